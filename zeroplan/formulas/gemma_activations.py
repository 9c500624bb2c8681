"""Activation bytes of Gemma 2 and Gemma 3 text decoders, as transformers 5.24 trains them (dropout 0).

Derived op by op from ``transformers/models/gemma2/modeling_gemma2.py`` and ``models/gemma3/modeling_gemma3.py``
(what each op's autograd formula keeps, ``tools/autograd/derivatives.yaml``), and checked storage by storage
with saved-tensor hooks on transformers' own classes (tests/test_families.py, fp32 and bf16). Symbols as in
``activation_terms``: N = b·s tokens, d, q = heads·head_dim, kv, f, h heads, V vocabulary, ``a`` activation bytes.

- ``Gemma2RMSNorm`` / ``Gemma3RMSNorm.forward``: ``_norm(x.float()) * (1.0 + weight.float())``, then
  ``type_as(x)``: pow and the product keep the fp32 input (N·d·4; in fp32 the input itself), the product keeps
  the fp32 rsqrt (N·4), the weight product keeps the fp32 normalised tensor (N·d·4, not Llama's 16-bit copy)
  and the fp32 (1 + weight) (d·4, not a parameter). Four per decoder layer (``input_``, ``post_attention_``,
  ``pre_feedforward_``, ``post_feedforward_layernorm``), one final; only the outputs of the input and
  pre-feedforward norms are kept (by q/k/v and gate/up: N·d·a each), the two "post" norms feed residual adds.
- Gemma 3's ``q_norm`` / ``k_norm`` (``Gemma3Attention.forward``) are the same norm over head_dim: per projection
  of width w and h_p heads N·w·4 (input) + N·w·4 (normalised) + N·h_p·4 (rsqrt) + head_dim·4.
- Gemma 2 attention is eager (``Gemma2PreTrainedModel._supports_sdpa = False``; ``eager_attention_forward``):
  ``repeat_kv`` copies k and v to the query heads, ``matmul(q, kᵀ)`` keeps q and the repeated k (N·q·a each),
  the soft-cap ``tanh(scores / cap) * cap`` keeps tanh's result (b·h·s²·a), the mask is added (nothing kept),
  ``softmax(dtype=float32)`` keeps its fp32 result (b·h·s²·4) and ``.to(query.dtype)`` makes the 16-bit
  probabilities that ``matmul(p, v)`` keeps with the repeated v (b·h·s²·a, none in fp32 where ``.to`` returns
  the softmax result itself); o_proj keeps its input (N·q·a). No logsumexp. The masks (full and sliding,
  (b, 1, s, s) in the activation dtype) are made once by ``Gemma2Model.forward`` and kept by nothing.
- Gemma 3 attention is SDPA as Llama's (``activation_terms._llama_attention_saved``) as long as no sliding
  layer gets a mask: ``masking_utils._ignore_causal_mask_sdpa`` skips the sliding mask while
  s < ``sliding_window`` (``kv_length >= local_attention_size`` makes one). From s = window on
  (``sliding_masked``) the sliding layers keep the (b, 1, s, s) mask in the activation dtype and k, v repeated
  to the query heads (``sdpa_attention_forward``: no ``enable_gqa`` with a mask), as Mistral's, and the full
  ones (``create_causal_mask``: none, ``is_causal``) do not: each layer its own block
  (``ModelActivations.layer_blocks``). With one kv head ``repeat_kv`` is a view (``llama_nograd.kv_copied``).
- The embedding is ``Gemma2TextScaledWordEmbedding``: ``embedding(ids) * embed_scale.to(weight.dtype)``, whose
  product keeps the 0-dim scale (``a`` bytes). RoPE's cos and sin are kept once per rotary table: Gemma 2 has
  one, Gemma 3 one per layer type present (``Gemma3RotaryEmbedding``: local and global bases).
- ``Gemma2ForCausalLM.forward``'s final soft-cap ``tanh(logits / cap) * cap`` keeps tanh's result (N·V·a),
  beside the capped logits the loss upcasts.
The MLP is Llama's (gate, up, ``gelu_pytorch_tanh`` keeps its input: ``ACT_KEPT``).
"""

from __future__ import annotations

from zeroplan.architectures.spec import TransformerSpec
from zeroplan.formulas.llama_nograd import sdpa_masked

GEMMA_FAMILIES: tuple[str, ...] = ("gemma2", "gemma3_text")


def _norm(rows: int, width: int) -> int:
    """One Gemma RMSNorm over vectors of ``width`` (``rows`` of them): fp32 input, fp32 normalised, fp32 rsqrt per
    row, fp32 (1 + weight)."""
    return 2 * rows * width * 4 + rows * 4 + width * 4


def eager_attention(spec: TransformerSpec, n: int, b: int, s: int, a: int) -> int:
    """Gemma 2's ``eager_attention_forward`` (module docstring): q, the repeated k and v, o_proj's input, tanh's
    result where the scores are soft-capped, the fp32 softmax and, in 16-bit, its 16-bit copy."""
    q, h = spec.q_dim, spec.n_head
    k_v = q if spec.n_kv_head < h else spec.kv_dim
    scores = b * h * s * s
    capped = scores * a if spec.attn_logit_softcap is not None else 0
    return n * a * (2 * q + 2 * k_v) + capped + scores * 4 + (scores * a if a < 4 else 0)


def qk_norms(spec: TransformerSpec, n: int) -> int:
    """Gemma 3's ``q_norm`` and ``k_norm``: one Gemma RMSNorm per head over head_dim, on q and on k."""
    if not spec.qk_norm:
        return 0
    return sum(_norm(n * heads, spec.head_dim) for heads in (spec.n_head, spec.n_kv_head))


def norms_saved(spec: TransformerSpec, n: int, a: int) -> int:
    """The four norms of a decoder layer and the two outputs kept (by q/k/v and by gate/up)."""
    return 4 * _norm(n, spec.d_model) + 2 * n * spec.d_model * a


def embed_saved(spec: TransformerSpec, s: int, a: int) -> int:
    """The 0-dim embedding scale and RoPE's cos and sin, (1, s, head_dim), per rotary table in use."""
    tables = len(set(spec.layer_types)) if spec.model_type == "gemma3_text" and spec.layer_types else 1
    return a + tables * 2 * s * spec.head_dim * a


def final_saved(spec: TransformerSpec, n: int, a: int) -> int:
    """The final norm, its output (kept by the head) and the final soft-cap's tanh (N·V·a)."""
    capped = n * spec.vocab_size * a if spec.final_logit_softcap is not None else 0
    return _norm(n, spec.d_model) + n * spec.d_model * a + capped


def eager_masks(spec: TransformerSpec, b: int, s: int, a: int) -> int:  # 0 for any other family
    """Gemma 2's two additive masks (full and sliding, (b, 1, s, s) in the activation dtype, seen on the layers'
    inputs), made by ``Gemma2Model.forward`` and alive through its forward (and held by checkpoints under full
    checkpointing), kept by no autograd node; Gemma 3 below its window gets none (SDPA's ``is_causal``)."""
    return 2 * b * s * s * a if spec.model_type == "gemma2" else 0


def sliding_masked(spec: TransformerSpec, s: int) -> bool:
    """Whether Gemma 3's sliding layers get a mask (``masking_utils._ignore_causal_mask_sdpa``: from
    ``kv_length >= sliding_window`` on), so that they save what its full layers do not (module docstring)."""
    return spec.model_type == "gemma3_text" and bool(spec.layer_types) and sdpa_masked(spec, s)


def _nograd_peak(spec: TransformerSpec, n: int, s: int, a: int, llama_nograd: int, act_nograd: dict[str, int]) -> int:
    """Bytes a Gemma decoder layer holds beside its input at its peak without grad (checkpointed forward), derived
    from the same Python and compared with MemTracker (tests/test_families.py: it misses at most one (b, s,
    head_dim) tensor, as Llama's layer, plus, for Gemma 2 in fp32 with the attention as the peak, 2 bytes per score
    not accounted for): a Gemma norm holds two fp32 N·d tensors (the normalised tensor and its (1 + weight)
    product) beside its input and the residual; Gemma 2's eager attention as commented below; Gemma 3's q/k norms
    hold two fp32 copies of the projection beside it; the MLP is Llama's. ``llama_nograd``: Llama's layer of the same
    widths without q/k norms (``llama_nograd.llama_nograd_peak``); ``act_nograd``: ``ACT_NOGRAD_PEAK``."""

    d, f, q, kv, h = spec.d_model, spec.ffn, spec.q_dim, spec.kv_dim, spec.n_head
    norm = 8 * n * d + 4 * n
    if spec.model_type == "gemma2":
        # beside the norm output and the rotated q, k and v: ``repeat_kv`` copies k and v (with one kv head its
        # reshape is a view), then either the first matmul (its copies of q and k, the scores) or the softmax (the
        # masked scores, CPU ``softmax(dtype=float32)``'s fp32 conversion of a 16-bit input and its fp32 result: 10
        # bytes per score in bf16, 8 in fp32); the probabilities (``attn_weights``, returned and bound to ``_`` by
        # the layer) stay alive to the layer's end, beside the norms and the MLP
        held = n * a * (d + q + 2 * kv) + (2 * n * q * a if 1 < spec.n_kv_head < h else 0)
        scores = h * s * s * (n // s)
        attn = held + max(2 * n * q * a + scores * a, scores * (a + 8 if a < 4 else 8))
        mlp = n * a * (2 * d + max(act_nograd[spec.hidden_act] * f, 3 * f, f + d))
        return max(2 * n * a * d + norm, attn, mlp) + (0 if attn >= mlp else scores * a)
    qk = max(n * a * (d + q) + 8 * n * q + 8 * n * h, n * a * (d + q + kv) + 8 * n * kv + 8 * n * spec.n_kv_head)
    return max(llama_nograd, 2 * n * a * d + norm, qk)


def gemma_block(spec: TransformerSpec, n: int, b: int, s: int, a: int, llama_attention: int, act_kept: dict[str, int],
                llama_nograd: int, act_nograd: dict[str, int]) -> dict[str, int]:
    """A Gemma 2 / Gemma 3 decoder layer (``Gemma2DecoderLayer`` / ``Gemma3DecoderLayer``) as the fields of
    ``activation_terms.BlockActivations``: the saved set of the module docstring, measured exactly; the working
    sets beside it, derived as for Llama (``_llama_block``) with what Gemma's norms change: in 16-bit the
    post-feedforward norm's fp32 product (N·d·4) is alive with its 16-bit output, the block input, x1 and the MLP
    output at the block's end. ``llama_attention``: Llama's attention of the same widths (Gemma 3's, below the
    window); ``act_kept``: ``ACT_KEPT``; ``llama_nograd``, ``act_nograd``: as ``_nograd_peak``'s."""

    d, f = spec.d_model, spec.ffn
    own_input = a == 4  # fp32: the input and post-feedforward norms keep the block input and x1 themselves
    attn = eager_attention(spec, n, b, s, a) if spec.model_type == "gemma2" else llama_attention
    mlp = (act_kept[spec.hidden_act] + 3) * n * f * a
    saved = norms_saved(spec, n, a) + attn + qk_norms(spec, n) + mlp
    return dict(
        saved=saved,
        mlp_saved=mlp,
        forward_extra=2 * n * d * a if own_input else 4 * n * d * a + n * d * 4,
        forward_before_output=(0 if own_input else 2) * n * d * a,
        ckpt_forward_peak=n * d * a + _nograd_peak(spec, n, s, a, llama_nograd, act_nograd),
        ckpt_saved=n * d * a,
        recomputed=saved - (n * d * a if own_input else 0),
        pending_at_last_grad=2 * n * d * 4 + n * 4 + d * 4,
        held_input_pending=n * d * a,
        norm_backward_saved=saved - mlp - 2 * _norm(n, d) - n * d * a - n * d * 4,
        norm_backward_ws=4 * n * d * 4 + 2 * n * d * a - n * 4,
        # down_proj backward: d(product), dW, as Llama's; the post-feedforward norm has run backward before it,
        # its saved set released and its weight gradient made (measured: t-gemma2-scores, FSDP2, fp32: with the
        # Llama terms, which keep that norm's saved set, both ranks' backward peak predicted 1.06% too high)
        backward_first_op=n * f * a + (d * f + d * spec.mlp_bias) * a + d * a - _norm(n, d),
        backward_first_op_recomputed=n * f * a + d * f * a + d * a - _norm(n, d),
        first_weight_grads=d * f * a,
        backward_act_grads=2 * n * f * a + d * a - _norm(n, d),
    )
