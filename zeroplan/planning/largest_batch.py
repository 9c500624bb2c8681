"""The largest micro-batch that fits (issue 21, "the user-level truth"): ``plan --max-micro-batch UP_TO`` plans
again at other micro-batches and reports, for every configuration of the plan, the largest micro-batch that
still fits on the plan's own quantity (reserved bytes of the engine's allocation trace, else the peak of live
bytes: ``reserved_fit.py``, ``allocator.reserved.fit_bytes``) within the budget.

The search is the one ``validate/gpu_check.sh`` runs on a real GPU (``search``): micro-batch 1, 2, 4, ... until
one does not fit or ``UP_TO`` is passed, then bisection between the largest that fits and the smallest that
does not; both assume that a larger micro-batch never needs less memory. With ``UP_TO`` a power of two the two
searches try the same micro-batches, so a recorded GPU search compares with this one bracket by bracket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from zeroplan.types import MAX_BATCH

MICRO_BATCH_LIMIT = MAX_BATCH
"""``--micro-batch``'s own upper limit (zeroplan/types.py ``BatchCount``)."""


@dataclass(frozen=True)
class Bracket:
    """The search's answer for one configuration."""

    largest: int
    """the largest micro-batch that fits; 0: not even 1."""
    smallest_over: Optional[int]
    """the smallest micro-batch found not to fit; None: every one up to the limit fits."""
    tried: tuple[int, ...]
    """the micro-batches evaluated, in order."""


def bracket(fits: Callable[[int], bool], up_to: int) -> Bracket:
    """Doubling from 1 while ``fits``, then bisection (``validate/gpu_check.sh search``); ``up_to`` >= 1."""
    if not 1 <= up_to <= MICRO_BATCH_LIMIT:
        raise ValueError(f"max micro-batch {up_to}: must be from 1 to {MICRO_BATCH_LIMIT}")
    tried: list[int] = []

    def check(b: int) -> bool:
        tried.append(b)
        return fits(b)

    ok, bad, b = 0, None, 1
    while b <= up_to:
        if not check(b):
            bad = b
            break
        ok, b = b, b * 2
    hi = bad if bad is not None else up_to + 1  # every micro-batch up to the limit is searched
    while hi - ok > 1:
        mid = (ok + hi) // 2
        if check(mid):
            ok = mid
        else:
            hi = bad = mid
    return Bracket(ok, bad, tuple(tried))


@dataclass(frozen=True)
class LargestBatch:
    """One configuration of the plan (its row's label) and its bracket."""

    label: str
    bracket: Bracket


def largest_micro_batches(config, up_to: int) -> tuple[LargestBatch, ...]:
    """Every configuration of ``plan_config(config)``, each with the largest micro-batch at which the same
    configuration (the same row label) fits; each micro-batch is planned once for all of them, with the options
    that pin a row's searched part (``PlanOption.pins``: FSDP2's mesh, which the plan's search may choose
    otherwise at another micro-batch) once per distinct pins. A configuration absent from another micro-batch's
    plan (an offload row listed only where nothing else fits) counts as not fitting there."""
    from zeroplan.engines.base import EngineOptions
    from zeroplan.planning.plan import plan_config

    config = config.model_copy(update={"replay_all": True})  # every row's fit, not only up to the first that fits
    base = plan_config(config).options
    plans: dict[tuple, dict[str, bool]] = {(config.micro_batch, o.pins): {} for o in base}
    for o in base:  # every row's own pins hold its row as planned at the given micro-batch
        for key in plans:
            plans[key][o.label] = bool(o.fits)

    def fits_at(b: int, pins: tuple) -> dict[str, bool]:
        if (b, pins) not in plans:
            fields = {name: getattr(config, name) for name in config.model_fields_set}  # as given: defaults stay
            if pins:
                fields["engine_options"] = EngineOptions(**{**(config.engine_options.model_extra or {}), **dict(pins)})
            try:  # validated again: a micro-batch whose activations pass any sane byte count is refused there
                at_b = type(config).model_validate({**fields, "micro_batch": b})
            except ValueError:
                plans[b, pins] = {}
            else:
                plans[b, pins] = {o.label: bool(o.fits) for o in plan_config(at_b).options}
        return plans[b, pins]

    return tuple(LargestBatch(o.label, bracket(lambda b, o=o: fits_at(b, o.pins).get(o.label, False), up_to))
                 for o in base)  # fmt: skip


def bracket_lines(found: tuple[LargestBatch, ...], up_to: int) -> list[str]:
    """The table's lines: one per configuration."""
    out = [f"Largest micro-batch that fits, on the quantity \"fits\" compares above (searched 1 to {up_to}: "
           "doubling, then bisection):"]
    width = max((len(f.label) for f in found), default=0)
    for f in found:
        b = f.bracket
        over = f"{b.smallest_over} does not" if b.smallest_over is not None else f"all up to {up_to} fit"
        out.append(f"  {f.label:<{width}}  {b.largest:>5}  ({over}; {len(b.tried)} tried)")
    return out


def largest_json(found: tuple[LargestBatch, ...], up_to: int) -> dict:
    """The JSON object: the limit and, per configuration, the bracket."""
    return {"up_to": up_to, "configurations": [
        {"label": f.label, "largest": f.bracket.largest, "smallest_over": f.bracket.smallest_over,
         "tried": list(f.bracket.tried)} for f in found]}  # fmt: skip
