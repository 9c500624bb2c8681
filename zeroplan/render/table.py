"""The one text-table formatter, the one convention line, and the number formats of every text view."""

from __future__ import annotations

import math

from zeroplan.parsing import BYTE_UNITS
from zeroplan.policy import ByteRows


def format_table(rows: list[list[str]], left: int = 1) -> list[str]:
    """``rows`` (header first) as aligned lines with a dashed rule under the header; the first ``left``
    columns are left-aligned (labels), the others right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return [line(rows[0]), line(["-" * w for w in widths])] + [line(r) for r in rows[1:]]


def convention_line(bytes_per_param: ByteRows, k: float) -> str:
    """'bytes per parameter: fp16 params 2 + fp16 grads 2 + fp32 master 4 + ... = 16 (K = 12)'."""
    parts = " + ".join(f"{name} {b:g}" for name, b in bytes_per_param)
    total = sum(b for _, b in bytes_per_param)
    return f"bytes per parameter: {parts} = {total:g} (K = {k:g})"


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
