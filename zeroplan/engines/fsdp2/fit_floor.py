""""Does not fit", settled before a configuration's backward is built (a speed-up, no rule). ``plan.estimate``
predicts the peak of the worst of a configuration's ranks: of each rank, the largest moment of each phase
(``leaders.predict_peak``: ``formulas.peak.peak_of``, the CUDA workspaces added to every phase after init). So any
one moment of any of its ranks, rounded and topped up as ``peak_of`` does, is a lower bound on that peak: the
plan's mesh search, which asks most of its configurations only whether they fit (a bisection over the shard
groups, ``mesh.smallest_fitting``; each degree's first fit, ``plan.first_fit``), reads "no" from the activations
every layer saves, then the optimizer step, init and forward moments of its first rank, where one of them is over,
without the backward's moments (the blocks' walk, most of an estimate) or its other ranks."""

from __future__ import annotations

from zeroplan.engines.fsdp2.leaders import outside_backward, peak_rounding
from zeroplan.engines.fsdp2.terms import Fsdp2Run, _blocks_saved
from zeroplan.formulas.peak import rounded_total

PHASES = (("optimizer_step", True), ("init", False), ("forward", True))
"""The moments read, cheapest first (the optimizer step is one moment; init one per unit; the forward a dozen, the
gathered blocks in each), and whether the workspaces count there (every phase after init)."""


def saved_floor(run: Fsdp2Run) -> int:
    """A lower bound on ``run``'s peak without checkpointing (0 otherwise): the activations every decoder layer
    saves for its backward (``terms._blocks_saved`` of all L layers; with TP the TP-local run's, ``tp_acts``'), all
    held at the cross-entropy backward, a moment of every profile (``moments.backward_moments``) whose other terms,
    and those the estimate adds (HSDP's held all-reduce buffers, the workspaces, the rank map), only add bytes;
    each term rounds up (``peak.rounded_total``). One term of the run, without its moments."""
    return _blocks_saved(run, len(run.units) - 1).bytes if run.checkpointing == "none" else 0


def over_floor(run: Fsdp2Run, capacity: int) -> bool:
    """Whether ``saved_floor`` or one of ``run``'s optimizer-step, init or forward moments alone exceeds
    ``capacity`` bytes, rounded as ``predict_peak`` rounds it: then so does the peak of every estimate that takes
    ``run``'s rank (``worst_rank`` takes the highest), and TP's rank map (``tp_estimate.with_resident``) only adds.
    False without activations (no peak) or under ``CPUOffloadPolicy`` (its moments are rewritten:
    ``offload.offload_moments``). The moments it builds stay in ``run.memo`` (``leaders.outside_backward``): the
    estimate that follows when it is False takes them."""
    if run.acts is None or run.settings.offload_policy != "none":
        return False
    if saved_floor(run) > capacity:
        return True
    block, resident = peak_rounding(run)
    extra = rounded_total(resident, block) if resident else 0
    for phase, after_init in PHASES:
        room = capacity - extra if after_init else capacity
        if any(rounded_total(m.terms, block) > room for m in outside_backward(run, phase)):
            return True
    return False
