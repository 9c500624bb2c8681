"""A run whose measured optimizer step DeepSpeed skipped is refused with the reason, never compared (issue 17).

DeepSpeed skips a step whose gradients overflowed (runtime/engine.py ``_take_model_step``: ``skipped_steps``,
``was_step_applied``): a non-finite gradient norm (the ZeRO optimizers' ``is_invalid_grad_norm``) or fp16's loss
scaler's overflow. Such a step allocates no optimizer state: its phases are not the step's. The runner records
``steps_applied`` per optimizer step (``validate.engines.deepspeed.measure``); ``deepspeed_compare.compare_row`` and
the differential matrix (``differential._run_deepspeed``) refuse such a run in one line (``StepSkipped``).

Two real runs force the skip through DeepSpeed's own mechanisms, in the session's torchrun world of N_d = 2
(tests/deepspeed_world.py, gpt-tiny, three steps; ~60 s together measured 2026-12-02 on two shared cores):
ZeRO-2 fp32 at lr = 1e30 (the first step applied; its update makes the weights ~1e30, the next forward's
gradients non-finite: steps 2 and 3 skipped) and ZeRO-1 fp16 with ``initial_scale_power`` 32 (the scaled loss
overflows fp16 at every scale it tries: all three skipped; optimizer_step's peak 185,956 B below init's 217,944 B,
the signature of seed 5's draw 5-3 in the sweep). Beside them, the same ZeRO-2 at lr = 1e-3 applies every step.
"""

from __future__ import annotations

import pytest

ND = 2
SMALL = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000,
         "stage3_param_persistence_threshold": 100}  # fmt: skip
ADAM = {"torch_adam": True}


def _cases() -> dict[str, dict]:
    from validate.engines.deepspeed import ds_config

    fp16 = ds_config(1, "fp16", zero=SMALL, optimizer_params=ADAM)
    fp16["fp16"]["initial_scale_power"] = 32  # a 2^32 loss scale: every scaled gradient is inf in fp16
    return {
        "applied": ds_config(2, zero={**SMALL, "overlap_comm": True}, optimizer_params=ADAM),  # test_deepspeed_async's
        "non-finite": ds_config(2, zero={**SMALL, "overlap_comm": True}, lr=1e30, optimizer_params=ADAM),
        "fp16-overflow": fp16,
    }


# the session's shared world of N_d = 2 (tests/deepspeed_world.py), 3 steps
DEEPSPEED_WORLD = {ND: lambda: [(c, {}) for c in _cases().values()]}


@pytest.fixture(scope="module")
def world(request, deepspeed_world):
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: DS_BUILD_OPS=0 pip install '.[deepspeed]'")
    ranks = deepspeed_world.ranks(request.module, ND)
    return {name: (config, [r[i] for r in ranks]) for i, (name, config) in enumerate(_cases().items())}


def _compare(config, rank_rows):
    from validate.engines.deepspeed import compare_row, workload_for

    return compare_row(config, ND, rank_rows, workload_for("gpt-tiny", 2, None), "gpt-tiny", 0.01, 0.03)


@pytest.mark.distributed
@pytest.mark.parametrize("name, applied, reason", [
    ("non-finite", [True, False, False], "skipped optimizer step 2, 3 of 3 on rank 0, 1: the gradient norm was not finite"),
    ("fp16-overflow", [False, False, False], "skipped optimizer step 1, 2, 3 of 3 on rank 0, 1: fp16's loss scaler"),
])  # fmt: skip
def test_a_skipped_step_is_refused_with_the_reason(world, name, applied, reason):
    from validate.engines.deepspeed_compare import StepSkipped

    config, rank_rows = world[name]
    assert [r["steps_applied"] for r in rank_rows] == [applied] * ND
    assert all(r["skipped_steps"] == applied.count(False) for r in rank_rows)
    with pytest.raises(StepSkipped, match=reason):
        _compare(config, rank_rows)


@pytest.mark.distributed
def test_every_step_applied_is_compared(world):
    config, rank_rows = world["applied"]
    assert [r["steps_applied"] for r in rank_rows] == [[True] * 3] * ND and all(r["skipped_steps"] == 0 for r in rank_rows)
    assert _compare(config, rank_rows)["ok"]


def _rows(*applied):
    return [{"rank": k, "steps_applied": list(a)} for k, a in enumerate(applied)]


def test_reason_names_the_steps_ranks_and_mechanism():
    from validate.engines.deepspeed_compare import skipped_steps_reason

    fp32, fp16 = {"zero_optimization": {"stage": 3}}, {"fp16": {"enabled": True}}
    assert skipped_steps_reason(fp32, _rows((True, True), (True, True))) is None
    why = skipped_steps_reason(fp32, _rows((True, True), (True, False)))
    assert why.startswith("DeepSpeed skipped optimizer step 2 of 2 on rank 1: the gradient norm was not finite")
    assert why.endswith("so the run is refused and nothing compared") and "\n" not in why
    assert "fp16's loss scaler found an overflow" in skipped_steps_reason(fp16, _rows((False, True), (False, True)))
    assert "rank 0, 1" in skipped_steps_reason(fp16, _rows((False, True), (False, True)))


def test_the_differential_refuses_a_draw_whose_step_was_skipped(monkeypatch, tmp_path):
    """``run_draw`` of a DeepSpeed draw raises ``StepSkipped`` (benchmarks/differential.py lists it under
    ``failed`` with the reason) before any prediction: the ranks' rows stand in for a run."""
    import validate.engines.deepspeed as runner
    from validate.engines import differential
    from validate.engines.deepspeed_compare import StepSkipped

    d = next(differential.draw(5, i, None, 5) for i in range(12) if differential.draw(5, i, None, 5).engine == "deepspeed")
    rows = [[{"rank": k, "steps_applied": [True, k == 0], "peak_bytes_by_phase": {}}] for k in range(d.nd)]
    monkeypatch.setattr(runner, "run_world", lambda *a, **k: rows)
    monkeypatch.setattr(differential, "predict_draw", lambda *a: pytest.fail("a skipped run was predicted"))
    with pytest.raises(StepSkipped, match="skipped optimizer step 2 of 2 on rank 1"):
        differential.run_draw(d, tmp_path)


#: tests/hf_zero3_build_check.py on tiny-deepseek-v3 (2026-12-02, ~20 s): the runner's build every parameter finite and
#: every weight's std within 0.000995 of initializer_range 0.02 (the smallest tensors' sampling error); the old build
#: (the runner's own zero.Init) the 4 expert tensors NaN and weights at torch's defaults (std off by 0.97)
STD_OFF = 0.002


@pytest.mark.distributed
def test_a_transformers_model_under_zero3_is_initialised_as_users_build_it():
    """Issue 17's cause, deterministic: every ``torch.empty`` of the build NaN, a parameter nobody initialises stays
    NaN. The runner's build (``hf_zero3_build``) initialises all; its old build left DeepSeek-V3's experts."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: DS_BUILD_OPS=0 pip install '.[deepspeed]'")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, str(root / "tests" / "hf_zero3_build_check.py"),
                           str(root / "tests" / "data" / "hf_configs" / "tiny-deepseek-v3.json")],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["runner"]["nonfinite"] == [] and out["runner"]["worst_std_off"] <= STD_OFF, out["runner"]
    experts = [f"model.layers.{k}.mlp.experts.{w}" for k in (1, 2) for w in ("gate_up_proj", "down_proj")]
    assert out["raw"]["nonfinite"] == experts and out["raw"]["worst_std_off"] > 0.5, out["raw"]
    assert not out["runner"]["zero3_after"]  # transformers' global unset: a later run builds without ZeRO-3


def test_zeroplan_validate_refuses_the_run_in_one_line(monkeypatch):
    """``zeroplan validate --engine deepspeed``: ``run_validation`` raises ``StepSkipped``, a ``RunFailed``, which the
    command prints as one line and exits 1 with (zeroplan/cli_validate.py); no row is compared, no report made."""
    import validate.engines.deepspeed_jit_lock as jit_lock
    import validate.harness as harness
    from validate.config import ValidateConfig
    from validate.engines.deepspeed_compare import StepSkipped, run_validation

    config = ValidateConfig(engine="deepspeed", world_sizes=(2,), stages=(2,), device="cpu")
    ranks = [[{"rank": k, "steps_applied": [k == 1, True]}] for k in range(2)]
    monkeypatch.setattr(jit_lock, "check_extension_locks", lambda: None)
    monkeypatch.setattr(harness, "run_matrix", lambda c: [({}, ranks)])
    with pytest.raises(StepSkipped, match="^DeepSpeed skipped optimizer step 1 of 2 on rank 0: the gradient norm") as e:
        run_validation(config)
    assert isinstance(e.value, harness.RunFailed) and "\n" not in str(e.value)
