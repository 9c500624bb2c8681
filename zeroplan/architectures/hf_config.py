"""A Hugging Face ``config.json`` read the way ``transformers`` 5.24 reads it, into a ``TransformerSpec``.

Pure Python (no torch, no transformers): the file is read locally, never downloaded. Families and the
config class each one's defaults come from:

- ``gpt2``:    transformers/models/gpt2/configuration_gpt2.py: GPT2Config
- ``llama``:   transformers/models/llama/configuration_llama.py: LlamaConfig
- ``mistral``: transformers/models/mistral/configuration_mistral.py: MistralConfig
- ``qwen2``:   transformers/models/qwen2/configuration_qwen2.py: Qwen2Config
- RoPE (all but gpt2): transformers/modeling_rope_utils.py: RotaryEmbeddingConfigMixin
  (``rope_parameters`` or the older ``rope_scaling`` dict first, then a top-level ``rope_theta``, then
  ``default_theta`` = 10000.0; ``rope_type`` from the dict's ``rope_type`` or ``type``, else "default").

Absent keys get the config class's default, except the keys that set a parameter shape and have no
family convention (vocabulary, width, depth, heads, MLP width, GPT-2's positions): transformers would
fill those with its reference size (a Llama config without ``hidden_size`` becomes 4096 wide), which
silently plans a different model, so a missing one is a one-line ValueError naming it. GPT-2's
``attribute_map`` aliases (``hidden_size`` for ``n_embd`` ...) are accepted as transformers accepts them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

from zeroplan.architectures.spec import ACTIVATIONS, TransformerSpec
from zeroplan.architectures.limits import dimension_limit, show

#: transformers/modeling_rope_utils.py: RotaryEmbeddingConfigMixin.default_theta
DEFAULT_ROPE_THETA = 10_000.0

_MISSING = object()


def _shown(value: object) -> str:
    """``value`` for a message: text quoted (``'8'`` is not 8), anything else short (``zeroplan.types.show``)."""
    return repr(value if len(value) <= 40 else value[:37] + "...") if isinstance(value, str) else show(value)


def _finite(value: object) -> bool:
    """A JSON number (not true/false) that is a finite float (a 400-digit integer is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class _Reader:
    """Typed access to one config dict; every error is one line naming the file and the key."""

    def __init__(self, config: Mapping[str, object], source: str, aliases: Mapping[str, str]) -> None:
        self.config, self.source, self.aliases = config, source, aliases

    def fail(self, key: str, why: str) -> ValueError:
        return ValueError(f"{self.source}: {key}: {why}")

    def raw(self, key: str) -> object:
        value = self.config.get(key, _MISSING)
        alias = self.aliases.get(key)
        if alias is not None and alias in self.config:
            if value is not _MISSING and self.config[alias] != value:
                raise self.fail(key, f"{value!r} disagrees with its alias {alias}={self.config[alias]!r}")
            value = self.config[alias]
        return value

    def count(self, key: str, default: object = _MISSING, minimum: int = 1) -> int | None:
        """A whole number >= ``minimum``; ``default`` when absent or null (None default: stays None)."""
        value = self.raw(key)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise self.fail(key, "missing (required: it sets parameter shapes)")
            return default  # type: ignore[return-value]
        return self.count_value(key, value, minimum)  # bounded before any shape is built

    def count_value(self, key: str, value: object, minimum: int = 1) -> int:
        """``value`` (of ``key``) as a whole number in [``minimum``, the dimension's limit]."""
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"{_shown(value)} is not a whole number >= {minimum}")
        if value > dimension_limit(key):
            raise self.fail(key, f"{_shown(value)} is above the limit of {dimension_limit(key):,} (docs/limits.md)")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw(key)
        if value is _MISSING or value is None:
            return default
        if not _finite(value) or value < 0:
            raise self.fail(key, f"{_shown(value)} is not a finite number >= 0")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is _MISSING or value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"{value!r} is not true or false")
        return value

    def activation(self, key: str, default: str) -> str:
        value = self.raw(key)
        value = default if value is _MISSING or value is None else value
        if value not in ACTIVATIONS:
            raise self.fail(key, f"{value!r} is not one of {', '.join(ACTIVATIONS)}")
        return value  # type: ignore[return-value]

    def require_default(self, key: str, default: object, why: str) -> None:
        """Refuse a setting zeroplan does not model (one that changes the shapes or the computation)."""
        value = self.raw(key)
        if value is not _MISSING and value is not None and value != default:
            raise self.fail(key, f"{value!r} is not supported ({why})")


def _gpt2(r: _Reader) -> dict:
    """GPT2Config (transformers/models/gpt2/configuration_gpt2.py), with its attribute_map aliases."""
    r.require_default("add_cross_attention", False, "cross-attention adds parameters zeroplan does not count")
    r.require_default("scale_attn_weights", True, "the reference runtime scales by 1/sqrt(head_dim)")
    r.require_default("scale_attn_by_inverse_layer_idx", False, "the reference runtime does not")
    return dict(
        style="gpt", vocab_size=r.count("vocab_size"), d_model=r.count("n_embd"), n_layer=r.count("n_layer"),
        n_head=r.count("n_head"), max_seq_len=r.count("n_positions"), ffn_hidden=r.count("n_inner", None),
        hidden_act=r.activation("activation_function", "gelu_new"),
        norm_eps=r.number("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=r.flag("tie_word_embeddings", True),
        embd_pdrop=r.number("embd_pdrop", 0.1), attn_pdrop=r.number("attn_pdrop", 0.1),
        resid_pdrop=r.number("resid_pdrop", 0.1),
    )  # fmt: skip


#: GPT2Config.attribute_map: the generic names transformers also accepts for GPT-2's keys.
_ALIASES = {"gpt2": {
    "n_embd": "hidden_size", "n_positions": "max_position_embeddings",
    "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
}}  # fmt: skip


def _rope(r: _Reader) -> dict:
    """RotaryEmbeddingConfigMixin.convert_rope_params_to_dict / standardize_rope_params."""
    rope = r.raw("rope_parameters")
    if rope is _MISSING or rope is None:
        rope = r.raw("rope_scaling")
    rope = {} if rope is _MISSING or rope is None else rope
    if not isinstance(rope, dict):
        raise r.fail("rope_parameters", f"{rope!r} is not an object")
    theta = rope.get("rope_theta", r.raw("rope_theta"))
    theta = DEFAULT_ROPE_THETA if theta is _MISSING or theta is None else theta
    if not _finite(theta) or theta <= 0:
        raise r.fail("rope_theta", f"{_shown(theta)} is not a finite number > 0")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in ROPE_KEYS:
        raise r.fail("rope_parameters", f"rope_type={_shown(rope_type)} is not one of {', '.join(ROPE_KEYS)}")
    _check_rope(r, rope, rope_type)
    return dict(rope_theta=float(theta), rope_type=rope_type)


#: transformers/modeling_rope_utils.py (5.24): RotaryEmbeddingConfigMixin._validate_<type>_rope_parameters:
#: the rope types it knows and the keys each requires (a missing one is transformers' KeyError).
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings"}),
    "longrope": frozenset({"short_factor", "long_factor", "original_max_position_embeddings"}),
    "llama3": frozenset({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}),
    "proportional": frozenset(),
}
_ROPE_NUMBERS = ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                 "low_freq_factor", "high_freq_factor", "partial_rotary_factor", "short_factor", "long_factor")
#: the smallest value of each numeric rope key transformers' validators accept (factor >= 1, others >= 0)
_ROPE_MINIMUM = {"factor": 1.0}


def _check_rope(r: _Reader, rope: Mapping[str, object], rope_type: str) -> None:
    """One line for a rope dict transformers would refuse or warn about: a missing required key, a
    numeric value that is not a finite number >= 0 (factor >= 1; short/long_factor non-empty lists of
    them), a partial_rotary_factor outside (0, 1], high_freq_factor <= low_freq_factor or beta_fast <=
    beta_slow. Keys transformers does not read are left alone, as transformers leaves them (a warning)."""
    required = ROPE_KEYS[rope_type]
    where = f"rope_parameters ({rope_type})"
    missing = sorted(required - set(rope))
    if missing:
        raise r.fail(where, f"{missing[0]}: missing (transformers requires it for rope_type {rope_type})")
    if "original_max_position_embeddings" in rope:
        r.count_value("original_max_position_embeddings", rope["original_max_position_embeddings"])
    for key in _ROPE_NUMBERS:
        if key not in rope:
            continue
        value, low = rope[key], _ROPE_MINIMUM.get(key, 0.0)
        values = value if key in ("short_factor", "long_factor") and isinstance(value, list) and value else [value]
        if not all(_finite(v) and v >= low for v in values):
            raise r.fail(where, f"{key}={_shown(value)} is not a finite number >= {low:g}")
    if not 0 < rope.get("partial_rotary_factor", 1.0) <= 1:
        raise r.fail(where, f"partial_rotary_factor={rope['partial_rotary_factor']} is not in (0, 1]")
    for high, low_key in (("high_freq_factor", "low_freq_factor"), ("beta_fast", "beta_slow")):
        if high in rope and low_key in rope and rope[high] <= rope[low_key]:
            raise r.fail(where, f"{high}={rope[high]} is not above {low_key}={rope[low_key]}")


def _llama_common(r: _Reader, kv_default: int | None, positions: int, tie: bool) -> dict:
    """The keys LlamaConfig, MistralConfig and Qwen2Config share, with the family's defaults."""
    n_head = r.count("num_attention_heads")
    d_model = r.count("hidden_size")
    n_kv = r.count("num_key_value_heads", kv_default)
    return dict(
        style="llama", vocab_size=r.count("vocab_size"), d_model=d_model,
        n_layer=r.count("num_hidden_layers"), n_head=n_head, ffn_hidden=r.count("intermediate_size"),
        n_kv_head=n_head if n_kv is None else n_kv,
        # LlamaAttention (and Mistral's, Qwen2's) read getattr(config, "head_dim", hidden // heads)
        head_dim=r.count("head_dim", d_model // n_head),
        max_seq_len=r.count("max_position_embeddings", positions),
        hidden_act=r.activation("hidden_act", "silu"), norm_eps=r.number("rms_norm_eps", 1e-6),
        tie_word_embeddings=r.flag("tie_word_embeddings", tie),
        attn_pdrop=r.number("attention_dropout", 0.0), **_rope(r),
    )  # fmt: skip


def _llama(r: _Reader) -> dict:
    """LlamaConfig (transformers/models/llama/configuration_llama.py)."""
    bias = r.flag("attention_bias", False)  # LlamaAttention: q, k, v and o all take it
    return dict(
        _llama_common(r, kv_default=None, positions=2048, tie=False),
        model_type="llama", qkv_bias=bias, o_bias=bias, mlp_bias=r.flag("mlp_bias", False),
    )


def _mistral(r: _Reader) -> dict:
    """MistralConfig (transformers/models/mistral/configuration_mistral.py): no biases; 8 key/value
    heads, 4096 * 32 positions and a 4096-token sliding window by default."""
    return dict(
        _llama_common(r, kv_default=8, positions=4096 * 32, tie=False),
        model_type="mistral", sliding_window=_window(r, 4096),
    )


def _window(r: _Reader, default: int) -> int | None:
    """``sliding_window``: the class default when absent, None when the file says null."""
    return None if r.raw("sliding_window") is None else r.count("sliding_window", default)


def _qwen2(r: _Reader) -> dict:
    """Qwen2Config (transformers/models/qwen2/configuration_qwen2.py): biases on q, k, v (Qwen2Attention,
    ``bias=True``), none on o and the MLP; 32768 positions; sliding windows only with use_sliding_window,
    then on layers >= max_window_layers (or as ``layer_types`` says)."""
    n_layer = r.count("num_hidden_layers")
    # Qwen2Config.__post_init__: sliding_window = sliding_window if use_sliding_window else None
    window = _window(r, 4096) if r.flag("use_sliding_window", False) else None
    layer_types = r.raw("layer_types")
    if layer_types is _MISSING or layer_types is None:
        first = r.count("max_window_layers", 28, minimum=0)
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                       for i in range(n_layer)]  # fmt: skip
    kinds = ("full_attention", "sliding_attention")
    if not isinstance(layer_types, list) or not all(isinstance(t, str) and t in kinds for t in layer_types):
        raise r.fail("layer_types", f"{_shown(layer_types)} is not a list of full_attention / sliding_attention")
    if len(layer_types) != n_layer:  # Qwen2Config: one entry per layer (transformers' layer_type_validation)
        raise r.fail("layer_types", f"{len(layer_types)} entries for num_hidden_layers={n_layer}")
    if len(set(layer_types)) > 1:
        raise r.fail("layer_types", "sliding windows on some layers only are not supported")
    if "sliding_attention" in layer_types and window is None:
        raise r.fail("sliding_window", "missing (layer_types asks for sliding attention)")
    window = window if layer_types and layer_types[0] == "sliding_attention" else None
    return dict(
        _llama_common(r, kv_default=32, positions=32768, tie=False),
        model_type="qwen2", qkv_bias=True, sliding_window=window,
    )


FAMILIES: dict[str, Callable[[_Reader], dict]] = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral,
                                                   "qwen2": _qwen2}  # fmt: skip
"""``model_type`` -> its reader. The newer families (Qwen3, Gemma 2/3, Phi-3, mixture-of-experts) live in
``hf_families``, which builds on the readers here and adds itself to this table and ``_ALIASES`` when the
package is imported (``zeroplan/architectures/__init__.py``), so the two modules do not import each other."""


def spec_from_hf_config(config: Mapping[str, object], source: str = "config") -> TransformerSpec:
    """The architecture a Hugging Face config dict describes; ValueError (one line) if it cannot."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{source}: not a JSON object")
    model_type = config.get("model_type")
    if model_type is None:
        raise ValueError(f"{source}: model_type: missing (expected one of {', '.join(FAMILIES)})")
    if not isinstance(model_type, str) or model_type not in FAMILIES:  # a list or dict is no family either
        raise ValueError(f"{source}: model_type: {_shown(model_type)} is not supported "
                         f"(expected one of {', '.join(FAMILIES)})")  # fmt: skip
    reader = _Reader(config, source, _ALIASES.get(model_type, {}))
    fields = FAMILIES[model_type](reader)
    fields.setdefault("model_type", model_type)
    try:
        return TransformerSpec(**fields)
    except ValueError as exc:  # e.g. hidden_size not divisible by num_attention_heads
        raise ValueError(f"{source}: {exc}") from None


def read_hf_config(path: str | Path) -> TransformerSpec:
    """The architecture of a local ``config.json``; ValueError (one line) if unreadable, not JSON or
    not a supported, complete config."""
    from zeroplan.files import read_json  # here: a preset's plan reads no file (its tempfile, signal: issue 16)

    source = f"config {str(path)!r}"
    return spec_from_hf_config(read_json(path, "config"), source)  # type: ignore[arg-type]
