"""ZeRO-3 with the model built under ``deepspeed.zero.Init`` (real DeepSpeed, gloo, CPU) against
``zeroplan.engines.deepspeed`` (``Settings.zero_init``, ``zero_init_moments``), and the planner's side.

The session's one torchrun world of N_d = 2 (``tests/deepspeed_world.py``): gpt-tiny fp32 and tiny-llama bf16 built under
``zero.Init``, and gpt-tiny fp32 built whole (the materialized path, for the before/after). Each row goes
through the validator's ``compare_row`` (which passes how the ranks built the model); the build's own peak
(``build_peak_bytes``, within init's) is compared with ``zero_init_moments``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from clicheck import assert_one_line_error

from tests.test_measured_rows import live_peak_misses
from zeroplan.engines import deepspeed as D
from zeroplan.formulas.peak import peak_of
from zeroplan.formulas.sharding import flat_shard_numel

ND, STATES_TOL, PEAK_TOL = 2, 0.01, 0.03
LLAMA = str(Path(__file__).resolve().parent / "data" / "hf_configs" / "tiny-llama.json")
SMALL = {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000,
         "stage3_param_persistence_threshold": 100}  # fmt: skip
# ZeRO-3 without prefetch, reuse distance 10,000: tiny-llama keeps its LM head and last down_proj gathered
# from forward into backward (2·4,992 < 10,000) and re-gathers the other 14 parameters in backward
NO_PREFETCH = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 10_000}
CASES = {  # name -> (model, dtype, zero_init, extra zero_optimization keys)
    "gpt-fp32-zero-init": ("gpt-tiny", "fp32", True, {}),
    "llama-bf16-zero-init": (LLAMA, "bf16", True, {}),
    "gpt-fp32-materialized": ("gpt-tiny", "fp32", False, {}),
    "llama-fp32-no-prefetch": (LLAMA, "fp32", True, NO_PREFETCH),
}
RECORDED = {  # each case's row in tests/data/measured/deepspeed.json (benchmarks/record_measured.py)
    "gpt-fp32-zero-init": "z3-gpt-fp32-zero-init", "llama-bf16-zero-init": "z3-llama-bf16-zero-init",
    "gpt-fp32-materialized": "z3-fp32-small", "llama-fp32-no-prefetch": "z3-llama-fp32-zero-init-no-prefetch",
}  # fmt: skip


def _world_cases() -> list[tuple[dict, dict]]:
    from validate.engines.deepspeed import ds_config

    return [(ds_config(3, dtype, zero={**SMALL, **extra}, optimizer_params={"torch_adam": True}),
             {"model": model, "zero_init": zi}) for model, dtype, zi, extra in CASES.values()]  # fmt: skip


# the session's shared world of N_d = 2 (tests/deepspeed_world.py), 3 steps: "gpt-fp32-materialized" is
# tests/test_deepspeed_engine.py's z3-fp32-small, run once for both
DEEPSPEED_WORLD = {ND: _world_cases}


@pytest.fixture(scope="module")
def world(request, deepspeed_world):
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: DS_BUILD_OPS=0 pip install '.[deepspeed]'")
    from validate.engines.deepspeed import compare_row, workload_for

    configs = [c for c, _ in _world_cases()]
    ranks = deepspeed_world.ranks(request.module, ND)  # steady-state collectives: the third step
    out = {}
    for i, (name, (model, _, zi, _)) in enumerate(CASES.items()):
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
    # every phase at this row's recorded error + max(64 B, 0.05%) (tests/test_measured_rows.py), not 3%
    misses = live_peak_misses(f"deepspeed-{RECORDED[name]}-nd{ND}", row["measured_peak_bytes_by_phase"],
                              row["predicted_peak_bytes_by_phase"])  # fmt: skip
    assert misses == []


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] and not c[3]])
def test_build_peak_is_zero_init_moments(world, name):
    """The build's peak: exactly the largest of ``zero_init_moments`` on every rank. (Some ranks used to
    hold one full parameter more, gloo's until the runner waited on the tensor's own use count; none since
    in 10 worlds at N_d = 2 and 4, docs/engines/deepspeed.md.)"""
    rank_rows, _, run = world[name]
    predicted = max(m.total() for m in D.zero_init_moments(run))
    assert [r["build_peak_bytes"] for r in rank_rows] == [predicted] * len(rank_rows)


def test_released_parameters_are_gathered_again_in_backward(world):
    """The no-prefetch row is not the plain one in disguise: 14 of tiny-llama's 16 gathered parameters are
    all-gathered again in backward (``stage3_schedule``), and its forward peak is below the all-kept prediction."""
    from validate.report import _key

    _, row, run = world["llama-fp32-no-prefetch"]
    s = run.settings
    sched = D.stage3_schedule(run.trace, run.numels, ND, s.param_persistence_threshold, s.prefetch_bucket_size,
                              s.max_live_parameters, s.max_reuse_distance)  # fmt: skip
    regathered = sum(run.numels[i] for i in sched.regathered)
    assert (sched.at(run.trace, "forward end"), len(sched.regathered)) == (4_944 + 4_224, 14)
    assert sched.backward_elements == regathered
    assert row["measured_collectives"][_key("all-gather", "backward", "float32")]["elements"] == regathered
    everything = run.settings.model_copy(update={"max_reuse_distance": 10**9})
    allkept = peak_of(D.moments(dataclasses.replace(run, settings=everything)))
    assert row["measured_peak_bytes_by_phase"]["forward"] == allkept.by_phase()["forward"] - regathered * 4


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

    spec = get_model(model).spec  # as the planner builds it (estimation/workload.py model_workload)
    return Workload(tuple(transformer_shapes(spec)), spec, spec.max_seq_len, 1, transformers=True)


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
    part = flat_shard_numel(tuple(math.prod(sh) for _, sh in w.shapes), 64)
    assert init[True] < psi * 4 / 20 and init[True] >= part * (2 + 4 + 4)  # 16-bit partition, converted, clone


def test_release_rule():
    """Without prefetch, ``stage3_schedule`` keeps a module's parameters from forward into backward iff
    2·Σ numel behind it < stage3_max_reuse_distance (partitioned_param_coordinator.py ``__params_to_release``
    walking ``__submodule_order[step_id:]``; the rule measured at five distances)."""
    numels = (10, 20, 5, 30)  # behind: 55, 35, 30, 0
    trace = D.stage3_trace(tuple((f"m{i}.weight", (n,)) for i, n in enumerate(numels)))

    def kept(distance: int) -> tuple[bool, ...]:
        sched = D.stage3_schedule(trace, numels, 2, 0, 0, 10**9, distance)
        return tuple(i not in sched.regathered for i in range(len(numels)))

    assert kept(61) == (False, False, True, True)
    assert kept(0) == (False,) * 4
    assert kept(111) == (True,) * 4


def test_plan_fits_llama2_70b_on_64_h100(tmp_path):
    """The planner's question of issue 11: ZeRO-3 built under zero.Init fits, with DeepSpeed's default prefetch
    (5e7) and reuse distance (1e9, below the model's 6.9e10 elements): the coordinator's replay
    (``stage3_schedule``) releases what the distance and the prefetch's marks allow, so the peak is the
    no-prefetch one plus what the schedule keeps gathered besides at the last block's backward."""
    from typer.testing import CliRunner

    from zeroplan.cli import app

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 3}}))  # fmt: skip
    got = CliRunner().invoke(app, ["plan", "--engine", "deepspeed", "--deepspeed-config", str(path), "--model",
                                   "llama2-70b", "--gpus", "64", "--gpu", "h100-80gb", "--json"])  # fmt: skip
    assert got.exit_code == 0, got.output
    d = json.loads(got.stdout)
    rec = d["recommendation"]
    # past one node ZeRO-3 also tries hpZ over the node (8 GPUs), ranked by bytes across nodes first (plan.py)
    assert rec["label"] == "ZeRO-3, buckets 5e8, hpZ 8", rec["label"]
    assert rec["deepspeed"]["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert rec["deepspeed"]["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert "deepspeed.zero.Init(" in rec["deepspeed_build"]
    peaks = {o["label"]: o["peak_bytes"] for o in d["stages"]}
    assert peaks[rec["label"]] <= 0.9 * 80 * 2**30 < min(v for k, v in peaks.items() if "ZeRO-3" not in k)
    w = _workload()
    numels = tuple(math.prod(sh) for _, sh in w.shapes)
    (trace,) = D._trace(w)
    at = {pf: D.stage3_schedule(trace, numels, 64, 100_000, pf, 10**9, 10**9).at(trace, "last block backward")
          for pf in (50_000_000, 0)}  # fmt: skip
    assert at[0] < at[50_000_000]  # prefetch keeps what its scan marked for a later step (not released)
    assert peaks["ZeRO-3, buckets 5e8"] - peaks["ZeRO-3, buckets 5e8, no prefetch"] == (at[50_000_000] - at[0]) * 2


def test_plan_emits_the_zero_init_build(tmp_path):
    from typer.testing import CliRunner

    from zeroplan.cli import app

    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    # gpt2-xl without dropout (the preset's 0.1 has no peak: dropout.dropout_limit)
    from zeroplan.presets import get_model

    model = tmp_path / "gpt2-xl.json"
    quiet = {"attn_pdrop": 0, "embd_pdrop": 0, "resid_pdrop": 0}
    model.write_text(json.dumps({**get_model("gpt2-xl").hf_config, **quiet}))
    # 6 GiB a GPU: ZeRO-1/2 do not fit (their init holds the fp32 model, 5.8 GiB), ZeRO-3 does
    args = ["plan", "--engine", "deepspeed", "--deepspeed-config", str(path), "--model", str(model),
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
    if "deepspeed" in args:  # without it the CLI's first answer is "--engine deepspeed needs DeepSpeed"
        pytest.importorskip("deepspeed", reason="DeepSpeed is an optional extra: DS_BUILD_OPS=0 pip install '.[deepspeed]'")
    from typer.testing import CliRunner

    from zeroplan.cli import app

    assert_one_line_error(CliRunner().invoke(app, ["validate", *args]), message)


#: a transformers model built under ZeRO-3 as users build it (``HfDeepSpeedConfig`` alive: ``from_config``'s own
#: ``zero.Init``, then ``initialize_weights_zero3``; validate/engines/deepspeed.py ``hf_zero3_build``): each rank's
#: ``build_peak_bytes`` (every rank the same) at micro-batch 1, ``ds_config(3, dtype)``; (hf config or the
#: differential draw, dtype, N_d) -> (measured, measured - one module at a time, as before). 2026-12-02
#: (docs/engines/deepspeed.md "zero.Init under transformers"); the draw: docs/benchmarks.md 5-3 (seed 5, gen. 5, draw 3)
HF_BUILDS = {
    ("tiny-llama", "fp32", 2): (146_240, 30_944), ("tiny-llama", "fp32", 3): (114_400, 30_944),
    ("tiny-llama", "bf16", 2): (73_136, 656), ("tiny-gpt2", "fp32", 2): (122_112, 20_880),
    ("tiny-gpt2", "fp32", 3): (95_472, 20_880), ("tiny-llama-tied-bias", "fp32", 2): (71_696, 10_736),
    ("tiny-llama-tied-bias", "fp32", 3): (55_248, 10_764), ("tiny-llama-tied-bias", "bf16", 2): (39_072, 48),
    ("tiny-deepseek-v3", "fp32", 2): (194_024, 1_024), ("draw 5-3", "fp32", 2): (52_029_336, 1_016),
}  # fmt: skip
#: the fp32 buffers (rotary ``inv_freq`` and ``original_inv_freq``, DeepSeek-V3's router bias) fp32 rows leave out
#: (run.py ``_sixteen_bit_hf``): at most 64 B on these models
HF_BUFFERS = 64


def _hf_build_run(name: str, dtype: str, nd: int, tmp_path: Path):
    from validate.engines.deepspeed import ds_config, workload_for

    config = ds_config(3, dtype, micro_batch=1, optimizer_params={"torch_adam": True})
    if name == "draw 5-3":
        from validate.engines.differential import draw

        d = draw(5, 3, generator=5)
        path, seq_len, config = tmp_path / "draw.json", d.seq_len, d.ds_config
        path.write_text(json.dumps(d.config))
    else:
        path, seq_len = Path(__file__).parent / "data" / "hf_configs" / f"{name}.json", 16
    workload = workload_for(str(path), 1, seq_len, 1, "none", hf=True)
    settings = D.Settings.from_ds_config(config, zero_init=True).model_copy(update={"hf_zero3_build": True})
    return D.ds_run(settings, workload, nd, stat_bytes=4)


@pytest.mark.parametrize("key", list(HF_BUILDS), ids=[f"{n}-{d}-nd{k}" for n, d, k in HF_BUILDS])
def test_transformers_build_gathers_each_module_with_its_children(key, tmp_path):
    """``initialize_weights_zero3`` gathers a module's parameters with its direct children's (``DSRun.init_gathers``):
    the build's peak within the fp32 buffers under the measurement (0-64 B, measured 0-48 B); one module at a time
    (``Module.apply``, the validator's own models) was up to 30,944 B under (tiny-llama: the attention's four
    projections at once; the draw: 1,016 B, the final norm beside the embedding), as recorded."""
    run = _hf_build_run(*key, tmp_path)
    measured, before = HF_BUILDS[key]
    predicted = max(m.total() for m in D.zero_init_moments(run))
    assert 0 <= measured - predicted <= HF_BUFFERS, (measured, predicted)
    one_module = max(m.total() for m in D.zero_init_moments(dataclasses.replace(run, init_gathers=())))
    assert measured - one_module == before, (measured, one_module)
