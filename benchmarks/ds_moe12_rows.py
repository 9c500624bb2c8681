"""DeepSpeed ZeRO-1/2 on transformers' mixture-of-experts classes: re-measure the rows of
tests/test_deepspeed_moe12.py (gloo, N_d = 2, fp32, CPU) and print each rank's per-phase error against the
profile, or list the live storages at one rank's backward peak (the method that found the mechanisms in
engines/deepspeed/moe12_hooks.py; storages made in the step only: a peak where one made in an earlier step is
alive, or none was made yet, lists what was alive at the step's own largest moment).

    DS_ACCELERATOR=cpu python benchmarks/ds_moe12_rows.py rows [--families mixtral-wide,...]   # ~1 min a family
    DS_ACCELERATOR=cpu python benchmarks/ds_moe12_rows.py trace mixtral-wide 2 small [--dtype bf16] [--offload] [--nd 3]
    DS_ACCELERATOR=cpu python benchmarks/ds_moe12_rows.py buckets qwen2-moe-wide 2:300000,1o:300000 [--dtype bf16]
        [--nd 3] [--offload] [--ga 2] [--out tests/data/measured/deepspeed_moe12_qwen2.json]              # ~1 min

Real runs: never in CI (tests/test_deepspeed_moe12.py is predicted-only)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/test_deepspeed_moe12.py imports clicheck
os.environ.setdefault("DS_ACCELERATOR", "cpu")
PHASES = ("init", "forward", "backward", "optimizer_step")


def _files(tmp: Path) -> Path:
    """The four families' config.json files and the world's own (a 64-position tiny Llama) under ``tmp``."""
    from tests.test_deepspeed_moe import CONFIGS

    for name, cfg in CONFIGS.items():
        (tmp / f"{name}.json").write_text(json.dumps(cfg))
    llama = json.loads((ROOT / "tests" / "data" / "hf_configs" / "tiny-llama.json").read_text())
    (tmp / "world.json").write_text(json.dumps({**llama, "max_position_embeddings": 64}))
    return tmp


def rows(families: list[str], tmp: Path) -> None:
    """Every (stage, ZERO key) of RECORDED and FROM_HOOKS for ``families``: measured rows and errors per rank."""
    from tests.test_deepspeed_moe12 import FROM_HOOKS, RECORDED, ZERO
    from validate.engines.deepspeed_compare import ds_config, run_world, workload_for
    from zeroplan.engines import deepspeed as D

    for name in families:
        cases = sorted({(st, z) for n, st, z in (*RECORDED, *FROM_HOOKS) if n == name})
        configs = [ds_config(st, micro_batch=1, zero=ZERO[z], optimizer_params={"torch_adam": True}) for st, z in cases]
        path = str(tmp / f"{name}.json")
        ranks = run_world(configs, 2, model=str(tmp / "world.json"), steps=2, seq_len=64,
                          runs=[{"model": path, "hf": True}] * len(configs))  # fmt: skip
        workload = workload_for(path, 1, 64, 1, "none", hf=True)
        for (stage, zero), config, *by_rank in zip(cases, configs, *ranks):
            measured = [[r["peak_bytes_by_phase"][p] for p in PHASES] for r in by_rank]
            print(f"({name!r}, {stage}, {zero!r}): {measured},")
            for rank, row in enumerate(measured):
                settings = D.Settings.from_ds_config(config).model_copy(update={"rank": rank})
                (est,) = D.estimate(workload, 2, settings, stat_bytes=4)
                pred = est.peak.by_phase()
                print(f"    rank {rank}: " + "  ".join(f"{p} {(v - pred[p]) / v:+.4%} ({v - pred[p]:+,} B)"
                                                     for p, v in zip(PHASES, row)))  # fmt: skip


def buckets(name: str, cases: list[str], dtype: str, nd: int, tmp: Path, out: str | None,
            offload: bool = False, ga: int = 1) -> None:
    """``name`` at each case ``STAGE:BUCKET`` (``STAGE`` 2, or ``1o``: ZeRO-1 with ``overlap_comm``), ``dtype``, on
    ``nd`` gloo ranks in one world: each rank's measured row and error per phase; ``out``: the rows written as JSON
    (tests/data/measured/deepspeed_moe12*.json, predicted again by tests/test_deepspeed_moe12.py). ``offload``:
    ``offload_optimizer: cpu`` (DeepSpeedCPUAdam), predicted as a CPU run measures it (``one_memory``: the GPU
    moments plus the host bytes; tests/data/measured/deepspeed_moe_offload_hooks.json). ``ga``: the
    ``gradient_accumulation_steps`` G."""
    import subprocess

    import deepspeed
    import torch

    from tests.test_deepspeed_moe import CONFIGS
    from validate.engines.deepspeed_compare import ds_config, one_memory, run_world, workload_for
    from zeroplan.engines import deepspeed as D

    configs = []
    for case in cases:
        stage, bucket = case.split(":")
        zero = {"reduce_bucket_size": int(bucket), "allgather_bucket_size": int(bucket),
                **({"overlap_comm": True} if stage == "1o" else {}),
                **({"offload_optimizer": {"device": "cpu"}} if offload else {})}  # fmt: skip
        adam = None if offload else {"torch_adam": True}  # offload: DeepSpeedCPUAdam (engine.py zero_use_cpu_optimizer)
        configs.append({**ds_config(int(stage[0]), dtype, micro_batch=1, zero=zero, optimizer_params=adam),
                        "gradient_accumulation_steps": ga})  # fmt: skip
    path = str(tmp / f"{name}.json")
    ranks = run_world(configs, nd, model=str(tmp / "world.json"), steps=2, seq_len=64,
                      runs=[{"model": path, "hf": True}] * len(configs))  # fmt: skip
    workload = workload_for(path, 1, 64, ga, "none", hf=True)
    recorded = []
    for case, config, *by_rank in zip(cases, configs, *ranks):
        measured = [[r["peak_bytes_by_phase"][p] for p in PHASES] for r in by_rank]
        predicted = []
        print(f"{name} {dtype} N_d {nd} G {ga} {case}: {measured}")
        for rank, row in enumerate(measured):
            settings = D.Settings.from_ds_config(config).model_copy(update={"rank": rank})
            pred = one_memory(workload, nd, settings, 4) if offload else D.estimate(workload, nd, settings, stat_bytes=4)[
                0].peak.by_phase()
            predicted.append([pred[p] for p in PHASES])
            print(f"    rank {rank}: " + "  ".join(f"{p} {(v - pred[p]) / v:+.4%} ({v - pred[p]:+,} B)"
                                                 for p, v in zip(PHASES, row)), flush=True)  # fmt: skip
        recorded.append({"model": name, "hf_config": CONFIGS[name], "ds_config": config, "n_d": nd, "seq_len": 64,
                         "micro_batch": 1, "measured": measured, "predicted_when_recorded": predicted})  # fmt: skip
        if offload:  # tests/test_deepspeed_moe_opt.py's keys (``_predict``)
            recorded[-1].update(family=name, case=f"z{case.replace(':', '-')}-{dtype}{f'-g{ga}' * (ga > 1)}", nd=nd,
                                shapes=[[n, list(s)] for n, s in workload.shapes])
    if out:
        old = json.loads(Path(out).read_text())["rows"] if Path(out).exists() else []
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        doc = {"source": f"DS_ACCELERATOR=cpu python benchmarks/ds_moe12_rows.py buckets {name} {','.join(cases)} "
                         f"--dtype {dtype} --nd {nd}{' --offload' * offload}{f' --ga {ga}' * (ga > 1)} --out {out} (gloo, CPU; appended)",
               "zeroplan_commit": commit.strip(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
               "phases": list(PHASES), "rows": old + recorded}  # fmt: skip
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")


def _live_storage_mode(ignore: set, hook: dict):
    """A dispatch mode keeping the storages ops make that are still alive, and the list of them at their peak."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Live(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes, self.info, self.live, self.peak, self.at_peak, self.hook = {}, {}, 0, 0, [], None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                key = st.data_ptr()
                if key in self.sizes or key in ignore or st.nbytes() == 0:
                    continue
                where = [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[-8:-2]]
                self.sizes[key], self.info[key] = st.nbytes(), (st.nbytes(), str(func), tuple(t.shape), where)
                self.live += st.nbytes()
                weakref.finalize(st, self.free, key)
            if self.live > self.peak:
                self.peak, self.at_peak, self.hook = self.live, [self.info[k] for k in self.sizes], hook.get("param")
            return out

        def free(self, key):
            self.live -= self.sizes.pop(key, 0)
            self.info.pop(key, None)

    return Live()


def named_hooks(engine, opt) -> tuple[set, dict]:
    """The storages a listing leaves out (parameters and flat groups) and a dict whose ``"param"`` names the parameter
    whose gradient hook ran last (DeepSpeed's ``reduce_independent_p_g_buckets_and_remove_grads``, wrapped)."""
    ignore = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    ignore |= {g.untyped_storage().data_ptr() for g in getattr(opt, "bit16_groups_flat", [])}
    names, hook = {id(p): n for n, p in engine.module.named_parameters()}, {}
    if hasattr(opt, "reduce_independent_p_g_buckets_and_remove_grads"):
        reduce = opt.reduce_independent_p_g_buckets_and_remove_grads

        def named(param, *args):
            hook["param"] = names.get(id(param))
            return reduce(param, *args)

        opt.reduce_independent_p_g_buckets_and_remove_grads = named
    return ignore, hook


def second_backward_listing(engine, opt, batches, rank: int, nd: int, top: int, depth: int = 3) -> None:
    """Train two steps and print, rank by rank, the live storages made in the second step at its backward peak
    (``_live_storage_mode``: parameters and the flat groups excluded; the first step allocates the buckets), with
    the parameter whose gradient hook ran last (DeepSpeed's ``reduce_independent_p_g_buckets_and_remove_grads``:
    (param, i) at ZeRO-1/2, (param,) at ZeRO-3). The one trace routine of ds_moe12_rows.py, ds_moe_opt_rows.py and
    ds_head_bucket_rows.py."""
    import gc

    import torch.distributed as dist

    ignore, hook = named_hooks(engine, opt)
    gc.disable()
    for step in range(2):
        mode = _live_storage_mode(ignore, hook)
        with mode:
            loss = engine.module.loss(batches[step].pop(0))
            mode.peak = 0
            engine.backward(loss)
        del loss
        engine.step()
    for turn in range(nd):  # rank 0's listing, then rank 1's, ...
        if turn == rank:
            print(f"rank {rank}: backward peak {mode.peak:,} B of storages made in the step (parameters and flat "
                  f"groups excluded), in or after the gradient hook of {mode.hook}")
            for nbytes, func, shape, where in sorted(mode.at_peak, key=lambda x: -x[0])[:top]:
                print(f"    {nbytes:>10,}  {func:<40} {str(shape):<18} {' <- '.join(reversed(where[-depth:]))}",
                      flush=True)  # fmt: skip
        dist.barrier()


def _trace_rank(rank: int, name: str, stage: int, zero: str, port: int, tmp: str, top: int = 30,
                dtype: str = "fp32", offload: bool = False, nd: int = 2) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nd),
                      LOCAL_RANK=str(rank))  # fmt: skip
    import deepspeed

    from tests.test_deepspeed_moe12 import ZERO
    from validate.engines.deepspeed import _model_and_batches
    from validate.engines.deepspeed_compare import ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    build, batches = _model_and_batches(f"{tmp}/{name}.json", nd, rank, 1, 2, 64, hf=True)
    zero = ZERO[zero] if zero in ZERO else {"reduce_bucket_size": int(zero), "allgather_bucket_size": int(zero)}
    if offload:  # DeepSpeedCPUAdam (engine.py zero_use_cpu_optimizer)
        config = ds_config(stage, dtype, micro_batch=1, zero={**zero, "offload_optimizer": {"device": "cpu"}})
    else:
        config = ds_config(stage, dtype, micro_batch=1, zero=zero, optimizer_params={"torch_adam": True})
    engine, opt, _, _ = deepspeed.initialize(model=(model := build()), model_parameters=model.parameters(),
                                             config=config)  # fmt: skip
    second_backward_listing(engine, opt, batches, rank, nd, top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rows")
    r.add_argument("--families", default="mixtral-wide,qwen3-moe-wide,qwen2-moe-wide,deepseek-wide")
    b = sub.add_parser("buckets")
    b.add_argument("name")
    b.add_argument("cases", help="comma-separated STAGE:BUCKET, STAGE 2 or 1o (ZeRO-1 with overlap_comm)")
    b.add_argument("--dtype", default="fp32")
    b.add_argument("--nd", type=int, default=2)
    b.add_argument("--out", help="append the rows to this JSON file")
    b.add_argument("--offload", action="store_true", help="offload_optimizer: cpu (DeepSpeedCPUAdam)")
    b.add_argument("--ga", type=int, default=1, help="gradient_accumulation_steps G")
    t = sub.add_parser("trace")
    t.add_argument("name")
    t.add_argument("stage", type=int)
    t.add_argument("zero", help="a key of tests/test_deepspeed_moe12.py ZERO, or a bucket size in elements")
    t.add_argument("--top", type=int, default=30, help="list this many of the largest live storages")
    t.add_argument("--dtype", default="fp32")
    t.add_argument("--offload", action="store_true", help="offload_optimizer: cpu (DeepSpeedCPUAdam)")
    t.add_argument("--nd", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        _files(Path(tmp))
        if args.cmd == "rows":
            rows(args.families.split(","), Path(tmp))
        elif args.cmd == "buckets":
            buckets(args.name, args.cases.split(","), args.dtype, args.nd, Path(tmp), args.out, args.offload, args.ga)
        else:
            import torch.multiprocessing as mp

            port = 29500 + os.getpid() % 1000
            mp.spawn(_trace_rank, args=(args.name, args.stage, args.zero, port, tmp, args.top, args.dtype,
                                        args.offload, args.nd), nprocs=args.nd)


if __name__ == "__main__":
    main()
