"""The peak model: the walker's arithmetic, activations against what autograd saves, and the reference
runtime's peak per phase against the validator's measurement (MemTracker, exact live bytes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.suite_slices import ci_slice
from background import validate_json
from zeroplan.architectures.spec import TransformerSpec
from zeroplan.engines.reference import predict_peak, reference_run
from zeroplan.formulas.activation_terms import model_activations
from zeroplan.formulas.peak import PHASES, Moment, Term, peak_of


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


def held_after_forward(spec: TransformerSpec, b: int, s: int, ckpt: str) -> int:
    """The validator's probe (MemTracker: every live tensor byte) around one forward of CausalLM: bytes
    alive once the loss exists, less the loss itself (4 B). Unlike saved-tensor hooks this also sees what
    a checkpoint holds as its inputs (RoPE's cos and sin, the sliding-window mask)."""
    from validate.models import build, make_batch
    from validate.probes import MemoryProbe

    batch = make_batch(spec, b, torch.Generator().manual_seed(0), s)
    probe = MemoryProbe(torch.device("cpu"))
    with probe:
        model = build(spec, torch.bfloat16, "cpu", checkpointing=ckpt)
        batch = tuple(t.clone() for t in batch)  # the batch is the runtime's (counted apart)
        before = probe.current_bytes()
        loss = model.loss(batch)
        after = probe.current_bytes()
        del loss
    return after - before - 4


HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"
# GPT-2 (gelu_new, tied; exact gelu, untied, n_inner), Llama (GQA; tied with biases and head_dim != d/h),
# Mistral (sliding window shorter than the sequence: mask, repeated k/v), Qwen2 (q/k/v biases, tied)
FAMILY_CONFIGS = ["tiny-gpt2", "tiny-gpt2-untied", "tiny-llama", "tiny-llama-tied-bias", "tiny-mistral", "tiny-qwen2"]


@pytest.mark.parametrize("name", ["gpt-tiny", *FAMILY_CONFIGS])
@pytest.mark.parametrize(("b", "s"), [(2, 8), (3, 16)])
@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_saved_activations_of_one_micro_batch_match_the_probe(name, b, s, ckpt):
    """Activations alone, per family: predicted bytes held after one forward vs the probe's measurement.
    Slack: none (every storage is derived op by op); the issue's bound is 2%."""
    from validate.models import spec_for

    spec = spec_for(name if name == "gpt-tiny" else str(HF_CONFIGS / f"{name}.json"), None)
    measured = held_after_forward(spec, b, s, ckpt)
    predicted = model_activations(spec, b, s).saved_total(ckpt)
    assert measured == pytest.approx(predicted, rel=0.02)
    assert measured == predicted


@pytest.mark.parametrize("name", ["gpt-tiny", "tiny-gpt2", "tiny-llama", "tiny-mistral"])
def test_saved_activations_match_autograd_saved_tensors(name):
    """Second observer without checkpointing: autograd's own saved tensors (saved_tensors_hooks)."""
    from validate.models import build, make_batch, spec_for

    spec = spec_for(name if name == "gpt-tiny" else str(HF_CONFIGS / f"{name}.json"), None)
    model = build(spec, torch.bfloat16, "cpu")
    batch = make_batch(spec, 2, torch.Generator().manual_seed(0), 8)
    measured = saved_bytes(lambda: model.loss(batch), model.parameters()) - sum(
        t.numel() * t.element_size() for t in batch
    )
    assert measured == model_activations(spec, 2, 8).saved_total("none")


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


# The CI matrix of issue 8, as a covering set of four validator runs (one invocation runs many stages
# and world sizes; each has one model, checkpointing mode and sequence length):
#
# | run            | model (family)           | mode      | N_d     | stages  | ckpt | seq |
# |----------------|--------------------------|-----------|---------|---------|------|-----|
# | gpt2_real      | tiny-gpt2.json (GPT-2)   | real gloo | 2, 4    | 0, 2, 3 | none | 16  |
# | llama_real     | tiny-llama.json (Llama)  | real gloo | 3       | 0, 2, 3 | full | 8   |
# | llama_sim      | tiny-llama.json (Llama)  | simulated | 8, 64   | 0-3     | none | 16  |  (CI: N_d = 64)
# | gpt2_sim       | tiny-gpt2.json (GPT-2)   | simulated | 8, 64   | 0-3     | full | 8   |  (CI: N_d = 8)
#
# Each family meets both checkpointing modes, both sequence lengths, real and simulated groups; every
# N_d of the issue and every stage runs. Stage 1 runs simulated only: on real gloo its backward peak
# depends on when gloo's worker thread drops a reduce-scatter's input copy (ProcessGroupGloo.cpp:
# reduce_scatter_tensor_coalesced clones the whole input, all-reduces it and copies this rank's chunk;
# the clone is made inside the c10d op, unseen by dispatch-level probes until wait() chunks it, and
# freed when gloo's work object goes, at a time of gloo's own): measured +1.6% (tiny-llama, N_d = 2)
# to +3.6% (gpt-tiny, N_d = 3) above the prediction (docs/peak.md).


# CI runs each simulated N_d once (tests/suite_slices.py; both with ZEROPLAN_FULL_MATRICES=1): 64 for Llama,
# 8 for GPT-2, so every N_d, stage, family and checkpointing mode still runs (the two simulated runs took
# 494 of the module's 903 s on 2 loaded cores, 2026-12-01; 271 s after). The real runs stay whole: a world
# of 4 ranks costs its start-up whatever its rows; dropping N_d = 2 from gpt2_real saved nothing measurable.
SIZES = {"gpt2_real": [2, 4], "llama_real": [3], "llama_sim": ci_slice([8, 64], [64]),
         "gpt2_sim": ci_slice([8, 64], [8])}  # fmt: skip


def world_sizes(run: str) -> list[str]:
    return [a for n in SIZES[run] for a in ("--world-size", str(n))]


# each run is one of the session's background jobs (tests/background.py: started at collection, niced, while the
# other tests run; this module runs last): ``zeroplan validate ARGS --json FILE``
BACKGROUND_CLI = {
    "gpt2_real": ["--model", str(HF_CONFIGS / "tiny-gpt2.json"), *world_sizes("gpt2_real"), "--stage", "0",
                  "--stage", "2", "--stage", "3", "--seq-len", "16", "--steps", "2"],
    "llama_real": ["--model", str(HF_CONFIGS / "tiny-llama.json"), "--world-size", "3", "--stage", "0", "--stage", "2",
                   "--stage", "3", "--checkpointing", "full", "--seq-len", "8", "--steps", "2"],
    "llama_sim": ["--model", str(HF_CONFIGS / "tiny-llama.json"), "--simulated", *world_sizes("llama_sim"),
                  "--seq-len", "16", "--steps", "2", "--foreach"],
    "gpt2_sim": ["--model", str(HF_CONFIGS / "tiny-gpt2.json"), "--simulated", *world_sizes("gpt2_sim"),
                 "--checkpointing", "full", "--seq-len", "8", "--steps", "2"],
}  # fmt: skip


def check_peak_row(row: dict) -> None:
    pred, meas = row["predicted_peak_bytes_by_phase"], row["measured_peak_bytes_by_phase"]
    assert set(pred) == set(meas) == set(PHASES)
    for phase in PHASES:  # both bounds: within 2% of the measurement, above or below
        assert abs(meas[phase] - pred[phase]) <= 0.02 * meas[phase], (row["stage"], phase, pred, meas)
    assert abs(row["peak_rel_error"]) <= 0.02 and row["checks"]["peak_within_tolerance"] is True
    assert abs(row["model_states_rel_error"]) <= 0.01 and row["checks"]["model_states_within_tolerance"] is True
    assert row["checks"]["collectives_match"] is True  # elements per collective, phase and dtype: exact


MATRIX = {  # run -> (N_d, stages, checkpointing, seq)
    "gpt2_real": (set(SIZES["gpt2_real"]), {0, 2, 3}, "none", 16),
    "llama_real": (set(SIZES["llama_real"]), {0, 2, 3}, "full", 8),
    "llama_sim": (set(SIZES["llama_sim"]), {0, 1, 2, 3}, "none", 16),
    "gpt2_sim": (set(SIZES["gpt2_sim"]), {0, 1, 2, 3}, "full", 8),
}


@pytest.mark.parametrize("run", [pytest.param(r, marks=pytest.mark.distributed) if r.endswith("real") else r
                                 for r in MATRIX])  # fmt: skip
def test_reference_peak_per_phase_matrix(run, request):
    report = validate_json(request.getfixturevalue("background"), request.module, run)[1]
    sizes, stages, ckpt, seq = MATRIX[run]
    assert {(r["world_size"], r["stage"]) for r in report["rows"]} == {(n, s) for n in sizes for s in stages}
    for row in report["rows"]:
        check_peak_row(row)
        # derived op by op: every phase equal to the byte here (the 2% bound above is the issue's)
        assert row["predicted_peak_bytes_by_phase"] == row["measured_peak_bytes_by_phase"], row["stage"]
        assert (row["checkpointing"], row["seq_len"]) == (ckpt, seq)
        assert row["mode"] == ("real" if run.endswith("real") else "simulated")
        if row["mode"] == "real":
            assert row["foreach"] is False and row["checks"]["parity"] is True  # torch's choice on CPU


def test_activations_dominate_at_100m_scale_and_the_loss_phase_is_named():
    # GPT-2 small as its config.json has it (activation_function gelu_new, transformers' Python tanh GELU)
    spec = TransformerSpec(n_layer=12, d_model=768, n_head=12, vocab_size=50304, max_seq_len=1024)
    est = predict_peak(reference_run(spec, 8, 3, 4, 1024))
    # b = 4, s = 1024, stage 3 at N_d = 8: the blocks' saved activations lead (gelu_new keeps four N·f
    # per block besides its output), then the loss backward's two fp32 N·V gradients (4·1024·50304·4·2 B)
    assert est.peak_phase == "backward"
    names = [t.name for t in est.peak_terms]
    assert names[:3] == ["saved activations of 12 blocks", "nll and log-softmax gradients (fp32)",
                         "log-softmax (fp32, saved by cross-entropy)"]  # fmt: skip
    n = 4 * 1024
    assert est.peak_terms[0].bytes == 12 * (n * 2 * (8 * 768 + 5 * 3072) + 4 * n * 2 + 4 * 12 * 1024 * 4)
    assert est.peak_terms[1].bytes == 4 * 1024 * 50304 * 4 * 2


def test_reference_engine_sizes_its_units_from_the_workloads_shapes():
    # the units are the parameters as built (Workload.shapes: the model's named_parameters()), not the
    # architecture's own shapes: a vocabulary padded by 13 rows moves every term that holds the root unit
    from zeroplan.architectures.spec import transformer_shapes
    from zeroplan.engines.base import Workload
    from zeroplan.engines.reference import Settings, estimate

    spec = TransformerSpec(style="llama", n_layer=2, d_model=48, n_head=6, n_kv_head=2, ffn_hidden=88, vocab_size=103,
                           max_seq_len=32)  # fmt: skip
    shapes = transformer_shapes(spec)
    padded = tuple((n, (s[0] + 13, *s[1:]) if n == "model.embed_tokens.weight" else s) for n, s in shapes)
    settings = Settings(stages=(0,), block_bytes=1, cuda_capability=None)
    (plain,) = estimate(Workload(shapes, spec, 16, 2), 2, settings)
    (built,) = estimate(Workload(padded, spec, 16, 2), 2, settings)

    def params16(row):
        (phase,) = (p for p in row.peak.phases if p.phase == "optimizer_step")
        return next(t.bytes for t in phase.terms if t.name == "16-bit parameters")

    assert params16(plain) == 2 * sum(math.prod(s) for _, s in shapes)
    assert params16(built) == 2 * sum(math.prod(s) for _, s in padded) == params16(plain) + 2 * 13 * 48
    assert built.memory.params_bytes == params16(built)  # states and peak from the same tensors
