"""The validator's runner of the bundled reference runtime (``Engine.runner`` of ``zeroplan/engines/reference``):
what its ranks run (``validate/worker.py``), its report (``validate/report.py``) and what it refuses before any
rank starts."""

from __future__ import annotations


def worker_module(config) -> str:
    """The module each rank runs (``validate.harness.launch_command``)."""
    return "validate.worker"


def run(config) -> dict:
    """Train the matrix and compare it with the reference engine's prediction (``validate.report``)."""
    from validate.harness import run_matrix
    from validate.report import build_report

    return build_report(config, run_matrix(config))


def check_run(config) -> None:
    """ValueError (one line) for what the reference runtime does not train."""
    if config.param_dtype == "fp32":
        raise ValueError("param-dtype=fp32: the reference runtime trains 16-bit parameters (bf16 or fp16)")
