"""Shared typer option blocks and the one-line error handling of every ``zeroplan`` command.

Every bad input ends as one line on stderr and exit code 2 (``OneLineErrors``); nothing is printed to stdout
before the whole answer is ready."""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from typer.core import TyperGroup

from zeroplan.cli_startup import coerce_when_given
from zeroplan.terminated import Terminated

if TYPE_CHECKING:
    from zeroplan.policy import PrecisionPolicy

try:  # typer >= 0.20 vendors its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer on plain click
    from click import exceptions as click_exceptions


class UserError(Exception):
    """Bad input found by a command; printed as one line, exit code 2."""


class OneLineErrors(TyperGroup):
    """Click group that turns usage errors and bad values into one stderr line and exit code 2, and
    refuses an option given twice on every command (click would silently keep the last value)."""

    def resolve_command(self, ctx, args):  # noqa: D102
        name, command, rest = super().resolve_command(ctx, args)
        if command is not None:
            refuse_repeated(command, rest)
            # an option left unset or plain builds no pydantic adapter (zeroplan.cli_startup)
            coerce_when_given(command, command.get_help_option(ctx))
        return name, command, rest

    def get_help_option(self, ctx):  # noqa: D102
        return coerce_when_given(None, super().get_help_option(ctx))  # the group's --help: no adapter either

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D102
        try:
            rv = super().main(args, prog_name or "zeroplan", complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as exc:
            typer.echo(exc.ctx.get_help())
            rv = 0
        except click_exceptions.ClickException as exc:
            typer.echo(f"zeroplan: error: {exc.format_message()}", err=True)
            rv = 2
        except (UserError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            typer.echo(f"zeroplan: error: {_one_line(exc)}", err=True)
            rv = 2
        except typer.Abort:
            typer.echo("zeroplan: aborted", err=True)
            rv = 130
        except OSError as exc:
            if exc.filename is not None:  # a name the user gave, probed as an input (files are written by
                # zeroplan.files, which turns its OSErrors into ValueErrors): an input error, exit 2
                typer.echo(f"zeroplan: error: {str(exc.filename)[:80]!r}: {exc.strerror or exc}", err=True)
                rv = 2
            else:  # stdout on a full disk or closed: the input was fine, the output was not
                typer.echo(f"zeroplan: error: cannot write the output ({exc.strerror or exc})", err=True)
                rv = 1
        except Terminated as exc:  # SIGTERM/SIGHUP while writing: the temporary file is already removed
            typer.echo(f"zeroplan: error: terminated by {exc}", err=True)
            rv = 128 + exc.signum
        if not standalone_mode:
            return rv
        sys.exit(rv or 0)


def _one_line(exc: Exception) -> str:
    """The message of a bad input: a pydantic ValidationError's first error (``zeroplan.types.error_line``),
    else the exception's own text. pydantic is looked up, not imported: a command that built no model
    raised no ValidationError (the CLI's start-up imports no pydantic, issue 16)."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        from zeroplan.types import error_line

        return error_line(exc)
    return str(exc)


def refuse_repeated(command, args: list[str]) -> None:
    """UsageError when an option that takes one value (not declared ``multiple``) appears twice in
    ``args``, in any spelling (``--gpus 8 --gpus=16``, ``--json --json``, ``--master-weights
    --no-master-weights``). Options meant to repeat (validate's ``--world-size``, ``--stage``) are lists."""
    by_flag = {}
    for param in command.params:
        for flag in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())):
            by_flag[flag] = param
    seen: set[str] = set()
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            break
        flag, eq, _ = token.partition("=")
        param = by_flag.get(flag)
        if param is None or not flag.startswith("-"):
            continue
        if not eq and not getattr(param, "is_flag", False) and param.nargs != 0:
            i += 1  # the value that follows, even if it starts with '-'
        if getattr(param, "multiple", False):
            continue
        if param.name in seen:
            raise click_exceptions.UsageError(f"{flag} given more than once: give each option once")
        seen.add(param.name)


def given_on_command_line(ctx, *names: str) -> list[str]:
    """Those of ``names`` (parameter names) the user typed, rather than left at their defaults."""
    sources = {n: ctx.get_parameter_source(n) for n in names}
    return [n for n, source in sources.items() if source is not None and source.name == "COMMANDLINE"]


def refuse_unused(ctx, names: tuple[str, ...], why: str) -> None:
    """UserError naming the first of ``names`` the user gave: an option that would be ignored."""
    for name in given_on_command_line(ctx, *names):
        flag = next(p.opts[0] for p in ctx.command.params if p.name == name)
        raise UserError(f"{flag} does not apply {why}")


class Unit(str, Enum):
    GB = "GB"
    GiB = "GiB"


# Precision-policy options shared by every command; None means "PrecisionPolicy's default".
ParamDtype = Annotated[Optional[str], typer.Option(
    help="Working parameter dtype: fp16 (the paper's), bf16, fp32, fp8.")]
GradDtype = Annotated[Optional[str], typer.Option(help="Gradient dtype (default: param dtype).")]
MasterWeights = Annotated[Optional[bool], typer.Option(
    "--master-weights/--no-master-weights", help="fp32 master copy (default: on unless fp32).")]
OptimizerName = Annotated[Optional[str], typer.Option(
    help="adam (default), adamw, sgd, sgd-momentum, lamb, lion, adafactor, adam8bit.")]
OptimizerDtype = Annotated[Optional[str], typer.Option(help="dtype of Adam m/v and momentum (default fp32).")]


def given(**options: object) -> dict:
    """The options the user gave, without the ones left at None (so the config's defaults apply)."""
    return {k: v for k, v in options.items() if v is not None}


def policy_from(param_dtype, grad_dtype, master_weights, optimizer, optimizer_dtype) -> PrecisionPolicy:
    """A PrecisionPolicy from the shared options; those left at None take the policy's defaults."""
    from zeroplan.policy import PrecisionPolicy

    return PrecisionPolicy(
        **given(
            param_dtype=param_dtype,
            grad_dtype=grad_dtype,
            master_weights=master_weights,
            optimizer=optimizer,
            optimizer_dtype=optimizer_dtype,
        )
    )


# The training step of an architecture (issue 8), shared by estimate, plan and sweep.
ModelOption = Annotated[
    Optional[str],
    typer.Option(help="Model preset (llama2-7b, gpt2-xl, ...), the path of a Hugging Face config.json, or "
                 "ORG/NAME in the local Hugging Face cache (never downloaded): exact shapes, and the peak of a "
                 "training step."),
]  # fmt: skip
RevisionOption = Annotated[
    Optional[str],
    typer.Option(help="With --model ORG/NAME: the cached snapshot of this branch, tag or commit (default: "
                 "refs/main, else the newest)."),
]  # fmt: skip
SeqLenOption = Annotated[
    Optional[int],
    typer.Option("--seq-len", help="Tokens per sequence, at most the model's positions (default: the preset's; "
                 "for a config.json its max positions, at most 2048). Needs --model."),
]  # fmt: skip
MicroBatchOption = Annotated[
    int, typer.Option("--micro-batch", help="Sequences per GPU per micro-step, 1 to 65536. Needs --model.")
]
CheckpointingOption = Annotated[
    str, typer.Option(help="Activation checkpointing: none, or full (every block recomputed). Needs --model.")
]
SelectiveAcOption = Annotated[
    Optional[str],
    typer.Option("--selective-ac", help="fsdp2, --checkpointing full: torchtitan's selective_ac_option: K checkpoints "
                 "layers K, 2K, ... (default 1: all); op keeps every layer's matmul outputs but every second one."),
]  # fmt: skip


def refuse_selective_ac(selective_ac: Optional[str], checkpointing: str, from_file: bool) -> None:
    """UserError (one line) for ``--selective-ac`` where it would change nothing: without ``--checkpointing full``,
    or beside a launcher file, which sets its own checkpointing."""
    if selective_ac is not None and (checkpointing != "full" or from_file):
        raise UserError(f"--selective-ac {selective_ac}: selects what --checkpointing full recomputes; " + (
            "a launcher file sets its own checkpointing" if from_file else f"got --checkpointing {checkpointing}"))


GradAccumOption = Annotated[int, typer.Option("--grad-accum", help="Micro-steps per optimizer step, 1 to 65536.")]
ForeachOption = Annotated[
    Optional[bool], typer.Option("--foreach/--no-foreach",
                                 help="Adam's multi-tensor path (default: torch's choice for the device: on with "
                                 "CUDA, off with --device cpu). Needs --model."),
]  # fmt: skip
EngineOption = Annotated[
    str, typer.Option(help="Training engine whose memory is estimated: reference (the paper's stages, the bundled "
                      "runtime), fsdp2 (PyTorch fully_shard) or deepspeed (ZeRO 1-3 from --deepspeed-config).")
]  # fmt: skip
ReshardOption = Annotated[
    Optional[str],
    typer.Option("--reshard-after-forward", help="fsdp2: true (default: blocks gathered again in backward), false "
                 "(kept gathered) or an integer k dividing N_d (kept sharded over k ranks until backward)."),
]  # fmt: skip
ReduceDtypeOption = Annotated[
    Optional[str],
    typer.Option("--reduce-dtype", help="fsdp2: MixedPrecisionPolicy.reduce_dtype, fp32, bf16 or fp16 (default: "
                 "the param dtype)."),
]  # fmt: skip
DpReplicateOption = Annotated[
    Optional[int],
    typer.Option("--dp-replicate", help="fsdp2: HSDP, replicas R of fully_shard's 2-D mesh (R, S) with R x S = N_d; "
                 "gradients all-reduced across them (default: N_d / --dp-shard, else 1)."),
]  # fmt: skip
DpShardOption = Annotated[
    Optional[str],
    typer.Option("--dp-shard", help="fsdp2: HSDP, ranks S each parameter is sharded over (default: N_d / "
                 "--dp-replicate, else N_d); plan: auto searches it (whole nodes, the smallest that fits)."),
]  # fmt: skip
TpOption = Annotated[
    Optional[str],
    typer.Option("--tp", help="fsdp2: tensor parallelism over T GPUs (torchtitan's llama plan: colwise q/k/v, gate/up, "
                 "rowwise o/down, sequence-parallel norms, loss parallel); FSDP2 shards over GPUs / T; plan: auto searches "
                 "1, 2, 4, 8 within a node. plan searches the mesh when none of --tp, --dp-shard, --dp-replicate is "
                 "given; one given pins it (--tp 1: the flat group)."),
]  # fmt: skip
LossParallelOption = Annotated[
    Optional[bool],
    typer.Option("--loss-parallel/--no-loss-parallel", help="fsdp2 with --tp: the head's output Shard(-1) and the "
                 "loss under loss_parallel() (default, torchtitan's); --no-loss-parallel: Replicate, the logits "
                 "all-gathered to every TP rank (torchtitan's disable_loss_parallel)."),
]  # fmt: skip
FsdpWrapOption = Annotated[
    Optional[str],
    typer.Option("--fsdp-wrap", help="fsdp2: the fully_shard calls: blocks (each decoder layer, then the root; "
                 "default), torchtitan (embeddings, each block, the final norm and output as one unit kept gathered, "
                 "the root) or a JSON file of units in call order (docs/engines/fsdp2.md)."),
]  # fmt: skip
InitOption = Annotated[
    Optional[str],
    typer.Option("--init", help="fsdp2: meta (built on the meta device, sharded, to_empty; default) or "
                 "materialized (built whole on the device, then sharded)."),
]  # fmt: skip
DeviceOption = Annotated[
    Optional[str],
    typer.Option("--device", help="fsdp2, deepspeed: cuda (default: NCCL, CUDA blocks and workspaces) or cpu (a "
                 "CPU run on gloo, as CPU CI runners train)."),
]  # fmt: skip
FsdpOffloadOption = Annotated[
    Optional[str],
    typer.Option("--fsdp-offload", help="fsdp2: none (default) or cpu (fully_shard(offload_policy="
                 "CPUOffloadPolicy()): shards, gradients and Adam on the host; docs/engines/fsdp2.md)."),
]  # fmt: skip
FsdpPinMemoryOption = Annotated[
    Optional[bool],
    typer.Option("--fsdp-pin-memory/--no-fsdp-pin-memory", help="fsdp2 with --fsdp-offload cpu: "
                 "CPUOffloadPolicy(pin_memory=...) (default true)."),
]  # fmt: skip
ZeroInitOption = Annotated[
    Optional[bool],
    typer.Option("--zero-init/--no-zero-init", help="deepspeed ZeRO-3: the model built under deepspeed.zero.Init "
                 "(default at stage 3) or built whole, then partitioned by deepspeed.initialize."),
]  # fmt: skip
HfZeroInitOption = Annotated[
    Optional[bool],
    typer.Option("--hf-zero-init/--no-hf-zero-init", help="deepspeed ZeRO-3 under zero.Init, with --model: the model "
                 "built by transformers (from_config with an HfDeepSpeedConfig alive, as the HF Trainer and accelerate "
                 "do: each module initialised with its children gathered) or by your script's own zero.Init (default, "
                 "unless a --deepspeed-config with \"auto\" or an --accelerate-config says the HF Trainer's)."),
]  # fmt: skip
DeepSpeedConfigOption = Annotated[
    Optional[Path],
    typer.Option("--deepspeed-config", help="ds_config.json: with --engine deepspeed the engine's settings (buckets, "
                 "precision, optimizer, stage); with reference, its stage, dtypes and optimizer."),
]  # fmt: skip
OWN_OPTION_PARAMS: dict[str, str] = {
    "deepspeed_config": "ds_config",
    "reshard_after_forward": "reshard_after_forward",
    "param_dtype": "param_dtype",
    "reduce_dtype": "reduce_dtype",
    "fsdp_wrap": "wrap",
    "init": "init",
    "device": "device",
    "dp_replicate": "dp_replicate",
    "dp_shard": "dp_shard",
    "zero_init": "zero_init",
    "hf_zero_init": "hf_zero3_build",
    "fsdp_offload": "offload_policy",
    "fsdp_pin_memory": "pin_memory",
    "tp": "tp",
    "loss_parallel": "loss_parallel",
    "selective_ac": "selective_ac",
}
"""Command parameter -> the engine's own option it sets (``Engine.own_options``, by name): the CLI's half of
adding an option (the engine declares it; its flag is typed here and listed here)."""
ENGINE_VOCABULARY: dict[str, tuple[str, ...]] = {
    "stage": ("stages", "stage"),
    "grad_dtype": ("policy",),
    "master_weights": ("policy",),
    "optimizer": ("policy",),
    "optimizer_dtype": ("policy",),
    **{param: (own,) for param, own in OWN_OPTION_PARAMS.items()},
    "deepspeed_config": ("policy", "ds_config"),  # the reference engine reads a ds_config's precision (file_policy)
    "param_dtype": ("policy", "param_dtype"),  # the reference engine's policy dtype, FSDP2's MixedPrecisionPolicy
}
"""Command parameter -> the shared ``PlannerOptions`` fields or own options it sets; an engine takes it when it
reads any of them (``Engine.reads``)."""
def _parse_reshard(text: str) -> bool | int:
    """``zeroplan.parsing.parse_reshard``, imported when a command is given the option."""
    from zeroplan.parsing import parse_reshard

    return parse_reshard(text)


PARSERS: dict[str, Callable[[str], object]] = {"reshard_after_forward": _parse_reshard}
"""Command parameter -> how its text becomes the option's value (the others are taken as typed)."""


def refuse_foreign(ctx, engine_name: str) -> None:
    """UserError (one line) for an option outside ``--engine``'s vocabulary, e.g. ``--reshard-after-forward``
    with reference, ``--grad-dtype`` or ``--stage`` with fsdp2; an unknown engine name first."""
    from zeroplan.engines import get_engine

    engine = get_engine(engine_name)
    reads = engine.reads
    names = {p.name for p in ctx.command.params}
    foreign = tuple(n for n, fields in ENGINE_VOCABULARY.items() if n in names and not set(fields) & set(reads))
    refuse_unused(ctx, foreign, f"to --engine {engine.name} (its options: {', '.join(reads)})")


def read_settings_file(path) -> Optional[dict]:
    """``--deepspeed-config`` read once, at the edge (None: not given); every later use takes the dict."""
    if path is None:  # no file: ``zeroplan.files`` (tempfile, threading) not imported
        return None
    from zeroplan.files import read_json
    return read_json(path, "deepspeed config")


def engine_options_from(engine_name: str, ds_config: Optional[dict] = None, reshard_after_forward=None,
                        param_dtype=None, reduce_dtype=None, **own):
    """The ``EngineOptions`` of the command line for an engine that reads them (``refuse_foreign`` has
    refused the others): every given command parameter of ``OWN_OPTION_PARAMS`` the engine declares, under its
    option's name (the ds_config as read, ``read_settings_file``; ``--reshard-after-forward`` parsed); ``own``:
    further command parameters by name."""
    from zeroplan.engines import get_engine
    from zeroplan.engines.base import EngineOptions
    given = dict(deepspeed_config=ds_config, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                 reduce_dtype=reduce_dtype, **own)  # fmt: skip
    theirs = {o.name for o in get_engine(engine_name).own_options}
    return EngineOptions(**{OWN_OPTION_PARAMS[k]: PARSERS.get(k, lambda v: v)(v) for k, v in given.items()
                            if v is not None and OWN_OPTION_PARAMS[k] in theirs})  # fmt: skip


def ds_config_batch(ctx, engine_name: str, ds_config: Optional[dict], nd: Optional[int], given: dict[str, int]):
    """(micro-batch, accumulation) of the run by the engine's batch rule (``Engine.batch``: the ds_config's
    batch where it sets one), a value of ``given`` (parameter name -> value) counting as given only when
    the user typed it."""
    from zeroplan.engines import get_engine

    typed = set(given_on_command_line(ctx, *given))
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    return get_engine(engine_name).batch(
        ds_config, nd, *(given[n] if n in typed else None for n in ("micro_batch", "grad_accum")),
        (flags.get("micro_batch", ""), flags.get("grad_accum", "")))  # fmt: skip


AllocConfOption = Annotated[
    str,
    typer.Option("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF of the run, for its reserved bytes "
                 "(e.g. expandable_segments:True,max_split_size_mb:512; default: torch's); docs/allocator.md."),
]  # fmt: skip
GpusPerNodeOption = Annotated[
    int, typer.Option(help="GPUs per node, 1 to 2**24 (host memory per node, intra vs inter links).")
]  # fmt: skip

HeadroomOption = Annotated[
    float,
    typer.Option(help="Fraction of GPU memory kept free beyond what is predicted, [0, 1): 0 by default (reserved "
                 "bytes are modelled; the CUDA context and NCCL buffers are not: docs/allocator.md)."),
]  # fmt: skip

STEP_OPTIONS: tuple[str, ...] = ("seq_len", "micro_batch", "checkpointing", "grad_accum", "foreach")
"""Parameter names of the training-step options: refused without an architecture."""
