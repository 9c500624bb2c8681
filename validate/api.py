"""``run_validation``: the one call behind ``zeroplan validate``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from validate.config import ValidateConfig
from validate.harness import run_matrix
from validate.report import build_report


def run_validation(config: ValidateConfig) -> dict:
    """Run the matrix of ``config`` (real or simulated) and return the report (``report.SCHEMA``)."""
    return build_report(config, run_matrix(config))


def write_json_atomic(report: dict, path: str | Path) -> None:
    """Write the report so that ``path`` holds either the whole result or nothing new."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
