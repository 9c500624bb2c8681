"""The one set of annotated pydantic types every config and preset uses, and the one-line error text.

Each type checks one rule and names the field and the value in its message ("gpus=0: must be >= 1"),
so ``EstimateConfig``, ``PlanConfig``, ``SweepConfig``, the presets and ``validate``'s config cannot
phrase or enforce a rule differently. Values may be Python or numpy scalars (sweeps pass numpy).
"""

from __future__ import annotations

import math
import operator
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, ValidationError, ValidationInfo

from zeroplan.formulas.activations import CHECKPOINTING
from zeroplan.formulas.dtypes import canonical_dtype
from zeroplan.formulas.stages import get_stage


def _is_bool(v: object) -> bool:
    return isinstance(v, bool) or type(v).__name__ == "bool_"  # numpy's bool is no int subclass


def _whole(v: object, info: ValidationInfo) -> int:
    """A whole number (int or numpy integer, never bool or float) >= 1."""
    if _is_bool(v) or not hasattr(v, "__index__"):
        raise ValueError(f"{info.field_name}={v!r}: must be a whole number")
    if operator.index(v) < 1:
        raise ValueError(f"{info.field_name}={v}: must be >= 1")
    return operator.index(v)


def _byte_size(v: object, info: ValidationInfo) -> int:
    """Whole bytes >= 1; an integral float (32e9) is a whole number of bytes."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return _whole(v, info)


def _real(v: object, info: ValidationInfo) -> float:
    if _is_bool(v) or not isinstance(v, (int, float)) and not hasattr(v, "__index__"):
        raise ValueError(f"{info.field_name}={v!r}: must be a number")
    return v


def _positive(v: object, info: ValidationInfo) -> float:
    """A finite number > 0."""
    if not math.isfinite(_real(v, info)) or v <= 0:
        raise ValueError(f"{info.field_name}={v:g}: must be a positive finite number")
    return v


def _non_negative(v: object, info: ValidationInfo) -> float:
    """A finite number >= 0."""
    if not math.isfinite(_real(v, info)) or v < 0:
        raise ValueError(f"{info.field_name}={v:g}: must be a finite number >= 0")
    return v


def _params(v: object, info: ValidationInfo) -> float:
    """Ψ: a positive finite whole number of parameters, kept as float (7.5e9 is typed as a float)."""
    if not math.isfinite(_real(v, info)) or v <= 0:
        raise ValueError(f"{info.field_name}={float(v)}: must be a positive finite number of parameters")
    if not float(v).is_integer():
        raise ValueError(f"{info.field_name}={float(v)}: must be a whole number of parameters")
    return float(v)


def _fraction(low_open: bool):
    """A fraction in [0, 1) (``low_open`` False) or in (0, 1] (True)."""

    def check(v: object, info: ValidationInfo) -> float:
        ok = math.isfinite(_real(v, info)) and ((0 < v <= 1) if low_open else (0 <= v < 1))
        if not ok:
            interval = "(0, 1]" if low_open else "[0, 1)"
            raise ValueError(f"{info.field_name}={v}: must be a fraction in {interval}")
        return v

    return check


def _stage(v: object, info: ValidationInfo) -> int:
    """A ZeRO stage number, by the stage table's own rule (``zeroplan.formulas.stages.get_stage``)."""
    return get_stage(v, info.field_name).number


Count = Annotated[int, BeforeValidator(_whole)]
"""A whole number >= 1: GPUs, degrees, batch sizes, sequence lengths, elements."""
ByteSize = Annotated[int, BeforeValidator(_byte_size)]
"""A size in whole bytes >= 1."""
Params = Annotated[float, BeforeValidator(_params)]
"""Ψ, a positive whole number of parameters."""
PositiveFinite = Annotated[float, BeforeValidator(_positive)]
"""A finite number > 0 (bandwidths in GB/s, FLOP/s, seconds, rates)."""
NonNegativeFinite = Annotated[float, BeforeValidator(_non_negative)]
"""A finite number >= 0 (latencies)."""
Fraction = Annotated[float, BeforeValidator(_fraction(low_open=False))]
"""A share in [0, 1): what may be kept free."""
PositiveFraction = Annotated[float, BeforeValidator(_fraction(low_open=True))]
"""A share in (0, 1]: a utilisation."""
StageNumber = Annotated[int, BeforeValidator(_stage)]
"""A ZeRO stage, 0-3."""
DType = Annotated[str, AfterValidator(canonical_dtype)]
"""A dtype name in any accepted spelling, stored canonical (``zeroplan.formulas.dtypes``)."""
Checkpointing = Literal[CHECKPOINTING]
"""Activation recomputation assumed: none, selective or full (``zeroplan.formulas.activations``)."""

_SCALARS = (str, int, float, type(None))


def error_line(exc: ValidationError) -> str:
    """The first validation error as one line: ours as written, pydantic's own with the field and value."""
    err = exc.errors()[0]
    msg = str(err["msg"]).removeprefix("Value error, ")
    loc = ".".join(str(p) for p in err["loc"] if isinstance(p, str))
    if not loc or re.search(rf"\b{re.escape(loc.split('.')[-1])}\b", msg):
        return msg
    if err["type"] != "missing" and isinstance(err.get("input"), _SCALARS):
        return f"{loc}={err['input']!r}: {msg}"
    return f"{loc}: {msg}"


def check_split(gpus: int, model_parallel: int) -> None:
    """ValueError unless N_m divides the GPU count (gpus = N_d x N_m)."""
    if gpus % model_parallel:
        raise ValueError(
            f"model_parallel={model_parallel} does not divide gpus={gpus}: gpus must be N_d x N_m"
        )
