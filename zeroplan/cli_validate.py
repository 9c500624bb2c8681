"""``zeroplan validate``: run the engines on real ranks and compare with the prediction (the command;
``zeroplan.cli`` registers it). torch is imported inside, by ``validate``."""

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from zeroplan.cli_options import FsdpWrapOption, ReshardOption, UserError, given, read_settings_file, refuse_unused

if TYPE_CHECKING:
    from validate.config import ValidateConfig


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
    amsgrad: bool = typer.Option(
        False, "--amsgrad", help="Reference engine: Adam(amsgrad=True), a third fp32 state (max_exp_avg_sq)."
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
    dp_replicate: Optional[int] = typer.Option(
        None, "--dp-replicate", help="fsdp2: HSDP, fully_shard on the 2-D mesh (R, N_d / R) of R replicas."
    ),
    dp_shard: Optional[int] = typer.Option(
        None, "--dp-shard", help="fsdp2: HSDP, ranks S each parameter is sharded over: R = N_d / (S x T) for one "
        "--world-size; without one, the world is R x S (x T) with R from --dp-replicate, else 1.",
    ),
    tp: Optional[int] = typer.Option(
        None, "--tp", help="fsdp2: tensor parallelism over T ranks, torchtitan's llama plan (mesh (S, T), or "
        "(R, S, T) with --dp-replicate); the model defaults to llama-tiny.",
    ),
    sequence_parallel: Optional[bool] = typer.Option(
        None, "--sp/--no-sp", help="fsdp2 --tp: SequenceParallel norms and Shard(1) activations (default --sp)."
    ),
    loss_parallel: Optional[bool] = typer.Option(
        None, "--loss-parallel/--no-loss-parallel", help="fsdp2 --tp: the head's output Shard(-1) and the loss under "
        "loss_parallel() (default); --no-loss-parallel: Replicate, all-gathered logits (torchtitan's "
        "disable_loss_parallel)."
    ),
    tp_plan: Optional[str] = typer.Option(
        None, "--tp-plan", help="fsdp2 --tp: torchtitan (default) or transformers (the model's own tp_plan, as "
        "accelerate's TP; implies --no-sp --no-loss-parallel).",
    ),
    fsdp2_init: Optional[str] = typer.Option(
        None, "--init", help="fsdp2: materialized (build the whole model on the device, then shard; default) or "
        "meta (build on the meta device, shard, to_empty, initialise the shards: FSDP2's large-model pattern).",
    ),
    fsdp_wrap: FsdpWrapOption = None,  # the run makes exactly these calls
    hf: Optional[bool] = typer.Option(
        None, "--hf", help="fsdp2: train transformers' own class of the --model config.json (default: the "
        "validator's CausalLM).",
    ),
    labels: Optional[bool] = typer.Option(
        None, "--labels/--no-labels", help="fsdp2 --hf: the loss from forward(labels=...) inside the root's forward "
        "(default, as the HF Trainer) or from the logits outside it.",
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
    runner = _runner(engine)
    if not getattr(runner, "installed", lambda: True)():  # what the engine's runner trains (DeepSpeed)
        raise UserError(runner.MISSING)
    from zeroplan.files import check_writable

    if json_path is not None:  # first: a run must never be lost to a path that cannot be written
        check_writable(json_path, inputs=[model, baseline, deepspeed_config])
    if not 0 < baseline_tolerance < 1:
        raise UserError(f"--baseline-tolerance {baseline_tolerance:g}: must be between 0 and 1")
    if dp_shard is not None:
        dp_replicate, world_size = _mesh_of_shard(dp_shard, dp_replicate, tp, world_size, engine)
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
    from validate.config import ValidateConfig
    from zeroplan.parsing import parse_count

    if fsdp_wrap is not None and fsdp_wrap not in ("blocks", "torchtitan"):  # a file: read once, here
        from zeroplan.files import read_json

        fsdp_wrap = read_json(fsdp_wrap, "fsdp wrapping")
    ds = read_settings_file(deepspeed_config)
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
        seq_len=seq_len,
        param_dtype=param_dtype,
        **given(engine=engine, reduce_dtype=reduce_dtype,
                reshard_after_forward=reshard_after_forward, fake_tensors=fake_tensors, fsdp2_init=fsdp2_init,
                fsdp_wrap=fsdp_wrap, hf=hf, labels=labels, dp_replicate=dp_replicate, tp=tp,
                sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, tp_plan=tp_plan),
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
        # the engines' run options (Engine.run_options) where given: another engine's is refused by name
        **given(grad_accum=None if grad_accum == 1 else grad_accum, amsgrad=amsgrad or None, deepspeed_config=ds,
                zero_init=zero_init or None),
    )
    report = _run(config)
    if report is not None:  # None: a node other than node 0, which printed its one line
        _report(report, old, baseline, baseline_tolerance, json_path, [model, baseline, deepspeed_config])


def _runner(engine: str):
    """The validator's runner of ``engine`` (``Engine.runner``); UserError for an unknown engine."""
    from validate.config import runner_of
    from zeroplan.engines import get_engine

    try:
        return runner_of(get_engine(engine))
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _mesh_of_shard(dp_shard: int, dp_replicate: Optional[int], tp: Optional[int], world_sizes: Optional[list[int]],
                   engine: str) -> tuple[Optional[int], list[int]]:
    """``--dp-shard S`` as the replicas and world size the run takes: R x S (x T) ranks, FSDP2's mesh
    (``init_device_mesh``'s sizes multiply to the world), R = N_d / (S x T) for the one world size given."""
    from validate.config import run_option_engines

    if engine not in (meshes := run_option_engines("dp_replicate")):  # --dp-shard sets the mesh's replicas
        raise UserError(f"--dp-shard: --engine {' or '.join(meshes)} only")
    if dp_shard < 2:
        raise UserError(f"--dp-shard {dp_shard}: must be >= 2 (the ranks each parameter is sharded over)")
    inner = dp_shard * (tp or 1)
    if not world_sizes:
        return dp_replicate, [(dp_replicate or 1) * inner]
    if len(set(world_sizes)) > 1:
        raise UserError(f"--dp-shard {dp_shard} with --world-size {sorted(set(world_sizes))}: give one world size")
    (n,) = set(world_sizes)
    if n % inner or (dp_replicate is not None and n != dp_replicate * inner):
        mesh = " x ".join(map(str, ([dp_replicate or "R"] + [dp_shard] + ([tp] if tp else []))))
        raise UserError(f"--dp-shard {dp_shard}: the mesh {mesh} must multiply to the world size {n}")
    return (n // inner if n > inner else dp_replicate), list(world_sizes)


def _run(config: "ValidateConfig") -> Optional[dict]:
    """One validation run of ``config``: its report, or None on a node other than node 0 (which prints the line
    it is told); an interrupt or failed run is one line on stderr and its exit status."""
    from validate.api import run_validation
    from validate.harness import Interrupted, NotNodeZero, RunFailed

    try:
        return run_validation(config)
    except KeyboardInterrupt:
        typer.echo("zeroplan: error: interrupted", err=True)
        raise typer.Exit(130) from None
    except Interrupted as exc:  # SIGTERM, SIGHUP: ranks and temporary files are gone already
        typer.echo(f"zeroplan: error: {exc}", err=True)
        raise typer.Exit(128 + exc.signum) from None
    except NotNodeZero as exc:
        typer.echo(str(exc))
        return None
    except RunFailed as exc:
        typer.echo(f"zeroplan: error: {exc}", err=True)
        raise typer.Exit(1) from None


def _report(report: dict, old: Optional[dict], baseline: Optional[Path], baseline_tolerance: float,
            json_path: Optional[Path], inputs: list) -> None:
    """The run's report: with its drift from ``old`` (--baseline), written to ``json_path``, printed as the
    table; exit 1 if off."""
    from validate.api import write_json_atomic
    from validate.report import to_table
    from zeroplan.files import check_writable

    if old is not None:
        from validate.baseline import with_drift

        report = with_drift(report, old, baseline_tolerance)
    if json_path is not None:
        check_writable(json_path, inputs=inputs)  # nothing put in the way since
        write_json_atomic(report, json_path)
    typer.echo(to_table(report))
    if old is not None:
        lines = report["baseline_drift"]["lines"]
        typer.echo(f"baseline {baseline}: " + ("no figure moved beyond " f"{100 * baseline_tolerance:g}%" if not lines
                   else "DRIFT: " + "; ".join(lines)))  # fmt: skip
    if not report["ok"]:
        raise typer.Exit(1)
