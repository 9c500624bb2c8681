"""The newer Hugging Face families, read the way transformers 5.24 reads their ``config.json``.

These readers add themselves to ``hf_config.FAMILIES`` (imported with the package); they use its ``_Reader``
and the Llama-family keys its ``_llama_common`` reads, and add each family's own. Config classes the defaults come from (all in
transformers/models/): ``qwen3/configuration_qwen3.py: Qwen3Config``, ``gemma2/...: Gemma2Config``,
``gemma3/...: Gemma3TextConfig`` and ``Gemma3Config``, ``phi3/...: Phi3Config``, ``mixtral/...:
MixtralConfig``, ``qwen2_moe/...: Qwen2MoeConfig``, ``qwen3_moe/...: Qwen3MoeConfig``,
``deepseek_v3/...: DeepseekV3Config``.

As in ``hf_config``, the generic keys that set shapes (vocabulary, width, depth, heads, a dense MLP's
width where a layer has one) are required, and so are an MoE model's expert count and expert width
(they hold most of its parameters); the family-specific widths take the config class's default when
absent, as transformers does (Qwen3's and Gemma's ``head_dim``, DeepSeek-V3's MLA ranks, top-k).
Exception: ``gemma3``'s ``text_config`` takes every ``Gemma3TextConfig`` default, because Google's
published Gemma 3 configs leave heads and vocabulary to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import zeroplan.architectures.hf_config as hf
from zeroplan.architectures.moe import MlaSpec, MoeSpec

def _record(r, cls, *args, **kwargs):
    """``cls(*args, **kwargs)`` (MoeSpec, MlaSpec), its ValueError naming the file like the reader's own."""
    try:
        return cls(*args, **kwargs)
    except ValueError as exc:
        raise ValueError(f"{r.source}: {exc}") from None


def _qwen3(r) -> dict:
    """Qwen3Config: Qwen2's sliding-window rules, ``head_dim`` 128 by default, ``attention_bias`` on q, k,
    v and o (Qwen3Attention), RMSNorm on q and k (q_norm, k_norm)."""
    bias = r.flag("attention_bias", False)
    return dict(
        hf._qwen2(r), model_type="qwen3", head_dim=r.count("head_dim", 128), qkv_bias=bias, o_bias=bias,
        qk_norm=True,
    )  # fmt: skip


def _layer_types(r, n_layer: int, sliding: Callable[[int], bool]) -> tuple[str, ...] | None:
    """``layer_types`` as given or as the class derives it; None when every layer is full attention."""
    types = r.raw("layer_types")
    if types is hf._MISSING or types is None:
        types = ["sliding_attention" if sliding(i) else "full_attention" for i in range(n_layer)]
    known = {"full_attention", "sliding_attention"}
    if not isinstance(types, list) or set(types) - known or len(types) != n_layer:
        raise r.fail("layer_types", f"{types!r} is not a list of {n_layer} full_attention / sliding_attention")
    return None if "sliding_attention" not in types else tuple(types)


def _gemma(r, model_type: str, positions: int, softcaps: tuple, every: int) -> dict:
    """Gemma2Config / Gemma3TextConfig: 4 key/value heads and head_dim 256 by default, tied embeddings,
    ``hidden_activation`` (gelu_pytorch_tanh), ``attention_bias`` on q, k, v, o, four norms per layer;
    sliding-window layers: all but every ``every``-th (Gemma 2: every 2nd; Gemma 3:
    ``sliding_window_pattern``, 6)."""
    r.require_default("use_bidirectional_attention", False, "zeroplan plans causal language models")
    fields = hf._llama_common(r, kv_default=4, positions=positions, tie=True)
    bias = r.flag("attention_bias", False)
    window = r.count("sliding_window", 4096)
    types = _layer_types(r, fields["n_layer"], lambda i: bool((i + 1) % every))
    return dict(
        fields, model_type=model_type, head_dim=r.count("head_dim", 256), qkv_bias=bias, o_bias=bias,
        hidden_act=r.activation("hidden_activation", "gelu_pytorch_tanh"), sandwich_norms=True,
        sliding_window=window if types else None, layer_types=types,
        attn_logit_softcap=_cap(r, "attn_logit_softcapping", softcaps[0]),
        final_logit_softcap=_cap(r, "final_logit_softcapping", softcaps[1]),
    )  # fmt: skip


def _cap(r, key: str, default: float | None) -> float | None:
    value = r.raw(key)
    if value is None:
        return None
    return r.number(key, default) if value is not hf._MISSING else default


def _gemma2(r) -> dict:
    """Gemma2Config: 8192 positions, soft-capping 50 (attention) and 30 (logits)."""
    return _gemma(r, "gemma2", 8192, (50.0, 30.0), 2)


def _gemma3_text(r) -> dict:
    """Gemma3TextConfig: 131072 positions, q/k norms, no soft-capping, 5 sliding layers in 6; RoPE theta
    1e6 on full-attention layers (``default_theta['global']``)."""
    fields = _gemma(r, "gemma3_text", 131_072, (None, None), r.count("sliding_window_pattern", 6))
    if r.raw("rope_theta") in (hf._MISSING, None) and fields["rope_theta"] == hf.DEFAULT_ROPE_THETA:
        fields["rope_theta"] = 1_000_000.0
    return dict(fields, qk_norm=True)


#: Gemma3TextConfig's defaults for the keys the published Gemma 3 configs leave out of ``text_config``.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8,
}  # fmt: skip


def _gemma3(r) -> dict:
    """Gemma3Config wraps a ``text_config`` (and a vision tower zeroplan does not plan): the text decoder,
    as Gemma3ForCausalLM builds it from ``text_config``."""
    text = r.raw("text_config")
    if not isinstance(text, dict):
        raise r.fail("text_config", f"{'missing' if text is hf._MISSING else repr(text)} (expected an object)")
    inner = hf._Reader({**GEMMA3_TEXT_DEFAULTS, **text}, f"{r.source}: text_config", {})
    return _gemma3_text(inner)


def _phi3(r) -> dict:
    """Phi3Config: fused qkv_proj and gate_up_proj without biases, rms_norm_eps 1e-5, 4096 positions,
    residual and embedding dropout, a sliding window only where the file sets one."""
    return dict(
        hf._llama_common(r, kv_default=None, positions=4096, tie=False), model_type="phi3",
        fused_projections=True, norm_eps=r.number("rms_norm_eps", 1e-5), sliding_window=hf._window(r, None),
        resid_pdrop=r.number("resid_pdrop", 0.0), embd_pdrop=r.number("embd_pdrop", 0.0),
    )  # fmt: skip


def _sparse(r, n_layer: int, step_key: str | None, only_key: str | None, first_dense: int = 0) -> tuple:
    """Sparse layers: Qwen-MoE's ``(i + 1) % decoder_sparse_step == 0`` and not in ``mlp_only_layers``;
    DeepSeek's ``i >= first_k_dense_replace``; Mixtral's every layer."""
    step = r.count(step_key, 1) if step_key else 1
    only = r.raw(only_key) if only_key else None
    only = [] if only in (hf._MISSING, None) else only
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise r.fail(only_key, f"{only!r} is not a list of layer indices")
    return tuple(i for i in range(first_dense, n_layer) if (i + 1) % step == 0 and i not in only)


def _dense_ffn(r, fields: dict, moe: MoeSpec, default: int) -> dict:
    """``intermediate_size`` sets the dense layers' MLP: required when there is one, else the default."""
    dense = len(moe.sparse_layers) < fields["n_layer"]
    width = r.count("intermediate_size") if dense else r.count("intermediate_size", default)
    return dict(fields, ffn_hidden=width)


def _moe(r, experts: str, top_k: int, width: int, sparse: tuple, shared: int = 0, norm: bool = False) -> MoeSpec:
    """The sparse MLP: ``experts`` names the expert count (required); ``num_experts_per_tok`` defaults to
    ``top_k``, ``norm_topk_prob`` to ``norm``; ``output_router_logits`` (false) and Mixtral's
    ``router_jitter_noise`` (0.0) read for the peak's limits."""
    return _record(r, MoeSpec, r.count(experts), r.count("num_experts_per_tok", top_k), width, sparse,
                   shared, r.flag("norm_topk_prob", norm), r.flag("output_router_logits", False), r.number("router_jitter_noise", 0.0))  # fmt: skip


def _mixtral(r) -> dict:
    """MixtralConfig: every layer sparse, experts of ``intermediate_size``, 8 key/value heads, top-2 of
    ``num_local_experts`` (alias ``num_experts``), rms_norm_eps 1e-5, RoPE theta 1e6."""
    fields = hf._llama_common(r, kv_default=8, positions=4096 * 32, tie=False)
    moe = _moe(r, "num_local_experts", 2, fields["ffn_hidden"], tuple(range(fields["n_layer"])))
    if r.raw("rope_theta") in (hf._MISSING, None) and fields["rope_theta"] == hf.DEFAULT_ROPE_THETA:
        fields["rope_theta"] = 1_000_000.0  # MixtralConfig.default_theta
    return dict(fields, model_type="mixtral", moe=moe, norm_eps=r.number("rms_norm_eps", 1e-5),
                sliding_window=hf._window(r, None))  # fmt: skip


def _qwen2_moe(r) -> dict:
    """Qwen2MoeConfig: ``qkv_bias`` (true) on q, k, v; 60 experts, top-4, a shared expert with its sigmoid
    gate; layers sparse by ``decoder_sparse_step`` / ``mlp_only_layers``."""
    r.require_default("use_sliding_window", False, "Qwen2-MoE sliding windows on some layers are not modelled")
    fields = dict(hf._llama_common(r, kv_default=16, positions=32768, tie=False), model_type="qwen2_moe",
                  qkv_bias=r.flag("qkv_bias", True))  # fmt: skip
    sparse = _sparse(r, fields["n_layer"], "decoder_sparse_step", "mlp_only_layers")
    moe = _moe(r, "num_experts", 4, r.count("moe_intermediate_size"), sparse,
               r.count("shared_expert_intermediate_size", 5632))
    return _dense_ffn(r, dict(fields, moe=moe), moe, 5632)


def _qwen3_moe(r) -> dict:
    """Qwen3MoeConfig: Qwen3's attention (q/k norms, ``attention_bias``), 4 key/value heads, 128 experts
    (``num_experts``, alias ``num_local_experts``), top-8, no shared expert; a sliding window on every
    layer only with ``use_sliding_window``."""
    bias = r.flag("attention_bias", False)
    window = hf._window(r, 4096) if r.flag("use_sliding_window", False) else None
    fields = dict(hf._llama_common(r, kv_default=4, positions=32768, tie=False), model_type="qwen3_moe",
                  qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window)  # fmt: skip
    sparse = _sparse(r, fields["n_layer"], "decoder_sparse_step", "mlp_only_layers")
    moe = _moe(r, "num_experts", 8, r.count("moe_intermediate_size"), sparse)
    return _dense_ffn(r, dict(fields, moe=moe), moe, 6144)


def _deepseek_v3(r) -> dict:
    """DeepseekV3Config: multi-head latent attention, ``first_k_dense_replace`` (3) dense layers, then
    ``n_routed_experts`` (alias ``num_local_experts``) routed experts, top-8, and ``n_shared_experts``
    (1) shared ones in one MLP. transformers builds no multi-token-prediction layer
    (``num_nextn_predict_layers``): neither does zeroplan."""
    fields = hf._llama_common(r, kv_default=None, positions=4096, tie=False)
    q_rank = r.raw("q_lora_rank")
    mla = _record(r, MlaSpec, None if q_rank is None else r.count("q_lora_rank", 1536),
                  r.count("kv_lora_rank", 512), r.count("qk_nope_head_dim", 128),
                  r.count("qk_rope_head_dim", 64), r.count("v_head_dim", 128))  # fmt: skip
    n_layer = fields["n_layer"]
    sparse = _sparse(r, n_layer, None, None, r.count("first_k_dense_replace", 3, minimum=0))
    expert_ffn = r.count("moe_intermediate_size")
    moe = _moe(r, "n_routed_experts", 8, expert_ffn, sparse, expert_ffn * r.count("n_shared_experts", 1), True)
    # DeepseekV3TopkRouter: sigmoid scores, groups (n_group 8, topk_group 4); routed_scaling_factor scales the
    # weights in place of a copy (no memory effect), e_score_correction_bias is an fp32 buffer (E,)
    moe = _record(r, replace, moe, n_group=r.count("n_group", 8), topk_group=r.count("topk_group", 4))
    bias = r.flag("attention_bias", False)
    # DeepseekV3Config.__post_init__: head_dim = qk_rope_head_dim (the rotary part of each head)
    return _dense_ffn(r, dict(fields, model_type="deepseek_v3", mla=mla, moe=moe, head_dim=mla.qk_rope_head_dim,
                              qkv_bias=bias, o_bias=bias), moe, 18432)  # fmt: skip


NEW_FAMILIES: dict[str, Callable] = {
    "qwen3": _qwen3, "gemma2": _gemma2, "gemma3_text": _gemma3_text, "gemma3": _gemma3, "phi3": _phi3,
    "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3,
}  # fmt: skip

#: config.json's alternative names for a key, as the config class's ``attribute_map`` accepts them.
NEW_ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_local_experts": "num_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "deepseek_v3": {"n_routed_experts": "num_local_experts"},
}

hf.FAMILIES.update(NEW_FAMILIES)  # registered where spec_from_hf_config looks (the package imports this module)
hf._ALIASES.update(NEW_ALIASES)
