"""FSDP2 rows from Python: ``Fsdp2Settings`` trained on N_d gloo CPU ranks (torchrun, ``validate.launch``)
and the profile's prediction for every rank, the pieces ``tests/test_fsdp2_hf.py`` asserts with (the
``zeroplan validate`` report goes through ``validate.engines.fsdp2_compare``)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

from validate.engines.fsdp2_compare import Fsdp2Settings, predict  # noqa: F401 (predict: the one home, re-exported)


def run_world(settings: Fsdp2Settings, nd: int, timeout_s: float = 600.0) -> dict:
    """``settings`` trained on ``nd`` gloo CPU ranks under torchrun (through ``validate.launch``, which names
    the first failed rank): ``{"meta": ..., "rows": [every rank's row]}``, as ``main`` writes it."""
    import subprocess
    import tempfile
    from pathlib import Path

    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="zeroplan-fsdp2-") as tmp:
        out = Path(tmp, "rows.json")
        cmd = [sys.executable, "-m", "validate.launch", str(Path(tmp, "failures.json")), "--", "--standalone",
               f"--nproc-per-node={nd}", "--max-restarts", "0", "-m", "validate.engines.fsdp2",
               "--settings", json.dumps(asdict(settings)), "--out", str(out)]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"fsdp2 run (N_d={nd}) exited {done.returncode}; its log ends:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def peak_errors_by_rank(settings: Fsdp2Settings, result: dict) -> list[dict[str, float]]:
    """Per rank, per phase: (measured - predicted) / measured, each rank against its own prediction."""
    from zeroplan.formulas.peak import PHASES as PEAK_PHASES

    out = []
    for row in result["rows"]:
        predicted = predict(settings, result["meta"], row["rank"])[0].peak.by_phase()
        measured = row["peak_bytes_by_phase"]
        out.append({p: (measured[p] - predicted[p]) / measured[p] for p in PEAK_PHASES})
    return out
