"""Prediction next to measurement, one row per (world size, stage), and the verdict.

Predictions come from ``zeroplan.estimate`` on the model's exact tensor sizes (from
``zeroplan.models``, the planner's shape functions), with the runtime's precision: bf16 parameters and
gradients, fp32 master copy, Adam with fp32 m and v.
"""

from __future__ import annotations

from validate.config import ValidateConfig
from validate.models import expected_shapes, spec_for
from zeroplan import estimate
from zeroplan.dtypes import canonical_dtype
from zeroplan.engines.reference import predict_peak, reference_run
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES
from zeroplan.formulas.peak import PHASES as PEAK_PHASES
from zeroplan.models import TransformerSpec, numels

SCHEMA = "zeroplan.validate/1"
GLOO_NOTE = (
    "gloo runs a reduce-scatter as a full all-reduce followed by a local copy, so on the wire it sends "
    "twice the ring volume counted here (seen with --wire: gpt-tiny at N_d = 2 sends 1.06x the logical "
    "bytes at stage 0, 1.59x at stages 1-2 and 1.42x at stage 3, i.e. 1.5x and 1.34x of stage 0's "
    "ratio, as (2+1)/2 and (1+1+2)/3 predict); comm bytes are the logical ring bytes per rank "
    "((N_d-1)*ceil(n/N_d)*b per call, x2 for all-reduce), which is what NCCL's ring sends."
)


def _key(op: str, phase: str, dtype: str) -> str:
    return f"{op}|{phase}|{canonical_dtype(dtype)}"


def _collectives_of_step(step: dict) -> dict:
    return {_key(*k.split("|")): v for k, v in step.items()}


def predicted_peak(config: ValidateConfig, meta: dict, stage: int, foreach: bool):
    """The reference profile's peak per phase for this row, or None for models it does not describe."""
    spec = spec_for(config.model, config.params)
    if not isinstance(spec, TransformerSpec):
        return None
    cuda = str(meta["device"]).startswith("cuda")
    seq = config.seq_len or spec.max_seq_len
    run = reference_run(spec, meta["world_size"], stage, config.batch_per_rank, seq, config.checkpointing,
                        foreach, stat_bytes=4 if cuda else 2)  # fmt: skip
    return predict_peak(run, block_bytes=CUDA_BLOCK_BYTES if cuda else 1)


def peak_rows(config: ValidateConfig, meta: dict, stage: int, rank_rows: list[dict]) -> dict:
    """Predicted and measured peak per phase (keys of ``zeroplan.formulas.peak.PHASES``) and the largest error."""
    measured = {p.replace(" ", "_"): max(r["peak_bytes_by_phase"][p] for r in rank_rows)
                for p in rank_rows[0]["peak_bytes_by_phase"]}  # fmt: skip
    foreach = rank_rows[0].get("foreach", config.foreach)  # rows of older workers lack it
    estimate_ = predicted_peak(config, meta, stage, bool(foreach))
    if estimate_ is None:
        return {"predicted_peak_bytes_by_phase": None, "measured_peak_bytes_by_phase": measured,
                "peak_rel_error": None, "predicted_peak_terms": None}  # fmt: skip
    predicted = estimate_.by_phase()
    errors = {p: (measured[p] - predicted[p]) / measured[p] for p in PEAK_PHASES if measured.get(p)}
    return {
        "predicted_peak_bytes_by_phase": predicted,
        "measured_peak_bytes_by_phase": measured,
        "peak_rel_error_by_phase": errors,
        "peak_rel_error": max(errors.values(), key=abs),
        "predicted_peak_phase": estimate_.peak_phase,
        "predicted_peak_terms": [{"name": t.name, "bytes": t.bytes, "source": t.source} for t in estimate_.peak_terms],
    }


def compare(config: ValidateConfig, meta: dict, stage: int, rank_rows: list[dict]) -> dict:
    """The JSON row of one stage at one world size, from every rank's measurements."""
    nd = meta["world_size"]
    tensor_numels = numels(expected_shapes(spec_for(config.model, config.params)))
    predicted = estimate(tensor_numels=tensor_numels, gpus=nd, stage=stage, param_dtype="bf16").stages[0]
    pred_states = predicted.memory.model_states_bytes
    boundary = [r["boundary_bytes"] for r in rank_rows]
    measured_states = max(b[-1] for b in boundary)
    steady = all(len(set(b)) == 1 for b in boundary)
    states_err = (measured_states - pred_states) / pred_states

    pred_coll = {_key(c.op, c.phase, c.dtype): {"elements": c.elements, "bytes_per_rank": c.bytes_per_rank}
                 for c in predicted.collectives}  # fmt: skip
    steps = [_collectives_of_step(s) for r in rank_rows for s in r["comm_by_step"]]
    measured_coll = steps[-1]
    same_every_step = all(s == measured_coll for s in steps)
    comm_exact = (
        same_every_step
        and set(measured_coll) == set(pred_coll)
        and all(
            measured_coll[k]["elements"] == v["elements"]
            and measured_coll[k]["bytes_per_rank"] == v["bytes_per_rank"]
            for k, v in pred_coll.items()
        )
    )
    measured_comm = sum(v["bytes_per_rank"] or 0 for v in measured_coll.values())
    pred_comm = predicted.comm_bytes_per_rank
    peaks = {
        p: max(r["peak_bytes_by_phase"][p] for r in rank_rows) for p in rank_rows[0]["peak_bytes_by_phase"]
    }
    peak = peak_rows(config, meta, stage, rank_rows)
    parities = [r["parity"] for r in rank_rows if r["parity"] is not None]
    parity_ok = all(p["ok"] for p in parities) if parities else None
    checks = {
        "model_states_within_tolerance": abs(states_err) <= config.tolerance,
        "model_states_steady": steady,
        "comm_exact": comm_exact,
        "peak_within_tolerance": None if peak["peak_rel_error"] is None
        else abs(peak["peak_rel_error"]) <= config.peak_tolerance,
        "parity": parity_ok,
    }
    return {
        "stage": stage,
        "world_size": nd,
        "mode": "simulated" if config.simulated else "real",
        "backend": meta["backend"],
        "device": meta["device"],
        "model": config.model if config.params is None else f"gpt~{config.params:g}",
        "psi": sum(tensor_numels),
        "predicted_model_states_bytes": pred_states,
        "measured_model_states_bytes": measured_states,
        "model_states_rel_error": states_err,
        "model_states_extra_bytes": measured_states - pred_states,
        "adam_step_bytes": max(r["adam_step_bytes"] for r in rank_rows),
        "predicted_breakdown_bytes": {
            "params": predicted.memory.params_bytes,
            "grads": predicted.memory.grads_bytes,
            "optimizer": predicted.memory.optimizer_bytes,
        },
        # CPU: MemTracker's own categories (bytes); CUDA: allocator counters (memory_stats)
        "probe_breakdown": rank_rows[0]["probe_breakdown"],
        "predicted_comm_bytes_per_rank": pred_comm,
        "measured_comm_bytes_per_rank": measured_comm,
        "comm_rel_error": (measured_comm - pred_comm) / pred_comm if pred_comm else float(measured_comm != 0),
        "predicted_collectives": pred_coll,
        "measured_collectives": measured_coll,
        "measured_peak_bytes": max(peaks.values()),
        **peak,
        "checkpointing": config.checkpointing,
        "seq_len": config.seq_len,
        "micro_batch": config.batch_per_rank,
        "foreach": rank_rows[0].get("foreach"),
        # the rank furthest from the reference (a failing rank if any)
        "parity": min(parities, key=lambda p: (p["ok"], -p["param_mean_abs_diff"])) if parities else None,
        "seconds": max(r["seconds"] for r in rank_rows),
        # --wire: bytes really sent on loopback per rank per step (rank 0's reading of the shared counter)
        "wire_bytes_per_rank": rank_rows[0].get("wire_bytes_per_rank"),
        # the profiler's backend-level communication events of the last step (real runs; rank 0)
        "profiler_comms": rank_rows[0].get("profiler_comms"),
        "wire_to_logical": (
            rank_rows[0]["wire_bytes_per_rank"] / measured_comm
            if rank_rows[0].get("wire_bytes_per_rank") is not None and measured_comm
            else None
        ),
        "checks": checks,
        "ok": all(v is not False for v in checks.values()),
    }


def build_report(config: ValidateConfig, worlds: list[tuple[dict, list[list[dict]]]]) -> dict:
    """The whole result: config, one row per (world size, stage), notes, overall ``ok``."""
    rows = []
    for meta, ranks in worlds:
        for i, stage in enumerate(config.stages):
            rows.append(compare(config, meta, stage, [rank_rows[i] for rank_rows in ranks]))
    notes = [GLOO_NOTE] if any(r["backend"] == "gloo" for r in rows) else []
    return {
        "schema": SCHEMA,
        "config": config.model_dump(),
        "torch": worlds[0][0].get("torch") if worlds else None,
        "rows": rows,
        "notes": notes,
        "ok": all(r["ok"] for r in rows),
    }


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, four significant digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:g} B"


def _pct(x: float) -> str:
    return f"{100 * x:+.3f}%"


def to_table(report: dict) -> str:
    """Predicted vs measured per row, with relative errors."""
    cols = ["stage", "N_d", "mode", "backend", "states pred", "states meas", "err", "comm/rank pred",
            "comm/rank meas", "err", "peak init", "peak fwd", "peak bwd", "peak opt", "peak err", "parity", "ok"]  # fmt: skip
    wire = any(r.get("wire_bytes_per_rank") is not None for r in report["rows"])
    if wire:
        cols[-2:-2] = ["wire/rank", "wire/comm"]
    lines = []
    for r in report["rows"]:
        p = r["measured_peak_bytes_by_phase"]
        parity = "-" if r["parity"] is None else ("ok" if r["checks"]["parity"] else "FAIL")
        lines.append([
            str(r["stage"]), str(r["world_size"]), r["mode"], r["backend"],
            _size(r["predicted_model_states_bytes"]), _size(r["measured_model_states_bytes"]),
            _pct(r["model_states_rel_error"]),
            _size(r["predicted_comm_bytes_per_rank"]), _size(r["measured_comm_bytes_per_rank"]),
            _pct(r["comm_rel_error"]),
            _size(p["init"]), _size(p["forward"]), _size(p["backward"]), _size(p["optimizer_step"]),
            "-" if r["peak_rel_error"] is None else _pct(r["peak_rel_error"]),
            parity, "yes" if r["ok"] else "NO",
        ])  # fmt: skip
        if wire:
            ratio = r.get("wire_to_logical")
            lines[-1][-2:-2] = [
                _size(r["wire_bytes_per_rank"] or 0),
                "-" if ratio is None else f"{ratio:.3f}x",
            ]
    widths = [max(len(x[i]) for x in [cols, *lines]) for i in range(len(cols))]
    fmt = lambda row: "  ".join(
        c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
    )
    first = report["rows"][0] if report["rows"] else {}
    out = [f"model {first.get('model')} (Ψ = {first.get('psi')}), bf16 params/grads, fp32 master + Adam m, v",
           fmt(cols), fmt(["-" * w for w in widths]), *map(fmt, lines), ""]  # fmt: skip
    out.append(
        f"states: model states live at the step boundary (measured: every live tensor byte) vs zeroplan; "
        f"err = (measured - predicted) / predicted, tolerance {100 * report['config']['tolerance']:g}%. "
        "comm: bytes one rank sends per step, ring rule, counted from the c10d calls. "
        "peak: largest live bytes measured within each phase; peak err: largest (measured - predicted) / "
        f"measured over the phases (zeroplan.engines.reference), tolerance {100 * report['config']['peak_tolerance']:g}%."
    )
    if wire:
        out.append(
            "wire/rank: bytes really sent on loopback per rank per step (--wire: the ranks run alone in a "
            "network namespace; /proc/net/dev, TCP/IP headers, ACKs and two barriers included)."
        )
    out += report["notes"]
    bad = [f"stage {r['stage']} N_d={r['world_size']}: " + ", ".join(k for k, v in r["checks"].items() if v is False)
           for r in report["rows"] if not r["ok"]]  # fmt: skip
    out.append("all rows within tolerance" if report["ok"] else "OUT OF TOLERANCE: " + "; ".join(bad))
    return "\n".join(out)
