"""The issue-11 matrix against real DeepSpeed, as the table of docs/engines/deepspeed.md prints it.

Runs the worlds of ``tests/test_deepspeed_engine.py`` (its ``CASES``: gpt-tiny, 3 steps, N_d = 2 and 4) once
and prints one markdown row per case and world: bytes measured per phase (max over ranks) with
(measured - predicted) / measured, the model-states error, zeroplan's peak and DeepSpeed's own estimator,
then the largest error of each phase. ~2 min on two cores once DeepSpeed's JIT ops are built.

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python benchmarks/deepspeed_matrix.py [N_d ...]
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

PHASES = ("init", "forward", "backward", "optimizer_step")


def _matrix():
    """The test module's CASES and configs: one definition of the matrix."""
    path = Path(__file__).resolve().parent.parent / "tests" / "test_deepspeed_engine.py"
    spec = importlib.util.spec_from_file_location("deepspeed_matrix_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CASES, module._configs(), module.STATES_TOL, module.PEAK_TOL


def _cell(measured: int, rel: float) -> str:
    return f"{measured:,} ({rel * 100:+.2f}%)"


def main(nds: list[int]) -> None:
    logging.disable(logging.WARNING)  # DeepSpeed's accelerator banner is not part of the table
    from validate.engines.deepspeed import compare_row, run_world, workload_for

    cases, configs, states_tol, peak_tol = _matrix()
    print("| ZeRO | N_d | buckets | dtype | Adam | init | forward | backward | optimizer_step | states err | "
          "zeroplan peak (err) | DeepSpeed estimator (err) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = dict.fromkeys(PHASES, 0.0)
    for nd in nds:
        ranks = run_world(configs, nd, steps=3)
        workload = workload_for("gpt-tiny", 2, None)
        for i, ((stage, dtype, buckets), config) in enumerate(zip(cases, configs)):
            row = compare_row(config, nd, [r[i] for r in ranks], workload, "gpt-tiny", states_tol, peak_tol)
            measured, rel = row["measured_peak_bytes_by_phase"], row["peak_rel_error_by_phase"]
            for p in PHASES:
                worst[p] = max(worst[p], abs(rel[p]))
            adam = "FusedAdam" if buckets.endswith("+fused") else "AdamW"
            kind = buckets.removesuffix("+fused")
            cells = [_cell(measured[p], rel[p]) for p in PHASES]
            peak, predicted = row["measured_peak_bytes"], max(row["predicted_peak_bytes_by_phase"].values())
            print(f"| {stage} | {nd} | {kind} | {dtype} | {adam} | " + " | ".join(cells)
                  + f" | {row['model_states_rel_error'] * 100:+.2f}% | {predicted:,} ({(peak - predicted) / peak * 100:+.2f}%)"
                  f" | {row['deepspeed_estimator_bytes']:,} ({row['deepspeed_estimator_rel_error'] * 100:+.2f}%) |",
                  flush=True)  # fmt: skip
    print("largest |error| per phase: " + ", ".join(f"{p} {worst[p] * 100:.2f}%" for p in PHASES))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2, 4])
