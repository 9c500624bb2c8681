"""Where ``DeepSpeedZeroOptimizer`` (runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8) reduces gradients and what
a rank holds then: the buckets of the hooks in gradient-ready order (``_hook_buckets``), ZeRO-1's reduction
after backward in parameter order (``_stage1_reduce``), the last bucket's reduction after a backward that
reduced from the hooks (``_epilogue_reduce``), the partitions whose flat gradient is a view
(``_within_one_parameter``), the hook that allocates each rank's ``grads_in_partition`` (``_reducing_hooks``),
inside a GPT block (``_in_block_partitions``), and the first bucket's reduction at the final norm's hook
(``_first_bucket_reduced``). Split from ``zero12.py``, which asks these."""

from __future__ import annotations

import bisect
import itertools
from functools import lru_cache

from zeroplan.engines.deepspeed.block_roles import _attention_after, _llama_roles, _mlp_modules
from zeroplan.engines.deepspeed.collectives import greedy_buckets
from zeroplan.engines.deepspeed.run import DSRun, _act, _blocks_saved, _bucket, _pbytes, _states
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
    """(gradient-ready order, ``DSRun.grad_ready_order``; the buckets' element counts in that order,
    ``greedy_buckets``; the position in the order of each bucket's first gradient; parameter -> its bucket) of
    ZeRO-2's reduction from the hooks (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``)."""
    return _hook_layout(run.numels, run.settings.reduce_bucket_size, run.grad_ready_order)


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
    held = run.wrapper.held_between_micro_steps(run)
    base = (*_states(run), *held, *(t for t in _bucket(run) if t not in held),
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


def _reducing_hooks(run: DSRun) -> tuple[tuple[int, int, int], ...]:
    """Reducing from the hooks, per rank (``run.ranks``) whose ``grads_in_partition`` a bucket before the last
    allocates: (rank, that bucket, the parameter whose gradient hook reduces it: the first that does not fit,
    stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``)."""
    order, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    out = []
    for rank in run.ranks:
        mine = run.flat.params(rank)
        if not mine:
            continue
        first = min(bucket_of[i] for i in mine)
        if first + 1 < len(buckets):  # else the last bucket: reduced after backward
            out.append((rank, first, order[first_of_bucket[first + 1]]))
    return tuple(out)


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
                                                                         "incoming activation gradient"))  # fmt: skip
    large = [i for i, n in enumerate(run.numels) if n > s.reduce_bucket_size]  # reduced in place, not copied
    large_in_bucket: dict[int, int] = {}
    for i in large:
        large_in_bucket[bucket_of[i]] = large_in_bucket.get(bucket_of[i], 0) + run.numels[i]
    best: dict[int, tuple[int, Moment]] = {}  # block -> (bytes, moment) of the rank holding the most
    at_hooks: dict[tuple[int, int], tuple] = {}
    for rank, first, hook in _reducing_hooks(run):
        j = run.param_blocks[hook]
        if j < 0 or hook in outputs:
            continue
        if (j, hook) not in at_hooks:  # every rank reducing at one hook sees the same activations
            at_hooks[j, hook] = _hook_activations(run, j, hook), _blocks_saved(run, j)
        at_hook, saved = at_hooks[j, hook]
        if at_hook is None:
            continue
        where, acts, module = at_hook
        lo, hi = run.flat.range(rank)
        in_bucket = large_in_bucket.get(first, 0)
        own = sum(run.numels[i] for i in large
                  if bucket_of[i] < first and run.param_blocks[i] == j and not lo <= i < hi) if kept else 0  # fmt: skip
        terms = (*base, saved, *acts,
                 Term(f"{where}'s weight gradients", sum(run.numels[i] for i in module) * p,
                      "autograd (one node makes every input's gradient)", len(module)),
                 Term("gradients larger than the bucket, in the bucket reduced", in_bucket * p,
                      "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce)"),
                 *((Term("gradients larger than the bucket, outside the partition, reduced before (kept)",
                         (own * p + kept[rank][j].bytes), kept[rank][j].source),) if kept else ()),
                 Term("grads_in_partition", run.flat.params_numel(rank) * p, GIP_SRC))  # fmt: skip
        name = f"block {j} {where} backward, rank {rank}'s grads_in_partition allocated"
        copy = buckets[first] * DTYPE_BYTES[s.grad_dtype]  # allreduce_bucket's flat copy, freed before the
        if copy > terms[-1].bytes:  # partition is allocated: the larger of the two, one after the other
            name = f"block {j} {where} backward, rank {rank}'s bucket flattened"
            terms = (*terms[:-1], Term("flattened copy of the bucket's gradients", copy,
                                       "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))"))
        total = sum(t.bytes for t in terms)
        if j not in best or total > best[j][0]:
            best[j] = (total, Moment("backward", name, terms))
    return tuple(m for _, m in best.values())


def _hook_activations(run: DSRun, j: int, hook: int) -> tuple[str, tuple[Term, ...], tuple[int, ...]] | None:
    """(where, block j's activations at ``hook``'s gradient hook: its saved tensors not yet released and the
    gradients in flight, the hooked module's parameters) for a hook of an MLP input projection or of the norm
    before the MLP; None elsewhere (the attention, the input norm: not modelled). GPT (``_mlp_saved``): at c_fc
    the saved tensors less the MLP's, the incoming and the MLP input's gradients; at LN2 also less its input x1,
    the residual's summed gradient. Llama (RMSNorm, SwiGLU; its hooks in ``DSRun.grad_ready_order``: down, up,
    gate, post_attention_layernorm): at up the MLP's saved tensors less gate's output (SiLU's input) released,
    in flight SiLU's output gradient, the norm output's (from up) and the incoming; at gate the norm's output
    released too, in flight the norm output's summed gradient and the incoming; at the norm
    ``norm_backward_saved`` with its normalised tensor's gradient and the incoming; at o_proj the attention's and
    the input norm's saved tensors, in flight o_proj's input gradient and x1's (block j held whole: recomputed
    under checkpointing, beside the input the checkpoint holds). Not modelled: q, k, v and the input norm.
    Measured: tiny-llama ZeRO-2 checkpointed, 5,000-element buckets, N_d = 3, MemTracker in
    ``copy_grads_in_partition``: rank 0 at block 0's gate_proj hook 620,536 B, rank 1 at block 1's o_proj hook
    597,816 B; each moment 504 B over (the token ids, N·8 B, which MemTracker never sees: no op makes them)."""
    blk, nda = run.acts.block, run.acts.embed_out
    if not blk.norm_backward_saved:  # GPT's LayerNorm block
        proj, norm = _mlp_modules(run, j)
        mlp = _mlp_saved(run)
        if mlp is None or hook not in (*proj, *norm):
            return None
        if hook in norm:
            return "LN2", (_act("block's saved activations before its MLP, less LN2's input", blk.saved - mlp - nda),
                           _act("residual gradient", nda)), norm
        return "MLP input projection", (_act("block's saved activations before its MLP", blk.saved - mlp),
                                        _act("incoming and MLP input's gradients", 2 * nda, 2)), proj
    roles = _llama_roles(run, j)
    if roles is None or not roles[2]:
        return None
    (*earlier, last_proj), norm, o_proj = roles
    saved = blk.recomputed + blk.ckpt_saved if run.checkpointing != "none" else blk.saved
    d = run.final_norm_numel
    nfa = nda // d * (sum(run.numels[i] for i in last_proj) // d)
    attention = _attention_after(run, j)
    if any(hook in m for m in attention):  # q, k, v, the input norm: bounded by o_proj's (their hooks come
        # after it, each op releasing more of the attention's saved tensors), in flight every attention input
        # projection's output gradient, the input norm output's and x1's
        rms = nda // _pbytes(run) * 4 + nda // (_pbytes(run) * d) * 4 + 2 * nda
        qkv = nda // d * (sum(run.numels[i] for m in attention for i in m if run.numels[i] > d) // d)
        module = next(m for m in attention if hook in m)
        return "attention input (bounded at o_proj's)", (
            _act("block's saved activations before its post-attention norm", saved - blk.mlp_saved - rms),
            _act("q, k, v's, the input norm output's and x1's gradients", qkv + 2 * nda, 3)), module
    if not any(hook in m for m in (*roles[0], roles[1], roles[2])):
        return None
    if hook in o_proj:  # the MLP's and the post-attention norm's saved tensors gone (an RMSNorm's: N·d·4 + N·4 +
        # 2·N·d·a), in flight o_proj's input gradient (N·q·a) and x1's (N·d·a)
        rms = nda // _pbytes(run) * 4 + nda // (_pbytes(run) * d) * 4 + 2 * nda
        nqa = nda // d * (sum(run.numels[i] for i in o_proj) // d)
        return "attention output projection", (_act("block's saved activations before its post-attention norm",
                                                    saved - blk.mlp_saved - rms),
                                               _act("attention output's and x1's gradients", nqa + nda, 2)), o_proj
    if hook in norm:
        return "post-attention norm", (_act("block's saved activations left at its post-attention norm",
                                            blk.norm_backward_saved + saved - blk.saved),
                                       _act("normalised tensor's and incoming gradients", 2 * nda, 2)), norm
    if hook in last_proj:
        return "MLP input projection", (_act("block's saved activations less the MLP's and the norm's output",
                                             saved - blk.mlp_saved - nda),
                                        _act("incoming and MLP input's gradients", 2 * nda, 2)), last_proj
    module = next(m for m in earlier if hook in m)
    return "MLP input projection", (
        _act("block's saved activations less the MLP's but the activation's input", saved - 3 * nfa),
        _act("incoming, MLP input's and the activation output's gradients", 2 * nda + nfa, 3)), module


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
    -3.3%, -8.3%, -8.7% before)."""
    if not run.param_blocks:
        return ()
    order, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    last_in_blocks = max((i for i, j in enumerate(run.param_blocks) if j >= 0), default=-1)
    if len(buckets) < 2 or not order[first_of_bucket[1]] > last_in_blocks:
        return ()  # one bucket (``_epilogue_reduce``), or the first reduced inside the last block
    p, g, acts = _pbytes(run), DTYPE_BYTES[run.settings.grad_dtype], run.acts
    large = sum(n for i, n in enumerate(run.numels) if bucket_of[i] == 0 and n > run.settings.reduce_bucket_size)
    pending = acts.block.pending_at_last_grad  # an RMSNorm's, the final norm being one of the blocks' norms
    norm = ((_act("final norm's saved tensors not yet used, its input gradient in flight (RMSNorm)", pending),)
            if pending else (_act("final norm saved and output", acts.final_saved),
                             _act("final norm output gradient", acts.embed_out)))  # fmt: skip
    base = (*(t for t in last if t not in inflight and t.name not in ("block backward working set",
                                                                      "incoming activation gradient")),
            _blocks_saved(run, acts.n_layer), *norm,
            Term("gradients larger than the bucket, in the bucket reduced", large * p,
                 "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce)"))  # fmt: skip
    out = [Moment("backward", "final norm backward, the first bucket reduced", (*base, Term(
        "flattened copy of the first bucket's gradients", buckets[0] * g,
        "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))")))]  # fmt: skip
    held = [run.flat.params_numel(r) for r, first, _ in _reducing_hooks(run) if first == 0]
    if held:
        out.append(Moment("backward", "final norm backward, the first bucket's grads_in_partition", (
            *base, Term("grads_in_partition", max(held) * p, GIP_SRC))))
    return tuple(out)


def _mlp_saved(run: DSRun) -> int | None:
    """A GPT block's saved tensors its MLP releases before the input projection's backward ends: LN2's output
    (the projection's input, released by the checkpoint's unpack once used, or saved) and the MLP's own
    (``BlockActivations.mlp_saved``: the activation's kept tensors and output, (k + 1)·N·f·a); None for other
    blocks (Llama's RMSNorm: ``BlockActivations.norm_backward_saved`` is set)."""
    blk = run.acts.block
    if blk.norm_backward_saved or not blk.mlp_saved:
        return None
    return run.acts.embed_out + blk.mlp_saved


def _embedding_hook_reduce(run: DSRun) -> tuple[Moment, ...]:
    """ZeRO-2 from the hooks, the embeddings' gradients starting a bucket of their own: the hook of the first of
    them (``reduce_independent_p_g_buckets_and_remove_grads``: it does not fit) reduces the previous bucket
    (``reduce_ipg_grads`` -> ``average_tensor`` -> ``allreduce_bucket``: ``self.flatten(bucket)``, a copy of
    its gradients) while that embedding gradient waits beside it, the blocks' activations gone; a rank whose
    ``grads_in_partition`` an earlier bucket allocated holds it (accumulating: two, ``_embedding_hook_reduce_
    accumulating``); one allocated by this reduction comes after the copy is freed. Found by the differential
    matrix (generator 5, 1-241: DeepSeek-V3 6.4M untied, N_d = 2, a 1,298,880-element bucket holding every
    block's gradients, the embedding's 2,597,760 larger): rank 1 at 97,856,760 B, 3,210,440 B (3.28%) over the
    reduction after backward predicted before (MemTracker's live storages at rank 1's peak: ``aten.cat`` of the
    bucket's 1,242,432 elements beside ``embedding_dense_backward``'s output; with 400,000-element buckets the
    previous bucket, block 0's, lies in rank 0's partition alone: no copy, as measured)."""
    if not (run.param_blocks and run.settings.partition_gradients):
        return ()
    first_block = min((i for i, b in enumerate(run.param_blocks) if b >= 0), default=0)
    order, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    embeddings = [i for i in range(first_block) if run.param_blocks[i] < 0]
    if not embeddings or run.tied_head:  # tied: zero12.py _tied_embedding_backward (the sum, larger)
        return ()
    at = bucket_of[max(embeddings)]
    hook = order[first_of_bucket[at]]
    if at == 0 or hook not in embeddings:
        return ()
    # the bucket's slices by destination rank, merged while consecutive (average_tensor); one slice is flattened
    # as a view (torch flatten_dense_tensors of one tensor), so a copy is made only for a bucket over 2+ partitions
    previous = set(order[first_of_bucket[at - 1]:first_of_bucket[at]])
    if sum(1 for r in range(run.nd) if previous.intersection(run.flat.params(r))) < 2:
        return ()
    p, g = _pbytes(run), DTYPE_BYTES[run.settings.grad_dtype]
    common = (*_states(run), *_bucket(run), _act("batch (token ids, targets)", run.acts.batch, 2),
              _act("loss", run.acts.loss), Term("the embedding's gradient, waiting at its hook", run.numels[hook] * p,
                                                "torch autograd AccumulateGrad"))  # fmt: skip
    copy = Term("flattened copy of the previous bucket's gradients", buckets[at - 1] * g,
                "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))")
    earlier = [r for r in run.ranks if run.flat.params(r) and min(bucket_of[i] for i in run.flat.params(r)) < at - 1]  # fmt: skip
    if run.grad_accum > 1:
        return _embedding_hook_reduce_accumulating(run, common, copy, earlier)
    held = [run.flat.params_numel(r) for r in earlier]
    return (Moment("backward", "embedding's hook reduces the blocks' bucket", (
        *common, *((Term("grads_in_partition", max(held) * p, GIP_SRC),) if held else ()), copy)),)  # fmt: skip


def _embedding_hook_reduce_accumulating(run: DSRun, common: tuple[Term, ...], copy: Term,
                                        earlier: list[int]) -> tuple[Moment, ...]:
    """``_embedding_hook_reduce`` from the second micro-step on, per rank: two ``grads_in_partition``. Each
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
