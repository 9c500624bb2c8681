"""The one set of annotated pydantic types every config and preset uses, and the one-line error text.

Each type checks one rule and names the field and the value in its message ("gpus=0: must be >= 1"),
so ``EstimateConfig``, ``PlanConfig``, ``SweepConfig``, the presets and ``validate``'s config cannot
phrase or enforce a rule differently. Values may be Python or numpy scalars (sweeps pass numpy).
"""

from __future__ import annotations

import functools
import math
import operator
import os
import re
import types
from collections.abc import Callable
from typing import Annotated, Literal, Optional

from pydantic import AfterValidator, BeforeValidator, Strict, ValidationError, ValidationInfo, validate_call

from zeroplan.architectures.limits import (  # noqa: F401 (re-exported: the one set of bounds)
    DIMENSION_LIMITS, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_PARAMS, MAX_VOCAB, MAX_WIDTH, _is_bool, check_dimensions,
    check_total, dimension_limit, show,
)
from zeroplan.formulas.activations import CHECKPOINTING
from zeroplan.formulas.dtypes import canonical_dtype
from zeroplan.formulas.stages import get_stage


MAX_GPUS = 2**24
"""Largest GPU count, N_d or N_m: 16,777,216, far above any cluster; keeps ring byte counts exact."""
MAX_SEQ_LEN = 2**24
"""Longest sequence, in tokens (16.8M; the longest contexts trained are about 10M)."""
MAX_BATCH = 2**16
"""Largest micro-batch (sequences per GPU per micro-step) and gradient-accumulation count."""
MAX_BYTES = 2**60
"""Largest memory size, in bytes (1 EiB): GPU memory, host memory, and any byte count a result may hold."""
MAX_COUNT = 2**53
"""Largest whole number of any other kind (model dimensions, bucket sizes): exact as a float too."""
BANDWIDTH_GBPS = (1e-3, 1e6)
"""Bandwidths, GB/s one direction: 1 MB/s to 1 PB/s. Below, a step takes longer than the age of the
cluster; the lower bound keeps every time finite (``plan --bw 1e-300`` printed inf)."""
TFLOPS = (1e-3, 1e6)
"""Peak dense TFLOP/s per GPU: 1 GFLOP/s to 1 EFLOP/s."""
FLOPS = (1e9, 1e18)
"""The same range in FLOP/s (GPU presets)."""
LATENCY_S = (0.0, 1.0)
"""Per-message latency (alpha) of a link, seconds: 0 to 1 s."""
MFU = (1e-3, 1.0)
"""Model FLOPs utilisation: 0.1% to 100%."""


def _index(v: object, info: ValidationInfo) -> int:
    """A whole number given as an int or numpy integer (never bool, float or text)."""
    if _is_bool(v) or not hasattr(v, "__index__"):
        raise ValueError(f"{info.field_name}={v!r}: must be a whole number")
    return operator.index(v)


def _whole(maximum: int, minimum: int = 1):
    """A whole number in [minimum, maximum]; integral floats up to 2**53 are exact and accepted for
    byte sizes only (``_byte_size``)."""

    def check(v: object, info: ValidationInfo) -> int:
        n = _index(v, info)
        if n < minimum:
            raise ValueError(f"{info.field_name}={show(n)}: must be >= {minimum}")
        if n > maximum:
            raise ValueError(f"{info.field_name}={show(n)}: must be <= {maximum:,}")
        return n

    return check


def _integral_float(v: object, info: ValidationInfo) -> object:
    """An integral finite float (32e9) as the int it holds exactly; other values unchanged."""
    if isinstance(v, float):
        if not (math.isfinite(v) and v.is_integer()):
            raise ValueError(f"{info.field_name}={v}: must be a whole number")
        return int(v)
    return v


def _byte_size(maximum: int, minimum: int = 1):
    """Whole bytes in [minimum, maximum]; an integral float (32e9) is a whole number of bytes."""
    whole = _whole(maximum, minimum)

    def check(v: object, info: ValidationInfo) -> int:
        if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
            raise ValueError(f"{info.field_name}={v}: must be a whole number of bytes")
        return whole(_integral_float(v, info), info)

    return check


def _real(v: object, info: ValidationInfo) -> float:
    if _is_bool(v) or not isinstance(v, (int, float)) and not hasattr(v, "__index__"):
        raise ValueError(f"{info.field_name}={v!r}: must be a number")
    if isinstance(v, int) and abs(v) > 2**53:
        raise ValueError(f"{info.field_name}={show(v)}: out of range")
    return v


def _positive(v: object, info: ValidationInfo) -> float:
    """A finite number > 0."""
    if not math.isfinite(_real(v, info)) or v <= 0:
        raise ValueError(f"{info.field_name}={v:g}: must be a positive finite number")
    return v


def _within(low: float, high: float, unit: str = ""):
    """A positive finite number in [low, high] (``unit`` for the message)."""

    def check(v: object, info: ValidationInfo) -> float:
        v = _positive(v, info) if low > 0 else _non_negative(v, info)
        if not low <= v <= high:
            raise ValueError(f"{info.field_name}={v}: must be between {low:g} and {high:g}{unit}")
        return v

    return check


def _non_negative(v: object, info: ValidationInfo) -> float:
    """A finite number >= 0."""
    if not math.isfinite(_real(v, info)) or v < 0:
        raise ValueError(f"{info.field_name}={v:g}: must be a finite number >= 0")
    return v


def _params(v: object, info: ValidationInfo) -> int:
    """Ψ: a positive whole number of parameters up to ``MAX_PARAMS``, kept exact as an int (an integral
    float such as 7.5e9 is accepted: below 2**53 it is exact)."""
    if _is_bool(v) or not isinstance(v, (int, float)) and not hasattr(v, "__index__"):
        raise ValueError(f"{info.field_name}={v!r}: must be a number")
    if isinstance(v, float) and not math.isfinite(v) or v <= 0:
        shown = float(v) if isinstance(v, float) or abs(operator.index(v)) < 2**53 else show(v)
        raise ValueError(f"{info.field_name}={shown}: must be a positive finite number of parameters")
    if isinstance(v, float) and v > MAX_PARAMS or not isinstance(v, float) and operator.index(v) > MAX_PARAMS:
        raise ValueError(f"{info.field_name}={show(v)}: must be <= {MAX_PARAMS:.0e} parameters")
    if isinstance(v, float) and not v.is_integer():
        raise ValueError(f"{info.field_name}={v}: must be a whole number of parameters")
    return int(v) if isinstance(v, float) else operator.index(v)


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


def model_name(v: object, info: ValidationInfo) -> str:
    """``model``: a preset name or the path of a config.json, given as ``str`` or as a path object
    (``pathlib.Path``, any ``os.PathLike``: the docs' ``model=Path("config.json")``); anything else (a
    dict, an int) is one ValueError naming the field."""
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    if not isinstance(v, str):
        raise ValueError(f"{info.field_name}={show(v)}: expected a preset name or the path of a config.json")
    return v


def check_wholes(values: tuple, what: str, maximum: int) -> tuple:
    """``values`` unchanged if each is a whole number in [1, ``maximum``]; else the one-line ValueError of the
    config fields (``gpus=0: must be >= 1``), for a command that must use a list before its config exists."""
    check, info = _whole(maximum), types.SimpleNamespace(field_name=what)
    for v in values:
        check(v, info)
    return values


def whole_up_to(maximum: int) -> object:
    """A whole number in [1, ``maximum``] as an annotated type, for a field with its own documented cap."""
    return Annotated[int, BeforeValidator(_whole(maximum))]


Count = Annotated[int, BeforeValidator(_whole(MAX_COUNT))]
"""A whole number from 1 to ``MAX_COUNT``: model dimensions, bucket sizes, steps."""
GpuCount = Annotated[int, BeforeValidator(_whole(MAX_GPUS))]
"""A GPU count or parallel degree (N_d, N_m), 1 to ``MAX_GPUS``."""
SeqLen = Annotated[int, BeforeValidator(_whole(MAX_SEQ_LEN))]
"""Tokens per sequence, 1 to ``MAX_SEQ_LEN``."""
BatchCount = Annotated[int, BeforeValidator(_whole(MAX_BATCH))]
"""Sequences per micro-step or micro-steps per step, 1 to ``MAX_BATCH``."""
Numel = Annotated[int, BeforeValidator(_whole(MAX_PARAMS))]
"""Elements of one tensor, 1 to ``MAX_PARAMS``."""
ByteSize = Annotated[int, BeforeValidator(_byte_size(MAX_BYTES))]
"""A size in whole bytes, 1 to ``MAX_BYTES`` (1 EiB)."""
ByteCount = Annotated[int, BeforeValidator(_byte_size(MAX_BYTES, minimum=0))]
"""A byte count that may be 0 (a budget, a measurement), up to ``MAX_BYTES``."""
Params = Annotated[int, BeforeValidator(_params)]
"""Ψ, a whole number of parameters from 1 to ``MAX_PARAMS``, exact."""
PositiveFinite = Annotated[float, BeforeValidator(_positive)]
"""A finite number > 0 (seconds, rates, tolerances)."""
NonNegativeFinite = Annotated[float, BeforeValidator(_non_negative)]
"""A finite number >= 0."""
Bandwidth = Annotated[float, BeforeValidator(_within(*BANDWIDTH_GBPS, " GB/s"))]
"""A link bandwidth in GB/s one direction, within ``BANDWIDTH_GBPS``."""
Tflops = Annotated[float, BeforeValidator(_within(*TFLOPS, " TFLOP/s"))]
"""Peak dense TFLOP/s per GPU, within ``TFLOPS``."""
Flops = Annotated[float, BeforeValidator(_within(*FLOPS, " FLOP/s"))]
"""Peak dense FLOP/s per GPU, within ``FLOPS``."""
Latency = Annotated[float, BeforeValidator(_within(*LATENCY_S, " s"))]
"""A per-message latency in seconds, within ``LATENCY_S``."""
Fraction = Annotated[float, BeforeValidator(_fraction(low_open=False))]
"""A share in [0, 1): what may be kept free."""
PositiveFraction = Annotated[float, BeforeValidator(_fraction(low_open=True))]
"""A share in (0, 1]."""
Utilisation = Annotated[float, BeforeValidator(_within(*MFU))]
"""Model FLOPs utilisation within ``MFU``."""
StageNumber = Annotated[int, BeforeValidator(_stage)]
"""A ZeRO stage, 0-3."""
ModelName = Annotated[str, BeforeValidator(model_name)]
"""``model``: a preset name or a config path (str or ``os.PathLike``), as text."""
Flag = Annotated[bool, Strict()]
"""True or False only (no 1, "yes" or "false")."""
DType = Annotated[str, Strict(), AfterValidator(canonical_dtype)]
"""A dtype name in any accepted spelling, stored canonical (``zeroplan.formulas.dtypes``)."""
Checkpointing = Literal[CHECKPOINTING]
"""Activation recomputation assumed: none, selective or full (``zeroplan.formulas.activations``)."""


def check_bytes(n: int, what: str) -> None:
    """ValueError when a derived byte count exceeds ``MAX_BYTES`` (e.g. activations of a huge batch)."""
    if n > MAX_BYTES:
        raise ValueError(f"{what}: {n:.3g} bytes per GPU, above the limit of {MAX_BYTES:.3g} (1 EiB)")


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


def checked_call(config: object) -> Callable[[Callable], Callable]:
    """``pydantic.validate_call(config=config)`` whose validator is built at the first call, not at import (two
    public searches of ``zeroplan.planning.plan`` built theirs in 8 ms of every command, issue 16); the body stays
    ``.raw_function``, as validate_call's, for callers whose config has checked every argument already."""

    def decorate(raw: Callable) -> Callable:
        validated: Optional[Callable] = None

        @functools.wraps(raw)
        def call(*args: object, **kwargs: object) -> object:
            nonlocal validated
            if validated is None:
                validated = validate_call(config=config)(raw)
            return validated(*args, **kwargs)

        call.raw_function = raw
        return call

    return decorate


def check_split(gpus: int, model_parallel: int) -> None:
    """ValueError unless N_m divides the GPU count (gpus = N_d x N_m)."""
    if gpus % model_parallel:
        raise ValueError(
            f"model_parallel={model_parallel} does not divide gpus={gpus}: gpus must be N_d x N_m"
        )
