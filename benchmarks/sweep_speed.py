"""How long a million-row sweep takes, in Python and written to a file by `zeroplan sweep`.

Targets (issue 9): `zeroplan sweep` of 1e6 rows to CSV within the time of `python -c "import torch"`
measured in the same run, with bounded memory (peak RSS); Parquet too. Also the capacity-planning
target: `zeroplan.sweep` of a million rows in about a second, against `zeroplan.estimate` in a loop.

Grid: 1000 Ψ values (1B to 1T, odd counts so padding matters) x 250 GPU counts (8 to 2000) x 4 stages
= 1,000,000 rows. The commands run as separate processes (`/usr/bin/time`-style: wall time, and peak
RSS from `resource.getrusage(RUSAGE_CHILDREN)` of a fresh child each time), so imports are counted as a
user sees them. Each is run REPEATS times, alternating; the median is shown, and the ratio to the torch
import is of CPU time (user + sys), which a loaded machine inflates far less than wall time.

Run: python benchmarks/sweep_speed.py [--cli-only]
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import zeroplan
from cli_latency import byte_compile  # benchmarks/ is on sys.path when run as a script
from zeroplan import sweep

N_PARAMS, N_GPUS, N_STAGES = 1000, 250, 4
LOOP_SAMPLE = 2000
REPEATS = 3
PARAMS = (np.linspace(1e9, 1e12, N_PARAMS).astype(np.int64) | 1).tolist()  # odd: padding everywhere
GPUS = list(range(8, 8 + 8 * N_GPUS, 8))

_CHILD = """
import resource, subprocess, sys, time
start = time.perf_counter()
subprocess.run(sys.argv[1:], check=True)
wall = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss)
"""


def run_once(argv: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + sys) and peak RSS (MiB) of one run of ``argv`` in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _CHILD, *argv], check=True, capture_output=True, text=True)
    wall, cpu, kib = out.stdout.split()
    return float(wall), float(cpu), int(kib) / 1024


def compare_cli(cli: list[str], grid: list[str]) -> None:
    """The CLI writing the grid as CSV and Parquet beside ``python -c 'import torch'``, alternating, each in a
    fresh process; ratios of CPU time (a shared machine inflates wall time far more)."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"python -c 'import torch'": ([sys.executable, "-c", "import torch"], None)}
        for name in ("sweep.csv", "sweep.parquet"):
            path = os.path.join(tmp, name)
            runs[f"zeroplan sweep --out {name}"] = ([*cli, *grid, "--out", path], path)
        samples: dict[str, list] = {what: [] for what in runs}
        for _ in range(REPEATS):  # alternating, so a change in the machine's load hits every command alike
            for what, (argv, _) in runs.items():
                samples[what].append(run_once(argv))
        times = {what: (statistics.median(w for w, _, _ in s), statistics.median(c for _, c, _ in s),
                        max(r for _, _, r in s)) for what, s in samples.items()}  # fmt: skip
        sizes = {what: os.path.getsize(path) for what, (_, path) in runs.items() if path is not None}
    print(f"\nin separate processes, median of {REPEATS} (peak RSS: the largest of the runs):")
    torch_cpu = times["python -c 'import torch'"][1]
    for what, (wall, cpu, rss) in times.items():
        extra = ""
        if what in sizes:
            extra = f", {sizes[what] / 1e6:.0f} MB written, {cpu / torch_cpu:.2f}x the torch import (CPU)"
        print(f"  {what:38s} CPU {cpu:6.2f} s  wall {wall:6.2f} s  peak RSS {rss:5.0f} MiB{extra}")


def main() -> None:
    byte_compile()
    if "--cli-only" in sys.argv:  # the command's targets alone (issue 16), without the in-process timings
        cli = [sys.executable, "-c", "from zeroplan.cli import main; main()", "sweep"]
        compare_cli(cli, ["--params", ",".join(map(str, PARAMS)), "--gpus", ",".join(map(str, GPUS))])
        return
    sweep(PARAMS[:10], GPUS[:10])  # warm up imports and pydantic validators
    walls = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        frame = sweep(PARAMS, GPUS)
        walls.append(time.perf_counter() - start)
    assert len(frame) == N_PARAMS * N_GPUS * N_STAGES

    rng = random.Random(0)
    sample = [(rng.choice(PARAMS), rng.choice(GPUS)) for _ in range(LOOP_SAMPLE)]
    start = time.perf_counter()
    for p, g in sample:
        zeroplan.estimate(p, g)
    per_config = (time.perf_counter() - start) / LOOP_SAMPLE
    loop_s = per_config * N_PARAMS * N_GPUS

    print(f"rows: {len(frame):,} ({N_PARAMS} params x {N_GPUS} gpus x {N_STAGES} stages)")
    print(f"zeroplan.sweep: first run {walls[0]:.3f} s, median of {REPEATS} {statistics.median(walls):.3f} s")
    print(
        f"zeroplan.estimate loop: {per_config * 1e6:.0f} us per configuration (sample of {LOOP_SAMPLE}), "
        f"{loop_s:.0f} s for the grid (extrapolated)"
    )
    print(f"speed-up: {loop_s / statistics.median(walls):,.0f}x")
    del frame

    cli = [sys.executable, "-c", "from zeroplan.cli import main; main()", "sweep"]
    compare_cli(cli, ["--params", ",".join(map(str, PARAMS)), "--gpus", ",".join(map(str, GPUS))])


if __name__ == "__main__":
    main()
