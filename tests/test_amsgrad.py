"""Adam(amsgrad=True) under the reference engine: the third state ``max_exp_avg_sq`` (torch 2.13
``torch/optim/adam.py:Adam._init_group``), one home in ``formulas.optimizers.optimizer_states``."""

from __future__ import annotations

import pytest

import zeroplan
from zeroplan.engines.base import Workload
from zeroplan.engines.reference import ENGINE, Settings
from zeroplan.formulas.optimizers import optimizer_bytes, optimizer_states
from zeroplan.policy import PrecisionPolicy


def test_amsgrad_is_a_third_adam_state_and_nothing_else():
    """Adam's K with an fp32 master: 4 + 4 + 4 = 12, with amsgrad 16 (max_exp_avg_sq like exp_avg_sq)."""
    assert optimizer_bytes(optimizer_states("adam"), "fp32", 1000) == 12_000
    states = optimizer_states("adamw", "bf16", amsgrad=True)
    assert [(s.name, s.dtype) for s in states] == [("Adam m", "bf16"), ("Adam v", "bf16"), ("Adam max v", "bf16")]
    assert optimizer_bytes(optimizer_states("adam", amsgrad=True), "fp32", 1000) == 16_000
    with pytest.raises(ValueError, match=r"^amsgrad=True with optimizer 'sgd-momentum': amsgrad is an option of adam"):
        optimizer_states("sgd-momentum", amsgrad=True)


# `zeroplan validate --world-size 2 --model gpt-tiny --device cpu --amsgrad` (bf16 parameters, fp32 master,
# gloo, per-tensor Adam: CPU's default; --amsgrad builds the runtime's and the parity reference's
# torch.optim.Adam with amsgrad=True), torch 2.13.0+cpu, 2026-12-02: rank 0's peak per phase (init, forward,
# backward, optimizer step) and its live bytes at the step boundary; parity ok at every stage. First measured
# with a sitecustomize patch forcing amsgrad on; re-run with the flag (`--stage 2`, same day): stage 2's row
# again, to the byte. Without amsgrad the same run measures S·4 less in every phase but init (S = 145,296 / 4
# elements at stage 0, half that at 1-3): the third state, and no temporary.
MEASURED = {
    0: ((363_240, 832_732, 845_660, 1_162_884), 726_484),
    1: ((282_024, 542_140, 555_068, 654_348), 435_892),
    2: ((282_024, 505_816, 518_744, 618_024), 399_568),
    3: ((282_024, 484_108, 515_804, 581_700), 363_244),
}
MARGIN = 0.0  # measured exact: every phase and the states equal the prediction to the byte


def _gpt_tiny_cpu(stage: int, amsgrad: bool):
    """The reference row of the measured run, as validate/report.py:reference_estimate builds it on CPU."""
    from validate.models import expected_shapes, spec_for

    spec = spec_for("gpt-tiny", None)
    workload = Workload(expected_shapes(spec), spec, spec.max_seq_len, 2, "none", 1, False)
    settings = Settings(stages=(stage,), policy=PrecisionPolicy(param_dtype="bf16"), block_bytes=1, stat_bytes=2,
                        cuda_capability=None, backend="gloo", amsgrad=amsgrad)  # fmt: skip
    (row,) = ENGINE.estimate(workload, 2, settings)
    return row


@pytest.mark.parametrize("stage", sorted(MEASURED))
def test_reference_amsgrad_every_phase_as_measured(stage):
    """``zeroplan validate --world-size 2 --model gpt-tiny --device cpu --stage STAGE --amsgrad``: every phase
    equal to the prediction to the byte (MEASURED), and one fp32 shard above the same run without amsgrad."""
    (phases, states), adam_step_bytes = MEASURED[stage], 4  # the step scalar: beside the model states
    row = _gpt_tiny_cpu(stage, amsgrad=True)
    predicted = tuple(row.peak.by_phase().values())
    for p, m in zip(predicted, phases):
        assert abs(m - p) <= MARGIN * m, (predicted, phases)
    assert row.memory.model_states_bytes + adam_step_bytes == states
    plain = _gpt_tiny_cpu(stage, amsgrad=False)
    shard_bytes = plain.memory.optimizer_bytes // 3  # master, m, v: one fp32 shard each
    assert row.memory.optimizer_bytes - plain.memory.optimizer_bytes == shard_bytes
    assert [a - b for a, b in zip(predicted, plain.peak.by_phase().values())] == [0, *[shard_bytes] * 3]
    assert "Adam m, v, max v, step" in {t.name for t in row.peak.peak_terms}



def test_validate_amsgrad_predicts_the_measured_row_and_is_refused_elsewhere():
    """``ValidateConfig.amsgrad`` (``zeroplan validate --amsgrad``) reaches the prediction the run is compared
    with (``validate/report.py reference_estimate``): stage 2's measured row; other engines refuse it in one
    line."""
    from validate.config import ValidateConfig
    from validate.models import expected_shapes, spec_for
    from validate.report import reference_estimate

    config = ValidateConfig(model="gpt-tiny", world_sizes=(2,), stages=(2,), device="cpu", amsgrad=True)
    meta = {"device": "cpu", "world_size": 2}
    row = reference_estimate(config, meta, 2, expected_shapes(spec_for("gpt-tiny", None)), False)
    assert tuple(row.peak.by_phase().values()) == MEASURED[2][0]
    assert row.memory.model_states_bytes + 4 == MEASURED[2][1]  # + Adam's 4-B step scalar
    for engine in ("fsdp2", "deepspeed"):
        with pytest.raises(ValueError, match=r"--amsgrad: --engine reference only"):
            ValidateConfig(engine=engine, amsgrad=True)

def test_a_live_amsgrad_optimizer_sets_the_reference_setting():
    """``estimate(model=, optimizer=Adam(amsgrad=True))`` under the reference engine is the estimate with
    ``Settings.amsgrad``: one fp32 state more than without, in the states and in every phase but init."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).bfloat16()
    psi = 64 * 32 + 32 + 32 * 8 + 8
    ams = zeroplan.estimate(model=model, optimizer=torch.optim.Adam(model.parameters(), amsgrad=True), gpus=2)
    plain = zeroplan.estimate(model=model, optimizer=torch.optim.Adam(model.parameters()), gpus=2)
    extra = [a.memory.optimizer_bytes - p.memory.optimizer_bytes for a, p in zip(ams.stages, plain.stages)]
    assert extra == [psi * 4, *[psi // 2 * 4] * 3]  # every tensor splits evenly in two


# `zeroplan validate --engine deepspeed --param-dtype fp32 --world-size 2 --model gpt-tiny --device cpu` (the built-in
# ds_configs: torch_adam, DeepSpeed's default 5e8-element buckets; gloo), DeepSpeed 0.19.8, torch 2.13.0+cpu,
# 2026-12-02, with every torch.optim.Adam built amsgrad=True (DeepSpeed's inner torch AdamW over the fp32
# partition, as a client Adam(amsgrad=True) is): the largest rank's peak per phase and the states at the boundary.
DS_MEASURED = {
    1: ((290_592, 620_864, 2_000_644_296, 654_104), 435_896),
    2: ((290_592, 620_864, 2_000_644_008, 654_104), 435_896),
    3: ((2_000_238_681, 2_000_766_421, 2_000_872_313, 2_000_654_381), 2_000_581_197),
}
DS_PLAIN = {  # the same command without amsgrad, same day: every phase after init and the states 72,648 B lower
    1: (290_592, 548_216, 2_000_571_648, 581_456),
    2: (290_592, 548_216, 2_000_571_360, 581_456),
    3: (2_000_238_681, 2_000_693_773, 2_000_799_665, 2_000_581_733),
}
DS_MARGIN = 0.0005  # measured: 0.041 % (ZeRO-1/2 forward, 256 B under: the targets' micro-batch, read late)
# and 0.040 % (step, 264 B over), both as without amsgrad (docs/engines/deepspeed.md); ZeRO-3's backward 0.0041 %
# (82,756 B over, as without amsgrad: DS_PLAIN)


def _ds_gpt_tiny_cpu(stage: int, amsgrad: bool):
    from validate.engines.deepspeed_compare import ds_config, workload_for
    from zeroplan.engines import deepspeed as D

    ds = ds_config(stage, "fp32", 2, 1e-3, optimizer_params={"torch_adam": True})
    settings = D.Settings.from_ds_config(ds, zero_init=False).model_copy(update={"device": "cpu", "amsgrad": amsgrad})
    w = workload_for("gpt-tiny", 2, None)
    rows = [D.estimate(w, 2, settings.model_copy(update={"rank": r}), stat_bytes=4)[0] for r in (0, 1)]
    return rows, {p: max(r.peak.by_phase()[p] for r in rows) for p in rows[0].peak.by_phase()}


@pytest.mark.parametrize("stage", sorted(DS_MEASURED))
def test_deepspeed_amsgrad_is_one_more_fp32_partition_as_measured(stage):
    phases, states = DS_MEASURED[stage]
    rows, predicted = _ds_gpt_tiny_cpu(stage, amsgrad=True)
    for p, m in zip(predicted.values(), phases):
        assert abs(m - p) <= DS_MARGIN * m, (predicted, phases)
    assert rows[0].memory.model_states_bytes == states  # exact: the step scalars are model states here
    _, plain = _ds_gpt_tiny_cpu(stage, amsgrad=False)
    delta = [predicted[p] - plain[p] for p in plain]
    assert delta == [0, *[72_648] * 3]  # Ψ = 36,324 elements, /2, fp32
    assert [m - n for m, n in zip(phases, DS_PLAIN[stage])] == delta  # measured: the same, to the byte


def test_a_live_amsgrad_optimizer_under_deepspeed():
    """A client ``Adam(amsgrad=True)`` is torch's Adam with a third state under an fp32 ds_config; refused under
    a 16-bit one (measured at fp32 only)."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    cfg = {"zero_optimization": {"stage": 2}}
    ams = zeroplan.estimate(model=model, optimizer=torch.optim.Adam(model.parameters(), amsgrad=True), gpus=2,
                            engine="deepspeed", ds_config=cfg)  # fmt: skip
    plain = zeroplan.estimate(model=model, optimizer=torch.optim.Adam(model.parameters()), gpus=2,
                              engine="deepspeed", ds_config=cfg)  # fmt: skip
    extra = ams.stages[0].memory.optimizer_bytes - plain.stages[0].memory.optimizer_bytes
    flat = 64 * 32 + 32 + 32 * 8 + 8  # 2,344: a multiple of 2·N_d, no padding
    assert extra == flat // 2 * 4  # the third state (torch's 4-B step tensor replaces FusedAdam's 4-B overflow buffer)
    assert ams.stages[0].name.endswith("+ Adam") and plain.stages[0].name.endswith("+ FusedAdam")
    half = {"bf16": {"enabled": True}, **cfg}
    with pytest.raises(ValueError, match=r"^amsgrad=True under engine=deepspeed with bf16 enabled: measured at fp32"):
        zeroplan.estimate(model=model, optimizer=torch.optim.Adam(model.parameters(), amsgrad=True), gpus=2,
                          engine="deepspeed", ds_config=half)  # fmt: skip


def test_a_ds_config_with_amsgrad_is_the_live_client_adam(tmp_path):
    """``estimate --deepspeed-config`` with ``optimizer.params.amsgrad`` (torch_adam: DeepSpeed hands it on to
    torch's Adam, engine.py ``_configure_basic_optimizer``) is the estimate of a live client
    ``Adam(amsgrad=True)``: the same peak, name and states; the key is written back by ``to_ds_config``."""
    import json

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.clicheck import run_json
    from zeroplan.engines import deepspeed as D

    config = "tests/data/hf_configs/tiny-gpt2.json"
    params = {"torch_adam": True, "adam_w_mode": False, "amsgrad": True}  # a client torch.optim.Adam
    ds = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam", "params": params}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    cli = run_json("estimate", "--engine", "deepspeed", "--model", config, "--gpus", "2",
                   "--deepspeed-config", str(tmp_path / "ds.json"))["stages"][0]  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config))
    live = zeroplan.estimate(model=model, optimizer=torch.optim.Adam(model.parameters(), amsgrad=True), gpus=2,
                             engine="deepspeed", ds_config={"zero_optimization": {"stage": 2}}).stages[0]  # fmt: skip
    assert (cli["name"], cli["peak_bytes"], cli["optimizer_bytes"]) == (
        live.name, live.peak.peak_bytes, live.memory.optimizer_bytes)
    # Ψ = 36,324 over N_d 2: master, m, v, max v (fp32), and 2 fp32 step scalars (terms.py: norm, Adam's step)
    assert cli["optimizer_bytes"] == 36_324 // 2 * 4 * 4 + 2 * 4
    settings = D.Settings.from_ds_config(ds)
    assert settings.amsgrad and D.Settings.from_ds_config(D.to_ds_config(settings)) == settings


@pytest.mark.parametrize("engine, dtype, row", [("reference", "bf16", 3), ("fsdp2", "fp32", 0),
                                               ("deepspeed", "fp32", 0)])  # fmt: skip
def test_k_and_the_byte_rows_count_the_third_state(engine, dtype, row):
    """A live ``Adam(amsgrad=True)``: ``Estimate.k`` and ``bytes_per_param`` are the engine's states (the
    policy's rows with ``Settings.amsgrad``), so K grows by max v's 4 B exactly as optimizer_bytes grows by 4 B
    per sharded element; plain DP ("vs DP") keeps the same third state."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    psi = 64 * 32 + 32 + 32 * 8 + 8  # 2,344: every tensor splits evenly in two
    kw = {"ds_config": {"zero_optimization": {"stage": 2}}} if engine == "deepspeed" else {}
    ams, plain = (zeroplan.estimate(model=model, optimizer=torch.optim.Adam(model.parameters(), amsgrad=a), gpus=2,
                                    engine=engine, **kw) for a in (True, False))  # fmt: skip
    assert ams.k - plain.k == 4 and ams.bytes_per_param == (*plain.bytes_per_param, ("fp32 Adam max v", 4.0))
    grown = ams.stages[row].memory.optimizer_bytes - plain.stages[row].memory.optimizer_bytes
    assert grown == (ams.k - plain.k) * psi // 2
    if engine == "reference":  # K = 16 (master, m, v, max v), all of stage 0's optimizer bytes; DP is stage 0
        assert (ams.k, ams.stages[0].memory.optimizer_bytes) == (16, 16 * psi)
        assert ams.stages[0].reduction_vs_dp == 1.0
