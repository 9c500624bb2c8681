"""Where ``DeepSpeedZeroOptimizer`` (runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8) reduces gradients and what
a rank holds then: the buckets of the hooks in gradient-ready order (``_hook_buckets``), ZeRO-1's reduction
after backward in parameter order (``_stage1_reduce``), the last bucket's reduction after a backward that
reduced from the hooks (``_epilogue_reduce``), and the partitions whose flat gradient is a view
(``_within_one_parameter``). Split from ``zero12.py``, which asks these."""

from __future__ import annotations

import bisect
import itertools
from functools import lru_cache

from zeroplan.engines.deepspeed.collectives import greedy_buckets
from zeroplan.engines.deepspeed.run import DSRun, _act, _bucket, _pbytes, _states
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.formulas.peak import Moment, Term

GIP_SRC = "runtime/zero/stage_1_and_2.py copy_grads_in_partition"


def _within_one_parameter(run: DSRun, rank: int) -> bool:
    """Whether ``rank``'s slice of the flat group lies within one parameter, no padding: ``get_flat_partition``
    then flattens one tensor, which ``_flatten_dense_tensors`` returns as a view of it (no copy), so the fp32
    gradient the step hands Adam keeps all of ``grads_in_partition`` alive (measured by the differential matrix:
    a Qwen2 13M untied at N_d = 3, ranks 0 and 2, slices of the embedding and of the head, +783,360 elements, the
    parameter's elements outside the slice, at the update: -1.97% before)."""
    first, end = run.flat.range(rank)
    return end - first == 1 and (rank + 1) * run.flat.part <= run.flat.offsets[-1]  # Ψ: where the padding starts


def _stage1_reduce(run: DSRun) -> tuple[Moment, ...]:
    """ZeRO-1 reduces after backward, in parameter order (``reduce_gradients``): each gradient is copied into
    the bucket (its autograd tensor freed); the first bucket holding one of this rank's parameters
    allocates ``grads_in_partition`` (``copy_grads_in_partition``: every parameter overlapping the
    partition, whole, in the model dtype), one moment per rank (``DSRun.first_largest``). A gradient larger than the
    bucket is reduced in place, not copied into it (``reduce_independent_p_g_buckets_and_remove_grads``:
    ``extra_large_param_to_reduce``), and stage 1 clears no gradient after reducing it, so those of the buckets
    reduced so far are still there. Found by the differential matrix (a Qwen2 13M untied, N_d = 3, 2e6-element
    buckets: the embedding's and the head's 5.1M-element gradients; ranks 0 and 1 -11.1% and -9.5%, rank 2,
    which owns the head's partition, -16.2% before)."""
    numels, p = run.numels, _pbytes(run)
    bucket_ends = tuple(itertools.accumulate(greedy_buckets(numels, run.settings.reduce_bucket_size)))
    offsets, states, psi = run.flat.offsets, (*_states(run), *_bucket(run)), sum(numels)
    limit = run.settings.reduce_bucket_size  # the large gradients before parameter i, once (not per rank)
    large_before = (0, *itertools.accumulate(n if n > limit else 0 for n in numels))

    def held(rank: int) -> tuple[int, int]:  # (elements sent when its partition is allocated, large ones kept)
        sent = bucket_ends[bisect.bisect_right(bucket_ends, offsets[run.flat.range(rank)[0]])]  # the bucket of its first
        return sent, large_before[bisect.bisect_right(offsets, sent) - 1]  # parameters i with offsets[i + 1] <= sent

    def extra(rank: int) -> int:
        sent, large = held(rank)
        return (psi - sent + large + run.flat.params_numel(rank)) * p

    owners = tuple(r for r in run.ranks if run.flat.params(r))
    out = []
    for rank in run.first_largest(extra, owners):  # one rank where every rank is described
        sent, large = held(rank)
        out.append(Moment("backward", f"reduce_gradients: rank {rank}'s grads_in_partition", (
            *states,
            Term("autograd gradients not yet bucketed", (psi - sent) * p, "torch autograd (param.grad)"),
            Term("gradients larger than the bucket, reduced in place and kept", large * p,
                 "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce; stage 1 clears no "
                 "gradient)"),
            Term("grads_in_partition", run.flat.params_numel(rank) * p,
                 "runtime/zero/stage_1_and_2.py copy_grads_in_partition (torch.empty of the partition's parameters)"),
            _act("batch (token ids, targets)", run.acts.batch, 2))))  # fmt: skip
    return tuple(out)


def _hook_buckets(run: DSRun) -> tuple[tuple[int, ...], tuple[int, ...], list[int], dict[int, int]]:
    """(gradient-ready order, taken as the reverse of parameter order; the buckets' element counts in that
    order, ``greedy_buckets``; the position in the order of each bucket's first gradient; parameter -> its
    bucket) of ZeRO-2's reduction from the hooks (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``)."""
    return _hook_layout(run.numels, run.settings.reduce_bucket_size)


@lru_cache(maxsize=16)  # read-only: every moment function of a run, and every rank's run, ask for the same
def _hook_layout(numels: tuple[int, ...], bucket: int) -> tuple[tuple[int, ...], tuple[int, ...], list[int], dict[int, int]]:
    """``_hook_buckets`` of parameters of ``numels`` elements and buckets of ``bucket`` elements."""
    order = tuple(reversed(range(len(numels))))  # gradient-ready order, approximated
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


def _epilogue_reduce(run: DSRun) -> tuple[Moment, ...]:
    """Reducing from the hooks, the last bucket is reduced after backward (stage_1_and_2.py
    ``independent_gradient_partition_epilogue`` -> ``reduce_ipg_grads`` -> ``average_tensor`` ->
    ``allreduce_and_scatter`` -> ``allreduce_bucket``: ``self.flatten(bucket)``, a copy of every gradient slice
    of the bucket, all-reduced, then copied back), the activations gone; a rank whose ``grads_in_partition``
    an earlier bucket allocated holds it (``copy_grads_in_partition`` runs after the flattened copy is freed).
    Found by the differential matrix (validate/engines/differential.py, seed 1 draw 3: GPT-2 6.4M untied, ZeRO-2, one
    bucket larger than the model, N_d = 2): both ranks held the states, the bucket and one Ψ-sized fp32 copy,
    14.1% over the last block's backward predicted before."""
    if not run.param_blocks:
        return ()
    _, buckets, _, bucket_of = _hook_buckets(run)
    last, g = len(buckets) - 1, DTYPE_BYTES[run.settings.grad_dtype]
    acts = run.acts
    base = (*_states(run), *run.wrapper.held_between_micro_steps(run), *_bucket(run),
            _act("batch (token ids, targets)", acts.batch, 2), _act("loss", acts.loss),
            Term("flattened copy of the last bucket's gradients", buckets[-1] * g,
                 "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))"))  # fmt: skip

    def early(rank: int) -> bool:  # its grads_in_partition allocated by an earlier bucket
        mine = run.flat.params(rank)
        return bool(mine) and min(bucket_of[i] for i in mine) < last and run.grad_accum == 1

    out = []
    for rank in run.first_largest(lambda r: run.flat.params_numel(r) if early(r) else 0):  # one where all are described
        out.append(Moment("backward", f"reduction after backward, rank {rank}", (*base, *(
            (Term("grads_in_partition", run.flat.params_numel(rank) * _pbytes(run), GIP_SRC),) if early(rank) else ()))))
    return tuple(out)
