"""The newer families (Qwen3, Gemma 2/3, Phi-3, Mixtral, Qwen-MoE, DeepSeek-V3): what each config key
becomes, variants against transformers' meta-device models, and one-line refusals.

The shapes of every config in tests/data/hf_configs are checked in tests/test_architectures.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from zeroplan.architectures.hf_config import read_hf_config, spec_from_hf_config
from zeroplan.architectures.spec import param_count, transformer_shapes
from zeroplan.formulas.activation_terms import model_activations

CONFIGS = Path(__file__).parent / "data" / "hf_configs"


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def meta_shapes(cfg: dict) -> tuple:
    """named_parameters() shapes of transformers' causal LM of ``cfg``, built on the meta device."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def test_features_of_the_real_configs():
    qwen3 = read_hf_config(CONFIGS / "qwen3-8b.json")
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.n_kv_head, qwen3.q_dim) == (True, 128, 8, 4096)
    gemma2 = read_hf_config(CONFIGS / "gemma-2-2b.json")
    assert (gemma2.sandwich_norms, gemma2.tied, gemma2.head_dim, gemma2.q_dim) == (True, True, 256, 2048)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.hidden_act == "gelu_pytorch_tanh"
    assert gemma2.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma2.sliding_window == 4096
    gemma3 = read_hf_config(CONFIGS / "gemma-3-1b.json")
    assert gemma3.qk_norm and gemma3.sandwich_norms and gemma3.final_logit_softcap is None
    assert [i for i, t in enumerate(gemma3.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    wrapped = read_hf_config(CONFIGS / "gemma-3-4b.json")  # text_config, Gemma3TextConfig defaults
    assert (wrapped.model_type, wrapped.vocab_size, wrapped.n_head, wrapped.n_kv_head) == ("gemma3_text", 262_208, 8, 4)
    assert wrapped.sliding_window == 1024
    phi3 = read_hf_config(CONFIGS / "phi-3-mini-4k.json")
    assert (phi3.fused_projections, phi3.sliding_window, phi3.norm_eps) == (True, 2047, 1e-5)
    assert dict(transformer_shapes(phi3))["model.layers.0.self_attn.qkv_proj.weight"] == (3 * 3072, 3072)
    mixtral = read_hf_config(CONFIGS / "mixtral-8x7b-v0.1.json")
    assert (mixtral.moe.n_experts, mixtral.moe.top_k, mixtral.moe.expert_ffn) == (8, 2, 14336)
    assert mixtral.moe.sparse_layers == tuple(range(32))
    qwen_moe = read_hf_config(CONFIGS / "qwen1.5-moe-a2.7b.json")
    assert (qwen_moe.moe.n_experts, qwen_moe.moe.top_k, qwen_moe.moe.shared_ffn) == (60, 4, 5632)
    assert qwen_moe.qkv_bias
    ds = read_hf_config(CONFIGS / "deepseek-v3.json")
    assert ds.moe.sparse_layers == tuple(range(3, 61))
    assert (ds.moe.n_experts, ds.moe.top_k, ds.moe.shared_ffn) == (256, 8, 2048)
    assert (ds.mla.q_lora_rank, ds.mla.kv_lora_rank, ds.mla.qk_head_dim, ds.mla.v_head_dim) == (1536, 512, 192, 128)
    assert (ds.head_dim, ds.ffn) == (64, 18432)  # DeepseekV3Config: head_dim = qk_rope_head_dim


def test_sparse_layers_follow_the_config_rules():
    # Qwen2MoeDecoderLayer: sparse iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    assert read_hf_config(CONFIGS / "tiny-qwen2-moe.json").moe.sparse_layers == (1,)  # step 2, layer 3 dense
    assert read_hf_config(CONFIGS / "tiny-qwen3-moe.json").moe.sparse_layers == (1, 2)  # mlp_only_layers [0]
    # DeepseekV3DecoderLayer: sparse iff i >= first_k_dense_replace (1 here)
    assert read_hf_config(CONFIGS / "tiny-deepseek-v3.json").moe.sparse_layers == (1, 2)


@pytest.mark.parametrize(
    ("cfg", "field", "expected"),
    [  # absent keys take the transformers 5.24 config class's default
        ({"model_type": "qwen3"}, "head_dim", 128),  # Qwen3Config.head_dim = 128 (not hidden / heads)
        ({"model_type": "gemma2"}, "head_dim", 256),  # Gemma2Config.head_dim
        ({"model_type": "gemma2"}, "n_kv_head", 4),
        ({"model_type": "gemma2"}, "tie_word_embeddings", True),
        ({"model_type": "gemma3_text"}, "rope_theta", 1e6),  # Gemma3TextConfig.default_theta["global"]
        ({"model_type": "phi3"}, "norm_eps", 1e-5),
        ({"model_type": "mixtral", "num_local_experts": 4}, "rope_theta", 1e6),  # MixtralConfig.default_theta
        ({"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 8}, "head_dim", 2),  # d / heads
        ({"model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 8}, "qkv_bias", True),
    ],
)
def test_defaults_of_absent_keys(cfg, field, expected):
    dims = {"hidden_size": 64, "num_attention_heads": 32, "num_hidden_layers": 2, "intermediate_size": 96,
            "vocab_size": 50}  # fmt: skip
    assert getattr(spec_from_hf_config({**dims, **cfg}), field) == expected


@pytest.mark.parametrize(
    ("cfg", "field", "expected"),
    [  # attribute_map aliases transformers accepts
        ({"model_type": "mixtral", "num_experts": 3, "num_key_value_heads": 2}, "n_experts", 3),
        ({"model_type": "qwen3_moe", "num_local_experts": 3, "moe_intermediate_size": 8, "num_experts_per_tok": 2},
         "n_experts", 3),
        ({"model_type": "deepseek_v3", "num_local_experts": 3, "moe_intermediate_size": 8, "num_experts_per_tok": 2},
         "n_experts", 3),
    ],
)
def test_expert_count_aliases(cfg, field, expected):
    dims = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 96,
            "vocab_size": 50}  # fmt: skip
    assert getattr(spec_from_hf_config({**dims, **cfg}).moe, field) == expected


@pytest.mark.parametrize(
    "variant",
    [
        {"q_lora_rank": None},  # DeepSeek-V2-Lite style: one q_proj
        {"q_lora_rank": None, "attention_bias": True, "first_k_dense_replace": 0},
    ],
)
def test_deepseek_variants_match_transformers(variant):
    cfg = {**config("tiny-deepseek-v3"), **variant}
    assert transformer_shapes(spec_from_hf_config(cfg)) == meta_shapes(cfg)


@pytest.mark.parametrize(
    "variant",
    [
        ("tiny-qwen3-moe", {"decoder_sparse_step": 2, "mlp_only_layers": [], "attention_bias": True}),
        ("tiny-qwen2-moe", {"qkv_bias": False, "tie_word_embeddings": True}),
        ("tiny-gemma2", {"attention_bias": True, "tie_word_embeddings": False}),
        ("tiny-phi3", {"head_dim": 4}),  # Phi3Attention reads head_dim where the config has one
    ],
)
def test_variants_match_transformers(variant):
    name, extra = variant
    cfg = {**config(name), **extra}
    spec = spec_from_hf_config(cfg)
    assert transformer_shapes(spec) == meta_shapes(cfg)
    assert param_count(spec) == sum(math.prod(s) for _, s in meta_shapes(cfg))


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"model_type": "mixtral"}, r"num_local_experts: missing \(required"),
        ({"model_type": "qwen3_moe", "num_experts": 4}, r"moe_intermediate_size: missing"),
        ({"model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 8, "mlp_only_layers": 1},
         r"mlp_only_layers: 1 is not a list of layer indices"),
        ({"model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 8, "use_sliding_window": True},
         r"use_sliding_window: True is not supported"),
        ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3},
         r"top_k=3: more experts per token than the 2 there are"),
        ({"model_type": "gemma3"}, r"text_config: missing \(expected an object\)"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, r"use_bidirectional_attention"),
        ({"model_type": "deepseek_v3", "n_routed_experts": 4, "moe_intermediate_size": 8, "n_shared_experts": 0},
         r"n_shared_experts: 0 is not a whole number >= 1"),
    ],
)
def test_bad_configs_are_one_line(cfg, message):
    dims = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
            "vocab_size": 50}  # fmt: skip
    with pytest.raises(ValueError, match=message) as info:
        spec_from_hf_config({**dims, **cfg}, "config 'c.json'")
    assert str(info.value).startswith("config 'c.json': ") and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "missing"),
    [
        ("tiny-qwen3", "q/k norms"),
        ("tiny-gemma2", "four norms per layer, soft-capping, sliding-window layers"),
        ("tiny-gemma3", "q/k norms, four norms per layer, sliding-window layers"),
        ("tiny-phi3", "fused qkv and gate-up projections"),
        ("tiny-mixtral", "routed experts"),
        ("tiny-qwen3-moe", "q/k norms, routed experts"),
        ("tiny-deepseek-v3", "routed experts, latent attention"),
    ],
)
def test_the_peak_is_refused_where_it_is_not_modelled(name, missing):
    spec = read_hf_config(CONFIGS / f"{name}.json")
    with pytest.raises(ValueError, match=f"its activation peak is not modelled yet \\({missing};") as info:
        model_activations(spec, 1, 8)
    assert str(info.value).startswith(f"model_type {spec.model_type!r}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "nd", "per_rank"),
    [  # docs/models.md: FSDP2 splits the (E, 2f, d) expert tensors on E, ceil(E / N_d) rows per rank
        ("mixtral-8x7b-v0.1", 8, 5_837_849_088),  # = Ψ / 8 exactly
        ("mixtral-8x7b-v0.1", 64, 5_662_347_328),  # 7.76 x Ψ / 64: one whole expert per rank
        ("qwen3-30b-a3b", 64, 477_064_416),  # 128 experts: still even
    ],
)
def test_fsdp2_dim0_rule_on_expert_tensors(name, nd, per_rank):
    from zeroplan.engines.fsdp2 import padded_shard_numel

    shapes = transformer_shapes(read_hf_config(CONFIGS / f"{name}.json"))
    assert sum(padded_shard_numel(s, nd) for _, s in shapes) == per_rank
    psi = sum(math.prod(s) for _, s in shapes)
    assert per_rank / (psi / nd) == pytest.approx({8: 1.0, 64: 7.759 if "mixtral" in name else 1.0}[nd], abs=1e-3)


def test_live_module_of_an_unmodelled_family_gets_model_states_without_a_peak():
    """``zeroplan.estimate(model=<Qwen3 module>)``: exact model states from the module's own tensors, no
    peak (the family's activations are not modelled yet), not the refusal line."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import zeroplan

    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, head_dim=16)  # fmt: skip
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(cfg)
    result = zeroplan.estimate(model=model, gpus=4)
    assert result.psi == sum(p.numel() for p in model.parameters()) == 86_912
