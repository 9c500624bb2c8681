"""FSDP2 rows from Python: ``Fsdp2Settings`` trained on N_d gloo CPU ranks (torchrun, ``validate.launch``)
and the profile's prediction for every rank, the pieces ``tests/test_fsdp2_hf.py`` asserts with (the
``zeroplan validate`` report goes through ``validate.engines.fsdp2_compare``)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

from validate.engines.fsdp2 import Fsdp2Settings
from validate.models import spec_for


def predict(settings: Fsdp2Settings, meta: dict, rank: int = 0):
    """(the estimate row, the profile's Settings) of the run ``settings`` on ``rank`` of ``meta``'s world;
    ``hf``: the transformers module tree (``Workload.transformers``)."""
    from zeroplan.architectures.spec import TransformerSpec, transformer_shapes
    from zeroplan.engines import fsdp2 as profile
    from zeroplan.engines.base import Workload

    spec = spec_for(settings.model, settings.params)
    if not isinstance(spec, TransformerSpec):
        raise ValueError(f"model {settings.model}: --engine fsdp2 validates transformers only")
    cuda = str(meta["device"]).startswith("cuda")
    foreach = settings.foreach if settings.foreach is not None else cuda
    workload = Workload(transformer_shapes(spec), spec, settings.seq_len or spec.max_seq_len, settings.batch_per_rank,
                        "full" if settings.checkpointing else "none", foreach=bool(foreach),
                        transformers=settings.hf)  # fmt: skip
    engine = profile.Settings(reshard_after_forward=settings.reshard_after_forward, param_dtype=settings.param_dtype,
                              reduce_dtype=settings.reduce_dtype, device="cuda" if cuda else "cpu",
                              backend=meta["backend"], rank=rank, init=settings.init,
                              cuda_capability=tuple(meta.get("cuda_capability", (9, 0))),
                              **({"loss_in_forward": settings.labels} if settings.hf else {}))  # fmt: skip
    (row,) = profile.estimate(workload, meta["world_size"], engine)
    return row, engine


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
