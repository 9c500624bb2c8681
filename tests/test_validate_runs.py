"""The validator end to end through ``zeroplan validate``: real gloo matrix, simulated N_d = 64, faults.

Each matrix runs once per module (fixtures); the tests read its JSON. The checks are exact where the
planner is exact: model states at the step boundary = prediction + Adam's one fp32 ``step`` scalar
(4 bytes), and every collective's elements and ring bytes = prediction.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from background import cli_job, key, validate_json, zeroplan  # noqa: F401 (zeroplan: the tests' way to run the CLI)
from tests.test_measured_rows import live_peak_misses
from zeroplan.formulas.memory import paper_model_states_bytes

REQUIRED = ("stage", "world_size", "mode", "backend", "predicted_model_states_bytes", "measured_model_states_bytes",
            "predicted_comm_bytes_per_rank", "derived_comm_bytes_per_rank", "measured_peak_bytes", "ok")  # fmt: skip
ADAM_STEP_BYTES = 4  # one fp32 step counter: the runtime's master shard is one flat tensor
K = 12  # mixed-precision Adam, ZeRO paper section 3.1


def run_json(tmp_path_factory, *args: str) -> tuple[SimpleNamespace, dict]:
    out = tmp_path_factory.mktemp("validate") / "result.json"
    proc = zeroplan("validate", *args, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


# The module's runs, each one of the session's background jobs (tests/background.py: started at collection,
# niced, while the other tests run; this module runs last): ``zeroplan validate ARGS --json FILE``, in the
# order the tests read them.
BACKGROUND_CLI = {
    # the default matrix: stages 0-3 at N_d = 2 and 4 on gpt-tiny, gloo (the CI regression)
    "real": [],
    # the MLP at N_d = 1 (no collectives at all) and N_d = 3 (odd: most tensors padded)
    "real_mlp": ["--model", "mlp-tiny", "--world-size", "1", "--world-size", "3"],
    # a 13.9M-parameter GPT from --params (test_a_params_model_passes_parity_within_the_derived_allowance)
    "params": ["--params", "2e6", "--world-size", "2", "--stage", "0", "--seq-len", "16", "--batch-per-rank", "1"],
    # rank 0 of N_d = 64 on a fake group, 1.2B-parameter GPT on fake tensors
    "simulated": ["--simulated", "--world-size", "64", "--model", "gpt-1b-wide", "--steps", "2", "--batch-per-rank", "1"],
    # mlp-tiny at N_d = 1 held to 1e-6 (test_out_of_tolerance_exits_1_and_still_writes_the_full_result; exits 1)
    "tolerance": ["--model", "mlp-tiny", "--world-size", "1", "--stage", "0", "--tolerance", "1e-6"],
}  # fmt: skip


@pytest.fixture(scope="module")
def real(request, background):
    return validate_json(background, request.module, "real")


@pytest.fixture(scope="module")
def real_mlp(request, background):
    return validate_json(background, request.module, "real_mlp")


@pytest.fixture(scope="module")
def simulated(request, background):
    return validate_json(background, request.module, "simulated")


def check_row_exact(row: dict) -> None:
    assert all(k in row for k in REQUIRED)
    assert row["adam_step_bytes"] == ADAM_STEP_BYTES
    # lower and upper bound at once: every live byte at the step boundary is a predicted model state
    assert row["measured_model_states_bytes"] == row["predicted_model_states_bytes"] + ADAM_STEP_BYTES
    assert row["checks"]["model_states_steady"] is True
    # measured: elements per (collective, phase, dtype) observed at dispatch = the planner's, exactly
    measured = {k: v["elements"] for k, v in row["measured_collectives"].items()}
    assert measured == {k: v["elements"] for k, v in row["predicted_collectives"].items()}
    assert row["checks"]["collectives_match"] is True
    assert row["measured_collective_elements"] == row["predicted_collective_elements"]
    assert all(v["calls"] >= 1 for v in row["measured_collectives"].values())
    # derived: the ring rule per observed call rounds each call's chunk up, so bucketed calls may add up
    # to more bytes than one call of the sum, by less than one chunk element per call and peer
    nd = row["world_size"]
    for k, v in row["measured_collectives"].items():
        predicted, passes = row["predicted_collectives"][k]["bytes_per_rank"], 2 if "all-reduce" in k else 1
        assert 0 <= v["derived_bytes_per_rank"] - predicted < v["calls"] * passes * (nd - 1) * 2  # bf16
    assert row["measured_peak_bytes"] >= row["measured_model_states_bytes"]
    # two steps timed without probes, none on fake tensors (no arithmetic: validate.worker.unprobed_steps), what a
    # simulated run on CPU has unless told otherwise (no run here does)
    fake = row["mode"] == "simulated" and row["device"] == "cpu"
    assert row["step_time_s"]["probed"] > 0 and (row["step_time_s"]["unprobed"] > 0) is not fake
    assert row["step_time_s"]["unprobed_steps"] == (0 if fake else 2)
    assert row["ok"] is True


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_real_gloo_matrix_matches_the_planner_exactly(real, stage, world_size):
    proc, report = real
    (row,) = [r for r in report["rows"] if r["stage"] == stage and r["world_size"] == world_size]
    assert (row["mode"], row["backend"]) == ("real", "gloo")
    check_row_exact(row)
    # every phase's peak at this row's recorded error + max(64 B, 0.05%) (tests/test_measured_rows.py), not 2%
    name = f"reference-gpt-tiny-z{stage}-nd{world_size}"
    assert live_peak_misses(name, row["measured_peak_bytes_by_phase"], row["predicted_peak_bytes_by_phase"]) == []
    assert row["parity"]["ok"] is True  # parameters and gradients equal the single-process reference
    # second source, the profiler's gloo events: gloo runs the reduction (all-reduce at stage 0, each
    # reduce-scatter at stages 1-3) as an all-reduce of the full buffer; there is no gloo reduce-scatter
    reduced = "all-reduce|backward|bf16" if stage == 0 else "reduce-scatter|backward|bf16"
    assert (
        row["profiler_comms"]["gloo:all_reduce"]["input_numel"]
        == row["predicted_collectives"][reduced]["elements"]
    )
    assert set(row["profiler_comms"]) <= {"gloo:all_reduce", "gloo:all_gather"}
    # and the planner's padded count is the paper's closed form up to padding (< N_d elements per tensor)
    paper = paper_model_states_bytes(row["psi"], world_size, K, stage)
    assert 0 <= row["predicted_model_states_bytes"] - paper <= (4 + K) * 26 * world_size  # 26 tensors
    assert report["ok"] is True and "all rows within tolerance" in proc.stdout


@pytest.mark.distributed
def test_real_runs_at_world_size_1_send_nothing_and_at_3_pad_every_tensor(real_mlp):
    _, report = real_mlp
    for row in report["rows"]:
        check_row_exact(row)
        assert row["parity"]["ok"] is True
        if row["world_size"] == 1:
            assert row["measured_collectives"] == {} and row["derived_comm_bytes_per_rank"] == 0
    # mlp-tiny at N_d = 3, stage 3: 7,989 params padded per tensor to 7,995 (2,310+70+4,900+70+630+9
    # -> 2,310+72+4,902+72+630+9), shard 2,665; 16 B per element of the shard.
    (s3,) = [r for r in report["rows"] if r["stage"] == 3 and r["world_size"] == 3]
    assert s3["predicted_model_states_bytes"] == 16 * 2665


@pytest.mark.distributed
def test_a_params_model_passes_parity_within_the_derived_allowance(request, background):
    # --params 2e6 builds a 13.9M-parameter GPT (1 x d256); its gradients once failed a fixed allowance
    # (3.4e-4 against 7.1e-5) though memory and traffic matched exactly.
    _, report = validate_json(background, request.module, "params")
    (row,) = report["rows"]
    assert row["psi"] == 13_930_240 and row["model"] == "gpt~2e+06 built as 1 x d256, Ψ = 13,930,240"
    check_row_exact(row)
    assert live_peak_misses("reference-gpt-13.9m-z0-nd2", row["measured_peak_bytes_by_phase"],
                            row["predicted_peak_bytes_by_phase"]) == []  # fmt: skip
    p = row["parity"]
    assert p["ok"] is True and 0 < p["grad_rel_diff"] <= p["grad_rtol"]
    assert p["param_mean_abs_diff"] <= p["param_mean_atol"] and p["unit_roundoff"] == 2**-8


def test_simulated_n64_billion_parameter_model_matches_the_planner(simulated):
    _, report = simulated
    assert [r["stage"] for r in report["rows"]] == [0, 1, 2, 3]
    for row in report["rows"]:
        assert (row["mode"], row["backend"], row["world_size"]) == ("simulated", "fake", 64)
        assert row["psi"] >= 1e9
        check_row_exact(row)
        assert row["parity"] is None  # fake tensors carry no values
    # ZeRO Figure 1 shape: stage 3 holds (2+2+K)Ψ/N_d, within padding
    s3 = report["rows"][3]
    assert s3["predicted_model_states_bytes"] == pytest.approx(16 * s3["psi"] / 64, rel=1e-6)


def _netns_available() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, check=False).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.distributed
@pytest.mark.skipif(not _netns_available(), reason="unshare -n needs Linux, util-linux and CAP_SYS_ADMIN")
def test_wire_bytes_show_gloo_reduce_scatter_costs_an_all_reduce(tmp_path_factory):
    _, report = run_json(tmp_path_factory, "--wire", "--world-size", "2", "--stage", "0", "--stage", "1",
                         "--stage", "3")  # fmt: skip
    ratio = {r["stage"]: r["wire_to_derived"] for r in report["rows"]}
    # stage 0: one all-reduce, sent as a ring: wire = logical bytes + TCP/IP and barrier overhead
    assert 1.0 <= ratio[0] <= 1.3
    # stage 1: RS (sent as an all-reduce: 2x) + AG (1x) over 2 logical units -> 1.5x stage 0's ratio;
    # stage 3: AG + AG + RS(2x) over 3 -> 4/3. The overhead ratio of stage 0 divides out.
    assert ratio[1] / ratio[0] == pytest.approx(1.5, abs=0.1)
    assert ratio[3] / ratio[0] == pytest.approx(4 / 3, abs=0.1)


def worker_pids(token: str) -> set[int]:
    """Rank processes whose environment carries ``token`` (so runs of other sessions do not count)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline, environ = (entry / "cmdline").read_bytes(), (entry / "environ").read_bytes()
            except OSError:
                continue
            if b"validate.worker" in cmdline and token.encode() in environ:
                pids.add(int(entry.name))
    return pids


@pytest.mark.distributed
@pytest.mark.parametrize("fault, timeout, message", [
    ("crash:1", 120, "rank 1 exited with code 3"),
    ("hang:1", 20, "no result after 20 s (a rank hangs?)"),
])  # fmt: skip
def test_a_failing_rank_ends_the_run_cleanly(tmp_path, fault, timeout, message):
    token = uuid.uuid4().hex
    out = tmp_path / "result.json"
    t0 = time.monotonic()
    env = {"ZEROPLAN_VALIDATE_FAULT": fault, "ZEROPLAN_TEST_TOKEN": token}
    proc = zeroplan("validate", "--model", "mlp-tiny", "--world-size", "2", "--stage", "0",
                    "--timeout", str(timeout), "--json", str(out), env=env)  # fmt: skip
    assert proc.returncode == 1
    assert message in proc.stderr and proc.stderr.startswith("zeroplan: error: ")
    assert proc.stdout == "" and not out.exists() and list(tmp_path.iterdir()) == []
    assert time.monotonic() - t0 < timeout + 30
    assert worker_pids(token) == set()  # no orphan rank left behind


def test_out_of_tolerance_exits_1_and_still_writes_the_full_result(request, background):
    # mlp-tiny at N_d = 1 keeps 4 bytes (Adam's step) beyond the prediction: 4 / 127,824 = 3e-5 > 1e-6.
    proc = SimpleNamespace(**background.result(key(request.module, "tolerance"), cli_job(BACKGROUND_CLI["tolerance"])))
    assert proc.returncode == 1, proc.stderr
    report = proc.report  # the --json file, read back
    assert report["ok"] is False and report["rows"][0]["checks"]["model_states_within_tolerance"] is False
    assert "OUT OF TOLERANCE: stage 0 N_d=1: model_states_within_tolerance" in proc.stdout


BIG = str(10**30)


@pytest.mark.parametrize("args, message", [
    (["--stage", "5"], "stages=5: must be one of 0, 1, 2, 3"),
    (["--world-size", "0"], "world_sizes=0: must be >= 1"),
    (["--model", "nope"], "model='nope': expected one of gpt-tiny, mlp-tiny, gpt-1b-wide"),
    (["--steps", "1"], "steps=1: must be >= 2"),
    (["--steps", BIG], f"steps={BIG}: at most 1000"),
    (["--params", "-3"], "params"),
    (["--simulated", "--wire"], "--wire counts real traffic"),
    (["--device", "gpu"], "device"),
    (["--seq-len", "17"], "seq-len=17: model gpt-tiny has only 16 positions"),
    (["--seq-len", "1e9"], "Invalid value for '--seq-len'"),
    (["--seq-len", "1000000000"], "seq-len=1000000000: model gpt-tiny has only 16 positions"),
    (["--model", "mlp-tiny", "--seq-len", "4"], "seq-len=4: model mlp-tiny is an MLP, it has no sequence"),
    (["--batch-per-rank", BIG], "batch_per_rank=100000...(31 digits): must be <= 4,096"),
    (["--simulated", "--world-size", BIG], "world_sizes=100000...(31 digits): must be <="),
    (["--simulated", "--world-size", "1000000"], "a simulated world is at most 65536 ranks"),
    (["--world-size", "1000"], "ranks on this node, at most 4 per usable core"),
    (["--params", "1e12", "--world-size", "1"], "available; use a smaller model, fewer ranks or --simulated"),
    (["--model", "gpt-tiny", "--params", "1e7"], "give --model or --params, not both"),
    (["--nnodes", "2", "--world-size", "3", "--master-port", "29500"], "give one --world-size, a multiple of it"),
    (["--nnodes", "2", "--world-size", "2"], "give --master-addr and --master-port of node 0"),
    (["--nnodes", "2", "--node-rank", "2"], "need 0 <= node-rank < nnodes"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2_before_any_rank_starts(tmp_path, args, message):
    # In process: every check runs in the parent, so no rank is ever started for these.
    from typer.testing import CliRunner

    from clicheck import assert_one_line_error
    from zeroplan.cli import app

    result = CliRunner().invoke(app, ["validate", *args, "--json", str(tmp_path / "r.json")])
    assert_one_line_error(result, message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where, message", [
    ("no/such/dir.json", "does not exist"),
    (".", "is a directory; give a file name"),
    ("/proc/r.json", "cannot write there"),
    ("x" * 300 + ".json", "cannot write there (File name too long)"),
])  # fmt: skip
def test_json_path_is_checked_first(tmp_path, where, message):
    from typer.testing import CliRunner

    from clicheck import assert_one_line_error
    from zeroplan.cli import app

    path = where if where.startswith("/") else str(tmp_path / where)
    # --steps 1 is bad too: the path is reported first, before the run's own options are checked
    assert_one_line_error(CliRunner().invoke(app, ["validate", "--steps", "1", "--json", path]), message)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, allocator statistics)")
def test_real_nccl_world_size_1_on_gpu(tmp_path_factory):
    _, report = run_json(tmp_path_factory, "--world-size", "1", "--device", "cuda")
    for row in report["rows"]:
        assert row["backend"] == "nccl"
        # the caching allocator rounds each block up to 512 bytes: a few KiB over at most
        assert 0 <= row["measured_model_states_bytes"] - row["predicted_model_states_bytes"] <= 512 * 40


@pytest.mark.parametrize("test, reason", [
    (test_wire_bytes_show_gloo_reduce_scatter_costs_an_all_reduce,
     "unshare -n needs Linux, util-linux and CAP_SYS_ADMIN"),
    (test_real_nccl_world_size_1_on_gpu, "needs a CUDA GPU (NCCL, allocator statistics)"),
])  # fmt: skip
def test_host_dependent_tests_say_why_they_skip(test, reason):
    # A skip without a reason hides what was not checked; -ra prints this reason in every test summary.
    (skipif,) = [m for m in test.pytestmark if m.name == "skipif"]
    assert skipif.kwargs["reason"] == reason
