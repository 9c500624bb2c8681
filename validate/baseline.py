"""``zeroplan validate --baseline OLD.json``: a new result against an earlier one, for a user's CI.

A row of the new report is matched with the baseline's row of the same engine, model, world size, mode,
ZeRO stage (FSDP2: 3 when resharding, 2 when not), engine configuration and checkpointing. For each
matched row the predicted and the measured figures may move by at most ``tolerance`` (relative to the
baseline): model states, the peak of every phase, collective elements. A row of the baseline with no
match in the new report is drift too (a configuration no longer run). No torch: reads two reports.
"""

from __future__ import annotations

from validate.schema import ValidationReport
from zeroplan.files import read_json

DEFAULT_DRIFT_TOLERANCE = 0.005
"""0.5%: a sixth of the 3% peak tolerance, far above the run-to-run spread of these figures (0 on CPU:
every byte is counted), so a change in torch, in the model or in zeroplan shows, noise does not."""

FIGURES = ("predicted_model_states_bytes", "measured_model_states_bytes", "predicted_collective_elements",
           "measured_collective_elements")  # fmt: skip


def read_baseline(path: str) -> dict:
    """The earlier report (schema ``zeroplan.validate/2``); ValueError naming the file if it is not one."""
    data = read_json(path, "--baseline")
    try:
        report = ValidationReport.model_validate(data).model_dump(by_alias=True)
    except ValueError as exc:
        first = str(exc).splitlines()[1:2]
        raise ValueError(f"--baseline {path!r}: not a zeroplan validate --json report ({' '.join(first).strip()})") from None
    if not report["rows"]:  # "no figure moved" would be said having compared nothing
        raise ValueError(f"--baseline {path!r}: has no rows, so nothing could be compared; give the --json report "
                         "of a run that measured at least one configuration")
    return report


def row_key(row: dict) -> tuple:
    """What makes two rows the same configuration."""
    return (row.get("engine", "reference"), row["model"], row["world_size"], row["mode"], row["stage"],
            row.get("engine_label"), row["checkpointing"], row["micro_batch"], row["seq_len"],
            row.get("grad_accum", 1))  # fmt: skip


def _moved(new: int, old: int) -> float:
    return (new - old) / old if old else float(new != old)


def drift(report: dict, baseline: dict, tolerance: float = DEFAULT_DRIFT_TOLERANCE) -> list[str]:
    """One line per figure that moved beyond ``tolerance`` (or row that disappeared); empty: no drift."""
    rows = {row_key(r): r for r in report["rows"]}
    out = []
    for old in baseline["rows"]:
        what = old.get("engine_label") or f"stage {old['stage']}"
        key, label = row_key(old), f"{old['model']} N_d={old['world_size']} {what}"
        new = rows.get(key)
        if new is None:
            out.append(f"{label}: in the baseline, not in this run")
            continue
        figures = {f: (new[f], old[f]) for f in FIGURES}
        for side in ("predicted", "measured"):
            for phase, value in (old.get(f"{side}_peak_bytes_by_phase") or {}).items():
                figures[f"{side} peak {phase}"] = ((new.get(f"{side}_peak_bytes_by_phase") or {}).get(phase, 0), value)
        for name, (now, before) in figures.items():
            if abs(_moved(now, before)) > tolerance:
                out.append(f"{label}: {name} {before:,} -> {now:,} ({100 * _moved(now, before):+.2f}%)")
    return out


def with_drift(report: dict, baseline: dict, tolerance: float) -> dict:
    """``report`` with its drift against ``baseline`` recorded (``baseline_drift``) and ``ok`` false on drift."""
    lines = drift(report, baseline, tolerance)
    return {**report, "baseline_drift": {"tolerance": tolerance, "lines": lines}, "ok": report["ok"] and not lines}
