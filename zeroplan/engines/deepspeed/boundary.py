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
from zeroplan.engines.deepspeed.run import DSRun, _pbytes, memo_of
from zeroplan.formulas.peak import Term

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

    return memo_of(run, "boundary unhooked", make)  # type: ignore[return-value]


def position(run: DSRun, param: int) -> int:
    """The place of parameter ``param``'s hook in the gradient-ready order."""
    where = memo_of(run, "boundary positions", lambda r: {i: k for k, i in enumerate(r.grad_ready_order)})
    return where[param]  # type: ignore[index]


def block_start(run: DSRun, j: int) -> int:
    """The place in the gradient-ready order of block ``j``'s first hook (its output projection's)."""
    return min(position(run, i) for i, b in enumerate(run.param_blocks) if b == j)


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


def early_partition_position(run: DSRun) -> int:
    """Where the last block's moment with a rank's early ``grads_in_partition`` (zero12.py
    ``_stage2_early_partitions``) stands: after the hook that reduced the first bucket (the parameter it copies
    into the bucket moved), and not before the last block's first hook (the final norm's and the head's ran)."""
    first_of_bucket = _hook_buckets(run)[2]
    return max(first_of_bucket[1] + 1, block_start(run, run.acts.n_layer - 1))


def block_position(run: DSRun, j: int, hook: int | None) -> int:
    """Where block ``j``'s first-op moment (zero12.py ``_blocks_from_hooks``) stands for a rank whose
    ``grads_in_partition`` the reduction at ``hook`` allocated (None: none yet): at the block's first hook, or
    after ``hook`` where that is the block's own output projection's (the partition comes after the hook that
    moves the projection's gradients into the bucket; measured: gpt-tiny N_d = 2, rank 1, 20,880 B of
    ``mlp.c_proj`` gradients gone by its partition)."""
    at = block_start(run, j)
    if hook is not None and run.param_blocks[hook] == j and hook in run.output_projections:
        return max(at, position(run, hook) + 1)
    return at
