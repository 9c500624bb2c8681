"""The engine contract's entry point for DeepSpeed (``zeroplan/engines/base.py``): ``estimate``, model
states, the peak per phase and one step's collectives of one configuration."""

from __future__ import annotations

import math
from typing import Optional

from zeroplan.engines.base import EngineEstimate, Workload
from zeroplan.engines.deepspeed.collectives import to_collective
from zeroplan.engines.deepspeed.phases import moments
from zeroplan.engines.deepspeed.run import _trace
from zeroplan.engines.deepspeed.settings import Settings, inner_optimizer_class, optimizer_class
from zeroplan.engines.deepspeed.wrapper import collectives, ds_run, memory_breakdown
from zeroplan.formulas.peak import PeakEstimate, peak_of


def estimate(workload: Workload, nd: int, settings: Settings, stat_bytes: Optional[int] = None) -> tuple[EngineEstimate, ...]:
    """DeepSpeed under ``settings`` on N_d = ``nd`` ranks: model states, peak per phase, one step's collectives."""
    numels = tuple(math.prod(shape) for _, shape in workload.shapes)
    peak: Optional[PeakEstimate] = None
    if workload.spec is not None:
        peak = peak_of(moments(ds_run(settings, workload, nd, stat_bytes)))
    return (EngineEstimate(
        engine="deepspeed",
        label=f"ZeRO-{settings.stage} {optimizer_class(settings)} + {inner_optimizer_class(settings)}",
        stage=settings.stage,
        memory=memory_breakdown(settings, numels, nd),
        peak=peak,
        collectives=tuple(to_collective(c, nd) for c in collectives(settings, numels, nd, workload.grad_accum,
                                                                    *_trace(workload))),
    ),)  # fmt: skip
