"""Routed experts' saved activations: zeroplan.formulas.moe_activations vs transformers' own experts
modules (saved-tensor hooks, bf16 on CPU), routed by the model's own router on random tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.formulas.moe_activations import expert_activations

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
# grouped_mm needs rows of 16-byte multiples (bf16: widths divisible by 8), as on GPUs
WIDTHS = {"hidden_size": 48, "intermediate_size": 40, "moe_intermediate_size": 24, "num_attention_heads": 4,
          "num_key_value_heads": 2}


def saved_bytes(fn, exclude) -> int:
    """Bytes of the distinct storages autograd saved during ``fn()`` and still holds at its end, less those of
    ``exclude``. Only what is alive counts: a freed storage's address may be given to a later one (as
    tests/hf_saved.hf_saved_bytes)."""
    import weakref

    import torch

    packed = []

    def pack(t):
        packed.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    alive = {ptr: n for ref, ptr, n in packed if ref() is not None and ptr not in skip}
    del out
    return sum(alive.values())


@pytest.mark.parametrize(
    ("name", "implementation"),
    [("tiny-mixtral", "grouped_mm"), ("tiny-mixtral", "eager"), ("tiny-qwen3-moe", "grouped_mm"),
     ("tiny-qwen3-moe", "eager"), ("tiny-qwen2-moe", "grouped_mm"), ("tiny-deepseek-v3", "grouped_mm")],
)  # fmt: skip
def test_expert_saved_bytes_match_transformers(name, implementation):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = {**json.loads((CONFIGS / f"{name}.json").read_text()), **WIDTHS}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg), experts_implementation=implementation
    ).to(torch.bfloat16)
    spec = spec_from_hf_config(cfg)
    block = model.model.layers[spec.moe.sparse_layers[0]].mlp
    n = 2 * 24  # b = 2, s = 24
    x = torch.randn(n, spec.d_model, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    _, weights, index = block.gate(x)  # the model's own routing: a data-dependent split
    x.requires_grad_(True)
    weights = weights.detach().requires_grad_(True)
    measured = saved_bytes(lambda: block.experts(x, index, weights), [x, weights, *block.parameters()])
    predicted = expert_activations(spec.moe, spec.model_type, spec.d_model, n, 2, implementation)
    assert predicted.dispatched_rows == n * spec.moe.top_k == index.numel()
    assert measured == predicted.saved_bytes  # slack: none


def test_the_split_does_not_matter_and_the_default_is_grouped_mm():
    spec = spec_from_hf_config(json.loads((CONFIGS / "mixtral-8x7b-v0.1.json").read_text()))
    acts = expert_activations(spec.moe, "mixtral", spec.d_model, 4096)
    # Mixtral-8x7B, 4096 tokens, top-2: 8192 rows of 2·(2·4096 + 4·14336) + 4 + 24 bytes, 8 offsets
    assert acts.dispatched_rows == 8192 and acts.rows_per_expert_max == 4096
    assert acts.saved_bytes == 8192 * (2 * (2 * 4096 + 4 * 14336) + 28) + 32 == 1_073_971_232
    with pytest.raises(ValueError, match="implementation='batched_mm': expected one of grouped_mm, eager"):
        expert_activations(spec.moe, "mixtral", spec.d_model, 4096, implementation="batched_mm")
