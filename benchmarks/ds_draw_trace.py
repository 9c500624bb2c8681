"""A DeepSpeed draw of the differential matrix traced: its model and ds_config (``validate.engines.differential.draw``),
optionally changed, trained two steps on its N_d gloo ranks as the runner trains it (``engine.module.loss(batch,
forward=engine)``, ``engine.backward``, ``engine.step`` every micro-step), printing each micro-step's forward and
backward peak of the storages made or first touched while training (``ds_moe12_rows._live_storage_mode``: the
partitions and Adam's states count once an op touches them) and rank 0's storages at the largest backward peak.
The trace that found zero3_epilogue.py ``final_norm_hook`` (issue 17, seed 5 draw 6: 248,834,456 B at G = 2 and at
G = 1, the validator's MemTracker 248,834,713 B).

    DS_ACCELERATOR=cpu python benchmarks/ds_draw_trace.py 5 6 --generator 5 [--accum 1] [--no-zero-init] [--top 40]
        [--forward]

Real runs (~5 min for a 16M model at N_d = 3 on 2 shared cores): never in CI."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _draw(args: argparse.Namespace):
    from dataclasses import replace

    from validate.engines.differential import draw

    d = draw(args.seed, args.index, generator=args.generator)
    ds = {**d.ds_config, "gradient_accumulation_steps": args.accum or d.ds_config["gradient_accumulation_steps"]}
    return replace(d, ds_config=ds, zero_init=d.zero_init and not args.no_zero_init)


def _rank(rank: int, args: argparse.Namespace, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(_draw(args).nd),
                      LOCAL_RANK=str(rank))  # fmt: skip
    import importlib

    import deepspeed
    import torch.distributed as dist

    from ds_moe12_rows import _live_storage_mode
    from validate.engines.deepspeed import _model_and_batches, build_model

    d = _draw(args)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the runner (validate/engines/deepspeed.py main)
    deepspeed.init_distributed(dist_backend="gloo")
    # the model class imported before zero.Init patches torch's tensor constructors (torch._dynamo's check)
    importlib.import_module(f"transformers.models.{d.config['model_type']}.modeling_{d.config['model_type']}")
    accum = d.ds_config["gradient_accumulation_steps"]
    build, batches = _model_and_batches(path, d.nd, rank, d.micro_batch, 2, d.seq_len, accum, d.checkpointing, True)
    model = build_model(build, d.ds_config, d.zero_init)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=d.ds_config)
    del model
    gc.collect()
    gc.disable()
    mode, peaks = _live_storage_mode(set(), {}), []
    with mode:
        for step in range(2):
            for micro in range(accum):
                batch = batches[step].pop(0)
                mode.peak = 0
                loss = engine.module.loss(batch, forward=engine)
                forward, mode.peak = mode.peak, 0
                at_forward = sorted(mode.at_peak, key=lambda x: -x[0])[:args.top]
                engine.backward(loss)
                del loss
                listing = at_forward if args.forward else sorted(mode.at_peak, key=lambda x: -x[0])[:args.top]
                peaks.append((step, micro, forward, mode.peak, listing))
                engine.step()  # off the boundary it only counts the micro-step
                del batch
    if rank == 0:
        for step, micro, forward, backward, _ in peaks:
            print(f"step {step} micro-step {micro}: forward {forward:,} B, backward {backward:,} B")
        phase = "forward" if args.forward else "backward"
        step, micro, forward, backward, listing = max(peaks, key=lambda p: p[2] if args.forward else p[3])
        print(f"rank 0's storages at the largest {phase} peak (step {step} micro-step {micro}, "
              f"{forward if args.forward else backward:,} B):")
        for nbytes, func, shape, where in listing:
            print(f"    {nbytes:>12,}  {func:<36} {str(shape):<16} {' <- '.join(reversed(where[-3:]))}", flush=True)
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("seed", type=int)
    parser.add_argument("index", type=int)
    parser.add_argument("--generator", type=int, default=1)
    parser.add_argument("--accum", type=int, default=None, help="gradient_accumulation_steps (default: the draw's)")
    parser.add_argument("--no-zero-init", action="store_true", help="build the model whole")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--forward", action="store_true", help="list the storages at the forward peak instead")
    args = parser.parse_args(argv)
    d = _draw(args)
    if d.engine != "deepspeed":
        parser.error(f"draw {d.name}: not a DeepSpeed draw")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(d.config))
        print(d.name, flush=True)
        mp.start_processes(_rank, args=(args, 29500 + os.getpid() % 400, str(path)), nprocs=d.nd, start_method="spawn")


if __name__ == "__main__":
    main()
