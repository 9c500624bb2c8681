"""Where ``DeepSpeedZeroOptimizer`` (runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8) reduces gradients and what
a rank holds then: the buckets of the hooks in gradient-ready order (``_hook_buckets``), ZeRO-1's reduction
after backward in parameter order (``_stage1_reduce``), the last bucket's reduction after a backward that
reduced from the hooks (``_epilogue_reduce``), the partitions whose flat gradient is a view
(``_within_one_parameter``), the hook that allocates each rank's ``grads_in_partition`` (``_reducing_hooks``),
inside a GPT block (``_in_block_partitions``), and the first bucket's reduction at the final norm's hook
(``_first_bucket_reduced``). Split from ``zero12.py``, which asks these."""

from __future__ import annotations

from functools import lru_cache
from itertools import compress

import zeroplan.engines.deepspeed.boundary as B
from zeroplan.engines.deepspeed.flat_copy import copy_numel, range_copy_numel
from zeroplan.engines.deepspeed.hook_activations import (_block_hook_activations, _hook_activations,  # noqa: F401
                                                         _hook_bytes, _hook_memo)
from zeroplan.engines.deepspeed.layout_ranks import (_hook_buckets, _hook_layout, _last_in_blocks, _params_numels,
                                                     _rank_first_buckets, _stage1_held, _views)
from zeroplan.engines.deepspeed.phases import final_norm_at_its_hook, final_norm_per_rank
from zeroplan.engines.deepspeed.run import DSRun, _act, _blocks_saved, _bucket, _pbytes, _states, memo_of, shared_memo
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.engines.deepspeed.terms import FlatGroup
from zeroplan.formulas.peak import Moment, Term

SRC = "runtime/zero/stage_1_and_2.py"
GIP_SRC = f"{SRC} copy_grads_in_partition"
shared_term = lru_cache(maxsize=4096, typed=True)(Term)
"""``Term(name, bytes, source, tensors)``, one object per value (terms are immutable; a speed-up, no rule: a 405B
plan's in-block moments made the same three terms ~600 times each)."""


def _within_one_parameter(run: DSRun, rank: int) -> bool:
    """Whether ``rank``'s slice of the flat group lies within one parameter, no padding: ``get_flat_partition``
    then flattens one tensor, which ``_flatten_dense_tensors`` returns as a view of it (no copy), so the fp32
    gradient the step hands Adam keeps all of ``grads_in_partition`` alive (measured by the differential matrix:
    a Qwen2 13M untied at N_d = 3, ranks 0 and 2, slices of the embedding and of the head, +783,360 elements, the
    parameter's elements outside the slice, at the update: -1.97% before)."""
    return _views(run.flat)[rank]


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
    states, psi = (*_states(run), *_bucket(run)), sum(numels)
    sent_and_kept = _stage1_held(run.flat, run.settings.reduce_bucket_size)

    def held(rank: int) -> tuple[int, int]:  # (elements sent when its partition is allocated, large ones kept)
        return sent_and_kept[rank]

    def extra(rank: int) -> int:
        sent, large = held(rank)
        return (psi - sent + large + run.flat.params_numel(rank)) * p

    def winners() -> tuple[int, ...]:
        return run.first_largest(extra, tuple(r for r in run.ranks if run.flat.params(r)))

    def every_rank() -> tuple[int, ...]:  # ``extra`` of every rank in one pass, the ranks with a parameter in C
        sizes = [(psi - sent + large + n) * p for (sent, large), n in zip(sent_and_kept, _params_numels(run.flat))]
        return run.first_largest(sizes.__getitem__, tuple(compress(run.ranks, run.flat._params)))

    # where every rank is described, its one rank once per layout, bucket and bytes (a speed-up, no rule)
    chosen = winners() if run.settings.rank is not None else shared_memo(
        "stage1 reduce", (run.flat, sent_and_kept), (psi, p), every_rank)
    out, every = [], run.settings.rank is None  # every rank described: the moment says whose it is
    for rank in chosen:  # type: ignore[union-attr]
        sent, large = held(rank)
        out.append(Moment("backward", f"reduce_gradients: rank {rank}'s grads_in_partition", (
            *states,
            Term("autograd gradients not yet bucketed", (psi - sent) * p, "torch autograd (param.grad)"),
            Term("gradients larger than the bucket, reduced in place and kept", large * p,
                 "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce; stage 1 clears no "
                 "gradient)"),
            Term("grads_in_partition", run.flat.params_numel(rank) * p,
                 "runtime/zero/stage_1_and_2.py copy_grads_in_partition (torch.empty of the partition's parameters)"),
            _act("batch (token ids, targets)", run.acts.batch, 2)), rank if every else None))  # fmt: skip
    return tuple(out)


def _hook_bucket_copy(run: DSRun, b: int) -> int:
    """``flat_copy.flattened_copy_numel`` of hook bucket ``b`` (``_hook_buckets``), its parameters in gradient-ready
    order."""
    return _hook_copies_of(run)[b]


def hook_copy_term(run: DSRun, b: int, which: str = "the bucket's") -> Term:
    """``allreduce_bucket``'s flattened copy of hook bucket ``b`` (``_hook_bucket_copy``) in the gradients' dtype."""
    return Term(f"flattened copy of {which} gradients", _hook_bucket_copy(run, b) * DTYPE_BYTES[run.settings.grad_dtype],
                f"{SRC} allreduce_bucket (self.flatten(bucket))")


def _hook_copies_of(run: DSRun) -> tuple[int, ...]:
    """``_hook_bucket_copy`` of every hook bucket of ``run``, looked up once per run (``memo_of``)."""
    return memo_of(run, "hook copies", lambda r: _hook_copies(r.flat, r.settings.reduce_bucket_size,
                                                              r.grad_ready_order))  # type: ignore[return-value]


@lru_cache(maxsize=16)  # per layout (``terms.flat_group``, by identity), bucket size and order: every rank's run asks
def _hook_copies(flat: FlatGroup, bucket: int, order: tuple[int, ...]) -> tuple[int, ...]:
    """``flattened_copy_numel`` of each hook bucket (``layout_ranks._hook_layout``) of ``flat`` reducing in buckets
    of ``bucket`` elements, gradients ready in ``order``."""
    order, _, first_of_bucket, _ = _hook_layout(flat.numels, bucket, order)
    ends, offsets, part = (*first_of_bucket[1:], len(order)), flat.offsets, flat.part
    # a bucket of one parameter is a range: ``range_copy_numel`` (closed form where a partition holds more than a
    # bucket; a speed-up, no rule: most of a 405B plan's hook buckets hold one parameter)
    return tuple([range_copy_numel(part, bucket, offsets[order[a]], offsets[order[a] + 1]) if b - a == 1
                  else copy_numel(flat, bucket, order[a:b]) for a, b in zip(first_of_bucket, ends)])  # fmt: skip


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
    last = len(buckets) - 1
    acts = run.acts
    held = B.held_at(run, run.wrapper.held_between_micro_steps(run), len(run.numels))  # every hook has run
    base = (*_states(run), *held, *(t for t in _bucket(run) if t not in held),
            _act("batch (token ids, targets)", acts.batch, 2), _act("loss", acts.loss),
            hook_copy_term(run, last, "the last bucket's"))  # fmt: skip

    firsts = _rank_first_buckets(run)

    def early(rank: int) -> bool:  # its grads_in_partition allocated by an earlier bucket
        return 0 <= firsts[rank] < last and (run.grad_accum == 1 or B.at_boundary(run))

    def winners() -> tuple[int, ...]:  # one where all are described
        return run.first_largest(lambda r: run.flat.params_numel(r) if early(r) else 0)

    def every_rank() -> tuple[int, ...]:  # ``winners``' bytes of every rank in one pass, no call per rank
        ok = run.grad_accum == 1 or B.at_boundary(run)
        sizes = [n if ok and 0 <= f < last else 0 for f, n in zip(firsts, _params_numels(run.flat))]
        return run.first_largest(sizes.__getitem__)

    out = []  # every rank described: its one once per layout, bucket and boundary (a speed-up, no rule)
    for rank in winners() if run.settings.rank is not None else shared_memo(  # type: ignore[union-attr]
            "epilogue reduce", (run.flat, firsts), (last, run.grad_accum == 1 or B.at_boundary(run)), every_rank):
        out.append(Moment("backward", f"reduction after backward, rank {rank}", (*base, *(
            (Term("grads_in_partition", run.flat.params_numel(rank) * _pbytes(run), GIP_SRC),) if early(rank) else ()))))
    return tuple(out)


def _reducing_hooks(run: DSRun) -> tuple[tuple[int, int, int], ...]:
    """Reducing from the hooks, per rank (``run.ranks``) whose ``grads_in_partition`` a bucket before the last
    allocates: (rank, that bucket, the parameter whose gradient hook reduces it: the first that does not fit,
    stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``). Once per run (``memo_of``)."""
    return memo_of(run, "reducing_hooks", _find_reducing_hooks)  # type: ignore[return-value]


def _find_reducing_hooks(run: DSRun) -> tuple[tuple[int, int, int], ...]:
    order, buckets, first_of_bucket, _ = _hook_buckets(run)
    firsts = _rank_first_buckets(run)
    # a rank overlapping no parameter (-1) has no partition; the last bucket's is reduced after backward
    return tuple([(rank, firsts[rank], order[first_of_bucket[firsts[rank] + 1]]) for rank in run.ranks
                  if 0 <= firsts[rank] and firsts[rank] + 1 < len(buckets)])  # a list first: no generator per rank


def _in_block_partitions(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...],
                         kept: dict[int, tuple[Term, ...]]) -> tuple[Moment, ...]:
    """Reducing from the hooks, a rank whose first bucket is reduced at a hook inside block j after the block's
    first op (the reduction at the first op is ``_partition_allocations``'): its ``grads_in_partition`` is
    allocated there (``copy_grads_in_partition``), with the block's activations partly released. In a GPT
    block (``_mlp_saved``), at the hook of the MLP input projection (c_fc: the output projection's and the
    activation's backward have run) or of LN2 (c_fc's too): the blocks before j saved, block j's saved tensors
    less the MLP's (and, at LN2, its input x1; its statistics are counted, 4 B per token at most over), the
    gradients in flight (at c_fc the incoming one and the MLP input's, at LN2 the residual's sum), the hooked
    module's weight gradients (one autograd node makes them together), the gradients larger than the bucket
    in the bucket being reduced (reduced in place, ``extra_large_param_to_reduce``) and, at stage 1 (which
    clears none), those reduced before outside the partition (``kept``: zero12.py ``_stage1_kept_gradients``, empty
    at stage 2; and block j's own).
    Not modelled (no moment, as before): a hook in the attention or LN1, or a block other than GPT's
    (Llama's RMSNorm). Measured (MemTracker at the peak, in copy_grads_in_partition), gpt-tiny, 5,000-element
    buckets: rank 0 at N_d = 2 allocated at block 0's c_fc hook, ZeRO-2 checkpointed 563,392 B, ZeRO-1 with
    overlap_comm 624,864 B (-7.42% and -2.12% before); rank 2 at N_d = 4, ZeRO-1 with overlap_comm, at block
    1's LN2 hook, 522,032 B (-1.87% before)."""
    if not run.param_blocks or not run.acts.block.mlp_saved:
        return ()
    p, s, outputs = _pbytes(run), run.settings, set(run.output_projections)
    _, buckets, _, bucket_of = _hook_buckets(run)
    base = tuple(t for t in last if t not in inflight and t.name not in ("block backward working set",
                                                                         "incoming activation gradient", B.HELD))  # fmt: skip
    large, large_in_bucket = _large_gradients(run)  # reduced in place, not copied
    # The bytes of each rank's moment, summed from what every rank reducing at one hook holds alike (``alike``)
    # and what is its own (its partition or the bucket's flat copy, the larger; at stage 1 its kept gradients):
    # the same integers as the terms' sum, so the same rank wins; only the winners' terms are built.
    # Per first bucket (its hook is the next bucket's first gradient's: one per first), its block j, what every
    # rank reducing there holds alike, its kept elements and the bucket's copy, or None where no moment is made
    # (a speed-up, no rule: looked up by the first bucket alone, the larger of two without ``max``).
    alike: dict[int, tuple[int, int, int, int] | None] = {}
    base_bytes, g, memo = sum(t.bytes for t in base), DTYPE_BYTES[s.grad_dtype], _hook_memo(run)
    copies = _hook_copies_of(run)  # each bucket's allreduce_bucket flat copy (``_hook_bucket_copy``)
    best: dict[int, tuple[int, int, int, int]] = {}  # block -> (bytes, rank, first, hook) of the rank holding the most
    blocks, gips = run.param_blocks, _params_numels(run.flat)  # each rank's ``FlatGroup.params_numel``
    # ZeRO-1's boundary gradients (``B.held_term``) asked only at the boundary, each block's saved bytes once per run
    # (a speed-up, no rule: ~1,000 hooks of a ZeRO-2 run)
    boundary, saved = B.at_boundary(run), {}
    for rank, first, hook in _reducing_hooks(run):
        common = alike.get(first, alike)  # ``alike`` itself: not seen yet
        if common is alike:  # every rank reducing at one hook sees the same activations
            j = blocks[hook]
            at_hook = None if j < 0 or hook in outputs else _hook_bytes(run, j, hook, memo)
            if at_hook is not None and j not in saved:
                saved[j] = _blocks_saved(run, j).bytes
            common = alike[first] = None if at_hook is None else (
                base_bytes + saved[j] + at_hook + large_in_bucket.get(first, 0) * p
                + (sum(t.bytes for t in B.held_term(run, B.position(run, hook) + 1)) if boundary else 0),
                sum(run.numels[i] for i in large if bucket_of[i] < first and run.param_blocks[i] == j) if kept else 0,
                copies[first] * g, j)
        if common is None:
            continue
        gip, copy, j = gips[rank] * p, common[2], common[3]
        total = common[0] + (gip if gip > copy else copy)
        if kept:
            lo, hi = run.flat.range(rank)
            own = common[1] - sum(run.numels[i] for i in range(lo, hi) if run.numels[i] > s.reduce_bucket_size
                                  and bucket_of[i] < first and run.param_blocks[i] == j)  # fmt: skip
            total += own * p + kept[rank][j].bytes
        held = best.get(j)
        if held is None or total > held[0]:
            best[j] = (total, rank, first, hook)
    return tuple(_partition_moment(run, base, kept, large, large_in_bucket, memo, rank, first, hook)
                 for _, rank, first, hook in best.values())


def _large_gradients(run: DSRun) -> tuple[list[int], dict[int, int]]:
    """The parameters larger than the bucket (reduced in place, not copied) and their elements per hook bucket, once
    per layout and bucket size (``shared_memo``; a speed-up, no rule: a pass over the parameters per run). Read only."""
    numels, limit, bucket_of = run.numels, run.settings.reduce_bucket_size, _hook_buckets(run)[3]

    def make() -> tuple[list[int], dict[int, int]]:
        large = [i for i, n in enumerate(numels) if n > limit]
        in_bucket: dict[int, int] = {}
        for i in large:
            in_bucket[bucket_of[i]] = in_bucket.get(bucket_of[i], 0) + numels[i]
        return large, in_bucket

    return shared_memo("large gradients", (numels, bucket_of), (limit,), make)  # type: ignore[return-value]


def _partition_moment(run: DSRun, base: tuple[Term, ...], kept: dict[int, tuple[Term, ...]], large: list[int],
                      large_in_bucket: dict[int, int], memo: dict, rank: int, first: int, hook: int) -> Moment:
    """``_in_block_partitions``' moment of ``rank``, whose first bucket ``first`` is reduced at ``hook``."""
    p, s, j = _pbytes(run), run.settings, run.param_blocks[hook]
    _, buckets, _, bucket_of = _hook_buckets(run)
    where, acts, module = _hook_activations(run, j, hook, memo)  # type: ignore[misc]
    lo, hi = run.flat.range(rank)
    in_bucket = large_in_bucket.get(first, 0)
    own = sum(run.numels[i] for i in large
              if bucket_of[i] < first and run.param_blocks[i] == j and not lo <= i < hi) if kept else 0  # fmt: skip
    terms = (*base, *(B.held_term(run, B.position(run, hook) + 1) if B.at_boundary(run) else ()),
             _blocks_saved(run, j), *acts,
             shared_term(f"{where}'s weight gradients", sum(run.numels[i] for i in module) * p,
                         "autograd (one node makes every input's gradient)", len(module)),
             shared_term("gradients larger than the bucket, in the bucket reduced", in_bucket * p,
                         "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce)"),
             *((Term("gradients larger than the bucket, outside the partition, reduced before (kept)",
                     (own * p + kept[rank][j].bytes), kept[rank][j].source),) if kept else ()),
             shared_term("grads_in_partition", run.flat.params_numel(rank) * p, GIP_SRC))  # fmt: skip
    name = f"block {j} {where} backward, rank {rank}'s grads_in_partition allocated"
    copy = _hook_bucket_copy(run, first) * DTYPE_BYTES[s.grad_dtype]  # allreduce_bucket's flat copy, freed before the
    if copy > terms[-1].bytes:  # partition is allocated: the larger of the two, one after the other
        name = f"block {j} {where} backward, rank {rank}'s bucket flattened"
        terms = (*terms[:-1], Term("flattened copy of the bucket's gradients", copy,
                                   "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))"))
    return Moment("backward", name, terms)


def _first_bucket_reduced(run: DSRun, last: tuple[Term, ...], inflight: tuple[Term, ...]) -> tuple[Moment, ...]:
    """Reducing from the hooks, the first bucket in gradient-ready order (the head's and the final norm's
    gradients) reduced at a hook before the last block's (the final norm's): every block's activations are
    saved, the final norm's too. ``reduce_ipg_grads`` -> ``average_tensor`` -> ``allreduce_and_scatter`` ->
    ``allreduce_bucket`` flattens the bucket's gradients into a new tensor (``self.flatten(bucket)``) while a
    gradient larger than the bucket, reduced in place (``extra_large_param_to_reduce``), is still alive; then,
    the copy freed, a rank whose first bucket it is allocates its ``grads_in_partition`` (``copy_grads_in_
    partition``). An RMSNorm's weight gradient comes from its last product, whose backward runs first: by its
    hook the head's input (the norm's output), a soft-cap's saved tanh and the product's saved normalised tensor
    are released, and what is left of the norm is ``BlockActivations.pending_at_last_grad`` (its fp32 input and
    rsqrt, the normalised tensor's gradient; measured: MemTracker at ``copy_grads_in_partition`` on Gemma 2,
    t-gemma2-scores ZeRO-2 rank 1, 13,049,292 B, 277,944 B under the moment with every final-norm tensor
    before: -0.87% of the phase's peak).
    Found by the differential matrix (seed 2 draw 5: Llama 15.1M untied, ZeRO-2, 2.7M-element
    buckets, N_d = 4: the head's 5.4M-element gradient and its flattened copy; MemTracker at the peak, in
    ``allreduce_bucket`` on ranks 0, 1, 3 and in ``copy_grads_in_partition`` on rank 2: backward -12.2%,
    -3.3%, -8.3%, -8.7% before). Then the final norm's backward per rank (``phases.final_norm_per_rank``)."""
    if not run.param_blocks:
        return ()
    order, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    last_in_blocks = _last_in_blocks(run)
    if len(buckets) < 2 or not order[first_of_bucket[1]] > last_in_blocks:
        return ()  # one bucket (``_epilogue_reduce``), or the first reduced inside the last block
    p, acts = _pbytes(run), run.acts
    large_first = tuple(i for i in _large_gradients(run)[0] if bucket_of[i] == 0)  # the first bucket's
    large = sum(run.numels[i] for i in large_first)
    base = (*(t for t in last if t not in inflight and t.name not in ("block backward working set",
                                                                      "incoming activation gradient", B.HELD)),
            *B.held_term(run, first_of_bucket[1] + 1), _blocks_saved(run, acts.n_layer), *final_norm_at_its_hook(run),
            Term("gradients larger than the bucket, in the bucket reduced", large * p,
                 "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce)"))  # fmt: skip
    out = [Moment("backward", "final norm backward, the first bucket reduced",
                  (*base, hook_copy_term(run, 0, "the first bucket's")))]
    held = {r: run.flat.params_numel(r) for r, first, _ in _reducing_hooks(run) if first == 0}
    if held:
        out.append(Moment("backward", "final norm backward, the first bucket's grads_in_partition", (
            *base, Term("grads_in_partition", max(held.values()) * p, GIP_SRC))))
    stage1 = not run.settings.partition_gradients

    def extra(rank: int) -> tuple[Term, ...]:  # then the final norm's backward, per rank (``final_norm_per_rank``)
        lo, hi = run.flat.range(rank)
        outside = sum(run.numels[i] for i in large_first if not lo <= i < hi) if stage1 else 0  # stage 1 keeps
        return (*((Term("grads_in_partition", held[rank] * p, GIP_SRC),) if rank in held else ()), *((Term(
            "gradients larger than the bucket, outside the partition (kept to the step)", outside * p,
            f"{SRC} reduce_ipg_grads (extra_large_param_to_reduce; stage 1)"),) if outside else ()))

    # at stage 2 only the ranks whose partition the first bucket allocates hold anything more
    return (*out, *final_norm_per_rank(run, last, inflight, extra, None if stage1 else tuple(sorted(held))))
