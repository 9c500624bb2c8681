"""The engine contract's entry point for DeepSpeed (``zeroplan/engines/base.py``): ``estimate``, model
states, the peak per phase and one step's collectives of one configuration."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache
from typing import Optional

from zeroplan.engines.base import EngineEstimate, Workload, worst_rank
from zeroplan.engines.deepspeed.collectives import to_collective
from zeroplan.engines.deepspeed.offload import host_memory, label_suffix
from zeroplan.engines.deepspeed.offload_terms import offloads
from zeroplan.engines.deepspeed.phases import moments
from zeroplan.engines.deepspeed.run import _layout, _trace
from zeroplan.engines.deepspeed.settings import Settings, inner_optimizer_class, optimizer_class
from zeroplan.engines.deepspeed.terms import FlatGroup
from zeroplan.engines.deepspeed.wrapper import collectives, ds_run, memory_breakdown
from zeroplan.formulas.cuda_workspaces import library_workspaces
from zeroplan.formulas.peak import Moment, PeakEstimate, Term, peak_of


def estimate(workload: Workload, nd: int, settings: Settings, stat_bytes: Optional[int] = None) -> tuple[EngineEstimate, ...]:
    """DeepSpeed under ``settings`` on N_d = ``nd`` ranks: model states, peak per phase, one step's collectives.

    ``settings.rank`` None: the worst rank (``worst_rank``). Only ``DeepSpeedZeroOptimizer`` (ZeRO-1/2) has ranks
    that differ, by the parameters their slice of the flat group overlaps (``FlatGroup.distinct_ranks``); the
    others partition every tensor, or the flat group, alike on every rank (``peak_rank`` None). The moments of
    every rank at once (``DSRun.ranks``) bound each rank's peak; the ranks are tried (``_tries``) until one reaches
    that bound (the first or the second, as a rule), all of them otherwise."""
    if settings.rank is not None and settings.rank >= nd:
        raise ValueError(f"rank={settings.rank}: must be < N_d={nd}")
    if settings.rank is not None or workload.spec is None or optimizer_class(settings) != "DeepSpeedZeroOptimizer":
        return (_estimate(workload, nd, settings, stat_bytes),)
    every = _estimate(workload, nd, settings, stat_bytes)
    bound = every.peak.peak_bytes
    flat = ds_run(settings, workload, nd, stat_bytes).flat
    named = _peak_moment_rank(run_moments(settings, workload, nd, stat_bytes), every.peak)  # type: ignore[arg-type]
    rows = {}
    for r in _tries(_rank_order(flat), named):
        # model states and collectives are every rank's alike: only the peak is the rank's own
        rows[r] = replace(every, peak=_peak(workload, nd, settings.model_copy(update={"rank": r}), stat_bytes),
                          peak_rank=r)  # fmt: skip
        if rows[r].peak.peak_bytes >= bound:
            break
    return (worst_rank(rows),)


def _tries(order: tuple[int, ...], named: Optional[int]) -> tuple[int, ...]:
    """The ranks ``estimate`` tries, in turn, until one reaches every rank's bound: the first of ``order``
    (``_rank_order``: rank 0, so that it is named when all are alike), then ``named``, the rank whose own terms the
    bound's moment holds (``_peak_moment_rank``), then the rest of ``order``. ``named`` reaches the bound as a rule:
    that moment is its own, listed for it by the family's ``DSRun.first_largest`` (the lowest rank of those holding
    the most). Trying it second, not in its place in ``order``, is a speed-up that names another rank only where
    several reach the bound, each a worst rank alike (``worst_rank``: every rank of such a tie peaks as high, holds
    the same model states): DeepSpeed on Qwen3-30B-A3B, 1,024 GPUs, ZeRO-1 at 5e8, named rank 11 as the 86th of 226
    (103 of the plan's 231 estimating CPU-ms), Llama-2-70B at 2e8 rank 6 as the 244th of 663."""
    if named is None or named == order[0]:
        return order
    return (order[0], named, *[r for r in order[1:] if r != named])


def _peak_moment_rank(moments: tuple[Moment, ...], peak: PeakEstimate) -> Optional[int]:
    """``Moment.rank`` of the moment ``peak`` (``peak_of`` of ``moments``) peaks at: the first of its phase by that
    name (a name listed twice, the first: a wrong rank is only tried in vain, ``_tries``). None: every rank's alike,
    or its family does not say."""
    top = next(p for p in peak.phases if p.phase == peak.peak_phase)
    return next((m.rank for m in moments if m.phase == top.phase and m.name == top.moment), None)


@lru_cache(maxsize=8)  # per layout (``terms.flat_group``, hashed by identity): every ZeRO-1/2 candidate asks
def _rank_order(flat: FlatGroup) -> tuple[int, ...]:
    """``estimate``'s ranks to try: one of each class (``FlatGroup.distinct_ranks``), the largest overlap first
    (rank 0 first among equals, so that it is named when all are alike)."""
    return tuple(sorted(flat.distinct_ranks(), key=lambda r: (r != 0, -flat.params_numel(r), r)))


def device_terms(workload: Workload, settings: Settings) -> tuple[int, tuple[Term, ...]]:
    """The allocator block every term is rounded to and the terms held from the first backward on: on CUDA
    512-byte blocks (``peak.CUDA_BLOCK_BYTES``) and the cuBLAS / cuBLASLt workspaces of ``settings.cuda_capability``
    (``formulas.cuda_workspaces``, FSDP2's and the reference's rule: cuBLASLt's where a Linear has a bias), on the
    CPU accelerator none. The peak (``_peak``) and the allocation trace (``alloc_trace``) both take them here."""
    if settings.device != "cuda" or workload.spec is None:
        return 1, ()
    return settings.block_bytes, (library_workspaces(settings.cuda_capability, workload.spec.biased_linear),)


def _peak(workload: Workload, nd: int, settings: Settings, stat_bytes: Optional[int]) -> Optional[PeakEstimate]:
    """The peak per phase of the rank ``settings`` describes (every rank's largest where none is named), on
    ``settings.device`` (``device_terms``)."""
    if workload.spec is None:
        return None
    block, resident = device_terms(workload, settings)
    return peak_of(run_moments(settings, workload, nd, stat_bytes), block, resident=resident)


@lru_cache(maxsize=64)  # a plan's allocation trace of a candidate walks the moments its estimate listed
def run_moments(settings: Settings, workload: Workload, nd: int, stat_bytes: Optional[int]) -> tuple[Moment, ...]:
    """Every moment of the run of ``workload`` under ``settings`` (``phases.moments``), once per run."""
    return moments(ds_run(settings, workload, nd, stat_bytes))


def _estimate(workload: Workload, nd: int, settings: Settings, stat_bytes: Optional[int]) -> EngineEstimate:
    # the parameter sizes, once per workload where it has an architecture (``run._layout``, cached)
    numels = _layout(workload)[0] if workload.spec is not None else tuple(math.prod(s) for _, s in workload.shapes)
    peak = _peak(workload, nd, settings, stat_bytes)
    host = host_memory(ds_run(settings, workload, nd, stat_bytes)) if offloads(settings) and workload.spec else None
    return EngineEstimate(
        engine="deepspeed",
        label=f"ZeRO-{settings.stage} {optimizer_class(settings)} + {inner_optimizer_class(settings)}"
              f"{label_suffix(settings)}",
        stage=settings.stage,
        memory=memory_breakdown(settings, numels, nd),
        peak=peak,
        collectives=tuple(to_collective(c, nd) for c in collectives(settings, numels, nd, workload.grad_accum,
                                                                    *_trace(workload))),
        peak_rank=settings.rank,
        host=host,
    )  # fmt: skip
