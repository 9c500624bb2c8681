"""The peak model: the walker's arithmetic, activations against what autograd saves, and the reference
runtime's peak per phase against the validator's measurement (MemTracker, exact live bytes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from zeroplan.engines.reference import predict_peak, reference_run
from zeroplan.formulas.activation_terms import model_activations
from zeroplan.formulas.peak import PHASES, Moment, Term, peak_of
from zeroplan.architectures.spec import TransformerSpec


def _moments(extra: int = 0) -> list[Moment]:
    return [Moment(p, f"{p} a", (Term("x", 1000, "s"), Term("y", 10 * i + extra, "s", 2))) for i, p in enumerate(PHASES)]


def test_peak_is_the_largest_moment_per_phase_with_its_terms_named():
    moments = [*_moments(), Moment("backward", "bigger", (Term("z", 5000, "src"),))]
    est = peak_of(moments)
    assert est.by_phase() == {"init": 1000, "forward": 1010, "backward": 5000, "optimizer_step": 1030}
    assert (est.peak_phase, est.peak_bytes) == ("backward", 5000)
    assert [t.name for t in est.peak_terms] == ["z"]


def test_cuda_rounding_is_per_tensor_and_overhead_is_a_separate_term():
    est = peak_of(_moments(extra=1), block_bytes=512, allocator_overhead_bytes=7)
    # init: 1000 -> 1024; y = 1 byte in 2 tensors -> 2 x 512
    assert est.by_phase()["init"] == 1024 + 2 * 512 + 7
    assert any(t.name.startswith("allocator overhead") and t.bytes == 7 for t in est.phases[0].terms)


def test_a_profile_missing_a_phase_is_refused():
    with pytest.raises(ValueError, match="optimizer_step"):
        peak_of(_moments()[:3])


# --- activations: predicted vs what autograd saves -----------------------------------------------


def saved_bytes(loss_fn, params) -> int:
    """Bytes of distinct non-parameter storages autograd saves during ``loss_fn()`` (the batch excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    owned = {p.untyped_storage().data_ptr() for p in params}
    del loss
    return sum(n for ptr, n in seen.items() if ptr not in owned)


GPT_CASES = [  # (spec, micro-batch, seq): the validator's model; odd sizes on purpose
    (TransformerSpec(n_layer=2, d_model=36, n_head=3, vocab_size=101, max_seq_len=16), 2, 16),
    (TransformerSpec(n_layer=3, d_model=64, n_head=4, vocab_size=211, max_seq_len=64), 3, 40),
]


@pytest.mark.parametrize(("spec", "b", "s"), GPT_CASES)
@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_gpt_saved_activations_match_autograd(spec, b, s, ckpt):
    from validate.models import build, make_batch

    model = build(spec, torch.bfloat16, "cpu", checkpointing=ckpt)
    batch = make_batch(spec, b, torch.Generator().manual_seed(0), s)
    measured = saved_bytes(lambda: model.loss(batch), model.parameters()) - sum(
        t.numel() * t.element_size() for t in batch
    )
    predicted = model_activations(spec, b, s).saved_total(ckpt)
    # slack: none needed; the derivation counts every saved storage (2% is the bound)
    assert measured == pytest.approx(predicted, rel=0.02)
    assert measured == predicted


LLAMA_CONFIGS = {  # transformers families built on CPU from a config (no download), dropout 0, SDPA
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}


@pytest.mark.parametrize("family", sorted(LLAMA_CONFIGS))
def test_llama_family_saved_activations_match_transformers(family):
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, extra = LLAMA_CONFIGS[family]
    d, heads, kv_heads, f, v, layers, b, s = 64, 4, 2, 176, 211, 2, 2, 24
    config = getattr(transformers, config_cls)(
        hidden_size=d, num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=f,
        vocab_size=v, num_hidden_layers=layers, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation="sdpa", torch_dtype="bfloat16", **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16).train()
    ids = torch.randint(0, v, (b, s))
    measured = saved_bytes(lambda: model(input_ids=ids, labels=ids).loss, model.parameters())
    spec = TransformerSpec(layers, d, heads, v, 64, ffn_hidden=f, n_kv_head=kv_heads, style="llama")
    predicted = model_activations(spec, b, s).saved_total("none")
    # slack 2%: transformers also saves the int64 labels it shifts and pads (b·s·8) and a few scalars
    assert measured == pytest.approx(predicted, rel=0.02)


# --- the reference runtime: predicted vs measured peak per phase --------------------------------


def validate_json(tmp_path_factory, *args: str) -> dict:
    out = tmp_path_factory.mktemp("peak") / "result.json"
    cmd = [sys.executable, "-c", "from zeroplan.cli import main; main()", "validate", *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def real_n3(tmp_path_factory):
    """gloo, N_d = 3 (every tensor padded), a second sequence length (8), torch's default Adam path."""
    return validate_json(tmp_path_factory, "--world-size", "3", "--seq-len", "8", "--steps", "2",
                         "--stage", "0", "--stage", "2", "--stage", "3")  # fmt: skip


@pytest.fixture(scope="module")
def simulated_ckpt(tmp_path_factory):
    """Fake group and tensors, N_d = 8 and 64, full checkpointing, foreach Adam."""
    return validate_json(tmp_path_factory, "--simulated", "--world-size", "8", "--world-size", "64",
                         "--checkpointing", "full", "--foreach", "--seq-len", "8", "--steps", "2")  # fmt: skip


def check_peak_row(row: dict) -> None:
    pred, meas = row["predicted_peak_bytes_by_phase"], row["measured_peak_bytes_by_phase"]
    assert set(pred) == set(meas) == set(PHASES)
    for phase in PHASES:  # both bounds: within 2% of the measurement, above or below
        assert abs(meas[phase] - pred[phase]) <= 0.02 * meas[phase], (row["stage"], phase, pred, meas)
    assert abs(row["peak_rel_error"]) <= 0.02 and row["checks"]["peak_within_tolerance"] is True
    assert row["checks"]["comm_exact"] is True and row["checks"]["model_states_within_tolerance"] is True


@pytest.mark.distributed
def test_reference_peak_per_phase_real_gloo_n3(real_n3):
    # stage 1 is left out on real gloo: gloo stages each reduce-scatter through a full-size flat copy
    # that its worker thread frees at a time of its own, so stage 1's backward peak varies run to run
    # (measured: +3.6% at N_d = 3, exact at N_d = 2 and 4); simulated stage 1 is exact (below)
    assert [r["stage"] for r in real_n3["rows"]] == [0, 2, 3]
    for row in real_n3["rows"]:
        check_peak_row(row)
        assert row["foreach"] is False  # torch's choice on CPU: the per-tensor loop


def test_reference_peak_per_phase_simulated_with_checkpointing(simulated_ckpt):
    assert {(r["world_size"], r["stage"]) for r in simulated_ckpt["rows"]} == {(n, s) for n in (8, 64) for s in range(4)}
    for row in simulated_ckpt["rows"]:
        check_peak_row(row)
        assert row["checkpointing"] == "full" and row["foreach"] is True


def test_activations_dominate_at_100m_scale_and_the_loss_phase_is_named():
    spec = TransformerSpec(n_layer=12, d_model=768, n_head=12, vocab_size=50304, max_seq_len=1024)
    est = predict_peak(reference_run(spec, 8, 3, 4, 1024))
    # GPT-2 small, b = 4, s = 1024, stage 3 at N_d = 8: the loss backward's two fp32 N·V gradients
    # (4·1024·50304·4·2 B) lead, then the blocks' 32·sbh + stats + logsumexp each
    assert est.peak_phase == "backward"
    names = [t.name for t in est.peak_terms]
    assert names[:3] == ["nll and log-softmax gradients (fp32)", "saved activations of 12 blocks",
                         "log-softmax (fp32, saved by cross-entropy)"]  # fmt: skip
    assert est.peak_terms[0].bytes == 4 * 1024 * 50304 * 4 * 2
    n = 4 * 1024
    assert est.peak_terms[1].bytes == 12 * (n * 2 * (8 * 768 + 2 * 3072) + 4 * n * 2 + 4 * 12 * 1024 * 4)
