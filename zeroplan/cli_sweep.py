"""``zeroplan sweep``: every combination of comma-separated values, one row per configuration (the
command; ``zeroplan.cli`` registers it). Thin: parse, one config model, one call, write."""

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from zeroplan.cli_options import (
    ForeachOption, GradDtype, MasterWeights, ModelOption, OptimizerDtype, OptimizerName, ParamDtype,
    ReduceDtypeOption, ReshardOption, UserError, engine_options_from, read_settings_file,
    DeviceOption, FsdpWrapOption, InitOption, ZeroInitOption, HfZeroInitOption,
    given_on_command_line, policy_from, refuse_foreign, refuse_unused,
)  # fmt: skip
from zeroplan.cli_options import AllocConfOption, HeadroomOption  # reserved bytes, as estimate/plan
from zeroplan.cli_options import RevisionOption  # --model ORG/NAME (zeroplan.hub)
from zeroplan.cli_options import DpReplicateOption, DpShardOption, LossParallelOption, TpOption  # fsdp2: mesh, TP
from zeroplan.cli_options import FsdpOffloadOption, FsdpPinMemoryOption  # fsdp2's CPUOffloadPolicy, as estimate
from zeroplan.hub import with_revision

if TYPE_CHECKING:
    from zeroplan.sweeping.config import SweepConfig


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
    foreach: ForeachOption = None,
    engine: Annotated[str, typer.Option(
        help="Training engine of the rows: reference (one row per --stage), fsdp2 or deepspeed (one row per "
        "configuration: the sharding the engine runs; deepspeed: one per --stage given).")] = "reference",
    deepspeed_config: Annotated[Optional[Path], typer.Option(
        "--deepspeed-config", help="ds_config.json, with --engine deepspeed only: the engine's settings (buckets, "
        "precision, optimizer; --stage gives the rows' stages). With --engine reference give the policy "
        "options (--param-dtype, --optimizer, ...) instead.")] = None,
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
    headroom: HeadroomOption = 0.0,
    alloc_conf: AllocConfOption = "",
    as_json: bool = typer.Option(False, "--json", help="One JSON object with rows[] instead of CSV."),
    out: Optional[Path] = typer.Option(
        None,
        help="Write to this file (atomically) instead of stdout; a name ending in .parquet writes Parquet."
    ),
) -> None:
    """Estimate every combination of comma-separated values; CSV (or JSON), one row per configuration and stage."""
    model = with_revision(model, revision)  # ORG/NAME@REV: zeroplan.hub

    from zeroplan.architectures.shapes_file import load_numels
    from zeroplan.engines import get_engine
    from zeroplan.parsing import parse_bytes, parse_counts, parse_list, parse_offload, parse_wholes
    from zeroplan.presets import gpu_capacity
    from zeroplan.sweeping.config import SweepConfig
    from zeroplan.types import MAX_BATCH, MAX_GPUS, check_wholes

    parquet, inputs = check_sweep_options(ctx, params, shapes, model, engine, deepspeed_config, as_json, out)
    reads_policy = "policy" in get_engine(engine).options
    options = engine_options_from(engine, read_settings_file(deepspeed_config), reshard_after_forward, param_dtype,
                                  reduce_dtype, fsdp_wrap=fsdp_wrap, init=init, device=device,
                                  dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, loss_parallel=loss_parallel,
                                  zero_init=zero_init, hf_zero_init=hf_zero_init,
                                  fsdp_offload=fsdp_offload, fsdp_pin_memory=fsdp_pin_memory)  # fmt: skip
    micro_batches = parse_wholes(micro_batch, "micro-batch")
    if model is not None:  # a ds_config's batch is the rows' (the engine's sweep_batches)
        typed = micro_batches if given_on_command_line(ctx, "micro_batch") else None
        micro_batches = get_engine(engine).sweep_batches(  # the lists in range first: the config checks them later
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
        gpu=gpu,  # its compute capability sizes the peak's cuBLAS workspaces, as in plan
        gpu_memory_bytes=capacity,
        headroom=headroom,
        alloc_conf=alloc_conf,
        policy=policy_from(param_dtype if reads_policy else None, grad_dtype, master_weights, optimizer,
                           optimizer_dtype),  # fmt: skip
        engine_options=options,
    )
    write_rows(config, as_json, out, parquet, inputs)


def check_sweep_options(ctx: typer.Context, params: Optional[str], shapes: Optional[Path], model: Optional[str],
                        engine: str, deepspeed_config: Optional[Path], as_json: bool,
                        out: Optional[Path]) -> tuple[bool, list]:
    """The option checks of ``sweep`` that need no parsed value (UserError, before any work): whether the
    output is Parquet, and every file sweep reads (a preset name is none)."""
    import importlib.util

    from zeroplan.engines import get_engine
    from zeroplan.files import check_writable

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
        refuse_unused(ctx, ("foreach", "engine", "alloc_conf"), "without --model: the peak needs an architecture")
    refuse_foreign(ctx, engine)
    if deepspeed_config is not None and "ds_config" not in get_engine(engine).reads:
        raise UserError("--deepspeed-config does not apply to sweep --engine reference: use --engine deepspeed "
                        "--model NAME with it, or give the reference policy options (--param-dtype, --optimizer, ...)")
    return parquet, inputs


def write_rows(config: "SweepConfig", as_json: bool, out: Optional[Path], parquet: bool, inputs: list) -> None:
    """The rows of ``config``, written as CSV, JSON or Parquet, to stdout or atomically to ``out``."""
    from zeroplan.files import atomic_write
    from zeroplan.render.sweep import CSV_SLICE_ROWS, write_csv, write_json, write_parquet
    from zeroplan.sweeping.grid import sweep_columns, sweep_frames

    def write(sink) -> None:
        if as_json:
            write_json(sweep_frames(config), config, sink)
        else:  # numpy columns straight to pyarrow: pandas is never imported
            write_csv(sweep_columns(config, CSV_SLICE_ROWS), sink)  # one slice at a time: the peak RSS

    if out is None:
        write(typer.get_binary_stream("stdout"))
    elif parquet:
        atomic_write(out, lambda tmp: write_parquet(sweep_frames(config), tmp), inputs=inputs)
    else:

        def write_file(tmp: str) -> None:
            with open(tmp, "wb") as sink:
                write(sink)

        atomic_write(out, write_file, inputs=inputs)
