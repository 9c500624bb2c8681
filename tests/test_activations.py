"""Activation estimate: Korthikanti et al. 2022 (arXiv:2205.05198), Table 2 per layer, times L."""

import pytest

from tests.hf_saved import hf_saved_bytes, predicted_saved_bytes

import zeroplan
from zeroplan.formulas.activations import activation_bytes
from zeroplan.presets import get_model

GPT3 = get_model("gpt3-175b").spec  # s = 2048, h = 12288, a = 96, L = 96


def test_gpt3_without_recomputation_by_hand():
    # sbh(34 + 5as/h) per layer: 2048·12288·34 + 5·96·2048² = 855,638,016 + 2,013,265,920 bytes, x 96 layers.
    assert activation_bytes(GPT3, 2048, 1, "none") == (855_638_016 + 2_013_265_920) * 96


def test_tensor_and_sequence_parallel_divide_by_t():
    assert activation_bytes(GPT3, 2048, 1, "none", tp=8) == (855_638_016 + 2_013_265_920) * 96 // 8
    assert activation_bytes(GPT3, 2048, 2, "selective", tp=8) == 34 * 2048 * 2 * 12288 * 96 // 8


def test_full_recomputation_keeps_each_layer_input():
    # 2sbh per layer, any architecture: Llama 2 70B at s = 4096, b = 1: 2·4096·8192·80 = 5 GiB.
    assert activation_bytes(get_model("llama2-70b").spec, 4096, 1, "full") == 5 * 2**30


def test_llama_constants_are_not_published():
    assert activation_bytes(get_model("llama2-70b").spec, 4096, 1, "none") is None
    assert activation_bytes(get_model("llama2-70b").spec, 4096, 1, "selective") is None


def test_bad_checkpointing():
    with pytest.raises(ValueError, match="checkpointing='some'"):
        activation_bytes(GPT3, 2048, 1, "some")


def test_plan_reports_activations_against_the_headroom():
    p = zeroplan.plan("gpt3-175b", gpu="h100-80gb", gpus=1024, model_parallel=8, checkpointing="selective",
                      headroom=0.1)  # fits on model states: the headroom is what activations must fit in
    assert p.activation_bytes == 34 * 2048 * 12288 * 96 // 8
    assert p.headroom_bytes == 80 * 2**30 - int(0.9 * 80 * 2**30)
    assert p.activation_bytes > p.headroom_bytes


# Dropout: the activation terms count none (dropout.dropout_limit), so every engine's peak refuses a
# config with dropout > 0 rather than under-predict it (a tiny bf16 gpt2 with dropout 0.1 under FSDP2 held
# 9-10% more than predicted: docs/engines/fsdp2.md).
DROPOUT_SPEC = get_model("gpt2-xl").spec  # openai-community/gpt2-xl's config.json: 0.1 each


@pytest.mark.parametrize("engine", ["reference", "fsdp2", "deepspeed"])
def test_every_engine_refuses_a_peak_with_dropout(engine):
    from dataclasses import replace

    from zeroplan.engines import get_engine
    from zeroplan.engines.base import PlannerOptions

    eng, options = get_engine(engine), PlannerOptions()
    limit = eng.peak_limits(options, DROPOUT_SPEC)
    assert limit is not None and limit.option == "architecture"
    assert limit.reason.startswith(f"the {engine} engine's peak counts no dropout masks; the config has "
                                   "embd_pdrop=0.1, attn_pdrop=0.1, resid_pdrop=0.1 (set attn_pdrop")
    quiet = replace(DROPOUT_SPEC, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    assert eng.peak_limits(options, quiet) is None
    one = replace(DROPOUT_SPEC, embd_pdrop=0.0, resid_pdrop=0.0)  # Llama's attention_dropout
    assert "the config has attn_pdrop=0.1 (" in eng.peak_limits(options, one).reason


def test_cli_refuses_an_fsdp2_peak_with_dropout():
    from typer.testing import CliRunner

    from zeroplan.cli import app

    r = CliRunner().invoke(app, ["estimate", "--model", "gpt2-xl", "--engine", "fsdp2", "--gpus", "8"])
    assert r.exit_code == 2
    assert "the fsdp2 engine's peak counts no dropout masks" in r.output


def test_dropout_saves_what_the_terms_do_not_count():
    # Why the refusal (transformers 5.24 modeling_gpt2.py, GPT2Block in train mode, bf16 on CPU):
    # dropout_p > 0 sends SDPA to its math path, which saves three fp32 b·h·s² tensors (asserted: two at least,
    # 4 bytes each) and fp32 q, k, v beside the dropout masks; at p = 0 SDPA saves q, k, v, out, logsumexp.
    torch = pytest.importorskip("torch")
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    def saved_bytes(p: float) -> int:
        torch.manual_seed(0)
        cfg = GPT2Config(n_embd=32, n_head=2, n_layer=1, n_positions=32,
                         attn_pdrop=p, resid_pdrop=p, embd_pdrop=p)
        cfg._attn_implementation = "sdpa"
        block = GPT2Block(cfg, layer_idx=0).to(torch.bfloat16).train()
        weights = {w.untyped_storage().data_ptr() for w in block.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        x = torch.randn(2, 32, 32, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        inputs = weights | {x.untyped_storage().data_ptr()}
        return sum(n for ptr, n in seen.items() if ptr not in inputs)

    b, h, s = 2, 2, 32
    assert saved_bytes(0.1) - saved_bytes(0.0) >= 2 * b * h * s * s * 4


@pytest.mark.parametrize(("s", "b", "kv_heads"), [(23, 2, 2), (24, 2, 2), (25, 2, 2), (25, 1, 2), (30, 3, 2),
                                                  (23, 2, 1), (24, 2, 1), (30, 3, 1)])
def test_sliding_window_mask_as_transformers_saves_it(s, b, kv_heads):
    """MistralForCausalLM (sdpa, fp32, window 24): every storage autograd saves in one forward (saved-tensor
    hooks, parameters excluded) equals ``saved_total`` plus the int64 targets. transformers gives SDPA a mask from
    s = window on (``llama_nograd.sdpa_masked``; before: s > window, 33,792 B short at s = 24) and the mask
    is (b, 1, s, s) (before: s², 14,400 B short at s = 30, b = 3). With one kv head ``repeat_kv`` is a view
    (``llama_nograd.kv_copied``; counting copies: 2·N·(q - kv)·a over per layer, 36,864 B in all at s = 24,
    b = 2)."""
    cfg = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
           "num_key_value_heads": kv_heads, "num_hidden_layers": 2, "vocab_size": 101, "max_position_embeddings": 128,
           "sliding_window": 24}  # fmt: skip
    measured, _, _ = hf_saved_bytes(cfg, b, s)
    assert measured == predicted_saved_bytes(cfg, b, s)
