"""``DeepSpeedZeroOptimizer`` (runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8): ZeRO-1 and ZeRO-2.

Its schedule: forward on the full 16-bit flat group; backward reduces gradients bucket by bucket, from the gradient
hooks (``partition_gradients``, ZeRO-2, or ``overlap_comm``: ``reduces_from_hooks``) or after backward in parameter
order (``reduce_gradients``, ZeRO-1), each rank copying what overlaps its partition into ``grads_in_partition``; the
step flattens the partition's gradients to fp32, updates the fp32 master partition and all-gathers the 16-bit flat
group. ZeRO-1 and 2 differ in DeepSpeed by ``partition_gradients`` (``Settings.partition_gradients``), and so here."""

from __future__ import annotations

from collections.abc import Callable

from zeroplan.engines.deepspeed.collectives import zero12_collectives
from zeroplan.engines.deepspeed.layout_ranks import (_hook_buckets, _largest_slices, _last_in_blocks, _params_numels,
                                                     _rank_first_buckets, _views)
import zeroplan.engines.deepspeed.boundary as B
import zeroplan.engines.deepspeed.moe12_hooks as MH
import zeroplan.engines.deepspeed.moe12_ws as MW
from zeroplan.engines.deepspeed.phases import (adam_update, cast_moments, final_norm_backward, flatten_moment,
                                               later_blocks_held)
import zeroplan.engines.deepspeed.late_reductions as LR
import zeroplan.engines.deepspeed.embedding_moments as EM
from zeroplan.engines.deepspeed.offload_wrappers import ZERO12_OFFLOAD
from zeroplan.engines.deepspeed.reduce import (GIP_SRC, _epilogue_reduce, _first_bucket_reduced, _in_block_partitions,
                                               _reducing_hooks, _stage1_reduce, _within_one_parameter)
from zeroplan.engines.deepspeed.run import DSRun, Wrapper, _act, _blocks_saved, _bucket, _pbytes, _states, shared_memo
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES, Settings
from zeroplan.engines.deepspeed.terms import aligned_flat_numel, zero12_terms
from zeroplan.formulas.peak import Moment, Term


def reduces_from_hooks(s: Settings) -> bool:
    """Whether gradients are reduced from the hooks in backward (stage_1_and_2.py ``__init__`` calls
    ``create_gradient_handling_hooks`` if ``partition_gradients or overlap_comm``), else after backward."""
    return s.partition_gradients or s.overlaps


def _largest_partition_numel(run: DSRun) -> int:
    """The most parameter elements overlapping one rank's slice of the flat group, of the ranks described
    (``DSRun.ranks``: the rank asked, or the largest of all)."""
    return max(run.flat.params_numel(r) for r in run.ranks)


def _partition_allocations(run: DSRun) -> tuple[tuple[int, int, int], ...]:
    """ZeRO-2 (and ZeRO-1 with ``overlap_comm``), per rank: (rank, j, its ``grads_in_partition``, bytes) where j is the
    last block whose backward starts with that partition alive, or -1 when it comes after every block's.

    Gradients are bucketed in gradient-ready order (taken, as ``_stage2_early_partitions`` does, as the reverse
    of parameter order); a bucket is reduced at the hook of the first gradient that does not fit
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads`` -> ``reduce_ipg_grads``), and a rank's
    ``grads_in_partition`` is allocated by the first reduction of a bucket holding one of its parameters
    (``copy_grads_in_partition``), to live until the step. A reduction at the hook of block b's output projection
    (its first gradients, GPT-2 ``mlp.c_proj``, Llama ``mlp.down_proj``) comes at b's first op; one later in b
    comes before b - 1's; one at the final norm's or the head's before the last block's. Under checkpointing
    every block's backward holds its recomputed activations, so the partition allocated in one block is live
    at the next block's peak nearly as large (measured: gpt-tiny, N_d = 4, rank 2's partition, allocated at the
    last block's c_fc weight gradient, peaks at block 0's c_proj backward)."""
    if not run.param_blocks:
        return ()
    last_in_blocks, blocks, n_layer = _last_in_blocks(run), run.param_blocks, run.acts.n_layer
    outputs, numels, p = set(run.output_projections), _params_numels(run.flat), _pbytes(run)  # N_d ranks: no Terms
    out = []
    for rank, _, hook in _reducing_hooks(run):
        j = blocks[hook]
        if j < 0:
            j = n_layer - 1 if 0 <= last_in_blocks < hook else -1  # final norm / head, or embeddings
        elif hook not in outputs:
            j -= 1
        if j >= 0:
            out.append((rank, j, numels[rank] * p))
    return tuple(out)


def _tied_embedding_backward(run: DSRun) -> tuple[Moment, ...]:
    """ZeRO-2 reducing from its hooks, a head tied to the token embedding: the embedding's backward, the last
    op of backward. The tied weight's gradient hook (``reduce_independent_p_g_buckets_and_remove_grads``) fires
    only once both uses are summed: the head's gradient has waited in autograd's input buffer since the LM
    head's backward, the embedding's backward makes its own dense gradient, and their sum is a third tensor of
    the same size, all three alive together (torch autograd InputBuffer::accumulate -> AccumulateGrad). The
    blocks' activations are gone by then, but every rank with a parameter in a bucket reduced before the
    embeddings' has its ``grads_in_partition`` (``copy_grads_in_partition``, kept until the step) and both
    reduce buckets are alive; the position ids went with the position embedding's backward, which runs first.
    Under checkpointing this is the phase's peak once the vocabulary is large. Measured: the 5.4M GPT (vocab
    8,192 x 256, fp32), 1e5-element buckets, overlap_comm, N_d = 2: each rank peaks there at its own
    grads_in_partition + 3 x 8,388,608 B over what the last block's backward holds less its activations
    (MemTracker, per hook: 90,444,056 B on rank 1, 89,487,640 B on rank 0; the head's gradient alone was in
    the prediction before, 9,424,904 B short). A bucket is sent at the hook of the next bucket's first gradient:
    the one before a tied weight larger than the bucket (its own bucket) is sent at the tied weight's hook, after
    this op, so its ranks have no grads_in_partition yet (the differential matrix, seed 3 draw 22, generator 4:
    Llama 9.0M tied, 2e6-element buckets, N_d = 4; rank 2's partition, block 0 and the embedding: +17.7% before)."""
    if not (run.tied_head and run.param_blocks and reduces_from_hooks(run.settings)):
        return ()
    first_block = min((i for i, b in enumerate(run.param_blocks) if b >= 0), default=0)
    embeddings = [i for i in range(first_block) if run.param_blocks[i] < 0]
    if not embeddings:
        return ()
    order, _, first_of_bucket, bucket_of = _hook_buckets(run)
    at = order.index(min(embeddings))  # the tied weight's hook, on the sum: after this op
    # bucket k is sent at the hook of bucket k + 1's first gradient: before this op only if that comes first
    sent = sum(1 for k in range(len(first_of_bucket) - 1) if first_of_bucket[k + 1] < at)
    accumulated = run.settings.partition_gradients and run.grad_accum > 1  # ZeRO-2 from the 2nd micro-step
    most = max(((run.flat.params_numel(r), -r) for r in run.ranks if run.flat.params(r) and (
        accumulated or min(bucket_of[i] for i in run.flat.params(r)) < sent)), default=None)
    p, acts, rank = _pbytes(run), run.acts, -most[1] if most and run.settings.rank is None else None
    return (Moment("backward", "tied embedding backward", (
        *_states(run), *_bucket(run), _act("batch (token ids, targets)", acts.batch, 2), _act("loss", acts.loss),
        *((Term("grads_in_partition", most[0] * p, GIP_SRC),) if most else ()), *B.held_term(run, at),
        Term(EM.TIED_NAME, 3 * run.head_numel * p, EM.TIED_SRC, 3)), rank),)  # fmt: skip


def _stage1_kept_gradients(run: DSRun) -> dict[int, tuple[Term, ...]]:
    """ZeRO-1 reducing from its hooks (``overlap_comm``), per rank, per block j: the gradients of parameters
    larger than ``reduce_bucket_size`` outside the rank's partition from blocks after j (and the final norm and
    head), alive at j's first backward op. Such a gradient is reduced in place, not copied into the bucket
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``: ``extra_large_param_to_reduce``), and
    stage 1 clears no gradient after reducing it (``reduce_ipg_grads``: only stage 2 calls
    ``clear_grad_attribute``), so it lives to the step's ``zero_grad``; smaller ones are views of the reused
    bucket. Measured: gpt-tiny, 5,000-element buckets, N_d = 4, checkpointed: ranks 0, 1, 2 held 41,472,
    41,472 and 20,736 B of c_fc / c_proj weight gradients more than ZeRO-2 in the same world."""
    numels, p, L = run.numels, _pbytes(run), run.acts.n_layer
    if not run.param_blocks:
        return {}
    last_in_blocks = _last_in_blocks(run)
    out = {}
    # (parameter, its block; L for the final norm and head, reduced before every block) of the gradients larger
    # than the bucket; the embeddings' come after the blocks
    large = [(i, L if b < 0 else b) for i, (n, b) in enumerate(zip(numels, run.param_blocks))
             if n > run.settings.reduce_bucket_size and (b >= 0 or i > last_in_blocks)]  # fmt: skip
    after = [0] * (L + 1)  # after[j]: elements of the large gradients from blocks after j
    for i, b in large:
        after[min(b, L)] += numels[i]
    for j in range(L - 1, -1, -1):
        after[j] += after[j + 1]
    after = after[1:] + [0]  # blocks > j
    for rank in run.ranks:
        mine_after = [0] * (L + 1)  # the same, of the rank's own parameters (few: a slice of the flat group)
        first, end = run.flat.range(rank)
        for i, b in large:
            if first <= i < end:
                mine_after[min(b, L)] += numels[i]
        for j in range(L - 1, -1, -1):
            mine_after[j] += mine_after[j + 1]
        out[rank] = tuple(Term("gradients larger than the bucket, outside the partition (kept to the step)",
                               (after[j] - mine_after[j + 1]) * p,
                               "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce; stage 1 "
                               "clears no gradient)") for j in range(L))  # fmt: skip
    return out


def _stage2_early_partitions(run: DSRun) -> tuple[tuple[int, Term], ...]:
    """ZeRO-2 reduces bucket by bucket in gradient-ready order (``DSRun.grad_ready_order``: the head, the final
    norm, then the last block's parameters from its last call); the first bucket fills during the last block's
    backward when the model needs more than one. A rank owning a parameter of that bucket allocates its
    ``grads_in_partition`` there, with the activations alive (stage_1_and_2.py ``reduce_ipg_grads`` ->
    ``copy_grads_in_partition``). Every rank described: the owners once per layout and bucket (a speed-up, no rule)."""
    _, buckets, _, _ = _hook_buckets(run)
    if len(buckets) < 2:  # everything fits one bucket: reduced after backward, activations gone
        return ()
    p, firsts = _pbytes(run), _rank_first_buckets(run)  # a rank's least bucket is 0 where it owns one of bucket 0's
    owners = shared_memo("first bucket owners", (firsts,), (), lambda: tuple(r for r, f in enumerate(firsts) if not f))
    return tuple((rank, Term("grads_in_partition", run.flat.params_numel(rank) * p, GIP_SRC))
                 for rank in (owners if run.settings.rank is None else run.ranks) if firsts[rank] == 0)  # fmt: skip


def _first_bucket_before_last_block(run: DSRun) -> bool:
    """Whether the first bucket in gradient-ready order is reduced by the last block's first op: at the head's,
    the final norm's or the last block's output projection's hook (the first that does not fit, stage_1_and_2.py
    ``reduce_independent_p_g_buckets_and_remove_grads``). Later (a hook further into the last block, or an
    earlier block's) its owners' ``grads_in_partition`` comes where ``_partition_allocations`` and
    ``_in_block_partitions`` put it, after the last block's first op has released its MLP. Measured: tiny-llama hf
    ZeRO-2, N_d = 2, buckets 20,250 (the first, 20,016 elements, sent at block 1's v_proj hook; rank 1 -7.7% over
    when counted at the last block's first op) and 39,000 (at block 0's v_proj hook; both ranks -7.2% / -8.0%)."""
    order, buckets, first_of_bucket, _ = _hook_buckets(run)
    if len(buckets) < 2 or not run.param_blocks:
        return False
    hook = order[first_of_bucket[1]]
    last_in_blocks = _last_in_blocks(run)
    last_block = run.param_blocks[last_in_blocks] if last_in_blocks >= 0 else -1
    return hook > last_in_blocks or (run.param_blocks[hook] == last_block and hook in run.output_projections)


def _most_held_by_block(nd: int, n_layer: int, allocated: dict[int, tuple[int, int]],
                        kept: dict[int, tuple[Term, ...]]) -> dict[int, int]:
    """Block j -> the first rank holding the most bytes at j's first backward op (its ``grads_in_partition``
    where allocated at a block >= j, plus its kept gradients at j), for the blocks where some rank holds any.
    Without kept gradients the ranks are swept once from the last block down (each joins at its block)."""
    if kept:
        out = {}
        for j in range(n_layer):
            most, who = 0, None
            for r in range(nd):
                held = (allocated[r][1] if r in allocated and j <= allocated[r][0] else 0) + (
                    kept[r][j].bytes if r in kept else 0)
                if held > most:
                    most, who = held, r
            if who is not None:
                out[j] = who
        return out
    joins: dict[int, list[int]] = {}
    for r, (j, _) in allocated.items():
        joins.setdefault(j, []).append(r)
    out, most, who = {}, 0, None
    for j in range(n_layer - 1, -1, -1):
        for r in joins.get(j, ()):
            held = allocated[r][1]
            if held > most or (held == most and who is not None and r < who):
                most, who = held, r
        if who is not None:
            out[j] = who
    return dict(sorted(out.items()))


class ZeroOptimizer(Wrapper):
    name = "DeepSpeedZeroOptimizer"
    terms = staticmethod(zero12_terms)
    collectives = staticmethod(zero12_collectives)
    offload = ZERO12_OFFLOAD

    def uses_reduction_stream(self, s: Settings) -> bool:
        """With ``overlap_comm``, ``reduce_ipg_grads`` makes ``grads_in_partition`` in ``self.reduction_stream``."""
        return s.overlaps

    def init_moments(self, run: DSRun) -> tuple[Moment, ...]:
        """The cast, the flat copy, then ``initialize_optimizer_states`` (an fp32 gradient partition of zeros,
        dropped at once)."""
        part = aligned_flat_numel(run.numels, run.nd) // run.nd
        return (*cast_moments(run), flatten_moment(run),
                Moment("init", "initialize_optimizer_states", (*_states(run, after_step=False), Term(
                    "fp32 gradient partition (zeros, dropped at once)", part * 4,
                    "runtime/zero/stage_1_and_2.py initialize_optimizer_states (single_grad_partition)"))))  # fmt: skip

    def held_between_micro_steps(self, run: DSRun) -> tuple[Term, ...]:
        """(Measured at G = 2.) ZeRO-1 reduces only at the boundary (engine.py ``allreduce_gradients``;
        ``reduce_ready_partitions_and_remove_grads`` tests ``is_gradient_accumulation_boundary``): autograd's
        gradients stay in ``param.grad``, and the reduce bucket the first hook allocated stays until the
        boundary's ``_release_ipg_buffers``. ZeRO-2 reduces every micro-step into ``grads_in_partition``,
        kept to the step (the largest rank's)."""
        if run.grad_accum == 1:
            return ()
        p = _pbytes(run)
        if not run.settings.partition_gradients:
            return (Term(B.HELD, sum(run.numels) * p, B.HELD_SRC), *_bucket(run))
        return (Term("grads_in_partition (accumulated over micro-steps)", _largest_partition_numel(run) * p,
                     f"{GIP_SRC} (kept until the step)"),)  # fmt: skip

    def keeps_gradients(self, run: DSRun) -> bool:
        """ZeRO-1 reducing after backward keeps every gradient autograd makes until ``reduce_gradients``;
        from the hooks each moves into the bucket (``reduce_ready_partitions_and_remove_grads``).
        Accumulating, all of them are in ``held_between_micro_steps``."""
        return not reduces_from_hooks(run.settings) and run.grad_accum == 1

    def buckets_at_hooks(self, run: DSRun) -> bool:
        """From the hooks (``reduces_from_hooks``), each gradient no larger than the bucket is copied into it and
        autograd's tensor repointed there (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``:
        ``grad_reduc.data = new_grad_tensor...``); ZeRO-1 accumulating does so only at the boundary
        (``reduce_ready_partitions_and_remove_grads``), the backward this profile describes (boundary.py)."""
        return reduces_from_hooks(run.settings)

    def last_block_bucket(self, run: DSRun) -> tuple[Term, ...]:
        """The bucket(s) from the first hook on; ZeRO-1 accumulating holds its bucket between micro-steps."""
        return () if run.grad_accum > 1 and not run.settings.partition_gradients else _bucket(run)

    def backward_after_last_block(self, run: DSRun, last: tuple[Term, ...],
                                  inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
        """The last block (per rank when ZeRO-2 accumulates), the earlier blocks with what a rank holds from
        the later ones (``later_blocks_held``; from the hooks: ``_partition_allocations``,
        ``_stage1_kept_gradients``), and ZeRO-1's reduction after backward (``_stage1_reduce``)."""
        s, accumulating, last = run.settings, run.grad_accum > 1, MW.last_block_from_hooks(run, last)  # sparse: its own
        hooks, boundary = reduces_from_hooks(s), B.at_boundary(run)  # ZeRO-1 accumulating: its hooks' backward
        if boundary and run.param_blocks:  # the head's and the final norm's hooks have run
            last = B.held_at(run, last, MW.last_block_start(run))
        out = list(self._last_block_accumulating(run, last) if accumulating and s.partition_gradients
                   else (Moment("backward", "last block backward", last),))  # fmt: skip
        out.extend(final_norm_backward(run, last, inflight))
        if self.keeps_gradients(run):
            out.extend(later_blocks_held(run, last, inflight, bound=True))
        if hooks and (not accumulating or boundary):
            early = dict(_stage2_early_partitions(run)) if _first_bucket_before_last_block(run) else {}
            at = B.early_partition_position(run, MW.last_block_start(run)) if early and boundary else 0
            out.extend(Moment("backward", f"last block backward, rank {r}'s grads_in_partition",
                              (*B.held_at(run, last, at), early[r]))
                       for r in run.first_largest(lambda r: early[r].bytes, tuple(early)))  # fmt: skip
            out.extend(self._blocks_from_hooks(run, last, inflight))
            kept = _stage1_kept_gradients(run) if not s.partition_gradients else {}
            out.extend(_in_block_partitions(run, last, inflight, kept))
            out.extend((*_first_bucket_reduced(run, last, inflight), *MH.sparse_moments(run, last, inflight, kept)))
            tied = _tied_embedding_backward(run)
            hooked = LR.embedding_hook_reduced(run)
            out.extend((*tied, *EM.tied_gradient_reduced(run, tied), *hooked,
                        *EM.stage1_embedding_hook_kept(run, hooked), *B.embedding_backward(run)))
        if hooks and accumulating and not boundary:  # ZeRO-2 (generator 5, 1-483)
            out.extend(_tied_embedding_backward(run))  # ZeRO-2: the final norm's hook as at G = 1 (seed 5 gen. 5, 5-8)
            out.extend(_first_bucket_reduced(run, last, inflight) if s.partition_gradients else ())
        if hooks:
            out.extend((*_epilogue_reduce(run), *LR.epilogue_large_gradient(run)))
            out.extend(LR.blocks_bucket_at_embedding_hook(run))
        if not hooks:
            out.extend((*_stage1_reduce(run), *LR.stage1_flattened_listed(run), *EM.tied_embedding_kept(run)))
        return tuple(out)

    @staticmethod
    def _last_block_accumulating(run: DSRun, last: tuple[Term, ...]) -> tuple[Moment, ...]:
        """ZeRO-2 accumulating, per rank: its own grads_in_partition, held from the first micro-step; a
        partition parameter's param.grad is then a view of it (copy_grads_in_partition: grad_reduc.data =
        new_grad_tensor), so autograd accumulates out of place (grad + new grad, a new tensor until its bucket
        is reduced): on the ranks owning the first bucket's parameters, as big again as their
        grads_in_partition at the last block (measured at G = 2: N_d = 2 and 4, -0.05% and -0.07%)."""
        p = _pbytes(run)
        held_name = "grads_in_partition (accumulated over micro-steps)"
        last = tuple(t for t in last if t.name != held_name)
        early = {r for r, _ in _stage2_early_partitions(run)}
        out = []
        for r in run.first_largest(lambda r: run.flat.params_numel(r) * p * (2 if r in early else 1)):
            gip = run.flat.params_numel(r) * p
            out.append(Moment("backward", f"last block backward, rank {r} (accumulating)", (
                *last, Term(held_name, gip, f"{GIP_SRC} (kept until the step)"),
                *((Term("accumulated gradients of the partition's parameters (autograd, out of place)", gip,
                        f"torch autograd AccumulateGrad; {GIP_SRC}"),) if r in early else ()))))  # fmt: skip
        return tuple(out)

    @staticmethod
    def _blocks_from_hooks(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
        """Block j's first op, with blocks 0..j held: the rank holding the most there (its partition, if
        allocated by then, and at ZeRO-1 its kept gradients larger than the bucket; the lowest rank of a tie)."""
        allocated = {r: (j, gip) for r, j, gip in _partition_allocations(run)}
        kept = _stage1_kept_gradients(run) if not run.settings.partition_gradients else {}
        out, common = [], tuple(t for t in last if t not in inflight)
        hooks = {r: hook for r, _, hook in _reducing_hooks(run)} if B.at_boundary(run) else {}
        for j, who in _most_held_by_block(run.nd, run.acts.n_layer, allocated, kept).items():
            has = who in allocated and j <= allocated[who][0]
            best = (*((Term("grads_in_partition", allocated[who][1], GIP_SRC),) if has else ()),  # the winner's only
                    *((kept[who][j],) if who in kept and kept[who][j].bytes else ()))
            out.append(Moment("backward", f"block {j} backward, rank {who}'s partition and kept gradients", (
                *MW.block_held(run, common, j, hooks.get(who) if has else None),  # the rank's, per block
                _blocks_saved(run, j + 1), *inflight[1:], *best)))
        return tuple(out)

    def optimizer_moments(self, run: DSRun, part: int, inner: str, temps: int) -> tuple[Moment, ...]:
        """``step`` flattens the partition's gradients (views of grads_in_partition, still alive) in the
        gradient dtype, then converts the flat copy to fp32 (a no-op in fp32); then the update. A partition
        within one parameter (``_within_one_parameter``) flattens to a view of grads_in_partition, copying nothing."""
        s, p = run.settings, _pbytes(run)
        src = "runtime/zero/stage_1_and_2.py step -> get_flat_partition (_flatten_dense_tensors), .to(fp32)"
        fp32_grads = s.grad_dtype == "fp32"

        def sizes(rank: int) -> tuple[int, int, int, bool]:  # (grads_in_partition, flat copy, fp32 copy, a view)
            view = _within_one_parameter(run, rank)
            flat = 0 if view or fp32_grads else part * DTYPE_BYTES[s.grad_dtype]
            return run.flat.params_numel(rank) * p, flat, part * 4 if not (view and fp32_grads) else 0, view

        # every rank described: each family's first largest from per-rank lists, once per layout (a speed-up, no rule)
        numels, views, largest = _params_numels(run.flat), _views(run.flat), _largest_slices(run.flat)
        g, fp64 = 0 if fp32_grads else part * DTYPE_BYTES[s.grad_dtype], DTYPE_BYTES["fp64"]

        def family(name: str, each: Callable[[int, int], int]) -> tuple[int, ...]:  # each(gip, rank) -> its bytes
            if run.settings.rank is not None:
                return run.first_largest(lambda r: each(run.flat.params_numel(r) * p, r))  # one rank: not called
            return shared_memo(name, (numels, views, largest), (p, part, g, fp32_grads), lambda: run.first_largest(
                [each(n * p, r) for r, n in enumerate(numels)].__getitem__))  # type: ignore[return-value]

        # with offload_optimizer the norm is summed from per-parameter norms taken in backward
        # (stage_1_and_2.py complete_grad_norm_calculation_for_cpu_offload): no fp64 copy on the GPU
        norms = () if s.offload_optimizer.on else family("norms", lambda gip, r: gip + largest[r] * fp64)
        flattens = family("flattens", lambda gip, r: gip + (0 if views[r] else g) + (
            0 if views[r] and fp32_grads else part * 4))
        updates = family("updates", lambda gip, r: gip if views[r] and fp32_grads else part * 4)
        common = adam_update(run, part, inner, temps)
        out = []
        for rank in sorted({*norms, *flattens, *updates}):
            gip, flat, fp32, view = sizes(rank)
            if rank in norms:
                out.append(_norm_moment(run, rank, gip))
            if rank in flattens:
                out.append(Moment("optimizer_step", f"flatten the partition's gradients, rank {rank}", (*_states(run),
                           Term("grads_in_partition", gip, GIP_SRC), Term("flat partition gradient (gradient dtype)", flat, src),
                           Term("fp32 gradient of the master partition", fp32, src))))  # fmt: skip
            if rank not in updates:
                continue
            update = common
            if view and fp32_grads:  # the fp32 gradient is grads_in_partition itself: all of it alive
                update = Moment("optimizer_step", f"{update.name}, rank {rank}", tuple(
                    Term("fp32 gradient of the master partition (a view of grads_in_partition, whole)", gip, src)
                    if t.name == "fp32 gradient of the master partition" else t for t in update.terms))  # fmt: skip
            out.append(update)
        return tuple(out)


def _norm_moment(run: DSRun, rank: int, gip: int) -> Moment:
    """``step`` first takes the global norm (``scaled_global_norm`` -> ``get_grad_norm_direct``): each slice of
    the partition's gradients copied to fp64 in turn (``g.data.to(get_norm_dtype())``, fp64 wherever the device
    has it), with ``grads_in_partition`` alive and nothing flattened yet. The largest slice can outweigh the
    flat fp32 copy that follows (measured: gpt-tiny at N_d = 4, ranks 1 and 3, whose slices hold a whole
    5,184-element c_fc / c_proj weight: 41,472 B of fp64 at the step's peak, -1.58% and -1.61% before)."""
    largest = _largest_slices(run.flat)[rank]  # the largest single parameter's slice in the rank's partition
    return Moment("optimizer_step", f"global norm, rank {rank}", (*_states(run), Term("grads_in_partition", gip, GIP_SRC),
                  Term("fp64 copy of the partition's largest gradient slice", largest * DTYPE_BYTES["fp64"],
                       "runtime/zero/stage_1_and_2.py get_grad_norm_direct (g.data.to(get_norm_dtype()))")))  # fmt: skip


ZERO12_OPTIMIZER = ZeroOptimizer()
