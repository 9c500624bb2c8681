"""The reference runtime's step as an ordered allocation trace (``zeroplan.allocator.step_trace``): its moments
walked in order, every tensor on the default stream (``validate/runtime.py`` issues its collectives from the
default stream and allocates nothing on another)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from zeroplan.engines.base import Workload
from zeroplan.engines.reference.moments import moments
from zeroplan.engines.reference.settings import Settings
from zeroplan.engines.reference.terms import reference_run
from zeroplan.formulas.cuda_workspaces import library_workspaces

if TYPE_CHECKING:  # the allocator's trace modules: imported by the first trace, not by every command
    from zeroplan.allocator.step_trace import AllocTrace

STREAMS = {0: "default"}
"""The streams the trace uses, by number."""


def alloc_traces(workload: Workload, nd: int, settings: Settings) -> tuple[AllocTrace, ...]:
    """One trace per requested ZeRO stage (``estimate``'s rows, in order); needs an architecture."""
    from zeroplan.allocator.step_trace import default_stream, step_trace

    if workload.spec is None:
        raise ValueError("an allocation trace needs an architecture (activations): give a model")
    cap = settings.cuda_capability
    resident = () if cap is None else (library_workspaces(cap, workload.spec.biased_linear),)
    out = []
    for stage in settings.stages:
        run = reference_run(workload.spec, nd, stage, workload.micro_batch, workload.seq_len, workload.checkpointing,
                            workload.foreach, stat_bytes=settings.stat_bytes, grad_accum=workload.grad_accum,
                            shapes=workload.shapes)  # fmt: skip
        run = replace(run, gloo=settings.backend == "gloo")
        out.append(step_trace(moments(run), settings.block_bytes, resident, default_stream))
    return tuple(out)
