"""The ``zeroplan`` command. Thin: parse options into a config model, call one function, render.

Errors are one line and exit code 2 (``zeroplan.cli_options.OneLineErrors``). Heavy modules (torch,
pandas, matplotlib) are imported inside the commands that need them, never here. The command modules keep real
annotations (no ``from __future__ import annotations``): typer evaluates every string annotation of the command it
registers (docs/benchmarks.md, "Start-up, fourth pass").
"""

import gc
import os
import sys

from zeroplan.cli_exit import ending, one_answer
from zeroplan.cli_startup import compiling_less, imported, no_plugin_search, quiet_imports, registered

with quiet_imports():  # no collection, compiling less (zeroplan.cli_startup)
    from pathlib import Path
    from typing import Annotated, Optional
    import typer
    from zeroplan.cli_options import (
        STEP_OPTIONS, AllocConfOption, CheckpointingOption, DeepSpeedConfigOption, EngineOption, ForeachOption,
        GradAccumOption, HeadroomOption, LossParallelOption,
        GradDtype, MasterWeights, MicroBatchOption, ModelOption, OneLineErrors, OptimizerDtype, OptimizerName,
        ParamDtype, ReduceDtypeOption, ReshardOption, SeqLenOption, Unit, UserError, ds_config_batch,
        DeviceOption, FsdpWrapOption, InitOption, ZeroInitOption, HfZeroInitOption, FsdpOffloadOption,
        FsdpPinMemoryOption, engine_options_from, read_settings_file, given, policy_from, refuse_foreign, refuse_unused,
    )  # fmt: skip
    from zeroplan.cli_options import DpReplicateOption, DpShardOption, GpusPerNodeOption, TpOption  # meshes, links
    from zeroplan.cli_options import RevisionOption, SelectiveAcOption, refuse_selective_ac  # ORG/NAME; fsdp2 SAC
    from zeroplan.cli_integrations import (  # the files users already have (zeroplan.integrations)
        AccelerateConfigOption, MixedPrecisionOption, TorchtitanConfigOption, from_config_files, resolve_hf_auto,
    )  # fmt: skip
    from zeroplan.hub import with_revision


def _typer() -> typer.Typer:
    """The ``zeroplan`` group: one-line errors, no completion, no rich tracebacks."""
    group = typer.Typer(
        cls=OneLineErrors, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
        help="Plan and check per-GPU memory and communication of ZeRO / FSDP sharded data parallelism.",
    )
    group.callback()(_root)
    return group


def _root() -> None:
    """Plan and check per-GPU memory and communication of ZeRO / FSDP sharded data parallelism."""


def estimate(
    ctx: typer.Context,
    params: Optional[str] = typer.Option(
        None,
        help="Ψ, parameters of the whole model: 7.5e9, 7.5B, 1T (exact whole number, 1 to 1e15).",
    ),
    shapes: Optional[Path] = typer.Option(None, help="JSON file of parameter shapes, for exact padding."),
    model: ModelOption = None,
    revision: RevisionOption = None,
    seq_len: SeqLenOption = None,
    micro_batch: MicroBatchOption = 1,
    checkpointing: CheckpointingOption = "none",
    selective_ac: SelectiveAcOption = None,
    grad_accum: GradAccumOption = 1,
    foreach: ForeachOption = None,
    engine: EngineOption = "reference",
    gpus: int = typer.Option(1, help="Total GPUs = N_d x N_m, 1 to 2**24."),
    gpus_per_node: GpusPerNodeOption = 8,
    model_parallel: int = typer.Option(
        1, "--model-parallel",
        help="N_m, tensor/pipeline parallel degree, 1 to 2**24.",
    ),
    stage: Optional[int] = typer.Option(
        None, help="Show only this ZeRO stage (0-3); deepspeed: the stage when --deepspeed-config gives none."
    ),
    deepspeed_config: DeepSpeedConfigOption = None,
    accelerate_config: AccelerateConfigOption = None,
    torchtitan_config: TorchtitanConfigOption = None,
    mixed_precision: MixedPrecisionOption = None,
    reshard_after_forward: ReshardOption = None,
    fsdp_wrap: FsdpWrapOption = None,
    init: InitOption = None,
    device: DeviceOption = None,
    dp_replicate: DpReplicateOption = None,
    dp_shard: DpShardOption = None,
    tp: TpOption = None,
    loss_parallel: LossParallelOption = None,
    zero_init: ZeroInitOption = None,
    hf_zero_init: HfZeroInitOption = None,
    fsdp_offload: FsdpOffloadOption = None,
    fsdp_pin_memory: FsdpPinMemoryOption = None,
    param_dtype: ParamDtype = None,
    reduce_dtype: ReduceDtypeOption = None,
    grad_dtype: GradDtype = None,
    master_weights: MasterWeights = None,
    optimizer: OptimizerName = None,
    optimizer_dtype: OptimizerDtype = None,
    gpu: Optional[str] = typer.Option(
        None, help="GPU preset, e.g. h100-80gb: its memory to check fit against, its cuBLAS workspaces in the peak."
    ),
    gpu_memory: Optional[str] = typer.Option(
        None,
        help="GPU memory to check fit against: 80GiB, 32GB (whole bytes, up to 1 EiB).",
    ),
    alloc_conf: AllocConfOption = "",
    units: Unit = typer.Option(Unit.GB, help="GB = 1e9 bytes (the paper's), GiB = 2**30."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (schema in README)."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV, one row per stage."),
) -> None:
    """Per-GPU model states and per-step communication of ZeRO stages 0-3."""
    model = with_revision(model, revision)  # ORG/NAME@REV: zeroplan.hub
    from zeroplan.architectures.shapes_file import load_numels
    from zeroplan.engines import get_engine
    from zeroplan.estimation.config import EstimateConfig
    from zeroplan.estimation.estimate import estimate_config
    from zeroplan.parsing import parse_bytes, parse_count
    from zeroplan.policy import PrecisionPolicy
    from zeroplan.presets import gpu_capacity
    from zeroplan.render.estimate import to_csv, to_json, to_table

    if as_json and as_csv:
        raise UserError("--json and --csv are exclusive: choose one")
    if as_json or as_csv:
        refuse_unused(ctx, ("units",), "to --json or --csv, which give bytes")
    if sum(x is not None for x in (params, shapes, model)) != 1:
        raise UserError("give exactly one of --params, --shapes and --model")
    if model is None:
        refuse_unused(ctx, (*STEP_OPTIONS, "alloc_conf", "hf_zero_init"), "without --model: the training step's peak needs an architecture")
    else:
        refuse_unused(ctx, ("model_parallel",), "with --model: the peak is modelled without tensor parallelism")
    engine, gpus, file_options, file_lines, step = from_config_files(
        ctx, accelerate_config, torchtitan_config, deepspeed_config, engine, gpus, model, seq_len, micro_batch, grad_accum)
    micro_batch, grad_accum, seq_len, checkpointing = (step.get(k, v) for k, v in (
        ("micro_batch", micro_batch), ("grad_accum", grad_accum), ("seq_len", seq_len), ("checkpointing", checkpointing)))
    refuse_foreign(ctx, engine)
    ds = read_settings_file(deepspeed_config)  # read once, here
    own = dict(fsdp_wrap=fsdp_wrap, init=init, device=device, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
               loss_parallel=loss_parallel, zero_init=zero_init, hf_zero_init=hf_zero_init, fsdp_offload=fsdp_offload,
               fsdp_pin_memory=fsdp_pin_memory, selective_ac=selective_ac)
    refuse_selective_ac(selective_ac, checkpointing, file_options is not None)
    options = file_options or engine_options_from(engine, ds, reshard_after_forward, param_dtype, reduce_dtype, **own)
    nd = gpus // model_parallel if model_parallel >= 1 and gpus % model_parallel == 0 else None  # checked later
    options, ds, auto_lines, auto = resolve_hf_auto(ctx, options, ds, model, seq_len, nd, micro_batch, grad_accum,
                                                    mixed_precision)  # fmt: skip
    auto_lines = (*file_lines, *auto_lines)
    if options.ds_config is not None:  # "auto" resolved, or an accelerate config's: the run's ds_config
        ds = options.ds_config
    if model is not None and ds is not None:  # the file's batch is the run's (N_d = gpus here)
        micro_batch, grad_accum = ds_config_batch(ctx, engine, ds, gpus,
                                                  {"micro_batch": micro_batch, "grad_accum": grad_accum})
    policy: dict = {}
    if "policy" in get_engine(engine).options:  # the paper's vocabulary; a ds_config completes it
        settings = given(stage=stage, param_dtype=param_dtype, grad_dtype=grad_dtype, master_weights=master_weights,
                         optimizer=optimizer, optimizer_dtype=optimizer_dtype)  # fmt: skip
        if ds is not None and get_engine(engine).file_policy is not None:
            settings = get_engine(engine).file_policy(ds, settings)
        stage = settings.pop("stage", None)
        policy = {"policy": PrecisionPolicy(**settings)}
    config = EstimateConfig(
        params=parse_count(params) if params is not None else None,
        tensor_numels=load_numels(shapes) if shapes is not None else None,
        model=model,
        **(dict(seq_len=seq_len, micro_batch=micro_batch, checkpointing=checkpointing, grad_accum=grad_accum,
                foreach=foreach) if model is not None else {}),  # fmt: skip
        engine=engine,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        model_parallel=model_parallel,
        stage=stage,
        gpu=gpu,
        gpu_memory_bytes=gpu_capacity(gpu, parse_bytes(gpu_memory) if gpu_memory is not None else None)[0],
        **policy,
        engine_options=options,
        alloc_conf=alloc_conf,
    )
    result = estimate_config(config)
    out = to_json(result, auto) if as_json else to_csv(result) if as_csv else "\n".join((to_table(
        result, units.value).rstrip("\n"), *auto_lines))
    typer.echo(out.rstrip("\n"))


def plan(
    ctx: typer.Context,
    model: ModelOption = None,
    revision: RevisionOption = None,
    params: Optional[str] = typer.Option(
        None, help="Ψ of the whole model instead of a preset: 70e9, 70B (1 to 1e15)."),
    gpu: Optional[str] = typer.Option(None, help="GPU preset, e.g. h100-80gb (memory, FLOP/s, links)."),
    gpu_memory: Optional[str] = typer.Option(
        None, help="GPU memory, overrides the preset: 80GiB, 32GB (whole bytes, up to 1 EiB)."),
    gpus: int = typer.Option(8, help="Total GPUs = N_d x N_m, 1 to 2**24."),
    gpus_per_node: GpusPerNodeOption = 8,
    model_parallel: int = typer.Option(
        1, "--model-parallel", help="N_m, tensor/pipeline parallel degree, 1 to 2**24."),
    headroom: HeadroomOption = 0.0,
    alloc_conf: AllocConfOption = "",
    interconnect: Optional[str] = typer.Option(None, help="Intra-node link preset (default: the GPU's)."),
    bw: Optional[float] = typer.Option(
        None, help="Intra-node bandwidth per GPU, GB/s one direction, 0.001 to 1e6."),
    inter_interconnect: str = typer.Option("ib-ndr", help="Inter-node link preset (one NIC per GPU)."),
    inter_bw: Optional[float] = typer.Option(
        None, help="Inter-node bandwidth per GPU, GB/s one direction, 0.001 to 1e6."),
    algorithm: str = typer.Option("ring", help="All-reduce algorithm for the latency term: ring or tree."),
    micro_batch: int = typer.Option(1, help="Sequences per GPU per micro-step, 1 to 65536."),
    grad_accum: int = typer.Option(1, help="Micro-steps per optimizer step, 1 to 65536."),
    seq_len: Optional[int] = typer.Option(
        None, help="Tokens per sequence, 1 to 2**24 (default: the preset's, else 2048)."),
    checkpointing: str = typer.Option(
        "full",
        help="Activation recomputation: none, selective, full (default full, as before the peak; the peak "
        "per GPU knows none and full).",
    ),
    foreach: ForeachOption = None,
    engine: Annotated[str, typer.Option(
        help="Training engine whose peak decides the fit: reference (ZeRO stages and offload), fsdp2 (chooses "
        "reshard_after_forward and checkpointing) or deepspeed (chooses the stage and bucket sizes).")] = "reference",
    deepspeed_config: Annotated[Optional[Path], typer.Option(
        "--deepspeed-config", help="ds_config.json, with --engine deepspeed only: the settings the search keeps "
        "(precision, optimizer, batch; it chooses the stage and buckets). With --engine reference the plan emits "
        "a ds_config instead.")] = None,
    accelerate_config: AccelerateConfigOption = None,
    torchtitan_config: TorchtitanConfigOption = None,
    mixed_precision: MixedPrecisionOption = None,
    reduce_dtype: ReduceDtypeOption = None,
    fsdp_wrap: FsdpWrapOption = None,
    init: InitOption = None,
    device: DeviceOption = None,
    dp_replicate: DpReplicateOption = None,
    dp_shard: DpShardOption = None,
    tp: TpOption = None,
    loss_parallel: LossParallelOption = None,
    zero_init: ZeroInitOption = None,
    hf_zero_init: HfZeroInitOption = None,
    fsdp_offload: FsdpOffloadOption = None,
    fsdp_pin_memory: FsdpPinMemoryOption = None,
    offload: str = typer.Option("none", help="Most offload the recommendation may use: none, cpu, nvme."),
    host_memory: Optional[str] = typer.Option(
        None, help="CPU memory per node, e.g. 2TB (up to 1 EiB): offload must fit."),
    peak_tflops: Optional[float] = typer.Option(
        None, help="Dense peak TFLOP/s per GPU, 0.001 to 1e6 (default: preset's)."),
    mfu: float = typer.Option(0.4, help="Model FLOPs utilisation for the compute estimate, 0.001 to 1."),
    param_dtype: Annotated[
        str, typer.Option(
            help="Working parameter dtype: bf16 (default here: what the launchers emit), fp16, fp32.",
        )
    ] = "bf16",
    grad_dtype: GradDtype = None,
    master_weights: MasterWeights = None,
    optimizer: OptimizerName = None,
    optimizer_dtype: OptimizerDtype = None,
    units: Unit = typer.Option(Unit.GiB, help="GB = 1e9 bytes, GiB = 2**30 bytes."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (schema in README)."),
    replay_all: bool = typer.Option(
        False, "--replay-all", help="With --engine fsdp2 or deepspeed: replay every configuration's allocation "
        "trace for its reserved bytes and fit (default: up to the first that fits, the recommendation; later rows "
        "print reserved — and fits —)."),
    max_micro_batch: Optional[int] = typer.Option(
        None, "--max-micro-batch", metavar="UP_TO",
        help="Also search, for every configuration, the largest micro-batch that fits, 1 to UP_TO (doubling, then "
        "bisection, as validate/gpu_check.sh does on a GPU; docs/allocator.md); with --json, largest_micro_batch."),
) -> None:
    """Fit, fewest GPUs, largest model, recommended stage/offload, comm time and launcher configs."""
    model = with_revision(model, revision)  # ORG/NAME@REV: zeroplan.hub
    from zeroplan.engines import get_engine
    from zeroplan.parsing import parse_bytes, parse_count
    from zeroplan.planning.config import PlanConfig
    from zeroplan.planning.plan import plan_config
    from zeroplan.render.plan import to_json, to_table
    from zeroplan.types import MAX_BATCH

    if model is not None and params is not None:
        raise UserError("--model and --params are exclusive: choose one")
    if as_json:
        refuse_unused(ctx, ("units",), "to --json, which gives bytes")
    if max_micro_batch is not None and not 1 <= max_micro_batch <= MAX_BATCH:
        raise UserError(f"--max-micro-batch {max_micro_batch}: must be from 1 to {MAX_BATCH}")
    if model is None:
        refuse_unused(ctx, ("foreach", "engine"), "without --model: the peak needs an architecture")
    engine, gpus, file_options, file_lines, step = from_config_files(
        ctx, accelerate_config, torchtitan_config, deepspeed_config, engine, gpus, model, seq_len, micro_batch, grad_accum)
    micro_batch, grad_accum, seq_len = (step.get(k, v) for k, v in (
        ("micro_batch", micro_batch), ("grad_accum", grad_accum), ("seq_len", seq_len)))
    refuse_foreign(ctx, engine)
    refuse_unused(ctx, get_engine(engine).plan_chooses, f"to plan --engine {engine}, which chooses it by predicted peak")
    if get_engine(engine).plan is None:  # the ladder replays every row with a trace (planning/reserved_fit.py)
        refuse_unused(ctx, ("replay_all",), f"to plan --engine {engine}, which replays every row")
    if deepspeed_config is not None and "ds_config" not in get_engine(engine).reads:
        raise UserError("--deepspeed-config does not apply to plan --engine reference (it emits a ds_config)")
    ds = read_settings_file(deepspeed_config)
    options = file_options or engine_options_from(engine, ds, None, param_dtype, reduce_dtype,
                                                  fsdp_wrap=fsdp_wrap, init=init, device=device,
                                                  dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
                                                  loss_parallel=loss_parallel, zero_init=zero_init, hf_zero_init=hf_zero_init,
                                                  fsdp_offload=fsdp_offload, fsdp_pin_memory=fsdp_pin_memory)  # fmt: skip
    options, _, auto_lines, auto = resolve_hf_auto(ctx, options, ds, model, seq_len,
                                                   gpus // model_parallel if model_parallel >= 1 and gpus % model_parallel
                                                   == 0 else None, micro_batch, grad_accum, mixed_precision)  # fmt: skip
    auto_lines = (*file_lines, *auto_lines)
    if model is not None and model_parallel >= 1 and gpus % model_parallel == 0:  # the file's batch at the planned N_d
        # (PlanConfig checks the split and refuses model_parallel < 1 in one line)
        micro_batch, grad_accum = ds_config_batch(ctx, engine, options.ds_config, gpus // model_parallel,
                                                  {"micro_batch": micro_batch, "grad_accum": grad_accum})
    config = PlanConfig(
        model=model,
        foreach=foreach,
        engine=engine,
        engine_options=options,
        params=parse_count(params) if params is not None else None,
        gpu=gpu,
        gpu_memory_bytes=parse_bytes(gpu_memory) if gpu_memory is not None else None,
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        model_parallel=model_parallel,
        headroom=headroom,
        alloc_conf=alloc_conf,
        replay_all=replay_all,
        interconnect=interconnect,
        bw_gbps=bw,
        inter_interconnect=inter_interconnect,
        inter_bw_gbps=inter_bw,
        algorithm=algorithm,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        seq_len=seq_len,
        **({} if "checkpointing" in get_engine(engine).plan_chooses else {"checkpointing": checkpointing}),
        offload=offload,
        host_memory_bytes=parse_bytes(host_memory, "host-memory") if host_memory is not None else None,
        peak_tflops=peak_tflops,
        mfu=mfu,
        **({"policy": policy_from(param_dtype, grad_dtype, master_weights, optimizer, optimizer_dtype)}
           if "policy" in get_engine(engine).options else {}),  # fmt: skip
    )
    result = plan_config(config)
    if max_micro_batch is not None:  # zeroplan.planning.largest_batch: imported only for the search it runs
        from zeroplan.planning.largest_batch import bracket_lines, largest_json, largest_micro_batches
    found = None if max_micro_batch is None else largest_micro_batches(config, max_micro_batch)
    if as_json:
        typer.echo(to_json(result, auto, None if found is None else largest_json(found, max_micro_batch)))
        return
    lines = () if found is None else ("", *bracket_lines(found, max_micro_batch))
    typer.echo("\n".join((to_table(result, units.value).rstrip("\n"), *auto_lines, *lines)))


# The commands in the order `zeroplan --help` lists them. A name (str) is a command of another module, imported when
# it runs or the whole group is listed (``zeroplan.cli_startup.ELSEWHERE``): an estimate or a plan does not load them.
COMMANDS = {"estimate": estimate, "sweep": "sweep", "plot": "plot", "plan": plan, "validate": "validate_cmd"}


def app_for(args: list[str]) -> typer.Typer:
    """The whole group (``app``), or when ``args`` start with a command's name, a group holding that command alone:
    typer reads the signature of every command it registers (about 35 ms for the five), and a run needs one."""
    whole = not args or args[0] not in COMMANDS  # `zeroplan`, `zeroplan --help`, an unknown command
    return registered(_typer(), COMMANDS if whole else {args[0]: COMMANDS[args[0]]})


def __getattr__(name: str) -> object:  # PEP 562
    """``app`` (every command; built on first use), and ``sweep``, ``plot``, ``PlotView``, ``validate_cmd`` by their
    old address (``zeroplan.cli_startup.ELSEWHERE``)."""
    globals()[name] = value = app_for([]) if name == "app" else imported(name)
    return value


def main() -> None:
    """The command: pydantic's plugins off unless the user names some (``PYDANTIC_DISABLE_PLUGINS``, its documented
    switch, set in this process only; their search reads every installed distribution's entry points), their loader
    unimported. ``ONE_ANSWER`` commands and help run without the cyclic collector (5-15% of a plan) and end frozen
    (``gc.freeze``: the last collection walked them all), compiling less (``cli_startup.compiling_less``,
    ``CodeCache``). Ends with SystemExit; ``command`` (the console script) then ends the process (``cli_exit``)."""
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    no_plugin_search()
    args, collecting = sys.argv[1:], gc.isenabled()
    one = one_answer(args)  # ONE_ANSWER's commands and help (zeroplan.cli_exit)
    if one:
        gc.disable()
        codes = quiet_imports.codes  # earlier commands' generated code (the imports' file): read, not compiled
        restore = compiling_less(codes)
    try:
        app_for(args)()
    finally:
        if one:
            gc.freeze()  # the process ends here (SystemExit): no collection, not even the last, walks these objects
            restore()
            codes.save()  # the texts it compiled, for the next command (unless PYTHONDONTWRITEBYTECODE)
        if collecting:
            gc.enable()


command = ending(main)  # the console script (pyproject.toml) and python -m: main(), then the process ended


if __name__ == "__main__":  # python -m zeroplan.cli
    command()
