"""The ZeRO paper's headline case measured on CPU: a 7.5B GPT-style model, rank 0 of N_d = 64.

ZeRO (Rajbhandari et al., SC20) Figure 1: per-device model states of a 7.5B model at N_d = 64 with
mixed-precision Adam (K = 12) are 120 GB (DP), 31.4 GB (P_os), 16.6 GB (P_os+g), 1.88 GB (P_os+g+p).
This runs the reference runtime on a fake process group with fake tensors and prints the paper's
number, the planner's exact prediction for the built model and the measured bytes.

    python benchmarks/validate_paper_7_5b.py [--json out.json]
"""

from __future__ import annotations

import argparse
import resource
import time

from validate.api import run_validation, write_json_atomic
from validate.config import ValidateConfig
from zeroplan.formulas.memory import paper_model_states_bytes

PAPER_FIGURE_1_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    config = ValidateConfig(params=7.5e9, simulated=True, world_sizes=(64,), steps=2, batch_per_rank=1,
                            seq_len=128, timeout_s=1800)  # fmt: skip
    t0 = time.perf_counter()
    report = run_validation(config)
    seconds = time.perf_counter() - t0
    if args.json:
        write_json_atomic(report, args.json)
    psi = report["rows"][0]["psi"]
    print(f"GPT-style model of {psi:,} parameters (zeroplan.architectures.spec.gpt_for_params(7.5e9)), N_d = 64")
    print(
        "stage  paper Fig.1 GB  paper formula GB  zeroplan GB  measured GB   measured-zeroplan B  derived comm/rank GB  ok"
    )
    for r in report["rows"]:
        formula = paper_model_states_bytes(psi, 64, 12, r["stage"]) / 1e9
        print(f"{r['stage']:>5}  {PAPER_FIGURE_1_GB[r['stage']]:>14.2f}  {formula:>16.3f}  "
              f"{r['predicted_model_states_bytes'] / 1e9:>11.3f}  {r['measured_model_states_bytes'] / 1e9:>11.3f}  "
              f"{r['model_states_extra_bytes']:>20,}  {r['derived_comm_bytes_per_rank'] / 1e9:>12.3f}  "
              f"{'yes' if r['ok'] else 'NO'}")  # fmt: skip
    rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"wall {seconds:.0f} s, worker max RSS {rss_gib:.2f} GiB (fake tensors: no data is allocated)")


if __name__ == "__main__":
    main()
