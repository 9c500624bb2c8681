"""``zeroplan plot``: the figures of a sweep (the command; ``zeroplan.cli`` registers it). matplotlib is
imported inside, by ``zeroplan.plots``."""

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from zeroplan.cli_options import (
    GradDtype, MasterWeights, OptimizerDtype, OptimizerName, ParamDtype, UserError, policy_from, refuse_unused,
)  # fmt: skip


class PlotView(str, Enum):
    memory = "memory"
    breakdown = "breakdown"
    comm = "comm"
    validate = "validate"


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
    it at exit and logs two warnings saying so; and since that cache starts empty, ``font_manager`` rebuilds
    the font list every run and, when that takes over 5 s (a slow or busy machine: CI did), logs a third
    ("Matplotlib is building the font cache"). None is about the user's input or output, and each would break
    the one-line rule, so those three (and only those) are dropped. A logger's filter sees only the records
    logged on that logger, not its children's, so each filter sits on the logger that logs its message."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_MATPLOTLIB_HOUSEKEEPING)

    for name in ("matplotlib", "matplotlib.font_manager"):
        logging.getLogger(name).addFilter(keep)


_MATPLOTLIB_HOUSEKEEPING = (
    "mkdir -p failed for path",  # matplotlib/__init__.py: _get_config_or_cache_dir
    "Matplotlib created a temporary",  # matplotlib/__init__.py: _get_config_or_cache_dir
    "Matplotlib is building the font cache",  # matplotlib/font_manager.py: FontManager.__init__ (after 5 s)
)
