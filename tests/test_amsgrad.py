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


# `zeroplan validate --world-size 2 --model gpt-tiny --device cpu` (bf16 parameters, fp32 master, gloo, per-tensor
# Adam: CPU's default), with every torch.optim.Adam built amsgrad=True (the runtime's and the parity reference's),
# torch 2.13.0+cpu, 2026-12-02: rank 0's peak per phase (init, forward, backward, optimizer step) and its live bytes
# at the step boundary; parity ok at every stage. Without amsgrad the same run measures S·4 less in every phase but
# init (S = 145,296 / 4 elements at stage 0, half that at 1-3): the third state, and no temporary.
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
