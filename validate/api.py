"""``run_validation``: the one call behind ``zeroplan validate``."""

from __future__ import annotations

import json
from pathlib import Path

from zeroplan.files import write_text_atomic

from validate.checks import check_before_start
from validate.config import ValidateConfig


def run_validation(config: ValidateConfig) -> dict:
    """Run the matrix of ``config`` (real or simulated) and return the report (``validate.schema``)."""
    check_before_start(config)
    if config.runner is None:
        raise ValueError(f"--engine {config.engine}: no validator runner (Engine.runner) to train it")
    return config.runner.run(config)  # the engine's runner (validate/engines/): torch imported when it runs


def write_json_atomic(report: dict, path: str | Path) -> None:
    """Write the report so that ``path`` holds either the whole result or nothing new."""
    write_text_atomic(path, json.dumps(report, indent=2))

