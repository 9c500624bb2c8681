"""Every recorded measurement against today's prediction: every phase, every rank, at the row's own error.

``tests/data/measured/{reference,fsdp2,deepspeed}.json`` hold what the validator measured once on real
engines (the reference runtime, FSDP2 and DeepSpeed 0.19.8 on gloo, CPU; written by
``benchmarks/record_measured.py``, which names the date, the torch and DeepSpeed versions and the run's
whole configuration). Each record carries the inputs of the engine's ``estimate`` (the ``Workload``, the
engine's ``Settings``) and, per rank, the measured peak of each phase, the measured model states and the
prediction made when it was recorded. This module predicts again (pure planner: no torch, seconds) and
checks each (rank, phase) at a tolerance that says what was measured:

    |measured - predicted| <= |measured - predicted at recording| + margin

The margin of a recorded row is 0 B: the measurement on disk does not move, so a prediction may come
closer to it (always passes) but not go further by a single byte without the row being re-recorded on
purpose. A live run (tests/test_deepspeed_*.py, test_fsdp2_engine.py, test_validate_runs.py) measures again,
so ``live_peak_misses`` allows max(LIVE_MARGIN_BYTES = 64 B, LIVE_MARGIN_REL = 0.05%) on top of the same
row's recorded error: the runs are deterministic to the byte where measured twice (FSDP2 gpt-tiny fp32
N_d = 2 reads 177,336 / 522,816 / 572,360 / 312,016 B as in docs/engines/fsdp2.md; DeepSpeed's ZeRO-1/2
optimizer step +260 or +264 B over 13 worlds, docs/engines/deepspeed-history.md), and 64 B is smaller than every
term but the scalars (loss, Adam's step, DeepSpeed's grad norm and overflow flags: 1-16 B; listed by
``benchmarks/term_removal.py``), where the 2-3% of before was up to 30 KiB of a 1 MiB peak. Model states: the same rule. Collectives: the elements of every (op, phase, dtype) of one
steady-state step equal the measured ones wherever they did at recording. ``benchmarks/term_removal.py``
drops each named term of each engine in turn and runs ``check_record`` on every row: the counts caught
before and after are in docs/benchmarks.md.

Re-record (``benchmarks/record_measured.py``) when a profile changes on purpose and its error grows.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from zeroplan.architectures.spec import TransformerSpec
from zeroplan.engines import get_engine
from zeroplan.engines.base import Workload
from zeroplan.formulas.dtypes import canonical_dtype
from zeroplan.formulas.peak import PHASES

MEASURED = Path(__file__).resolve().parent / "data" / "measured"
ENGINE_NAMES = ("reference", "fsdp2", "deepspeed")
RECORDED_MARGIN_BYTES = 0
LIVE_MARGIN_BYTES = 64
LIVE_MARGIN_REL = 0.0005


def live_margin(measured: int) -> float:
    """The stated slack of a live run on top of its row's recorded error (module docstring)."""
    return max(LIVE_MARGIN_BYTES, LIVE_MARGIN_REL * measured)


# ---- records <-> planner inputs (JSON, no torch) ----


def workload_json(w: Workload) -> dict:
    """A ``Workload`` as JSON: every field, the spec as its dataclass fields."""
    return {
        "shapes": [[n, list(s)] for n, s in w.shapes], "spec": dataclasses.asdict(w.spec),
        "seq_len": w.seq_len, "micro_batch": w.micro_batch, "checkpointing": w.checkpointing,
        "grad_accum": w.grad_accum, "foreach": w.foreach, "transformers": w.transformers,
    }  # fmt: skip


def workload_from(d: dict) -> Workload:
    """The ``Workload`` a record's ``workload`` describes."""
    shapes = tuple((n, tuple(s)) for n, s in d["shapes"])
    rest = {k: v for k, v in d.items() if k not in ("shapes", "spec")}
    spec = {k: tuple(v) if isinstance(v, list) else v for k, v in d["spec"].items()}  # JSON lists: the spec's tuples
    return Workload(shapes, TransformerSpec(**spec), **rest)


def settings_of(record: dict):
    """The engine's ``Settings`` of a record (DeepSpeed: read from its ds_config as the validator reads it)."""
    engine = get_engine(record["engine"])
    if record["engine"] == "deepspeed":
        # "machine": what the ds_config does not say (qgZ's devices per node: the CPU accelerator's device_count)
        settings = engine.settings.from_ds_config(record["ds_config"], zero_init=record["zero_init"])
        return settings.model_copy(update=record.get("machine", {}))
    return engine.settings.model_validate(record["settings"])


def estimate_of(record: dict, rank: int):
    """The engine's ``EngineEstimate`` for ``rank`` of the record (FSDP2's and DeepSpeed's profiles are per
    rank; the reference runtime's ranks are alike)."""
    engine = get_engine(record["engine"])
    settings = settings_of(record)
    if record["engine"] in ("fsdp2", "deepspeed"):
        settings = settings.model_copy(update={"rank": rank})
    (row,) = engine.estimate(workload_from(record["workload"]), record["nd"], settings, **record.get("estimate_kwargs", {}))
    return row


DTYPE_ALIASES = {"float64": "fp64", "int8": "int8", "uint8": "uint8"}
"""torch's names of the dtypes the planner's ``canonical_dtype`` has no entry for (DeepSpeed's fp64
norm all-reduce, its int8 overflow flag)."""


def dtype_name(name: str) -> str:
    """The planner's name of a collective's dtype, whether torch's (``float32``) or the planner's (``fp32``)."""
    try:
        return canonical_dtype(name)
    except ValueError:
        return DTYPE_ALIASES.get(name, name)


def predicted_collectives(record: dict, row) -> dict[str, int]:
    """Elements per ``op|phase|dtype`` of one optimizer step: every engine's rows count one optimizer step
    (``EngineEstimate.collectives``; a collective that runs every micro-step is summed over them)."""
    out: dict[str, int] = {}
    for c in row.collectives:
        key = f"{c.op}|{c.phase.replace(' ', '_')}|{dtype_name(c.dtype)}"
        out[key] = out.get(key, 0) + c.elements
    return out


def predict(record: dict) -> list[dict]:
    """Per measured rank: the predicted peak of each phase, model states and collectives."""
    out = []
    for r in record["ranks"]:
        row = estimate_of(record, r["rank"])
        out.append({"rank": r["rank"], "peak_bytes_by_phase": row.peak.by_phase(),
                    "model_states_bytes": row.model_states_bytes,
                    "collectives": predicted_collectives(record, row)})  # fmt: skip
    return out


# ---- the check (the test and benchmarks/term_removal.py run this one function) ----


def _within(what: str, measured: int, predicted: int, recorded: int, margin: float = RECORDED_MARGIN_BYTES) -> list[str]:
    allowed = abs(measured - recorded) + margin
    if abs(measured - predicted) <= allowed:
        return []
    return [f"{what}: measured {measured:,} predicted {predicted:,} (recorded {recorded:,}; "
            f"|error| {abs(measured - predicted):,} > {allowed:,.0f} allowed)"]  # fmt: skip


def check_record(record: dict, predicted: list[dict] | None = None) -> list[str]:
    """Every way today's prediction of ``record`` is further from the measurement than recorded (empty: ok)."""
    predicted = predict(record) if predicted is None else predicted
    misses: list[str] = []
    unchecked = set(record.get("unchecked_phases", ()))
    for r, p in zip(record["ranks"], predicted):
        where = f"{record['name']} rank {r['rank']}"
        for phase in PHASES:
            if phase not in unchecked:
                misses += _within(f"{where} {phase}", r["measured_peak_bytes_by_phase"][phase],
                                  p["peak_bytes_by_phase"][phase], r["predicted_peak_bytes_by_phase"][phase])  # fmt: skip
        misses += _within(f"{where} model states", r["measured_model_states_bytes"], p["model_states_bytes"],
                          r["predicted_model_states_bytes"])  # fmt: skip
        coll = record["collectives"]
        if coll["matched_at_recording"] and p["collectives"] != coll["measured"]:
            misses.append(f"{where} collectives: predicted {p['collectives']} measured {coll['measured']}")
    return misses


def load(engine: str) -> dict:
    return json.loads((MEASURED / f"{engine}.json").read_text())


def records() -> list[dict]:
    """Every recorded row (test_every_engine_has_records_and_provenance: every engine has a file)."""
    return [row for e in ENGINE_NAMES if (MEASURED / f"{e}.json").exists() for row in load(e)["rows"]]


RECORDS: list[dict] = records()


# ---- the live tests' tolerance: the same rule on a fresh run, against the same row's recorded error ----


def recorded_peak_error(name: str) -> dict[str, int]:
    """measured - predicted per phase of the recorded row ``name``, each the largest over ranks: what a live
    row (``measured_peak_bytes_by_phase``, ``predicted_peak_bytes_by_phase``) compares."""
    (record,) = [r for r in RECORDS if r["name"] == name]
    top = lambda key, p: max(r[key][p] for r in record["ranks"])
    return {p: top("measured_peak_bytes_by_phase", p) - top("predicted_peak_bytes_by_phase", p) for p in PHASES}


def recorded_states_error(name: str) -> int:
    """measured - predicted model states of the recorded row ``name``, the largest over ranks each."""
    (record,) = [r for r in RECORDS if r["name"] == name]
    top = lambda key: max(r[key] for r in record["ranks"])
    return top("measured_model_states_bytes") - top("predicted_model_states_bytes")


def live_peak_misses(name: str, measured: dict, predicted: dict, unchecked=()) -> list[str]:
    """Phases of a live row further from their measurement than the recorded row ``name`` was, beyond the
    live margin: |measured - predicted| <= |recorded error| + max(64 B, 0.05% of measured)."""
    recorded = recorded_peak_error(name)
    return [m for p in PHASES if p not in unchecked
            for m in _within(f"{name} {p}", measured[p], predicted[p], measured[p] - recorded[p],
                             live_margin(measured[p]))]  # fmt: skip


@pytest.mark.parametrize("record", RECORDS, ids=[r["name"] for r in RECORDS])
def test_prediction_within_recorded_error(record):
    assert check_record(record) == []


def test_every_engine_has_records_and_provenance():
    for e in ENGINE_NAMES:
        data = load(e)
        assert data["engine"] == e and data["torch"] and data["recorded"] and data["rows"]
        assert all(row["engine"] == e and row["ranks"] for row in data["rows"])
        assert all(row["collectives"]["matched_at_recording"] for row in data["rows"])  # every row, today
    assert load("deepspeed")["deepspeed"] == "0.19.8"


def test_a_dropped_term_fails_the_check():
    """The check can fail: one record's prediction less its largest term of the peak phase is caught."""
    record = next(r for r in RECORDS if r["engine"] == "reference")
    predicted = predict(record)
    row = estimate_of(record, record["ranks"][0]["rank"])
    phase = row.peak.peak_phase
    largest = max(next(p for p in row.peak.phases if p.phase == phase).terms, key=lambda t: t.bytes)
    predicted[0]["peak_bytes_by_phase"][phase] -= largest.bytes
    assert any(f"{phase}:" in m for m in check_record(record, predicted))

