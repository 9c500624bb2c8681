"""Peak per phase, predicted vs measured, where activations dominate: a 124M GPT-2-small-shaped model
(12 x 768, vocab 50304) simulated with fake tensors at N_d = 8 (rank 0 of a fake group), b = 4, s = 512.

    PYTHONPATH=. python benchmarks/peak_100m.py [--checkpointing full] [--stage 3]

Runs ``zeroplan validate --simulated`` (one process, FakeTensorMode: shapes and storage sizes, no data)
and prints each phase's predicted and measured bytes and the relative error.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PARAMS = "124M"  # zeroplan.architectures.spec.gpt_for_params: 12 layers of 768 (GPT-3's aspect ratio), vocab 50304


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpointing", default="none")
    parser.add_argument("--stage", action="append", default=None)
    parser.add_argument("--world-size", default="8")
    args = parser.parse_args()
    stages = args.stage or ["0", "1", "2", "3"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "peak.json")
        cmd = [sys.executable, "-c", "from zeroplan.cli import main; main()", "validate", "--simulated",
               "--params", PARAMS, "--world-size", args.world_size, "--micro-batch", "4", "--seq-len", "512",
               "--steps", "2", "--checkpointing", args.checkpointing, "--json", str(out)]  # fmt: skip
        for s in stages:
            cmd += ["--stage", s]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if not out.exists():
            sys.exit(proc.stdout + proc.stderr)
        report = json.loads(out.read_text())
    first = report["rows"][0]
    print(f"GPT ~{PARAMS} (Ψ = {first['psi']:,}), N_d = {first['world_size']} simulated, b = 4, s = 512, "
          f"checkpointing {args.checkpointing}, Adam foreach={first['foreach']}")  # fmt: skip
    print(f"{'stage':>5} {'phase':<15} {'predicted MiB':>14} {'measured MiB':>13} {'error':>9}  moment's largest term")
    for row in report["rows"]:
        pred, meas = row["predicted_peak_bytes_by_phase"], row["measured_peak_bytes_by_phase"]
        for phase in pred:
            err = (meas[phase] - pred[phase]) / meas[phase]
            print(f"{row['stage']:>5} {phase:<15} {pred[phase] / 2**20:>14.2f} {meas[phase] / 2**20:>13.2f} "
                  f"{100 * err:>+8.3f}%")  # fmt: skip
        top = row["predicted_peak_terms"][0]
        print(f"{'':>5} peak in {row['predicted_peak_phase']}; largest term: {top['name']} "
              f"({top['bytes'] / 2**20:.1f} MiB)")  # fmt: skip


if __name__ == "__main__":
    main()
