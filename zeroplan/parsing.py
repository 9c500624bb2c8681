"""Parsing and printing of counts and byte sizes. GB = 1e9 bytes (the ZeRO paper's unit); GiB = 2**30."""

from __future__ import annotations

import math
import re

BYTE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
COUNT_SUFFIXES: dict[str, float] = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}

_NUMBER = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def parse_count(text: str, what: str = "params") -> float:
    """'7.5e9', '7.5B', '70b', '1T' -> a positive finite number; ValueError with a one-line message."""
    m = re.fullmatch(_NUMBER + r"\s*([kKmMbBtT]?)", str(text).strip())
    if not m:
        raise ValueError(f"{what}={text!r}: not a number (examples: 7.5e9, 7.5B, 1T)")
    value = float(m.group(1)) * COUNT_SUFFIXES[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}={text!r}: must be a positive finite number")
    return value


def parse_bytes(text: str, what: str = "gpu-memory") -> int:
    """'80GiB', '32GB', '141 GB', '8e10' (bytes) -> whole bytes; ValueError with a one-line message."""
    m = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", str(text).strip())
    unit = m.group(2).lower() if m else ""
    if not m or unit not in BYTE_UNITS and unit != "":
        raise ValueError(f"{what}={text!r}: expected a size such as 80GiB, 32GB or 8e10 (bytes)")
    value = float(m.group(1)) * BYTE_UNITS.get(unit, 1)
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{what}={text!r}: must be a positive size")
    return int(value)


def format_bytes(n: float, unit: str = "GB") -> str:
    """Bytes in ``unit`` with three significant digits at least, e.g. '31.4 GB', '1.88 GB', '4187.5 GB'."""
    value = n / BYTE_UNITS[unit.lower()]
    if value == 0:
        return f"0 {unit}"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{min(decimals, 6)}f} {unit}"


def format_count(n: float) -> str:
    """A parameter count in the paper's style: 7.5B, 128B, 1T."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.0f}"
