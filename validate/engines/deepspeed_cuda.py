"""Real DeepSpeed ZeRO 1-3 on CUDA: the rows of ``zeroplan validate --engine deepspeed`` on a GPU machine, measured
by the caching allocator instead of the CPU accelerator's MemTracker (issue 21, "Recorded truth").

The rank side (``rank_main``, reached from ``validate.engines.deepspeed.main`` when the run's device resolves to
CUDA, ``on_cuda``): ``DS_ACCELERATOR=cuda``, one GPU per rank (``LOCAL_RANK``), ``deepspeed.init_distributed`` on
NCCL, the model built in fp32 on the CPU as users do (``deepspeed.initialize`` moves it), each micro-batch moved to
the GPU as the step takes it (``_OnDevice``: never alive before its step, as on CPU), and ``measure`` with the CUDA
``MemoryProbe``: per phase ``max_memory_allocated`` (less what was allocated before the row) and
``max_memory_reserved`` (reset per phase and per row; ``measured_reserved_bytes_by_phase``). Every ds_config gets
``optimizer.params.torch_adam: true`` (``torch_adam_configs``): torch's Adam, so that no DeepSpeed op is JIT-built
on the GPU machine (``fused_adam`` without offload; with ``offload_optimizer`` torch's Adam steps on the host instead
of ``DeepSpeedCPUAdam``'s ``cpu_adam``), the optimizer the profile models for ``torch_adam``.

The parent side (``deepspeed_compare.predicted_reserved``, called by its ``compare_row`` for a CUDA row): the profile's
allocation trace (``zeroplan.engines.deepspeed.alloc_trace``) replayed through the allocator model under this
process's ``PYTORCH_CUDA_ALLOC_CONF`` (the ranks inherit it), ``predicted_reserved_bytes_by_phase``. On CUDA the GPU
and the host are two memories: the allocator counts the GPU alone, so an offload row is compared with the profile's
GPU peak (its host terms are not added, unlike the CPU runner's one memory).

Testable without a GPU: ``on_cuda``, ``torch_adam_configs``, ``check_gpus``, the parent's ``predicted_reserved``,
the readings' post-processing (``_fold_build``, ``without_workspaces``) and the parent's comparison of a CUDA row
(tests/test_offload_deepspeed_cuda.py); the rank side runs in validate/gpu_check.sh.
"""

from __future__ import annotations

import copy
import json
import os

CUDA_BUILD_KEY = "reserved_bytes.peak.build"
"""The probe's reserved peak of the model's construction (``measure``'s "build" phase), folded into init's."""


def on_cuda(config_json: str, cuda_available: bool | None = None) -> bool:
    """Whether the run of ``config_json`` (a ``ValidateConfig``) trains on CUDA: ``--device cuda``, or ``auto`` where
    a GPU is visible; ValueError (one line) for ``--device cuda`` without one."""
    device = json.loads(config_json).get("device", "auto")
    if device == "cpu":
        return False
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if device == "cuda" and not cuda_available:
        raise ValueError("--device cuda: no CUDA GPU visible (DeepSpeed's CUDA runner); use --device cpu")
    return bool(cuda_available)


def check_gpus(world_size: int, gpus: int) -> None:
    """ValueError (one line) unless every rank has its own GPU (NCCL: one device per rank)."""
    if world_size > gpus:
        raise ValueError(f"DeepSpeed on CUDA: world size {world_size} needs {world_size} GPUs, {gpus} visible; "
                         "run world size 1 per GPU, or --device cpu")  # fmt: skip


def torch_adam_configs(configs: list[dict]) -> list[dict]:
    """Each ds_config with ``optimizer.params.torch_adam: true`` (copies; an optimizer type other than Adam/AdamW is
    refused: only Adam has a torch path that builds no op)."""
    out = []
    for ds in configs:
        ds = copy.deepcopy(ds)
        opt = ds.setdefault("optimizer", {"type": "Adam", "params": {}})
        if str(opt.get("type", "")).lower() not in ("adam", "adamw"):
            raise ValueError(f"optimizer.type={opt.get('type')!r}: the CUDA runner trains with torch's Adam "
                             "(torch_adam: true, no DeepSpeed op built); give Adam or AdamW")  # fmt: skip
        opt.setdefault("params", {})["torch_adam"] = True
        out.append(ds)
    return out


class _OnDevice(list):
    """A step's micro-batches, each moved to the GPU when the step pops it (``measure`` pops them in order)."""

    def pop(self, index=-1):  # noqa: D401 - list's own signature
        return tuple(t.to("cuda", non_blocking=False) for t in super().pop(index))


def _cuda_probe():
    """The CUDA ``MemoryProbe`` with the per-device split ``measure`` records (the GPU's live bytes)."""
    import torch

    from validate.probes import MemoryProbe

    class CudaMemoryProbe(MemoryProbe):
        def by_device(self) -> dict[str, int]:
            return {f"cuda:{torch.cuda.current_device()}": self.current_bytes()}

    return CudaMemoryProbe(torch.device("cuda"))


def _fold_build(row: dict) -> dict:
    """The build phase's reserved peak kept within init's, as ``measure`` keeps its allocated peak."""
    b = dict(row["probe_breakdown"])
    build = b.pop(CUDA_BUILD_KEY, None)
    if build is not None:
        key = CUDA_BUILD_KEY.replace("build", "init")
        b[key] = max(b.get(key, 0), build)
    return {**row, "probe_breakdown": b}


def without_workspaces(row: dict, workspace_bytes: int) -> dict:
    """The step boundaries less the cuBLAS workspaces (made by the first matmul, kept for the run: not model states),
    as the FSDP2 and reference runners subtract them (``MemoryProbe.release_workspaces``); init's reading has none.
    The phases' peaks keep them, as an unprobed run holds them."""
    boundary = {k: b if k == "init" else b - workspace_bytes for k, b in row["boundary_bytes"].items()}
    return {**row, "boundary_bytes": boundary, "library_workspace_bytes": workspace_bytes}


def _release_workspaces() -> int:
    """The bytes the cuBLAS workspaces held, freed (after ``measure``: the engine is gone, the workspaces stay)."""
    import torch

    from validate.probes import _clear_cublas_workspaces

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    _clear_cublas_workspaces()
    return before - torch.cuda.memory_allocated()


def rank_main(args, model_and_batches, measure) -> None:
    """One rank on CUDA (``args``: ``validate.engines.deepspeed.main``'s parsed arguments; ``model_and_batches``
    (``case_model_and_batches``) and ``measure``: that runner's, passed in so that this module does not import it
    back): every ds_config of ``--configs`` (default ``run_configs``) with torch's Adam, rank 0 writing every
    rank's rows to ``--out``."""
    os.environ["DS_ACCELERATOR"] = "cuda"
    import deepspeed
    import torch
    import torch.distributed as dist

    from validate.config import ValidateConfig
    from validate.engines.deepspeed_changes import runner_changes
    from validate.engines.deepspeed_compare import run_configs
    from zeroplan.files import write_text_atomic

    config = ValidateConfig.model_validate_json(args.config)
    check_gpus(int(os.environ.get("WORLD_SIZE", "1")), torch.cuda.device_count())
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl")
    rank, nd = dist.get_rank(), dist.get_world_size()
    configs = torch_adam_configs(json.loads(args.configs) if args.configs else run_configs(config, nd))
    runs = json.loads(args.runs) if args.runs else [{}] * len(configs)
    rows = []
    for ds, run in zip(configs, runs):
        model_fn, batches = model_and_batches(config, ds, run, nd, rank)
        row = measure(model_fn, ds, [_OnDevice(b) for b in batches], rank, nd,
                      bool(run.get("zero_init", config.zero_init)), settle=False, probe=_cuda_probe())  # fmt: skip
        row = without_workspaces(_fold_build(row), _release_workspaces())
        row = {**row, "device": "cuda", "backend": "nccl", "fp16_capability_overridden": False}
        rows.append({**row, "runner_changes": [*runner_changes(row), "optimizer.params.torch_adam: true (torch's "
                                               "Adam: no DeepSpeed op built on the GPU machine; deepspeed_cuda)"]})
    everyone = [None] * nd if rank == 0 else None
    dist.gather_object(rows, everyone, dst=0)
    if rank == 0:
        meta = {"world_size": nd, "backend": "nccl", "device": "cuda", "torch": torch.__version__,
                "cuda_capability": list(torch.cuda.get_device_capability())}  # fmt: skip
        write_text_atomic(args.out, json.dumps({"meta": meta, "ranks": everyone}))
    dist.barrier()
    dist.destroy_process_group()
