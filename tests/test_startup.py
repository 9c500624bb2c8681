"""What a fresh ``zeroplan`` process skips at start-up (issue 16; docs/benchmarks.md, "Start-up, fourth pass").

Each check runs a command in a fresh interpreter (what is imported or built depends on the process's history) and
asserts both that the answer is unchanged and that the skipped work was skipped: reverting the change fails it.
"""

import json
import subprocess
import sys

ESTIMATE = "['zeroplan', 'estimate', '--params', '7.5e9', '--gpus', '64', '--json']"


def run_main(argv: str, before: str = "", after: str = "") -> subprocess.CompletedProcess:
    """``zeroplan.cli.main`` with ``argv`` in a fresh interpreter; ``before`` and ``after`` run around it and
    print to stderr."""
    code = (f"import sys\n{before}\nfrom zeroplan.cli import main\nsys.argv = {argv}\n"
            f"try:\n    main()\nexcept SystemExit:\n    pass\n{after}\n")  # fmt: skip
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_an_option_left_unset_builds_no_coercion():
    # typer 0.29 builds a pydantic TypeAdapter per option before coercing, even a value of None it returns
    # unchanged (38 for this estimate, 11 of them coerce a value): zeroplan.cli_startup.coerce_when_given.
    record = ("import typer.core as core\nseen = {}\nprocess = core._TyperParameter.process_value\n"
              "def recording(self, ctx, value):\n"
              "    out = process(self, ctx, value)\n"
              "    seen[self.name] = (value is None, type(self._runtime_param).__name__)\n"
              "    return out\n"
              "core._TyperParameter.process_value = recording\n")  # fmt: skip
    out = run_main(ESTIMATE, record, "import json\nprint(json.dumps(seen), file=sys.stderr)")
    assert json.loads(out.stdout)["stages"][3]["model_states_bytes"] == 1_875_000_000
    seen = json.loads(out.stderr.strip().splitlines()[-1])
    unset = {name for name, (none, _) in seen.items() if none}
    assert {"model", "stage", "gpu", "seq_len", "deepspeed_config", "help"} <= unset
    assert {seen[name][1] for name in unset} == {"_CoercedWhenGiven"}  # no adapter for any of them
    # given plain text (a str option's ASCII, an int option's digits): no adapter either (sixth pass)
    assert seen["gpus"][1] == seen["params"][1] == "_CoercedWhenGiven"
    assert len(unset) > 2 * (len(seen) - len(unset))


def test_a_bad_value_for_an_option_unset_by_default_is_typers_own_line():
    # the deferred coercion is typer's own once a value is given: same message, exit code 2
    code = ("import sys\nfrom zeroplan.cli import main\n"
            "sys.argv = ['zeroplan', 'estimate', '--params', '7.5e9', '--gpus', '8', '--stage', 'x']\nmain()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("zeroplan: error: Invalid value for '--stage': Input should be a valid integer, unable to "
                          "parse string as an integer\n")


def test_presets_models_built_when_a_preset_is_read():
    # GpuSpec, LinkSpec and ModelPreset are built on first use (defer_build): `estimate --params` reads no preset
    check = ("from zeroplan.presets import GpuSpec, LinkSpec, ModelPreset\n"
             "print([type(m.__pydantic_validator__).__name__ for m in (GpuSpec, LinkSpec, ModelPreset)], "
             "file=sys.stderr)")  # fmt: skip
    out = run_main(ESTIMATE, after=check)
    assert json.loads(out.stdout)["stages"][3]["model_states_bytes"] == 1_875_000_000
    assert out.stderr.strip().splitlines()[-1] == "['MockValSer', 'MockValSer', 'MockValSer']"
    out = run_main(ESTIMATE.replace("'--json'", "'--gpu', 'h100-80gb', '--json'"), after=check)
    assert json.loads(out.stdout)["inputs"]["gpu_memory_bytes"] == 80 * 2**30
    assert out.stderr.strip().splitlines()[-1] == "['SchemaValidator', 'MockValSer', 'MockValSer']"


def test_a_one_answer_command_ends_with_its_objects_frozen():
    # estimate/plan/help end with gc.freeze (zeroplan.cli.main): the interpreter's last collection at exit walked
    # every object they made (about 6% of `estimate`'s instructions); the collector is on again, as it was
    check = "import gc\nprint(gc.get_freeze_count() > 10_000, gc.isenabled(), file=sys.stderr)"
    out = run_main(ESTIMATE, after=check)
    assert json.loads(out.stdout)["stages"][3]["model_states_bytes"] == 1_875_000_000
    assert out.stderr.strip().splitlines()[-1] == "True True"


def test_a_command_that_writes_files_ends_collectable(tmp_path):
    # sweep writes files (and keeps the collector): nothing is frozen, no finalizer is held back
    check = "import gc\nprint(gc.get_freeze_count(), gc.isenabled(), file=sys.stderr)"
    out_csv = tmp_path / "s.csv"
    out = run_main(f"['zeroplan', 'sweep', '--params', '1e9', '--gpus', '8', '--out', {str(out_csv)!r}]", after=check)
    assert out.stderr.strip().splitlines()[-1] == "0 True"
    assert out_csv.read_text().count("\n") > 4


def test_command_annotations_are_objects_not_strings():
    # typer evaluates each string annotation of the command it registers (typing.get_type_hints: 1.6 ms a call for
    # estimate's 41, twice): the command modules keep real annotations (no `from __future__ import annotations`)
    import zeroplan.cli as cli
    from zeroplan.cli_startup import imported

    for name, command in cli.COMMANDS.items():
        command = imported(command) if isinstance(command, str) else command
        strings = [p for p, a in command.__annotations__.items() if isinstance(a, str)]
        assert strings == [], (name, strings)


def test_a_plan_loads_no_other_commands_module():
    # the sweep, plot and validate commands' modules, the --max-micro-batch search and EstimateConfig's module are
    # imported where used (docs/benchmarks.md, "Start-up, fifth pass"); `zeroplan.cli.plot` and the others still
    # answer by their old address, and `zeroplan --help` lists all five
    skipped = ("zeroplan.cli_sweep", "zeroplan.cli_plot", "zeroplan.cli_validate", "zeroplan.planning.largest_batch",
               "zeroplan.estimation.config")
    after = f"print([m for m in {skipped!r} if m in sys.modules], file=sys.stderr)"
    out = run_main("['zeroplan', 'plan', '--model', 'llama2-7b', '--gpus', '8', '--gpu', 'a100-40gb', '--json']",
                   after=after)
    assert json.loads(out.stdout)["inputs"]["gpus"] == 8
    assert out.stderr.strip().splitlines()[-1] == "[]"
    out = run_main(ESTIMATE, after=after)
    assert out.stderr.strip().splitlines()[-1] == "['zeroplan.estimation.config']"
    out = run_main("['zeroplan', '--help']", after="import zeroplan.cli as c\nprint(c.plot.__module__, "
                   "c.PlotView.__module__, c.validate_cmd.__name__, c.sweep.__name__, file=sys.stderr)")
    assert all(f" {name} " in out.stdout for name in ("estimate", "sweep", "plot", "plan", "validate"))
    assert out.stderr.strip().splitlines()[-1] == "zeroplan.cli_plot zeroplan.cli_plot validate_cmd sweep"


def test_a_csv_sweep_loads_neither_pandas_nor_pyarrow_compute(tmp_path):
    # render/sweep.py calls pyarrow's compute functions by name (``_call``): ``import pyarrow.compute`` builds a
    # wrapper per function (about 40 ms of CPU; docs/benchmarks.md, "The CSV sweep, fifth pass"). The CSV is numpy
    # columns to pyarrow, never a DataFrame. Rows: 2 Ψ x 2 GPU counts x (4 stages + 3 offloaded: stages 1-3).
    out = tmp_path / "x.csv"
    argv = (f"['zeroplan', 'sweep', '--params', '1e9,7e9', '--gpus', '8,4096', '--offload', 'none,cpu', "
            f"'--gpu-memory', '40GiB', '--out', {str(out)!r}]")  # fmt: skip
    seen = run_main(argv, after="print(sorted(m for m in ('pandas', 'pyarrow', 'pyarrow.compute') if m in sys.modules)"
                    ", file=sys.stderr)")  # fmt: skip
    assert seen.stderr.strip().splitlines()[-1] == "['pyarrow']"
    lines = out.read_text().splitlines()
    assert len(lines) == 1 + 2 * 2 * (4 + 3) and lines[1].startswith("1000000000,8,1,8,1000000000,1,0,DP,none,")


def test_a_plan_that_replays_no_trace_loads_no_allocator_replay():
    # engines/deepspeed/alloc_trace.py and planning/reserved_fit.py import the allocator's trace and replay modules
    # (step_trace, replay, blocks, caching: ~32 M instructions) where a trace is built, not at import: a plan whose
    # every row's live peak exceeds the GPU (70B on two 40 GB GPUs) replays none (docs/benchmarks.md, DeepSpeed plan,
    # ninth pass); a plan with a row that fits does (7B on eight).
    after = ("import json\nprint(json.dumps(['zeroplan.allocator.step_trace' in sys.modules, "
             "'zeroplan.allocator.replay' in sys.modules]), file=sys.stderr)")
    for gpus, replays in (("2", False), ("8", True)):
        model = "llama2-70b" if gpus == "2" else "llama2-7b"
        argv = (f"['zeroplan', 'plan', '--engine', 'deepspeed', '--model', {model!r}, '--gpus', {gpus!r}, "
                "'--gpu', 'a100-40gb', '--json']")
        done = run_main(argv, after=after)
        rows = [*json.loads(done.stdout)["stages"], *json.loads(done.stdout)["offload"]]
        assert any(r.get("reserved_bytes") is not None for r in rows) is replays, gpus
        assert json.loads(done.stderr.strip().splitlines()[-1]) == [replays, replays], gpus


def test_a_plan_table_prints_its_ds_config_without_the_json_documents_models():
    # the table's ds_config goes through render.json_text, the JSON writer alone: render.schemas (the thirty
    # document models) and sweeping.records (SweepRow) are not loaded (docs/benchmarks.md, "2026-12-03, startup");
    # `plan --json` still builds PlanDoc with them
    argv = "['zeroplan', 'plan', '--engine', 'deepspeed', '--model', 'llama2-7b', '--gpus', '8', '--gpu', 'a100-40gb'"
    after = ("print([m for m in ('zeroplan.render.schemas', 'zeroplan.sweeping.records') if m in sys.modules], "
             "file=sys.stderr)")
    table, as_json = run_main(argv + "]", after=after), run_main(argv + ", '--json']", after=after)
    assert table.stderr.strip().splitlines()[-1] == "[]"
    assert as_json.stderr.strip().splitlines()[-1] == "['zeroplan.render.schemas', 'zeroplan.sweeping.records']"
    printed = table.stdout.split("\nDeepSpeed config (exactly the one predicted):\n", 1)[1].split("\n\n", 1)[0]
    assert json.loads(printed) == json.loads(as_json.stdout)["recommendation"]["deepspeed"]
    assert json.dumps(json.loads(printed), indent=2, allow_nan=False) == printed
    from zeroplan.render.json_text import json_text
    from zeroplan.render.schemas import json_text as re_exported

    assert re_exported is json_text


def test_the_fsdp2_plans_models_keep_real_annotations():
    # pydantic evaluates each string annotation of a model it builds, and dataclasses match each string against
    # ClassVar and InitVar: the FSDP2 plan's settings, wrapping and engine records keep objects (1.1 M instructions;
    # docs/benchmarks.md, "2026-12-03, fifth session, startup3"), as the policy, presets and configs do (second pass)
    from zeroplan.engines import base
    from zeroplan.engines.fsdp2 import settings, wrap

    classes = [value for module in (base, settings, wrap) for value in vars(module).values()
               if isinstance(value, type) and value.__module__ == module.__name__]
    assert len(classes) >= 10
    strings = [(c.__name__, n) for c in classes for n, a in vars(c).get("__annotations__", {}).items()
               if isinstance(a, str)]
    assert strings == []


REAL_ANNOTATIONS = ("zeroplan.architectures.spec", "zeroplan.architectures.moe", "zeroplan.engines.declared",
                    "zeroplan.engines.live", "zeroplan.engines.fsdp2.collectives", "zeroplan.engines.fsdp2.param",
                    "zeroplan.engines.fsdp2.states", "zeroplan.formulas.activation_terms",
                    "zeroplan.formulas.collectives", "zeroplan.formulas.commtime", "zeroplan.formulas.memory",
                    "zeroplan.formulas.mesh", "zeroplan.formulas.moe_activations", "zeroplan.formulas.offload",
                    "zeroplan.formulas.optimizers", "zeroplan.formulas.peak", "zeroplan.formulas.stages",
                    "zeroplan.planning.records")  # fmt: skip


def test_every_plans_dataclasses_keep_real_annotations():
    # dataclasses match each string annotation against ClassVar and InitVar (a regular expression and two lookups a
    # field) and pydantic evaluates each one of a dataclass it validates (TransformerSpec in EstimateConfig): the
    # dataclass modules every plan and estimate load keep objects (4.6 M instructions of the FSDP2 70B plan, 4.8 M of
    # estimate; docs/benchmarks.md, "2026-12-03, sixth session, imports4")
    import dataclasses
    import importlib

    modules = [importlib.import_module(name) for name in REAL_ANNOTATIONS]
    classes = [value for module in modules for value in vars(module).values()
               if dataclasses.is_dataclass(value) and value.__module__ == module.__name__]
    assert len(classes) >= 30
    strings = [(c.__name__, f.name) for c in classes for f in dataclasses.fields(c) if isinstance(f.type, str)]
    assert strings == []


def test_an_estimate_table_or_json_imports_no_csv_and_its_csv_is_as_written():
    # render.estimate imports csv in to_csv, the CSV view alone (docs/benchmarks.md, "2026-12-03, sixth session,
    # imports4"); `estimate --csv` still writes the header and one row a stage
    # (what the command imports: a .pth file may import csv at start-up, as CI's imports tempfile)
    before = "started = set(sys.modules)"
    after = "print('csv' in sys.modules, sorted({'csv', '_csv'} & set(sys.modules) - started), file=sys.stderr)"
    for argv in (ESTIMATE, ESTIMATE.replace(", '--json'", "")):
        assert run_main(argv, before, after).stderr.strip().splitlines()[-1].endswith(" []"), argv
    done = run_main(ESTIMATE.replace("'--json'", "'--csv'"), before, after)
    assert done.stderr.strip().splitlines()[-1].startswith("True ")
    lines = done.stdout.splitlines()
    assert lines[0].startswith("stage,name,params_bytes,") and len(lines) == 5 and lines[1].startswith("0,")
