"""FSDP2's phases as moments: at each point where live memory can peak, the terms alive there
(``zeroplan.formulas.peak`` sums them); read from ``_fsdp_state.py``, ``_fsdp_param_group.py`` and
``_fsdp_collectives.py`` (``SRC``)."""

from __future__ import annotations

import math

from zeroplan.engines.fsdp2.block_forward import block_forward, checkpointed_before_last
from zeroplan.engines.fsdp2.hf_tree import (
    checkpointed_position_ids,
    gpt2_body_embeds,
    inputs_embeds_held,
    last_block_in_loss,
    logits_in_loss,
    position_ids,
    root_backward_released,
    rotary_buffers,
    tied_head_build,
    tied_head_to_empty,
)
from zeroplan.engines.fsdp2.mesh import REDUCED, holds_allreduce, with_allreduce_held
from zeroplan.engines.fsdp2.norms import final_norm_backward, input_norm_backward, input_projections_backward
from zeroplan.engines.fsdp2.norms import rope_released
from zeroplan.engines.fsdp2.param import local_shard_numel, padded_shard_numel, shape_counts
from zeroplan.engines.fsdp2.side import gathered_numel as _gathered_numel
from zeroplan.engines.fsdp2.side import (
    embedding_copy_outs,
    embedding_regather,
    embedding_units,
    final_callback_units,
    head_output,
    head_prefetched,
    head_units,
    last_side_unit,
    resharded_after_head,
    root_side,
    side_prev,
    side_reduce,
    side_regathers,
    split_root,
    spanning_resharded,
    split_root_regathers,
    with_embedding_prefetch,
)
from zeroplan.engines.fsdp2.terms import (
    Fsdp2Run,
    _act,
    _blocks_saved,
    _fp,
    adam,
    ag_output,
    batch,
    copy_in,
    gather_input,
    gloo_copy,
    grad_cast,
    grads,
    last_grad_held,
    kept_blocks,
    mesh_ranks,
    params,
    partial_reshard,
    post_forward_reshard,
    prefetched,
    resharded,
    rs_input,
    rs_output,
    unit_grads,
    unsharded,
)
from zeroplan.engines.fsdp2.offload import offload_moments
from zeroplan.engines.fsdp2.optimizer_step import optimizer_moments
from zeroplan.engines.fsdp2.tp_loss import logits_gather_moments, loss_parallel_backward, loss_parallel_log_softmax
from zeroplan.formulas.peak import Moment, Term

def init_moments(run: Fsdp2Run) -> tuple[Moment, ...]:
    """``fully_shard`` of each block, then the root: the units not yet sharded are whole, and the shard
    of this unit is allocated before its whole tensors are dropped (_fsdp_param.py:
    FSDPParam._init_sharded_param). Adam's constructor allocates nothing (its states come at step 1).

    ``init="meta"``: nothing is allocated until ``to_empty`` gives each shard device memory
    (torch/nn/modules/module.py:Module.to_empty, then _fully_shard/_fully_shard.py:FSDPModule._apply:
    FSDPParam.reset_sharded_param), and the in-place initialisation adds nothing (measured: the init
    peak is the padded shards, gpt-tiny N_d = 2 and tiny-llama N_d = 8, MemTracker less the meta device)."""
    if run.settings.init == "meta":
        rank, src = run.settings.described_rank, "_fsdp_param.py:FSDPParam.reset_sharded_param"
        shapes = run.param_order or tuple(s for u in run.units for s in u.shapes)
        repad = [n for s, _ in shape_counts(shapes)
                 if (n := local_shard_numel(s, run.nd, rank)) != padded_shard_numel(s, run.nd)]  # fmt: skip
        return (
            Moment("init", "to_empty: the shards get device memory", (*mesh_ranks(run), *rotary_buffers(run), params(run))),
            # a shard shorter than its padded size (ranks at the end) is copied into a new padded tensor
            # while its unpadded one is alive: the largest such copy on top of all shards bounds the peak
            Moment("init", "to_empty: re-padding a short shard", (*mesh_ranks(run), *rotary_buffers(run), params(run),
                   _fp("the unpadded shard being re-padded", max(repad, default=0) * run.m, src))),
            *(Moment("init", "to_empty: the tied weight's second allocation", (*mesh_ranks(run), *rotary_buffers(run),
                     params(run), *tied)) for tied in (tied_head_to_empty(run),) if tied),
            *(Moment("init", "init_weights: a rotary table recomputed", (*mesh_ranks(run), *rotary_buffers(run),
                     params(run), Term("rotary recompute temporaries (int64 arange and its float copy)", temps,
                     "transformers/modeling_rope_utils.py:compute_default_rope_parameters")))
              for temps in (run.rotary_init_bytes,) if temps),
        )  # fmt: skip
    # the fully_shard calls in the order the wrapping makes them (wrap.resolve; blocks, then the root)
    calls = [(u.name, [s for _, s in u.params]) for u in run.shard_units if u.params] or \
        [(run.units[u].name, list(run.units[u].shapes)) for u in [*range(1, len(run.units)), 0]]
    numel = [sum(math.prod(s) for s in shapes) for _, shapes in calls]
    shard = [sum(padded_shard_numel(s, run.nd) for s in shapes) for _, shapes in calls]
    out = [Moment("init", "build: lm_head before tie_weights", (*rotary_buffers(run), Term(
        "unsharded units as built", sum(numel) * run.m, "validate/models.py:build"),
        *tied_head_build(run)))] if tied_head_build(run) else []  # fmt: skip
    for i, (name, _) in enumerate(calls):
        whole, done = sum(numel[i:]) * run.m, sum(shard[:i]) * run.m
        out.append(Moment("init", f"fully_shard({name})", (
            *mesh_ranks(run), *rotary_buffers(run), Term("unsharded units as built", whole, "validate/models.py:build"),
            _fp("shards of the units sharded before", done, "_fsdp_param.py:FSDPParam._init_sharded_param"),
            _fp("this unit's new shard", shard[i] * run.m, "_fsdp_param.py:FSDPParam._init_sharded_param"))))  # fmt: skip
    return tuple(out)


def forward_moments(run: Fsdp2Run) -> tuple[Moment, ...]:
    """The first block's all-gather and copy-out (the root's output still bound), the last block's all-gather
    and forward, the LM head, the loss (_fsdp_state.py:FSDPState._pre_forward, _post_forward: the last
    all-gather output is freed when the root's forward returns, after the loss in transformers' tree)."""
    acts, L = run.acts, len(run.units) - 1
    base = (*mesh_ranks(run), *rotary_buffers(run), params(run), adam(run), batch(run),
            _act("embedding saved (position ids)", acts.embed_saved), root_side(run, "blocks"))  # fmt: skip
    # transformers' body frees its position ids (and GPT-2's its embedding locals) on return
    head_base, base = base, (*base, *position_ids(run), *gpt2_body_embeds(run))
    head_base = (*head_base[:-1], *checkpointed_position_ids(run), root_side(run, "head"))  # a split root's units
    # after the layers are gathered; a checkpointed layer keeps its position ids for its recompute (hf_tree)
    prev = ag_output(run, L - 1, "previous unit, freed when this copy-out returns") if L > 1 else None
    # the first block's all-gather: the root's all-gather output is the previous one (freed when this
    # block's wait_for_unshard returns, as above: _fsdp_param_group.py:FSDPParamGroup.wait_for_unshard)
    root_prev = side_prev(run)
    first = (Moment("forward", "block 1 all-gather", (*base, _act("block input", acts.embed_out), *root_prev,
                    copy_in(run, 1), ag_output(run, 1, "this unit"))),
             Moment("forward", "block 1 copy-out", (*base, _act("block input", acts.embed_out), *root_prev,
                    ag_output(run, 1, "this unit"), unsharded(run, 1)))) if L > 1 else ()  # fmt: skip
    prev = (prev,) if prev is not None else root_prev
    base = (*base, *inputs_embeds_held(run)) if L > 1 else base  # transformers' body, from block 2 on (hf_tree)
    gather = Moment("forward", f"block {L} all-gather", (
        *base, *kept_blocks(run, L - 1), _blocks_saved(run, L - 1), _act("block input", acts.embed_out),
        *prev, copy_in(run, L), ag_output(run, L, "this unit")))  # fmt: skip
    # wait_for_unshard binds the previous all-gather state to a local (``if prev_all_gather_state := ...``),
    # so the previous output is freed only when it returns, after this block's copy-out (measured)
    copy_out = Moment("forward", f"block {L} copy-out", (
        *base, *kept_blocks(run, L - 1), _blocks_saved(run, L - 1), _act("block input", acts.embed_out),
        *prev, ag_output(run, L, "this unit"), unsharded(run, L)))  # fmt: skip
    last = block_forward(run, L, base, "kept until the root's post-forward")
    earlier = checkpointed_before_last(run, base)  # layer SAC: a checkpointed layer's forward before the last
    # reshard_after_forward=k: the block's post-forward copies its k-sharded slices while it is whole
    # (the block output is alive, its last op's output is gone: traced, gpt-tiny N_d = 8, k = 2)
    reshard = (Moment("forward", f"block {L} post-forward reshard", (
        *base, *kept_blocks(run, L - 1), _blocks_saved(run, L), _act("block output", acts.embed_out),
        ag_output(run, L, "kept until the root's post-forward"), unsharded(run, L), post_forward_reshard(run, L))),
    ) if partial_reshard(run) else ()  # fmt: skip
    head_acts = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved),
                 _act("logits", acts.logits))  # fmt: skip
    base = head_base
    kept_out = ag_output(run, L, "kept until the root's post-forward")
    tail = ()
    if head_units(run):  # a split root: [norm, output] gathered after the layers frees the last block's output;
        # inside the body (its final norm runs first), so the body's position ids are alive (draw 1-38: 256 B)
        kept_out = head_output(run, "kept until the root's post-forward")
        tail = (Moment("forward", f"{head_units(run)[-1].name} copy-out", (
            *base, *gpt2_body_embeds(run), *position_ids(run), *kept_blocks(run, L), _blocks_saved(run, L),
            _act("block output", acts.embed_out),
            ag_output(run, L, "previous unit, freed when this copy-out returns"), kept_out)),)  # fmt: skip
    head = Moment("forward", "LM head", (*base, *kept_blocks(run, L), *head_acts, kept_out))
    in_loss = last_block_in_loss(run)  # transformers' forward(labels=...): the loss before the post-forward
    in_loss = (kept_out,) if in_loss and head_units(run) else in_loss
    # ``logits.float()`` (validate/transformer.py:CausalLM.loss): a copy beside the 16-bit logits, which
    # nothing keeps once it exists (the head saves its input); in fp32 it is the logits themselves
    fp32_logits = _act("fp32 logits (loss upcast)", acts.logits_fp32 if run.p != 4 else acts.logits)
    base = (*base[:-1], root_side(run, "loss"))  # a split root's units after the layers resharded by now
    upcast = Moment("forward", "logits upcast", (*base, *kept_blocks(run, L), *head_acts, fp32_logits, *in_loss))
    loss = Moment("forward", "cross-entropy", (*base, *kept_blocks(run, L), *head_acts[:2], *logits_in_loss(run),
                  fp32_logits, _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax),
                  _act("loss", acts.loss), *in_loss))  # fmt: skip
    lp = loss_parallel_log_softmax(run)  # TP: _log_softmax on vocabulary-sharded logits, before the loss
    lp = (Moment("forward", "loss-parallel log-softmax", (*base, *kept_blocks(run, L), *head_acts[:2],
                 *logits_in_loss(run), fp32_logits, *lp, *in_loss)),) if lp else ()  # fmt: skip
    states = (*mesh_ranks(run), *rotary_buffers(run), params(run), adam(run), batch(run))
    return (*embedding_copy_outs(run, states), *first, gather, copy_out, *earlier, last, *reshard, *tail, head,
            *logits_gather_moments(run, head), *((upcast,) if run.p != 4 else ()), *lp, loss)  # fmt: skip


def reduce_scatter_moments(what: str, common, rs_in: Term, rs_out: Term, cast: Term, gloo) -> tuple[Moment, ...]:
    """A unit's reduce-scatter, then the cast of its output to the module dtype: two moments, since gloo's
    copy of the input is gone before the cast (_fsdp_collectives.py:foreach_reduce runs
    ``_to_dtype_if_needed(reduce_output, orig_dtype)`` after the collective; traced at dispatch, gpt-tiny
    bf16/bf16 at N_d = 2: the copy drops as the fp32 cast is made, so both are never live together)."""
    return (Moment("backward", f"{what} reduce-scatter", (*common, rs_in, rs_out, *gloo)),
            Moment("backward", f"{what} cast to the module dtype", (*common, rs_in, rs_out, cast)))  # fmt: skip


def backward_moments(run: Fsdp2Run, blocks: tuple[int, ...] | None = None) -> tuple[Moment, ...]:
    """Loss and head backward (the root's pre-backward prefetches the last block), each block's backward
    and reduce-scatter (_fsdp_param_group.py:FSDPParamGroup.pre_backward, _backward_prefetch, post_backward;
    _fsdp_collectives.py:foreach_reduce), the embeddings, the root's reduce-scatter (_fsdp_state.py:
    FSDPState._root_post_backward_final_callback)."""
    acts, L, p = run.acts, len(run.units) - 1, run.p
    n_d = acts.embed_out  # one N·d activation (or its gradient)
    base = (*mesh_ranks(run), *rotary_buffers(run), params(run), adam(run), batch(run),
            _act("embedding saved (position ids)", acts.embed_saved), _act("loss", acts.loss),
            *checkpointed_position_ids(run), root_side(run, "backward"))  # fmt: skip
    saved_all = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved))
    log_softmax = _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax)
    # the loss inside the root's forward (transformers' labels=): the root's pre-backward hook fires on the
    # loss, before the cross-entropy backward, and prefetches the last block (hf_tree); with units after the
    # layers the root's prefetch is theirs (kept gathered: nothing to do) and the last block waits for their
    # pre-backward, after the loss backward (measured: accelerate's wrapping of qwen2, bf16, exact)
    early = run.loss_in_forward and resharded(run) and not head_units(run) and not spanning_resharded(run)
    out = [Moment("backward", f"block {L} backward all-gather (root's prefetch, before the loss backward)", (
        *base, *kept_blocks(run, L), *saved_all, log_softmax, gather_input(run, L),
        ag_output(run, L, "backward prefetch"))), ] if early else []  # fmt: skip
    out.extend(split_root_regathers(run, base, (*kept_blocks(run, L), *saved_all), log_softmax))
    ce_base = (*base[:-1], root_side(run, "loss"), *head_prefetched(run)) if split_root(run) else base
    out.append(Moment("backward", "cross-entropy backward", (*ce_base, *kept_blocks(run, L), *saved_all, log_softmax,
                      _act("nll and log-softmax gradients (fp32)", 2 * acts.log_softmax, 2),
                      *loss_parallel_backward(run), *(prefetched(run, L) if early else ()))))  # fmt: skip
    if resharded_after_head(run) or spanning_resharded(run):  # their pre-backward, on the logits' gradient
        name = (head_units(run) or spanning_resharded(run))[-1].name  # copies out the root's prefetch (or its own)
        out.append(Moment("backward", f"{name} backward copy-out", (*base, *kept_blocks(run, L), *saved_all,
                          _act("logits gradient", acts.logits), *head_prefetched(run, at_copy_out=True))))  # fmt: skip
    # a backward all-gather copies its input (the shard, or the k-sharded data) into a flat param-dtype
    # buffer first, freed once the collective returns: the root's pre_backward prefetches the last block
    if resharded(run) and not early:
        out.append(Moment("backward", f"block {L} backward all-gather (root's prefetch)", (
            *base, *kept_blocks(run, L), *saved_all, _act("logits gradient", acts.logits), gather_input(run, L),
            ag_output(run, L, "backward prefetch"))))  # fmt: skip
    root_held = Term("root gradients held (head weight, final norm)", (run.head_numel + run.final_norm_numel) * p,
                     "autograd (unsharded root .grad until the root's post_backward)", 2)  # fmt: skip
    out.append(Moment("backward", "LM head backward", (*base, *kept_blocks(run, L), *saved_all,
                      _act("logits gradient", acts.logits), _act("final norm output gradient", n_d),
                      Term("head weight gradient", run.head_numel * p, "autograd (mm backward)"),
                      *prefetched(run, L))))  # fmt: skip
    out.append(Moment("backward", "final norm backward", (*base, *kept_blocks(run, L), _blocks_saved(run, L),
                      root_held, final_norm_backward(run), *prefetched(run, L))))  # fmt: skip
    for u in reversed(head_units(run)):  # a split root's [norm, output]: reduced at its own post_backward, with
        # its last parameter's gradient (an untied head's) held through it (terms.last_grad_held), before the layers
        ugrads, rs_in, rs_out, cast, gloo = side_reduce(run, u)
        common = (*base[:-1], root_side(run, "blocks"), *kept_blocks(run, L), _blocks_saved(run, L),
                  _act("final norm input gradient", n_d), *prefetched(run, L))  # resharded before it reduces
        out.append(Moment("backward", f"{u.name} reduce-scatter copy-in", (*common, ugrads, rs_in)))
        last = last_grad_held(run, u.params[-1][1], u.name)
        out.extend(reduce_scatter_moments(u.name, (*common, *last), rs_in, rs_out, cast, gloo))
    if not split_root(run):  # a merged root resharded: its all-gather output held to its reduce-scatter (a bound)
        start = side_regathers(run, "start")
        out = [Moment(m.phase, m.name, (*m.terms, *start)) for m in out]
    if head_units(run):  # reduced and resharded after their backward (FSDPParamGroup.post_backward): from here
        # on the units after the layers hold their sharded gradients, not their parameters or unsharded ones
        base = (*base[:-1], root_side(run, "blocks"))
        root_held = _fp(f"sharded gradients of {', '.join(u.name for u in head_units(run))}",
                        sum(_gathered_numel(run, u) // run.nd for u in head_units(run)) * run.m,
                        "_fsdp_collectives.py:foreach_reduce", len(head_units(run)))  # fmt: skip
    after, held = L + 1, holds_allreduce(run)
    for i in range(L, 0, -1) if blocks is None else blocks:
        # blocks not built (``blocks``): their reduce-scatter outputs, for HSDP's held buffers (``moments``) only, in
        # one moment a run of them (none kept between them: the same buffers held after; a speed-up); none held: none
        if held and (gap := range(after - 1, i, -1)):
            out.append(Moment("backward", f"blocks {gap[0]}-{gap[-1]}{NOT_BUILT}{REDUCED}",
                              tuple(rs_output(run, j) for j in gap)))  # fmt: skip
        out.extend(block_backward_moments(run, i, base, root_held))
        after = i
    out.extend(root_backward_moments(run, base))
    out = with_embedding_prefetch(run, out)
    end = side_regathers(run, "end")
    again = embedding_regather(run)  # from their copy-out (their pre-backward): their unsharded parameters alone
    if not again:
        return tuple(out)
    # wait_for_unshard frees a backward all-gather output when the copy-out returns (it keeps one only in
    # forward): measured on the fake group (no gloo copy to hide it), qwen2 V 12007 under torchtitan at N_d = 8
    at = next(i for i, m in enumerate(out) if m.name == "embedding backward")
    emb = out[at]
    copy_out = Moment("backward", f"{', '.join(u.name for u in embedding_units(run))} backward copy-out", (
        *(t for t in emb.terms if t.name not in EMBEDDING_GRADS), *end, *again))  # fmt: skip
    out[at:at + 1] = [copy_out, Moment(emb.phase, emb.name, (*emb.terms, *again))]
    return tuple(out)


# the embedding backward's weight gradients, made after the embeddings' copy-out (root_backward_moments)
EMBEDDING_GRADS = ("other root gradients", "head weight gradient", "head weight gradient (input buffer)",
                   "embedding weight gradient", "their sum")


def block_backward_moments(run: Fsdp2Run, i: int, base: tuple[Term, ...], root_held: Term) -> tuple[Moment, ...]:
    """Block ``i`` in backward: its copy-out and the next block's prefetch (resharded), its backward, its gradients
    complete, its reduce-scatter; the blocks after it are reduced (``done``), the previous block's reduce-scatter input
    is held until this post_backward. Each term asked once, those alike for all blocks once per run (a speed-up)."""
    if (ctx := run.memo.get(BLOCK_CONTEXT)) is None:
        blk, n_d, L = run.acts.block, run.acts.embed_out, len(run.units) - 1
        ws = max(blk.backward_first_op, blk.backward_act_grads + blk.first_weight_grads)
        ctx = run.memo[BLOCK_CONTEXT] = (blk, L, _act("incoming activation gradient", n_d), _act(
            "block backward working set", ws), _act("block input gradient", n_d), resharded(run), kept_blocks(run, L))
    blk, L, incoming, working, grad_in, again, all_kept = ctx
    done = grads(run, range(i + 1, L + 1))
    held = (rs_input(run, i + 1, "held until the next post_backward"),) if i < L else ()
    kept_before, saved_before, saved_i = all_kept[:i - 1], _blocks_saved(run, i - 1), _blocks_saved(run, i)
    whole, pre = unsharded(run, i), (ag_output(run, i - 1, "backward prefetch"),) if again and i > 1 else ()
    out = []
    if again:  # resharded: pre_backward: the prefetched all-gather output is copied out, then freed (with
        # the block's k-sharded data: FSDPParam.to_unsharded), then the next block is prefetched
        out.append(Moment("backward", f"block {i} copy-out", (*base, *all_kept[:i], saved_i, incoming,
                          root_held, ag_output(run, i, "prefetched, freed after copy-out"), whole, *held, done)))
        if i > 1:
            out.append(Moment("backward", f"block {i - 1} backward all-gather (prefetch)", (*base, *kept_before,
                              saved_i, incoming, root_held, whole, gather_input(run, i - 1), *pre, *held, done)))
    # the per-op policy: the recompute has popped the layer's cached outputs (kept or freed by then: selective_ac)
    inflight = (saved_before, _act("checkpointed block input", blk.ckpt_saved)) if run.ac_op else (saved_i,)
    checkpointed = run.checkpointed(i)
    if checkpointed:
        inflight += (_act("recomputed block's saved activations", blk.recomputed),)
    out.append(Moment("backward", f"block {i} backward", (*base, *kept_before, *inflight, incoming, root_held, working,
                                                         whole, *pre, *held, done)))  # fmt: skip
    if i == 1 and rope_released(run):  # the first layer's rotary products have run backward: cos and sin go
        base = tuple(t for t in base if t.name != "embedding saved (position ids)")
    grads_i = unit_grads(run, i)
    if projections := input_projections_backward(run, grads_i):  # q's: every weight gradient but the norm's
        out.append(Moment("backward", f"block {i} attention input projections' backward", (*base, *kept_before,
                          saved_before, incoming, *projections, root_held, whole, *pre, *held, done)))
    # the block's first op (its input norm) runs backward last: every weight gradient of the block exists
    out.append(Moment("backward", f"block {i} gradients complete", (*base, *kept_before, saved_before, incoming,
                      input_norm_backward(run, checkpointed), root_held, whole, grads_i, *pre, *held, done)))
    common = (*base, *kept_before, saved_before, grad_in, root_held, *pre, done)
    rs_in = rs_input(run, i, "this unit")
    out.append(Moment("backward", f"block {i} reduce-scatter copy-in", (*common, grads_i, rs_in)))
    last = last_grad_held(run, run.units[i].shapes[-1], f"block {i}")
    out.extend(reduce_scatter_moments(f"block {i}", (*common, *last), rs_in, rs_output(run, i), grad_cast(run, i),
                                      gloo_copy(run, i)))  # fmt: skip
    return tuple(out)


def root_backward_moments(run: Fsdp2Run, base: tuple[Term, ...]) -> tuple[Moment, ...]:
    """The embeddings' backward (a tied head's two gradients summed), then the root's reduce-scatter."""
    L, p, n_d = len(run.units) - 1, run.p, run.acts.embed_out
    blocks_done = grads(run, range(1, L + 1))
    if head_units(run):  # the units after the layers were reduced first: their sharded gradients too
        blocks_done = _fp(f"sharded gradients of {L} blocks and {', '.join(u.name for u in head_units(run))}",
                          blocks_done.bytes + sum(_gathered_numel(run, u) // run.nd for u in head_units(run)) * run.m,
                          "_fsdp_collectives.py:foreach_reduce", L + len(head_units(run)))  # fmt: skip
    released, alive = root_backward_released(run, base)  # what the tree has let go of by then (hf_tree)
    incoming = (_act("incoming activation gradient", n_d),) if alive else ()
    others = (run.units[0].numel - run.head_numel) * p
    if run.tied_head:  # torch/csrc/autograd/input_buffer.cpp: the two gradients are summed out of place
        emb = (Term("head weight gradient (input buffer)", run.head_numel * p, "autograd InputBuffer"),
               Term("embedding weight gradient", run.head_numel * p, "aten embedding_dense_backward"),
               Term("their sum", run.head_numel * p, "autograd InputBuffer::add"))  # fmt: skip
    elif head_units(run):  # the head's gradient was reduced with its unit, early in backward
        emb = ()
    else:
        emb = (Term("head weight gradient", run.head_numel * p, "autograd (mm backward)"),)
    out = [Moment("backward", "embedding backward", (
        *released, *incoming, *emb,
        Term("other root gradients", others, "autograd (embedding, final norm)"),
        rs_input(run, 1, "held until the root's post_backward"), blocks_done))]  # fmt: skip
    root_base = released[:-1]  # the root is resharded before its reduce-scatter (base[-1])
    if split_root(run):  # the unit reduced last (the root, or the embeddings): its own buffers
        # its unsharded gradients stay alive through its reduce-scatter: a unit whose post_backward runs in the
        # root's final callback (the embeddings' inputs need no gradient, so no hook of theirs fires) reduces
        # gradients autograd still holds (measured: wide-vocabulary qwen2 under torchtitan's wrapping, exact)
        order = final_callback_units(run)
        for j, u in enumerate(order[:-1]):  # the root first (all_states order), the later units still whole
            ugrads, rs_in, rs_out, cast, gloo = side_reduce(run, u)
            pending = tuple(t for v in order[j + 1:] for t in (side_reduce(run, v)[0], _fp(
                f"unsharded parameters ({v.name}, resharded at its own post_backward, after)",
                _gathered_numel(run, v) * run.p, "_fsdp_param_group.py:FSDPParamGroup.post_backward")))  # fmt: skip
            common = (*root_base, blocks_done, *pending)
            out.append(Moment("backward", f"{u.name} reduce-scatter copy-in", (*common, ugrads, rs_in)))
            last = last_grad_held(run, u.params[-1][1], u.name)  # the others are freed by the copy-in
            out.extend(reduce_scatter_moments(u.name, (*common, *last), rs_in, rs_out, cast, gloo))
            shard_bytes = _gathered_numel(run, u) // run.nd * run.m  # reduced: its sharded gradients from here
            blocks_done = _fp(f"{blocks_done.name}, {u.name}", blocks_done.bytes + shard_bytes,
                              "_fsdp_collectives.py:foreach_reduce", blocks_done.tensors + 1)  # fmt: skip
        final = order[-1] if len(order) > 1 else last_side_unit(run)
        ugrads, rs_in, rs_out, cast, gloo = side_reduce(run, final)
        held = last_grad_held(run, final.params[-1][1], final.name)
    else:
        ugrads = Term("unsharded gradients (root)", run.units[0].numel * p, "autograd", len(run.units[0].shapes))
        rs_in, rs_out, cast, gloo = rs_input(run, 0, "this unit"), rs_output(run, 0), grad_cast(run, 0), gloo_copy(run, 0)
        held = last_grad_held(run, run.units[0].shapes[-1], "root")
    out.append(Moment("backward", "root reduce-scatter copy-in", (*root_base, ugrads, rs_in, blocks_done)))
    out.extend(reduce_scatter_moments("root", (*root_base, blocks_done, *held), rs_in, rs_out, cast, gloo))
    return tuple(out)


NOT_BUILT = " (not built)"
BLOCK_CONTEXT = ("block_backward_context",)  # ``run.memo`` key of what ``block_backward_moments`` asks every block


def moments(run: Fsdp2Run, blocks: tuple[int, ...] | None = None) -> tuple[Moment, ...]:
    """Every moment of a training step of FSDP2 (needs activations: an architecture); ``blocks``: only these
    blocks' backward moments, last first (``leaders.sampled_blocks``; None: every block)."""
    if run.acts is None:
        raise ValueError("the peak needs an architecture (activations); this run has only tensor shapes")
    # HSDP's held all-reduce buffers (mesh.py); the blocks not built are there only for them, and left out there
    backward = with_allreduce_held(run, backward_moments(run, blocks), NOT_BUILT if blocks is not None else None)
    every = (*init_moments(run), *forward_moments(run), *backward, *optimizer_moments(run))
    return offload_moments(run, every) if run.settings.offload_policy != "none" else every  # CPUOffloadPolicy
