"""Issue 17, "every setting a run has is an option": the planner commands, from their command lines alone, predict a
run measured with real ``fully_shard`` on gloo CPU ranks (tests/test_fsdp2_wrap.py ``RECORDED``: transformers'
own classes, 2 steps, materialized init, torch's default single-tensor Adam on the CPU, which ``--device cpu`` takes
without ``--no-foreach``: estimation/workload.py ``default_foreach``), and ``zeroplan validate
--engine fsdp2 --fsdp-wrap FILE`` hands the runner exactly that file.

Each of ``--device cpu`` (gloo's reduce-scatter copy, no CUDA blocks or workspaces, torch's CPU optimizer path),
``--init materialized`` (the whole model at init), the device's optimizer path (an explicit ``--foreach`` moves the
step) and ``--fsdp-wrap`` moves at least one phase of
these rows by more than ``MARGIN`` (checked below), so a command that dropped any of them fails here. Before this
file the planner's ``--device cpu`` path was asserted only against another prediction (cpu < cuda).
"""

from __future__ import annotations

import json
import re

import pytest
from clicheck import assert_one_line_error, run, run_json
from test_fsdp2_wrap import CONFIGS, FILE, RECORDED

from zeroplan.allocator.reserved import NO_CUDA_ALLOCATOR
from zeroplan.formulas.peak import PHASES

MARGIN = 0.0005  # as tests/test_fsdp2_wrap.py: these rows are predicted to the byte
# RECORDED rows of transformers' own classes with the loss in forward (the planner's tree); not the validator's
# CausalLM (hf=False) nor labels=False, which no planner option expresses
ROWS = ("qwen2-torchtitan", "qwen2-file", "qwen2-file-3", "qwen2-torchtitan-4", "gpt2-torchtitan",
        "qwen2-accelerate-bf16", "gpt2-tied-accelerate", "qwen2-wide-vocab-torchtitan")  # fmt: skip
RUN = ("--device", "cpu", "--init", "materialized")  # the CPU run the validator measured (foreach: the device's)


def _argv(name: str, tmp_path) -> list[str]:
    config, nd, kw, _ = RECORDED[name]
    model = tmp_path / f"{config}.json"
    model.write_text(json.dumps(CONFIGS[config]))
    wrap = kw["wrap"]
    if isinstance(wrap, dict):
        (tmp_path / "wrap.json").write_text(json.dumps(wrap))
        wrap = str(tmp_path / "wrap.json")
    return ["--model", str(model), "--gpus", str(nd), "--engine", "fsdp2", "--fsdp-wrap", wrap,
            "--seq-len", str(kw.get("seq_len", 32)), "--micro-batch", str(kw.get("batch_per_rank", 2)),
            "--param-dtype", kw.get("param_dtype", "fp32")]  # fmt: skip


def _within(predicted: dict, measured: list[int], where: str) -> None:
    for phase, got in zip(PHASES, measured):
        assert abs(got - predicted[phase]) / got <= MARGIN, (where, phase, got, predicted[phase])


@pytest.mark.parametrize("name", ROWS)
def test_estimate_sweep_and_plan_predict_the_measured_cpu_run(name, tmp_path):
    argv, peaks = _argv(name, tmp_path), RECORDED[name][3]
    (row,) = run_json("estimate", *argv, *RUN)["stages"]
    _within(row["phases"], peaks[row["peak_rank"]], f"estimate, rank {row['peak_rank']}")  # the worst rank's row
    assert abs(row["peak_bytes"] - max(map(max, peaks))) <= MARGIN * row["peak_bytes"]
    (swept,) = run_json("sweep", *argv, *RUN, "--checkpointing", "none")["rows"]  # sweep's default is full
    assert (swept["peak_bytes"], swept["peak_rank"]) == (row["peak_bytes"], row["peak_rank"])
    planned = run_json("plan", *argv, *RUN, "--gpu", "h100-80gb")
    # plan searches the decoder layers' reshard (a file's value decides) and checkpointing: the rows measured
    (option,) = (s for s in planned["stages"] if s["label"] == "reshard_after_forward=True, checkpointing none")
    assert option["phases"] == row["phases"] and option["name"] == row["name"]


@pytest.mark.parametrize("dropped", range(len(RUN) // 2 + 2))
def test_each_setting_of_the_run_moves_a_phase(dropped, tmp_path):
    """Without any one of ``--device cpu``, ``--init materialized``, the CPU's single-tensor Adam (``--foreach``
    given: an explicit flag wins over the device's default, so a default that ignored the device misses as this
    does) or the file's wrapping, the same command misses the measured row by more than the margin: the test above
    cannot pass with one dropped."""
    argv, peaks = _argv("qwen2-file", tmp_path), RECORDED["qwen2-file"][3]
    run_args = list(RUN)
    if dropped < 2:
        del run_args[2 * dropped:2 * dropped + 2]
    elif dropped == 2:
        run_args.append("--foreach")
    else:
        argv[argv.index("--fsdp-wrap") + 1] = "blocks"
    (row,) = run_json("estimate", *argv, *run_args)["stages"]
    assert any(abs(got - row["phases"][p]) / got > MARGIN for p, got in zip(PHASES, peaks[0]))


def test_the_python_api_and_the_configs_take_the_devices_optimizer_path():
    """``foreach`` not given (or None): torch's default for the run's device in ``estimate``, ``EstimateConfig``,
    ``PlanConfig`` and ``SweepConfig`` alike (estimation/workload.py ``device_foreach``); given, it wins."""
    from zeroplan import EstimateConfig, PlanConfig, SweepConfig, estimate

    def step(**kw):
        return estimate(model="llama2-7b", gpus=8, engine="fsdp2", **kw).stages[0].peak.by_phase()["optimizer_step"]

    assert step(device="cpu") == step(device="cpu", foreach=False) < step(device="cpu", foreach=True)
    assert step() == step(foreach=True) > step(foreach=False)  # CUDA (the default): the multi-tensor path
    cpu, common = {"device": "cpu"}, dict(model="llama2-7b", engine="fsdp2", gpu="h100-80gb")
    for config in (EstimateConfig, PlanConfig, SweepConfig):
        assert [config(**common, engine_options=o, foreach=f).foreach
                for o, f in ((cpu, None), ({}, None), (cpu, True), ({}, False))] == [False, True, True, False], config


def test_a_cpu_run_has_no_reserved_bytes_and_fits_on_its_live_peak(tmp_path):
    """``--device cpu``: no CUDA caching allocator to replay (allocator/reserved.py ``replayed_on``): reserved is null
    with its reason on estimate and on every plan row, and "fits" compares the live peak: with the memory exactly the
    measured row's peak, the row fits (a replay reserves whole segments, more than the live bytes: it would not)."""
    argv, peaks = _argv("qwen2-torchtitan", tmp_path), RECORDED["qwen2-torchtitan"][3]
    memory = str(max(map(max, peaks)))  # predicted to the byte (the test above)
    (row,) = run_json("estimate", *argv, *RUN, "--gpu-memory", memory)["stages"]
    assert (row["reserved_bytes"], row["reserved_not_replayed"], row["fits"]) == (None, NO_CUDA_ALLOCATOR, True)
    assert "reserved_not_replayed" not in run_json("estimate", *argv, "--gpu-memory", memory)["stages"][0]  # CUDA
    planned = run_json("plan", *argv, *RUN, "--gpu-memory", memory)
    assert {(o["reserved_bytes"], o["reserved_not_replayed"]) for o in planned["stages"]} == {(None, NO_CUDA_ALLOCATOR)}
    (option,) = (s for s in planned["stages"] if s["label"] == "reshard_after_forward=True, checkpointing none")
    assert option["fits"] and planned["fit_basis"].startswith("fits on the peak of live bytes per GPU")
    text = run("plan", *argv, *RUN, "--gpu-memory", memory).stdout
    assert f"reserved —: {NO_CUDA_ALLOCATOR}." in text and "fits: the peak of live bytes" in text


def test_validate_hands_the_wrapping_file_to_the_runner(tmp_path, monkeypatch):
    """``zeroplan validate --engine fsdp2 --fsdp-wrap FILE`` reads the file once and the runner's settings carry it
    (``Fsdp2Settings.from_validate``; ``runner_calls`` makes its calls: tests/test_fsdp2_wrap.py); a bad file is one
    line before any rank starts."""
    pytest.importorskip("torch")
    import validate.api
    from validate.engines.fsdp2 import Fsdp2Settings

    from zeroplan.engines.fsdp2.wrap import parse_wrapping

    seen = []

    def capture(config):
        seen.append(config)
        raise KeyboardInterrupt  # no run: the command stops where it would start the ranks

    monkeypatch.setattr(validate.api, "run_validation", capture)
    argv = _argv("qwen2-file", tmp_path)
    given = ["validate", "--engine", "fsdp2", "--hf", "--model", argv[1], "--world-size", "2",
             "--fsdp-wrap", argv[argv.index("--fsdp-wrap") + 1]]  # fmt: skip
    assert run(*given).exit_code == 130
    (config,) = seen
    assert Fsdp2Settings.from_validate(config).wrapping() == parse_wrapping(FILE)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"units": [{"modules": ["model.layers.*"]}]}))
    assert_one_line_error(run(*given[:-1], str(bad)), "the last entry must be the root alone")
    assert len(seen) == 1


def test_fsdp_wrap_help_names_torchtitans_units():
    # rich reads "[norm, output]" as markup and drops it: the help must say it in words
    for command in ("estimate", "plan", "sweep", "validate"):
        text = re.sub(r"[\s│]+", " ", run(command, "--help").stdout)
        assert "each block, the final norm and output as one unit kept gathered, the root" in text, command
