"""ZeRO-3 on a mixture-of-experts decoder layer (transformers 5.24, DeepSpeed 0.19.8): the sparse block's
forward moments, read off the coordinator at its own hooks, the backward moment of its gradients' reduction, and
which sparse runs are modelled. The mechanism, with the sources read: docs/engines/deepspeed.md "ZeRO-3 and
mixture-of-experts".

Every sparse MLP's submodules are called at every step whatever the routing (``experts`` is one module holding
every expert's 3-D tensors, ``MixtralExperts``/``Qwen3MoeExperts``/``DeepseekV3Experts``), so the module trace
is the same at every step (partitioned_param_coordinator.py ``trace_prologue`` never invalidates it) and every
expert is gathered, routed or not: the worst case where routing varies is the case. DeepSpeed makes Mixtral's
and the Qwen MoEs' sparse MLP a ZeRO-3 leaf by default (trace.py ``_LEAF_SPARSE``): one fetch for the router and
the experts, one backward hook reducing all their gradients; DeepSeek-V3's keeps a hook per module.

Symbols: N tokens of the micro-batch, E routed experts, k experts per token, d width, f one expert's width,
a activation bytes, p parameter bytes."""

from __future__ import annotations

from typing import Optional

from zeroplan.engines.deepspeed.run import DSRun, _act, _blocks_saved, _gathered, _states, router_copies, shared_memo
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.formulas import deepseek_activations as DS
from zeroplan.formulas.moe_activations import ROUTING_WEIGHT_BYTES
from zeroplan.formulas.moe_activations import INDEX_BYTES
from zeroplan.formulas.moe_block import FP32, router_saved, shared_expert_saved, sparse_backward_ws, weighted_bytes
from zeroplan.formulas.peak import Moment, Term

STAGE3 = "runtime/zero/stage3.py"


def mark_names(run: DSRun) -> frozenset[str]:
    """The names of the trace's marks, once per trace (``shared_memo``; a speed-up, no rule: each ZeRO-3 run made a
    set of a 405B trace's ~3,000 marks to test a name)."""
    marks = run.trace.marks
    return shared_memo("mark names", (marks,), (), lambda: frozenset(m for m, _, _ in marks))  # type: ignore[return-value]


def sparse_blocks(run: DSRun) -> tuple[int, ...]:
    """The decoder layers whose sparse MLP has marks in the ZeRO-3 trace (trace.py ``_sparse_mark``); once per trace
    and depth (a speed-up, no rule)."""
    if run.trace is None:
        return ()
    L = run.acts.n_layer
    return shared_memo("sparse blocks", (run.trace.marks,), (L,), lambda: tuple(  # type: ignore[return-value]
        j for j in range(L) if f"block {j} after experts" in mark_names(run)))


def _block(run: DSRun, j: int):
    acts = run.acts
    return acts.layer_blocks[j] if acts.layer_blocks else acts.block


def _tokens(run: DSRun) -> int:
    spec = run.spec
    return run.acts.embed_out // (spec.d_model * _abytes(run))


def _abytes(run: DSRun) -> int:
    return DTYPE_BYTES[run.settings.dtype]


def _before_experts(run: DSRun) -> tuple[int, int]:
    """(saved, alive unsaved) bytes of the sparse MLP made before its ``experts`` run: the router's saved tensors
    and, Qwen2-MoE, the shared expert's (it runs first); the router's logits (N·E·a, DeepSeek fp32), its top-k
    weights (N·k·w) and, where no norm saves them (16-bit), the block input and x1 (2·N·d·a), plus Qwen2-MoE's
    shared output (N·d·a)."""
    spec, a, n = run.spec, _abytes(run), _tokens(run)
    moe, mt, d = spec.moe, spec.model_type, spec.d_model
    if mt == "deepseek_v3":
        saved = DS.router_saved(moe, n, d, a)
        logits = n * moe.n_experts * FP32
    else:
        saved = router_saved(moe, mt, n) + shared_expert_saved(moe, mt, n, d, a)
        logits = n * moe.n_experts * a
    shared_out = n * d * a if shared_expert_saved(moe, mt, n, d, a) else 0
    inputs = 0 if a == FP32 else 2 * n * d * a
    return saved, logits + n * moe.top_k * (ROUTING_WEIGHT_BYTES[mt] or a) + inputs + shared_out


def _inputs(run: DSRun) -> int:
    """The block input and x1 where no norm saves them (16-bit; fp32: the norms save them, in ``saved``)."""
    a = _abytes(run)
    return 0 if a == FP32 else 2 * run.acts.embed_out


def sparse_forward_moments(run: DSRun, sched, base: tuple[Term, ...]) -> tuple[Moment, ...]:
    """Each sparse layer's forward moments at ZeRO-3, without checkpointing (``sparse_blocks``), each with what the
    coordinator holds at that hook (``_gathered`` of the trace's marks):

    - the post-attention norm fetched, and the sparse MLP where it is a ZeRO-3 leaf (Mixtral, Qwen-MoE: one
      fetch gathers the router and both expert tensors) or its router (DeepSeek): a prefetch may have
      all-gathered expert tensors in one coalesced call whose flat buffer stays open, beside the copies, until the
      fetch that pops the last of them (partition_parameters.py ``_all_gather_dtype``, coordinator.py
      ``Coordinator.wait``); alive: the earlier blocks' saved tensors and this block's up to its MLP (measured:
      Mixtral, the forward peak is the last block's post-attention norm, 384 B over these terms);
    - DeepSeek's ``experts`` fetched: the router's saved tensors (in a 16-bit run with its fp32 weight copy,
      ``run.router_copies``) and outputs added (``_before_experts``);
    - the experts run and after, to the sparse MLP's release (DeepSeek's shared experts run last): the block's
      saved tensors and its forward peak beyond them (``forward_extra``), with the most gathered there (measured:
      Qwen3-MoE, the reordering ``weighted_out[inv_perm]``)."""
    tails = shared_memo("sparse forward tails", (sched, run.trace, run.acts, run.spec), (  # type: ignore[union-attr]
        run.checkpointing, run.transformers, run.settings.dtype, run.settings.quantized_weights, run.nd),
        lambda: _sparse_forward_tails(run, sched))
    return tuple([Moment("forward", name, (*base, *tail)) for name, tail in tails])


def _sparse_forward_tails(run: DSRun, sched) -> tuple[tuple[str, tuple[Term, ...]], ...]:
    """``sparse_forward_moments``' (name, terms after ``base``), once for the runs of one schedule, trace,
    activations, architecture, checkpointing, model, dtype, qwZ and N_d: what they read (``shared_memo``; a speed-up,
    no rule: each ZeRO-3 candidate made them anew; tests/test_deepspeed_moe_memos.py)."""
    out = []
    L, marks = run.acts.n_layer, mark_names(run)
    ckpt = run.checkpointing != "none"
    masks = Term("the body's unused attention mask (bool)", run.acts.body_masks,
                 "transformers models/qwen2_moe/modeling_qwen2_moe.py Qwen2MoeModel.forward (causal_mask_mapping): "
                 "activation_terms.unused_sliding_mask")  # fmt: skip
    base = (masks,) if run.acts.body_masks else ()
    for j in sparse_blocks(run):
        blk, name = _block(run, j), ("last block" if j == L - 1 else f"block {j}")
        held = (_blocks_saved(run, j), _act("block's saved activations before its MLP", blk.saved - blk.mlp_saved))
        inputs = _act("block input and x1 (not saved, 16-bit)", _inputs(run), 2)
        if ckpt:  # no grad: the checkpoint's input (in the first j + 1 blocks' term), x1 and the norm's output
            held = (_blocks_saved(run, j + 1), _act("x1 and the post-attention norm's output (no grad)",
                                                     2 * run.acts.embed_out, 2))  # fmt: skip
            inputs = _act("", 0)
        for what in ("post_attention_layernorm", "mlp", "gate"):  # the mlp's mark where it is a leaf, else the router's
            if f"block {j} {what} fetch" in marks and (what != "mlp" or f"block {j} gate fetch" not in marks):
                out.append((f"{name}, {what} fetched", (
                    *base, *_gathered(run, sched, f"block {j} {what} fetch", during=True), *held, inputs)))  # fmt: skip
        if f"block {j} experts fetch" in marks:
            r_saved, r_alive = _before_experts(run)
            r_saved += router_copies(run, j + 1) - router_copies(run, j)  # DeepSeek 16-bit: its fp32 weight copy
            out.append((f"{name}, experts fetched", (
                *base, *_gathered(run, sched, f"block {j} experts fetch", during=True), *held,
                _act("router's saved tensors", r_saved),
                _act("router logits and top-k weights (and 16-bit inputs)", r_alive))))  # fmt: skip
        if ckpt and f"block {j} attention" in marks:  # its no-grad peak may be the attention's (DeepSeek's SDPA)
            out.append((f"{name}, attention (no grad)", (
                *base, *_gathered(run, sched, f"block {j} attention"), _blocks_saved(run, j),
                _act("checkpointed block's working set (no grad)", blk.ckpt_forward_peak))))  # fmt: skip
        run_terms = ((_blocks_saved(run, j), _act("checkpointed block's working set (no grad)", blk.ckpt_forward_peak))
                     if ckpt else (_blocks_saved(run, j + 1),
                                   _act("block's forward peak beyond its saved tensors", blk.forward_extra)))  # fmt: skip
        out.append((f"{name}, experts run", (
            *base, *_gathered(run, sched, f"block {j} after experts"), *run_terms)))  # fmt: skip
    return tuple(out)


def _bucket_walk(sizes: tuple[int, ...], bucket: int) -> tuple[int, int]:
    """(the most elements alive, the elements still held after the last hook) while gradients of ``sizes``, in
    hook order, all alive at the first hook, go through stage3.py ``reduce_independent_p_g_buckets_and_remove_grads``
    one by one (``_reduction_peak``)."""
    alive, peak, elements, held = sum(sizes), sum(sizes), 0, 0
    for n in sizes:
        if elements + n > bucket and elements > 0:
            peak = max(peak, alive + held)  # the held gradients' reduce-scatter copy
            alive, elements, held = alive - held, 0, 0
        if elements + n <= bucket:
            alive -= n
        else:
            held += n
        elements += n
    return max(peak, alive + held), held


def _reduction_peak(sizes: tuple[int, ...], bucket: int, g: int, norm_copy=None, nd: int = 1) -> int:
    """The most bytes of gradients (``g`` bytes an element) alive while the sparse MLP's gradients, ``sizes`` in
    hook order, all alive at the first hook, go through stage3.py ``reduce_independent_p_g_buckets_and_remove_grads``
    one by one: a gradient that fits the contiguous bucket is copied in and freed (``__add_grad_to_ipg_bucket``); a
    larger one stays in ``param.grad`` until the next hook reduces the bucket (``__reduce_and_partition_ipg_grads``),
    whose reduce-scatter makes a full-size copy of it on gloo (measured, below) before ``partition_grads`` frees it.
    ``norm_copy(n)``: with ``offload_optimizer``, the bytes ``partition_grads -> _offload_grad_partition_at_boundary``
    makes to take a held gradient's partition norm (``_constant_buffered_norm2``: an fp64 copy, one at a time, after
    gloo's copy is freed: the larger of the two, as zero3.py ``_in_block_reductions``). Beside both, where ``nd``
    does not divide the held gradient (or several are held), ``reduce_scatter_coalesced``'s interleaved, padded
    flat buffer (``torch.cat``, ceil(n / N_d)·N_d elements each; one tensor dividing evenly is reduced as a view of
    itself), whose chunk the returned partitions are views of, alive through ``partition_grads``. Measured: Mixtral
    fp16 with offload_optimizer, N_d = 3, 5,000-element buckets, gate_up_proj's 262,144 elements: 524,452 B
    (3.38 %) under on every rank before, the padded buffer's 524,292 B (tests/data/measured/deepspeed_moe_nd3.json)."""

    def copy(held: list[int]) -> int:
        gloo = sum(held) * g
        padded = 0 if len(held) == 1 and held[0] % nd == 0 else sum(-(-n // nd) * nd for n in held) * g
        return padded + (max(gloo, max(norm_copy(n) for n in held)) if held and norm_copy else gloo)

    alive, elements, held = sum(sizes), 0, []
    peak = alive * g
    for n in sizes:
        if elements + n > bucket and elements > 0:
            peak = max(peak, alive * g + copy(held))
            alive, elements, held = alive - sum(held), 0, []
        if elements + n <= bucket:
            alive -= n
        else:
            held.append(n)
        elements += n
    return max(peak, alive * g + copy(held))


def expert_gradients_held(run: DSRun, sched) -> tuple[Moment, ...]:
    """The last sparse layer's gradients at ZeRO-3, where its expert tensors' gradients stay in ``param.grad``.

    A ZeRO-3 leaf (Mixtral, Qwen-MoE, trace.py ``_LEAF_SPARSE``) has no per-parameter gradient hooks: its
    parameters' gradients are reduced together by the module's backward hook, after the router's backward
    (stage3.py ``create_reduce_and_remove_grad_hooks`` -> ``reduce_leaf_module_grads``), every one alive until
    then, then one by one (``_reduction_peak``). Measured (live-storage trace, gloo, N_d = 2, 5,000-element
    buckets): Mixtral's peak there is ``gate_up_proj``'s gradient (2·E·d·f), its reduce-scatter copy and
    ``down_proj``'s gradient (E·d·f), Qwen3-MoE's the same plus the router weight's (E·d): ``gate_up_proj`` is
    reduced when ``down_proj`` is added (NCCL reduces in place: the copy is gloo's, not measured on a GPU).
    Elsewhere (DeepSeek) each gradient has its own hook: a tensor larger than the bucket is held to the next one
    (``_reduction_peak`` of the experts' tensors, ``down_proj``'s first). Beside them the earlier blocks' saved
    tensors, the block's up to its MLP and the MLP's input gradient (N·d·a). With ``offload_optimizer`` the norm's
    fp64 copy of the held gradient's partition in place of gloo's copy where larger (``_reduction_peak``; live
    storages, Mixtral bf16 at 5,000-element buckets: Mixtral, Qwen3-MoE, Qwen2-MoE were 1.3-2.6 % under, now within
    160 B: tests/test_deepspeed_moe_opt.py)."""
    blocks = sparse_blocks(run)
    if not blocks or blocks[-1] != run.acts.n_layer - 1:
        return ()
    j, names = blocks[-1], run.trace.names
    leaf, experts = shared_memo("last sparse modules", (names,), (j,), lambda: (  # once per trace (a speed-up, no rule)
        next((i for i, n in enumerate(names) if n.endswith(f".{j}.mlp")), None),
        next((i for i, n in enumerate(names) if n.endswith(f".{j}.mlp.experts")), None)))  # type: ignore[misc]
    if experts is not None:  # hooked one by one: the experts' down_proj first (backward order), then gate_up_proj
        sizes = tuple(run.numels[i] for i in sorted(run.trace.modules[experts], reverse=True))
    elif leaf is not None:  # named_parameters order (the leaf's parameter list)
        sizes = tuple(run.numels[i] for i in run.trace.modules[leaf])
    else:
        return ()
    s = run.settings
    bucket = s.reduce_bucket_size if s.contiguous_gradients else 0
    if all(n <= bucket for n in sizes) and experts is not None:
        return ()
    g, blk, acts = DTYPE_BYTES[s.grad_dtype], _block(run, j), run.acts
    nd = run.nd  # the norm's fp64 copy of a rank's partition and its 8-B norm (zero3.py _in_block_reductions)
    norm_copy = (lambda n: -(-n // nd) * DTYPE_BYTES["fp64"] + 8) if s.offload_optimizer.on else None
    base = (*_states(run), *run.wrapper.held_between_micro_steps(run),
            _act("batch (token ids, targets)", acts.batch, 2), _act("embedding saved (position ids)", acts.embed_saved),
            _act("loss", acts.loss))  # fmt: skip
    return (Moment("backward", "last block sparse MLP's gradients reduced", (
        *base, *_gathered(run, sched, "last block backward"), _blocks_saved(run, j),
        _act("block's saved activations before its MLP", blk.saved - blk.mlp_saved),
        _act("the sparse MLP's input gradient", acts.embed_out),
        Term("the sparse MLP's gradients and a reduce-scatter copy (gloo) or, with offload_optimizer, the norm's "
             "fp64 copy of a partition", _reduction_peak(sizes, bucket, g, norm_copy, nd),
             f"{STAGE3} reduce_leaf_module_grads / reduce_independent_p_g_buckets_and_remove_grads -> "
             "__avg_scatter_grads -> runtime/comm/coalesced_collectives.py reduce_scatter_coalesced (torch.cat); "
             "partition_grads -> _offload_grad_partition_at_boundary -> _constant_buffered_norm2"))),)  # fmt: skip


_SHARED_BACKWARD = ("down_proj", "up_proj", "gate_proj")
"""DeepSeek's shared experts' weight gradients in hook order: ``down_proj(act(gate_proj(x)) * up_proj(x))`` read
backward (autograd runs the node made last first: up_proj's before the activation's and gate_proj's)."""


def routed_experts_backward(run: DSRun, sched, last: tuple[Term, ...]) -> Optional[tuple[Moment, Moment]]:
    """The last layer's backward where its routed experts are hooked apart from its shared experts (DeepSeek-V3) and
    each gradient goes to the bucket at its hook (``contiguous_gradients``), as two moments in place of the dense
    "last block backward" (``last``), or None elsewhere.

    ``DeepseekV3MoE`` runs its shared experts after the routed ones, so backward runs them first: by the routed
    experts' moments (``moe_block.sparse_backward_ws``) the shared experts' parameters have been released
    (parameter_offload.py ``post_sub_module_backward_function`` -> partitioned_param_coordinator.py
    ``release_sub_module``; trace.py's ``block j experts backward`` mark) and their weight gradients have left
    ``param.grad``: copied into the bucket at their hooks, or, larger than it, kept until the next hook sends the
    bucket (stage3.py ``reduce_independent_p_g_buckets_and_remove_grads``; the last one held: ``_bucket_walk``), at
    the latest the routed ``down_proj``'s, before its weight gradient is made. The formulas' working set counts them
    (3·d·f_s, ``deepseek_sparse_block``: FSDP2 keeps a layer's gradients to its reduce-scatter). Measured
    (live-storage trace at the peak, DeepSeek-V3 wide, transformers' checkpointing, 5,000-element buckets, gloo,
    N_d = 2): the peak is the recomputed routed experts' gate-up backward, without the shared experts' parameters
    and gradients (2 x 98,304 B), 196,024 B (2.3 %) over before. The other moment keeps the dense one's terms with
    the block's other working sets: the shared experts' own (``deepseek_sparse_block``) and the attention's
    (``backward_first_op_recomputed``, the latent attention's backward where it is the larger, less the MLP's weight
    gradients it counts: sent by then)."""
    if not run.settings.contiguous_gradients or run.trace is None or run.spec is None or run.spec.moe is None:
        return None
    j = run.acts.n_layer - 1
    mark = f"block {j} experts backward"
    if mark not in mark_names(run) or "shared_experts" not in " ".join(run.trace.names):
        return None
    names, spec, a, n = run.trace.names, run.spec, _abytes(run), _tokens(run)
    moe, d, mt, blk = spec.moe, spec.d_model, spec.model_type, _block(run, j)
    shared = [next((m for i, m in enumerate(run.trace.modules) if names[i].endswith(f".{j}.mlp.shared_experts.{x}")),
                   ()) for x in _SHARED_BACKWARD]  # fmt: skip
    sizes = tuple(run.numels[i] for m in shared for i in m)
    held = _bucket_walk(sizes, run.settings.reduce_bucket_size)[1] * DTYPE_BYTES[run.settings.grad_dtype]
    fs, s_rows, wo = moe.shared_ffn, n * moe.top_k, weighted_bytes(mt, a)
    shared_saved = DS.shared_experts_saved(moe, n, a)
    own = n * d * a if a == FP32 else 0  # deepseek_sparse_block's ``after_shared``, less the shared weight gradients
    # before the routed down_proj's hook (the reordering's backward, sparse_backward_ws's first moments) the last
    # shared gradient larger than the bucket may still be held
    reorder = 3 * s_rows * d * wo + max(0, (s_rows * d * a if wo != a else 0) - s_rows * INDEX_BYTES)
    routed = max(sparse_backward_ws(moe, mt, n, d, a), reorder + held) + own - shared_saved
    # the shared experts' own moments; the attention's, net of the MLP's weight gradients, sent by then
    attention = blk.backward_first_op_recomputed - DS._mlp_weight_grads(spec, a)
    other = max(attention, n * fs * a + d * fs * a, 2 * n * fs * a + d * fs * a)
    ws = "block backward working set"
    gathered = set(_gathered(run, sched, "last block backward"))
    src = f"{STAGE3} reduce_independent_p_g_buckets_and_remove_grads; partitioned_param_coordinator.py release_sub_module"
    experts = tuple(t for t in last if t not in gathered and t.name != ws)
    return (Moment("backward", "last block backward", tuple(
                t if t.name != ws else _act("block backward working set (attention, shared experts)", other)
                for t in last)),
            Moment("backward", "last block routed experts backward", (
                *experts, *_gathered(run, sched, mark),
                Term("routed experts' backward working set (shared experts' gradients sent)", routed, src))))  # fmt: skip


ZERO3_MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
"""The sparse families whose ZeRO-3 peak is measured (tests/test_deepspeed_moe.py)."""


def zero3_moe_limit(model_type: str, zero: dict) -> Optional[str]:
    """Why ZeRO-3's peak of a sparse model under ``zero`` (the ds_config's ``zero_optimization``) is not given,
    or None: outside ``ZERO3_MOE_FAMILIES``, with ZeRO-3 leaves other than DeepSpeed's defaults, or with ZeRO++
    (its schedule on a sparse layer is not measured). ``offload_param`` cpu and nvme: measured on the four families,
    the dense terms (tests/test_deepspeed_moe_fp16_nvme.py; refused before, moefp16 2026-12-02)."""
    if model_type not in ZERO3_MOE_FAMILIES:
        return f"model_type {model_type!r} not measured (measured: {', '.join(ZERO3_MOE_FAMILIES)})"
    if zero.get("leaf_module") not in (None, {}) or zero.get("stage3_module_granularity_threshold") not in (None, 0):
        return ("leaf_module / stage3_module_granularity_threshold not modelled (DeepSpeed's default leaf classes "
                "assumed: trace.py _LEAF_SPARSE)")
    zeropp = [k for k in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")
              if zero.get(k) not in (None, False, 0, 1)]  # fmt: skip
    return f"ZeRO++ ({', '.join(zeropp)}) not measured" if zeropp else None
