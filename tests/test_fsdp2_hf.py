"""FSDP2 on transformers' own classes (issue 17): one live row on real gloo ranks, and the switches that decide
which tree the profile predicts. The recorded rows (20, N_d 2 and 4, gpt2 / llama / mistral / qwen2, tied and
untied, labels or not, reshard or not, fp32 and bf16) are in tests/test_fsdp2_hf_recorded.py.

Live row: a ~0.95M-parameter Qwen2 (2 layers, odd sizes, 5 query heads on 1 key/value head, untied head)
trained with ``forward(labels=...)``, 32 tokens x 2 per rank at N_d = 2: recorded exact in every phase on both
ranks (2026-12-01; the profile before issue 17's terms: forward +9.99%, backward +9.30%); the bound is that
error plus ``MARGIN``. Its peaks are two of issue 17's mechanisms: forward, the root's all-gather output still
bound at the first block's copy-out; backward, the untied head's gradient held through the root's
reduce-scatter. About 50 s on 2 loaded cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.fsdp2 import Settings, estimate, fsdp2_run, moments
from zeroplan.formulas.peak import PHASES

DATA = Path(__file__).resolve().parent / "data" / "hf_configs"
MARGIN = 0.0005  # as tests/test_fsdp2_hf_recorded.py
QWEN2 = {"model_type": "qwen2", "hidden_size": 120, "intermediate_size": 328, "num_attention_heads": 5,
         "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 3001, "max_position_embeddings": 64,
         "tie_word_embeddings": False}  # fmt: skip
HF_TERMS = ("lm_head weight", "16-bit logits", "after the loss", "rotary inv_freq", "position ids (cache_position")


@pytest.mark.distributed
def test_live_qwen2_every_phase_every_rank(tmp_path):
    pytest.importorskip("transformers")
    from validate.engines.fsdp2 import Fsdp2Settings
    from validate.engines.fsdp2_rows import predict, run_world

    path = tmp_path / "qwen2.json"
    path.write_text(json.dumps(QWEN2))
    settings = Fsdp2Settings(model=str(path), hf=True, seq_len=32, steps=2)
    result = run_world(settings, 2)
    assert [r["rank"] for r in result["rows"]] == [0, 1]
    for row in result["rows"]:
        predicted = predict(settings, result["meta"], row["rank"])[0]
        for phase in PHASES:
            measured = row["peak_bytes_by_phase"][phase]
            err = (measured - predicted.peak.by_phase()[phase]) / measured
            assert abs(err) <= MARGIN, (row["rank"], phase, err)
        bites = {"forward": ("block 1 copy-out", "all-gather output (root, the root's, freed when this copy-out returns)"),
                 "backward": ("root reduce-scatter", "unsharded gradient of the last parameter (root, foreach_reduce's loop variable)")}
        for phase, (moment, term) in bites.items():  # each is larger than the bound: dropping it fails above
            (at,) = (p for p in predicted.peak.phases if p.phase == phase)
            (held,) = (t for t in at.terms if t.name == term)
            assert at.moment == moment and held.bytes > 2 * MARGIN * row["peak_bytes_by_phase"][phase]
        # model states exact: what is live after the last backward is the states plus the rotary embedding's
        # two fp32 buffers of head_dim / 2 = 12 (engines/fsdp2/hf_tree.py rotary_buffers): 96 B
        assert row["readings_bytes"]["after_backward"][-1] - predicted.model_states_bytes == 2 * 12 * 4
        assert row["parity"]["grad_rel_diff"] < 1e-5  # a real training step: gradients equal one process's


def _workload(transformers: bool, config: str = "tiny-llama.json") -> Workload:
    spec = spec_from_hf_config(json.loads((DATA / config).read_text()))
    return Workload(transformer_shapes(spec), spec, 16, 2, transformers=transformers)


def _terms(workload: Workload, settings: Settings) -> set[str]:
    """Every term of every moment the profile lists for ``workload`` at N_d = 2."""
    return {t.name for m in moments(fsdp2_run(workload, 2, settings)) for t in m.terms}


def test_validator_tree_is_unchanged_by_the_transformers_switches():
    # the validator's CausalLM (transformers=False): loss_in_forward is not read, no hf_tree term appears
    s = Settings(device="cpu", backend="gloo", param_dtype="bf16", init="materialized")
    off = s.model_copy(update={"loss_in_forward": False})
    assert estimate(_workload(False), 2, s) == estimate(_workload(False), 2, off)
    assert not {n for n in _terms(_workload(False), s) if n.startswith(HF_TERMS)}


def test_transformers_tree_terms_follow_labels_and_tying():
    s = Settings(device="cpu", backend="gloo", param_dtype="bf16", init="materialized")
    off = s.model_copy(update={"loss_in_forward": False})
    untied = _workload(True)  # tiny-llama: untied head, RoPE
    # the head's gradient at the root's reduce-scatter, whatever computes the loss; rotary buffers throughout
    for settings in (s, off):
        found = _terms(untied, settings)
        assert {"unsharded gradient of the last parameter (root, foreach_reduce's loop variable)",
                "rotary inv_freq, original_inv_freq (fp32 buffers)", "position ids (cache_position, int64)"} <= found
    # the loss inside the root's forward: the last block's all-gather output and the bf16 logits through it
    assert {n for n in _terms(untied, s) if "after the loss" in n or n.startswith("16-bit logits")}
    assert not {n for n in _terms(untied, off) if "after the loss" in n or n.startswith("16-bit logits")}
    loss = {k: next(m.total() for m in moments(fsdp2_run(untied, 2, v)) if m.name == "cross-entropy")
            for k, v in (("labels", s), ("outside", off))}  # fmt: skip
    block = 2 * sum(a * b for name, (a, *rest) in untied.shapes if name.startswith("model.layers.1.")
                    for b in [rest[0] if rest else 1])  # the last block, gathered in bf16
    logits = 2 * 2 * 16 * untied.spec.vocab_size  # micro-batch 2 x 16 tokens x vocab, bf16
    assert loss["labels"] - loss["outside"] == block + logits
    tied = _terms(_workload(True, "tiny-qwen2.json"), s)
    assert "lm_head weight before tie_weights" in tied
    assert not {n for n in tied if n.startswith("lm_head weight gradient")}


def test_validator_settings_refuse_what_hf_builder_cannot_run():
    pytest.importorskip("torch")
    from validate.engines.fsdp2 import Fsdp2Settings

    with pytest.raises(ValueError, match="hf=True"):
        Fsdp2Settings(model=str(DATA / "tiny-qwen2.json"), hf=True, params=1e6)
    with pytest.raises(ValueError, match="labels=False"):
        Fsdp2Settings(labels=False)


def test_validate_command_takes_meta_init_and_checkpointing_with_hf():
    """``zeroplan validate --engine fsdp2 --hf`` runs meta init and checkpointing (the runner builds both:
    validate/engines/fsdp2.py); only ``--params`` is refused with ``--hf``, in one line."""
    from validate.config import ValidateConfig

    model = str(DATA / "tiny-qwen2.json")
    for extra in ({"fsdp2_init": "meta"}, {"checkpointing": "full"}):
        assert ValidateConfig(engine="fsdp2", hf=True, model=model, world_sizes=[2], **extra).hf
    with pytest.raises(ValueError, match="--hf: a config.json --model, not --params"):
        ValidateConfig(engine="fsdp2", hf=True, params=1e6, world_sizes=[2])


def test_decoder_layers_are_transformers_own(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from validate.engines.fsdp2 import Fsdp2Settings
    from validate.engines.fsdp2_hf import build_model, decoder_layers
    from validate.models import spec_for

    settings = Fsdp2Settings(model=str(DATA / "tiny-qwen2.json"), hf=True, labels=False)
    spec = spec_for(settings.model, None)
    model = build_model(spec, settings, "cpu")
    layers = decoder_layers(model, spec)
    assert layers is model.model.layers and len(layers) == spec.n_layer
    tokens = torch.randint(0, spec.vocab_size, (1, 8))
    loss = model.loss((tokens, tokens.roll(-1, 1)))
    assert loss.ndim == 0 and loss.requires_grad
