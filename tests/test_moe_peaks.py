"""The activation peak of the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): what autograd saves
in transformers' own classes (saved-tensor hooks, exact), and real FSDP2 and DeepSpeed runs on tiny configs
(recorded), against ``zeroplan.formulas.moe_block`` through the engines' peaks."""

from __future__ import annotations

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.formulas.activation_terms import model_activations

# grouped_mm needs rows of 16-byte multiples (bf16: every width divisible by 8); every layer sparse
BASE = {"hidden_size": 48, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 101, "max_position_embeddings": 64}
SPARSE = {
    "mixtral": {**BASE, "model_type": "mixtral", "num_local_experts": 5, "num_experts_per_tok": 2},
    "qwen3_moe": {**BASE, "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 3,
                  "moe_intermediate_size": 24, "head_dim": 16, "tie_word_embeddings": True},
    "qwen3_moe-norm": {**BASE, "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 3,
                       "moe_intermediate_size": 24, "head_dim": 16, "norm_topk_prob": True},
    "qwen2_moe": {**BASE, "model_type": "qwen2_moe", "num_experts": 6, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32},
}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(SPARSE))
def test_saved_activations_match_transformers_classes(family, dtype):
    """Every storage autograd saves in one training forward of transformers' class (grouped_mm experts, SDPA;
    parameters excluded) equals ``saved_total`` plus the int64 targets cross-entropy saves (N·8): no slack.
    Without the router's terms (``moe_block.router_saved``) the miss is N·E·4 + N·k·8 (+ N·4 + N·k·4
    renormalised) per layer; without the shared expert's, 4·N·f_s·a + N·a + N·d·a: each fails here."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg, b, s = SPARSE[family], 2, 24
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg), attn_implementation="sdpa", dtype=getattr(torch, dtype))
    assert model.config._experts_implementation == "grouped_mm"  # get_correct_experts_implementation's default
    owned = {p.untyped_storage().data_ptr() for p in model.train().parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg["vocab_size"], (b, s))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, shift_labels=ids, use_cache=False)
    assert getattr(out, "aux_loss", None) is None  # output_router_logits false: no load-balancing loss
    measured = sum(n for ptr, n in seen.items() if ptr not in owned)
    a = 4 if dtype == "float32" else 2
    acts = model_activations(spec_from_hf_config(cfg), b, s, act_bytes=a, stat_bytes=a)
    assert measured == acts.saved_total("none") + b * s * 8
