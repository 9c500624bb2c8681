"""``run_validation``: the one call behind ``zeroplan validate``."""

from __future__ import annotations

import json
from pathlib import Path

from zeroplan.files import write_text_atomic

from validate.checks import check_before_start
from validate.config import ValidateConfig
from validate.harness import run_matrix
from validate.report import build_report


def run_validation(config: ValidateConfig) -> dict:
    """Run the matrix of ``config`` (real or simulated) and return the report (``validate.schema``)."""
    check_before_start(config)
    if config.engine == "deepspeed":
        from validate.engines.deepspeed import run_validation as run_deepspeed

        return run_deepspeed(config)
    if config.engine == "fsdp2":
        from validate.engines.fsdp2 import build_report as fsdp2_report

        return fsdp2_report(config, run_matrix(config))
    return build_report(config, run_matrix(config))


def write_json_atomic(report: dict, path: str | Path) -> None:
    """Write the report so that ``path`` holds either the whole result or nothing new."""
    write_text_atomic(path, json.dumps(report, indent=2))

