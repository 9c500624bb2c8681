"""The engine registry is the only door (issue 16): a toy engine added through the public registry API
answers ``estimate``, ``plan`` and ``sweep``; and the rules the hardening helper left, each with one home."""

from __future__ import annotations

import json

import pytest

import zeroplan
from zeroplan.engines import get_engine

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}  # fmt: skip


# ---------------------------------------------------------------- the hardening helper's leftovers


@pytest.mark.parametrize("name", [{"a": 1}, ["reference"], 3, None])
def test_get_engine_refuses_a_non_string_in_one_line(name):
    with pytest.raises(ValueError, match=r"^unknown engine .*: known engines are reference, deepspeed, fsdp2$"):
        get_engine(name)


@pytest.mark.parametrize("stage", [4, 0, "3"])
def test_the_deepspeed_plan_reads_the_files_stage_before_searching(tmp_path, stage):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        zeroplan.plan(str(cfg), gpu="h100-80gb", gpus=8, engine="deepspeed",
                      ds_config={"zero_optimization": {"stage": stage}})  # fmt: skip
    plan = zeroplan.plan(str(cfg), gpu="h100-80gb", gpus=8, engine="deepspeed",
                         ds_config={"zero_optimization": {"stage": 2}})  # fmt: skip
    assert {o.stage for o in plan.options} == {1, 2, 3}  # the file's stage is one candidate, not the answer


@pytest.mark.parametrize("name", ["a" * 5000, "x\x00y", ("b" * 300 + "/") * 20])
def test_a_model_name_no_file_system_can_hold_is_a_preset_question(name):
    from zeroplan.presets import is_config_path

    assert is_config_path(name) is False
    with pytest.raises(ValueError, match="unknown model"):
        zeroplan.estimate(model=name, gpus=8)


def test_an_empty_baseline_is_refused_where_baselines_are_read(tmp_path):
    from validate.baseline import read_baseline

    path = tmp_path / "b.json"
    path.write_text(json.dumps({"schema": "zeroplan.validate/2", "config": {}, "torch": None, "rows": [],
                                "notes": [], "ok": True}))  # fmt: skip
    with pytest.raises(ValueError, match=r"^--baseline .*: has no rows, so nothing could be compared"):
        read_baseline(str(path))


# ---------------------------------------------------------------- a toy engine through the public registry API


def toy_engine():
    """A whole engine in a few lines: bf16 parameters kept whole, fp32 gradients and ``copies`` fp32 optimizer
    states sharded ceil(Ψ/N_d) (its own option), one all-gather per step, and a peak of four phases."""
    import math
    from typing import Optional

    from pydantic import BaseModel, ConfigDict

    from zeroplan.engines.base import (Candidate, Engine, EngineEstimate, EngineOption, EnginePlan, Launcher,
                                       PlannerOptions, RunOption, Workload)  # fmt: skip
    from zeroplan.formulas.collectives import Collective, ring_bytes_per_rank
    from zeroplan.formulas.memory import MemoryBreakdown
    from zeroplan.formulas.peak import Moment, Term, peak_of
    from zeroplan.policy import PrecisionPolicy

    class Settings(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        copies: int = 2

    def check_copies(v: object) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 4:
            raise ValueError(f"copies={v!r}: expected a whole number in [1, 4]")
        return v

    def estimate(workload: Workload, nd: int, s: Settings) -> tuple[EngineEstimate, ...]:
        psi = sum(math.prod(shape) for _, shape in workload.shapes)
        shard = -(-psi // nd)
        memory = MemoryBreakdown(2 * psi, 4 * shard, 4 * s.copies * shard)
        peak = None
        if workload.spec is not None:
            states = (Term("params", memory.params_bytes, "toy"), Term("grads", memory.grads_bytes, "toy"),
                      Term("optimizer", memory.optimizer_bytes, "toy"))  # fmt: skip
            act = Term("activations", 1000 * workload.micro_batch * workload.seq_len, "toy: 1000 B per token")
            peak = peak_of([Moment("init", "built", states[:1]), Moment("forward", "loss", (*states, act)),
                            Moment("backward", "grads", (*states, act)), Moment("optimizer_step", "step", states)])
        gather = Collective("all-gather", "forward", psi, "bf16", ring_bytes_per_rank("all-gather", psi, nd, 2))
        return (EngineEstimate("toy", f"toy copies={s.copies}", 2, memory, peak, (gather,)),)

    def planner_settings(options: PlannerOptions) -> Settings:
        return Settings(copies=options.own["copies"])

    def plan(workload: Workload, nd: int, capacity_bytes: int, options: PlannerOptions) -> EnginePlan:
        tried = [(c, estimate(workload, nd, Settings(copies=c))[0]) for c in (1, 2, 3)]
        out = tuple(Candidate(f"copies={c}", e, e.peak.peak_bytes <= capacity_bytes, {"copies": c}) for c, e in tried)
        return EnginePlan(out, next((i for i, c in enumerate(out) if c.fits), None), "fewest copies first")

    return Engine("toy", estimate, Settings, planner_settings,
                  lambda s: PrecisionPolicy(param_dtype="bf16", grad_dtype="fp32", master_weights=False),
                  options=(), plan=plan, own_options=(EngineOption("copies", check_copies, 2, "optimizer copies"),),
                  launcher=Launcher("toy", "Toy (exactly the copies predicted):"),
                  run_options=(RunOption("toy_copies", Optional[int], help="copies the toy's runner keeps",
                                         planner="copies"),))  # fmt: skip


@pytest.fixture
def toy():
    from zeroplan.engines import REGISTRY, register

    register("toy", toy_engine())  # adding an engine: one package (here a function) plus one registry line
    yield get_engine("toy")
    del REGISTRY["toy"]


def test_a_toy_engine_answers_estimate_with_its_own_option(toy, tmp_path):
    est = zeroplan.estimate(1000, gpus=4, engine="toy", copies=3)
    (row,) = est.stages
    assert (row.memory.params_bytes, row.memory.grads_bytes, row.memory.optimizer_bytes) == (2000, 1000, 3000)
    assert row.name == "toy copies=3" and row.peak is None  # a bare Ψ: no architecture, no peak
    assert row.collectives[0].bytes_per_rank == (4 - 1) * 250 * 2  # one ring pass of bf16 shards
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    (row,) = zeroplan.estimate(model=str(cfg), gpus=2, engine="toy", seq_len=16, micro_batch=2).stages
    psi = row.collectives[0].elements
    assert row.peak.peak_bytes == 2 * psi + 4 * -(-psi // 2) * 3 + 1000 * 2 * 16  # default copies=2: grads + 2x4
    with pytest.raises(ValueError, match=r"copies=9: expected a whole number in \[1, 4\]"):
        zeroplan.estimate(1000, gpus=4, engine="toy", copies=9)
    with pytest.raises(ValueError, match="copies does not apply to engine 'fsdp2'"):
        zeroplan.estimate(1000, gpus=4, engine="fsdp2", copies=2)
    with pytest.raises(ValueError, match=r"param_dtype, .*\) does not apply to engine 'toy' \(it reads: copies\)"):
        zeroplan.estimate(1000, gpus=4, engine="toy", param_dtype="fp32")  # a policy field: not the toy's
    with pytest.raises(ValueError, match=r"reduce_dtype does not apply to engine 'toy' \(it reads: copies\)"):
        zeroplan.estimate(1000, gpus=4, engine="toy", reduce_dtype="fp32")  # FSDP2's own option: not the toy's


def test_a_toy_engine_answers_plan_and_sweep(toy, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    plan = zeroplan.plan(str(cfg), gpu_memory_bytes=10**9, gpus=2, engine="toy", seq_len=16)
    assert [o.candidate for o in plan.options] == ["copies=1", "copies=2", "copies=3"]
    assert plan.recommendation.candidate == "copies=1"
    frame = zeroplan.sweep(model=str(cfg), gpus=[2, 4], engine="toy", seq_len=16, copies=1)
    (row,) = zeroplan.estimate(model=str(cfg), gpus=4, engine="toy", seq_len=16, copies=1).stages
    psi = row.collectives[0].elements
    assert frame["optimizer_bytes"].tolist() == [4 * -(-psi // 2), 4 * -(-psi // 4)]
    assert frame["peak_bytes"].tolist()[1] == row.peak.peak_bytes
    assert frame["name"].astype(str).tolist() == ["toy copies=1"] * 2


def test_a_toy_engines_launcher_is_printed_through_its_record(toy, tmp_path):
    """``plan`` prints the recommendation under the key and title the toy declares (``Engine.launcher``); the
    built-in engines' keys stay in the JSON, null (``LAUNCHER_KEYS``: each some built-in engine's declared key)."""
    from zeroplan.engines import PLANNER_ENGINES
    from zeroplan.planning.records import LAUNCHER_KEYS
    from zeroplan.render.plan import plan_dict, to_table

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    plan = zeroplan.plan(str(cfg), gpu_memory_bytes=10**9, gpus=2, engine="toy", seq_len=16)
    assert plan.launchers == {"deepspeed": None, "fsdp2": None, "toy": {"copies": 1}}
    text = to_table(plan)
    assert 'Toy (exactly the copies predicted):\n{\n  "copies": 1\n}' in text
    assert "DeepSpeed config" not in text and "FSDP2 (" not in text
    rec = plan_dict(plan)["recommendation"]
    assert (rec["deepspeed"], rec["fsdp2"], rec["toy"]) == (None, None, {"copies": 1})
    declared = [get_engine(n).launcher.key for n in PLANNER_ENGINES if get_engine(n).launcher is not None]
    assert sorted(declared) == sorted(LAUNCHER_KEYS)


def test_a_toy_engines_validator_run_option_is_read_from_its_record(toy):
    """``validate``'s config reads the toy's run option from its record (``Engine.run_options``): checked by its
    type and by the planner option it is (``RunOption.planner``), at its default where not given, refused for
    every other engine by name, and no other engine's option reaches the toy."""
    from validate.config import ValidateConfig
    from zeroplan.types import error_line

    assert ValidateConfig(engine="toy").toy_copies is None and ValidateConfig(engine="toy").runner is None  # no checks
    assert ValidateConfig(engine="toy", toy_copies=3).model_dump()["toy_copies"] == 3
    for bad, message in ((dict(engine="toy", toy_copies=9), r"copies=9: expected a whole number in \[1, 4\]"),
                         (dict(engine="toy", toy_copies="x"), "toy_copies='x': Input should be a valid integer"),
                         (dict(toy_copies=2), "toy-copies: --engine toy only"),
                         (dict(engine="fsdp2", toy_copies=2), "toy-copies: --engine toy only"),
                         (dict(engine="toy", reduce_dtype="fp32"), "reduce-dtype: --engine fsdp2 only"),
                         (dict(engine="toy", zero_init=True, amsgrad=True),
                          "--zero-init: --engine deepspeed only; --amsgrad: --engine reference only")):  # fmt: skip
        with pytest.raises(ValueError) as info:
            ValidateConfig(**bad)
        assert __import__("re").search(message, error_line(info.value)), error_line(info.value)
    assert ValidateConfig(engine="toy", grad_accum=1, zero_init=False).toy_copies is None  # others' defaults: unset


def test_an_engines_peak_limit_is_the_one_check_of_estimate_plan_and_sweep(toy, tmp_path):
    from dataclasses import replace

    from zeroplan.engines import REGISTRY
    from zeroplan.engines.base import PeakLimit
    from zeroplan.policy import PrecisionPolicy

    def limits(options, spec):  # the toy's own limit: its peak is not modelled beyond three copies
        return PeakLimit("copies", "the toy's peak models up to 3 copies") if options.own["copies"] > 3 else None

    REGISTRY["toy"] = replace(toy, own_peak_limits=limits)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    zeroplan.estimate(model=str(cfg), gpus=2, engine="toy", seq_len=16, copies=3)
    zeroplan.estimate(1000, gpus=2, engine="toy", copies=4)  # no architecture: model states only, no peak asked
    for answer in (lambda: zeroplan.estimate(model=str(cfg), gpus=2, engine="toy", seq_len=16, copies=4),
                   lambda: zeroplan.plan(str(cfg), gpu_memory_bytes=10**9, gpus=2, engine="toy", copies=4),
                   lambda: zeroplan.sweep(model=str(cfg), gpus=[2], engine="toy", seq_len=16, copies=4)):  # fmt: skip
        with pytest.raises(ValueError, match="the toy.s peak models up to 3 copies"):
            answer()
    with pytest.raises(ValueError, match="got model_parallel=2"):  # a planner input: named as the config names it
        zeroplan.plan(str(cfg), gpu_memory_bytes=10**9, gpus=4, model_parallel=2, engine="toy")
    # the ladder (reference): outside its peak, fits fall back to model states with the same reason
    ref = get_engine("reference")
    fp32 = zeroplan.plan(str(cfg), gpu_memory_bytes=10**9, gpus=2, seq_len=16,
                         policy=PrecisionPolicy(param_dtype="fp32"))
    limit = ref.peak_limits(fp32.config.planner_options, fp32.config.model_architecture)
    assert limit.option == "policy" and fp32.fit_basis == f"fits on model states within the headroom: {limit.reason}"
    assert {o.peak for o in fp32.options} == {None}
    frame = zeroplan.sweep(model=str(cfg), gpus=[2], seq_len=16, checkpointing="none", param_dtype="fp32")
    assert frame["peak_bytes"].isna().all() and len(frame) == 4
    frame = zeroplan.sweep(model=str(cfg), gpus=[2], seq_len=16, checkpointing="none")  # the default policy: peaks
    assert frame["peak_bytes"].notna().all()
    assert ref.peak_limits(fp32.config.planner_options, None).reason == "the peak needs an architecture (--model)"


# ---------------------------------------------------------------- one byte table


def test_one_byte_table_for_every_engine_and_the_validator():
    from validate.compare import key
    from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
    from zeroplan.formulas.dtypes import BYTES_PER_ELEMENT, canonical_dtype, dtype_bytes

    assert DTYPE_BYTES is BYTES_PER_ELEMENT  # DeepSpeed's fp64 norm, int32 overflow buffer and bool tracker too
    assert [dtype_bytes(d) for d in ("torch.float64", "int32", "bool", "half")] == [8, 4, 1, 2]
    assert key("all-reduce", "optimizer_step", "torch.float64") == "all-reduce|optimizer_step|fp64"
    with pytest.raises(ValueError, match="unknown dtype 'fp64': expected one of bf16, fp16, fp32, fp8, int8"):
        canonical_dtype("fp64")  # a precision policy never names a dtype no engine trains in


# ---------------------------------------------------------------- the ds_config: read once, validated once


def test_one_estimate_reads_the_ds_config_once_and_validates_it_once(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import zeroplan.files
    from zeroplan.cli import app
    from zeroplan.engines.deepspeed import config as ds_config

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                              "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}))  # fmt: skip
    reads, validations = [], []
    real_read, real_validate = zeroplan.files.read_json, ds_config.DeepSpeedConfig.model_validate
    monkeypatch.setattr(zeroplan.files, "read_json", lambda *a, **k: reads.append(a) or real_read(*a, **k))
    monkeypatch.setattr(ds_config.DeepSpeedConfig, "model_validate",
                        lambda *a, **k: validations.append(a) or real_validate(*a, **k))  # fmt: skip
    monkeypatch.setattr(ds_config, "_PARSED", {})
    for engine in ("deepspeed", "reference"):  # the reference engine reads the file's policy and batch
        reads.clear(), validations.clear(), ds_config._PARSED.clear()
        r = CliRunner().invoke(app, ["estimate", "--model", str(cfg), "--gpus", "4", "--engine", engine,
                                     "--deepspeed-config", str(ds), "--json"])  # fmt: skip
        assert r.exit_code == 0, r.output
        assert [a[0] for a in reads if str(a[0]).endswith("ds.json")] == [ds]
        assert len(validations) == 1
        step = json.loads(r.stdout)["inputs"]["step"]
        assert (step["micro_batch"], step["grad_accum"]) == (2, 3)  # the file's batch, by the engine's rule


def test_estimate_imports_only_the_engine_it_asks_for():
    import os
    import subprocess
    import sys

    code = ("import sys; from zeroplan.cli import main; sys.argv = ['zeroplan', 'estimate', '--params', '7.5e9', "
            "'--gpus', '64']\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[2] for m in sys.modules if m.startswith('zeroplan.engines.')}))\n"
            "print(sorted(m for m in ('zeroplan.planning.config', 'zeroplan.sweeping.config', 'pandas') "
            "if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout  # fmt: skip
    assert out.splitlines()[-2] == "['base', 'declared', 'live', 'reference']"  # shared records; no DeepSpeed or FSDP2
    assert out.splitlines()[-1] == "[]"  # nor the plan's and the sweep's models (zeroplan's names are lazy)


# ---------------------------------------------------------------- the engine contract: one optimizer step


def test_the_reference_engine_counts_collectives_per_optimizer_step():
    """``EngineEstimate.collectives`` is one optimizer step for every engine: the reference rows at G = 4 are
    the paper's per-micro-step rows with every-micro-step collectives (ZeRO-2/3 reductions, ZeRO-3 all-gathers)
    summed over the 4 micro-steps, and the engine time model on them equals the paper's time model."""
    from zeroplan.engines.base import Workload
    from zeroplan.formulas.collectives import step_collectives
    from zeroplan.formulas.commtime import engine_step_time, step_time
    from zeroplan.presets import get_interconnect

    ref, numels, nd, g = get_engine("reference"), (1000, 24, 4096), 4, 4
    shapes = tuple((f"t{i}", (n,)) for i, n in enumerate(numels))
    settings = ref.settings()
    one = {r.stage: r for r in ref.estimate(Workload(shapes), nd, settings)}
    acc = {r.stage: r for r in ref.estimate(Workload(shapes, grad_accum=g), nd, settings)}
    calls = {0: (1,), 1: (1, 1), 2: (g, 1), 3: (g, g, g)}  # all-reduce; rs, ag; rs every micro-step; ag, ag, rs
    link = get_interconnect("nvlink4")
    for stage, n in calls.items():
        assert [c.micro_steps for c in acc[stage].collectives] == list(n)
        assert [c.elements for c in acc[stage].collectives] == [k * c.elements for k, c in zip(n, one[stage].collectives)]
        assert [c.bytes_per_rank for c in acc[stage].collectives] == [
            k * c.bytes_per_rank for k, c in zip(n, one[stage].collectives)]  # fmt: skip
        paper = step_collectives(stage, numels, nd, "fp16", "fp16", True)  # the default policy: fp16
        assert paper == one[stage].collectives  # G = 1: the paper's rows themselves
        want = step_time(stage, paper, nd, link, g).comm_s
        assert engine_step_time(acc[stage].collectives, nd, link, g).comm_s == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("engine", ["reference", "fsdp2"])
def test_the_gpu_presets_capability_sizes_the_peak_in_estimate_sweep_and_plan(tmp_path, engine):
    """``--gpu`` sizes the cuBLAS workspaces of the peak (``PlannerOptions.gpu_capability``) in estimate and sweep
    as in plan: an A100 (8, 0) keeps smaller workspaces than the H100 (9, 0) every command assumes without one."""
    from zeroplan.formulas.cuda_workspaces import library_workspaces

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    step = dict(model=str(cfg), seq_len=16, checkpointing="none", engine=engine)
    stage = {"stage": 3} if engine == "reference" else {}

    def peak(**kw) -> int:
        (row,) = zeroplan.estimate(gpus=2, **stage, **step, **kw).stages
        return row.peak.peak_bytes

    h100, a100 = peak(), peak(gpu="a100-80gb")
    cap = {"gpu": "a100-80gb"}
    assert h100 - a100 == library_workspaces((9, 0), False).bytes - library_workspaces((8, 0), False).bytes > 0
    assert zeroplan.estimate(gpus=2, **stage, **step, **cap).gpu_memory_bytes == 80 * 2**30  # the preset's memory
    frame = zeroplan.sweep(gpus=[2], **({"stages": [3]} if engine == "reference" else {}), **step, **cap)
    assert frame["peak_bytes"].tolist() == [a100]
    if engine == "reference":  # the ladder's stage-3 row (fsdp2's plan searches its own candidates)
        planned = zeroplan.plan(gpus=2, **step, **cap)
        assert next(o for o in planned.options if o.stage == 3 and not o.offload.any).peak.peak_bytes == a100


# ---------------------------------------------------------------- the vocabulary once


def test_each_engines_vocabulary_is_declared_once_in_its_record(tmp_path):
    """Engine-specific options live in the engine's ``own_options`` only (issue 16): ``PlannerOptions`` and
    ``EngineOptions`` hold none by name, every CLI flag of ``OWN_OPTION_PARAMS`` is some engine's declaration,
    and a bad value is refused by that declaration's check, in one line."""
    from dataclasses import fields

    from zeroplan.cli_options import OWN_OPTION_PARAMS
    from zeroplan.engines import PLANNER_ENGINES
    from zeroplan.engines.base import EngineOptions, PlannerOptions
    from zeroplan.types import error_line

    # grad_accum is the workload's G (every engine's peak limits may read it), not an engine's vocabulary
    assert [f.name for f in fields(PlannerOptions)] == ["stages", "policy", "flat_layout", "stage", "gpu_capability",
                                                        "grad_accum", "own"]  # fmt: skip
    assert EngineOptions.model_fields == {}
    fsdp2, deepspeed = get_engine("fsdp2"), get_engine("deepspeed")
    assert fsdp2.options == () and fsdp2.reads[:3] == ("reshard_after_forward", "param_dtype", "reduce_dtype")
    assert deepspeed.options == ("stage",) and "ds_config" in deepspeed.reads
    declared = {o.name for name in PLANNER_ENGINES for o in get_engine(name).own_options}
    assert set(OWN_OPTION_PARAMS.values()) <= declared
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    for bad, message in ((dict(reshard_after_forward="yes"), "reshard_after_forward=yes: expected true, false"),
                         (dict(reduce_dtype="fp33"), "reduce_dtype: unknown dtype 'fp33'")):  # fmt: skip
        with pytest.raises(ValueError) as info:
            zeroplan.estimate(model=str(cfg), gpus=2, engine="fsdp2", seq_len=16, **bad)
        assert error_line(info.value).startswith(message)
    with pytest.raises(ValueError) as info:
        zeroplan.estimate(1e9, gpus=2, engine="deepspeed", stage=3, ds_config=[1])
    assert error_line(info.value).startswith("ds_config=[1]: expected a parsed ds_config.json (a dict)")
