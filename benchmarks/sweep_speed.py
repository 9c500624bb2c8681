"""How long a million-row sweep takes, in Python and written to a file by `zeroplan sweep`.

Targets (issue 9): `zeroplan sweep` of 1e6 rows to CSV within the time of `python -c "import torch"`
measured in the same run, with bounded memory (peak RSS); Parquet too. Also the capacity-planning
target: `zeroplan.sweep` of a million rows in about a second, against `zeroplan.estimate` in a loop.

Grid: 1000 Ψ values (1B to 1T, odd counts so padding matters) x 250 GPU counts (8 to 2000) x 4 stages
= 1,000,000 rows. The commands run as separate processes (`/usr/bin/time`-style: wall time, and peak
RSS from `resource.getrusage(RUSAGE_CHILDREN)` of a fresh child each time), so imports are counted as a
user sees them. Each is run REPEATS times; the median is shown.

Run: python benchmarks/sweep_speed.py
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
print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def measure(argv: list[str]) -> tuple[float, float]:
    """Median wall seconds and peak RSS (MiB) of ``argv`` run REPEATS times, each in a fresh process."""
    walls, rss = [], []
    for _ in range(REPEATS):
        argv_ = [sys.executable, "-c", _CHILD, *argv]
        out = subprocess.run(argv_, check=True, capture_output=True, text=True)
        wall, kib = out.stdout.split()
        walls.append(float(wall))
        rss.append(int(kib) / 1024)
    return statistics.median(walls), max(rss)


def main() -> None:
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
    grid = ["--params", ",".join(map(str, PARAMS)), "--gpus", ",".join(map(str, GPUS))]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [("python -c 'import torch'", measure([sys.executable, "-c", "import torch"]), None)]
        for name in ("sweep.csv", "sweep.parquet"):
            path = os.path.join(tmp, name)
            timing = measure([*cli, *grid, "--out", path])
            rows.append((f"zeroplan sweep --out {name}", timing, os.path.getsize(path)))
    print(f"\nin separate processes, median of {REPEATS} (peak RSS: the largest of the runs):")
    torch_s = rows[0][1][0]
    for what, (wall, rss), size in rows:
        extra = ""
        if size is not None:
            extra = f", {size / 1e6:.0f} MB written, {wall / torch_s:.2f}x the torch import"
        print(f"  {what:38s} {wall:6.2f} s  peak RSS {rss:5.0f} MiB{extra}")


if __name__ == "__main__":
    main()
