"""``allreduce_bucket``'s flattened copy (runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8): which buckets
ZeRO-1/2 copy when they send them, and how much."""

from __future__ import annotations

from collections.abc import Iterable

from zeroplan.engines.deepspeed.run import DSRun
from zeroplan.engines.deepspeed.terms import FlatGroup


def flattened_copy_numel(run: DSRun, params: Iterable[int]) -> int:
    """Elements of the largest copy ``allreduce_bucket`` makes of a bucket of ``params`` (in its order), as
    stage_1_and_2.py ``average_tensor`` sends it: the bucket's gradients cut at the partitions' boundaries, a
    run of consecutive slices bound for one partition merged into one; ``allreduce_and_scatter`` groups the
    slices in order, sending a group once it holds more than ``reduce_bucket_size`` elements; ``self.flatten``
    (torch ``_flatten_dense_tensors``: ``flatten_dense_tensors`` returns a single contiguous tensor's view and
    ``cat``s two or more) copies only a group of two or more slices. Found by the differential matrix (seed 3
    draw 15, generator 4: Llama 10.5M untied, ZeRO-2, 3e6-element buckets, N_d = 2: the head's 4.8M-element
    gradient, alone in its bucket and within rank 1's partition, is all-reduced in place; +1.46% on rank 0
    before); seed 2 draw 5's head (5.4M elements over two partitions at N_d = 4) is copied."""
    return copy_numel(run.flat, run.settings.reduce_bucket_size, params)


def copy_numel(flat: FlatGroup, limit: int, params: Iterable[int]) -> int:
    """``flattened_copy_numel`` of the flat group ``flat`` reducing in buckets of ``limit`` elements: the bucket's
    slices (a parameter cut at the partitions' boundaries, the first merged into the slice before it where both
    lie in one partition) fed one at a time into the groups, without a list of them (equal to the walk that
    listed them first on random layouts: tests/test_deepspeed_fast_paths.py)."""
    offsets, part = flat.offsets, flat.part
    copy = count = numel = 0  # the largest group copied; the group being filled: its slices, its elements
    pr, pn = -1, 0  # the slice pending (the next may merge into it): its partition, its elements
    for i in params:
        lo, hi = offsets[i], offsets[i + 1]
        if lo >= hi:
            continue
        r, last = lo // part, (hi - 1) // part
        n = (hi if r == last else (r + 1) * part) - lo  # the parameter's first slice
        if r == pr:
            pn += n
        else:
            if pn:  # the pending slice joins the group
                count, numel = count + 1, numel + pn
                if numel > limit:
                    copy, count, numel = max(copy, numel if count > 1 else 0), 0, 0
            pr, pn = r, n
        for r in range(r + 1, last + 1):  # its other slices: whole partitions, then the last one's part
            count, numel = count + 1, numel + pn
            if numel > limit:
                copy, count, numel = max(copy, numel if count > 1 else 0), 0, 0
            pr, pn = r, (part if r < last else hi - r * part)
    if pn:
        count, numel = count + 1, numel + pn
        if numel > limit:
            copy, count, numel = max(copy, numel if count > 1 else 0), 0, 0
    return max(copy, numel if count > 1 else 0)


def range_copy_numel(part: int, limit: int, lo: int, hi: int) -> int:
    """``copy_numel`` of a bucket holding consecutive parameters in their order (``range(first, end)``: ZeRO-1's
    reduction after backward), whose elements are the flat group's [``lo``, ``hi``): its slices, the parameters cut at
    the partitions' boundaries and a run bound for one partition merged, are then the bucket's pieces of each
    partition, fed into the groups as ``copy_numel`` feeds them (a speed-up, no rule: no pass over the parameters;
    equal to it on random layouts, tests/test_deepspeed_fast_paths.py)."""
    if part > limit:  # a whole partition's piece closes a group alone, and so does one after it: only the first
        end = (lo // part + 1) * part  # piece, if it fits, is copied with the next (a speed-up, no rule: the loop
        return 0 if end >= hi or end - lo > limit else min(hi, end + part) - lo  # below gives the same)
    copy = count = numel = 0
    while lo < hi:
        end = min(hi, (lo // part + 1) * part)  # this partition's piece
        count, numel, lo = count + 1, numel + end - lo, end
        if numel > limit:
            copy, count, numel = max(copy, numel if count > 1 else 0), 0, 0
    return max(copy, numel if count > 1 else 0)
