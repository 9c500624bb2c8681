"""List the live storages at each rank's backward peak of one DeepSpeed draw of the differential matrix (the
method of benchmarks/ds_moe12_rows.py: a dispatch mode keeping the storages ops make, parameters and flat groups
excluded), every micro-step of both steps (storages made since
``deepspeed.initialize`` and alive: Adam's states, buffers kept from earlier micro-steps), built and trained as validate/engines/deepspeed.py measures it
(zero.Init, transformers' checkpointing, accumulation, through ``DeepSpeedEngine.forward``).

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/differential_trace.py --seed 6 --generator 4 --index 4

A tracing run, not a measurement: the recorded bytes are validate/engines/differential.py ``run_draw``'s."""

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


def _listing(rank: int, label: str, peak: int, at_peak: list, hook, top: int, depth: int) -> None:
    print(f"rank {rank} {label}: peak {peak:,} B of the live storages the mode saw made (backward: parameters and "
          f"flat groups excluded), in or after the gradient hook of {hook}")  # fmt: skip
    for nbytes, func, shape, where in sorted(at_peak, key=lambda x: -x[0])[:top]:
        print(f"    {nbytes:>10,}  {func:<40} {str(shape):<18} {' <- '.join(reversed(where[-depth:]))}", flush=True)


def _trace_rank(rank: int, d_json: str, port: int, tmp: str, top: int, depth: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    import deepspeed
    import torch.distributed as dist

    from ds_moe12_rows import _live_storage_mode, named_hooks
    from validate.engines.deepspeed import _model_and_batches, build_model
    from validate.engines.differential import Draw

    d = Draw(**json.loads(d_json))
    os.environ["WORLD_SIZE"] = str(d.nd)
    path = Path(tmp) / "draw.json"
    path.write_text(json.dumps(d.config))
    deepspeed.init_distributed(dist_backend="gloo")
    accum = d.ds_config.get("gradient_accumulation_steps", 1)
    build, batches = _model_and_batches(str(path), d.nd, rank, d.micro_batch, 2, d.seq_len, accum, d.checkpointing, hf=True)
    init = _live_storage_mode(set(), {})  # the build and deepspeed.initialize: init's peak, every storage
    with init:
        model = build_model(build, d.ds_config, d.zero_init)
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=d.ds_config)
    del model
    ignore, hook = named_hooks(engine, opt)
    gc.disable()
    listings = []
    mode = _live_storage_mode(ignore, hook)  # one mode over the run: what every step made and still holds
    with mode:
        for step in range(2):
            for micro in range(accum):
                loss = engine.module.loss(batches[step].pop(0), forward=engine)
                mode.peak, mode.at_peak = 0, []
                engine.backward(loss)
                listings.append((f"step {step + 1} micro-step {micro + 1}", mode.peak, mode.at_peak, mode.hook))
                del loss
                engine.step()
            gc.collect()
    for turn in range(d.nd):
        if turn == rank:
            _listing(rank, "init (build, deepspeed.initialize)", init.peak, init.at_peak, None, top, depth)
            for listing in listings:
                _listing(rank, *listing, top, depth)
        dist.barrier()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--generator", type=int, default=4)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    from validate.engines.differential import draw

    d = draw(args.seed, args.index, None, args.generator)
    if d.engine != "deepspeed":
        sys.exit(f"draw {d.name} is not a DeepSpeed draw")
    from dataclasses import asdict

    print(d.name, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        port = 29500 + os.getpid() % 1000
        mp.spawn(_trace_rank, args=(json.dumps(asdict(d)), port, tmp, args.top, args.depth), nprocs=d.nd)


if __name__ == "__main__":
    main()
