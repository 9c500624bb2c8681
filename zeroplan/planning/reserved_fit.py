""""Fits" on what runs out: a configuration fits when the caching allocator's reserved bytes (the engine's
allocation trace replayed under ``PYTORCH_CUDA_ALLOC_CONF``: ``zeroplan.allocator.reserved``) are within the
card's memory less ``--headroom`` (0 by default). The CUDA context and NCCL's buffers lie outside the
allocator and are not counted: the context is not measured yet and NCCL's channels depend on the topology
(``zeroplan.formulas.outside_allocator``); ``--headroom`` keeps room for them. An option without a trace (an
offload option) fits on its peak of live bytes, one without an architecture on its model states
(``allocator.reserved.fit_bytes``, the one rule).

A row whose live peak alone exceeds the budget is not replayed (``live_over``): the allocator reserves at least
what it has allocated, and allocates at least the live peak (every request rounded up to its block), so its
reserved bytes cannot fit either; "fits: no" is settled without the replay, its reserved bytes print ``—``
(JSON ``reserved_bytes: null`` with ``reserved_not_replayed``, ``NOT_REPLAYED``).

An engine's plan (fsdp2, deepspeed: candidates in the engine's order, the first that fits recommended) replays
rows in order up to the first that fits, and no further (``AFTER_FIT``): a later row's reserved bytes cannot change
the recommendation, so they print ``—`` and its fit ``—`` (JSON ``reserved_bytes`` and ``fits`` null) unless
``--replay-all`` (``PlanConfig.replay_all``) asks for every row, as the mesh search already stops at its first
fitting candidate. Decided 2026-12-03 (issue 16's plan-speed row): the allocation traces and replays were two
thirds of the slowest plan's CPU time, and half of them were of rows after the recommendation. The reference
engine's plan (the ladder of stages and offload) replays every row: its recommendation walks a ladder that
``--offload`` cuts, and its traces are few.

When the live bytes fit and the reserved ones do not, fragmentation (reserved minus allocated: blocks cached
on one stream or pool and not reusable by another request) is what does not fit, and ``fragmentation_advice``
says what to change: ``expandable_segments:True`` when the same trace then fits, else a smaller micro-batch
or smaller buckets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from zeroplan.allocator.reserved import ReservedEstimate, reserved_of
from zeroplan.number_formats import format_bytes

if TYPE_CHECKING:  # the allocator's trace modules: imported by the first trace, not by every plan (issue 16)
    from zeroplan.allocator.step_trace import AllocTrace

EXPANDABLE = "expandable_segments:True"
"""The ``PYTORCH_CUDA_ALLOC_CONF`` option that grows one segment per stream instead of caching many
(docs/allocator.md)."""


NOT_REPLAYED = "not replayed: its live peak alone exceeds the GPU less the headroom; reserved >= live"
"""Why a row's reserved bytes are ``—`` (``live_over``): the plan's footnote and JSON ``reserved_not_replayed``."""


AFTER_FIT = "not replayed: a configuration above it fits and is recommended, which no later row changes (fits — too); " \
    "--replay-all replays every row"
"""Why a row after the recommendation has no reserved bytes and no fit (an engine's plan without ``--replay-all``):
the plan's footnote and JSON ``reserved_not_replayed``."""


def live_over(peak, budget_bytes: Optional[int]) -> bool:
    """Whether a row's peak of live bytes (``PeakEstimate``; None: no peak) alone exceeds ``budget_bytes`` (None: no
    budget): then its allocation trace is neither built nor replayed (reserved >= allocated >= live, so it cannot
    fit), the one rule every plan asks (``engine_plan``, ``plan``; ``estimate`` replays the one configuration
    asked, always)."""
    return peak is not None and budget_bytes is not None and peak.peak_bytes > budget_bytes


def fit_quantity(alloc_conf: Optional[str]) -> str:
    """What "fits" compares, in words: reserved bytes under ``alloc_conf`` ("": torch's defaults), or (None: no
    allocation trace) the peak of live bytes."""
    if alloc_conf is None:
        return "the peak of live bytes per GPU"
    conf = f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf}" if alloc_conf else "torch's default PYTORCH_CUDA_ALLOC_CONF"
    return (f"the allocator's reserved bytes per GPU (max_memory_reserved of the engine's allocation trace under "
            f"{conf}, docs/allocator.md; the CUDA context and NCCL buffers not counted)")  # fmt: skip


def with_expandable(alloc_conf: str) -> str:
    """``alloc_conf`` with ``expandable_segments:True`` (replacing any ``expandable_segments`` given)."""
    parts = [p for p in alloc_conf.split(",") if p.strip() and not p.strip().startswith("expandable_segments")]
    return ",".join([*parts, EXPANDABLE])


def fragmentation_advice(label: str, peak_bytes: int, reserved: ReservedEstimate, trace: AllocTrace,
                         budget_bytes: int, micro_batch: int) -> Optional[str]:  # fmt: skip
    """What to change when ``label``'s live bytes fit ``budget_bytes`` and its reserved bytes do not (None
    otherwise): ``expandable_segments:True`` if the trace then fits, else a smaller micro-batch or buckets."""
    if not peak_bytes <= budget_bytes < reserved.reserved_bytes:
        return None
    frag = format_bytes(reserved.fragmentation_bytes, "GiB")
    head = (f"{label}: its live bytes fit ({format_bytes(peak_bytes, 'GiB')}) but its reserved bytes do not "
            f"({format_bytes(reserved.reserved_bytes, 'GiB')}; {frag} of fragmentation)")  # fmt: skip
    if EXPANDABLE not in reserved.alloc_conf:
        conf = with_expandable(reserved.alloc_conf)
        grown = reserved_of(trace, conf)
        if grown.reserved_bytes <= budget_bytes:
            return (f"{head}: set PYTORCH_CUDA_ALLOC_CONF={conf} (--alloc-conf), which reserves "
                    f"{format_bytes(grown.reserved_bytes, 'GiB')} and fits")  # fmt: skip
        head += f"; with {EXPANDABLE} still {format_bytes(grown.reserved_bytes, 'GiB')}"
    smaller = f"a micro-batch below {micro_batch} (--micro-batch; --grad-accum keeps the batch)" if micro_batch > 1 \
        else "a shorter sequence (--seq-len)"
    return f"{head}: {smaller}, or smaller communication buckets"


def first_fragmentation(options, traces, budget_bytes: int, micro_batch: int) -> Optional[str]:
    """``fragmentation_advice`` for the first of ``options`` (``PlanOption``s, cheapest first; ``traces``: each
    one's allocation trace or None) whose live bytes fit and whose reserved bytes do not, before any option
    that fits; None when there is none."""
    for o, trace in zip(options, traces):
        if o.fits:
            return None
        if o.reserved is not None and trace is not None:
            label = o.label if o.candidate is not None else f"ZeRO stage {o.label}"
            advice = fragmentation_advice(label, o.peak.peak_bytes, o.reserved, trace, budget_bytes, micro_batch)
            if advice is not None:
                return advice
    return None
