"""DeepSpeed's step as an ordered allocation trace (``zeroplan.allocator.step_trace``): its moments walked in
order. Streams (DeepSpeed 0.19.8): ZeRO-1/2 with ``overlap_comm`` allocate the gradient partition
(``grads_in_partition``) inside ``reduce_ipg_grads``'s ``with get_accelerator().stream(self.reduction_stream)``
(``runtime/zero/stage_1_and_2.py``); everything else the profile names (buckets and partitions made in
``__init__``, ZeRO-3's gathered parameters, activations) comes from the default stream. Like the profile's
peak, the trace is on ``settings.device``: on CUDA each tensor rounded to 512-byte blocks and the cuBLAS /
cuBLASLt workspaces held from the first backward on (``profile.device_terms``), on the CPU accelerator neither."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed.settings import Settings, optimizer_class
from zeroplan.formulas.peak import Moment, Term

if TYPE_CHECKING:  # the allocator's trace modules: imported by the first trace, not by every plan (issue 16)
    from zeroplan.allocator.step_trace import AllocTrace

DEFAULT, REDUCTION = 0, 1
STREAMS = {DEFAULT: "default", REDUCTION: "reduction_stream"}


_BLOCK = re.compile(r"^block (\d+) backward")


def chronological(moments: tuple[Moment, ...]) -> list[Moment]:
    """The moments in the order a step meets them: the profile lists the earlier blocks' backward moments
    from block 0 up (``phases.later_blocks_held``, ``zero12._blocks_from_hooks``), and backward reaches block
    L-1 first, so those run of moments is put in descending block order (each block's own order kept). Some
    moments are the largest over ranks (``rank r's grads_in_partition``): the trace walks them in turn, a
    mixture of ranks rather than one rank's timeline (docs/allocator.md)."""
    out: list[Moment] = []
    run: list[tuple[int, int, Moment]] = []
    for m in (*moments, None):
        hit = _BLOCK.match(m.name) if m is not None and m.phase == "backward" else None
        if hit:
            run.append((-int(hit.group(1)), len(run), m))
            continue
        out.extend(moment for *_, moment in sorted(run, key=lambda r: (r[0], r[1])))
        run = []
        if m is not None:
            out.append(m)
    return out


def _reduction_stream(term: Term) -> int:
    return REDUCTION if term.name == "grads_in_partition" else DEFAULT


def alloc_traces(workload: Workload, nd: int, settings: Settings, stat_bytes: int | None = None) -> tuple[AllocTrace, ...]:
    """The trace of ``estimate``'s one row (needs an architecture): of the rank it describes (``settings.rank``,
    else the one it names as peaking highest, ``EngineEstimate.peak_rank``; None: every rank alike)."""
    if workload.spec is None:
        raise ValueError("an allocation trace needs an architecture (activations): give a model")
    if settings.rank is None and optimizer_class(settings) == "DeepSpeedZeroOptimizer":  # the others: every rank alike
        from zeroplan.engines.deepspeed.profile import estimate

        (row,) = estimate(workload, nd, settings, stat_bytes)
        settings = settings.model_copy(update={"rank": row.peak_rank})
    from zeroplan.allocator.step_trace import default_stream, step_trace
    from zeroplan.engines.deepspeed.profile import device_terms, run_moments  # the estimate's own moments
    from zeroplan.engines.deepspeed.wrapper import wrapper_for

    stream_of = _reduction_stream if wrapper_for(settings).uses_reduction_stream(settings) else default_stream
    block, resident = device_terms(workload, settings)
    moments = shared_terms(chronological(run_moments(settings, workload, nd, stat_bytes)))
    return (step_trace(moments, block, resident, stream_of),)


def shared_terms(moments: list[Moment]) -> list[Moment]:
    """``moments`` with each set of equal terms made one object. The trace builder finds a term's tensors once per
    object and diffs consecutive moments by object (``step_trace._Builder.wanted_after``); the profile builds many
    equal terms anew (a 1,024-GPU plan's ZeRO-3 candidate: 1,069 term objects of 302 values, 2.8 times the changes
    between moments), which the builder would take as freed and made again, to the same keys and amounts: the
    events are the same, for less work (tests/test_deepspeed_winners.py compares the traces)."""
    canon: dict[Term, Term] = {}
    by_id: dict[int, Term] = {}  # each object's canonical term, its value hashed once
    out = []
    for m in moments:
        terms = []
        for t in m.terms:
            c = by_id.get(id(t))
            if c is None:
                c = by_id[id(t)] = canon.setdefault(t, t)
            terms.append(c)
        out.append(Moment(m.phase, m.name, tuple(terms)))
    return out
