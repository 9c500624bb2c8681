"""How long `zeroplan.sweep` takes for a million rows, against `zeroplan.estimate` called in a loop.

Target (issue: capacity planning): a sweep of a million configurations in about a second.
Grid: 1000 Ψ values (1B to 1T, odd counts so padding matters) x 250 GPU counts (8 to 2000) x 4 stages
= 1,000,000 rows. The loop is timed on a random sample of the same grid and scaled up; both sides build
the same rows (the sweep's DataFrame; the loop's `Estimate` records).

Run: python benchmarks/sweep_speed.py
"""

from __future__ import annotations

import random
import statistics
import time

import numpy as np

import zeroplan
from zeroplan import sweep

N_PARAMS, N_GPUS, N_STAGES = 1000, 250, 4
LOOP_SAMPLE = 2000
REPEATS = 3


def main() -> None:
    params = (np.linspace(1e9, 1e12, N_PARAMS).astype(np.int64) | 1).tolist()  # odd: padding everywhere
    gpus = list(range(8, 8 + 8 * N_GPUS, 8))
    sweep(params[:10], gpus[:10])  # warm up imports and pydantic validators

    walls = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        frame = sweep(params, gpus)
        walls.append(time.perf_counter() - start)
    assert len(frame) == N_PARAMS * N_GPUS * N_STAGES

    rng = random.Random(0)
    sample = [(rng.choice(params), rng.choice(gpus)) for _ in range(LOOP_SAMPLE)]
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


if __name__ == "__main__":
    main()
