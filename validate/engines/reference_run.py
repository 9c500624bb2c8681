"""What a run of the bundled reference runtime (``validate/worker.py``) refuses before any rank starts: the
validator's checks of its ``ValidateConfig`` (``Engine.runner`` of ``zeroplan/engines/reference``)."""

from __future__ import annotations


def check_run(config) -> None:
    """ValueError (one line) for what the reference runtime does not train."""
    if config.param_dtype == "fp32":
        raise ValueError("param-dtype=fp32: the reference runtime trains 16-bit parameters (bf16 or fp16)")
