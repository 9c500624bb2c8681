"""An option at its own default is coerced without typer's pydantic adapter (issue 16; docs/benchmarks.md,
"Start-up, fifth pass"): ``zeroplan.cli_startup._own_default`` decides which, and these tests hold it to typer's
own coercion for every option of every command, so a typer that starts changing such a value fails here."""

import json
import subprocess
import sys

import pytest
from typer._click.core import ParameterSource
from typer._coercion import build_runtime_param
from typer.main import get_command

import zeroplan.cli as cli
from zeroplan.cli_startup import _COERCED_WHEN_GIVEN, _own_default, _plain_text

# what the fast path must cover: each command's options whose default is already of its declared type
OWN_DEFAULTS = {
    "estimate": {"micro_batch", "checkpointing", "grad_accum", "engine", "gpus", "gpus_per_node", "model_parallel",
                 "alloc_conf", "units"},
    "plan": {"gpus", "gpus_per_node", "model_parallel", "headroom", "alloc_conf", "inter_interconnect", "algorithm",
             "micro_batch", "grad_accum", "checkpointing", "engine", "offload", "mfu", "param_dtype", "units"},
}


def commands():
    """Every command's click object, each in the group ``zeroplan.cli.app_for`` builds for it."""
    for name in cli.COMMANDS:
        group = get_command(cli.app_for([name]))
        yield name, group.commands[name]


@pytest.mark.parametrize("name,command", list(commands()), ids=list(cli.COMMANDS))
def test_an_option_at_its_own_default_is_what_typer_returns(name, command):
    import typer

    ctx = typer.Context(command)
    fast = set()
    for param in command.params:
        value = param.get_default(ctx)
        if value is None or param.type_descriptor.annotation is bool:  # None: coerce_when_given; bool: typer skips
            continue
        ctx.set_parameter_source(param.name, ParameterSource.DEFAULT)
        typer_value = build_runtime_param(param.type_descriptor).coerce(value, param=param, ctx=ctx)
        param._runtime_param = None
        if _own_default(value, param, ctx):
            fast.add(param.name)
            assert _COERCED_WHEN_GIVEN.coerce(value, param, ctx) is value
            assert type(typer_value) is type(value) and typer_value == value, (name, param.name, value, typer_value)
        ctx.set_parameter_source(param.name, ParameterSource.COMMANDLINE)  # given: typer's own coercion, always
        assert not _own_default(value, param, ctx)
        ctx.set_parameter_source(param.name, ParameterSource.ENVIRONMENT)
        assert not _own_default(value, param, ctx)
    assert OWN_DEFAULTS.get(name, fast) == fast


def test_a_bounded_or_converted_default_goes_to_typer():
    # a number with min/max (typer checks the bound) or an int default of a float option (pydantic returns 1.0)
    import typer

    def command(a: float = typer.Option(1), b: int = typer.Option(3, min=1), c: float = typer.Option(0.5)):
        """Three options."""

    app = typer.Typer(add_completion=False)
    app.command()(command)
    click_command = get_command(app)
    ctx = typer.Context(click_command)
    taken = {}
    for param in click_command.params:
        ctx.set_parameter_source(param.name, ParameterSource.DEFAULT)
        taken[param.name] = _own_default(param.get_default(ctx), param, ctx)
    assert taken == {"a": False, "b": False, "c": True}
    a = next(p for p in click_command.params if p.name == "a")
    assert type(build_runtime_param(a.type_descriptor).coerce(1, param=a, ctx=ctx)) is float


def test_a_plan_builds_adapters_for_its_given_options_only():
    # fresh process: the options at their own default keep the stand-in (no TypeAdapter), given ones get typer's
    record = ("import typer.core as core\nseen = {}\nprocess = core._TyperParameter.process_value\n"
              "def recording(self, ctx, value):\n"
              "    out = process(self, ctx, value)\n"
              "    seen[self.name] = type(self._runtime_param).__name__\n"
              "    return out\n"
              "core._TyperParameter.process_value = recording\n")  # fmt: skip
    code = (f"import sys\n{record}\nfrom zeroplan.cli import main\n"
            "sys.argv = ['zeroplan', 'plan', '--model', 'llama2-7b', '--gpus', '8', '--gpu', 'a100-40gb', '--json']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nimport json\nprint(sorted(sys.modules), file=sys.stderr)\n"
            "print(json.dumps(seen), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["inputs"]["gpus"] == 8
    seen = json.loads(out.stderr.strip().splitlines()[-1])
    # given: --model, --gpus, --gpu, plain text (_plain_text); --json: a bool flag, which typer does not coerce
    assert {k for k, v in seen.items() if v == "AdapterRuntimeParam"} == set()
    assert OWN_DEFAULTS["plan"] | {"model", "gpu", "help"} <= {k for k, v in seen.items() if v == "_CoercedWhenGiven"}
    assert "typer._adapters" not in out.stderr.strip().splitlines()[-2]  # its import: pydantic adapters


TEXTS = ("8", "0", "1024", "999999999999999999", "9999999999999999999", "007", "+8", "-1", " 8", "8 ", "1_000",
         "1.0", "1e3", "0x10", "\uff18", "\u00b2", "", "abc", "h100-80gb", "llama3-405b", "GiB", "gib", "\u00fc",
         "\udcff", "a\x00b", "none")


@pytest.mark.parametrize("name,command", list(commands()), ids=list(cli.COMMANDS))
def test_a_given_plain_text_is_what_typer_returns(name, command):
    # _plain_text answers a given str or int option without typer's adapter: the same value as typer's own
    # coercion wherever it answers; where typer refuses the text, it leaves it to typer (the same error)
    import typer

    ctx = typer.Context(command)
    answered = 0
    for param in command.params:
        if param.type_descriptor.annotation is bool:
            continue
        ctx.set_parameter_source(param.name, ParameterSource.COMMANDLINE)
        for text in TEXTS:
            plain = _plain_text(text, param)
            try:
                typer_value = build_runtime_param(param.type_descriptor).coerce(text, param=param, ctx=ctx)
            except Exception:  # noqa: BLE001 - typer refuses: the shortcut must not answer
                assert plain is None, (name, param.name, text)
                continue
            if plain is not None:
                answered += 1
                assert type(plain) is type(typer_value) and plain == typer_value, (name, param.name, text)
            param._runtime_param = None
            assert _COERCED_WHEN_GIVEN.coerce(text, param, ctx) == typer_value
        param._runtime_param = None
    assert answered > (10 if name in ("estimate", "plan") else 0)
