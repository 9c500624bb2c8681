"""ZeRO-1/2 (runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8): backward moments at the token embedding, the last
op of backward, that ``zero12.py _tied_embedding_backward`` and ``late_reductions.py embedding_hook_reduced`` leave
out: ZeRO-1 reducing after backward with a tied head (``tied_embedding_kept``), the tied gradient larger than the
bucket reduced at its own hook (``tied_gradient_reduced``), and what ZeRO-1 from the hooks keeps beside an
embedding's hook (``stage1_embedding_hook_kept``). Found by the differential matrix's seed 4."""

from __future__ import annotations

import zeroplan.engines.deepspeed.boundary as B
from zeroplan.engines.deepspeed.flat_copy import flattened_copy_numel
from zeroplan.engines.deepspeed.layout_ranks import _hook_buckets
from zeroplan.engines.deepspeed.reduce import GIP_SRC, hook_copy_term
from zeroplan.engines.deepspeed.run import DSRun, _act, _bucket, _pbytes, _states
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.formulas.peak import Moment, Term

TIED_SRC = ("torch autograd InputBuffer::accumulate -> AccumulateGrad; runtime/zero/stage_1_and_2.py "
            "reduce_independent_p_g_buckets_and_remove_grads (the hook fires on the sum)")
TIED_NAME = "tied embedding gradients (the head's, the embedding's, their sum)"
COPY_NAME = "flattened copy of the bucket's gradients"  # late_reductions.py embedding_hook_reduced's


def _tied_weight(run: DSRun) -> int | None:
    """The tied weight's index (the token embedding, the first embedding before every block), or None when the
    head is not tied or the layout has no blocks."""
    if not (run.tied_head and run.param_blocks and any(b >= 0 for b in run.param_blocks)):
        return None
    first_block = min(i for i, b in enumerate(run.param_blocks) if b >= 0)
    embeddings = [i for i in range(first_block) if run.param_blocks[i] < 0]
    return min(embeddings) if embeddings else None


def tied_embedding_kept(run: DSRun) -> tuple[Moment, ...]:
    """ZeRO-1 reducing after backward (no ``overlap_comm``: ``reduce_gradients`` walks ``bit16_groups`` after
    backward, ``zero12.py ZeroOptimizer.keeps_gradients``), a head tied to the token embedding: at the embedding's
    backward, the last op, every other gradient autograd made is kept in ``param.grad`` beside the head's gradient
    waiting in autograd's input buffer, the embedding's own and their sum (torch autograd InputBuffer::accumulate ->
    AccumulateGrad), with the states, the bucket and the batch. Found by the differential matrix (seed 4, 4-2,
    generator 4: Llama 15.6M tied, V x h = 17,546 x 384, N_d = 4; live storages of rank 0's second step: the three
    (17546, 384) tensors, ``aten.mm``, ``embedding_dense_backward`` and the add, beside every block's weight gradient
    and the bucket: backward -11.15 % before; 4-8, generator 5: Phi-3 7.8M tied, -13.84 %)."""
    tied = _tied_weight(run)
    if tied is None or not run.wrapper.keeps_gradients(run):
        return ()
    p, vh = _pbytes(run), run.numels[tied]
    return (Moment("backward", "tied embedding backward, every gradient kept", (
        *_states(run), *_bucket(run), _act("batch (token ids, targets)", run.acts.batch, 2),
        Term("autograd gradients of every other parameter (kept to reduce_gradients)", (sum(run.numels) - vh) * p,
             "torch autograd (param.grad); runtime/zero/stage_1_and_2.py reduce_gradients (after backward)"),
        Term(TIED_NAME, 3 * vh * p, TIED_SRC, 3))),)  # fmt: skip


def tied_gradient_reduced(run: DSRun, before: tuple[Moment, ...]) -> tuple[Moment, ...]:
    """Reducing from the hooks, a tied weight larger than the bucket: at its hook (on the sum) the previous bucket
    is reduced (``reduce_ipg_grads``, a rank whose first bucket it is allocating ``grads_in_partition``,
    ``copy_grads_in_partition``), then the tied gradient itself, at once (``extra_large_param_to_reduce``):
    ``allreduce_bucket`` flattens its slices (``flattened_copy_numel`` of that one parameter) beside the sum, the
    head's and the embedding's own gradients freed. ``before``: ``zero12.py _tied_embedding_backward``'s moment,
    whose terms less its ``grads_in_partition`` and the three tied gradients this moment holds beside the sum and
    the rank's own. One moment, the rank holding the most.
    Found by the differential matrix (seed 4, 4-3, generator 4: Mistral 6.7M tied, V x h = 28,098 x 160, ZeRO-2
    overlap_comm, N_d = 3: rank 2, whose slice overlaps the embedding's tail and every block, allocates its
    26,715,520-B ``grads_in_partition`` at the tied hook, then ``aten.cat`` of ranks 0 and 1's slices, 4,452,588
    elements, ``allreduce_and_copy_with_multiple_ranks``: -6.39 % before)."""
    tied = _tied_weight(run)
    if (tied is None or not before or (run.grad_accum > 1 and not B.at_boundary(run))  # ZeRO-1's boundary: as G = 1
            or run.numels[tied] <= run.settings.reduce_bucket_size):
        return ()
    _, _, _, bucket_of = _hook_buckets(run)
    at, p = bucket_of[tied], _pbytes(run)
    copy = Term("flattened copy of the tied gradient's slices", flattened_copy_numel(run, [tied]) *
                DTYPE_BYTES[run.settings.grad_dtype], "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten)")
    common = tuple(t for t in before[0].terms if t.name not in ("grads_in_partition", TIED_NAME, B.HELD))
    tied_sum = Term("the tied gradient (the sum) at its hook", run.numels[tied] * p, TIED_SRC)

    def extra(rank: int) -> tuple[Term, ...]:
        params = run.flat.params(rank)
        if not params:
            return (copy,)
        gip = Term("grads_in_partition", run.flat.params_numel(rank) * p, GIP_SRC)
        first = min(bucket_of[i] for i in params)
        return (gip, copy) if first < at else (max(gip, copy, key=lambda t: t.bytes),)

    return tuple(Moment("backward", f"tied gradient reduced at its hook, rank {r}", (*common, tied_sum, *extra(r)))
                 for r in run.first_largest(lambda r: sum(t.bytes for t in extra(r))))  # fmt: skip


def stage1_embedding_hook_kept(run: DSRun, hooked: tuple[Moment, ...]) -> tuple[Moment, ...]:
    """ZeRO-1 reducing from the hooks (``overlap_comm``): ``late_reductions.py embedding_hook_reduced``'s moments
    (``hooked``, one per bucket sent at an embedding's hook, in bucket order) again for the rank holding the most
    with what stage 1 keeps there, every block's backward done: the gradients larger than the bucket outside its
    partition (``zero12.py _stage1_kept_gradients``' rule, now of every block and the head: reduced in place,
    ``extra_large_param_to_reduce``, and stage 1 clears none, so they live to the step) and the embedding output's
    gradient (activation dtype, N x h: the residual's gradient into the embedding's backward). The rank's own terms
    as there: its ``grads_in_partition`` beside the bucket's flattened copy once an earlier bucket allocated it,
    the larger of the two when this one does, else the copy. Empty at ZeRO-2, which clears each gradient once
    reduced. Found by the differential matrix (seed 4, 4-1, generator 5: Phi-3 10.6M untied, V x h = 20,080 x 192,
    1,927,680-element buckets, N_d = 2; live storages of rank 0's second step at block 0's input_layernorm hook,
    which autograd runs after the embedding's backward: the head's 15,421,440-B gradient, outside rank 0's
    partition, and the 49,152-B embedding output's gradient beside rank 0's grads_in_partition and the embedding's
    gradient: -7.63 % before)."""
    s = run.settings
    if s.partition_gradients or not s.overlaps or not hooked or (run.grad_accum > 1 and not B.at_boundary(run)):
        return ()
    numels, p, blocks = run.numels, _pbytes(run), run.param_blocks
    first_block = min(i for i, b in enumerate(blocks) if b >= 0)
    order, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    sent = [b for b in range(len(buckets) - 1)  # embedding_hook_reduced's buckets, one moment each
            if order[first_of_bucket[b + 1]] < first_block and blocks[order[first_of_bucket[b + 1]]] < 0]
    large = [i for i, n in enumerate(numels) if n > s.reduce_bucket_size and i >= first_block]  # blocks, norm, head
    out_grad = Term("the embedding output's gradient", run.acts.embed_out,
                    "torch autograd (the embedding backward's input)")
    firsts = {r: min(bucket_of[i] for i in run.flat.params(r)) for r in run.ranks if run.flat.params(r)}

    def kept(rank: int) -> Term:
        first, end = run.flat.range(rank)
        return Term("gradients larger than the bucket, outside the partition (kept to the step)",
                    sum(numels[i] for i in large if not first <= i < end) * p,
                    "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce; stage 1 clears "
                    "no gradient)")  # fmt: skip

    out = []
    for b, moment in zip(sent, hooked):
        common = tuple(t for t in moment.terms if t.name not in ("grads_in_partition", COPY_NAME))
        copy = hook_copy_term(run, b)  # the moment's own, or the one it left out for the larger grads_in_partition

        def own(rank: int) -> tuple[Term, ...]:
            if rank not in firsts or firsts[rank] > b:
                return (copy, kept(rank))
            gip = Term("grads_in_partition", run.flat.params_numel(rank) * p, GIP_SRC)
            return (gip, copy, kept(rank)) if firsts[rank] < b else (max(gip, copy, key=lambda t: t.bytes), kept(rank))

        out.extend(Moment("backward", f"{moment.name}, rank {r} with stage 1's kept gradients",
                          (*common, *own(r), out_grad))
                   for r in run.first_largest(lambda r: sum(t.bytes for t in own(r))))  # fmt: skip
    return tuple(out)
