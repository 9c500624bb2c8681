"""The engine's peaks and allocation traces of the ladder's options (``zeroplan.planning.plan``): each stage
estimated once, an offload option on its stage's peak with the offloaded model states on the host
(``offload_peak``), and the traces of the stages whose live peak fits (``reserved_fit.live_over``)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional

from zeroplan.engines import get_engine, planner_options
from zeroplan.estimation.workload import model_workload
from zeroplan.formulas.offload import Offload
from zeroplan.formulas.peak import PeakEstimate
from zeroplan.planning.config import PlanConfig
from zeroplan.planning.offload_peak import offload_peak
from zeroplan.planning.reserved_fit import fit_quantity, live_over

if TYPE_CHECKING:  # the trace modules: imported where a trace is built
    from zeroplan.allocator.step_trace import AllocTrace

OptionKey = tuple[int, Offload]
"""(stage, offload): one option of the ladder."""


def option_peaks(
    config: PlanConfig, keys: tuple[OptionKey, ...], nd: Optional[int] = None, traced: bool = True,
    budget_bytes: Optional[int] = None,
) -> tuple[dict[OptionKey, PeakEstimate], str, dict[OptionKey, Optional[AllocTrace]]]:
    """({(stage, offload): peak} of ``keys``, how fits are decided, {(stage, no offload): allocation trace}):
    the engine's peak on ``nd`` ranks (default N_d) of each stage, for an offload option with the offloaded
    model states on the host (``offload_peak``), when the architecture and the step are ones it models; else
    {} and why fits are on model states. Each stage is estimated once, and only the stages of ``keys``; the
    traces only when ``traced`` (the cut-first advice at 2 N_d reads the peak alone), and a stage whose live
    peak alone exceeds ``budget_bytes`` gets None (``reserved_fit.live_over``: not built, not replayed)."""
    engine = get_engine(config.engine)
    stages = sorted({s for s, _ in keys})
    options = planner_options(engine, config.engine_options, policy=config.policy,
                              stage=stages[0] if len(stages) == 1 else None)  # fmt: skip
    options = replace(options, gpu_capability=config.gpu_capability, grad_accum=config.grad_accum)  # --gpu, G
    limit = engine.peak_limits(options, config.model_architecture, config.checkpointing, config.model_parallel)
    if limit is not None:
        return {}, f"fits on model states within the headroom: {limit.reason}", {}
    workload = model_workload(config.model_architecture, config.sequence_length, config.micro_batch,
                              config.checkpointing, config.grad_accum, config.foreach)  # fmt: skip
    settings = engine.planner_settings(options)
    rows = engine.estimate(workload, nd or config.nd, settings)
    block = engine.block_bytes(settings)
    by_stage = {r.stage: r.peak for r in rows if r.peak is not None}
    peaks = {
        (s, off): by_stage[s] if not off.any else offload_peak(by_stage[s], s, off, block)
        for s, off in keys
        if s in by_stage
    }
    traces = {}
    if engine.alloc_trace and traced:
        wanted = [r.stage for r in rows if r.peak is not None and not live_over(r.peak, budget_bytes)]
        if len(wanted) == len(rows):  # every stage's trace, in one call
            by_trace = dict(zip(wanted, engine.alloc_trace(workload, nd or config.nd, settings)))
        else:  # only the stages whose live peak fits: each with its own settings, as ``--stage`` asks it
            by_trace = {s: engine.alloc_trace(workload, nd or config.nd,
                                              engine.planner_settings(replace(options, stages=(s,), stage=s)))[0]
                        for s in wanted}  # fmt: skip
        traces = {(s, off): by_trace.get(s) for s, off in keys if s in by_stage and not off.any}
    quantity = fit_quantity(config.alloc_conf if traces else None)
    return peaks, (
        f"fits on {quantity} ({config.engine} engine, docs/peak.md) within the headroom; an offload option "
        "on its stage's peak of live bytes with the offloaded model states on the host "
        "(docs/plan.md#offload-options)"
    ), traces
