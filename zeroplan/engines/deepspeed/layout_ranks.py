"""What ``DeepSpeedZeroOptimizer``'s moments (``reduce.py``, ``zero12.py``) read of each rank and of the hooks'
buckets, computed once per layout rather than once per rank and per moment function: the buckets of the
gradient hooks (``_hook_layout``), each rank's first bucket (``_first_buckets``), view (``_views``), ZeRO-1
reduction point (``_stage1_held``), overlap (``_params_numels``) and largest slice (``_largest_slices``). A
flat layout is ``terms.flat_group``'s, cached, so these caches hash it by identity; every function is the
per-rank rule it replaced applied to each rank (issue 16: a 405B plan's 1,024 ranks)."""

from __future__ import annotations

import bisect
import itertools
from functools import lru_cache

from zeroplan.engines.deepspeed.collectives import greedy_buckets
from zeroplan.engines.deepspeed.run import DSRun, memo_of, shared_memo
from zeroplan.engines.deepspeed.terms import FlatGroup


@lru_cache(maxsize=8)  # per layout (``terms.flat_group``, hashed by identity)
def _views(flat: FlatGroup) -> tuple[bool, ...]:
    """``_within_one_parameter`` of every rank of ``flat``."""
    return tuple(end - first == 1 and (rank + 1) * flat.part <= flat.offsets[-1]  # Ψ: where the padding starts
                 for rank, (first, end) in enumerate(flat._ranges))  # every rank's ``range``


@lru_cache(maxsize=16)  # per layout (``terms.flat_group``, hashed by identity) and bucket size
def _stage1_held(flat: FlatGroup, limit: int) -> tuple[tuple[int, int], ...]:
    """``_stage1_reduce``'s per rank of ``flat``, buckets of ``limit`` elements: (elements reduced when its
    partition is allocated, at the end of the bucket of its first parameter; of them, the gradients larger than a
    bucket, kept)."""
    numels, offsets = flat.numels, flat.offsets
    bucket_ends = tuple(itertools.accumulate(greedy_buckets(numels, limit)))
    large_before = (0, *itertools.accumulate(n if n > limit else 0 for n in numels))  # once, not per rank
    out = []
    for first, end in flat._ranges:  # every rank's ``range``
        if end == first:  # no parameter (the padding's): no partition allocated
            out.append((0, 0))
            continue
        sent = bucket_ends[bisect.bisect_right(bucket_ends, offsets[first])]  # the bucket of its first
        out.append((sent, large_before[bisect.bisect_right(offsets, sent) - 1]))  # parameters i: offsets[i + 1] <= sent
    return tuple(out)


def _hook_buckets(run: DSRun) -> tuple[tuple[int, ...], tuple[int, ...], list[int], dict[int, int]]:
    """(gradient-ready order, ``DSRun.grad_ready_order``; the buckets' element counts in that order,
    ``greedy_buckets``; the position in the order of each bucket's first gradient; parameter -> its bucket) of
    ZeRO-2's reduction from the hooks (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``).
    Once per run (``memo_of``: hashing the layout's tuples for ``_hook_layout``'s cache costs ~20 us a call)."""
    return memo_of(run, "hook buckets", lambda r: _hook_layout(r.numels, r.settings.reduce_bucket_size,
                                                               r.grad_ready_order))  # type: ignore[return-value]


@lru_cache(maxsize=16)  # read-only: every moment function of a run, and every rank's run, ask for the same
def _hook_layout(numels: tuple[int, ...], bucket: int,
                 order: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], list[int], dict[int, int]]:
    """``_hook_buckets`` of parameters of ``numels`` elements, buckets of ``bucket`` elements, gradients ready in
    ``order``."""
    buckets = greedy_buckets(tuple(numels[i] for i in order), bucket)
    first_of_bucket, at = [], 0
    for size in buckets:
        first_of_bucket.append(at)
        at_numel = 0
        while at_numel < size:
            at_numel += numels[order[at]]
            at += 1
    bucket_of = {}
    for b, start in enumerate(first_of_bucket):
        end = first_of_bucket[b + 1] if b + 1 < len(first_of_bucket) else len(order)
        for i in order[start:end]:
            bucket_of[i] = b
    return order, buckets, first_of_bucket, bucket_of


def _last_in_blocks(run: DSRun) -> int:
    """The last parameter (``named_parameters`` order) inside a decoder block; -1 without blocks. Once per run."""
    return memo_of(run, "last in blocks", lambda r: shared_memo("last in blocks", (r.param_blocks,), (), lambda: max(
        (i for i, j in enumerate(r.param_blocks) if j >= 0), default=-1)))  # type: ignore[return-value]


def _first_in_blocks(run: DSRun) -> int | None:
    """The first parameter (``named_parameters`` order) inside a decoder block; None without one. Once per layout."""
    return memo_of(run, "first in blocks", lambda r: shared_memo("first in blocks", (r.param_blocks,), (), lambda: next(
        (i for i, j in enumerate(r.param_blocks) if j >= 0), None)))  # type: ignore[return-value]


def _rank_first_buckets(run: DSRun) -> tuple[int, ...]:
    """Per rank (all N_d), the first bucket in gradient-ready order holding one of the parameters its slice of
    the flat group overlaps (``_hook_buckets``); -1 for a rank overlapping none (the padding's)."""
    return _first_buckets(run.flat, run.settings.reduce_bucket_size, run.grad_ready_order)


@lru_cache(maxsize=16)  # per layout and bucket size: every run of a candidate, and candidates alike, ask
def _first_buckets(flat: FlatGroup, bucket: int, order: tuple[int, ...]) -> tuple[int, ...]:
    """``_rank_first_buckets`` of ``flat`` (a ``terms.flat_group``, hashed by identity) for buckets of ``bucket``
    elements, gradients ready in ``order``: the least bucket over each rank's range of parameters."""
    bucket_of = _hook_layout(flat.numels, bucket, order)[3]
    by_param = [bucket_of[i] for i in range(len(flat.numels))]
    return tuple([min(by_param[first:end]) if end > first else -1  # a list first: no generator per rank
                  for first, end in flat._ranges])


@lru_cache(maxsize=8)  # per layout (``terms.flat_group``, hashed by identity)
def _params_numels(flat: FlatGroup) -> tuple[int, ...]:
    """``FlatGroup.params_numel`` of every rank of ``flat``."""
    return flat._params_numels  # every rank's, the layout's own tuple


@lru_cache(maxsize=8)  # per layout (``terms.flat_group``, hashed by identity): every rank of every candidate asks
def _largest_slices(flat: FlatGroup) -> tuple[int, ...]:
    """The elements of the largest single parameter's slice in each rank's partition of ``flat``."""
    offsets, part = flat.offsets, flat.part
    return tuple([max([min(offsets[i + 1], (rank + 1) * part) - max(offsets[i], rank * part)
                       for i in flat.params(rank)], default=0) for rank in range(flat.nd)])  # lists: no generators
