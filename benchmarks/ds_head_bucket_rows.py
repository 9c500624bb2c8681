"""DeepSpeed ZeRO-1/2 with an untied head's gradient larger than the reduce bucket (issue 17): measure the rows of
tests/test_deepspeed_head_bucket.py beyond its first eight (GPT-2's LayerNorm final norm, bf16, N_d = 3; gloo, CPU)
and print each rank's per-phase error against the profile, or list the live storages at one rank's backward peak
(benchmarks/ds_moe12_rows.py's dispatch mode).

    DS_ACCELERATOR=cpu python benchmarks/ds_head_bucket_rows.py rows --nd 2 --cases gpt2-untied:2:fp32,...
    DS_ACCELERATOR=cpu python benchmarks/ds_head_bucket_rows.py trace gpt2-untied 2 fp32 --nd 2

A case is NAME:STAGE:DTYPE, NAME a key of tests/test_deepspeed_head_bucket.py CONFIGS (its bucket: BUCKETS).
Real runs: never in CI (the test is predicted-only)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
PHASES = ("init", "forward", "backward", "optimizer_step")


def _files(tmp: Path) -> None:
    """The cases' config.json files and the world's own (a 64-position tiny Llama) under ``tmp``."""
    from tests.test_deepspeed_head_bucket import CONFIGS

    for name, cfg in CONFIGS.items():
        (tmp / f"{name}.json").write_text(json.dumps(cfg))
    llama = json.loads((ROOT / "tests" / "data" / "hf_configs" / "tiny-llama.json").read_text())
    (tmp / "world.json").write_text(json.dumps({**llama, "max_position_embeddings": 64}))


def _config(stage: int, dtype: str, bucket: int) -> dict:
    from validate.engines.deepspeed_compare import ds_config

    zero = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    zero |= {"overlap_comm": True} if stage == 1 else {}
    return ds_config(stage, dtype, micro_batch=1, zero=zero, optimizer_params={"torch_adam": True})


def rows(cases: list[tuple[str, int, str]], nd: int, tmp: Path) -> None:
    """Measured rows of ``cases`` in one world of ``nd`` ranks, and each rank's error per phase."""
    from tests.test_deepspeed_head_bucket import BUCKETS
    from validate.engines.deepspeed_compare import run_world, workload_for
    from zeroplan.engines import deepspeed as D

    configs = [_config(stage, dtype, BUCKETS[name]) for name, stage, dtype in cases]
    runs = [{"model": str(tmp / f"{name}.json"), "hf": True} for name, _, _ in cases]
    ranks = run_world(configs, nd, model=str(tmp / "world.json"), steps=2, seq_len=64, runs=runs)
    for (name, stage, dtype), config, run, *by_rank in zip(cases, configs, runs, *ranks):
        measured = [[r["peak_bytes_by_phase"][p] for p in PHASES] for r in by_rank]
        print(f"({name!r}, {stage}, {dtype!r}, {nd}): {measured},", flush=True)
        workload = workload_for(run["model"], 1, 64, 1, "none", hf=True)
        for rank, row in enumerate(measured):
            settings = D.Settings.from_ds_config(config).model_copy(update={"rank": rank})
            (est,) = D.estimate(workload, nd, settings, stat_bytes=4)
            pred = est.peak.by_phase()
            print(f"    rank {rank}: " + "  ".join(f"{p} {(v - pred[p]) / v:+.4%} ({v - pred[p]:+,} B)"
                                                 for p, v in zip(PHASES, row)), flush=True)  # fmt: skip


def _trace_rank(rank: int, name: str, stage: int, dtype: str, nd: int, port: int, tmp: str, top: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nd),
                      LOCAL_RANK=str(rank))  # fmt: skip
    import deepspeed
    from ds_moe12_rows import second_backward_listing

    from tests.test_deepspeed_head_bucket import BUCKETS
    from validate.engines.deepspeed import _model_and_batches

    deepspeed.init_distributed(dist_backend="gloo")
    build, batches = _model_and_batches(f"{tmp}/{name}.json", nd, rank, 1, 2, 64, hf=True)
    engine, opt, _, _ = deepspeed.initialize(model=(model := build()), model_parameters=model.parameters(),
                                             config=_config(stage, dtype, BUCKETS[name]))  # fmt: skip
    second_backward_listing(engine, opt, batches, rank, nd, top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rows")
    r.add_argument("--cases", required=True, help="NAME:STAGE:DTYPE,...")
    r.add_argument("--nd", type=int, default=2)
    t = sub.add_parser("trace")
    t.add_argument("name")
    t.add_argument("stage", type=int)
    t.add_argument("dtype")
    t.add_argument("--nd", type=int, default=2)
    t.add_argument("--top", type=int, default=30, help="list this many of the largest live storages")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        _files(Path(tmp))
        if args.cmd == "rows":
            cases = [(n, int(s), d) for n, s, d in (c.split(":") for c in args.cases.split(","))]
            rows(cases, args.nd, Path(tmp))
        else:
            import torch.multiprocessing as mp

            port = 29500 + os.getpid() % 1000
            mp.spawn(_trace_rank, args=(args.name, args.stage, args.dtype, args.nd, port, tmp, args.top),
                     nprocs=args.nd)


if __name__ == "__main__":
    main()
