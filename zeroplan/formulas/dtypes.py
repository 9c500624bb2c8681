"""The one table that turns element counts into bytes.

Names accept the spellings users already type: ours (``bf16``), PyTorch's (``torch.bfloat16``,
``bfloat16``, ``half``) and DeepSpeed's (``fp16``/``bf16`` config sections). The table holds every dtype an
engine profile allocates or sends (the DeepSpeed profile's fp64 gradient norm, int32 overflow buffer and
bool inf/nan tracker among them); a precision policy may name only ``POLICY_DTYPES`` (``canonical_dtype``).
"""

from __future__ import annotations

from functools import lru_cache

BYTES_PER_ELEMENT: dict[str, int] = {
    "fp64": 8,
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int32": 4,
    "int8": 1,
    "bool": 1,
}

_ALL: tuple[str, ...] = tuple(BYTES_PER_ELEMENT)
POLICY_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8", "int8")
"""The dtypes a precision policy (parameters, gradients, optimizer states, FSDP2's mixed precision) may name."""

_ALIASES: dict[str, str] = {
    "float64": "fp64",
    "double": "fp64",
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "uint8": "int8",
}


def _key(name: object) -> str:
    key = str(name).strip().lower().removeprefix("torch.")
    return _ALIASES.get(key, key)


@lru_cache(maxsize=256)  # a plan asks for the same few names tens of thousands of times
def _lookup(name: object, allowed: tuple[str, ...]) -> str:
    key = _key(name)
    if key not in allowed:
        raise ValueError(f"unknown dtype {name!r}: expected one of {', '.join(sorted(allowed))}")
    return key


def dtype_name(name: str) -> str:
    """Any accepted spelling of a dtype of the table as its key (``torch.float64`` -> ``fp64``); ValueError
    otherwise."""
    return _lookup(name, _ALL) if isinstance(name, str) else _lookup.__wrapped__(name, _ALL)


def canonical_dtype(name: str) -> str:
    """Map any accepted spelling of a policy dtype to its key (``POLICY_DTYPES``); raise ValueError otherwise."""
    return _lookup(name, POLICY_DTYPES) if isinstance(name, str) else _lookup.__wrapped__(name, POLICY_DTYPES)


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (any dtype of the table)."""
    return BYTES_PER_ELEMENT[dtype_name(name)]
