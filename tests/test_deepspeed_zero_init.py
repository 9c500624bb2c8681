"""ZeRO-3 with the model built under ``deepspeed.zero.Init`` (real DeepSpeed, gloo, CPU) against
``zeroplan.engines.deepspeed`` (``Settings.zero_init``, ``zero_init_moments``), and the planner's side.

One torchrun world of N_d = 2 (``run_world(..., runs=...)``): gpt-tiny fp32 and tiny-llama bf16 built under
``zero.Init``, and gpt-tiny fp32 built whole (the materialized path, for the before/after). Each row goes
through the validator's ``compare_row`` (which passes how the ranks built the model); the build's own peak
(``build_peak_bytes``, within init's) is compared with ``zero_init_moments``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from clicheck import assert_one_line_error
from zeroplan.engines import deepspeed as D
from zeroplan.formulas.peak import PHASES

ND, STATES_TOL, PEAK_TOL = 2, 0.01, 0.03
LLAMA = str(Path(__file__).resolve().parent / "data" / "hf_configs" / "tiny-llama.json")
SMALL = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000,
         "stage3_param_persistence_threshold": 100}  # fmt: skip
CASES = {  # name -> (model, dtype, zero_init)
    "gpt-fp32-zero-init": ("gpt-tiny", "fp32", True),
    "llama-bf16-zero-init": (LLAMA, "bf16", True),
    "gpt-fp32-materialized": ("gpt-tiny", "fp32", False),
}


@pytest.fixture(scope="module")
def world():
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: DS_BUILD_OPS=0 pip install '.[deepspeed]'")
    from validate.engines.deepspeed import compare_row, ds_config, run_world, workload_for

    configs = [ds_config(3, dtype, zero=SMALL, optimizer_params={"torch_adam": True}) for _, dtype, _ in CASES.values()]
    runs = [{"model": model, "zero_init": zi} for model, _, zi in CASES.values()]
    ranks = run_world(configs, ND, steps=2, runs=runs)
    out = {}
    for i, (name, (model, _, zi)) in enumerate(CASES.items()):
        workload = workload_for(model, configs[i]["train_micro_batch_size_per_gpu"], None)
        rank_rows = [r[i] for r in ranks]
        row = compare_row(configs[i], ND, rank_rows, workload, name, STATES_TOL, PEAK_TOL)
        settings = D.Settings.from_ds_config(configs[i], zero_init=zi)
        out[name] = (rank_rows, row, D.ds_run(settings, workload, ND, stat_bytes=D.DTYPE_BYTES[settings.dtype]))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_row_within_tolerance(world, name):
    rank_rows, row, _ = world[name]
    assert all(r["zero_init"] is CASES[name][2] for r in rank_rows)
    assert abs(row["model_states_rel_error"]) <= STATES_TOL, row["model_states_rel_error"]
    assert row["checks"]["collectives_match"], (row["predicted_collectives"], row["measured_collectives"])
    for phase in PHASES:
        measured = row["measured_peak_bytes_by_phase"][phase]
        predicted = row["predicted_peak_bytes_by_phase"][phase]
        assert abs(measured - predicted) <= PEAK_TOL * measured, (phase, measured, predicted)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2]])
def test_build_peak_is_zero_init_moments(world, name):
    """The build's peak: exactly the largest of ``zero_init_moments`` on the quietest rank; another rank
    may still hold one full parameter gloo has not let go of after its broadcast (measured up to the
    largest parameter at N_d = 4, docs/engines/deepspeed.md), never more."""
    rank_rows, _, run = world[name]
    predicted = max(m.total() for m in D.zero_init_moments(run))
    measured = [r["build_peak_bytes"] for r in rank_rows]
    assert min(measured) == predicted, (measured, predicted)
    assert max(measured) <= predicted + max(run.numels) * 4, (measured, predicted)


def test_zero_init_never_holds_the_whole_model(world):
    """Before/after on the same model: built whole, the build holds Ψ fp32 elements; under zero.Init the
    partitions and one module at a time."""
    whole, _, run = world["gpt-fp32-materialized"]
    parts, _, _ = world["gpt-fp32-zero-init"]
    psi = sum(run.numels)
    assert all(r["build_peak_bytes"] == psi * 4 for r in whole)
    assert max(r["build_peak_bytes"] for r in parts) < psi * 4 * 0.7


def _workload(model: str = "llama2-70b"):
    from zeroplan.architectures.spec import transformer_shapes
    from zeroplan.engines.base import Workload
    from zeroplan.presets import get_model

    spec = get_model(model).spec
    return Workload(tuple(transformer_shapes(spec)), spec, spec.max_seq_len, 1)


def test_settings_zero_init_vocabulary():
    assert D.Settings(stage=3).builds_partitioned and not D.Settings(stage=3, zero_init=False).builds_partitioned
    assert not D.Settings(stage=2).builds_partitioned
    with pytest.raises(ValueError, match="ZeRO-3 only"):
        D.Settings(stage=2, zero_init=True)
    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    assert D.Settings.from_ds_config(config).zero_init is None
    assert D.Settings.from_ds_config(config, zero_init=False).zero_init is False
    # not a ds_config key: the emitted file reads back as the settings the planner predicted
    s = D.Settings.from_ds_config(config)
    assert D.Settings.from_ds_config(D.to_ds_config(s)) == s


def test_init_peak_at_70b_on_64_gpus():
    """ZeRO-3, Llama-2-70B, N_d = 64, bf16: built whole, init holds the fp32 model (Ψ·4 and the 16-bit cast
    beside it); under zero.Init the largest init moment is deepspeed.initialize's fp32 master clone."""
    w = _workload()
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    psi = sum(math.prod(sh) for _, sh in w.shapes)
    init = {}
    for zi in (False, True):
        (est,) = D.estimate(w, 64, D.Settings.from_ds_config(config, zero_init=zi))
        init[zi] = est.peak.by_phase()["init"]
    assert init[False] >= psi * 4
    part = D.stage3_partition_numel(tuple(math.prod(sh) for _, sh in w.shapes), 64)
    assert init[True] < psi * 4 / 20 and init[True] >= part * (2 + 4 + 4)  # 16-bit partition, converted, clone


def test_plan_emits_the_zero_init_build(tmp_path):
    from typer.testing import CliRunner

    from zeroplan.cli import app

    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    # 6 GiB a GPU: ZeRO-1/2 do not fit (their init holds the fp32 model, 5.8 GiB), ZeRO-3 does
    args = ["plan", "--engine", "deepspeed", "--deepspeed-config", str(path), "--model", "gpt2-xl",
            "--gpus", "64", "--gpu-memory", "6GiB"]  # fmt: skip
    got = CliRunner().invoke(app, [*args, "--json"])
    text = CliRunner().invoke(app, args)
    assert got.exit_code == 0, got.output
    rec = json.loads(got.stdout)["recommendation"]
    assert rec["deepspeed"]["zero_optimization"]["stage"] == 3, rec["label"]
    assert "deepspeed.zero.Init(config_dict_or_path='ds_config.json')" in rec["deepspeed_build"]
    assert "deepspeed.zero.Init(config_dict_or_path='ds_config.json')" in text.stdout
    assert D.build_snippet(D.Settings(stage=2)) is None and D.build_snippet(D.Settings(stage=3, zero_init=False)) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--zero-init"], "--engine deepspeed only"),
        (["--engine", "deepspeed", "--stage", "2", "--zero-init"], "ZeRO-3 only"),
        (["--engine", "deepspeed", "--zero-init"], "ZeRO-3 only"),  # the built-in configs: stages 1-3
    ],
)
def test_validate_refuses_zero_init_off_zero3(args, message):
    pytest.importorskip("torch")
    from typer.testing import CliRunner

    from zeroplan.cli import app

    assert_one_line_error(CliRunner().invoke(app, ["validate", *args]), message)
