"""DeepSpeed's ``BF16_Optimizer`` (bf16, ``data_types.grad_accum_dtype`` fp32, ZeRO-0/1) and optimizer offload
(``offload_optimizer: cpu``, ZeRO-1/2) on transformers' mixture-of-experts classes (issue 19): real runs (gloo,
N_d = 2, both ranks, CPU) against the profile, each rank's per-phase error (what a CPU run measures: the GPU moments
plus the host bytes, ``deepspeed_compare.one_memory``), and the rows as JSON for tests/data/measured/.

    DS_ACCELERATOR=cpu python benchmarks/ds_moe_opt_rows.py bf16opt [--families mixtral-wide,...] [--out FILE]
    DS_ACCELERATOR=cpu python benchmarks/ds_moe_opt_rows.py offload [--families ...] [--cases=-small] [--out FILE]
    DS_ACCELERATOR=cpu python benchmarks/ds_moe_opt_rows.py offload16 [--families ...] [--out FILE]   (fp16)
    DS_ACCELERATOR=cpu python benchmarks/ds_moe_opt_rows.py nvme3 [--families ...] [--out FILE]   (async_io stand-in)
    DS_ACCELERATOR=cpu python benchmarks/ds_moe_opt_rows.py nvme16 [--families ...] [--out FILE]  (the same, fp16)
    ... [--nd 3]: N_d ranks (default 2); --families also takes config.json paths (a dense model: nvme3 --cases nvme-opt)

Real runs: never in CI (tests/test_deepspeed_moe_opt.py predicts the recorded rows again)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
PHASES = ("init", "forward", "backward", "optimizer_step")
SMALL = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000}
FAMILIES = "mixtral-wide,qwen3-moe-wide,qwen2-moe-wide,deepseek-wide"
NVME_FOLDER = "/tmp/zeroplan-moe-nvme"  # the stand-in's files (nvme3), emptied before each world: one nvme3 at a time


def cases(kind: str) -> list[tuple[str, dict]]:
    """(label, ds_config) of each measured row of ``kind``."""
    from validate.engines.deepspeed_compare import ds_config

    if kind == "bf16opt":  # engine.py _configure_bf16_optimizer: bf16 with fp32 gradient accumulation at ZeRO-0/1
        return [(f"z{st}-{b}", ds_config(st, "bf16", micro_batch=1, zero=z, optimizer_params={"torch_adam": True},
                                         grad_accum_dtype="fp32"))
                for st in (1,) for b, z in (("default", {}), ("small", SMALL))]  # fmt: skip
    off = {"offload_optimizer": {"device": "cpu"}}  # DeepSpeedCPUAdam (engine.py zero_use_cpu_optimizer)
    if kind == "ga2":  # two micro-steps per step, the given runs' one-bucket cases
        configs = [("z1-bf16opt-ga2", ds_config(1, "bf16", micro_batch=1, optimizer_params={"torch_adam": True},
                                                grad_accum_dtype="fp32")),
                   *((f"z{st}-bf16-default-ga2", ds_config(st, "bf16", micro_batch=1, zero=off)) for st in (1, 2))]
        return [(label, {**c, "gradient_accumulation_steps": 2}) for label, c in configs]
    if kind in ("nvme3", "nvme16"):  # ZeRO-Infinity at ZeRO-3, DeepSpeed's buckets; async_io replaced (_nvme_world)
        nvme, dt = {"device": "nvme", "nvme_path": NVME_FOLDER}, "bf16" if kind == "nvme3" else "fp16"
        param = {**nvme, "buffer_size": 1_100_000}  # as test_engine_offload_nvme_param.py ROWS (the default locks 1 GB)
        zeros = {"nvme-opt": {"offload_optimizer": nvme}, "param-cpu": {**off, "offload_param": {"device": "cpu"}},
                 "nvme-param": {**off, "offload_param": param}}  # fmt: skip
        return [(f"z3-{dt}-{k}", ds_config(3, dt, micro_batch=1, zero=z)) for k, z in zeros.items()
                if kind == "nvme3" or k != "param-cpu"]  # fp16: the NVMe rows (param-cpu: offload16's kind)
    if kind == "offload16":  # fp16 (DeepSpeedZeroOptimizer / stage3 with the loss scaler), ZeRO-1/2 and ZeRO-3
        from hf_saved import DS_SMALL

        z12 = [(f"z{st}-fp16-{b}", ds_config(st, "fp16", micro_batch=1, zero={**z, **off}))
               for st in (1, 2) for b, z in (("default", {}), ("small", SMALL))]  # fmt: skip
        return z12 + [(f"z3-fp16-{b}", ds_config(3, "fp16", micro_batch=1, zero={**z, **off}))
                      for b, z in (("default", {}), ("small", DS_SMALL))]  # fmt: skip
    if kind == "offload3":  # ZeRO-3 as tests/test_deepspeed_moe.py measures it ("small": tests/hf_saved.py DS_SMALL)
        from hf_saved import DS_SMALL

        return [(f"z3-{dt}-{b}", ds_config(3, dt, micro_batch=1, zero={**z, **off}))
                for dt in ("bf16", "fp32") for b, z in (("default", {}), ("small", DS_SMALL))]  # fmt: skip
    return [(f"z{st}-{dt}-{b}", ds_config(st, dt, micro_batch=1, zero={**z, **off}))
            for dt in ("bf16", "fp32") for st in (1, 2) for b, z in (("default", {}), ("small", SMALL))]  # fmt: skip


def _dump(d: dict) -> str:
    """``d`` as JSON, one line per key of the header and of each row (the files stay small and diffable)."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in d.items() if k != "rows"]
    rows = ["  {\n" + ",\n".join(f"   {json.dumps(k)}: {json.dumps(v)}" for k, v in r.items()) + "\n  }"
            for r in d["rows"]]
    return "\n".join(["{", *head, ' "rows": [']) + "\n" + ",\n".join(rows) + "\n ]\n}\n"


def measure(kind: str, families: list[str], tmp: Path, out: Path | None, only: str = "", nd: int = 2) -> None:
    from ds_moe12_rows import _files
    from validate.engines.deepspeed_compare import one_memory, refuse_skipped_steps, run_world, workload_for
    from zeroplan.engines import deepspeed as D

    import deepspeed
    import torch

    _files(tmp)
    rows = []
    for name in families:
        labelled = [(label, c) for label, c in cases(kind) if only in label]
        path = name if name.endswith(".json") else str(tmp / f"{name}.json")  # a family, or a config.json's path
        if kind in ("nvme3", "nvme16"):
            ranks = _nvme_world([c for _, c in labelled], path, tmp, nd)
        else:
            ranks = run_world([c for _, c in labelled], nd, model=str(tmp / "world.json"), steps=2, seq_len=64,
                              runs=[{"model": path, "hf": True}] * len(labelled))  # fmt: skip
        for (label, config), *by_rank in zip(labelled, *ranks):
            workload = workload_for(path, 1, 64, config["gradient_accumulation_steps"], "none", hf=True)
            refuse_skipped_steps(config, list(by_rank))  # fp16: a step the loss scaler skipped is not measured
            measured = [[r["peak_bytes_by_phase"][p] for p in PHASES] for r in by_rank]
            predicted = []
            print(f"{name} {label}: {measured}", flush=True)
            for rank, row in enumerate(measured):
                settings = D.Settings.from_ds_config(config).model_copy(update={"rank": rank})
                pred = one_memory(workload, nd, settings, 4)
                predicted.append([pred[p] for p in PHASES])
                print(f"    rank {rank}: " + "  ".join(f"{p} {(v - pred[p]) / v:+.4%} ({v - pred[p]:+,} B)"
                                                     for p, v in zip(PHASES, row)), flush=True)  # fmt: skip
            rows.append({"family": Path(name).stem, "case": label, "nd": nd, "ds_config": config,
                         "hf_config": json.loads(Path(path).read_text()),
                         "shapes": [[n, list(s)] for n, s in workload.shapes],
                         "measured": measured, "predicted_when_recorded": predicted,
                         **({"nvme": [r["nvme"] for r in by_rank]} if "nvme" in by_rank[0] else {})})
    if out is not None:
        out.write_text(_dump({
            "engine": "deepspeed",
            "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "zeroplan_commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                              text=True).stdout.strip(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "device": "cpu", "backend": "gloo",
            "command": f"DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/ds_moe_opt_rows.py {kind} --nd {nd}",
            "run": f"validate.engines.deepspeed_compare.run_world(configs, {nd}, model=<64-position tiny-llama>, steps=2, "
                   "seq_len=64, runs=[{'model': hf_config, 'hf': True}]); peak bytes [init, forward, backward, "
                   "optimizer_step] per rank",
            "rows": rows}))  # fmt: skip


def _nvme_rank(rank: int, port: int, configs: list[dict], path: str, out: str, nd: int = 2) -> None:
    """One rank of ``_nvme_world``: as the validator's rank (validate/engines/deepspeed.py ``main``: one intra-op
    thread, deepspeed_shm_comm never built, gloo, fp16 on CPU, ``measure`` each config), DeepSpeed's ``async_io`` op replaced by
    synchronous file reads and writes (tests/test_engine_offload_nvme.py ``_install_standin``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nd),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")  # fmt: skip
    import deepspeed
    import deepspeed.ops
    import torch
    from test_engine_offload_nvme import _install_standin
    from validate.engines.deepspeed import _model_and_batches, measure
    from validate.engines.deepspeed_changes import fp16_on_cpu

    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    stats = {"locked": [], "read": 0, "write": 0}
    _install_standin(stats)
    rows = []
    for config in configs:
        stats.update(locked=[], read=0, write=0)
        model_fn, batches = _model_and_batches(path, nd, rank, 1, 2, 64, hf=True)
        with fp16_on_cpu(config):  # as the validator's rank runs an fp16 config (validate/engines/deepspeed.py main)
            row = measure(model_fn, config, batches, rank, nd)
        rows.append({k: row[k] for k in ("rank", "peak_bytes_by_phase", "steps_applied")} | {"nvme": dict(stats)})
    Path(f"{out}.{rank}").write_text(json.dumps(rows))


def _nvme_world(configs: list[dict], path: str, tmp: Path, nd: int = 2) -> list[list[dict]]:
    """Per rank, the rows of ``configs`` on the transformers model ``path`` (``nd`` processes and ranks, two steps of
    64 positions), NVMe offload through the stand-in (``_nvme_rank``)."""
    import shutil

    import torch.multiprocessing as mp

    shutil.rmtree(NVME_FOLDER, ignore_errors=True)
    out = str(tmp / "nvme_rows")
    mp.spawn(_nvme_rank, args=(29500 + os.getpid() % 1000, configs, path, out, nd), nprocs=nd)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(nd)]


def _trace_rank(rank: int, name: str, kind: str, label: str, port: int, tmp: str, top: int, nd: int = 2) -> None:
    """One rank of ``trace``: the live storages made in the second step at its backward peak (parameters and the
    flat groups excluded; ds_moe12_rows.py ``_live_storage_mode``), with the parameter whose hook ran last."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nd),
                      LOCAL_RANK=str(rank))  # fmt: skip
    import deepspeed
    from ds_moe12_rows import second_backward_listing
    from validate.engines.deepspeed import _model_and_batches

    if kind == "nvme3":  # as _nvme_rank: async_io replaced by files
        import deepspeed.ops
        from test_engine_offload_nvme import _install_standin

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        _install_standin({"locked": [], "read": 0, "write": 0})
    deepspeed.init_distributed(dist_backend="gloo")
    config = dict(cases(kind))[label]
    build, batches = _model_and_batches(f"{tmp}/{name}.json", nd, rank, 1, 2, 64, hf=True)
    engine, opt, _, _ = deepspeed.initialize(model=(model := build()), model_parameters=model.parameters(),
                                             config=config)  # fmt: skip
    second_backward_listing(engine, opt, batches, rank, nd, top, depth=4)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("bf16opt", "offload", "offload3", "offload16", "nvme3", "nvme16", "ga2"))
    parser.add_argument("--nd", type=int, default=2, help="data-parallel ranks")
    parser.add_argument("--families", default=FAMILIES)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cases", default="", help="only the cases whose label holds this (e.g. -small)")
    parser.add_argument("--trace", default=None, help="FAMILY:CASE: list the live storages at its backward peak")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.trace is None:
            measure(args.kind, args.families.split(","), Path(tmp), args.out, args.cases, args.nd)
            return
        import torch.multiprocessing as mp
        from ds_moe12_rows import _files

        _files(Path(tmp))
        name, label = args.trace.split(":")
        mp.spawn(_trace_rank, args=(name, args.kind, label, 29500 + os.getpid() % 1000, tmp, args.top, args.nd),
                 nprocs=args.nd)


if __name__ == "__main__":
    main()
