"""Issue 18 (hardening, round 3): each case the issue reports, and the class behind it.

- outputs that overwrite inputs: every input of every command against every output, by file identity;
- sizes that never return: every architecture dimension bounded before any work, one Ψ check for all;
- tracebacks and wrong exception types from config.json fields and from ``model=`` in Python;
- wrong messages and exit codes (a too-long input name, an unwritable TMPDIR or HOME);
- silently accepted nonsense (a ds_config stage in ``plan``, an empty baseline, rope parameters);
- advice that names something that does not work;
- a SIGKILLed ``validate`` leaves nothing behind;
- a fixed-seed slice of the fuzzer (``benchmarks/fuzz_inputs.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import zeroplan
from clicheck import assert_one_line_error, run
from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import TransformerSpec
from zeroplan.files import file_identity, refuse_input_as_output
from zeroplan.types import DIMENSION_LIMITS, MAX_LAYERS, MAX_WIDTH, dimension_limit

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

TINY_LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 128}  # fmt: skip
TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 320, "n_embd": 64, "n_layer": 2, "n_head": 4,
             "n_positions": 128, "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}  # no dropout: the peaks refuse it
TINY_QWEN2 = {**TINY_LLAMA, "model_type": "qwen2", "num_key_value_heads": 2}
TINY_MISTRAL = {**TINY_LLAMA, "model_type": "mistral", "num_key_value_heads": 2}


def write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------- outputs that overwrite inputs


def _spellings(tmp_path: Path, name: str) -> list[str]:
    """Names of the file ``name`` in ``tmp_path`` that are not its plain path: through a directory and
    back, and a hard link (a symbolic link is refused as a target in its own right)."""
    (tmp_path / "d").mkdir(exist_ok=True)
    os.link(tmp_path / name, tmp_path / f"hard-{name}")
    return [str(tmp_path / name), str(tmp_path / "d" / ".." / name), str(tmp_path / f"hard-{name}")]


WRITERS = [  # (command line with {in} and {out}, input file name, its content)
    (["sweep", "--model", "{in}", "--out", "{out}"], "cfg.json", TINY_LLAMA),
    (["sweep", "--shapes", "{in}", "--out", "{out}"], "shapes.json", [[4, 4], [3]]),
    (["sweep", "--model", "gpt2-xl", "--engine", "deepspeed", "--deepspeed-config", "{in}", "--out", "{out}"],
     "ds.json", {"zero_optimization": {"stage": 2}}),
    (["plot", "--view", "validate", "--results", "{in}", "--out", "{out}"], "r.png", {}),
    (["validate", "--simulated", "--model", "{in}", "--json", "{out}"], "cfg.json", TINY_LLAMA),
    (["validate", "--simulated", "--baseline", "{in}", "--json", "{out}"], "b.json", {"rows": []}),
    (["validate", "--simulated", "--engine", "deepspeed", "--deepspeed-config", "{in}", "--json", "{out}"],
     "ds.json", {"zero_optimization": {"stage": 2}}),
]  # fmt: skip


@pytest.mark.parametrize("argv, name, content", WRITERS, ids=lambda v: v[0] if isinstance(v, list) else None)
def test_no_command_writes_over_any_input_whatever_its_name(tmp_path, argv, name, content):
    write(tmp_path / name, content)
    before = (tmp_path / name).read_bytes()
    for out in _spellings(tmp_path, name):
        r = run(*[a.replace("{in}", str(tmp_path / name)).replace("{out}", out) for a in argv])
        assert_one_line_error(r, "is also an input of this command")
        assert (tmp_path / name).read_bytes() == before


def test_file_identity_is_device_and_inode_not_the_string(tmp_path):
    (tmp_path / "a").write_text("x")
    (tmp_path / "d").mkdir()
    os.link(tmp_path / "a", tmp_path / "b")
    (tmp_path / "s").symlink_to(tmp_path / "a")
    ident = file_identity(tmp_path / "a")
    assert ident == (os.stat(tmp_path / "a").st_dev, os.stat(tmp_path / "a").st_ino)
    assert file_identity(tmp_path / "d" / ".." / "a") == file_identity(tmp_path / "b") == file_identity(tmp_path / "s")
    assert file_identity(tmp_path / "new") == ("new", os.path.realpath(tmp_path), "new")
    refuse_input_as_output(tmp_path / "new", [tmp_path / "a", "llama2-7b", None])  # a preset name is no file
    with pytest.raises(ValueError, match="is also an input"):
        refuse_input_as_output(tmp_path / "b", [tmp_path / "s"])


# ---------------------------------------------------------------- sizes: bounded before any work


@pytest.mark.parametrize("layers", [10**30, 1_000_000, MAX_LAYERS + 1])
@pytest.mark.parametrize("command", [
    ["estimate", "--gpus", "8"],
    ["estimate", "--gpus", "8", "--engine", "fsdp2"],
    ["estimate", "--gpus", "8", "--engine", "deepspeed", "--stage", "3"],
    ["plan", "--gpu", "h100-80gb"],
    ["plan", "--gpu", "h100-80gb", "--engine", "fsdp2"],
    ["plan", "--gpu", "h100-80gb", "--engine", "deepspeed"],
    ["sweep"],
    ["sweep", "--engine", "fsdp2"],
    ["plot", "--out", "{d}/x.png"],
])  # fmt: skip
def test_a_deep_model_is_refused_before_any_work(tmp_path, command, layers):
    cfg = write(tmp_path / "deep.json", {**TINY_LLAMA, "num_hidden_layers": layers})
    start = time.process_time()
    r = run(*[a.replace("{d}", str(tmp_path)) for a in command], "--model", str(cfg))
    assert_one_line_error(r, f"num_hidden_layers: {layers if layers < 10**24 else '100000...(31 digits)'} is above "
                             f"the limit of {MAX_LAYERS}")  # fmt: skip
    assert time.process_time() - start < 5


def _dimension_keys(config: dict) -> list[str]:
    return [k for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)]


@pytest.mark.parametrize("base", [TINY_LLAMA, TINY_GPT2, TINY_QWEN2, TINY_MISTRAL], ids=lambda c: c["model_type"])
def test_every_dimension_of_a_config_has_a_bound(base):
    extra = {"gpt2": ["n_inner"], "llama": ["head_dim", "num_key_value_heads", "max_position_embeddings"]}
    extra["mistral"] = extra["qwen2"] = [*extra["llama"], "sliding_window"]
    for key in [*_dimension_keys(base), *extra[base["model_type"]]]:
        too_big = dimension_limit(key) + 1
        with pytest.raises(ValueError, match=rf"{key}: {too_big} is above the limit of {dimension_limit(key):,}"):
            spec_from_hf_config({**base, key: too_big, **({"use_sliding_window": True} if key == "sliding_window"
                                                          else {})})  # fmt: skip


@pytest.mark.parametrize("field", ["n_layer", "d_model", "n_head", "vocab_size", "max_seq_len", "ffn_hidden",
                                   "n_kv_head", "head_dim", "sliding_window"])  # fmt: skip
def test_every_dimension_of_a_spec_has_the_same_bound(field):
    fields = dict(n_layer=2, d_model=64, n_head=4, vocab_size=320, style="llama")
    with pytest.raises(ValueError, match=rf"{field}=\d+: above the limit of {dimension_limit(field):,}"):
        TransformerSpec(**{**fields, field: dimension_limit(field) + 1})


def test_the_bounds_table_names_what_the_docs_name():
    text = (Path(__file__).parent.parent / "docs" / "limits.md").read_text()
    assert f"{MAX_LAYERS:,}" in text and f"{MAX_WIDTH:,}" in text
    for key in ("num_hidden_layers", "vocab_size", "num_attention_heads", "max_position_embeddings"):
        assert key in DIMENSION_LIMITS and key in text


@pytest.mark.parametrize("command", [["estimate"], ["plan", "--gpu", "h100-80gb"], ["sweep"]])
def test_psi_above_1e15_is_one_line_on_every_command(tmp_path, command):
    # every width within its bound, the whole model 1.1e15 parameters: sweep overflowed int64 (2**40 wide)
    wide = {**TINY_LLAMA, "hidden_size": 2**20, "intermediate_size": 2**20, "num_attention_heads": 2**13,
            "num_hidden_layers": MAX_LAYERS, "vocab_size": 32000}  # fmt: skip
    cfg = write(tmp_path / "wide.json", wide)
    assert_one_line_error(run(*command, "--model", str(cfg)), "elements in all, above 1e+15")
    cfg = write(tmp_path / "w40.json", {**TINY_LLAMA, "hidden_size": 2**40})
    assert_one_line_error(run(*command, "--model", str(cfg)), "hidden_size: 1099511627776 is above the limit")


def test_gpt_for_params_stays_within_the_layer_bound():
    from zeroplan.architectures.spec import gpt_for_params, param_count

    for psi in (1e9, 175e9, 5e12, 1e15):
        spec = gpt_for_params(psi)
        assert spec.n_layer <= MAX_LAYERS and 0.98 < param_count(spec) / psi < 1.03


# ---------------------------------------------------------------- config.json fields of the wrong type

ODD_JSON = [None, True, -1, 0, 10**30, 1.5, 1e300, "8", "", [], [["x"]], {}, {"a": 1}, ["llama"]]


@pytest.mark.parametrize("base", [TINY_LLAMA, TINY_GPT2, TINY_QWEN2, TINY_MISTRAL], ids=lambda c: c["model_type"])
def test_any_value_of_any_config_key_is_a_value_error_or_a_spec(base):
    keys = [*base, "head_dim", "rope_scaling", "rope_parameters", "rope_theta", "layer_types", "tie_word_embeddings",
            "hidden_act", "activation_function", "rms_norm_eps", "sliding_window", "use_sliding_window",
            "attention_bias", "mlp_bias", "max_window_layers", "n_inner", "layer_norm_epsilon"]  # fmt: skip
    for key in keys:
        for value in ODD_JSON:
            try:
                spec_from_hf_config({**base, key: value}, "cfg")
            except ValueError as exc:
                assert str(exc).startswith("cfg: ") and "\n" not in str(exc), exc


@pytest.mark.parametrize("config, message", [
    ({**TINY_LLAMA, "model_type": ["llama"]}, "model_type: ['llama'] is not supported"),
    ({**TINY_LLAMA, "model_type": {"llama": 1}}, "model_type: {'llama': 1} is not supported"),
    ({**TINY_QWEN2, "layer_types": [["x"]]}, "layer_types: [['x']] is not a list"),
    ({**TINY_QWEN2, "layer_types": [{"a": 1}, "full_attention"]}, "is not a list of full_attention"),
    ({**TINY_QWEN2, "layer_types": ["full_attention"]}, "layer_types: 1 entries for num_hidden_layers=2"),
    ({**TINY_LLAMA, "rope_scaling": {"rope_type": "nonsense", "factor": 2.0}}, "rope_type='nonsense' is not one of"),
    ({**TINY_LLAMA, "rope_scaling": {"type": ["linear"], "factor": 2.0}}, "rope_type=['linear'] is not one of"),
    ({**TINY_LLAMA, "rope_scaling": {"type": "linear", "factor": -4.0}}, "factor=-4.0 is not a finite number >= 1"),
    ({**TINY_LLAMA, "rope_scaling": {"type": "linear"}}, "factor: missing (transformers requires it"),
    ({**TINY_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": -1}},
     "original_max_position_embeddings: -1 is not a whole number >= 1"),
    ({**TINY_LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
                                     "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     "high_freq_factor=1.0 is not above low_freq_factor=4.0"),
    ({**TINY_LLAMA, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, -1.0], "long_factor": [1.0],
                                     "original_max_position_embeddings": 64}}, "short_factor=[1.0, -1.0] is not"),
    ({**TINY_LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "attention_factor": -0.5}}, "attention_factor=-0.5 is not a finite number >= 0"),
    ({**TINY_LLAMA, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 2}},
     "partial_rotary_factor=2 is not in (0, 1]"),
    ({**TINY_LLAMA, "rope_theta": 10**400}, "rope_theta: 100000...(401 digits) is not a finite number > 0"),
])  # fmt: skip
def test_config_fields_of_the_wrong_kind_are_one_line(tmp_path, config, message):
    cfg = write(tmp_path / "c.json", config)
    for command in (["estimate"], ["plan", "--gpu", "h100-80gb"], ["sweep"]):
        assert_one_line_error(run(*command, "--model", str(cfg)), message)


def test_rope_parameters_transformers_accepts_are_accepted():
    for rope in ({"rope_type": "linear", "factor": 2.0}, {"type": "dynamic", "factor": 2},
                 {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0, "truncate": False},
                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
                 {"rope_type": "longrope", "short_factor": [1.0, 1.1], "long_factor": [2.0, 3.0],
                  "original_max_position_embeddings": 64}):  # fmt: skip
        assert spec_from_hf_config({**TINY_LLAMA, "rope_scaling": rope}).rope_type == rope.get("rope_type", rope.get("type"))


# ---------------------------------------------------------------- the Python API's model=


def test_model_may_be_a_path_object_as_the_docs_say(tmp_path):
    cfg = write(tmp_path / "cfg.json", TINY_LLAMA)
    assert zeroplan.estimate(model=cfg, gpus=2).psi == zeroplan.estimate(model=str(cfg), gpus=2).psi
    assert zeroplan.plan(model=cfg, gpus=2, gpu="h100-80gb").params == zeroplan.estimate(model=str(cfg)).psi
    assert zeroplan.sweep(model=cfg, gpus=(2,)).equals(zeroplan.sweep(model=str(cfg), gpus=(2,)))


@pytest.mark.parametrize("bad", [{"model_type": "llama"}, 7, 7.5, b"cfg.json", ["llama2-7b"], True, object()])
@pytest.mark.parametrize("function", ["estimate", "plan", "sweep"])
def test_model_of_any_other_type_is_a_value_error(bad, function):
    call = {"estimate": lambda: zeroplan.estimate(model=bad), "plan": lambda: zeroplan.plan(model=bad, gpu="h100-80gb"),
            "sweep": lambda: zeroplan.sweep(model=bad)}[function]  # fmt: skip
    with pytest.raises(ValueError, match="model"):
        call()


# ---------------------------------------------------------------- messages and exit codes


@pytest.mark.parametrize("command", [
    ["estimate"], ["plan", "--gpu", "h100-80gb"], ["sweep"], ["plot", "--out", "{d}/x.png"], ["validate", "--simulated"],
])  # fmt: skip
@pytest.mark.parametrize("name", ["a" * 300, "a" * 300 + ".json", "d/" * 2100 + "c.json", "é" * 200])
def test_a_name_too_long_for_the_file_system_is_an_input_error(tmp_path, command, name):
    r = run(*[a.replace("{d}", str(tmp_path)) for a in command], "--model", name)
    assert_one_line_error(r, "")
    assert "cannot write the output" not in r.stderr and name[:20] in r.stderr


@pytest.mark.parametrize("option", ["--shapes", "--deepspeed-config"])
def test_every_input_path_option_names_the_input_when_too_long(option):
    r = run("sweep", *(["--model", "gpt2-xl", "--engine", "deepspeed"] if option != "--shapes" else []),
            option, "x" * 300 + ".json")  # fmt: skip
    assert_one_line_error(r, "File name too long")


def test_an_unwritable_tmpdir_in_validate_names_tmpdir(monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", "/proc/self/no-such-dir")  # unwritable even for root
    monkeypatch.setenv("TMPDIR", "/proc/self/no-such-dir")
    r = run("validate", "--simulated", "--world-size", "2", "--stage", "1")
    assert_one_line_error(r, "cannot create the run's temporary folder in TMPDIR='/proc/self/no-such-dir'")
    assert "cannot write the output" not in r.stderr


@pytest.mark.parametrize("out, code", [("x.png", 0), ("/proc/self/no/x.png", 2)])
def test_plot_with_an_unwritable_home_prints_one_line_at_most(tmp_path, out, code):
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    env["HOME"] = "/proc/self/no-home"  # unwritable even for root
    r = subprocess.run([sys.executable, "-c", "from zeroplan.cli import main; main()", "plot", "--params", "7B",
                        "--out", out], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == code, r.stderr
    assert r.stderr.count("\n") == (0 if code == 0 else 1), r.stderr


def test_matplotlibs_housekeeping_warnings_are_dropped_and_nothing_else():
    """CI once printed "Matplotlib is building the font cache" on stderr: ``font_manager`` logs it on its own
    logger after 5 s of building, which happens on a slow machine with an unwritable HOME. The messages are
    logged here from the loggers matplotlib logs them on, so this does not need a slow machine to fail."""
    code = """if True:
        import logging, sys
        from zeroplan.cli_plot import _quiet_matplotlib_cache_warnings
        logging.basicConfig(stream=sys.stderr, format="%(name)s: %(message)s")
        _quiet_matplotlib_cache_warnings()
        top, fonts = logging.getLogger("matplotlib"), logging.getLogger("matplotlib.font_manager")
        top.warning("mkdir -p failed for path /proc/x: [Errno 2]")
        top.warning("Matplotlib created a temporary cache directory at /tmp/y")
        fonts.warning("Matplotlib is building the font cache; this may take a moment.")
        fonts.warning("findfont: Font family 'x' not found.")
        top.warning("something else")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["matplotlib.font_manager: findfont: Font family 'x' not found.",
                                     "matplotlib: something else"]  # fmt: skip


# ---------------------------------------------------------------- nonsense silently accepted


@pytest.mark.parametrize("stage", [4, 0, "3", None, True, [3], -1, 2.0])
def test_plan_refuses_a_ds_config_stage_with_estimates_own_message(tmp_path, stage):
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": stage}})
    cfg = write(tmp_path / "cfg.json", TINY_GPT2)
    common = ["--model", str(cfg), "--engine", "deepspeed", "--deepspeed-config", str(ds)]
    est = run("estimate", *common)
    plan = run("plan", *common, "--gpu", "h100-80gb")
    assert est.exit_code == 2 and plan.exit_code == 2, (est.output, plan.output)
    assert plan.stderr == est.stderr  # one check serves both
    with pytest.raises(ValueError):
        zeroplan.plan(model=cfg, gpu="h100-80gb", engine="deepspeed", ds_config={"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_plan_still_searches_with_a_valid_ds_config_stage(tmp_path, stage):
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": stage}})
    r = run("plan", "--model", str(write(tmp_path / "cfg.json", TINY_GPT2)), "--engine", "deepspeed", "--deepspeed-config", str(ds), "--gpu", "h100-80gb")
    assert r.exit_code == 0 and "Recommendation: ZeRO-" in r.stdout, r.output


def test_a_baseline_that_compares_nothing_is_refused(tmp_path):
    empty = write(tmp_path / "b.json", {"schema": "zeroplan.validate/2", "config": {}, "torch": None, "rows": [],
                                        "notes": [], "ok": True})  # fmt: skip
    assert_one_line_error(run("validate", "--simulated", "--baseline", str(empty)), "has no rows, so nothing")


# ---------------------------------------------------------------- advice that names what works


def test_sweep_help_and_refusal_name_what_works(tmp_path):
    from click.utils import strip_ansi

    help_text = " ".join(strip_ansi(run("sweep", "--help").stdout).replace("│", " ").split())
    assert "with --engine deepspeed only" in help_text and "with reference, its stage" not in help_text
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 2}})
    cfg = str(write(tmp_path / "cfg.json", TINY_GPT2))
    r = run("sweep", "--model", cfg, "--deepspeed-config", str(ds))
    assert_one_line_error(r, "use --engine deepspeed --model NAME with it")
    follow = run("sweep", "--model", cfg, "--engine", "deepspeed", "--deepspeed-config", str(ds))
    assert follow.exit_code == 0, follow.output


def test_plan_help_does_not_offer_a_ds_config_to_the_reference_engine(tmp_path):
    from click.utils import strip_ansi

    help_text = " ".join(strip_ansi(run("plan", "--help").stdout).replace("│", " ").split())
    assert "with --engine deepspeed only" in help_text
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 2}})
    assert run("plan", "--model", "gpt2-xl", "--gpu", "h100-80gb", "--deepspeed-config", str(ds)).exit_code == 2


def test_offload_in_a_ds_config_names_a_command_that_plans_offload(tmp_path):
    ds = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    cfg = str(write(tmp_path / "cfg.json", TINY_GPT2))
    r = run("estimate", "--model", cfg, "--gpus", "2", "--deepspeed-config", str(ds))  # the paper's model states
    assert r.exit_code == 2
    assert "--engine deepspeed" in r.stderr and "--engine reference --offload" in r.stderr
    assert run("plan", "--model", cfg, "--engine", "deepspeed", "--deepspeed-config", str(ds), "--gpu", "h100-80gb").exit_code == 0
    assert run("plan", "--model", cfg, "--gpu", "h100-80gb", "--engine", "reference", "--offload", "cpu").exit_code == 0


# ---------------------------------------------------------------- SIGKILL of validate


@pytest.mark.distributed
def test_a_sigkilled_validate_leaves_nothing_in_tmpdir(tmp_path):
    token = uuid.uuid4().hex
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "ZEROPLAN_TEST_TOKEN": token, "ZEROPLAN_VALIDATE_FAULT": "hang:1"}
    cmd = [sys.executable, "-c", "from zeroplan.cli import main; main()", "validate", "--model", "mlp-tiny",
           "--world-size", "2", "--stage", "0", "--timeout", "120"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(list(tmpdir.glob("*/logs/*/attempt_0/*"))) < 2:
            time.sleep(0.2)  # both ranks have started (torchrun made their log folders)
        assert len(list(tmpdir.glob("*/logs/*/attempt_0/*"))) == 2, "the ranks never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (list(tmpdir.iterdir()) or _carrying(token)):
            time.sleep(0.2)
        assert list(tmpdir.iterdir()) == [], "left for a later run to clean"
        assert not _carrying(token), "processes of the run still alive"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _carrying(token):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _carrying(token: str) -> set[int]:
    needle = f"ZEROPLAN_TEST_TOKEN={token}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


# ---------------------------------------------------------------- a fixed-seed slice of the fuzzer


def test_fuzz_slice_finds_no_broken_promise(tmp_path):
    from fuzz_inputs import run_cases

    report = run_cases(seed=18, count=40, folder=tmp_path, timeout_s=60, include_validate=False)
    assert report.ran == 40
    assert report.broken == [], "\n".join(report.broken)


# ---------------------------------------------------------------- what the fuzzer found (kept as cases)


@pytest.mark.parametrize("call", [
    lambda: zeroplan.estimate(7e9, engine={}),
    lambda: zeroplan.estimate(7e9, engine=["fsdp2"]),
    lambda: zeroplan.sweep([7e9], engine={}),
    lambda: zeroplan.sweep([7e9], stages=3),
    lambda: zeroplan.sweep(model="gpt2-xl", gpus=(2, 4), stages=16777217),
])  # fmt: skip
def test_fuzzer_finds_in_python_are_value_errors(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "gpt2-xl", "--gpu", "a100-40gb", "--engine", "fsdp2", "--model-parallel", "0"],
     "model_parallel=0: must be >= 1"),
    (["sweep", "--model", "gpt2-xl", "--engine", "deepspeed", "--stage", "2", "--model-parallel", "0"],
     "model_parallel=0: must be >= 1"),
    (["sweep", "--model", "gpt2-xl", "--engine", "deepspeed", "--stage", "2", "--gpus", "0"], "gpus=0: must be >= 1"),
    (["sweep", "--model", "gpt2-xl", "--engine", "deepspeed", "--stage", "2", "--micro-batch", "0"],
     "micro_batch=0: must be >= 1"),
])  # fmt: skip
def test_fuzzer_finds_on_the_command_line_are_one_line(argv, message):
    assert_one_line_error(run(*argv), message)


def test_an_engine_sweep_of_a_deep_model_gets_fewer_estimates(tmp_path):
    cfg = write(tmp_path / "deep.json", {**TINY_LLAMA, "num_hidden_layers": MAX_LAYERS})
    gpus = ",".join(str(2**i) for i in range(10))
    micro = ",".join(str(i) for i in range(1, 60))  # 590 estimates: fine at 32 layers, not at 256
    assert_one_line_error(run("sweep", "--model", str(cfg), "--engine", "fsdp2", "--gpus", gpus, "--micro-batch", micro),
                          f"590 engine estimates (gpus x micro_batch x stages) of a {MAX_LAYERS}-layer model, above "
                          f"the limit of {4096 * 32 // MAX_LAYERS}")  # fmt: skip
