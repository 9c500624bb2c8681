"""`zeroplan estimate` through typer's CliRunner: output formats and every kind of bad input."""

import csv
import io
import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from zeroplan.cli import app
from clicheck import assert_one_line_error

runner = CliRunner()


def run(*args):
    return runner.invoke(app, ["estimate", *args])


def stage_rows(text):
    return [line.split() for line in text.splitlines() if line[:1].isdigit()]


def test_table_shows_the_paper_example_and_its_convention():
    r = run("--params", "7.5e9", "--gpus", "64")
    assert r.exit_code == 0, r.output
    assert "fp16 params 2 + fp16 grads 2 + fp32 master 4 + fp32 Adam m 4 + fp32 Adam v 4 = 16 (K = 12)" in r.stdout
    rows = {row[0]: row for row in stage_rows(r.stdout)}
    # Table 1 of the ZeRO paper: 120, 31.4, 16.6, 1.88 GB at Nd = 64.
    assert [rows[s][8] for s in "0123"] == ["120", "31.4", "16.6", "1.88"]
    assert rows["3"][11] == "3.00Ψ" and rows["0"][11] == "2.00Ψ"


def test_gib_units_and_fit_column():
    r = run("--params", "7.5B", "--gpus", "64", "--units", "GiB", "--gpu-memory", "32GiB")
    assert r.exit_code == 0, r.output
    assert "GiB = 2**30 bytes" in r.stdout and "fits 32.0 GiB" in r.stdout
    fits = [row[-1] for row in stage_rows(r.stdout)]
    assert fits == ["no", "yes", "yes", "yes"]


def test_json_schema_and_values():
    r = run("--params", "7.5e9", "--gpus", "64", "--json", "--gpu-memory", "32GB")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema"] == "zeroplan.estimate/1" and doc["k"] == 12
    assert [s["stage"] for s in doc["stages"]] == [0, 1, 2, 3]
    s3 = doc["stages"][3]
    assert s3["model_states_bytes"] == 1_875_000_000
    assert s3["params_bytes"] + s3["grads_bytes"] + s3["optimizer_bytes"] == s3["model_states_bytes"]
    assert s3["comm_volume_elements"] == 3 * 7_500_000_000
    assert s3["comm_bytes_per_rank"] == sum(c["bytes_per_rank"] for c in s3["collectives"])
    assert set(s3["collectives"][0]) == {"op", "phase", "elements", "dtype", "bytes_per_rank", "mesh_dim",
                                         "group_size", "link"}  # fmt: skip
    # 64 ranks on 8-GPU nodes: one flat group over dp_shard crossing nodes (zeroplan/formulas/mesh.py)
    assert {(c["mesh_dim"], c["group_size"], c["link"]) for c in s3["collectives"]} == {("dp_shard", 64, "inter")}
    assert [s["fits"] for s in doc["stages"]] == [False, True, True, True]


def test_csv_one_row_per_stage():
    r = run("--params", "1e9", "--gpus", "8", "--csv", "--stage", "2")
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert len(rows) == 1 and rows[0]["stage"] == "2"
    # 2Ψ + 14Ψ/8 bytes for Ψ = 1e9.
    assert int(rows[0]["model_states_bytes"]) == 2_000_000_000 + 14 * 125_000_000


def test_shapes_file_gives_exact_padding(tmp_path):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"w": [5, 2], "b": [7]}))
    r = run("--shapes", str(path), "--gpus", "4", "--stage", "3", "--json")
    assert r.exit_code == 0, r.output
    # ceil(10/4) + ceil(7/4) = 5 elements per rank, 16 bytes each.
    assert json.loads(r.stdout)["stages"][0]["model_states_bytes"] == 80


def test_model_parallel_and_policy_options():
    r = run("--params", "128e9", "--gpus", "1024", "--model-parallel", "16", "--param-dtype", "bf16",
            "--optimizer", "adamw", "--json")  # fmt: skip
    doc = json.loads(r.stdout)
    assert doc["inputs"]["nd"] == 64 and doc["inputs"]["psi"] == 8_000_000_000
    assert doc["stages"][3]["model_states_bytes"] == 2_000_000_000


BAD = [
    (["--params", "0"], "params='0': must be a positive"),
    (["--params", "-7e9"], "must be a positive"),
    (["--params", "nan"], "not a number"),
    (["--params", "inf"], "not a number"),
    (["--params", "lots"], "not a number"),
    (["--params", "1.5"], "whole number"),
    (["--params", "7e9", "--gpus", "0"], "gpus=0: must be >= 1"),
    (["--params", "7e9", "--gpus", "-8"], "gpus=-8: must be >= 1"),
    (["--params", "7e9", "--gpus", "2.5"], "--gpus"),
    (["--params", "7e9", "--gpus", "many"], "--gpus"),
    (["--params", "7e9", "--stage", "4"], "stage=4"),
    (["--params", "7e9", "--optimizer", "rmsprop"], "unknown optimizer 'rmsprop'"),
    (["--params", "7e9", "--param-dtype", "fp12"], "unknown dtype 'fp12'"),
    (["--params", "7e9", "--gpus", "6", "--model-parallel", "4"], "does not divide gpus=6"),
    (["--params", "7e9", "--model-parallel", "0"], "model_parallel=0"),
    (["--params", "7e9", "--gpu-memory", "80XB"], "gpu-memory='80XB'"),
    (["--params", "7e9", "--gpu-memory", "-1GB"], "must be a positive size"),
    (["--params", "7e9", "--units", "MB"], "--units"),
    (["--params", "7e9", "--json", "--csv"], "exclusive"),
    (["--gpus", "8"], "exactly one of --params, --shapes and --model"),
    (["--params", "7e9", "--frobnicate"], "No such option"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_one_line_exit_2(args, message):
    assert_one_line_error(run(*args), message)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ("[]", "non-empty JSON list"),
        ('{"w": [4, -1]}', "not a shape of positive whole dimensions"),
        ('{"w": [4, 2.5]}', "not a shape"),
        ('"text"', "non-empty JSON list"),
    ],
)
def test_malformed_shapes_file(tmp_path, content, message):
    path = tmp_path / "shapes.json"
    path.write_text(content)
    assert_one_line_error(run("--shapes", str(path)), message)


def test_missing_shapes_file(tmp_path):
    assert_one_line_error(run("--shapes", str(tmp_path / "absent.json")), "No such file")


def test_estimate_never_imports_heavy_modules():
    # `zeroplan estimate` must answer in a fraction of a second: torch, pandas and matplotlib stay out.
    code = (
        "import sys\n"
        "from zeroplan.cli import main\n"
        "sys.argv = ['zeroplan', 'estimate', '--params', '7.5e9', '--gpus', '64', '--json']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'pandas', 'matplotlib', 'numpy') if m in sys.modules), file=sys.stderr)\n"
        "print(sorted(m for m in sys.modules if m.startswith('zeroplan.allocator.')), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["stages"][3]["model_states_bytes"] == 1_875_000_000
    heavy, allocator = out.stderr.strip().splitlines()[-2:]
    assert heavy == "[]"
    # without a model nothing is replayed: the allocator's config and reserved records only (issue 16)
    assert allocator == "['zeroplan.allocator.config', 'zeroplan.allocator.reserved']"


@pytest.mark.parametrize("user_value, searched", [(None, False), ("some_plugin", True)])
def test_plugin_search_skipped_only_with_plugins_off(user_value, searched):
    # With pydantic's plugins off (main's default) the loader, which imports importlib.metadata (about 45 CPU-ms),
    # is never imported; a user who names a plugin to disable gets pydantic's own search (zeroplan.cli, issue 16).
    code = ("import sys\nfrom zeroplan.cli import main\n"
            "sys.argv = ['zeroplan', 'estimate', '--params', '7.5e9', '--gpus', '64', '--json']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('importlib.metadata' in sys.modules, file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    if user_value is not None:
        env["PYDANTIC_DISABLE_PLUGINS"] = user_value
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout)["stages"][3]["model_states_bytes"] == 1_875_000_000
    assert out.stderr.strip().splitlines()[-1] == str(searched)


def test_plugin_stand_in_hands_over_to_the_real_loader():
    # A pydantic that asks the stand-in for anything but get_plugins gets pydantic's own loader
    # (zeroplan.cli_startup), never an AttributeError.
    code = ("import os, sys\nos.environ['PYDANTIC_DISABLE_PLUGINS'] = '__all__'\n"
            "from zeroplan.cli_startup import no_plugin_search\nno_plugin_search()\n"
            "stand_in = sys.modules['pydantic.plugin._loader']\nprint(stand_in.get_plugins())\n"
            "real = stand_in.__getattr__('get_plugins')\n"
            "print(sys.modules['pydantic.plugin._loader'] is not stand_in, real.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["()", "True pydantic.plugin._loader"]


def test_estimate_runs_without_the_cycle_collector():
    # `estimate` and `plan` answer one configuration: main() turns the cyclic collector off for the command
    # (its passes cost 5-20% of a plan) and back on when the command returns (zeroplan.cli_exit.ONE_ANSWER).
    code = ("import gc, sys\nimport zeroplan.render.estimate as r\nfrom zeroplan.cli import main\n"
            "seen = []\nto_json = r.to_json\n"
            "r.to_json = lambda *a: (seen.append(gc.isenabled()), to_json(*a))[1]\n"
            "sys.argv = ['zeroplan', 'estimate', '--params', '7.5e9', '--gpus', '64', '--json']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(seen, gc.isenabled(), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["stages"][3]["model_states_bytes"] == 1_875_000_000
    assert out.stderr.strip().splitlines()[-1] == "[False] True"


def test_help_runs_without_the_cycle_collector():
    # help is one answer too (ONE_ANSWER's comment): the collector's passes were ~6% of `zeroplan --help`
    code = ("import gc, sys\nimport typer.core as core\nfrom zeroplan.cli import main\n"
            "seen = []\nhelp_of = core.TyperGroup.format_help\n"
            "core.TyperGroup.format_help = lambda *a: (seen.append(gc.isenabled()), help_of(*a))[1]\n"
            "sys.argv = ['zeroplan', '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(seen, gc.isenabled(), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "estimate" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "[False] True"


def test_cli_module_imports_no_pydantic():
    # Every command pays for `import zeroplan.cli`: typer and the option blocks only; pydantic, the configs and
    # the engines are imported by the command that runs (issue 16: 0.43 -> 0.17 CPU-s).
    code = ("import sys, zeroplan.cli\n"
            "print(sorted(m for m in ('pydantic', 'zeroplan.policy', 'zeroplan.engines') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_console_script_runs():
    out = subprocess.run(["zeroplan", "estimate", "--params", "7.5e9", "--gpus", "64", "--stage", "3", "--csv"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split(",")[5] == "1875000000"


def test_validate_without_torch_is_one_line():
    # The planner installs without torch; `zeroplan validate` must then say what to install, not crash.
    code = (
        "import importlib.util, sys\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'torch' else _find(name, *a)\n"
        "from zeroplan.cli import main\n"
        "sys.argv = ['zeroplan', 'validate']\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        'zeroplan: error: validate needs torch (2.4 to 2.13): install the extra, e.g. pip install ".[validate]"'
    )
