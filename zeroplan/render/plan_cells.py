"""The cells of ``zeroplan plan``'s tables (``render/plan.py``): sizes, seconds and counts as printed, and the
reserved column with its footnote, ``—`` on a row not replayed (``planning/reserved_fit.py live_over``)."""

from __future__ import annotations

from typing import Optional

from zeroplan.allocator.reserved import NO_CUDA_ALLOCATOR
from zeroplan.planning.records import Plan, PlanOption
from zeroplan.render.table import format_bytes, format_count

NOT_REPLAYED_CELL = "—"
"""The reserved cell of a row whose allocation trace was not replayed (``PlanOption.not_replayed``)."""


def seconds_cell(s: Optional[float]) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def size_cell(n: Optional[int], unit: str) -> str:
    return "-" if n is None else format_bytes(n, unit)


def count_cell(n: Optional[int]) -> str:
    return "no limit" if n is None else format_count(n)


def reserved_cell(o: PlanOption, unit: str) -> str:
    """The reserved column: ``—`` where the row was not replayed, "-" without a trace (offload, no model)."""
    return NOT_REPLAYED_CELL if o.not_replayed else size_cell(o.reserved and o.reserved.reserved_bytes, unit)


def fits_cell(o: PlanOption) -> str:
    """The fits column: yes, no, or ``—`` where the fit was not decided (a row after the recommendation, not
    replayed: ``planning/reserved_fit.py AFTER_FIT``)."""
    return NOT_REPLAYED_CELL if o.fits is None else "yes" if o.fits else "no"


def not_replayed_note(p: Plan) -> list[str]:
    """The footnote under the table where a row's reserved cell is ``—``: why, one sentence per reason, in the
    order the rows first give it."""
    whys = dict.fromkeys(o.not_replayed for o in p.options if o.not_replayed)
    return [f"reserved {NOT_REPLAYED_CELL}: {why}." for why in whys]


CUDA_FIT = (
    "fits: reserved, the caching allocator's max_memory_reserved for the engine's allocation trace of a training "
    "step (docs/allocator.md), within the GPU's memory less the headroom (0 by default); the CUDA context and "
    "NCCL buffers are not counted."
)
CPU_FIT = (
    "fits: the peak of live bytes, within the memory less the headroom (0 by default): a CPU run (--device cpu) "
    "has no CUDA caching allocator to replay (reserved —)."
)


def fit_sentence(p: Plan) -> str:
    """The engine plan's note on what "fits" compares: reserved bytes, or the live peak on a CPU run
    (``allocator.reserved.replayed_on``)."""
    return CPU_FIT if any(o.not_replayed == NO_CUDA_ALLOCATOR for o in p.options) else CUDA_FIT
