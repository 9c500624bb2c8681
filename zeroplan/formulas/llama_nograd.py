"""A llama-layout decoder layer's peak without grad (a checkpointed block's forward), and when transformers
gives SDPA a mask: split from ``activation_terms.py`` (which reads both), derived op by op as documented there."""

from __future__ import annotations

from zeroplan.architectures.spec import TransformerSpec

#: N·f tensors alive at once while the activation runs without grad (its input included): a fused op
#: holds its input and output; gelu_new's ``0.5 * x * (1.0 + tanh(...))`` holds x, 0.5·x, 1 + tanh and
#: the product at its last op (each intermediate is freed as soon as the next op has consumed it).
ACT_NOGRAD_PEAK: dict[str, int] = {"gelu": 2, "gelu_pytorch_tanh": 2, "silu": 2, "swish": 2, "relu": 2, "gelu_new": 4}


def sdpa_masked(spec: TransformerSpec, s: int) -> bool:
    """Whether transformers gives SDPA a mask: a sliding window no longer than the sequence (masking_utils.py
    ``_ignore_causal_mask_sdpa`` skips it only while kv_length < the window; measured: Mistral, window 24, at
    s = 24 the mask and the repeated k, v are saved)."""
    return spec.sliding_window is not None and s >= spec.sliding_window


def kv_copied(spec: TransformerSpec, s: int) -> bool:
    """Whether k and v are copied to the query heads before SDPA (the one rule; every family's SDPA terms read it).
    transformers' ``sdpa_attention_forward`` passes ``enable_gqa`` unless SDPA gets a mask (``sdpa_masked``) or
    head_dim > 256 (``use_gqa_in_sdpa``); then ``repeat_kv`` (modeling_llama.py) runs ``expand`` and ``reshape`` of
    (b, kv, n_rep, s, hd): with one kv head the reshape merges two stride-0 dims, a view of k, v (no copy: they stay
    kv wide); with 2 or more it copies them, N·q wide each. Measured: MistralForCausalLM, window 24, two kv heads
    copy (tests/test_activations.py); one kv head, Mistral (FSDP2 and DeepSpeed rows) and Gemma 3
    (tests/test_families.py), a view: counting copies there was 2·N·(q - kv)·a over per masked layer."""
    return 1 < spec.n_kv_head < spec.n_head and (sdpa_masked(spec, s) or spec.head_dim > 256)


def llama_nograd_peak(spec: TransformerSpec, n: int, s: int, a: int) -> int:
    """Bytes a LlamaDecoderLayer holds beside its input at its peak without grad (checkpointed forward): the
    largest of ``llama_nograd_moments``."""
    return max(llama_nograd_moments(spec, n, s, a).values())


def llama_nograd_moments(spec: TransformerSpec, n: int, s: int, a: int) -> dict[str, int]:
    """Bytes a LlamaDecoderLayer holds beside its input at each moment without grad (checkpointed forward),
    by moment (sequence parallelism re-counts them by where each tensor lives: ``engines/fsdp2/tp.py``).

    Op by op in validate/transformer.py (transformers' order): RMSNorm holds its fp32 copy, the squares or
    the product and the fp32 rsqrt (8·N·d + 4·N); the attention holds the norm output (its argument),
    q, k, v and RoPE's three temporaries of the projection being rotated (t·cos, rotate_half, ·sin),
    then SDPA's output (and the copied k, v (``kv_copied``) and the 16-bit mask where used) beside the rotated q, k and
    v, then o_proj's output; the residual sum holds x1, the attention output and the sum; the MLP holds
    x1 and the norm output with the activation's peak or its output, up's and their product, then the
    product and down's output.
    """
    d, f, q, kv = spec.d_model, spec.ffn, spec.q_dim, spec.kv_dim
    masked, repeated = sdpa_masked(spec, s), kv_copied(spec, s)
    lse = n * spec.n_head * 4
    norm = (8 if a < 4 else 4) * n * d + 4 * n  # fp32 copy (fp32: the input itself) and squares (or product), rsqrt
    rope_q = n * a * (d + 4 * q + 2 * kv)  # norm out, q, k, v, q·cos, rotate_half(q), ·sin
    rope_k = n * a * (d + 2 * q + 5 * kv)  # norm out, q, k, v, rotated q, k·cos, rotate_half(k), ·sin
    sdpa = n * a * (d + 2 * q + 2 * kv + (2 * q if repeated else 0)) + lse + (n * s * a if masked else 0)  # b·s²·a = N·s·a
    o_proj = n * a * (2 * d + 2 * q + 2 * kv)  # norm out, rotated q, k, v, SDPA out, o_proj out
    act = ACT_NOGRAD_PEAK[spec.hidden_act] * f
    if spec.fused_projections:  # Phi3MLP: the gate_up output (2f) lives to the end (``gate`` is a view of it):
        # the activation beside it, then it, act out and the product, then it, the product and down's output
        mlp = n * a * (2 * d + max(2 * f + act - f, 4 * f, 3 * f + d))
    else:
        mlp = n * a * (2 * d + max(act, 3 * f, f + d))
    qk = 0
    if spec.qk_norm:  # Qwen3's q_norm then k_norm: the norm's working set beside its input (the projection's
        # output), with the norm output held as the attention's argument, and the normed q during k's norm
        fp32 = 8 if a < 4 else 4  # the fp32 copy and the squares or the product (fp32: the input itself)
        # (+ the fp32 mean and its rsqrt per head, both alive at the product)
        qk = max(n * a * (d + q) + fp32 * n * q + 8 * n * spec.n_head,
                 n * a * (d + q + kv) + fp32 * n * kv + 8 * n * spec.n_kv_head)
    fused = 0
    if spec.fused_projections:  # Phi3Attention's ``qkv`` local (q + 2kv) lives to its end; at sdpa_attention_forward's
        # ``transpose(1, 2).contiguous()`` copy: norm out, qkv, rotated q and k, SDPA out and its copy
        fused = n * a * (d + 4 * q + 3 * kv + (2 * q if repeated else 0)) + (n * s * a if masked else 0)
    return {"norm": norm, "rope_q": rope_q, "rope_k": rope_k, "sdpa": sdpa, "o_proj": o_proj, "residual": n * a * 3 * d,
            "post_norm": n * a * d + norm, "mlp": mlp, "qk_norm": qk, "fused": fused}  # fmt: skip
