"""Issue 9: every bad input refused up front in one line, no lost or clobbered file, sweeps that stream.

Each class is fixed at one root (``zeroplan.types`` ranges, ``zeroplan.files`` reader and writer,
``OneLineErrors``); the cases here are the ones the issue reports, so they stay fixed.
"""

import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import zeroplan
import zeroplan.presets
from clicheck import assert_one_line_error
from zeroplan.cli import app
from zeroplan.cli_options import refuse_repeated
from zeroplan.engines.deepspeed import deepspeed_config, from_deepspeed
from zeroplan.files import MAX_JSON_BYTES, MAX_JSON_DEPTH, read_json, write_text_atomic
from zeroplan.parsing import parse_bytes, parse_count, parse_whole
from zeroplan.planning.plan import max_params, min_gpus
from zeroplan.render.schemas import json_text
from zeroplan.render.sweep import write_csv, write_parquet
from zeroplan.sweeping.config import SweepConfig
from zeroplan.sweeping.grid import sweep_config, sweep_frames

LONG_POSITIONS = str(Path(__file__).parent / "data" / "long-positions-gpt2.json")  # 2**24 positions

runner = CliRunner()
BIG = "1" + "0" * 400
E30 = str(10**30)


def invoke(argv, tmp_path=None):
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    return runner.invoke(app, argv)


# ---------------------------------------------------------------- files: the one reader


@pytest.fixture
def odd_files(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "urandom").symlink_to("/dev/urandom")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "nan.json").write_text('[1, NaN]')
    (tmp_path / "inf.json").write_text("[1e400]")
    (tmp_path / "digits.json").write_text("[" + "7" * 5000 + "]")
    with open(tmp_path / "huge.json", "wb") as f:  # sparse: the size is refused before any read
        f.truncate(MAX_JSON_BYTES + 1)
    return tmp_path


@pytest.mark.parametrize(
    "name, message",
    [
        ("fifo", "not a regular file"),
        ("zero", "not a regular file"),
        ("urandom", "not a regular file"),
        (".", "not a regular file"),
        ("deep.json", f"nested 100000 deep, above the limit of {MAX_JSON_DEPTH}"),
        ("nan.json", "NaN is not a JSON number"),
        ("inf.json", "1e400 is too large"),
        ("digits.json", "more than 4300 digits"),
        ("huge.json", "above the limit of 67,108,864"),
        ("missing.json", "No such file"),
    ],
)
def test_reader_refuses_odd_files(odd_files, name, message):
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        read_json(odd_files / name, "shapes file")
    assert time.monotonic() - start < 5  # a FIFO must not block, /dev/zero must not be read


@pytest.mark.parametrize("name", ["fifo", "urandom", "deep.json", "nan.json", "huge.json"])
@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "--shapes", "{f}"],
        ["estimate", "--params", "7B", "--deepspeed-config", "{f}"],
        ["sweep", "--shapes", "{f}"],
        ["plot", "--view", "validate", "--results", "{f}", "--out", "{d}/v.png"],
    ],
)
def test_cli_refuses_odd_files_in_one_line(odd_files, name, argv):
    argv = [a.replace("{f}", str(odd_files / name)).replace("{d}", str(odd_files)) for a in argv]
    assert_one_line_error(runner.invoke(app, argv), repr(str(odd_files / name)))


def test_strings_with_brackets_are_not_nesting(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"a[": ["[" * 500, {"}": "]]]"}]}))
    assert read_json(tmp_path / "s.json", "x") == {"a[": ["[" * 500, {"}": "]]]"}]}


# ---------------------------------------------------------------- numbers: one range per quantity


@pytest.mark.parametrize(
    "argv, message",
    [
        (["estimate", "--params", "7B", "--gpus", BIG], "gpus=100000...(401 digits): must be <= 16,777,216"),
        (["estimate", "--params", "7B", "--gpus", E30], "gpus=100000...(31 digits): must be <= 16,777,216"),
        (["estimate", "--params", "1e300"], "must be <= 1e+15 parameters"),
        (["estimate", "--params", "2e15"], "params=2000000000000000: must be <= 1e+15 parameters"),
        (["estimate", "--params", "1e99999999"], "out of range"),
        (["estimate", "--params", "7.5"], "must be a whole number of parameters"),
        (["estimate", "--params", "7B", "--gpu-memory", "1.5"], "gpu-memory='1.5': must be a whole number of bytes"),
        (["estimate", "--params", "7B", "--gpu-memory", "2EiB"], "expected a size"),
        (["estimate", "--params", "7B", "--gpu-memory", "2e18"], "must be <= 1,152,921,504,606,846,976"),
        (["sweep", "--model", "gpt2-xl", "--micro-batch", E30], "micro_batch=100000...(31 digits): must be <= 65,536"),
        (["sweep", "--model", "gpt2-xl", "--seq-len", E30], "seq_len=100000...(31 digits): must be <= 16,777,216"),
        (["sweep", "--params", "7B", "--model-parallel", E30], "model_parallel=100000...(31 digits): must be <="),
        (["sweep", "--params", "7B", "--gpus", "8," + BIG], "gpus=100000...(401 digits): must be <= 16,777,216"),
        (["sweep", "--params", ",".join(str(10**9 + i) for i in range(1000)), "--gpus",
          ",".join(str(i) for i in range(1, 30_001))], "above the limit of 1e+08: split it"),  # fmt: skip
        (["sweep", "--model", LONG_POSITIONS, "--seq-len", "16777216", "--micro-batch", "65536", "--checkpointing",
          "none"], "above the limit of 1.15e+18 (1 EiB)"),  # fmt: skip
        (["sweep", "--model", "gpt2-xl", "--seq-len", "1025"], "seq_len=1025: above the model's maximum positions"),
        (["plan", "--params", "7B", "--gpu", "h100-80gb", "--bw", "1e-300"], "bw_gbps=1e-300: must be between 0.001"),
        (["plan", "--params", "7B", "--gpu", "h100-80gb", "--bw", "1e300"], "must be between 0.001 and 1e+06 GB/s"),
        (["plan", "--params", "7B", "--gpu", "h100-80gb", "--inter-bw", "1e-300"], "inter_bw_gbps=1e-300"),
        (["plan", "--params", "7B", "--gpu", "h100-80gb", "--peak-tflops", "1e-300"], "peak_tflops=1e-300"),
        (["plan", "--params", "7B", "--gpu", "h100-80gb", "--mfu", "1e-300"], "mfu=1e-300: must be between 0.001 and 1"),
        (["plan", "--params", "7B", "--gpu", "h100-80gb", "--gpus", E30], "must be <= 16,777,216"),
        (["plan", "--params", "7B", "--gpu", "h100-80gb", "--grad-accum", E30], "must be <= 65,536"),
        (["plan", "--params", "7B", "--gpu", "h100-80gb", "--host-memory", "1000.5"], "host-memory='1000.5': must be a whole number of bytes"),
    ],
)
def test_out_of_range_numbers_are_one_line(argv, message):
    assert_one_line_error(invoke(argv), message)


def test_huge_dimensions_in_a_shapes_file(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"w": [int(BIG), 3], "b": [3]}))
    for command in ("estimate", "sweep"):
        r = invoke([command, "--shapes", str(tmp_path / "s.json")])
        assert_one_line_error(r, "more than 1e+15 elements in one tensor")


def test_huge_byte_counts_in_a_results_file(tmp_path):
    row = dict(stage=1, world_size=2, mode="real", backend="gloo", predicted_model_states_bytes=int(BIG),
               measured_model_states_bytes=1, predicted_comm_bytes_per_rank=1, measured_comm_bytes_per_rank=1, ok=True)  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps({"rows": [row]}))
    r = invoke(["plot", "--view", "validate", "--results", "{d}/r.json", "--out", "{d}/v.png"], tmp_path)
    assert_one_line_error(r, "predicted_model_states_bytes=100000...(401 digits): must be <=")
    assert not (tmp_path / "v.png").exists()


def test_integers_are_parsed_exactly():
    assert parse_bytes("9007199254740993") == 9007199254740993  # 2**53 + 1: a float would give ...992
    assert parse_count("999999999999999") == 999_999_999_999_999
    assert parse_count("7.5B") == 7_500_000_000 and isinstance(parse_count("7.5B"), int)
    assert parse_count("1.5K") == 1500
    r = invoke(["estimate", "--params", "7B", "--gpu-memory", "9007199254740993", "--json"])
    assert json.loads(r.stdout)["inputs"]["gpu_memory_bytes"] == 9007199254740993
    with pytest.raises(ValueError, match="out of range"):
        parse_whole("9" * 5000, "gpus")


# ---------------------------------------------------------------- DeepSpeed sections, strict


@pytest.mark.parametrize(
    "config, message",
    [
        ({"fp16": {"enabled": "false"}}, "fp16.enabled='false': must be true or false"),
        ({"bf16": {"enabled": 1}}, "bf16.enabled=1: must be true or false"),
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled='auto': the HF Trainer fills in 'auto'"),
        ({"optimizer": {"type": "SGD", "params": {"momentum": "0"}}}, "optimizer.params.momentum='0'"),
        ({"optimizer": {"type": "SGD", "params": [0.9]}}, "'optimizer.params' must be an object"),
        ({"optimizer": {"type": "SGD", "params": "momentum=0.9"}}, "'optimizer.params' must be an object"),
        ({"optimizer": {"type": 7}}, "optimizer.type=7: must be a string"),
        ({"data_types": {"grad_accum_dtype": 32}}, "data_types.grad_accum_dtype=32: must be a string"),
        ({"zero_optimization": {"offload_param": {"device": True}}}, "offload_param.device=True"),
    ],
)
def test_deepspeed_sections_are_strict(tmp_path, config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        from_deepspeed(config)
    (tmp_path / "ds.json").write_text(json.dumps(config))
    result = invoke(["estimate", "--params", "7B", "--deepspeed-config", "{d}/ds.json"], tmp_path)
    if "'auto'" in message:  # the command line resolves "auto" as the HF Trainer would, which needs a ZeRO section
        message = "no zero_optimization section: accelerate's DeepSpeedPlugin refuses it"
    assert_one_line_error(result, message)


def test_deepspeed_keys_zeroplan_does_not_read_are_allowed():
    config = {"train_batch_size": "auto", "scheduler": {"type": "WarmupLR"}, "fp16": {"enabled": False, "loss_scale": 0}}
    assert from_deepspeed(config) == {"stage": 0, "param_dtype": "fp32"}


# ---------------------------------------------------------------- never a non-finite number


JSON_COMMANDS = [
    ["estimate", "--params", "1e15", "--gpus", str(2**24), "--json"],
    ["estimate", "--params", "1", "--json"],
    ["plan", "--params", "1e15", "--gpu-memory", "1", "--gpus", str(2**24), "--bw", "0.001", "--inter-bw", "0.001",
     "--peak-tflops", "0.001", "--mfu", "0.001", "--json"],  # fmt: skip
    ["plan", "--model", "gpt2-xl", "--gpu", "h100-80gb", "--offload", "nvme", "--gpus", "1", "--json"],
    ["plan", "--gpu-memory", "1", "--json"],
    ["sweep", "--model", "llama2-7b", "--gpus", "1,8", "--stage", "2,3", "--offload", "cpu,nvme/nvme", "--json"],
]


def _strict(constant):
    raise AssertionError(f"{constant} in JSON output")


@pytest.mark.parametrize("argv", JSON_COMMANDS)
def test_every_json_output_is_strict_json(argv):
    r = invoke(argv)
    assert r.exit_code == 0, r.output
    json.loads(r.stdout, parse_constant=_strict)
    assert not any(word in r.stdout for word in ("NaN", "Infinity"))


@pytest.mark.parametrize("argv", [[a for a in c if a != "--json"] for c in JSON_COMMANDS[:4]])
def test_no_text_output_prints_inf_or_nan(argv):
    r = invoke(argv)
    assert r.exit_code == 0, r.output
    words = set(r.stdout.replace("(", " ").replace(")", " ").split())
    assert not words & {"inf", "nan", "-inf", "NaN", "Infinity"}


def test_json_writer_refuses_non_finite_numbers():
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="Out of range float"):
            json_text({"x": bad})


# ---------------------------------------------------------------- options that do not apply, repeated options

PLOT_VALIDATE = ["plot", "--view", "validate", "--results", "{d}/r.json", "--out", "{d}/v.png"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (PLOT_VALIDATE + ["--gpus", "8"], "--gpus does not apply to --view validate"),
        (PLOT_VALIDATE + ["--stage", "1"], "--stage does not apply to --view validate"),
        (PLOT_VALIDATE + ["--gpu-memory", "80GB"], "--gpu-memory does not apply to --view validate"),
        (PLOT_VALIDATE + ["--gpu", "h100-80gb"], "--gpu does not apply"),
        (PLOT_VALIDATE + ["--model-parallel", "2"], "--model-parallel does not apply"),
        (PLOT_VALIDATE + ["--param-dtype", "bf16"], "--param-dtype does not apply"),
        (PLOT_VALIDATE + ["--no-master-weights"], "--master-weights does not apply"),
        (PLOT_VALIDATE + ["--model", "gpt2-xl"], "--model does not apply"),
        (["plot", "--view", "comm", "--params", "7B", "--gpu-memory", "80GB", "--out", "{d}/c.png"],
         "--gpu-memory does not apply to --view comm"),  # fmt: skip
        (["plot", "--view", "breakdown", "--params", "7B", "--results", "{d}/r.json", "--out", "{d}/c.png"],
         "--results does not apply to --view breakdown"),  # fmt: skip
        (["estimate", "--params", "7B", "--json", "--units", "GiB"], "--units does not apply"),
        (["estimate", "--params", "7B", "--csv", "--units", "GB"], "--units does not apply"),
        (["plan", "--params", "7B", "--gpu", "h100-80gb", "--json", "--units", "GB"], "--units does not apply"),
        (["sweep", "--params", "7B", "--checkpointing", "none"], "--checkpointing changes only activations"),
    ],
)
def test_options_that_do_not_apply_are_refused(tmp_path, argv, message):
    (tmp_path / "r.json").write_text("{}")
    assert_one_line_error(invoke(argv, tmp_path), message)
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["estimate", "--params", "7B", "--gpus", "8", "--gpus", "16"], "--gpus"),
        (["estimate", "--params", "7B", "--gpus=8", "--gpus", "16"], "--gpus"),
        (["estimate", "--params", "7B", "--json", "--json"], "--json"),
        (["estimate", "--params", "7B", "--master-weights", "--no-master-weights"], "--no-master-weights"),
        (["plan", "--gpu", "h100-80gb", "--gpu", "a100-40gb"], "--gpu"),
        (["sweep", "--params", "7B", "--gpus", "8", "--gpus", "16"], "--gpus"),
        (["plot", "--params", "7B", "--out", "{d}/a.png", "--out", "{d}/b.png"], "--out"),
        (["validate", "--model", "gpt-tiny", "--model", "mlp-tiny"], "--model"),
        (["validate", "--steps", "2", "--steps", "3"], "--steps"),
    ],
)
def test_a_repeated_option_is_an_error_on_every_command(tmp_path, argv, flag):
    assert_one_line_error(invoke(argv, tmp_path), f"{flag} given more than once")


def test_options_declared_as_lists_may_repeat():
    import typer.main

    command = typer.main.get_command(app).commands["validate"]
    refuse_repeated(command, ["--world-size", "2", "--world-size", "4", "--stage", "1", "--stage", "3"])
    refuse_repeated(command, ["--params", "--steps", "--steps", "2"])  # a value that looks like an option


# ---------------------------------------------------------------- the Python API is strict


@pytest.mark.parametrize(
    "call",
    [
        lambda: zeroplan.estimate(True),
        lambda: zeroplan.estimate(tensor_numels="1234"),
        lambda: zeroplan.estimate(7e9, stage=True),
        lambda: zeroplan.estimate(7e9, gpu_memory_bytes=True),
        lambda: zeroplan.estimate(7e9, gpu_memory_bytes=1.5),
        lambda: zeroplan.estimate(7e9, gpus=10**30),
        lambda: zeroplan.estimate(1e300),
        lambda: zeroplan.estimate(7e9, master_weights="false"),
        lambda: zeroplan.estimate(7e9, master_weights=1),
        lambda: zeroplan.estimate(7e9, param_dtype=16),
        lambda: min_gpus((), 1e9, 3),
        lambda: max_params(math.nan, 0, 1),
        lambda: max_params(80e9, True, 1),
        lambda: zeroplan.plan(params=7e9, gpu="h100-80gb", bw_gbps=1e-300),
        lambda: zeroplan.plan(params=7e9, gpu="h100-80gb", mfu=math.nan),
        lambda: zeroplan.sweep([7e9], gpus=[10**30]),
        lambda: deepspeed_config("3"),
        lambda: deepspeed_config(3, micro_batch=0),
    ],
)
def test_public_functions_refuse_nonsense_with_value_error(call):
    with pytest.raises(ValueError):
        call()


BAD_VALUES = st.one_of(
    st.none(), st.booleans(), st.text(max_size=5), st.just(math.nan), st.just(math.inf), st.just(-math.inf),
    st.integers(min_value=-(10**40), max_value=10**40), st.floats(), st.just(10**5000),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)  # fmt: skip
PUBLIC = {
    "estimate": (zeroplan.estimate, dict(params=7e9, gpus=8)),
    "estimate_shapes": (zeroplan.estimate, dict(tensor_numels=(100, 7), gpus=8, stage=3)),
    "estimate_model": (zeroplan.estimate, dict(model="gpt2-xl", gpus=8)),
    "plan": (zeroplan.plan, dict(params=7e9, gpu="h100-80gb", gpus=8)),
    "sweep": (zeroplan.sweep, dict(params=(7e9,), gpus=(8,))),
    "max_params": (max_params, dict(gpu_budget_bytes=80 * 10**9, stage=3, nd=8)),
    "min_gpus": (min_gpus, dict(tensor_numels=(10**9,), gpu_budget_bytes=80 * 10**9, stage=3)),
    "deepspeed_config": (deepspeed_config, dict(stage=3)),
    "from_deepspeed": (lambda config: from_deepspeed(config), dict(config={})),
    "parse_count": (parse_count, dict(text="7B")),
    "parse_bytes": (parse_bytes, dict(text="80GB")),
}
KEYS = [(name, key) for name, (_, kwargs) in PUBLIC.items() for key in kwargs]


def _whole(v, low, high):
    return not isinstance(v, bool) and isinstance(v, int) and low <= v <= high


def _integral(v, low, high):  # Ψ and byte sizes: an integral float is exact and accepted
    if isinstance(v, float):
        return math.isfinite(v) and v.is_integer() and low <= v <= high
    return _whole(v, low, high)


def _numels(v):
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(_whole(n, 1, 10**15) for n in v) and sum(v) <= 10**15


ACCEPTS = {  # what each argument may legitimately be: a value outside it must raise ValueError (issue 18)
    "params": lambda v: _integral(v, 1, 10**15),
    "gpus": lambda v: _whole(v, 1, 2**24),
    "nd": lambda v: _whole(v, 1, 2**24),
    "stage": lambda v: _whole(v, 0, 3),
    "tensor_numels": _numels,
    "gpu_budget_bytes": lambda v: _integral(v, 0, 2**60),
    "gpu": lambda v: isinstance(v, str) and v.strip().lower() in zeroplan.presets.gpu_presets(),
    "config": lambda v: isinstance(v, dict),
    "model": lambda v: isinstance(v, str),  # a preset or a config path; a dict or an int is a ValueError  # every key zeroplan does not read is allowed
    # the parsers read str(text): a positive whole number given as a number is its own text
    "text": lambda v: (isinstance(v, str) and re.fullmatch(r"[0-9.eE+ ]*[0-9][0-9.eE+ ]*[kKmMgGbBtTiI]{0,3}", v.strip())
                       or _integral(v, 1, math.inf)),
    ("sweep", "params"): lambda v: isinstance(v, (list, tuple)) and all(ACCEPTS["params"](x) for x in v),
    ("sweep", "gpus"): lambda v: isinstance(v, (list, tuple)) and all(ACCEPTS["gpus"](x) for x in v),
}
ACCEPTS_NONE = {("estimate_shapes", "stage"), ("plan", "params")}  # None: every stage; no Ψ: the largest model


@pytest.mark.parametrize("name, key", KEYS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=BAD_VALUES)
def test_public_functions_raise_only_value_errors(name, key, value):
    function, kwargs = PUBLIC[name]
    try:
        function(**{**kwargs, key: value})
    except ValueError:  # ValidationError is one
        return
    ok = ACCEPTS.get((name, key), ACCEPTS.get(key))(value) or (value is None and (name, key) in ACCEPTS_NONE)
    assert ok, f"{name}({key}={value!r}) was accepted silently"


# ---------------------------------------------------------------- the one writer


def test_writer_refuses_non_regular_targets_and_inputs(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "null").symlink_to("/dev/null")
    (tmp_path / "in.json").write_text("[[4, 4]]")
    for target, message in [
        (tmp_path / "fifo", "not a regular file"),
        (Path("/dev/null"), "not a regular file"),
        (tmp_path / "null", "is a symbolic link"),
        (tmp_path / "in.json", "is also an input"),
        (tmp_path / "x" / ".." / "in.json", "directory"),
    ]:
        with pytest.raises(ValueError, match=message):
            write_text_atomic(target, "x", inputs=[tmp_path / "in.json"])
    assert (tmp_path / "in.json").read_text() == "[[4, 4]]"
    assert os.path.islink(tmp_path / "null") and stat_is_char("/dev/null")


def stat_is_char(path):
    import stat

    return stat.S_ISCHR(os.stat(path).st_mode)


def test_cli_never_writes_over_an_input(tmp_path):
    (tmp_path / "s.json").write_text("[[4, 4], [3]]")
    r = invoke(["sweep", "--shapes", "{d}/s.json", "--out", "{d}/s.json"], tmp_path)
    assert_one_line_error(r, "is also an input of this command")
    (tmp_path / "r.png").write_text("{}")
    r = invoke(["plot", "--view", "validate", "--results", "{d}/r.png", "--out", "{d}/r.png"], tmp_path)
    assert_one_line_error(r, "is also an input of this command")
    (tmp_path / "link.png").symlink_to(tmp_path / "r.png")
    r = invoke(["plot", "--view", "validate", "--results", "{d}/r.png", "--out", "{d}/link.png"], tmp_path)
    assert_one_line_error(r, "is a symbolic link")
    assert (tmp_path / "s.json").read_text() == "[[4, 4], [3]]" and (tmp_path / "r.png").read_text() == "{}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_a_write_leaves_no_temporary_file(tmp_path, signum):
    target = tmp_path / "out.csv"
    target.write_text("the old file\n")
    params = ",".join(str(10**9 + 2 * i + 1) for i in range(2000))
    gpus = ",".join(str(8 * i) for i in range(1, 501))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from zeroplan.cli import main; main()", "sweep", "--params", params,
         "--gpus", gpus, "--out", str(target)],
        stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".out.csv.*")):  # wait until the temporary file is being written
        assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before the signal"
        time.sleep(0.005)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    assert err.decode().strip() == f"zeroplan: error: terminated by {signal.Signals(signum).name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]
    assert target.read_text() == "the old file\n"


def test_a_signal_inside_mkstemp_leaves_no_temporary_file(tmp_path, monkeypatch):
    # The race a full run once hit: the signal lands after mkstemp made the file, before its name is known, and
    # another thread (numpy's, pyarrow's) takes it while the main thread would have masked it. The hold must be
    # a handler of ours, not a mask (zeroplan/files.py _signals_held): Terminated, and no temporary file.
    import tempfile
    import threading

    from zeroplan.files import Terminated, write_text_atomic

    other = threading.Event()
    threading.Thread(target=other.wait, daemon=True).start()  # a thread that does not block SIGTERM
    real = tempfile.mkstemp

    def mkstemp_then_signal(*args, **kwargs):
        made = real(*args, **kwargs)
        if kwargs["prefix"].endswith("~"):
            return made  # check_writable's probe, before atomic_write's handlers (a signal there terminates)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs here if the signal is not held
        return made

    target = tmp_path / "out.txt"
    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_signal)
    try:
        with pytest.raises(Terminated):
            write_text_atomic(target, "new\n")
    finally:
        other.set()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- sweeps stream


@pytest.fixture(scope="module")
def varied():
    configs = [
        SweepConfig(params=(7 * 10**9 + 1, 70 * 10**9), gpus=(1, 3, 8, 64), model_parallel=(1, 2)),
        SweepConfig(model="llama2-7b", gpus=(1, 8, 16), stages=(1, 2, 3), offload=("none", "cpu", "nvme/nvme"),
                    gpu_memory_bytes=80 * 2**30, micro_batch=(1, 4)),  # fmt: skip
        SweepConfig(model="gpt2-xl", gpus=(4, 8), model_parallel=(1, 2), checkpointing="none", micro_batch=(1, 3)),
        SweepConfig(tensor_numels=(4097, 33, 1), gpus=(1, 3, 6), policy=zeroplan.PrecisionPolicy(param_dtype="fp32")),
    ]
    return configs


def test_streamed_csv_is_byte_for_byte_pandas(varied):
    for config in varied:
        frame = sweep_config(config)
        out = io.BytesIO()
        write_csv(sweep_frames(config, rows=7), out)
        assert out.getvalue().decode() == frame.to_csv(index=False, lineterminator="\n")


def test_streamed_frames_are_the_whole_sweep(varied):
    for config in varied:
        whole = sweep_config(config)
        parts = pd.concat(list(sweep_frames(config, rows=5)), ignore_index=True)
        pd.testing.assert_frame_equal(parts.astype(str), whole.astype(str))


def test_parquet_round_trip(tmp_path, varied):
    config = varied[1]
    write_parquet(sweep_frames(config, rows=11), str(tmp_path / "s.parquet"))
    back = pd.read_parquet(tmp_path / "s.parquet")
    pd.testing.assert_frame_equal(back, sweep_config(config), check_categorical=False)
    r = invoke(["sweep", "--model", "llama2-7b", "--gpus", "1,8", "--out", "{d}/c.parquet"], tmp_path)
    assert r.exit_code == 0, r.output
    assert len(pd.read_parquet(tmp_path / "c.parquet")) == 8


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else find_spec(name, *a))
    r = invoke(["sweep", "--params", "7B", "--out", "{d}/s.parquet"], tmp_path)
    assert_one_line_error(r, "writing .parquet needs pyarrow")
    assert not list(tmp_path.iterdir())


def test_sweep_out_equals_stdout(tmp_path):
    argv = ["sweep", "--model", "llama2-7b", "--gpus", "1,8,16", "--offload", "none,cpu", "--stage", "2,3"]
    for extra in ([], ["--json"]):
        shown = invoke(argv + extra).stdout
        assert invoke(argv + extra + ["--out", "{d}/o"], tmp_path).exit_code == 0
        assert (tmp_path / "o").read_text() == shown


# ---------------------------------------------------------------- plots stay readable


def test_plot_refuses_more_than_a_figure_can_show(tmp_path):
    row = dict(stage=1, world_size=2, mode="real", backend="gloo", predicted_model_states_bytes=10,
               measured_model_states_bytes=10, predicted_comm_bytes_per_rank=5, measured_comm_bytes_per_rank=5, ok=True)  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps({"rows": [row] * 20_000}))
    start = time.monotonic()
    r = invoke(["plot", "--view", "validate", "--results", "{d}/r.json", "--out", "{d}/v.png"], tmp_path)
    assert_one_line_error(r, "20000 runs, at most 60 fit one figure")
    assert time.monotonic() - start < 30
    r = invoke(["plot", "--params", ",".join(f"{i}B" for i in range(1, 8)), "--out", "{d}/m.png"], tmp_path)
    assert_one_line_error(r, "7 params values, at most 6 panels")
    r = invoke(["plot", "--view", "comm", "--params", "7B", "--gpus", ",".join(str(8 * i) for i in range(1, 66)),
                "--out", "{d}/m.png"], tmp_path)  # fmt: skip
    assert_one_line_error(r, "65 GPU counts, at most 64")
    assert not list(tmp_path.glob("*.png"))


def test_fast_float_text_is_repr():
    import numpy as np

    from zeroplan.render.sweep import _float_strings

    rng = np.random.default_rng(0)
    values = np.concatenate([
        10 ** rng.uniform(-8, 20, 200_000), -(10 ** rng.uniform(-5, 12, 1000)), np.arange(0, 5000, dtype=float),
        [math.nan, 1e-4, 1e10, 9999999999.5, 1e16, 2.0**53, 5e-324, 1.7976931348623157e308, -0.0],
    ])  # fmt: skip
    expected = ["" if math.isnan(v) else repr(float(v)) for v in values]
    assert _float_strings(values).to_pylist() == expected


def test_csv_without_pyarrow_is_the_same_text(varied, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    for config in varied[:2]:
        out = io.BytesIO()
        write_csv(sweep_frames(config, rows=9), out)
        assert out.getvalue().decode() == sweep_config(config).to_csv(index=False, lineterminator="\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_on_stdout_is_one_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-c", "from zeroplan.cli import main; main()", "sweep", "--params", "7B"],
            stdout=full, stderr=subprocess.PIPE, env=env, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.decode().strip() == "zeroplan: error: cannot write the output (No space left on device)"
