"""``allreduce_bucket``'s flattened copy (runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8): which buckets
ZeRO-1/2 copy when they send them, and how much."""

from __future__ import annotations

from collections.abc import Sequence

from zeroplan.engines.deepspeed.run import DSRun
from zeroplan.engines.deepspeed.terms import FlatGroup


def flattened_copy_numel(run: DSRun, params: Sequence[int]) -> int:
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


def copy_numel(flat: FlatGroup, limit: int, params: Sequence[int]) -> int:
    """``flattened_copy_numel`` of the flat group ``flat`` reducing in buckets of ``limit`` elements. A bucket
    whose elements all lie within one partition is one slice, copied by no group: 0 without the walk."""
    offsets, part = flat.offsets, flat.part
    if not params:
        return 0
    ends = (params[0], params[-1]) if isinstance(params, range) else params  # a range's least and most: its ends
    lo, hi = offsets[min(ends)], offsets[max(ends) + 1]  # from its lowest element to its highest
    if hi <= lo or lo // part == (hi - 1) // part:
        return 0
    return walked_copy_numel(flat, limit, params)


def walked_copy_numel(flat: FlatGroup, limit: int, params: Sequence[int]) -> int:
    """``copy_numel`` by walking the bucket's slices and groups (the fast path's reference: test_deepspeed_fast_paths)."""
    offsets, part = flat.offsets, flat.part
    slices: list[list[int]] = []  # [partition, elements], in the bucket's order
    for i in params:
        lo, hi = offsets[i], offsets[i + 1]
        while lo < hi:
            r = lo // part
            cut = min(hi, (r + 1) * part)
            if slices and slices[-1][0] == r:
                slices[-1][1] += cut - lo
            else:
                slices.append([r, cut - lo])
            lo = cut
    copy, count, numel = 0, 0, 0
    for _, n in slices:
        count, numel = count + 1, numel + n
        if numel > limit:
            copy, count, numel = max(copy, numel if count > 1 else 0), 0, 0
    return max(copy, numel if count > 1 else 0)
