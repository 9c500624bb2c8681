"""How long `zeroplan plan` takes: end to end as a fresh process, and the in-process `zeroplan.plan` call.

Target (issue: capacity planning): `zeroplan plan` stays interactive, well under the time of
`python -c "import torch"` (it never imports torch, pandas or matplotlib). The largest preset
(llama3-405b, 885 tensors, exact padding) on 1,024 GPUs is the slowest case: 10 options, each with a
min-GPU search and two max-size searches, and with N_m = 1 the engine's peak of every stage; the FSDP2
and DeepSpeed plans predict the peak of each of their candidates (and replay the allocation trace of each
one whose live peak fits, up to the first that fits: ``planning/reserved_fit.py live_over``, ``AFTER_FIT``); the
FSDP2 plan on 2,048 GPUs is issue 20's case. Run: python benchmarks/plan_latency.py
[REPEATS] [--before DIR]: with ``--before``, each plan also runs with the checkout DIR first on PYTHONPATH
(``git archive`` of the old commit), interleaved with the current one, so that before and after share the
machine's load.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import zeroplan
from cli_latency import medians_of  # benchmarks/ is on sys.path when run as a script

REPEATS = 5
ARGS = ["plan", "--model", "llama3-405b", "--gpu", "h100-80gb", "--gpus", "1024", "--model-parallel", "8",
        "--grad-accum", "16", "--json"]  # fmt: skip
PEAK = ["plan", "--model", "llama3-405b", "--gpu", "h100-80gb", "--gpus", "1024"]  # N_m = 1: every option's peak
BIG_FSDP2 = ["plan", "--engine", "fsdp2", "--model", "llama3-405b", "--gpus", "2048", "--gpu", "h100-80gb"]
"""Issue 20's case: answers with a mesh in under a second (wall time, on a quiet machine); the mesh search is
its default since 2026-12-02 (before: the flat group, the search with ``--tp auto --dp-shard auto``)."""
HF_CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "hf_configs"
MOE = ["plan", "--engine", "deepspeed", "--gpu", "h100-80gb", "--gpus", "1024", "--model"]
"""The largest model of any size: DeepSeek-V3 (671B, 58 sparse layers of 256 experts) and Qwen3-30B-A3B (48 of 128),
from their config.json, on DeepSpeed (ZeRO-1/2's per-hook winners over 1,024 ranks: the slowest plans, 0.93 and
0.85 CPU-s before 2026-12-03's ``moe12_hooks`` winners)."""
ZEROPLAN = shutil.which("zeroplan") or "zeroplan"
COMMANDS = {
    "zeroplan plan (llama3-405b)": [ZEROPLAN, *ARGS],
    "plan, peaks (reference)": [ZEROPLAN, *PEAK],
    "plan --engine fsdp2": [ZEROPLAN, *PEAK, "--engine", "fsdp2"],
    "plan --engine deepspeed": [ZEROPLAN, *PEAK, "--engine", "deepspeed"],
    "plan --engine fsdp2, 2048 GPUs": [ZEROPLAN, *BIG_FSDP2],
    "fsdp2 2048, --tp auto --dp-shard": [ZEROPLAN, *BIG_FSDP2, "--tp", "auto", "--dp-shard", "auto"],  # any version
    "fsdp2 2048, --tp 1 (flat)": [ZEROPLAN, *BIG_FSDP2, "--tp", "1"],
    "deepspeed, deepseek-v3 (MoE)": [ZEROPLAN, *MOE, str(HF_CONFIGS / "deepseek-v3.json")],
    "deepspeed, qwen3-30b-a3b (MoE)": [ZEROPLAN, *MOE, str(HF_CONFIGS / "qwen3-30b-a3b.json")],
    "deepspeed, llama2-70b": [ZEROPLAN, *MOE, "llama2-70b"],
    "fsdp2, llama2-70b, 2048 GPUs": [ZEROPLAN, "plan", "--engine", "fsdp2", "--model", "llama2-70b", "--gpus", "2048",
                                     "--gpu", "h100-80gb"],
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
}
"""Issue 16's target: every plan, any engine, under a quarter of the torch import (the largest preset, the largest
mixture-of-experts models, and Llama-2-70B: the slowest plans of a matrix of every engine, 34 transformers configs
and 4 presets on 64, 1,024 and 2,048 GPUs, 2026-12-03: its DeepSpeed plan tried 244 ranks for ZeRO-1's worst before
``profile._tries``, its FSDP2 plan replayed all four candidates' traces, since 2026-12-03 the first two: ``AFTER_FIT``)."""


def main() -> None:
    args = sys.argv[1:]
    before = None
    if "--before" in args:
        at = args.index("--before")
        before, args = os.path.abspath(args[at + 1]), args[:at] + args[at + 2:]
    repeats = int(args[0]) if args else REPEATS
    medians = medians_of(COMMANDS, repeats, before)
    torch_s = medians['python -c "import torch"']
    for name, m in medians.items():
        print(f"{name:30s} {m / torch_s:5.2f}x the torch import (CPU time)")
    calls = []
    for _ in range(repeats):
        start = time.perf_counter()
        zeroplan.plan("llama3-405b", gpu="h100-80gb", gpus=1024, model_parallel=8, grad_accum=16)
        calls.append(time.perf_counter() - start)
    print(f"{'zeroplan.plan() in process':30s} median {statistics.median(calls) * 1e3:6.0f} ms")


if __name__ == "__main__":
    main()
