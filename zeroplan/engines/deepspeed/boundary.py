"""ZeRO-1 with ``overlap_comm`` accumulating (G > 1): the boundary micro-step's backward.

ZeRO-1 reduces only at the accumulation boundary (stage_1_and_2.py ``reduce_ready_partitions_and_remove_grads``
tests ``is_gradient_accumulation_boundary``), so the earlier micro-steps leave every ``param.grad`` alive
(zero12.py ``held_between_micro_steps``). At the boundary the hooks reduce as at G = 1
(``reduce_independent_p_g_buckets_and_remove_grads``): autograd adds the new gradient into ``param.grad`` in place
(torch ``AccumulateGrad``: grad mode off, ``variable_grad += new_grad``), then the hook copies it into the bucket
and repoints ``param.grad`` there (``grad_reduc.data = new_grad_tensor...``), freeing the earlier micro-steps'
tensor. So the boundary's backward is G = 1's from the hooks (the buckets, each rank's ``grads_in_partition``
from its first bucket's reduction, ``copy_grads_in_partition``) plus, at each moment, the earlier gradients of
the parameters whose hook has not run yet (``held_at``). Measured (MemTracker per hook, gpt-tiny, 5,000-element
buckets, N_d = 2, G = 2): rank 1's ``grads_in_partition`` (85,248 B) allocated at the last block's
``mlp.c_proj.weight`` hook beside 31,032 elements of earlier gradients: backward 820,592 B, 63,688 B
(7.76 %) over the moment predicted before, which had no partition there."""

from __future__ import annotations

from zeroplan.engines.deepspeed.layout_ranks import _hook_buckets
from zeroplan.engines.deepspeed.run import DSRun, _act, _bucket, _pbytes, _states, memo_of, shared_memo
from zeroplan.formulas.peak import Moment, Term

SRC = "runtime/zero/stage_1_and_2.py"

HELD = "gradients of earlier micro-steps (param.grad)"
HELD_SRC = "torch autograd AccumulateGrad; runtime/engine.py allreduce_gradients (stage 1: at the boundary only)"
MOVED_SRC = (f"{HELD_SRC}; runtime/zero/stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads (each moved "
             "into the bucket at its hook)")  # fmt: skip


def at_boundary(run: DSRun) -> bool:
    """ZeRO-1 reducing from the hooks (``overlap_comm``) and accumulating: its last micro-step's backward."""
    s = run.settings
    return run.grad_accum > 1 and not s.partition_gradients and s.overlaps


def _unhooked(run: DSRun) -> tuple[int, ...]:
    """unhooked[k]: elements of the parameters from position k of the gradient-ready order on
    (``DSRun.grad_ready_order``), k = 0 .. len; once per run."""

    def make(r: DSRun) -> tuple[int, ...]:
        out = [0]
        for i in reversed(r.grad_ready_order):
            out.append(out[-1] + r.numels[i])
        return tuple(reversed(out))

    return memo_of(run, "boundary unhooked", lambda r: shared_memo(  # every run of the layout alike
        "boundary unhooked", (r.grad_ready_order, r.numels), (), lambda: make(r)))  # type: ignore[return-value]


def position(run: DSRun, param: int) -> int:
    """The place of parameter ``param``'s hook in the gradient-ready order."""
    where = memo_of(run, "boundary positions", lambda r: shared_memo(  # every run of the layout alike
        "boundary positions", (r.grad_ready_order,), (), lambda: {i: k for k, i in enumerate(r.grad_ready_order)}))
    return where[param]  # type: ignore[index]


def block_start(run: DSRun, j: int) -> int:
    """The place in the gradient-ready order of block ``j``'s first hook (its output projection's)."""
    return memo_of(run, "boundary block starts", lambda r: shared_memo(  # every run of the layout alike
        "boundary block starts", (r.grad_ready_order, r.param_blocks), (), lambda: _block_starts(r)))[j]  # type: ignore[index]


def _block_starts(run: DSRun) -> dict[int, int]:
    """block -> the place of its first hook in the gradient-ready order (``block_start``), every block at once."""
    out: dict[int, int] = {}
    for k, i in enumerate(run.grad_ready_order):
        out.setdefault(run.param_blocks[i], k)
    return out


def held_term(run: DSRun, at: int) -> tuple[Term, ...]:
    """At the boundary, the earlier micro-steps' gradients of the parameters whose hook has not run before
    position ``at`` of the gradient-ready order (the parameter at ``at`` included); none elsewhere."""
    if not at_boundary(run):
        return ()
    numel = _unhooked(run)[min(at, len(run.grad_ready_order))]
    return (Term(HELD, numel * _pbytes(run), MOVED_SRC),) if numel else ()


def held_at(run: DSRun, terms: tuple[Term, ...], at: int) -> tuple[Term, ...]:
    """``terms`` with the earlier gradients (``HELD``, all of them before the first hook) as at position ``at``."""
    if not at_boundary(run):
        return terms
    return (*(t for t in terms if t.name != HELD), *held_term(run, at))


def early_partition_position(run: DSRun, last_start: int) -> int:
    """Where the last block's moment with a rank's early ``grads_in_partition`` (zero12.py
    ``_stage2_early_partitions``) stands: after the hook that reduced the first bucket (the parameter it copies
    into the bucket moved), and not before ``last_start``, where the last block's moments stand (its first hook, the
    final norm's and the head's ran; a sparse block's gate-up backward: moe12_ws.py ``sparse_block_start``)."""
    first_of_bucket = _hook_buckets(run)[2]
    return max(first_of_bucket[1] + 1, last_start)


def block_position(run: DSRun, j: int, hook: int | None, at: int) -> int:
    """Where block ``j``'s first-op moment (zero12.py ``_blocks_from_hooks``) stands at ZeRO-1's boundary (what is
    held then) for a rank whose ``grads_in_partition`` the reduction at ``hook`` allocated (None: none yet): at
    ``at``, the block's first hook (moe12_ws.py ``sparse_block_start``: a sparse block's gate-up backward), or
    after ``hook`` where that is the block's own output projection's (the partition comes after the hook that moves
    the projection's gradients into the bucket; measured: gpt-tiny N_d = 2, rank 1, 20,880 B of ``mlp.c_proj``
    gradients gone by its partition)."""
    if hook is not None and run.param_blocks[hook] == j and hook in run.output_projections:
        return max(at, position(run, hook) + 1)
    return at


def embedding_backward(run: DSRun) -> tuple[Moment, ...]:
    """At the boundary, an untied embedding's backward, every block's hooks run: its new gradient
    (``embedding_dense_backward``) beside its earlier micro-steps' ``param.grad`` (added in place after, torch
    ``AccumulateGrad``; at G = 1 the new one is ``param.grad``, so only the hook's moment, late_reductions.py
    ``embedding_hook_reduced``), the embedding output's gradient, the buckets, the ``grads_in_partition`` of a rank
    whose first bucket was sent at an earlier hook, and at stage 1 the gradients larger than the bucket outside the
    partition (never moved into the bucket, never cleared: zero12.py ``_stage1_kept_gradients``' rule). The rank
    holding the most. Found by the differential matrix (seed 5, 5-6, generator 4: Mistral 32.4M untied, the
    11.8M-element embedding and head, 5.9M-element buckets, checkpointed, N_d = 4): rank 1's 67,549,184-B partition
    beside the head's kept 47,261,696-B gradient and the embedding's two, 483,584,280 B measured, -5.32 % before."""
    if not (at_boundary(run) and run.param_blocks) or run.tied_head:  # tied: zero12.py _tied_embedding_backward
        return ()
    blocks, numels, p, acts = run.param_blocks, run.numels, _pbytes(run), run.acts
    first_block = min((i for i, b in enumerate(blocks) if b >= 0), default=0)
    embeddings = [i for i in range(first_block) if blocks[i] < 0]
    if not embeddings:
        return ()
    e = max(embeddings, key=lambda i: numels[i])
    at = position(run, e)
    _, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    sent = sum(1 for k in range(len(buckets) - 1) if first_of_bucket[k + 1] < at)  # buckets 0 .. sent - 1 reduced
    large = [i for i, n in enumerate(numels) if n > run.settings.reduce_bucket_size and position(run, i) < at]

    def own(rank: int) -> tuple[Term, ...]:
        lo, hi = run.flat.range(rank)
        params = run.flat.params(rank)
        gip = run.flat.params_numel(rank) if params and min(bucket_of[i] for i in params) < sent else 0
        kept = sum(numels[i] for i in large if not lo <= i < hi)
        return (*((Term("grads_in_partition", gip * p, f"{SRC} copy_grads_in_partition"),) if gip else ()),
                *((Term("gradients larger than the bucket, outside the partition (kept to the step)", kept * p,
                        f"{SRC} reduce_ipg_grads (extra_large_param_to_reduce; stage 1 clears no gradient)"),)
                  if kept else ()))  # fmt: skip

    base = (*_states(run), *_bucket(run), _act("batch (token ids, targets)", acts.batch, 2),
            _act("embedding saved (position ids)", acts.embed_saved), _act("loss", acts.loss),
            *held_term(run, at), Term("the embedding's new gradient (before AccumulateGrad)", numels[e] * p,
                                      "torch autograd (embedding_dense_backward)"),
            _act("the embedding output's gradient", acts.embed_out))  # fmt: skip
    return tuple(Moment("backward", f"embedding backward at the boundary, rank {r}", (*base, *own(r)))
                 for r in run.first_largest(lambda r: sum(t.bytes for t in own(r))))
