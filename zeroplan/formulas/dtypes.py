"""The one table that turns element counts into bytes.

Names accept the spellings users already type: ours (``bf16``), PyTorch's (``torch.bfloat16``,
``bfloat16``, ``half``) and DeepSpeed's (``fp16``/``bf16`` config sections).
"""

from __future__ import annotations

BYTES_PER_ELEMENT: dict[str, int] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
}

_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "uint8": "int8",
}


def canonical_dtype(name: str) -> str:
    """Map any accepted spelling to a key of ``BYTES_PER_ELEMENT``; raise ValueError otherwise."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in BYTES_PER_ELEMENT:
        known = ", ".join(sorted(BYTES_PER_ELEMENT))
        raise ValueError(f"unknown dtype {name!r}: expected one of {known}")
    return key


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name."""
    return BYTES_PER_ELEMENT[canonical_dtype(name)]
