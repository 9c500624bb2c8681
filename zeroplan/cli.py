"""The ``zeroplan`` command. Thin: parse options into a config model, call one function, render.

Errors are one line and exit code 2 (``zeroplan.cli_options.OneLineErrors``). Heavy modules (torch,
pandas, matplotlib) are imported inside the commands that need them, never here.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from zeroplan.cli_options import (
    STEP_OPTIONS, CheckpointingOption, DeepSpeedConfigOption, EngineOption, ForeachOption, GradAccumOption,
    GradDtype, MasterWeights, MicroBatchOption, ModelOption, OneLineErrors, OptimizerDtype, OptimizerName,
    ParamDtype, ReduceDtypeOption, ReshardOption, SeqLenOption, Unit, UserError, ds_config_batch, engine_options_from,
    given, given_on_command_line, policy_from, refuse_foreign, refuse_unused,
)  # fmt: skip
from zeroplan.cli_options import RevisionOption  # --model ORG/NAME (zeroplan.hub)
from zeroplan.hub import with_revision


app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Plan and check per-GPU memory and communication of ZeRO / FSDP sharded data parallelism.",
)


@app.callback()
def _root() -> None:
    """Plan and check per-GPU memory and communication of ZeRO / FSDP sharded data parallelism."""


@app.command()
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
    grad_accum: GradAccumOption = 1,
    foreach: ForeachOption = True,
    engine: EngineOption = "reference",
    gpus: int = typer.Option(1, help="Total GPUs = N_d x N_m, 1 to 2**24."),
    model_parallel: int = typer.Option(
        1, "--model-parallel",
        help="N_m, tensor/pipeline parallel degree, 1 to 2**24.",
    ),
    stage: Optional[int] = typer.Option(
        None, help="Show only this ZeRO stage (0-3); deepspeed: the stage when --deepspeed-config gives none."
    ),
    deepspeed_config: DeepSpeedConfigOption = None,
    reshard_after_forward: ReshardOption = None,
    param_dtype: ParamDtype = None,
    reduce_dtype: ReduceDtypeOption = None,
    grad_dtype: GradDtype = None,
    master_weights: MasterWeights = None,
    optimizer: OptimizerName = None,
    optimizer_dtype: OptimizerDtype = None,
    gpu_memory: Optional[str] = typer.Option(
        None,
        help="GPU memory to check fit against: 80GiB, 32GB (whole bytes, up to 1 EiB).",
    ),
    units: Unit = typer.Option(Unit.GB, help="GB = 1e9 bytes (the paper's), GiB = 2**30."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (schema in README)."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV, one row per stage."),
) -> None:
    """Per-GPU model states and per-step communication of ZeRO stages 0-3."""
    model = with_revision(model, revision)  # ORG/NAME@REV: zeroplan.hub
    from zeroplan.architectures.shapes_file import load_numels
    from zeroplan.engines import get_engine
    from zeroplan.engines.deepspeed import merge_deepspeed
    from zeroplan.estimation.config import EstimateConfig
    from zeroplan.estimation.estimate import estimate_config
    from zeroplan.files import read_json
    from zeroplan.parsing import parse_bytes, parse_count
    from zeroplan.policy import PrecisionPolicy
    from zeroplan.render.estimate import to_csv, to_json, to_table

    if as_json and as_csv:
        raise UserError("--json and --csv are exclusive: choose one")
    if as_json or as_csv:
        refuse_unused(ctx, ("units",), "to --json or --csv, which give bytes")
    if sum(x is not None for x in (params, shapes, model)) != 1:
        raise UserError("give exactly one of --params, --shapes and --model")
    if model is None:
        refuse_unused(ctx, STEP_OPTIONS, "without --model: the training step's peak needs an architecture")
    else:
        refuse_unused(ctx, ("model_parallel",), "with --model: the peak is modelled without tensor parallelism")
    refuse_foreign(ctx, engine)
    options = engine_options_from(engine, deepspeed_config, reshard_after_forward, param_dtype, reduce_dtype)
    if model is not None and deepspeed_config is not None:  # the file's batch is the run's (N_d = gpus here)
        ds = options.ds_config if options.ds_config is not None else read_json(deepspeed_config, "deepspeed config")
        micro_batch, grad_accum = ds_config_batch(ctx, ds, gpus, {"micro_batch": micro_batch, "grad_accum": grad_accum})
    policy: dict = {}
    if "policy" in get_engine(engine).options:  # the paper's vocabulary; a ds_config completes it
        settings = given(stage=stage, param_dtype=param_dtype, grad_dtype=grad_dtype, master_weights=master_weights,
                         optimizer=optimizer, optimizer_dtype=optimizer_dtype)  # fmt: skip
        if deepspeed_config is not None:
            settings = merge_deepspeed(deepspeed_config, settings)
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
        model_parallel=model_parallel,
        stage=stage,
        gpu_memory_bytes=parse_bytes(gpu_memory) if gpu_memory is not None else None,
        **policy,
        engine_options=options,
    )
    result = estimate_config(config)
    if as_json:
        out = to_json(result)
    elif as_csv:
        out = to_csv(result)
    else:
        out = to_table(result, units.value)
    typer.echo(out.rstrip("\n"))


@app.command()
def sweep(
    ctx: typer.Context,
    params: Optional[str] = typer.Option(
        None,
        help="Ψ values, comma-separated: 1e9,7B,70B (each 1 to 1e15).",
    ),
    shapes: Optional[Path] = typer.Option(
        None,
        help="JSON file of parameter shapes (one model, exact padding).",
    ),
    model: ModelOption = None,
    revision: RevisionOption = None,
    gpus: str = typer.Option(
        "1",
        help="Total GPU counts, comma-separated: 8,64,512 (each 1 to 2**24; at most 1e8 rows in all).",
    ),
    model_parallel: str = typer.Option(
        "1", "--model-parallel",
        help="N_m values (1 to 2**24), comma-separated; pairs where N_m does not divide gpus are skipped."
    ),
    stage: str = typer.Option("0,1,2,3", help="ZeRO stages to report, comma-separated."),
    offload: str = typer.Option(
        "none",
        help="Comma-separated: none, cpu, nvme (optimizer states) or OPT/PARAMS, e.g. cpu/cpu (stage 3)."
    ),
    micro_batch: str = typer.Option(
        "1", "--micro-batch",
        help="Sequences per GPU per micro-step (1 to 65536), comma-separated (activations; needs --model)."
    ),
    seq_len: Optional[int] = typer.Option(
        None, "--seq-len",
        help="Tokens per sequence, 1 to 2**24 (default: the preset's).",
    ),
    checkpointing: str = typer.Option(
        "full",
        help="Activation recomputation: none, selective, full (default full, as before the peak; the peak "
        "per GPU knows none and full).",
    ),
    foreach: ForeachOption = True,
    engine: Annotated[str, typer.Option(
        help="Training engine of the rows: reference (one row per --stage), fsdp2 or deepspeed (one row per "
        "configuration: the sharding the engine runs; deepspeed: one per --stage given).")] = "reference",
    deepspeed_config: Annotated[Optional[Path], typer.Option(
        "--deepspeed-config", help="ds_config.json, with --engine deepspeed only: the engine's settings (buckets, "
        "precision, optimizer; --stage gives the rows' stages). With --engine reference give the policy "
        "options (--param-dtype, --optimizer, ...) instead.")] = None,
    reshard_after_forward: ReshardOption = None,
    reduce_dtype: ReduceDtypeOption = None,
    param_dtype: ParamDtype = None,
    grad_dtype: GradDtype = None,
    master_weights: MasterWeights = None,
    optimizer: OptimizerName = None,
    optimizer_dtype: OptimizerDtype = None,
    gpu: Optional[str] = typer.Option(None, help="GPU preset for the fits column: h100-80gb, a100-40gb, ..."),
    gpu_memory: Optional[str] = typer.Option(
        None,
        help="GPU memory for the fits column: 80GiB, 141GB (whole bytes, up to 1 EiB).",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object with rows[] instead of CSV."),
    out: Optional[Path] = typer.Option(
        None,
        help="Write to this file (atomically) instead of stdout; a name ending in .parquet writes Parquet."
    ),
) -> None:
    """Estimate every combination of comma-separated values; CSV (or JSON), one row per configuration and stage."""
    model = with_revision(model, revision)  # ORG/NAME@REV: zeroplan.hub
    import importlib.util

    from zeroplan.architectures.shapes_file import load_numels
    from zeroplan.engines import get_engine
    from zeroplan.files import atomic_write, check_writable
    from zeroplan.parsing import parse_bytes, parse_counts, parse_list, parse_offload, parse_wholes
    from zeroplan.presets import gpu_capacity
    from zeroplan.render.sweep import write_csv, write_json, write_parquet
    from zeroplan.sweeping.config import SweepConfig
    from zeroplan.sweeping.grid import sweep_frames
    from zeroplan.types import MAX_BATCH, MAX_GPUS, check_wholes

    if sum(x is not None for x in (params, shapes, model)) != 1:
        raise UserError("give exactly one of --params, --shapes and --model")
    parquet = out is not None and out.suffix.lower() == ".parquet"
    if parquet and as_json:
        raise UserError("--json and an --out ending in .parquet are exclusive: choose one format")
    if parquet and importlib.util.find_spec("pyarrow") is None:
        raise UserError('writing .parquet needs pyarrow: pip install pyarrow (or ".[parquet]")')
    inputs = [shapes, model, deepspeed_config]  # every file sweep reads (a preset name is none)
    if out is not None:
        check_writable(out, inputs)
    if model is None and given_on_command_line(ctx, "checkpointing"):
        raise UserError("--checkpointing changes only activations, which need --model")
    if model is None:
        refuse_unused(ctx, ("foreach", "engine"), "without --model: the peak needs an architecture")
    refuse_foreign(ctx, engine)
    if deepspeed_config is not None and "ds_config" not in get_engine(engine).options:
        raise UserError("--deepspeed-config does not apply to sweep --engine reference: use --engine deepspeed "
                        "--model NAME with it, or give the reference policy options (--param-dtype, --optimizer, ...)")
    reads_policy = "policy" in get_engine(engine).options
    options = engine_options_from(engine, deepspeed_config, reshard_after_forward, param_dtype, reduce_dtype)
    micro_batches = parse_wholes(micro_batch, "micro-batch")
    if model is not None:  # a ds_config's batch is the rows' (sweep_micro_batches)
        from zeroplan.engines.deepspeed import sweep_micro_batches

        typed = micro_batches if given_on_command_line(ctx, "micro_batch") else None
        micro_batches = sweep_micro_batches(  # the lists in range first: the config checks them only later
            options.ds_config, check_wholes(parse_wholes(gpus, "gpus"), "gpus", MAX_GPUS),
            check_wholes(parse_wholes(model_parallel, "model-parallel"), "model_parallel", MAX_GPUS),
            typed and check_wholes(typed, "micro_batch", MAX_BATCH), "--micro-batch") or micro_batches
    capacity, _ = gpu_capacity(gpu, parse_bytes(gpu_memory) if gpu_memory is not None else None)
    config = SweepConfig(
        params=parse_counts(params) if params is not None else None,
        tensor_numels=load_numels(shapes) if shapes is not None else None,
        model=model,
        micro_batch=micro_batches,
        seq_len=seq_len,
        checkpointing=checkpointing,
        foreach=foreach,
        engine=engine,
        gpus=parse_wholes(gpus, "gpus"),
        model_parallel=parse_wholes(model_parallel, "model-parallel"),
        **({"stages": parse_wholes(stage, "stage")} if given_on_command_line(ctx, "stage") or reads_policy else {}),
        offload=parse_list(offload, "offload", parse_offload),
        gpu_memory_bytes=capacity,
        policy=policy_from(param_dtype if reads_policy else None, grad_dtype, master_weights, optimizer,
                           optimizer_dtype),  # fmt: skip
        engine_options=options,
    )

    def write(sink) -> None:
        frames = sweep_frames(config)
        write_json(frames, config, sink) if as_json else write_csv(frames, sink)

    if out is None:
        write(typer.get_binary_stream("stdout"))
    elif parquet:
        atomic_write(out, lambda tmp: write_parquet(sweep_frames(config), tmp), inputs=inputs)
    else:

        def write_file(tmp: str) -> None:
            with open(tmp, "wb") as sink:
                write(sink)

        atomic_write(out, write_file, inputs=inputs)


class PlotView(str, Enum):
    memory = "memory"
    breakdown = "breakdown"
    comm = "comm"
    validate = "validate"


@app.command()
def plot(
    ctx: typer.Context,
    out: Path = typer.Option(..., help="Image file to write: .png, .svg or .pdf."),
    view: PlotView = typer.Option(
        PlotView.memory,
        help="memory: per-GPU model states vs N_d (log-log); breakdown: stacked bars per stage; "
        "comm: bytes sent per GPU per step; validate: predicted vs measured from --results.",
    ),
    params: Optional[str] = typer.Option(
        None,
        help="Ψ values, comma-separated: 7e9 or 7B,70B (each 1 to 1e15; at most 6 in the memory view).",
    ),
    model: Optional[str] = typer.Option(
        None,
        help="Reference model preset instead of --params: llama2-70b, ...",
    ),
    gpus: str = typer.Option(
        "8,16,32,64",
        help="Total GPU counts, comma-separated (each 1 to 2**24; at most 64).",
    ),
    model_parallel: int = typer.Option(
        1, "--model-parallel",
        help="N_m, tensor/pipeline parallel degree, 1 to 2**24.",
    ),
    stage: str = typer.Option("0,1,2,3", help="ZeRO stages to draw, comma-separated."),
    param_dtype: ParamDtype = None,
    grad_dtype: GradDtype = None,
    master_weights: MasterWeights = None,
    optimizer: OptimizerName = None,
    optimizer_dtype: OptimizerDtype = None,
    gpu: Optional[str] = typer.Option(
        None,
        help="GPU preset whose memory is drawn as a line: h100-80gb, ...",
    ),
    gpu_memory: Optional[str] = typer.Option(None, help="GPU capacity to draw as a line: 80GiB, 141GB."),
    results: Optional[Path] = typer.Option(
        None,
        help="JSON written by `zeroplan validate --json` (validate view; at most 60 runs, 64 MiB).",
    ),
) -> None:
    """Draw a sweep (memory, breakdown, comm) or validator results (validate) to an image file."""
    _quiet_matplotlib_cache_warnings()
    from zeroplan import plots
    from zeroplan.files import check_writable
    from zeroplan.parsing import parse_bytes, parse_counts, parse_wholes
    from zeroplan.presets import gpu_capacity
    from zeroplan.sweeping.config import SweepConfig
    from zeroplan.sweeping.grid import sweep_config

    plots.check_format(out)  # before any work: a bad name is one line, not a traceback after the sweep
    check_writable(out, inputs=[results, model])
    policy = ("param_dtype", "grad_dtype", "master_weights", "optimizer", "optimizer_dtype")
    if view is PlotView.validate:
        why = "to --view validate, which draws --results only"
        sweep_options = ("params", "model", "gpus", "model_parallel", "stage", *policy, "gpu", "gpu_memory")
        refuse_unused(ctx, sweep_options, why)
        if results is None:
            raise UserError("--view validate needs --results FILE (from `zeroplan validate --json`)")
        rows = plots.load_validation(results)
        plots.check_points(view.value, runs=len(rows))
        fig = plots.predicted_vs_measured(rows)
    else:
        refuse_unused(ctx, ("results",), f"to --view {view.value}; only --view validate reads it")
        if view is PlotView.comm:
            refuse_unused(ctx, ("gpu", "gpu_memory"), "to --view comm, which draws no memory")
        if (params is None) == (model is None):
            raise UserError(f"--view {view.value} needs exactly one of --params and --model")
        memory_bytes = parse_bytes(gpu_memory) if gpu_memory is not None else None
        capacity, capacity_label = gpu_capacity(gpu, memory_bytes)
        config = SweepConfig(
            params=parse_counts(params) if params is not None else None,
            model=model,
            gpus=parse_wholes(gpus, "gpus"),
            model_parallel=(model_parallel,),
            stages=parse_wholes(stage, "stage"),
            policy=policy_from(param_dtype, grad_dtype, master_weights, optimizer, optimizer_dtype),
        )
        plots.check_points(view.value, n_params=len(config.params or (1,)), n_gpus=len(config.gpus))
        frame = sweep_config(config)
        fig = plots.figure(view.value, frame, gpu_memory_bytes=capacity, gpu_label=capacity_label)
    plots.save(fig, out, inputs=[results, model])


def _quiet_matplotlib_cache_warnings() -> None:
    """With an unwritable HOME (or MPLCONFIGDIR) matplotlib makes a temporary config and cache folder, removes
    it at exit and logs two warnings saying so; they are not about the user's input or output, and would
    break the one-line rule, so those two (and only those) are dropped."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("mkdir -p failed for path") or text.startswith("Matplotlib created a temporary"))

    logging.getLogger("matplotlib").addFilter(keep)


@app.command()
def plan(
    ctx: typer.Context,
    model: ModelOption = None,
    revision: RevisionOption = None,
    params: Optional[str] = typer.Option(
        None,
        help="Ψ of the whole model instead of a preset: 70e9, 70B (1 to 1e15).",
    ),
    gpu: Optional[str] = typer.Option(None, help="GPU preset, e.g. h100-80gb (memory, FLOP/s, links)."),
    gpu_memory: Optional[str] = typer.Option(
        None,
        help="GPU memory, overrides the preset: 80GiB, 32GB (whole bytes, up to 1 EiB).",
    ),
    gpus: int = typer.Option(8, help="Total GPUs = N_d x N_m, 1 to 2**24."),
    gpus_per_node: int = typer.Option(
        8,
        help="GPUs per node, 1 to 2**24 (host memory per node, intra vs inter links).",
    ),
    model_parallel: int = typer.Option(
        1, "--model-parallel",
        help="N_m, tensor/pipeline parallel degree, 1 to 2**24.",
    ),
    headroom: float = typer.Option(
        0.1,
        help="Fraction of GPU memory kept free for activations etc., [0, 1).",
    ),
    interconnect: Optional[str] = typer.Option(None, help="Intra-node link preset (default: the GPU's)."),
    bw: Optional[float] = typer.Option(
        None,
        help="Intra-node bandwidth per GPU, GB/s one direction, 0.001 to 1e6.",
    ),
    inter_interconnect: str = typer.Option("ib-ndr", help="Inter-node link preset (one NIC per GPU)."),
    inter_bw: Optional[float] = typer.Option(
        None,
        help="Inter-node bandwidth per GPU, GB/s one direction, 0.001 to 1e6.",
    ),
    algorithm: str = typer.Option("ring", help="All-reduce algorithm for the latency term: ring or tree."),
    micro_batch: int = typer.Option(1, help="Sequences per GPU per micro-step, 1 to 65536."),
    grad_accum: int = typer.Option(1, help="Micro-steps per optimizer step, 1 to 65536."),
    seq_len: Optional[int] = typer.Option(
        None,
        help="Tokens per sequence, 1 to 2**24 (default: the preset's, else 2048).",
    ),
    checkpointing: str = typer.Option(
        "full",
        help="Activation recomputation: none, selective, full (default full, as before the peak; the peak "
        "per GPU knows none and full).",
    ),
    foreach: ForeachOption = True,
    engine: Annotated[str, typer.Option(
        help="Training engine whose peak decides the fit: reference (ZeRO stages and offload), fsdp2 (chooses "
        "reshard_after_forward and checkpointing) or deepspeed (chooses the stage and bucket sizes).")] = "reference",
    deepspeed_config: Annotated[Optional[Path], typer.Option(
        "--deepspeed-config", help="ds_config.json, with --engine deepspeed only: the settings the search keeps "
        "(precision, optimizer, batch; it chooses the stage and buckets). With --engine reference the plan emits "
        "a ds_config instead.")] = None,
    reduce_dtype: ReduceDtypeOption = None,
    offload: str = typer.Option("none", help="Most offload the recommendation may use: none, cpu, nvme."),
    host_memory: Optional[str] = typer.Option(
        None,
        help="CPU memory per node, e.g. 2TB (up to 1 EiB): offload must fit.",
    ),
    peak_tflops: Optional[float] = typer.Option(
        None,
        help="Dense peak TFLOP/s per GPU, 0.001 to 1e6 (default: preset's).",
    ),
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
) -> None:
    """Fit, fewest GPUs, largest model, recommended stage/offload, comm time and launcher configs."""
    model = with_revision(model, revision)  # ORG/NAME@REV: zeroplan.hub
    from zeroplan.engines import get_engine
    from zeroplan.parsing import parse_bytes, parse_count
    from zeroplan.planning.config import PlanConfig
    from zeroplan.planning.plan import plan_config
    from zeroplan.render.plan import to_json, to_table

    if model is not None and params is not None:
        raise UserError("--model and --params are exclusive: choose one")
    if as_json:
        refuse_unused(ctx, ("units",), "to --json, which gives bytes")
    if model is None:
        refuse_unused(ctx, ("foreach", "engine"), "without --model: the peak needs an architecture")
    refuse_foreign(ctx, engine)
    refuse_unused(ctx, get_engine(engine).plan_chooses, f"to plan --engine {engine}, which chooses it by predicted peak")
    if deepspeed_config is not None and "ds_config" not in get_engine(engine).options:
        raise UserError("--deepspeed-config does not apply to plan --engine reference (it emits a ds_config)")
    options = engine_options_from(engine, deepspeed_config, None, param_dtype, reduce_dtype)
    if model is not None and model_parallel >= 1 and gpus % model_parallel == 0:  # the file's batch at the planned N_d
        # (PlanConfig checks the split and refuses model_parallel < 1 in one line)
        micro_batch, grad_accum = ds_config_batch(ctx, options.ds_config, gpus // model_parallel,
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
    typer.echo(to_json(result) if as_json else to_table(result, units.value))


@app.command("validate")
def validate_cmd(
    ctx: typer.Context,
    world_size: Optional[list[int]] = typer.Option(
        None, "--world-size",
        help="N_d; repeat for several. Default: 2 and 4 (64 with --simulated). Real: at most 4 ranks per usable "
        "core and what memory holds; simulated: at most 65536.",
    ),
    stage: Optional[list[int]] = typer.Option(None, "--stage", help="ZeRO stage 0-3; repeat. Default: all."),
    model: Optional[str] = typer.Option(
        None, help="gpt-tiny (default), mlp-tiny, gpt-1b-wide, a model preset or a config.json path."
    ),
    params: Optional[str] = typer.Option(
        None, help="Instead of --model: a GPT-style model of about Ψ params (the table says what was built)."
    ),
    simulated: bool = typer.Option(False, "--simulated", help="One process plays rank 0 on a fake group."),
    device: str = typer.Option("auto", help="auto (cuda if present), cpu or cuda."),
    steps: int = typer.Option(3, help="Training steps per stage, 2-1000."),
    batch_per_rank: int = typer.Option(
        2, "--micro-batch", "--batch-per-rank", help="Micro-batch: samples per rank per step, 1-4096."
    ),
    grad_accum: int = typer.Option(
        1, "--grad-accum",
        help="Micro-steps per optimizer step, 1-64 (reference engine): G forward+backward, one update.",
    ),
    checkpointing: str = typer.Option("none", help="Activation checkpointing: none, or full (each block recomputed)."),
    foreach: Optional[bool] = typer.Option(
        None, "--foreach/--no-foreach", help="Adam's foreach path (default: torch's choice for the device)."
    ),
    peak_tolerance: Optional[float] = typer.Option(
        None, help="Largest relative error of any phase's peak still ok (default 0.02; 0.03 with --engine deepspeed)."
    ),
    seq_len: Optional[int] = typer.Option(
        None, "--seq-len", help="Tokens per sample (GPT only; at most the model's positions; default: all)."
    ),
    param_dtype: str = typer.Option(
        "bf16", "--param-dtype", help="16-bit dtype of the runtime's params/grads: bf16 or fp16 (master, Adam: fp32); "
        "fsdp2: MixedPrecisionPolicy.param_dtype, bf16 or fp32 (no mixed precision).",
    ),
    engine: str = typer.Option(
        "reference", "--engine", help="What trains: reference (the bundled ZeRO runtime), fsdp2 or deepspeed (the real ones)."
    ),
    reduce_dtype: Optional[str] = typer.Option(
        None, "--reduce-dtype", help="fsdp2: MixedPrecisionPolicy.reduce_dtype, bf16 or fp32 (default: param dtype)."
    ),
    reshard_after_forward: ReshardOption = None,
    fsdp2_init: Optional[str] = typer.Option(
        None, "--init", help="fsdp2: materialized (build the whole model on the device, then shard; default) or "
        "meta (build on the meta device, shard, to_empty, initialise the shards: FSDP2's large-model pattern).",
    ),
    fake_tensors: Optional[bool] = typer.Option(
        None, "--fake-tensors/--real-tensors", help="--simulated: FakeTensorMode (default on CPU) or real tensors."
    ),
    tolerance: float = typer.Option(0.01, help="Largest relative error of model states still ok."),
    timeout: float = typer.Option(600.0, help="Seconds one world size may run, counted from its launch."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the full result here (atomically)."),
    baseline: Optional[Path] = typer.Option(
        None, "--baseline", help="An earlier --json result: fail (exit 1) if a figure moved beyond --baseline-tolerance."
    ),
    baseline_tolerance: float = typer.Option(
        0.005, "--baseline-tolerance", help="Largest relative move of a predicted or measured figure vs --baseline."
    ),
    wire: bool = typer.Option(False, "--wire", help="Also count bytes on loopback in a private netns (gloo)."),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes of a real run (torchrun); run this command on each."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's rank, 0 to nnodes-1 (torchrun)."),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr", help="Address of node 0 (torchrun)."),
    master_port: Optional[int] = typer.Option(
        None, "--master-port", help="TCP port on node 0 (torchrun); default: a free port (one node only)."
    ),
    deepspeed_config: Optional[Path] = typer.Option(
        None, "--deepspeed-config", help="--engine deepspeed: a ds_config.json to run (default: built-in configs)."
    ),
    zero_init: bool = typer.Option(
        False, "--zero-init", help="--engine deepspeed, ZeRO-3: build the model under deepspeed.zero.Init("
        "config_dict_or_path=<the ds_config>), partitioned as built (default: built whole, then partitioned).",
    ),
) -> None:
    """Train the reference ZeRO runtime (or real FSDP2 / DeepSpeed with --engine), measure memory and traffic,
    compare with zeroplan;
    exit 1 if off."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise UserError('validate needs torch (2.4 to 2.13): install the extra, e.g. pip install ".[validate]"')
    if engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise UserError('--engine deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install ".[deepspeed]"')
    from zeroplan.files import check_writable

    if json_path is not None:  # first: a run must never be lost to a path that cannot be written
        check_writable(json_path, inputs=[model, baseline, deepspeed_config])
    if not 0 < baseline_tolerance < 1:
        raise UserError(f"--baseline-tolerance {baseline_tolerance:g}: must be between 0 and 1")
    if reshard_after_forward is not None:  # the planner's vocabulary: true, false or K (zeroplan.parsing)
        from zeroplan.parsing import parse_reshard

        try:
            reshard_after_forward = parse_reshard(reshard_after_forward)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    old = None
    if baseline is not None:
        from validate.baseline import read_baseline

        try:
            old = read_baseline(str(baseline))
        except ValueError as exc:
            raise UserError(str(exc)) from None
    from validate.api import run_validation, write_json_atomic
    from validate.config import ValidateConfig
    from validate.harness import Interrupted, NotNodeZero, RunFailed
    from validate.report import to_table
    from zeroplan.files import read_json
    from zeroplan.parsing import parse_count

    ds = read_json(deepspeed_config, "deepspeed config") if deepspeed_config is not None else None
    batch_keys = sorted(k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
                        if isinstance(ds, dict) and k in ds)  # fmt: skip
    if batch_keys:
        refuse_unused(ctx, ("batch_per_rank",), f"with a DeepSpeed config that sets the batch ({', '.join(batch_keys)})")
    config = ValidateConfig(
        **given(stages=tuple(stage) if stage else None, world_sizes=tuple(world_size) if world_size else None),
        model=model,
        params=parse_count(params) if params is not None else None,
        simulated=simulated,
        device=device,
        steps=steps,
        batch_per_rank=batch_per_rank,
        grad_accum=grad_accum,
        seq_len=seq_len,
        param_dtype=param_dtype,
        **given(engine=engine if engine != "reference" else None, reduce_dtype=reduce_dtype,
                reshard_after_forward=reshard_after_forward, fake_tensors=fake_tensors, fsdp2_init=fsdp2_init),
        tolerance=tolerance,
        checkpointing=checkpointing,
        foreach=foreach,
        **given(peak_tolerance=peak_tolerance),
        timeout_s=timeout,
        wire=wire,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        deepspeed_config=ds,
        zero_init=zero_init,
    )
    try:
        report = run_validation(config)
    except KeyboardInterrupt:
        typer.echo("zeroplan: error: interrupted", err=True)
        raise typer.Exit(130) from None
    except Interrupted as exc:  # SIGTERM, SIGHUP: ranks and temporary files are gone already
        typer.echo(f"zeroplan: error: {exc}", err=True)
        raise typer.Exit(128 + exc.signum) from None
    except NotNodeZero as exc:
        typer.echo(str(exc))
        return
    except RunFailed as exc:
        typer.echo(f"zeroplan: error: {exc}", err=True)
        raise typer.Exit(1) from None
    if old is not None:
        from validate.baseline import with_drift

        report = with_drift(report, old, baseline_tolerance)
    if json_path is not None:
        check_writable(json_path, inputs=[model, baseline, deepspeed_config])  # nothing put in the way since
        write_json_atomic(report, json_path)
    typer.echo(to_table(report))
    if old is not None:
        lines = report["baseline_drift"]["lines"]
        typer.echo(f"baseline {baseline}: " + ("no figure moved beyond " f"{100 * baseline_tolerance:g}%" if not lines
                   else "DRIFT: " + "; ".join(lines)))  # fmt: skip
    if not report["ok"]:
        raise typer.Exit(1)


def main() -> None:
    """Console-script entry point."""
    app()
