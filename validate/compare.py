"""Prediction next to measurement: the one comparison every engine runner uses.

A runner (``validate.report`` for the reference runtime, ``validate.engines.fsdp2``,
``validate.engines.deepspeed``) gives its engine profile's ``EngineEstimate`` row as a ``Prediction`` and
its ranks' readings as ``Readings``; ``compare`` returns the report row's predicted, measured and error
fields and the checks on them (``validate.schema.ReportRow``). What stays in a runner is what is its own:
how its ranks read model states, which steps are steady, its parity check and its extra columns.

Rules, one home each:
- model states: predicted = the profile's parameters, gradients and optimizer states plus the named
  terms it holds beside them at the reading (``Prediction.beside_states``, read from the predicted row);
  a measurement is never corrected by a prediction.
- relative errors: (measured - predicted) / predicted for states and collectives, (measured - predicted)
  / measured for peaks; a zero denominator gives 0 when both are 0, else 1 (``rel_error``).
- collectives: observed calls summed per (op, phase, dtype) must equal the prediction at every steady
  step of every rank, in elements (or call by call, ``Prediction.per_call``), over the ops the profile
  predicts (``Prediction.ops``); bytes are derived (the ring rule on each observed call), never measured.
- peaks: the largest reading of each phase over the ranks against the predicted phase peak; phases a
  runner cannot check are reported with the reason and left out of the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from zeroplan.engines.base import EngineEstimate
from zeroplan.formulas.collectives import Collective, ring_bytes_per_rank
from zeroplan.formulas.dtypes import BYTES_PER_ELEMENT, dtype_bytes, dtype_name
from zeroplan.formulas.peak import PHASES as PEAK_PHASES
from zeroplan.formulas.peak import Term

RING_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
"""The collectives compared (an all-to-all: DeepSpeed ZeRO++ qgZ's ``all_to_all_single``, one pass, ``PASSES``)."""

GLOO_NOTE = (
    "gloo runs a reduce-scatter as a full all-reduce followed by a local copy, so on the wire it sends "
    "twice the ring volume counted here (seen with --wire: gpt-tiny at N_d = 2 sends 1.06x the logical "
    "bytes at stage 0, 1.59x at stages 1-2 and 1.42x at stage 3, i.e. 1.5x and 1.34x of stage 0's "
    "ratio, as (2+1)/2 and (1+1+2)/3 predict); derived comm bytes are the logical ring bytes per rank "
    "((N_d-1)*ceil(n/N_d)*b per observed call, x2 for all-reduce), which is what NCCL's ring sends."
)
"""The note every report with a gloo row carries (the reference runner's and the engines')."""


def rel_error(measured: float, predicted: float, base: float) -> float:
    """(measured - predicted) / base; with base 0: 0 when measured equals predicted, else 1."""
    if base:
        return (measured - predicted) / base
    return float(measured != predicted)


def _dtype(name: str) -> str:
    """The planner's name of a dtype (``bfloat16`` -> ``bf16``, ``float64`` -> ``fp64``; one table,
    ``zeroplan.formulas.dtypes``), or the name as observed if the table has none."""
    try:
        return dtype_name(name)
    except ValueError:
        return name


def key(op: str, phase: str, dtype: str) -> str:
    """The report's key of a collective: ``op|phase|dtype`` (dtype in the planner's spelling)."""
    return f"{op}|{phase}|{_dtype(dtype)}"


def observed_collectives(calls: list[list], nd: int, group_sizes: list | None = None) -> dict[str, dict]:
    """Observed calls summed per (op, phase, dtype): ``calls`` and ``elements`` are counted at dispatch;
    ``derived_bytes_per_rank`` is the planner's ring rule applied to each call (derived, not measured;
    None for a collective the rule does not cover) over the call's group (``group_sizes``, in call order,
    as seen at dispatch; None or missing: ``nd``)."""
    out: dict[str, dict] = {}
    sizes = list(group_sizes or []) + [None] * len(calls)
    for (op, phase, dtype, elements), size in zip(calls, sizes):
        row = out.setdefault(key(op, phase, dtype), {"calls": 0, "elements": 0, "derived_bytes_per_rank": 0})
        row["calls"] += 1
        row["elements"] += elements
        derived = (
            ring_bytes_per_rank(op, elements, size or nd, dtype_bytes(dtype))
            if op in RING_OPS and _dtype(dtype) in BYTES_PER_ELEMENT
            else None
        )
        row["derived_bytes_per_rank"] = (
            None if derived is None or row["derived_bytes_per_rank"] is None
            else row["derived_bytes_per_rank"] + derived
        )  # fmt: skip
    return out


RESERVED_PREFIX = "reserved_bytes.peak."
"""``validate.probes.MemoryProbe.breakdown`` key prefix of ``max_memory_reserved`` per phase (CUDA only)."""


def reserved_by_phase(breakdown: dict) -> Optional[dict[str, int]]:
    """``max_memory_reserved`` per phase out of a probe's breakdown; None where none was read (CPU)."""
    out = {k[len(RESERVED_PREFIX):].replace(" ", "_"): int(v) for k, v in breakdown.items()
           if k.startswith(RESERVED_PREFIX)}  # fmt: skip
    return out or None


@dataclass(frozen=True)
class Prediction:
    """An engine profile's row, as the runner's ranks are measured against it."""

    estimate: EngineEstimate
    collectives: Optional[tuple[Collective, ...]] = None
    """one optimizer step's collectives in the runner's phase names; None: ``estimate.collectives``."""
    peak_by_phase: Optional[dict[str, int]] = None
    """the predicted peak per phase; None: ``estimate.peak`` (a runner over several ranks' predictions
    gives their largest per phase)."""
    beside_states: tuple[Term, ...] = ()
    """terms of the profile live beside the model states where the runner reads them (read from the row)."""
    per_call: bool = False
    """collectives match call by call, in order (the profile predicts each call), not summed per key."""
    ops: Optional[tuple[str, ...]] = None
    """the collectives the profile predicts (others are reported, not checked); None: all."""
    peak_by_rank: Optional[dict[int, dict[str, int]]] = None
    """each measured rank's own predicted peak per phase (the engine's ``Settings.rank``); with
    ``Readings.peak_by_rank``, each rank's measured peak is compared with its own prediction."""
    reserved_by_phase: Optional[dict[str, int]] = None
    """CUDA: the allocator model's ``max_memory_reserved`` per phase for the engine's allocation trace
    (``zeroplan.allocator.reserved``); None: not predicted (CPU, or an engine not wired yet)."""


@dataclass(frozen=True)
class Readings:
    """What the ranks measured, max over ranks where a figure is one number."""

    states_bytes: int
    """live bytes where model states are read (the step boundary, or after backward), largest rank."""
    steady: bool
    """the same live bytes at every step boundary of every rank."""
    peak_bytes_by_phase: dict[str, int]
    """largest live bytes within each phase, max over ranks (keys of ``zeroplan.formulas.peak.PHASES``)."""
    steps: list[list[list]]
    """the calls of every steady step of every rank, each ``[op, phase, dtype, elements]``."""
    last_step: list[list]
    """rank 0's calls of the last step."""
    setup_calls: list[list]
    """rank 0's calls while the engine was built (none predicted; reported, not checked)."""
    nd: int
    group_sizes: Optional[list] = None
    """the process group size of each call of ``last_step`` (None: ``nd``)."""
    unchecked_phases: dict[str, str] = field(default_factory=dict)
    """phases whose peak is reported but not checked, each with the reason."""
    peak_by_rank: Optional[dict[int, dict[str, int]]] = None
    """each rank's largest live bytes within each phase (``peak_bytes_by_phase`` is their max)."""


def _states(pred: Prediction, got: Readings, tolerance: float) -> dict:
    est = pred.estimate
    predicted = est.model_states_bytes + sum(t.bytes for t in pred.beside_states)
    err = rel_error(got.states_bytes, predicted, predicted)
    return {
        "predicted_model_states_bytes": predicted,
        "measured_model_states_bytes": got.states_bytes,
        "model_states_rel_error": err,
        "model_states_extra_bytes": got.states_bytes - predicted,
        "predicted_beside_states_terms": [{"name": t.name, "bytes": t.bytes, "source": t.source}
                                          for t in pred.beside_states] or None,  # fmt: skip
        "predicted_breakdown_bytes": {"params": est.memory.params_bytes, "grads": est.memory.grads_bytes,
                                      "optimizer": est.memory.optimizer_bytes},  # fmt: skip
        "_checks": {"model_states_within_tolerance": abs(err) <= tolerance, "model_states_steady": got.steady},
    }


def _by_key(calls: list[list], ops: Optional[tuple[str, ...]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for op, phase, dtype, elements in calls:
        if ops is None or op in ops:
            out.setdefault(key(op, phase, dtype), []).append(elements)
    return out


def _collectives(pred: Prediction, got: Readings) -> dict:
    predicted = pred.estimate.collectives if pred.collectives is None else pred.collectives
    table: dict[str, dict] = {}
    per_call: dict[str, list[int]] = {}
    for c in predicted:
        k = key(c.op, c.phase, c.dtype)
        row = table.setdefault(k, {"elements": 0, "bytes_per_rank": 0})
        row["elements"] += c.elements
        row["bytes_per_rank"] += c.bytes_per_rank
        per_call.setdefault(k, []).append(c.elements)
    if pred.per_call:
        match = all(_by_key(s, pred.ops) == per_call for s in got.steps)
    else:
        want = {k: v["elements"] for k, v in table.items()}
        match = all({k: sum(v) for k, v in _by_key(s, pred.ops).items()} == want for s in got.steps)
    measured = observed_collectives(got.last_step, got.nd, got.group_sizes)
    covered = {k: v for k, v in measured.items() if pred.ops is None or k.split("|")[0] in pred.ops}
    pred_elements = sum(v["elements"] for v in table.values())
    measured_elements = sum(v["elements"] for v in covered.values())
    pred_comm = sum(v["bytes_per_rank"] for v in table.values())
    derived = sum(v["derived_bytes_per_rank"] or 0 for v in covered.values())
    return {
        "predicted_collective_elements": pred_elements,
        "measured_collective_elements": measured_elements,
        "collective_elements_rel_error": rel_error(measured_elements, pred_elements, pred_elements),
        "predicted_comm_bytes_per_rank": pred_comm,
        # the ring rule applied to each observed call: derived from the measurement, not measured
        "derived_comm_bytes_per_rank": derived,
        "derived_comm_rel_error": rel_error(derived, pred_comm, pred_comm),
        "predicted_collectives": table,
        "measured_collectives": measured,
        "measured_setup_collectives": observed_collectives(got.setup_calls, got.nd),
        # every call rank 0 issued in the last step, in order: [op, phase, dtype, elements]
        "observed_calls_last_step": got.last_step,
        "_checks": {"collectives_match": match},
    }


def _peaks(pred: Prediction, got: Readings, tolerance: float) -> dict:
    measured = got.peak_bytes_by_phase
    out = {"measured_peak_bytes": max(measured.values()), "measured_peak_bytes_by_phase": measured,
           "predicted_reserved_bytes_by_phase": pred.reserved_by_phase}  # fmt: skip
    peak = pred.estimate.peak
    predicted = pred.peak_by_phase or (peak.by_phase() if peak is not None else None)
    if predicted is None:
        return {**out, "predicted_peak_bytes_by_phase": None, "peak_rel_error": None, "predicted_peak_terms": None,
                "_checks": {"peak_within_tolerance": None}}  # fmt: skip
    errors = {p: rel_error(measured[p], predicted[p], measured[p]) for p in PEAK_PHASES if measured.get(p)}
    ranks = None
    if pred.peak_by_rank is not None and got.peak_by_rank is not None:
        errors, ranks = _errors_by_rank(pred.peak_by_rank, got.peak_by_rank)
    checked = [e for p, e in errors.items() if p not in got.unchecked_phases]
    worst = max(checked, key=abs) if checked else None
    return {
        **out,
        "predicted_peak_bytes_by_phase": predicted,
        "peak_rel_error_by_phase": errors,
        "peak_rel_error_rank_by_phase": ranks,
        "peak_rel_error": worst,
        "peak_unchecked_phases": got.unchecked_phases or None,
        "predicted_peak_phase": peak.peak_phase,
        "predicted_peak_terms": [{"name": t.name, "bytes": t.bytes, "source": t.source} for t in peak.peak_terms],
        "_checks": {"peak_within_tolerance": None if worst is None else abs(worst) <= tolerance},
    }


def _errors_by_rank(predicted: dict[int, dict[str, int]], measured: dict[int, dict[str, int]]
                    ) -> tuple[dict[str, float], dict[str, int]]:  # fmt: skip
    """Per phase, the error of the rank furthest from its own prediction, and that rank: a rank that holds
    more than predicted fails even where another rank's larger prediction covers it."""
    errors: dict[str, float] = {}
    ranks: dict[str, int] = {}
    for rank in sorted(measured):
        for p in PEAK_PHASES:
            m = measured[rank].get(p)
            if m:
                e = rel_error(m, predicted[rank][p], m)
                if p not in errors or abs(e) > abs(errors[p]):
                    errors[p], ranks[p] = e, rank
    return errors, ranks


def compare(pred: Prediction, got: Readings, tolerance: float, peak_tolerance: float) -> dict:
    """The report row's comparison fields and ``checks`` (parity left to the runner: ``finish``)."""
    parts = (_states(pred, got, tolerance), _collectives(pred, got), _peaks(pred, got, peak_tolerance))
    checks: dict = {}
    out: dict = {"stage": pred.estimate.stage, "engine_label": pred.estimate.label}
    for part in parts:
        checks.update(part.pop("_checks"))
        out.update(part)
    return {**out, "checks": checks}


def finish(row: dict, parity_ok: Optional[bool]) -> dict:
    """The row checked against ``validate.schema.ReportRow``, with the parity check and the verdict."""
    from validate.schema import ReportRow

    checks = {**row["checks"], "parity": parity_ok}
    # CUDA: the probe's max_memory_reserved per phase (validate/probes.py); CPU rows have none (null)
    row = {**row, "measured_reserved_bytes_by_phase": reserved_by_phase(row.get("probe_breakdown") or {})}
    return ReportRow.model_validate({**row, "checks": checks,
                                     "ok": all(v is not False for v in checks.values())}).model_dump()  # fmt: skip
