"""``run_validation``: the one call behind ``zeroplan validate``."""

from __future__ import annotations

import json
from pathlib import Path

from zeroplan.files import write_text_atomic

from validate.config import ValidateConfig
from validate.harness import run_matrix
from validate.report import build_report


def check_devices(config: ValidateConfig) -> None:
    """A real NCCL run needs one GPU per rank: say so before starting any process (ValueError)."""
    import torch

    if (
        config.simulated
        or config.device == "cpu"
        or not (config.device == "cuda" or torch.cuda.is_available())
    ):
        return
    gpus = torch.cuda.device_count()
    too_big = [nd for nd in config.world_sizes if nd > gpus]
    if too_big:
        raise ValueError(
            f"world-size={too_big}: a real NCCL run needs one GPU per rank and {gpus} are visible; "
            "use --world-size <= that, --device cpu (gloo) or --simulated"
        )


def run_validation(config: ValidateConfig) -> dict:
    """Run the matrix of ``config`` (real or simulated) and return the report (``report.SCHEMA``)."""
    check_devices(config)
    return build_report(config, run_matrix(config))


def write_json_atomic(report: dict, path: str | Path) -> None:
    """Write the report so that ``path`` holds either the whole result or nothing new."""
    write_text_atomic(path, json.dumps(report, indent=2))

