"""The sparse MLP of a mixture-of-experts decoder layer, as transformers 5.24 trains it: what autograd saves
and the working sets beside it, per layer and micro-batch (bytes). The routed experts' own terms are
``moe_activations.expert_activations``; this module adds the router and the shared expert, and the moments
of the block's forward and backward that the engines' peaks take.

Symbols: N = b·s tokens, k = experts per token, S = N·k dispatched rows, E = routed experts, d = width,
f = one expert's width, f_s = the shared expert's width, ``a`` = activation bytes, ``w`` = the routing
weights' bytes (``moe_activations.ROUTING_WEIGHT_BYTES``).

Saved for backward (saved-tensor hooks on transformers' classes, tests/test_moe_peaks.py; derivatives.yaml
per op), beside the post-attention norm's output, which the router's linear saves (the dense MLP's gate and
up linears save that same storage, counted with the norm):

- the router (``MixtralTopKRouter.forward``, ``Qwen2MoeTopKRouter.forward``, ``Qwen3MoeTopKRouter.forward``):
  ``softmax(logits, fp32)`` saves its fp32 output (N·E·4; Mixtral's ``router_logits.float()`` copy is not
  saved), ``topk`` its int64 indices (N·k·8: the storage the experts receive as ``top_k_index``); where the
  top-k weights are renormalised (``router_top_value /= sum``: always for Mixtral, ``norm_topk_prob`` for the
  Qwen MoEs) the in-place division saves the fp32 sum (N·4) and a clone of its fp32 input (N·k·4);
- the routed experts: ``expert_activations`` (grouped_mm, the default; the gathered rows, the gate-up output,
  SiLU's output and the product, the down output, the sorted weights, three int64 indices, E int32 offsets);
- Qwen2-MoE's shared expert (``Qwen2MoeSparseMoeBlock.forward``): a SwiGLU MLP (gate and up outputs, SiLU's
  output, the product: 4·N·f_s·a), ``sigmoid(shared_expert_gate(x))`` (N·a, saved by sigmoid and the
  product) and the shared expert's output (N·d·a, saved by that product).

No load-balancing loss: ``output_router_logits`` is false by default in every family here (MixtralConfig,
Qwen2MoeConfig, Qwen3MoeConfig), and the model adds ``aux_loss`` only when it is set.
"""

from __future__ import annotations

import math

from zeroplan.architectures.moe import MoeSpec, moe_shapes
from zeroplan.formulas import deepseek_activations as DS
from zeroplan.formulas.moe_activations import INDEX_BYTES, ROUTING_WEIGHT_BYTES, expert_activations

FP32 = 4  # the router's softmax output and the renormalised top-k weights (``dtype=torch.float``)
#: the families whose sparse block's terms are derived here and measured (tests/test_moe_peaks.py)
SPARSE_BLOCK_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def renormalised(moe: MoeSpec, model_type: str) -> bool:
    """Whether the router divides its top-k weights by their sum in place (Mixtral always; the Qwen MoEs when
    ``norm_topk_prob``)."""
    return model_type == "mixtral" or moe.norm_topk_prob


def router_saved(moe: MoeSpec, model_type: str, n_tokens: int) -> int:
    """The router's saved tensors beside its input (module docstring)."""
    n, e, k = n_tokens, moe.n_experts, moe.top_k
    norm = n * FP32 + n * k * FP32 if renormalised(moe, model_type) else 0
    return n * e * FP32 + n * k * INDEX_BYTES + norm


def shared_expert_saved(moe: MoeSpec, model_type: str, n_tokens: int, d_model: int, act_bytes: int) -> int:
    """Qwen2-MoE's shared expert and its sigmoid gate (module docstring); 0 for the families without one."""
    if model_type != "qwen2_moe" or not moe.shared_ffn:
        return 0
    n, a = n_tokens, act_bytes
    return 4 * n * moe.shared_ffn * a + n * a + n * d_model * a


def sparse_mlp_saved(moe: MoeSpec, model_type: str, n_tokens: int, d_model: int, act_bytes: int) -> int:
    """Everything one sparse MLP saves beside its input: router, routed experts, shared expert (DeepSeek-V3's
    router and shared experts: ``deepseek_activations``)."""
    experts = expert_activations(moe, model_type, d_model, n_tokens, act_bytes).saved_bytes
    if model_type == "deepseek_v3":
        return (DS.router_saved(moe, n_tokens, d_model, act_bytes) + experts
                + DS.shared_experts_saved(moe, n_tokens, act_bytes))  # fmt: skip
    return (router_saved(moe, model_type, n_tokens) + experts
            + shared_expert_saved(moe, model_type, n_tokens, d_model, act_bytes))  # fmt: skip


def sparse_block_limits(spec) -> tuple[str, ...]:
    """What in a sparse-block family's ``spec`` (a ``TransformerSpec``) the terms do not derive (empty: the peak
    is modelled); the experts' SiLU is the one measured. Layers of both kinds (Qwen-MoE's ``decoder_sparse_step`` /
    ``mlp_only_layers``, DeepSeek-V3's dense first layers) each get their own block
    (``activation_terms.ModelActivations.layer_blocks``)."""
    out = list(DS.deepseek_limits(spec))
    if spec.hidden_act not in ("silu", "swish"):
        out.append(f"experts with hidden_act {spec.hidden_act!r}")
    if spec.moe is not None and spec.moe.router_logits_loss:
        out.append("the load-balancing loss (output_router_logits true)")
    if spec.moe is not None and spec.moe.router_jitter:
        out.append(f"router jitter (router_jitter_noise {spec.moe.router_jitter:g})")
    return tuple(out)


def weighted_bytes(model_type: str, act_bytes: int) -> int:
    """Bytes of an element of ``proj_out * sample_weights_g`` (``grouped_mm_experts_forward``): type promotion
    of the activation dtype with the routing weights' (Mixtral's fp32 weights make the weighted rows and their
    gradients fp32 in a 16-bit run)."""
    w = ROUTING_WEIGHT_BYTES[model_type] or act_bytes
    return max(act_bytes, w)


def sparse_forward_extra(moe: MoeSpec, model_type: str, n_tokens: int, d_model: int, act_bytes: int,
                         own_input: bool) -> int:  # fmt: skip
    """Bytes alive beyond the block's saved tensors at the sparse block's forward peak: the reordering
    ``weighted_out[inv_perm]`` in ``grouped_mm_experts_forward`` (the weighted rows and their reordered copy,
    2·S·d·wo), with the function's locals (``expert_ids_g`` S·8, ``histc_input`` S·4 fp32,
    ``tokens_per_expert`` E·4), the sparse block's (the router logits it binds to ``_``, N·E·a; the top-k
    weights, N·k·w) and, in a 16-bit run, the block input and the attention residual, which no op saves
    (``own_input``: the fp32 norms save them). After the experts return, the residual sum holds only N·d
    tensors (the dense layer's moment, which the caller keeps as the other candidate)."""
    n, e, k, d, a = n_tokens, moe.n_experts, moe.top_k, d_model, act_bytes
    s, w, wo = n * k, ROUTING_WEIGHT_BYTES[model_type] or a, weighted_bytes(model_type, a)
    inputs = 0 if own_input else 2 * n * d * a
    later = n * a if model_type == "qwen2_moe" else 0  # saved after it: the shared gate's sigmoid output
    return inputs + n * e * a + n * k * w + s * (INDEX_BYTES + FP32) + e * FP32 + 2 * s * d * wo - later


def sparse_backward_ws(moe: MoeSpec, model_type: str, n_tokens: int, d_model: int, act_bytes: int,
                       down_held: bool = True, grads_held: bool = True) -> int:  # fmt: skip
    """The largest moment of the routed experts' backward beyond the block's saved tensors and the incoming
    gradient (``grouped_mm_experts_forward`` read backward; each saved tensor freed once its node has run):

    - the reordering's backward (``IndexBackward0``): the expanded gradient's contiguous copy, zeros and
      ``index_put`` (3·S·d·wo);
    - the routing product's (``MulBackward0``): the reordered gradient, d(rows) and d(rows)·rows (3·S·d·wo),
      d(rows) cast to the activation dtype where the weights promoted it, ``inv_perm`` freed (S·8);
    - the down grouped matmul's (``GroupedMmBackward0``): its weight gradient E·d·f and d(product) S·f, the
      routing product's saved tensors freed;
    - SiLU-times-up's: the down weight gradient, d(product), d(SiLU out) and d(up) (3·S·f), the down
      output and the product freed;
    - the gate-up grouped matmul's: both weight gradients (3·E·d·f), d(gathered rows) and d(gate-up out),
      the gate-up output, SiLU's output and the product freed.

    ``down_held`` False: the down weight gradient has left by SiLU-times-up's backward (DeepSpeed ZeRO-2 copies a
    gradient no larger than its bucket into the bucket at its hook); ``grads_held`` False: see ``shared_expert_ws``.
    """
    e, d, f, a = moe.n_experts, d_model, moe.expert_ffn, act_bytes
    s, wo = n_tokens * moe.top_k, weighted_bytes(model_type, act_bytes)
    cast = s * d * a if wo != a else 0
    down = 0 if down_held else e * d * f * a
    experts = max(3 * s * d * wo,
               3 * s * d * wo + cast - s * INDEX_BYTES,
               e * d * f * a + s * f * a - s * INDEX_BYTES,
               e * d * f * a + 2 * s * f * a - s * INDEX_BYTES - s * d * a - down,
               3 * e * d * f * a - 2 * s * f * a - s * INDEX_BYTES - down)  # fmt: skip
    if not shared_expert_saved(moe, model_type, n_tokens, d, a):
        return experts
    return shared_expert_ws(moe, model_type, n_tokens, d, a, experts, grads_held)


def shared_expert_ws(moe: MoeSpec, model_type: str, n_tokens: int, d_model: int, act_bytes: int,
                     experts_ws: int, grads_held: bool = True) -> int:  # fmt: skip
    """Qwen2-MoE's sparse block backward (``Qwen2MoeSparseMoeBlock.forward`` read backward; autograd runs the
    nodes made last first): the shared gate's product, sigmoid and linear run before the routed experts, so
    the experts' moments also hold d(shared output) (N·d), the input gradient the gate's linear made (N·d)
    and its weight gradient (d), less the sigmoid output and the shared output they saved (N + N·d); the
    shared SwiGLU runs last, beside every weight gradient of the experts (3·E·d·f) and the router's (E·d),
    with the router's and experts' saved tensors freed: its down projection's backward (d(product) N·f_s, its
    weight gradient d·f_s, with d(shared output) N·d) or its product's (2·N·f_s + d·f_s, as a dense MLP's).
    ``grads_held`` False: the experts', the router's and the shared gate's weight gradients have left by then
    (DeepSpeed ZeRO-2 reduces them at the hooks: engines/deepspeed/moe12_hooks.py)."""
    n, e, d, f, fs, a = n_tokens, moe.n_experts, d_model, moe.expert_ffn, moe.shared_ffn, act_bytes
    routed = router_saved(moe, model_type, n) + expert_activations(moe, model_type, d, n, a).saved_bytes
    held = (3 * e * d * f * a + e * d * a + d * a if grads_held else 0) - routed - n * a
    return max(experts_ws + n * d * a + d * a - n * a,
               held + n * fs * a + d * fs * a + n * d * a,  # d(shared output) still in the node's input
               held + 2 * n * fs * a + d * fs * a)  # fmt: skip


def sparse_block(block, spec, n_tokens: int, act_bytes: int, own_input: bool):
    """``block`` (the dense layer's ``activation_terms.BlockActivations``, its ``saved`` already the sparse
    MLP's) with the sparse block's forward and backward moments: the forward peak the larger of the experts'
    reordering and the residual sum's; the backward working set the experts' (``sparse_backward_ws``), whose
    first weight gradient is the down projection's (E·d·f); and its activation-gradient term the later moment
    at the post-attention norm's backward, net of what is released by then, where that is larger."""
    from dataclasses import replace

    if spec.model_type == "deepseek_v3":  # sigmoid router, shared experts after the routed ones
        return deepseek_sparse_block(block, spec, n_tokens, act_bytes, own_input)
    moe, d, a = spec.moe, spec.d_model, act_bytes
    ws = sparse_backward_ws(moe, spec.model_type, n_tokens, d, a)
    # later, at the post-attention RMSNorm's backward (pow's: ``norm_backward_ws``): the MLP's saved tensors and
    # the norm's output and normalised copy released, every MLP weight gradient and the norm's own alive (measured:
    # a top-1 bf16 Qwen3-MoE layer, 33,672 B over ``ws``, tests/test_moe_peaks.py); beside ``saved``, net
    mlp_grads = sum(math.prod(shape) for _, shape in moe_shapes(moe, spec.model_type, d, "")) * a + d * a
    later = block.norm_backward_ws + mlp_grads - (block.saved - block.norm_backward_saved)
    dense = block.ckpt_forward_peak  # the attention's moments (and a dense MLP's, a lower bound of the sparse one's)
    ckpt = max(dense, sparse_nograd_peak(moe, spec.model_type, n_tokens, d, a))
    return replace(block, ckpt_forward_peak=ckpt, forward_extra=max(block.forward_extra,
                                            sparse_forward_extra(moe, spec.model_type, n_tokens, d, a, own_input)),
                   backward_first_op=ws, first_weight_grads=moe.n_experts * d * moe.expert_ffn * a,
                   backward_act_grads=max(0, later - moe.n_experts * d * moe.expert_ffn * a))  # fmt: skip


def sparse_nograd_peak(moe: MoeSpec, model_type: str, n_tokens: int, d_model: int, act_bytes: int) -> int:
    """The sparse MLP's largest moment without grad (a checkpointed block's forward), its input, the block
    input and the attention residual included (3·N·d·a): what ``grouped_mm_experts_forward`` binds to locals
    lives to its return. Beside them the router's outputs (logits N·E·a, weights N·k·w, indices N·k·8), the
    sort's ``expert_ids_g`` and ``perm`` (2·S·8), the gathered rows (S·d·a), the sorted weights (S·w),
    ``histc_input`` (S·4), the counts and offsets (2·E·4), then the largest of: the gate-up output (S·2f·a);
    it with SiLU's output and the product (4·S·f·a); the product and the down output (S·(f + d)·a); the down
    output with the weighted rows, ``inv_perm`` and their reordered copy (S·d·(a + 2·wo) + S·8); the down
    output, the reordered rows, ``inv_perm``, their per-token sum (N·d·wo) and its cast (N·d·a, where wo is
    not a). Qwen2-MoE's shared expert runs first (its SwiGLU: SiLU's output, up's and their product, then
    the product and its output), and its output (N·d·a)
    lives through the routed experts. Each exact against a live-storage trace (tests/test_moe_peaks.py)."""
    n, e, k, d, f, a = n_tokens, moe.n_experts, moe.top_k, d_model, moe.expert_ffn, act_bytes
    s, w, wo = n * k, ROUTING_WEIGHT_BYTES[model_type] or a, weighted_bytes(model_type, a)
    base = 3 * n * d * a
    shared = 0
    if shared_expert_saved(moe, model_type, n, d, a):
        fs = moe.shared_ffn
        shared = base + n * a * max(3 * fs, fs + d)  # SiLU out, up out and their product; then it and down out
        base += n * d * a
    held = (base + n * e * a + n * k * (w + INDEX_BYTES) + s * (2 * INDEX_BYTES + d * a + w + FP32)
            + 2 * e * FP32)  # fmt: skip
    cast = n * d * a if wo != a else 0
    return max(shared, held + max(
        2 * s * f * a, 4 * s * f * a, s * (f + d) * a,
        s * d * (a + 2 * wo) + s * INDEX_BYTES,
        s * d * (a + wo) + s * INDEX_BYTES + n * d * wo + cast))  # fmt: skip


def deepseek_sparse_block(block, spec, n: int, a: int, own_input: bool):
    """``DeepseekV3MoE``'s moments on ``block`` (its ``saved`` already the sparse layer's), from the Mixtral-like
    routed experts' (``moe_block``: the same ``grouped_mm_experts_forward``, fp32 routing weights) with what
    DeepSeek's block changes, each exact against a live-storage trace (tests/test_deepseek.py):

    - the router's logits are fp32 (N·E·4, not N·E·a), bound to ``_`` and alive to the block's end;
    - the shared experts run after the routed ones: at the experts' reordering their saved tensors (4·N·f_s·a) are
      not made yet; at the block's end the routed output, the shared output and their sum (3·N·d·a) are alive with
      the logits and the scaled weights (N·k·4), and in 16-bit the block input and x1;
    - backward: the shared experts first (as a dense MLP: d(product) and the down weight gradient, then the
      activation's gradients), then the routed experts' moments with the shared weight gradients (3·d·f_s·a) and
      their input gradient (N·d·a) alive and their saved tensors freed;
    - no grad: the routed experts' moments (logits fp32), then the shared SwiGLU beside the routed output, the
      logits, weights and indices."""
    from dataclasses import replace

    moe, d, mt = spec.moe, spec.d_model, spec.model_type
    e, k, fs = moe.n_experts, moe.top_k, moe.shared_ffn
    shared = DS.shared_experts_saved(moe, n, a)
    logits = n * e * (FP32 - a)  # moe_block counts the router logits in the activation dtype
    forward = max(sparse_forward_extra(moe, mt, n, d, a, own_input) + logits - shared,
                  (0 if own_input else 2 * n * d * a) + 3 * n * d * a + n * e * FP32 + n * k * FP32)  # fmt: skip
    backward = deepseek_backward_ws(moe, n, d, a, own_input)
    routed_out = 4 * n * d * a + n * e * FP32 + n * k * (FP32 + INDEX_BYTES)
    nograd = max(sparse_nograd_peak(moe, mt, n, d, a) + logits, routed_out + n * a * max(3 * fs, fs + d, 2 * d))
    return replace(block, ckpt_forward_peak=max(block.ckpt_forward_peak, nograd),
                   forward_extra=max(block.forward_extra, forward), backward_first_op=backward,
                   first_weight_grads=e * d * moe.expert_ffn * a, backward_act_grads=0)  # fmt: skip


def deepseek_backward_ws(moe: MoeSpec, n: int, d: int, a: int, own_input: bool, down_held: bool = True,
                         grads_held: bool = True) -> int:  # fmt: skip
    """``deepseek_sparse_block``'s backward working set: the shared experts first, as a dense MLP's, then the routed
    experts' moments (``sparse_backward_ws``) with the shared weight gradients (3·d·f_s·a; ``grads_held`` False: left
    by then, DeepSpeed ZeRO-2 reducing them at the hooks) and, in fp32, their input gradient; in 16-bit the trace
    shows no N·d·a beside the experts' moments (measured on three widths, tests/test_deepseek.py; the mechanism not
    traced)."""
    fs = moe.shared_ffn
    grads = 3 * d * fs * a if grads_held else 0
    after_shared = grads + (n * d * a if own_input else 0) - DS.shared_experts_saved(moe, n, a)
    return max(n * fs * a + d * fs * a, 2 * n * fs * a + d * fs * a,
               sparse_backward_ws(moe, "deepseek_v3", n, d, a, down_held) + after_shared)  # fmt: skip
