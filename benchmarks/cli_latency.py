"""How long `zeroplan estimate` takes end to end, against `python -c "import torch"` in the same run.

Target (issue: planner core): under a quarter of the torch import. Run: python benchmarks/cli_latency.py
Each command runs as a fresh process, alternating, several times; medians are compared because this
machine is shared and noisy.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time

REPEATS = 7
COMMANDS = {
    "zeroplan estimate": [shutil.which("zeroplan") or "zeroplan", "estimate", "--params", "7.5e9", "--gpus", "64"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
}


def wall_s(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def compare(commands: dict[str, list[str]], repeats: int) -> dict[str, float]:
    """Run each command ``repeats`` times, alternating; print and return the median wall time of each."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, argv in commands.items():
            times[name].append(wall_s(argv))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, m in medians.items():
        print(f"{name:30s} median {m * 1e3:7.0f} ms  (min {min(times[name]) * 1e3:.0f} ms, {repeats} runs)")
    return medians


def main() -> None:
    medians = compare(COMMANDS, REPEATS)
    ratio = medians["zeroplan estimate"] / medians['python -c "import torch"']
    print(f"ratio zeroplan / import torch: {ratio:.3f} (target < 0.25)")


if __name__ == "__main__":
    main()
