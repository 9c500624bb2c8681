"""DeepSeek-V3's decoder layer as transformers 5.24 trains it on the CPU: multi-head latent attention and the
sigmoid, group-limited router, what autograd saves (bytes, per layer and micro-batch), derived op by op from
``transformers/models/deepseek_v3/modeling_deepseek_v3.py`` (derivatives.yaml per op) and measured storage by
storage with saved-tensor hooks on transformers' own class (tests/test_deepseek.py, fp32 and bf16, exact).

Symbols: N = b·s tokens, h heads, n = qk_nope_head_dim, r = qk_rope_head_dim, qk = n + r, v = v_head_dim,
r_q = q_lora_rank, r_kv = kv_lora_rank, E routed experts, k per token, G = n_group, g = topk_group, f_s the shared
experts' width, ``a`` the activation bytes.

Attention (``DeepseekV3Attention.forward``):
- ``q_a_layernorm`` (where r_q is set) is Llama's RMSNorm over r_q: its fp32 input (q_a_proj's output), rsqrt
  (N·4), the normalised copy and its output, saved by q_b_proj (N·r_q·a each); without r_q, q_proj saves the
  input norm's output, already counted.
- ``kv_a_layernorm`` normalises the r_kv-wide view of ``kv_a_proj_with_mqa``'s output: in fp32 ``.to(float32)``
  returns the view, so pow keeps the whole (r_kv + r)-wide storage; in 16-bit an fp32 copy of the view
  (N·r_kv·4); then rsqrt, the normalised copy and kv_b_proj's input (N·r_kv·a each).
- RoPE (interleaved or not) multiplies by cos and sin, saved once per model (2·s·r·a: ``head_dim`` = r).
- SDPA with qk ≠ v head widths: the CPU flash kernel needs equal widths (``check_head_dim_size_cpp``), so torch
  takes ``_scaled_dot_product_attention_math``, which on the CPU computes in fp32 whatever the input dtype and
  saves the scaled q and the scaled kᵀ (N·h·qk·4 each), the softmax output (b·h·s²·4) and v (N·h·v·4);
  o_proj saves the 16-bit output's contiguous copy (N·h·v·a). CUDA's kernels save less (not measured here).

Router (``DeepseekV3TopkRouter.forward``, fp32 weight ``_keep_in_fp32_modules_strict``): the linear keeps its
fp32 input (in 16-bit a copy, N·d·4; in fp32 the norm output, counted), sigmoid its output (N·E·4), gather its
index (the expert ``topk``'s indices, N·k·8, also the experts' ``top_k_index``). The group scores' ``topk(2)``,
the group ``topk``, ``masked_fill`` and the expert ``topk`` save indices and a bool mask (N·G·2·8, N·g·8, N·E)
for nodes no loss reaches (only their integer indices are used): the nodes, and those tensors, are freed when
the router returns (a saved-tensor hook sees them packed; tests/test_deepseek.py counts what is alive);
``norm_topk_prob`` (DeepSeek's default) divides in place: the fp32 sum and a copy of the weights (N·4 + N·k·4);
``routed_scaling_factor`` is a product with a number (nothing kept). The routed experts are
``moe_activations.expert_activations`` (fp32 weights); the shared experts one SwiGLU MLP on the norm output
(gate's output, SiLU's output, up's output, their product: 4·N·f_s·a), added after the routed experts.
"""

from __future__ import annotations


from zeroplan.architectures.moe import MoeSpec
from zeroplan.formulas.moe_activations import INDEX_BYTES

FP32 = 4  # the router and the CPU math attention compute in fp32
BOOL = 1


def _rms(n: int, width: int, a: int) -> int:
    """transformers' RMSNorm over ``width`` (Llama's): fp32 input, rsqrt, normalised copy and the output kept by
    the next linear."""
    return n * width * FP32 + n * FP32 + 2 * n * width * a


def mla_saved(spec, n: int, b: int, s: int, a: int) -> int:
    """One ``DeepseekV3Attention``'s saved tensors beside the input norm's (module docstring)."""
    m, h = spec.mla, spec.n_head
    q = _rms(n, m.q_lora_rank, a) if m.q_lora_rank is not None else 0
    kv_in = n * (m.kv_lora_rank + m.qk_rope_head_dim) * FP32 if a == FP32 else n * m.kv_lora_rank * FP32
    kv = kv_in + n * FP32 + 2 * n * m.kv_lora_rank * a
    v = n * h * (m.qk_nope_head_dim + m.v_head_dim) * a if _v_view(b, s) and a == FP32 else n * h * m.v_head_dim * FP32
    sdpa = FP32 * (2 * n * h * m.qk_head_dim + b * h * s * s) + v
    return q + kv + sdpa + n * h * m.v_head_dim * a


def _v_view(b: int, s: int) -> bool:
    """Whether math SDPA's ``bmm`` takes v, a (b, h, s, v) view of kv_b_proj's output (or its fp32 copy), as a
    (b·h, s, v) view: only when b or s is 1 do the batch and head strides merge. Then it saves that storage itself
    (fp32: the whole N·h·(n + v) output, 16-bit: the fp32 copy), else a contiguous copy (N·h·v·4)."""
    return b == 1 or s == 1


def router_saved(moe: MoeSpec, n: int, d: int, a: int) -> int:
    """``DeepseekV3TopkRouter``'s saved tensors (module docstring)."""
    e, k = moe.n_experts, moe.top_k
    cast = n * d * FP32 if a != FP32 else 0
    norm = n * FP32 + n * k * FP32 if moe.norm_topk_prob else 0
    return cast + n * e * FP32 + n * k * INDEX_BYTES + norm


def shared_experts_saved(moe: MoeSpec, n: int, a: int) -> int:
    """``DeepseekV3MoE.shared_experts``: a SwiGLU MLP of n_shared_experts · moe_intermediate_size."""
    return 4 * n * moe.shared_ffn * a


def deepseek_limits(spec) -> tuple[str, ...]:
    """What in a DeepSeek-V3 ``spec`` the terms here do not give (empty: modelled): q/k and v heads of one width
    (CPU SDPA then takes its flash kernel, not measured); groups transformers' router cannot form (n_group not
    dividing E, fewer than two experts a group: ``topk(2)``, more than n_group groups or fewer experts in them than
    top_k: -inf picks)."""
    out, m, moe = [], spec.mla, spec.moe
    if m is not None and m.qk_head_dim == m.v_head_dim:
        out.append(f"latent attention with q/k and v heads of one width ({m.v_head_dim}: SDPA's flash kernel)")
    if moe is not None and spec.model_type == "deepseek_v3":
        e, g, tg = moe.n_experts, moe.n_group, moe.topk_group
        if e % g or e // g < 2 or tg > g or moe.top_k > tg * (e // g):
            out.append(f"routing groups n_group={g}, topk_group={tg} for {e} experts, top-{moe.top_k}")
    return tuple(out)


def _mlp_weight_grads(spec, a: int) -> int:
    """Weight gradients the layer's MLP makes before its attention runs backward: gate, up, down; or the routed
    experts' two 3-D tensors, the fp32 router and the shared experts."""
    d, moe = spec.d_model, spec.moe
    if moe is None:
        return 3 * d * spec.ffn * a
    return 3 * moe.n_experts * d * moe.expert_ffn * a + moe.n_experts * d * FP32 + 3 * d * moe.shared_ffn * a


def mla_moments(spec, n: int, b: int, s: int, a: int, saved: int) -> dict[str, int]:
    """The latent attention's moments as ``activation_terms.BlockActivations`` fields (``saved``: the block's),
    derived op by op from ``DeepseekV3Attention.forward`` and torch's CPU math SDPA and exact against a live-storage
    trace of transformers' layer (tests/test_deepseek.py). Math SDPA (fp32 throughout; in 16-bit q, k, v are first
    copied to fp32) scales q, scales kᵀ, builds the causal mask as an fp32 (s, s) tensor, multiplies to the scores
    (b·h·s²·4) and adds the mask into a second score-sized tensor: the layer's largest moment, with the attention's
    locals alive (q_b_proj's output, the query and key it assembles, kv_b_proj's output, the rotated q and k parts;
    in 16-bit the compressed kv too, which fp32 saves).

    - ``forward_extra``: that moment beside everything the layer saves except what it does not hold yet (the
      softmax output, v's contiguous copy, o_proj's input and the post-attention half), plus the 16-bit block input;
    - ``ckpt_forward_peak`` (no grad): block input, norm output, the locals, the normalised kv, the fp32 copies,
      the scaled q, the mask and the two score tensors (the scaled kᵀ is freed after the product);
    - backward: softmax's backward holds d(probabilities) and d(scores) (2·b·h·s²·4) with the MLP's, the
      post-attention norm's and o_proj's weight gradients and d(x1) (N·d·a), the post-attention half's saved
      tensors and o_proj's input freed."""
    m, h, d = spec.mla, spec.n_head, spec.d_model
    qk, v, r, r_kv = m.qk_head_dim, m.v_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    scores, mask, sixteen = b * h * s * s * FP32, s * s * FP32, a != FP32
    rms_in = n * d * FP32 + n * FP32 + 2 * n * d * a
    after = saved - rms_in - mla_saved(spec, n, b, s, a)  # post-attention norm and MLP
    locals_ = n * a * (3 * h * qk + h * r + r + h * (m.qk_nope_head_dim + v))
    compressed = n * (r_kv + r) * a
    upcast = FP32 * n * h * (2 * qk + v) if sixteen else 0
    v_copy, out32, out = n * h * v * FP32, n * h * v * FP32, n * h * v * a  # v's contiguous fp32 copy, SDPA's output
    if _v_view(b, s):  # no copy: the saved v is kv_b_proj's output (fp32) or its fp32 copy, made before the scores
        v_copy = 0
        locals_grad, upcast_grad = (locals_ - n * h * (m.qk_nope_head_dim + v) * a, upcast) if not sixteen else \
            (locals_, upcast - n * h * v * FP32)
    else:
        locals_grad, upcast_grad = locals_, upcast
    probs_a = b * h * s * s * a if sixteen else 0  # 16-bit: the probabilities' copy SDPA returns (as attn_weights)
    out_a = out if sixteen else 0
    # grad: what the layer holds beside the saved tensors made so far (all but the post-attention half's, and
    # before the softmax neither the probabilities, v's copy nor o_proj's input)
    base = (n * d * a if sixteen else 0) - after - scores - v_copy - out  # 16-bit: the block input (no op saves it)
    pre = locals_grad + (compressed if sixteen else 0) + upcast_grad + mask
    forward = max(base + pre + 2 * scores,  # the mask added: the scores and the masked scores
                  base + scores + v_copy + pre + probs_a + out32 + out_a,  # SDPA's output (and its 16-bit copy)
                  base + scores + v_copy + out + pre - mask - upcast_grad + out)  # o_proj's input copied from it
    held = 2 * n * d * a + locals_ + compressed + n * r_kv * a + upcast + n * h * qk * FP32 + mask
    nograd = held + max(n * h * qk * FP32 + scores, 2 * scores, scores + probs_a + v_copy + out32)
    bias = d * a if spec.o_bias else 0
    weights = _mlp_weight_grads(spec, a) + d * a + d * h * v * a + bias
    backward = 2 * scores + n * d * a + weights - after - n * h * v * a
    if _v_view(b, s) and not sixteen:  # the product's node frees kv_b_proj's output, not a copy as wide as dv
        backward -= n * h * m.qk_nope_head_dim * a
    return {"forward_extra": forward, "ckpt_forward_peak": nograd, "backward": backward}


def mla_block(block, spec, n: int, b: int, s: int, a: int):
    """``block`` (a latent-attention layer's ``BlockActivations``, its ``saved`` already the layer's) with the
    attention's moments where they are the larger (``mla_moments``)."""
    from dataclasses import replace

    m = mla_moments(spec, n, b, s, a, block.saved)
    return replace(block, forward_extra=max(block.forward_extra, m["forward_extra"]),
                   ckpt_forward_peak=max(block.ckpt_forward_peak, m["ckpt_forward_peak"]),
                   backward_first_op=max(block.backward_first_op, m["backward"]),
                   backward_first_op_recomputed=max(block.backward_first_op_recomputed, m["backward"]))  # fmt: skip


def router_bias_bytes(spec) -> int:
    """DeepSeek-V3's router buffer ``e_score_correction_bias``, fp32, one per routed expert, in every sparse layer
    (``modeling_deepseek_v3.py:DeepseekV3TopkRouter.__init__``: ``nn.Buffer(torch.zeros(num_experts, dtype=float32))``);
    not sharded (FSDP2, DeepSpeed: a buffer), alive from the build on and fp32 whatever the run's dtype. Without it
    every phase of the recorded FSDP2 DeepSeek rows (tests/test_deepseek.py) read 32 B under (2 sparse layers x 4
    experts x 4 B; MemTracker's Buffer: 64 B with the rotary tables' 32), and DeepSpeed's bf16 rows too
    (tests/test_deepspeed_moe.py ``BF16``). 0 for other families."""
    moe = getattr(spec, "moe", None)
    if spec.model_type != "deepseek_v3" or moe is None:
        return 0
    return len(moe.sparse_layers) * moe.n_experts * 4


def router_weight_copy_bytes(spec, param_bytes: int) -> int:
    """Per sparse layer, the fp32 copy of DeepSeek-V3's router weight that ``F.linear`` saves when the engine runs
    the layer with 16-bit parameters: transformers keeps the router in fp32 (``_keep_in_fp32_modules_strict``, so
    ``self.weight.type(torch.float32)`` returns the weight itself), but FSDP2's ``MixedPrecisionPolicy`` casts every
    unsharded parameter and DeepSpeed casts the whole model to bf16/fp16, the router's too, so
    ``DeepseekV3TopkRouter.forward`` makes E·d·4 B and the linear saves it to its backward. Traced (live storages at
    the forward peak, gloo N_d = 2, bf16: a (4, 128) fp32 tensor from ``modeling_deepseek_v3.py:forward`` line 135 per
    sparse layer): the 4,096 B the DeepSeek bf16 rows read under, FSDP2 (tests/test_deepseek.py) and DeepSpeed
    ZeRO-1/2/3 (tests/test_deepspeed_moe.py, test_deepspeed_moe12.py ``BF16``). 0 in fp32 or for other families."""
    moe = getattr(spec, "moe", None)
    if spec.model_type != "deepseek_v3" or moe is None or param_bytes == 4:
        return 0
    return moe.n_experts * spec.d_model * 4
