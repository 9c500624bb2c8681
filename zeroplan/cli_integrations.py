"""The CLI's side of the configuration files users already have (``zeroplan.integrations``, docs/integrations.md):
a ``--deepspeed-config`` with ``"auto"``, ``--accelerate-config`` and ``--torchtitan-config``, turned into the
engine options of ``estimate`` and ``plan``, with the lines the table prints about them. A setting the engines
cannot express yet is refused in one line naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from zeroplan.cli_options import UserError, given_on_command_line


#: ``--mixed-precision`` -> the run's dtype (``TrainerRun.dtype``): accelerate's ``mixed_precision`` values, the
#: HF Trainer's ``--fp16`` / ``--bf16`` (``TrainingArguments.mixed_precision``)
MIXED_PRECISION: dict[str, str] = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}

MixedPrecisionOption = Annotated[
    Optional[str],
    typer.Option("--mixed-precision", help="The run's precision where a --deepspeed-config says \"auto\" for "
                 "fp16/bf16: no, fp16 or bf16, as the HF Trainer's --fp16/--bf16 and accelerate's mixed_precision "
                 "(default: no, the Trainer's default)."),
]  # fmt: skip


def resolve_hf_auto(ctx, options, ds: Optional[dict], model: Optional[str], seq_len: Optional[int], nd: Optional[int],
                    micro_batch: int, grad_accum: int, mixed_precision: Optional[str] = None):
    """A ``--deepspeed-config`` with ``"auto"`` (any engine that reads the file): the ds_config as the HF Trainer
    resolves it (``zeroplan.integrations.hf_trainer``) for this command's run, and the lines saying what each key
    became.

    The run: N_d; the micro-batch and accumulation as typed, or the command line's default where the file
    says ``"auto"`` or nothing (a plain value in the file stands: ``run_batch`` then checks it); the hidden
    size of ``--model``; the precision from ``--mixed-precision`` (the Trainer's ``--fp16``/``--bf16``), else the
    Trainer's default (neither): fp32. Returns ``(options, ds, lines, resolution)``: the resolved file in ``ds``
    and, where the engine holds it, in ``options.ds_config``; the ``AutoResolution`` whose records the JSON
    documents write as ``inputs.ds_config_auto`` (``zeroplan.render.schemas.auto_out``); unchanged, no lines and
    None when nothing is ``"auto"`` (``--mixed-precision`` is then refused: it would change nothing)."""
    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
        raise UserError(f"--mixed-precision {mixed_precision}: expected one of {', '.join(MIXED_PRECISION)}")
    if ds is not None:  # the resolver's module (its records) is loaded only for a file
        from zeroplan.integrations.ds_auto import auto_keys
    if ds is None or not auto_keys(ds):
        if mixed_precision is not None:
            raise UserError("--mixed-precision fills the \"auto\" of a --deepspeed-config; this run has none "
                            "(the precision is the file's or the engine's own option)")  # fmt: skip
        return options, ds, (), None
    from zeroplan.estimation.workload import resolve
    from zeroplan.integrations.hf_trainer import TRANSFORMERS_VERSION, TrainerRun, resolve_trainer_auto

    typed = set(given_on_command_line(ctx, "micro_batch", "grad_accum"))

    def stated(name: str, key: str, value: int) -> Optional[int]:
        return value if name in typed or ds.get(key) in ("auto", None) else None

    run = TrainerRun(nd=nd or 1, micro_batch=stated("micro_batch", "train_micro_batch_size_per_gpu", micro_batch),
                     grad_accum=stated("grad_accum", "gradient_accumulation_steps", grad_accum),
                     dtype=MIXED_PRECISION[mixed_precision] if mixed_precision is not None else None,
                     hidden_size=resolve(model, seq_len)[0].d_model if model is not None else None)  # fmt: skip
    res = resolve_trainer_auto(ds, run)
    width = max(len(f.key) for f in res.filled) if res.filled else 0
    lines = (f'ds_config "auto" as the HF Trainer resolves it (transformers {TRANSFORMERS_VERSION}, '
             "docs/integrations.md):",
             *(f"  {f.key:<{width}} = {f.value!r}  ({f.source.split(' ', 2)[-1]})" for f in res.filled),
             *(f"  {key:<{width}} = 'auto'  ({why})" for key, why in res.unresolved))  # fmt: skip
    if options.ds_config is not None:
        options = options.model_copy(update={"ds_config": res.config})
    options, build = transformers_build(ctx, options, res.config, model, ctx.params.get("engine"), "the HF Trainer's "
                                        "TrainingArguments(deepspeed=...)")  # fmt: skip
    return options, res.config, (*lines, *build), res


def transformers_build(ctx, options, config: dict, model: Optional[str], engine: Optional[str], who: str):
    """``(options, lines)``: ``options`` with ``hf_zero3_build`` set where the run of an HF Trainer ds_config (one with
    ``"auto"``) or of an accelerate DeepSpeed config is ZeRO-3 under ``zero.Init``, and the line saying so; unchanged
    and no line elsewhere.

    Why: both create an ``HfDeepSpeedConfig`` of the file before the script builds its model (transformers
    ``training_args.py`` ``TrainingArguments.__post_init__``: ``HfTrainerDeepSpeedConfig(self.deepspeed)``;
    accelerate ``utils/dataclasses.py`` ``DeepSpeedPlugin.set_deepspeed_weakref``, at ``Accelerator()``), so a
    transformers model (every ``--model``: estimation/workload.py ``model_workload``) is built by transformers: its own
    ``zero.Init`` and ``initialize_weights_zero3`` (engines/deepspeed/build.py). Where: the engine declares the option
    (deepspeed), ``--model`` is given, neither ``--hf-zero-init/--no-hf-zero-init`` nor ``--no-zero-init`` was typed,
    and the run is at ZeRO-3: the file's stage (or ``--stage``), or any stage where the command searches it (plan, which
    has no ``--stage``: its ZeRO-3 rows)."""
    from zeroplan.engines import get_engine

    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", ctx.params.get("stage"))
    if (model is None or engine is None or ctx.params.get("hf_zero_init") is not None
            or ctx.params.get("zero_init") is False or ("stage" in ctx.params and stage != 3)
            or "hf_zero3_build" not in {o.name for o in get_engine(engine).own_options}):  # fmt: skip
        return options, ()
    line = f"build: transformers' own under ZeRO-3 (--hf-zero-init), as {who} runs it"
    return options.model_copy(update={"hf_zero3_build": True}), (line,)


AccelerateConfigOption = Annotated[
    Optional[Path],
    typer.Option("--accelerate-config", help="accelerate launch --config_file YAML: DEEPSPEED sets the deepspeed "
                 "engine, its ds_config and --gpus (num_processes); FSDP (version 2) sets the fsdp2 engine, its "
                 "wrapping, policy and --gpus (docs/integrations.md)."),
]  # fmt: skip
TorchtitanConfigOption = Annotated[
    Optional[Path],
    typer.Option("--torchtitan-config", help="torchtitan TOML job config (torchtitan <= 0.2.2): the fsdp2 engine "
                 "with torchtitan's wrapping, policy, batch and --gpus (docs/integrations.md)."),
]  # fmt: skip


def _implied(ctx, name: str, given: object, value: object, flag: str, why: str) -> object:
    """``value`` (what the file says) for the parameter ``name``; UserError when the user typed another."""
    if name in given_on_command_line(ctx, name) and given != value:
        raise UserError(f"{flag} {given} contradicts {why} ({value}); drop one of them")
    return value


def from_config_files(ctx, accelerate_config: Optional[Path], torchtitan_config: Optional[Path],
                      deepspeed_config: Optional[Path], engine: str, gpus: int, model: Optional[str],
                      seq_len: Optional[int], micro_batch: int, grad_accum: int):
    """``(engine, gpus, EngineOptions or None, lines, step)`` from ``--accelerate-config`` / ``--torchtitan-config``
    (None, no lines and no step without them); ``step``: the micro-batch, accumulation, sequence length and
    checkpointing an FSDP2 launcher file sets. One line (UserError or ValueError) for two configuration files, an
    option that contradicts the file, and what the engines cannot express."""
    if accelerate_config is None and torchtitan_config is None:
        return engine, gpus, None, (), {}
    if sum(x is not None for x in (accelerate_config, torchtitan_config, deepspeed_config)) > 1:
        raise UserError("give one of --accelerate-config, --torchtitan-config and --deepspeed-config")
    if torchtitan_config is not None:
        from zeroplan.integrations.fsdp2_run import from_torchtitan
        from zeroplan.integrations.torchtitan_config import TORCHTITAN_VERSION, read_torchtitan_config

        typed = "gpus" in given_on_command_line(ctx, "gpus")
        run = read_torchtitan_config(torchtitan_config, world_size=gpus if typed else None)
        return _fsdp2(ctx, from_torchtitan(run, _names(model, seq_len)), engine, gpus, "--torchtitan-config",
                      f"torchtitan {TORCHTITAN_VERSION}'s apply_fsdp")  # fmt: skip
    from zeroplan.integrations.accelerate_config import (AccelerateFsdp, prepare_deepspeed,
                                                         read_accelerate_config)

    run = read_accelerate_config(accelerate_config)
    if isinstance(run, AccelerateFsdp):
        from zeroplan.integrations.accelerate_config import ACCELERATE_VERSION
        from zeroplan.integrations.fsdp2_run import from_accelerate

        return _fsdp2(ctx, from_accelerate(run, _names(model, seq_len)), engine, gpus, "--accelerate-config",
                      f"accelerate {ACCELERATE_VERSION}'s fsdp2_prepare_model")  # fmt: skip
    engine = _implied(ctx, "engine", engine, "deepspeed", "--engine", "the accelerate config (DEEPSPEED)")
    gpus = _implied(ctx, "gpus", gpus, run.num_processes, "--gpus", "the accelerate config's num_processes")
    stage = run.ds_config.get("zero_optimization", {}).get("stage")
    if stage == 3 and not run.zero3_init:
        raise UserError("--accelerate-config: zero3_init_flag false (the model built whole, then partitioned): "
                        "estimate and plan model ZeRO-3 under deepspeed.zero.Init; not expressible yet")  # fmt: skip
    hidden = None
    if model is not None:
        from zeroplan.estimation.workload import resolve

        hidden = resolve(model, seq_len)[0].d_model
    res = prepare_deepspeed(run, micro_batch, grad_accum, hidden)
    lines = ("accelerate config: the ds_config as accelerate hands it to DeepSpeed "
             f"({'from ' + run.config_file if run.config_file else 'built from deepspeed_config'}):",
             *(f"  {f.key} = {f.value!r}  ({f.source.split(' ', 2)[-1]})" for f in res.filled),
             *(f"  {key} = 'auto'  ({why})" for key, why in res.unresolved))  # fmt: skip
    from zeroplan.cli_options import OWN_OPTION_PARAMS, engine_options_from

    # the file's ds_config with the engine's own options typed beside it (--device, --zero-init, --hf-zero-init)
    typed = {k: ctx.params.get(k) for k in OWN_OPTION_PARAMS if k != "deepspeed_config"}
    options, build = transformers_build(ctx, engine_options_from(engine, res.config, **typed), res.config, model,
                                        engine, "accelerate's DeepSpeedPlugin")  # fmt: skip
    return engine, gpus, options, (*lines, *build), {}


def _names(model: Optional[str], seq_len: Optional[int]):
    """The modules of ``--model`` a launcher wraps (``integrations.fsdp2_run.Names``), read from its parameter
    names in transformers' order (``transformer_shapes``): the first is the token embedding's, the last outside
    the decoder layers and ``lm_head`` the final norm's. None without ``--model``."""
    if model is None:
        return None
    from zeroplan.architectures.spec import block_prefix, transformer_shapes
    from zeroplan.estimation.workload import resolve
    from zeroplan.integrations.fsdp2_run import Names

    spec = resolve(model, seq_len)[0]
    prefix = block_prefix(spec)
    modules = [n.rsplit(".", 1)[0] for n, _ in transformer_shapes(spec)]
    norm = [m for m in modules if not m.startswith(prefix) and m != "lm_head"][-1]
    return Names(modules[0], prefix + "*", norm, spec.tied)


STEP_FLAGS = {"micro_batch": "--micro-batch", "grad_accum": "--grad-accum", "seq_len": "--seq-len",
              "checkpointing": "--checkpointing"}  # fmt: skip


def _fsdp2(ctx, run, engine: str, gpus: int, flag: str, who: str):
    """``from_config_files``' answer for an FSDP2 launcher file (``zeroplan.integrations.fsdp2_run``): the
    engine fsdp2 with the file's wrapping and policy, N_d, and the step values the file sets (``step``: a
    typed option that contradicts one is refused)."""
    from zeroplan.engines.base import EngineOptions

    engine = _implied(ctx, "engine", engine, "fsdp2", "--engine", f"the {flag[2:]} (FSDP2)")
    gpus = _implied(ctx, "gpus", gpus, run.gpus, "--gpus", f"the {flag[2:]}'s FSDP ranks")
    step = {}
    for name, value in (("micro_batch", run.micro_batch), ("grad_accum", run.grad_accum), ("seq_len", run.seq_len),
                        ("checkpointing", run.checkpointing)):  # fmt: skip
        if value is not None:
            if name in given_on_command_line(ctx, name) and ctx.params.get(name) != value:
                raise UserError(f"{STEP_FLAGS[name]} {ctx.params.get(name)} contradicts the {flag[2:]} ({value}); "
                                "drop one of them")  # fmt: skip
            step[name] = value
    from zeroplan.integrations.fsdp2_run import label

    lines = (f"{flag[2:]}: fsdp2 as {who} runs it: fully_shard calls {label(run.wrapping)}; init {run.options['init']}"
             + "".join(f"; {k.replace('_', '-')} {v}" for k, v in step.items()),)  # fmt: skip
    return engine, gpus, EngineOptions(**run.options), lines, step
