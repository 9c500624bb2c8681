"""Parameter shapes of model families, so Ψ and per-tensor padding come from an architecture.

Pure: returns ``(name, shape)`` pairs with the names, shapes and order of ``named_parameters()`` of the
Hugging Face ``transformers`` model of the same config (``GPT2LMHeadModel``, ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, transformers 5.24), which ``validate/transformer.py`` builds
in plain torch. A tied LM head is the token embedding itself, so it is counted once (``named_parameters``
drops the duplicate, as here).

Two layouts (``style``):
- ``"gpt"`` (model_type ``gpt2``): learned position embeddings, LayerNorm with bias, biased ``Conv1D``
  projections whose weights are stored (in, out), fused q/k/v, 4x MLP by default, LM head tied by default.
- ``"llama"`` (model_type ``llama``, ``mistral``, ``qwen2``): rotary positions (no parameters), RMSNorm
  (weight only), separate q/k/v/o projections with ``n_kv_head`` key/value heads of ``head_dim``,
  SwiGLU MLP (gate, up, down); biases where the config asks for them (Qwen2: q, k, v); LM head untied
  by default. The newer families keep this layout (``model.layers.{i}.``, ``model.norm``) and add to it:
  q/k norms (``qk_norm``: Qwen3, Gemma 3), Gemma's four norms per layer (``sandwich_norms``), Phi-3's
  fused ``qkv_proj`` and ``gate_up_proj`` (``fused_projections``), sparse MLPs (``moe``: Mixtral,
  Qwen-MoE, DeepSeek-V3) and multi-head latent attention (``mla``: DeepSeek-V3); ``architectures.moe``
  has those two.
"""

import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Optional

from zeroplan.architectures.moe import MlaSpec, MoeSpec, linear, mla_shapes, moe_shapes

Shape = tuple[int, ...]

#: HF ``model_type`` -> layout. One home for the families zeroplan knows.
FAMILY_STYLE: dict[str, str] = {
    "gpt2": "gpt", "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gemma2": "llama",
    "gemma3_text": "llama", "phi3": "llama", "mixtral": "llama", "qwen2_moe": "llama", "qwen3_moe": "llama",
    "deepseek_v3": "llama",
}  # fmt: skip

#: Activation functions the reference runtime implements, as transformers' ``ACT2FN`` names them
#: (transformers/activations.py): GPT-2's default ``gelu_new`` and the Llama family's ``silu``.
ACTIVATIONS: tuple[str, ...] = ("gelu_new", "gelu", "gelu_pytorch_tanh", "relu", "silu", "swish")


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer. Dimensions are elements.

    Defaults (None) resolve on construction to the family's: ``ffn_hidden`` 4·d_model,
    ``n_kv_head`` n_head, ``head_dim`` d_model / n_head, ``model_type`` gpt2 or llama by ``style``,
    ``tie_word_embeddings`` True for gpt2 and False otherwise, ``hidden_act`` gelu_new for gpt2 and silu
    otherwise (GPT2Config / LlamaConfig in transformers 5.24). Dropout probabilities are 0 unless given;
    a config file's values come through ``zeroplan.architectures.hf_config``.
    """

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    max_seq_len: int = 1024
    """positions: GPT-2's ``n_positions`` (rows of the position embedding), else max_position_embeddings."""
    ffn_hidden: int | None = None
    n_kv_head: int | None = None
    style: str = "gpt"  # "gpt" | "llama"
    model_type: str | None = None
    """the Hugging Face family: gpt2 | llama | mistral | qwen2."""
    head_dim: int | None = None
    tie_word_embeddings: bool | None = None
    qkv_bias: bool = False
    """llama layout: biases on q, k, v (Qwen2: always; Llama: ``attention_bias``). GPT-2 is always biased."""
    o_bias: bool = False
    """llama layout: bias on the output projection (Llama's ``attention_bias``)."""
    mlp_bias: bool = False
    """llama layout: biases on gate, up, down (Llama's ``mlp_bias``)."""
    hidden_act: str | None = None
    norm_eps: float = 1e-5
    """LayerNorm (gpt) or RMSNorm (llama) epsilon."""
    rope_theta: float = 10000.0
    """llama layout: RoPE base wavelength."""
    rope_type: str = "default"
    """llama layout: transformers' rope_type (default, llama3, ...); the validator builds ``default``."""
    sliding_window: int | None = None
    """llama layout: tokens each query sees (itself and the window-1 before it); None: all before it."""
    embd_pdrop: float = 0.0
    """dropout after the embeddings (GPT-2 ``embd_pdrop``)."""
    attn_pdrop: float = 0.0
    """dropout on attention probabilities (GPT-2 ``attn_pdrop``, Llama family ``attention_dropout``)."""
    resid_pdrop: float = 0.0
    """dropout after the attention and MLP output projections (GPT-2 ``resid_pdrop``, Phi-3's)."""
    qk_norm: bool = False
    """llama layout: RMSNorm over head_dim on queries and keys (``q_norm``, ``k_norm``: Qwen3, Gemma 3)."""
    sandwich_norms: bool = False
    """llama layout: Gemma 2/3's ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` too."""
    fused_projections: bool = False
    """llama layout: Phi-3's ``qkv_proj`` (q, k, v in one) and ``gate_up_proj`` (gate, up in one)."""
    attn_logit_softcap: Optional[float] = None
    """Gemma 2: attention scores through cap·tanh(score / cap) (no parameters)."""
    final_logit_softcap: Optional[float] = None
    """Gemma 2: logits through cap·tanh(logit / cap) (no parameters)."""
    layer_types: Optional[tuple[str, ...]] = None
    """per layer ``full_attention`` / ``sliding_attention`` where they differ (Gemma); None: every layer
    as ``sliding_window`` says."""
    moe: Optional[MoeSpec] = None
    """the sparse MLP and the layers that hold it (``architectures.moe``); None: dense."""
    mla: Optional[MlaSpec] = None
    """multi-head latent attention's widths (DeepSeek-V3); None: q/k/v/o projections."""

    @property
    def biased_linear(self) -> bool:
        """Whether a projection has a bias (GPT-2: all of them; llama layout: as the config asks)."""
        return self.style == "gpt" or self.qkv_bias or self.o_bias or self.mlp_bias

    def __post_init__(self) -> None:
        from zeroplan.architectures.limits import check_dimensions

        # before any shape is built: bounded work (docs/limits.md); rope_theta is a wavelength, not a size
        check_dimensions({k: v for k, v in vars(self).items() if k != "rope_theta"})
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.style not in ("gpt", "llama"):
            raise ValueError(f"style={self.style!r}: expected 'gpt' or 'llama'")
        gpt = self.style == "gpt"
        resolved = {
            "model_type": "gpt2" if gpt else "llama",
            "tie_word_embeddings": gpt,
            "hidden_act": "gelu_new" if gpt else "silu",
            "n_kv_head": self.n_head,
            "head_dim": self.d_model // self.n_head,
        }
        for name, default in resolved.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if FAMILY_STYLE.get(self.model_type) != self.style:
            raise ValueError(f"model_type={self.model_type!r} does not have the {self.style!r} layout")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r}: expected one of {', '.join(ACTIVATIONS)}")
        for name in ("ffn_hidden", "n_kv_head", "head_dim", "sliding_window"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        for name in ("embd_pdrop", "attn_pdrop", "resid_pdrop"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be in [0, 1)")
        if not (self.norm_eps > 0 and self.rope_theta > 0):
            raise ValueError(f"norm_eps={self.norm_eps}, rope_theta={self.rope_theta}: must be > 0")
        if self.d_model % self.n_head:  # transformers' GPT2Attention and LlamaConfig refuse it too
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if gpt and any((self.qk_norm, self.sandwich_norms, self.fused_projections, self.moe, self.mla)):
            raise ValueError("qk_norm, sandwich_norms, fused_projections, moe and mla need the 'llama' layout")
        if self.moe is not None and max(self.moe.sparse_layers, default=-1) >= self.n_layer:
            raise ValueError(f"moe.sparse_layers={self.moe.sparse_layers}: the model has {self.n_layer} layers")
        if self.layer_types is not None and len(self.layer_types) != self.n_layer:
            raise ValueError(f"layer_types: {len(self.layer_types)} entries for {self.n_layer} layers")
        if gpt and (self.n_kv_head != self.n_head or self.head_dim * self.n_head != self.d_model):
            raise ValueError(
                f"n_kv_head={self.n_kv_head}, head_dim={self.head_dim}: the gpt layout has full multi-head "
                f"attention (n_kv_head = n_head = {self.n_head}, head_dim = d_model / n_head)"
            )
        from zeroplan.architectures.limits import check_total

        check_total(numels(transformer_shapes(self)), "model")  # Ψ <= 1e15: the same bound as --params

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): n_head · head_dim."""
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): n_kv_head · head_dim."""
        return self.n_kv_head * self.head_dim

    @property
    def tied(self) -> bool:
        return bool(self.tie_word_embeddings)


BLOCK_PREFIX: dict[str, str] = {"gpt": "transformer.h.", "llama": "model.layers."}
"""Name prefix of the decoder layers (the sharding units) per style, as transformers registers them."""


def layout_features(spec: TransformerSpec) -> tuple[str, ...]:
    """The newer families' features of ``spec`` beyond the Llama/Mistral/Qwen2 block, by name: what the activation
    terms (``formulas.activation_terms.unmodelled_features``) and the validator's own runtime
    (``validate/transformer.py``) each say they do or do not derive."""
    features = {
        "q/k norms": spec.qk_norm, "four norms per layer": spec.sandwich_norms,
        "fused qkv and gate-up projections": spec.fused_projections,
        "soft-capping": spec.attn_logit_softcap is not None or spec.final_logit_softcap is not None,
        "sliding-window layers": spec.layer_types is not None, "routed experts": spec.moe is not None,
        "latent attention": spec.mla is not None,
    }  # fmt: skip
    return tuple(name for name, present in features.items() if present)


def block_prefix(spec: TransformerSpec) -> str:
    """``transformer.h.`` (GPT-2) or ``model.layers.`` (Llama, Mistral, Qwen2): the decoder layers' names."""
    return BLOCK_PREFIX[spec.style]


def _gpt_shapes(spec: TransformerSpec) -> list[tuple[str, Shape]]:
    """transformers/models/gpt2/modeling_gpt2.py: GPT2LMHeadModel (Conv1D weights are (in, out))."""
    d, f = spec.d_model, spec.ffn
    out: list[tuple[str, Shape]] = [("transformer.wte.weight", (spec.vocab_size, d)),
                                    ("transformer.wpe.weight", (spec.max_seq_len, d))]  # fmt: skip
    layer = [
        ("ln_1.weight", (d,)), ("ln_1.bias", (d,)),
        ("attn.c_attn.weight", (d, 3 * d)), ("attn.c_attn.bias", (3 * d,)),
        ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
        ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
        ("mlp.c_fc.weight", (d, f)), ("mlp.c_fc.bias", (f,)),
        ("mlp.c_proj.weight", (f, d)), ("mlp.c_proj.bias", (d,)),
    ]  # fmt: skip
    for i in range(spec.n_layer):  # each layer's names under its prefix (``_llama_shapes``: a speed-up, no rule)
        p = f"{BLOCK_PREFIX['gpt']}{i}."
        out += [(p + name, shape) for name, shape in layer]
    out += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    return out


def _attention_shapes(spec: TransformerSpec, p: str) -> list[tuple[str, Shape]]:
    """LlamaAttention and its relatives under ``p`` (``model.layers.{i}.self_attn.``): Phi3Attention
    registers o_proj before its fused qkv_proj; Qwen3/Gemma 3 add q_norm and k_norm (head_dim) last."""
    d, q, kv = spec.d_model, spec.q_dim, spec.kv_dim
    if spec.mla is not None:
        return mla_shapes(spec.mla, spec.n_head, d, p, spec.qkv_bias)
    if spec.fused_projections:
        return linear(p + "o_proj", d, q, spec.o_bias) + linear(p + "qkv_proj", q + 2 * kv, d, spec.qkv_bias)
    out = linear(p + "q_proj", q, d, spec.qkv_bias) + linear(p + "k_proj", kv, d, spec.qkv_bias)
    out += linear(p + "v_proj", kv, d, spec.qkv_bias) + linear(p + "o_proj", d, q, spec.o_bias)
    if spec.qk_norm:
        out += [(p + "q_norm.weight", (spec.head_dim,)), (p + "k_norm.weight", (spec.head_dim,))]
    return out


def _mlp_shapes(spec: TransformerSpec, layer: int, p: str) -> list[tuple[str, Shape]]:
    """The layer's MLP under ``p`` (``model.layers.{i}.mlp.``): sparse where ``spec.moe`` says, Phi-3's fused
    gate_up_proj, else gate, up, down."""
    d, f, bias = spec.d_model, spec.ffn, spec.mlp_bias
    if spec.moe is not None and layer in spec.moe.sparse_layers:
        return moe_shapes(spec.moe, spec.model_type, d, p)
    if spec.fused_projections:
        return linear(p + "gate_up_proj", 2 * f, d, bias) + linear(p + "down_proj", d, f, bias)
    out = linear(p + "gate_proj", f, d, bias) + linear(p + "up_proj", f, d, bias)
    return out + linear(p + "down_proj", d, f, bias)


def _llama_shapes(spec: TransformerSpec) -> list[tuple[str, Shape]]:
    """transformers/models/llama/modeling_llama.py: LlamaForCausalLM; the other llama-layout families
    register the same decoder layer (self_attn, mlp, then the norms: two, or Gemma's four). One layer's
    parameters are built once (twice with sparse layers) under the prefix "" and named under each layer's
    prefix: the shape builders put their prefix before every name and read the layer only for a sparse MLP
    (a speed-up, no rule: a spec is built, with all its shapes, for every TP degree a plan tries)."""
    d = spec.d_model
    norms = ("input_layernorm", "post_attention_layernorm")
    if spec.sandwich_norms:
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    out: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (spec.vocab_size, d))]
    layers: dict[bool, list[tuple[str, Shape]]] = {}  # a layer's parameters under the prefix "", by sparse MLP
    for i in range(spec.n_layer):
        sparse = spec.moe is not None and i in spec.moe.sparse_layers  # ``_mlp_shapes``' only use of the layer
        layer = layers.get(sparse)
        if layer is None:
            layer = layers[sparse] = _attention_shapes(spec, "self_attn.") + _mlp_shapes(spec, i, "mlp.") + [
                (norm + ".weight", (d,)) for norm in norms]  # fmt: skip
        p = f"{BLOCK_PREFIX['llama']}{i}."
        out += [(p + name, shape) for name, shape in layer]
    out.append(("model.norm.weight", (d,)))
    return out


def transformer_shapes(spec: TransformerSpec) -> tuple[tuple[str, Shape], ...]:
    """Every parameter of ``spec`` as (name, shape), in ``named_parameters()`` order."""
    out = _gpt_shapes(spec) if spec.style == "gpt" else _llama_shapes(spec)
    if not spec.tied:
        out.append(("lm_head.weight", (spec.vocab_size, spec.d_model)))
    return tuple(out)


def param_count(spec: TransformerSpec) -> int:
    """Ψ of ``spec``: every parameter element, a tied head once."""
    return sum(numels(transformer_shapes(spec)))


def mlp_shapes(widths: tuple[int, ...]) -> tuple[tuple[str, Shape], ...]:
    """A stack of biased linears ``widths[0] -> widths[1] -> ...`` as (name, shape)."""
    if len(widths) < 2 or any(w < 1 for w in widths):
        raise ValueError(f"widths={widths}: need at least two positive widths")
    out: list[tuple[str, Shape]] = []
    for i, (w_in, w_out) in enumerate(zip(widths, widths[1:])):
        out += [(f"layers.{i}.weight", (w_out, w_in)), (f"layers.{i}.bias", (w_out,))]
    return tuple(out)


def numels(shapes: tuple[tuple[str, Shape], ...]) -> tuple[int, ...]:
    """Element count of each tensor (in C: a spec checks its Ψ from every shape; a speed-up, no rule)."""
    return tuple(map(math.prod, map(itemgetter(1), shapes)))


def gpt_for_params(psi: float, vocab_size: int = 50304) -> TransformerSpec:
    """A GPT-style spec with about ``psi`` parameters, for simulating a model given only Ψ.

    Blocks hold 12·d² + 13·d parameters. The width follows GPT-3's aspect ratio n_layer ≈ d_model / 128
    (175B: 96 layers of 12288), so Ψ ≈ 12·d³/128, rounded to a multiple of 128 with 128-wide heads; above
    ``zeroplan.types.MAX_LAYERS`` layers (Ψ beyond about 4e12) the model keeps that many and widens instead.
    """
    from zeroplan.architectures.limits import MAX_LAYERS

    d_model = max(128, round((psi * 128 / 12) ** (1 / 3) / 128) * 128)
    if (psi * 128 / 12) ** (1 / 3) / 128 > MAX_LAYERS:  # deeper than the layer bound: as deep as allowed, wider
        d_model = max(128, math.floor(math.sqrt(psi / (12 * MAX_LAYERS)) / 128) * 128)
    per_layer = 12 * d_model * d_model + 13 * d_model
    embed = (vocab_size + 1024) * d_model + 2 * d_model
    n_layer = min(MAX_LAYERS, max(1, round((psi - embed) / per_layer)))
    return TransformerSpec(n_layer, d_model, d_model // 128, vocab_size)
