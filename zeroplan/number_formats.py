"""The number formats of every text view: bytes in a unit, parameter counts in the paper's style.

Below the planner (it words its notes with them) and the renderers (``zeroplan.render.table`` re-exports
them); the byte units are parsing's (``zeroplan.parsing.BYTE_UNITS``), so a size prints as it is read.
"""

from __future__ import annotations

import math

from zeroplan.parsing import BYTE_UNITS


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
