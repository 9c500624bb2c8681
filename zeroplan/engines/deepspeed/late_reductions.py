"""ZeRO-1/2 (runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8): the reductions after every block's backward whose
flattened copy (``flat_copy.flattened_copy_numel``) or ``grads_in_partition`` can make the phase's peak, the
activations gone: ZeRO-1's after backward (``reduce_gradients``: flattened_buckets.py, its names re-exported here) and a
bucket sent at an embedding's hook."""

from __future__ import annotations

import itertools

import zeroplan.engines.deepspeed.boundary as B
from zeroplan.engines.deepspeed.flattened_buckets import (ALIVE_SRC, _FlattenedBuckets, _RankFacts,  # noqa: F401
                                                          _flattened_buckets, _flattened_tails, stage1_flattened,
                                                          stage1_flattened_listed)
from zeroplan.engines.deepspeed.layout_ranks import _first_in_blocks, _hook_buckets, _params_numels, _rank_first_buckets
from zeroplan.engines.deepspeed.reduce import GIP_SRC, hook_copy_term
from zeroplan.engines.deepspeed.run import DSRun, _act, _bucket, _pbytes, _states, shared_memo
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.formulas.peak import Moment, Term


def embedding_hook_reduced(run: DSRun) -> tuple[Moment, ...]:
    """Reducing from the hooks, a bucket sent at an embedding's gradient hook (the first gradient that does not
    fit, ``reduce_independent_p_g_buckets_and_remove_grads``), after every block's backward, the activations
    gone: the embedding's gradient (tied: the sum, ``zero12.py _tied_embedding_backward``) is alive beside the
    states and the buckets while ``allreduce_bucket`` flattens the bucket sent (``flattened_copy_numel``); then,
    the copy freed, a rank whose first bucket it is allocates its ``grads_in_partition``, and a rank whose
    first bucket went earlier holds its own. The rank holding the most; one moment per such bucket. Found by
    the differential matrix (seed 3 draw 15, generator 4: Llama 10.5M untied, ZeRO-2, N_d = 2; MemTracker at
    rank 0's backward peak, in ``copy_grads_in_partition`` at the token embedding's hook: the states, both
    buckets, the embedding's 19,125,504-B gradient and rank 0's 21,080,832-B ``grads_in_partition``)."""
    first_block = _first_in_blocks(run)
    if first_block is None:
        return ()
    order, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    p, acts = _pbytes(run), run.acts
    held = run.wrapper.held_between_micro_steps(run)
    base = (*_states(run), *held, *(t for t in _bucket(run) if t not in held),
            _act("batch (token ids, targets)", acts.batch, 2), _act("loss", acts.loss))
    firsts, gips = _rank_first_buckets(run), _params_numels(run.flat)  # a rank overlapping no parameter: -1
    out = []
    for b in range(len(buckets) - 1):
        hook = order[first_of_bucket[b + 1]]
        if hook >= first_block or run.param_blocks[hook] >= 0:
            continue
        grad = Term("the embedding's gradient at its hook", run.numels[hook] * p,
                    "autograd (embedding backward) -> runtime/zero/stage_1_and_2.py "
                    "reduce_independent_p_g_buckets_and_remove_grads")
        copy = hook_copy_term(run, b)
        rank = _embedding_hook_winner(run.ranks, firsts, gips, b, p, copy.bytes)
        own: tuple[Term, ...] = (copy,)  # a rank with no grads_in_partition yet
        if rank is not None:
            gip = Term("grads_in_partition", gips[rank] * p, GIP_SRC)
            # allocated earlier, alive through the copy; or allocated once the copy is freed: the larger of the two
            own = (gip, copy) if firsts[rank] < b else (max(gip, copy, key=lambda t: t.bytes),)
        out.append(Moment("backward", f"embedding's hook, bucket {b} sent",
                          (*B.held_at(run, base, B.position(run, hook) + 1), grad, *own)))  # ZeRO-1's boundary
    return tuple(out)


def _embedding_hook_winner(ranks: tuple[int, ...] | range, firsts: tuple[int, ...], gips: tuple[int, ...], b: int,
                           p: int, copy: int) -> int | None:
    """``embedding_hook_reduced``'s rank holding the most at bucket ``b`` (None: the option of no rank's partition),
    from integer sums less what every option holds (the states, the buckets, the embedding's gradient), the first
    largest in the options' order: none's (the copy); each rank of ``ranks`` whose first bucket is earlier (its
    grads_in_partition and the copy) or ``b`` (the larger of the two). It was every rank's terms built and summed
    (~35 % of a ZeRO-2 1,024-GPU run's moments); tests/test_deepspeed_winners.py checks it against that loop."""
    best, winner = copy, None
    for r in ranks:
        first = firsts[r]
        if first < 0 or first > b:
            continue
        total = gips[r] * p + copy if first < b else max(gips[r] * p, copy)
        if total > best:
            best, winner = total, r
    return winner


def blocks_bucket_at_embedding_hook(run: DSRun) -> tuple[Moment, ...]:
    """ZeRO-2 from the hooks accumulating gradients, an embedding's gradient starting a bucket: its hook
    (``reduce_independent_p_g_buckets_and_remove_grads``: it does not fit) reduces the
    previous bucket (``reduce_ipg_grads`` -> ``average_tensor`` -> ``allreduce_bucket``: ``self.flatten(bucket)``, a
    copy of its gradients) while that embedding gradient waits beside it, the blocks' activations gone; from the
    second micro-step on each rank holds two ``grads_in_partition`` (``_blocks_bucket_at_embedding_hook_accumulating``).
    Without accumulation the same reduction is ``embedding_hook_reduced``'s bucket sent at the embedding's hook (its
    flattened copy, ``flattened_copy_numel``, is the whole bucket where it spans two partitions or more, none within
    one, as here; and its ranks' options hold this one's), folded there. Found by the differential matrix
    (generator 5, 1-241: DeepSeek-V3 6.4M untied, N_d = 2, a 1,298,880-element bucket holding every block's
    gradients, the embedding's 2,597,760 larger): rank 1 at 97,856,760 B, 3,210,440 B (3.28%) over the reduction
    after backward predicted before (MemTracker's live storages at rank 1's peak: ``aten.cat`` of the bucket's
    1,242,432 elements beside ``embedding_dense_backward``'s output; with 400,000-element buckets the previous
    bucket, block 0's, lies in rank 0's partition alone: no copy, as measured). GPT-2's ``wpe`` goes into the
    blocks' bucket and ``wte`` alone starts one (seed 6 draw 4, generator 4: 8.2M untied, G = 2, N_d = 2; backward
    -12.30 % and -5.01 % when only the first embedding in hook order was looked at; the live storages at both
    ranks' peak, in wte's hook of the second micro-step: two ``grads_in_partition``, wte's 9,074,688-B gradient, the
    bucket and, on rank 1, the 7,489,536-B flattened copy; benchmarks/differential_trace.py)."""
    if not (run.param_blocks and run.settings.partition_gradients and run.grad_accum > 1):
        return ()
    first_block = _first_in_blocks(run) or 0
    order, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    embeddings = [i for i in range(first_block) if run.param_blocks[i] < 0]
    if not embeddings or run.tied_head:  # tied: zero12.py _tied_embedding_backward (the sum, larger)
        return ()
    out: list[Moment] = []
    for at in (k for k in range(1, len(buckets)) if order[first_of_bucket[k]] in embeddings):
        hook = order[first_of_bucket[at]]
        # the bucket's slices by destination rank, merged while consecutive (average_tensor); one slice is flattened
        # as a view (torch flatten_dense_tensors of one tensor), so a copy is made only for a bucket over 2+ partitions
        previous = set(order[first_of_bucket[at - 1]:first_of_bucket[at]])
        if sum(1 for r in range(run.nd) if previous.intersection(run.flat.params(r))) < 2:
            continue
        p, g = _pbytes(run), DTYPE_BYTES[run.settings.grad_dtype]
        common = (*_states(run), *_bucket(run), _act("batch (token ids, targets)", run.acts.batch, 2),
                  _act("loss", run.acts.loss), Term("the embedding's gradient, waiting at its hook",
                                                    run.numels[hook] * p, "torch autograd AccumulateGrad"))  # fmt: skip
        copy = Term("flattened copy of the previous bucket's gradients", buckets[at - 1] * g,
                    "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))")
        earlier = [r for r in run.ranks if run.flat.params(r) and min(bucket_of[i] for i in run.flat.params(r)) < at - 1]  # fmt: skip
        out.extend(_blocks_bucket_at_embedding_hook_accumulating(run, common, copy, earlier))
    return tuple(out)


def _blocks_bucket_at_embedding_hook_accumulating(run: DSRun, common: tuple[Term, ...], copy: Term,
                                                    earlier: list[int]) -> tuple[Moment, ...]:
    """``blocks_bucket_at_embedding_hook`` from the second micro-step on, per rank: two ``grads_in_partition``. Each
    micro-step's epilogue drops the buffer (``_release_ipg_buffers``) but keeps views of it (``all_grad_tensors``:
    the partition's ``param.grad``, summed into in place, dropped at the boundary), so the next micro-step's first
    ``copy_grads_in_partition`` allocates another beside it. A rank whose new one an earlier bucket allocated holds
    it beside the copy; one allocated by this reduction comes after the copy is freed (the larger of the two).
    Found by the differential matrix (generator 5, 1-19: Gemma 2 19.9M untied, N_d = 2, G = 2, overlap_comm,
    4,327,680-element buckets; -8.57 % / -10.44 % with one buffer): the second micro-step's live storages at the
    embedding's hook (the listing of benchmarks/ds_moe12_rows.py): rank 0 two 40,015,872 B buffers, no copy;
    rank 1 two 39,722,496 B buffers and the 10,200,576 B copy (now 308 B and 692 B over). At G = 3 the third
    micro-step's peak is the second's (+512 B in the same listing): still two buffers."""
    p = _pbytes(run)

    def extra(r: int) -> tuple[Term, ...]:  # a rank with no parameter (gip 0): the copy alone
        gip = run.flat.params_numel(r) * p
        new = Term("grads_in_partition (this micro-step's)", gip, GIP_SRC)
        kept = Term("grads_in_partition of the earlier micro-steps (all_grad_tensors' views, to the boundary)", gip,
                    "runtime/zero/stage_1_and_2.py independent_gradient_partition_epilogue (all_grad_tensors)")
        return (kept, *((new, copy) if r in earlier else (max(new, copy, key=lambda t: t.bytes),)))

    return tuple(Moment("backward", f"embedding's hook reduces the blocks' bucket, rank {r} (accumulating)",
                        (*common, *extra(r)))
                 for r in run.first_largest(lambda r: sum(t.bytes for t in extra(r))))  # fmt: skip


def epilogue_large_gradient(run: DSRun) -> tuple[Moment, ...]:
    """Reducing from the hooks (G = 1), the last bucket one gradient larger than the bucket (the token embedding's,
    last in hook order): it is reduced in place after backward (``independent_gradient_partition_epilogue`` ->
    ``reduce_ipg_grads``: ``extra_large_param_to_reduce``) and copied into the partition of the rank owning it
    (``copy_grads_in_partition``), which allocates that rank's ``grads_in_partition`` there if no earlier bucket did,
    the gradient alive beside it; stage 1 also keeps every other gradient larger than the bucket outside the rank's
    partition (reduced in place, never cleared: ``embedding_moments.py stage1_embedding_hook_kept``'s rule).
    Found by the differential matrix (seed 6 draw 5, generator 4: GPT-2 23.8M untied, ZeRO-1 ``overlap_comm``,
    4,688,960-element buckets, checkpointed, N_d = 4; rank 0, whose partition is ``wte`` alone: the live storages at
    its backward peak, benchmarks/differential_trace.py: the head's and wte's 37,511,680-B gradients, its
    37,511,680-B ``grads_in_partition`` from ``reduce_ipg_grads``, both buckets and the states; -11.59 % before, now
    within 8 B)."""
    s = run.settings
    if not run.param_blocks or run.grad_accum > 1:
        return ()
    order, buckets, first_of_bucket, _ = _hook_buckets(run)
    last = len(buckets) - 1
    if last < 1 or len(order) - first_of_bucket[last] != 1 or run.numels[order[-1]] <= s.reduce_bucket_size:
        return ()
    big, p, numels = order[-1], _pbytes(run), run.numels
    base = (*_states(run), *_bucket(run), _act("batch (token ids, targets)", run.acts.batch, 2),
            _act("loss", run.acts.loss),
            Term("the last gradient, larger than the bucket, reduced after backward", numels[big] * p,
                 "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce)"))  # fmt: skip
    copy = hook_copy_term(run, last, "the last bucket's")
    firsts = _rank_first_buckets(run)
    # the other large gradients' elements before each parameter: a rank's kept ones (those outside its range) from
    # two lookups, not a pass over them per rank (1,024 ranks of ~900 such gradients: a 405B plan at 5e6 buckets)
    large_before = shared_memo("epilogue large", (numels,), (s.reduce_bucket_size, big), lambda: (0, *itertools.accumulate(
        [n if n > s.reduce_bucket_size and i != big else 0 for i, n in enumerate(numels)])))  # once per layout, bucket

    def kept_numel(r: int) -> int:
        first, end = run.flat.range(r)
        return large_before[-1] - (large_before[end] - large_before[first])

    def own(r: int) -> tuple[Term, ...]:
        kept = () if s.partition_gradients else (Term(
            "gradients larger than the bucket, outside the partition (kept to the step)", kept_numel(r) * p,
            "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce; stage 1 clears none)"),)
        if firsts[r] < 0:
            return (copy, *kept)
        gip = Term("grads_in_partition", run.flat.params_numel(r) * p, GIP_SRC)
        return (*((gip, copy) if firsts[r] < last else (max(gip, copy, key=lambda t: t.bytes),)), *kept)

    def own_bytes(r: int) -> int:  # the bytes of ``own(r)``'s terms, none built: every rank is asked
        kept = 0 if s.partition_gradients else kept_numel(r) * p
        if firsts[r] < 0:
            return copy.bytes + kept
        gip = run.flat.params_numel(r) * p
        return (gip + copy.bytes if firsts[r] < last else max(gip, copy.bytes)) + kept

    def every_rank() -> tuple[int, ...]:  # ``own_bytes`` of every rank in one pass, no call per rank (a speed-up)
        c, total, gips = copy.bytes, large_before[-1], _params_numels(run.flat)
        sizes = [(0 if s.partition_gradients else (total - large_before[b] + large_before[a]) * p)
                 + (c if f < 0 else gips[r] * p + c if f < last else max(gips[r] * p, c))
                 for r, f, (a, b) in zip(range(run.nd), firsts, run.flat._ranges)]  # every ``range``
        return run.first_largest(sizes.__getitem__)

    # every rank described: its one once per layout, bucket and bytes (``shared_memo``; a speed-up, no rule)
    chosen = run.first_largest(own_bytes) if s.rank is not None else shared_memo(
        "epilogue large gradient", (run.flat, firsts, large_before), (p, copy.bytes, last, s.partition_gradients),
        every_rank)
    return tuple(Moment("backward", f"the last, large gradient reduced after backward, rank {r}", (*base, *own(r)))
                 for r in chosen)  # type: ignore[union-attr]  # fmt: skip
