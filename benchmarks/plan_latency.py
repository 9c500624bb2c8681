"""How long `zeroplan plan` takes: end to end as a fresh process, and the in-process `zeroplan.plan` call.

Target (issue: capacity planning): `zeroplan plan` stays interactive, well under the time of
`python -c "import torch"` (it never imports torch, pandas or matplotlib). The largest preset
(llama3-405b, 885 tensors, exact padding) on 1,024 GPUs is the slowest case: 10 options, each with a
min-GPU search and two max-size searches. Run: python benchmarks/plan_latency.py
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time

import zeroplan
from cli_latency import compare  # benchmarks/ is on sys.path when run as a script

REPEATS = 5
ARGS = ["plan", "--model", "llama3-405b", "--gpu", "h100-80gb", "--gpus", "1024", "--model-parallel", "8",
        "--grad-accum", "16", "--json"]  # fmt: skip
COMMANDS = {
    "zeroplan plan (llama3-405b)": [shutil.which("zeroplan") or "zeroplan", *ARGS],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
}


def main() -> None:
    compare(COMMANDS, REPEATS)
    calls = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        zeroplan.plan("llama3-405b", gpu="h100-80gb", gpus=1024, model_parallel=8, grad_accum=16)
        calls.append(time.perf_counter() - start)
    print(f"{'zeroplan.plan() in process':30s} median {statistics.median(calls) * 1e3:6.0f} ms")


if __name__ == "__main__":
    main()
