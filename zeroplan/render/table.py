"""The one text-table formatter and the one convention line; the number formats of every text view live in
``zeroplan.number_formats`` (the planner words a note with them too) and are re-exported here."""

from __future__ import annotations

from typing import Optional

from zeroplan.number_formats import format_bytes, format_count  # noqa: F401 (re-exported)
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


def peak_phase_cell(phase: str, rank: Optional[int]) -> str:
    """The peak's phase as the tables print it, with the worst rank where ranks differ (``peak_rank``)."""
    return phase.replace("_", " ") + ("" if rank is None else f", rank {rank}")
