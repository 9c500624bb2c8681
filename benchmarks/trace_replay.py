"""The FSDP2 plan's winner: its allocation trace (``Engine.alloc_trace``: ``allocator/step_trace.py``) and its replay
(``allocator/reserved.py reserved_of``), timed in process apart from the rest of the plan.

Runs ``zeroplan plan --engine fsdp2 --model llama3-405b --gpu h100-80gb --gpus N`` in this process (its output
dropped), keeps the arguments of the trace the plan builds (the winner's: ``planning/engine_plan.py``), then builds
that trace and replays it REPEATS times, the cyclic collector off as in the CLI, and prints the least and the
median CPU time (``time.process_time``) of each. ``--what build|both``: with ``REPEATS`` 1 and 0 under
``valgrind --tool=cachegrind``, the difference of the two counts is one build (``build``) or one build and one
replay (``both``); the plan's own trace is built and replayed in both runs.

Run: python benchmarks/trace_replay.py [REPEATS] [--gpus N] [--what build|both]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import os
import statistics
import sys
import time


def captured_trace_inputs(gpus: int) -> tuple:
    """The arguments of the one trace ``zeroplan plan --engine fsdp2`` builds on ``gpus`` GPUs, and the engine's
    own ``alloc_trace``."""
    import zeroplan.cli as cli
    import zeroplan.engines as engines

    engine = engines.get_engine("fsdp2")
    calls: list[tuple] = []

    def kept(*args):
        calls.append(args)
        return engine.alloc_trace(*args)

    engines.REGISTRY["fsdp2"] = dataclasses.replace(engine, alloc_trace=kept)
    args = ["plan", "--engine", "fsdp2", "--model", "llama3-405b", "--gpu", "h100-80gb", "--gpus", str(gpus)]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            cli.app_for(args)(args)
    finally:
        engines.REGISTRY["fsdp2"] = engine
    if len(calls) != 1:
        raise SystemExit(f"expected the plan to build one trace, it built {len(calls)}")
    return calls[0], engine.alloc_trace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repeats", nargs="?", type=int, default=15)
    parser.add_argument("--gpus", type=int, default=2048)
    parser.add_argument("--what", choices=("build", "both"), default="both")
    opts = parser.parse_args()
    inputs, alloc_trace = captured_trace_inputs(opts.gpus)
    from zeroplan.allocator.reserved import reserved_of

    gc.disable()  # as ``zeroplan.cli.main`` for a plan
    builds, replays = [], []
    for _ in range(opts.repeats):
        start = time.process_time()
        (trace,) = alloc_trace(*inputs)
        builds.append(time.process_time() - start)
        if opts.what == "both":
            start = time.process_time()
            reserved = reserved_of(trace)
            replays.append(time.process_time() - start)
    if builds:
        print(f"{len(trace.events)} events; trace: least {min(builds) * 1e3:.1f} ms, median "
              f"{statistics.median(builds) * 1e3:.1f} ms", end="")  # fmt: skip
        if replays:
            print(f"; replay: least {min(replays) * 1e3:.1f} ms, median {statistics.median(replays) * 1e3:.1f} ms "
                  f"(reserved {reserved.reserved_bytes:,} B)", end="")  # fmt: skip
        print()
    sys.stdout.flush()
    os._exit(0)  # no teardown of the traces kept: the instruction counts are the work alone


if __name__ == "__main__":
    main()
