"""``run_validation``: the one call behind ``zeroplan validate``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from zeroplan.files import write_text_atomic

from validate.checks import check_before_start
from validate.config import ValidateConfig
from validate.harness import run_matrix
from validate.report import build_report


def _reference(config: ValidateConfig) -> dict:
    return build_report(config, run_matrix(config))


def _fsdp2(config: ValidateConfig) -> dict:
    if config.tp is not None:  # the TP runner (validate/engines/fsdp2_tp.py), its own comparison
        from validate.engines.fsdp2_tp_compare import build_report as fsdp2_report
    else:
        from validate.engines.fsdp2_compare import build_report as fsdp2_report

    return fsdp2_report(config, run_matrix(config))


def _deepspeed(config: ValidateConfig) -> dict:
    from validate.engines.deepspeed_compare import run_validation as run_deepspeed

    return run_deepspeed(config)


RUNS: dict[str, Callable[[ValidateConfig], dict]] = {
    "reference": _reference,
    "fsdp2": _fsdp2,
    "deepspeed": _deepspeed,
}
"""``ValidateConfig.engine`` -> what trains it and builds its report (each engine's runner lives in
``validate/engines/``; torch and the engine are imported only when that engine runs)."""


def run_validation(config: ValidateConfig) -> dict:
    """Run the matrix of ``config`` (real or simulated) and return the report (``validate.schema``)."""
    check_before_start(config)
    return RUNS[config.engine](config)


def write_json_atomic(report: dict, path: str | Path) -> None:
    """Write the report so that ``path`` holds either the whole result or nothing new."""
    write_text_atomic(path, json.dumps(report, indent=2))

