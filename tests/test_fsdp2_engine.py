"""FSDP2 as an engine: ``zeroplan validate --engine fsdp2`` rows, prediction (``zeroplan/engines/fsdp2/``)
against real ``fully_shard`` under the shared probes, on every axis of issue 10.

Real gloo ranks (torchrun) at N_d = 2 and 4 cover reshard on/off, fp32 and bf16 mixed precision (reduce
fp32), and activation checkpointing on/off: four runs, an orthogonal array, so every pair of settings
meets once (one also runs Adam's foreach path). Added: the default policy (bf16 reduce), the int
``reshard_after_forward=2`` (real at N_d = 4, simulated at 8 and 64), and tiny-llama in fp32 and in bf16
with checkpointing. Simulated (fake process group) at N_d = 8, 64, 512 with real
tensors (gpt-tiny; tiny-llama at 8), and a 7B-class Llama
(llama-2-7b's config.json) at N_d = 64 with FakeTensorMode, whose init and optimizer_step peaks are
reported but not checked (``validate/engines/fsdp2.py:FAKE_TENSOR_PHASES``): the test asserts they are
over-reads, so the artifact is stated, never hidden.

Bounds: every checked phase's peak within its recorded error + max(64 B, 0.05%) both ways
(``tests/data/measured/fsdp2.json``, ``tests/test_measured_rows.py``; issue 16: 3% before, so that a dropped
term fails), model states within 1%; model states and collectives are in fact exact (asserted).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clicheck import assert_one_line_error
from tests.suite_slices import ci_slice
from tests.test_measured_rows import live_peak_misses
from zeroplan.engines.base import Workload
from zeroplan.engines.fsdp2 import (
    Settings,
    estimate,
    local_shard_numel,
    padded_shard_numel,
    settings_snippet,
    shard_rows,
    unit_collectives,
    units_of,
)

DATA = Path(__file__).resolve().parent / "data" / "hf_configs"
STATES_BOUND = 0.01
LLAMA_4_LAYERS = "tiny-llama.json with num_hidden_layers = 4"  # written by the fixture (not a file in hf_configs,
# whose every file tests/test_architectures.py checks)

RUNS = {
    # name: ValidateConfig fields (engine fsdp2, 2 steps, gpt-tiny unless said)
    "real-2-fp32-reshard": dict(world_sizes=(2,), param_dtype="fp32"),
    "real-2-bf16-keep-ckpt": dict(world_sizes=(2,), param_dtype="bf16", reduce_dtype="fp32",
                                  reshard_after_forward=False, checkpointing="full", foreach=True),
    "real-4-bf16-reshard-ckpt": dict(world_sizes=(4,), param_dtype="bf16", reduce_dtype="fp32", checkpointing="full"),
    "real-4-fp32-keep-meta": dict(world_sizes=(4,), param_dtype="fp32", reshard_after_forward=False, fsdp2_init="meta"),
    # `zeroplan validate --engine fsdp2`'s default policy: bf16 params and bf16 reduce (the cast of the
    # reduce-scatter output to fp32 comes after gloo's copy is gone: docs/engines/fsdp2.md)
    "real-2-bf16-default": dict(world_sizes=(2,), param_dtype="bf16"),
    # FSDP2's int reshard_after_forward: blocks kept sharded over 2 of the 4 ranks between forward and backward
    "real-4-bf16-k2": dict(world_sizes=(4,), param_dtype="bf16", reshard_after_forward=2),
    "sim-8-64-bf16-k2": dict(simulated=True, fake_tensors=False, world_sizes=(8, 64), param_dtype="bf16",
                             reduce_dtype="fp32", reshard_after_forward=2),
    # Llama layout (RMSNorm, RoPE, GQA, SwiGLU) on real gloo: fp32 (the RMSNorm upcast is its input: forward
    # was -2.7%) and bf16 with checkpointing (the recomputed block's saved set: backward was +1.0%); fp32 with
    # checkpointing and bf16 without were exact before and are in docs/engines/fsdp2.md (suite time)
    "real-2-tiny-llama-fp32-meta": dict(world_sizes=(2,), model=str(DATA / "tiny-llama.json"), param_dtype="fp32",
                                        fsdp2_init="meta"),
    "real-2-tiny-llama-bf16-ckpt": dict(world_sizes=(2,), model=str(DATA / "tiny-llama.json"), param_dtype="bf16",
                                        checkpointing="full"),
    "sim-8-64-512-bf16": dict(simulated=True, fake_tensors=False, world_sizes=(8, 64, 512), param_dtype="bf16",
                              reduce_dtype="fp32"),
    "sim-8-tiny-llama-bf16": dict(simulated=True, fake_tensors=False, world_sizes=(8,),
                                  model=str(DATA / "tiny-llama.json"), param_dtype="bf16", reduce_dtype="fp32"),
    # four Llama layers: the start of backward (final RMSNorm backward beside the prefetched last block) peaks
    "sim-8-tiny-llama-4-layers-k2": dict(simulated=True, fake_tensors=False, world_sizes=(8,), model=LLAMA_4_LAYERS,
                                         param_dtype="bf16", reshard_after_forward=2),
    "sim-64-llama-7b-fake": dict(simulated=True, world_sizes=(64,), model=str(DATA / "llama-2-7b.json"),
                                 param_dtype="bf16", reduce_dtype="fp32", batch_per_rank=1, seq_len=256),
}  # fmt: skip


# CI runs a covering slice (tests/suite_slices.py; all runs with ZEROPLAN_FULL_MATRICES=1): every setting
# above still runs live. Left out: the default policy at N_d = 2 (bf16 reduce runs live in real-4-bf16-k2)
# and the int reshard at simulated N_d = 8 and 64 (real at 4 in real-4-bf16-k2, simulated at 8 in
# sim-8-tiny-llama-4-layers-k2); both stay checked against their recorded rows (tests/test_measured_rows.py).
CI_RUNS = ci_slice(list(RUNS), [n for n in RUNS if n not in ("real-2-bf16-default", "sim-8-64-bf16-k2")])


def _validate_configs(scratch: Path) -> dict:
    """``{run: ValidateConfig}`` of the CI runs; the four-layer Llama's config.json is written to ``scratch``."""
    import json

    from validate.config import ValidateConfig

    configs = {}
    for name in CI_RUNS:
        fields = dict(RUNS[name])
        if fields.get("model") == LLAMA_4_LAYERS:
            path = scratch / "tiny-llama-4-layers.json"
            path.write_text(json.dumps({**json.loads((DATA / "tiny-llama.json").read_text()), "num_hidden_layers": 4}))
            fields["model"] = str(path)
        configs[name] = ValidateConfig(engine="fsdp2", steps=2, device="cpu", **fields)
    return configs


# every run is one of the session's background jobs (tests/background.py): started at collection, niced, while
# the other tests run; this module runs last
BACKGROUND_VALIDATE = _validate_configs


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.distributed) for n in CI_RUNS])
def report(request, background):
    """``zeroplan validate``'s report of the run (``validate.api.run_validation``), from the background job."""
    from background import key, validate_job

    config = _validate_configs(background.dir)[request.param]
    return request.param, background.result(key(request.module, request.param), validate_job(config))


def test_every_row_within_bounds(report):
    name, rep = report
    assert len(rep["rows"]) == len(RUNS[name]["world_sizes"])
    for row in rep["rows"]:
        assert row["engine"] == "fsdp2"
        unchecked = row["peak_unchecked_phases"] or {}
        # every checked phase at this row's recorded error + max(64 B, 0.05%) (tests/test_measured_rows.py)
        assert live_peak_misses(f"fsdp2-{name}-nd{row['world_size']}", row["measured_peak_bytes_by_phase"],
                                row["predicted_peak_bytes_by_phase"], unchecked) == []  # fmt: skip
        assert -STATES_BOUND <= row["model_states_rel_error"] <= STATES_BOUND
        assert row["checks"]["model_states_steady"] and row["checks"]["collectives_match"]
        assert row["ok"], row["checks"]
    assert rep["ok"]


def test_states_and_collectives_exact(report):
    name, rep = report
    k = RUNS[name].get("reshard_after_forward")
    for row in rep["rows"]:
        # rank 0's parameters + gradients + Adam, byte for byte; an int k < N_d adds the post-forward mesh's
        # int32 rank tensor, a term of the profile (engines.fsdp2.mesh_ranks) put on the prediction side, read
        # from the predicted row (never subtracted from the measurement)
        mesh = 4 * row["world_size"] if type(k) is int and 1 < k < row["world_size"] else 0
        assert sum(t["bytes"] for t in row["predicted_beside_states_terms"] or []) == mesh
        assert row["model_states_extra_bytes"] == 0 and row["model_states_rel_error"] == 0
        assert row["measured_collective_elements"] == row["predicted_collective_elements"]
        # the ring rule on each observed call, over the group it ran on (k ranks for the backward all-gathers)
        assert row["derived_comm_bytes_per_rank"] == row["predicted_comm_bytes_per_rank"]


def test_fake_tensor_phases_are_over_reads_and_say_why(report):
    name, rep = report
    for row in rep["rows"]:
        unchecked = row["peak_unchecked_phases"]
        if not name.endswith("-fake"):
            assert unchecked is None  # real tensors: every phase is checked
            continue
        assert set(unchecked) == {"init", "optimizer_step"} and all("FakeTensorMode" in v for v in unchecked.values())
        for phase in unchecked:  # the artifact only adds: a prediction above the reading would be a miss
            assert row["measured_peak_bytes_by_phase"][phase] > row["predicted_peak_bytes_by_phase"][phase]


def test_parity_on_real_fp32(report):
    name, rep = report
    for row in rep["rows"]:
        if row["mode"] == "real" and "fp32" in name:
            assert row["parity"]["ok"] and row["parity"]["grad_rel_diff"] <= row["parity"]["grad_rtol"]
        elif row["mode"] == "simulated":
            assert row["parity"] is None


# ---- pure: no ranks ----


def test_dim0_padding_rule():
    # wte of gpt-tiny at nd = 8: ceil(101 / 8) = 13 rows of 36 on every rank, rank 7 holds 101 - 91 = 10
    assert shard_rows(101, 8) == 13
    assert padded_shard_numel((101, 36), 8) == 13 * 36
    assert [local_shard_numel((101, 36), 8, r) for r in (0, 6, 7)] == [13 * 36, 13 * 36, 10 * 36]
    assert padded_shard_numel((3,), 4) == 1 and local_shard_numel((3,), 4, 3) == 0
    with pytest.raises(ValueError, match="nd=0"):
        shard_rows(5, 0)


def _gpt_tiny_workload(**kw) -> Workload:
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.architectures.spec import transformer_shapes

    spec = spec_from_hf_config({"model_type": "gpt2", "activation_function": "gelu", "n_layer": 2, "n_embd": 36,
                                "n_head": 3, "vocab_size": 101, "n_positions": 16}, "test")  # fmt: skip
    return Workload(transformer_shapes(spec), spec, 16, 2, **kw)


def test_gpt_tiny_closed_form():
    # measured in docs/engines/fsdp2.md: gloo N_d = 2, fp32: after backward 290,992 B; peaks 177,336 / 522,816 /
    # 572,360 / 312,016 B (init / forward / backward / optimizer); every collective 4,320 / 16,020 elements
    (row,) = estimate(_gpt_tiny_workload(), 2, Settings(device="cpu", backend="gloo", init="materialized"))
    assert row.model_states_bytes == 290_992
    assert row.peak.by_phase() == {"init": 177_336, "forward": 522_816, "backward": 572_360, "optimizer_step": 312_016}
    # meta-device init (the default): only the shards, 36,324 elements / 2 ranks, fp32 (measured 72,720 B on
    # rank 0 with `zeroplan validate --engine fsdp2 --init meta --world-size 2`)
    (meta,) = estimate(_gpt_tiny_workload(), 2, Settings(device="cpu", backend="gloo"))
    assert meta.peak.by_phase() == {**row.peak.by_phase(), "init": 72_720}
    assert [c.elements for c in row.collectives] == [4320, 16020, 16020, 16020, 16020, 16020, 16020, 4320]
    assert row.stage == 3 and row.engine == "fsdp2"


def test_measured_rows_closed_form():
    # measured (docs/engines/fsdp2.md), gpt-tiny, 2 steps, rank 0, gloo on CPU:
    # the default policy (bf16 params and reduce) at N_d = 2: backward was over-predicted by 16,020 B when
    # the cast of the reduce-scatter output was counted beside gloo's copy of the input
    (row,) = estimate(_gpt_tiny_workload(), 2, Settings(param_dtype="bf16", device="cpu", backend="gloo", init="materialized"))
    assert row.peak.by_phase() == {"init": 177_336, "forward": 371_248, "backward": 402_944, "optimizer_step": 312_016}
    # reshard_after_forward=2 at N_d = 4, fp32 (the post-forward mesh adds 16 B from init on)
    (row,) = estimate(_gpt_tiny_workload(), 4, Settings(reshard_after_forward=2, device="cpu", backend="gloo", init="materialized"))
    assert row.peak.by_phase() == {"init": 161_332, "forward": 449_320, "backward": 495_840, "optimizer_step": 156_368}


def test_reshard_and_policy_change_what_is_sent_and_kept():
    w = _gpt_tiny_workload()
    (keep,) = estimate(w, 4, Settings(reshard_after_forward=False, param_dtype="bf16", reduce_dtype="fp32", device="cpu"))
    (reshard,) = estimate(w, 4, Settings(param_dtype="bf16", reduce_dtype="fp32", device="cpu"))
    ops = lambda row: [(c.op, c.phase, c.dtype) for c in row.collectives]
    assert ops(keep) == [("all-gather", "forward", "bf16")] * 3 + [("reduce-scatter", "backward", "fp32")] * 3
    assert ops(reshard).count(("all-gather", "backward", "bf16")) == 2  # the blocks, never the root
    assert keep.stage == 2 and keep.peak.by_phase()["forward"] > reshard.peak.by_phase()["forward"]
    # no separate master copy: fp32 shards of parameters and gradients, Adam's m and v
    assert keep.memory == reshard.memory
    assert {c.group_size for c in unit_collectives(units_of(w.shapes, "transformer.h."), 4, Settings(
        reshard_after_forward=2)) if c.phase == "backward" and c.op == "all-gather"} == {2}  # fmt: skip
    with pytest.raises(ValueError, match="must divide"):
        estimate(w, 4, Settings(reshard_after_forward=3))


def test_no_architecture_no_peak():
    w = _gpt_tiny_workload()
    (row,) = estimate(Workload(w.shapes), 2, Settings())
    assert row.peak is None and row.model_states_bytes > 0


def test_settings_are_strict():
    with pytest.raises(ValueError):
        Settings(reshard_after_forward=0)
    with pytest.raises(ValueError):
        Settings(param_dtype="int8")
    with pytest.raises(ValueError):
        Settings(offload=True)
    code = settings_snippet(Settings(reshard_after_forward=False, param_dtype="bf16", reduce_dtype="fp32"))
    assert "reshard_after_forward=False" in code and "param_dtype=torch.bfloat16, reduce_dtype=torch.float32" in code


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engine", "fsdp2", "--stage", "3"], "FSDP2 has no stages"),
        (["--reduce-dtype", "fp32"], "--engine fsdp2 only"),
        (["--reshard-after-forward", "false"], "--engine fsdp2 only"),
        (["--reshard-after-forward", "2"], "--engine fsdp2 only"),
        (["--engine", "fsdp2", "--reshard-after-forward", "maybe"], "expected true, false or a whole number"),
        (["--engine", "fsdp2", "--reshard-after-forward", "0"], "expected true, false or a whole number of ranks >= 1"),
        (["--engine", "fsdp2", "--world-size", "4", "--reshard-after-forward", "3"], "must divide"),
        (["--engine", "fsdp2", "--param-dtype", "fp16"], "fp16"),
        (["--param-dtype", "fp32"], "reference runtime trains 16-bit"),
        (["--engine", "fsdp2", "--wire"], "--engine reference only"),
        (["--engine", "fsdp2", "--model", "mlp-tiny"], "transformers only"),
    ],
)
def test_validate_refuses_options_an_engine_would_ignore(args, message):
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from zeroplan.cli import app

    assert_one_line_error(CliRunner().invoke(app, ["validate", *args]), message)


def test_baseline_drift(report, tmp_path):
    import copy
    import json

    from validate.baseline import drift, read_baseline, with_drift

    _, rep = report
    path = tmp_path / "old.json"
    path.write_text(json.dumps(rep))
    old = read_baseline(str(path))  # a report reads back as a baseline (schema round trip)
    assert drift(rep, old) == [] and with_drift(rep, old, 0.005)["ok"] == rep["ok"]
    moved = copy.deepcopy(old)
    row = moved["rows"][0]
    row["measured_peak_bytes_by_phase"]["backward"] = int(row["measured_peak_bytes_by_phase"]["backward"] / 1.01)
    lines = drift(rep, moved, 0.005)
    assert len(lines) == 1 and "measured peak backward" in lines[0] and "+1.00%" in lines[0]
    assert drift(rep, moved, 0.02) == []
    assert not with_drift(rep, moved, 0.005)["ok"]
    gone = copy.deepcopy(old)
    gone["rows"][0]["world_size"] = 3
    assert drift(rep, gone)[0].endswith("in the baseline, not in this run")


def test_baseline_must_be_a_report(tmp_path):
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from zeroplan.cli import app

    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    result = CliRunner().invoke(app, ["validate", "--engine", "fsdp2", "--baseline", str(bad)])
    assert_one_line_error(result, "not a zeroplan validate --json report")


def test_recommend_by_predicted_peak():
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.architectures.spec import transformer_shapes
    from zeroplan.engines.fsdp2 import plan_options, recommend

    # GPT-2 small (tests/data/hf_configs/gpt2.json's dimensions), 8 x 1024 tokens per rank, N_d = 8
    spec = spec_from_hf_config({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                                "vocab_size": 50257, "n_positions": 1024}, "gpt2")  # fmt: skip
    w = Workload(transformer_shapes(spec), spec, 1024, 8)
    s = Settings(param_dtype="bf16", reduce_dtype="fp32")
    options = plan_options(w, 8, 10**12, s)
    peaks = [o.estimate.peak.peak_bytes for o in options]  # (keep, none), (reshard, none), (keep, full), (reshard, full)
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]  # at 12 layers, each step down cuts the peak
    assert recommend(w, 8, peaks[0], s) == options[0]  # everything fits: the cheapest, no extra work
    assert recommend(w, 8, peaks[0] - 1, s) == options[1]
    assert recommend(w, 8, peaks[2], s) == options[2]
    assert recommend(w, 8, peaks[3] - 1, s) is None
    best = recommend(w, 8, peaks[3], s)
    assert (best.settings.reshard_after_forward, best.checkpointing) == (True, "full")
    # the snippet is the predicted configuration
    assert "reshard_after_forward=True" in best.snippet and "checkpoint_wrapper(block)" in best.snippet
    assert "param_dtype=torch.bfloat16, reduce_dtype=torch.float32" in best.snippet


def test_snippet_runs_as_predicted(tmp_path):
    """The emitted code, run on a fake group of 4 with FakeTensorMode, builds what the estimate describes:
    the same units and reshard setting (checked through FSDP2's own state)."""
    torch = pytest.importorskip("torch")
    import subprocess
    import sys

    from zeroplan.engines.fsdp2 import recommend

    w = _gpt_tiny_workload()
    s = Settings(param_dtype="bf16", reduce_dtype="fp32", device="cpu")
    best = recommend(w, 4, 10**9, s)
    script = tmp_path / "snippet.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=4)\n"
        "from validate.models import build, PRESETS\n"
        "model = build(PRESETS['gpt-tiny'], torch.float32, 'meta')  # init='meta', as the snippet says\n"
        "model.layers, model.init_weights = model.blocks, model._init_weights\n"
        + best.snippet +
        "from torch.distributed.fsdp import FSDPModule\n"
        "units = [m for m in model.modules() if isinstance(m, FSDPModule)]\n"
        "print(len(units), sum(p.to_local().numel() for p in model.parameters()),\n"
        "      int(any(p.to_local().is_meta for p in model.parameters())))\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    units, numel, still_meta = map(int, done.stdout.split())
    assert not still_meta  # the snippet's to_empty gave every shard memory
    assert units == 3  # two blocks and the root, as the estimate's units
    assert numel * 4 == best.estimate.memory.params_bytes  # fp32 padded shards
    del torch


def test_world_size_one_is_refused_not_guessed():
    # FSDP2 at one rank skips its collectives (_fsdp_param_group.py: world_size == 1): not modelled
    with pytest.raises(ValueError, match="N_d = 1"):
        estimate(_gpt_tiny_workload(), 1, Settings(device="cpu"))
    from validate.config import ValidateConfig

    with pytest.raises(ValueError, match="world-size=1"):
        ValidateConfig(engine="fsdp2", world_sizes=(1,))


def test_collectives_count_one_optimizer_step_with_accumulation():
    # set_requires_gradient_sync(False) on all but the last micro-step (the snippet's accumulation): every
    # unit is gathered again in every micro-step (post_backward reshards whether or not it reduces), the
    # reduce-scatter runs once (_fsdp_param_group.py:FSDPParamGroup.post_backward)
    (one,) = estimate(_gpt_tiny_workload(), 2, Settings(device="cpu", backend="gloo"))
    (three,) = estimate(_gpt_tiny_workload(grad_accum=3), 2, Settings(device="cpu", backend="gloo"))
    assert [(c.op, c.phase) for c in three.collectives] == [(c.op, c.phase) for c in one.collectives]
    assert [c.micro_steps for c in three.collectives] == [3] * 5 + [1] * 3  # 3 forward + 2 backward gathers
    assert [c.elements for c in three.collectives] == [12960, 48060, 48060, 48060, 48060, 16020, 16020, 4320]
    assert [c.bytes_per_rank for c in three.collectives] == [
        3 * c.bytes_per_rank if c.op == "all-gather" else c.bytes_per_rank for c in one.collectives]


def test_beside_states_is_the_rows_own_field():
    # the post-forward mesh's int32 rank tensor (reshard_after_forward=k, 1 < k < N_d) lives beside the model
    # states between steps: the row says so itself, and the validator reads that field, not a term's name
    from validate.engines.fsdp2_compare import beside_states

    w = _gpt_tiny_workload()
    (k2,) = estimate(w, 4, Settings(reshard_after_forward=2, device="cpu", backend="gloo"))
    assert [(t.name, t.bytes, t.source) for t in k2.beside_states] == [
        ("post-forward mesh ranks (int32)", 16, "torch/distributed/fsdp/_fully_shard/_fsdp_init.py:_get_post_forward_mesh_info")]
    assert beside_states(k2) == k2.beside_states
    for rsf in (True, False, 4):  # k = N_d and the bools: no post-forward mesh
        assert estimate(w, 4, Settings(reshard_after_forward=rsf, device="cpu"))[0].beside_states == ()
    assert estimate(Workload(w.shapes), 4, Settings(reshard_after_forward=2))[0].beside_states == k2.beside_states
