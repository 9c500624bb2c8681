"""Log what ZeRO-3's parameter coordinator does, hook by hook, in real DeepSpeed (one rank's view).

Run under torchrun (``DS_ACCELERATOR=cpu``; what ``docs/engines/deepspeed.md`` "ZeRO-3: which parameters are
gathered when" measured, and ``tests/test_deepspeed_profile.py`` keeps)::

    PYTHONPATH=$PWD DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 \\
        -m validate.engines.deepspeed_coordinator_probe tests/data/hf_configs/tiny-llama.json \\
        '{"stage3_prefetch_bucket_size": 5000, "stage3_max_reuse_distance": 0}' out.json [hf]

It wraps ``PartitionedParameterCoordinator.fetch_sub_module``, ``release_sub_module`` and
``__all_gather_params_`` (runtime/zero/partitioned_param_coordinator.py) and, after every hook, reads the
gathered elements from the tensors themselves: the storages of the non-persistent parameters not
NOT_AVAILABLE and of the flat buffers of the coalesced all-gathers still in the inflight registry
(``AllGatherCoalescedHandle.partitions``), each counted once. Rank 0 writes ``{"log": [[step, op, module
or sizes, forward, gathered elements], ...], "params": [[name, ds_numel, ds_persist], ...]}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings


def main(argv: list[str]) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore")
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from validate.engines.deepspeed import _model_and_batches, ds_config

    model_name, zero, out = argv[0], json.loads(argv[1]), argv[2]
    hf = argv[3:] == ["hf"]  # a fourth argument ``hf``: transformers' model of the config (hf_builder)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, nd = dist.get_rank(), dist.get_world_size()
    zero = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000, "stage3_param_persistence_threshold": 100, **zero}
    config = ds_config(3, zero=zero, optimizer_params={"torch_adam": True})
    model_fn, batches = _model_and_batches(model_name, nd, rank, 2, 3, hf=hf)
    model = model_fn()
    names: dict[int, str] = {}
    log: list = []
    step = [-1]

    def gathered() -> int:
        storages = {}
        for p in model.parameters():
            if p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist and p.data.numel():
                st = p.data.untyped_storage()
                storages[st.data_ptr()] = st.nbytes() // p.data.element_size()
        registry = getattr(model, "ds_inflight_param_registry", {})
        for handle in {id(h): h for h in registry.values()}.values():
            for h in getattr(handle, "handles", [handle]):
                parts = getattr(h, "partitions", None)
                if parts:
                    st = parts[0].untyped_storage()
                    storages[st.data_ptr()] = st.nbytes() // parts[0].element_size()
        return sum(storages.values())

    C = ppc.PartitionedParameterCoordinator
    fetch, release = C.fetch_sub_module, C.release_sub_module
    all_gather = C._PartitionedParameterCoordinator__all_gather_params_

    def logged_fetch(self, module, forward):
        fetch(self, module, forward)
        log.append([step[0], "fetch", names.get(id(module), "?"), forward, gathered()])

    def logged_release(self, module, forward=False):
        release(self, module, forward)
        log.append([step[0], "release", names.get(id(module), "?"), forward, gathered()])

    def logged_all_gather(self, params, forward, quantize=False):
        sizes = sorted(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        log.append([step[0], "allgather", sizes, forward, None])
        return all_gather(self, params, forward, quantize)

    C.fetch_sub_module, C.release_sub_module = logged_fetch, logged_release
    C._PartitionedParameterCoordinator__all_gather_params_ = logged_all_gather
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    names.update({id(m): (n or "(root)") for n, m in model.named_modules()})
    for k in range(len(batches)):
        step[0] = k
        batch = batches[k].pop(0)
        loss = engine.module.loss(batch, forward=engine)  # as validate/engines/deepspeed.py measure
        log.append([k, "phase", "backward", None, gathered()])
        engine.backward(loss)
        engine.step()
    if rank == 0:
        params = [[n, p.ds_numel, bool(p.ds_persist)] for n, p in model.named_parameters()]
        with open(out, "w") as f:
            json.dump({"log": log, "params": params}, f)
    del engine
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
