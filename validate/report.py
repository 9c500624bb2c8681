"""Prediction next to measurement, one row per (world size, stage), and the verdict.

Predictions come from ``zeroplan.estimate`` on the model's exact tensor sizes (from
``zeroplan.architectures.spec``, the planner's shape functions), with the runtime's precision: 16-bit parameters
and gradients (``ValidateConfig.param_dtype``, bf16 by default), fp32 master copy, Adam with fp32 m and v.
"""

from __future__ import annotations

from validate.config import ValidateConfig
from validate.models import expected_shapes, spec_for
from validate.schema import SCHEMA, ReportRow, ValidationReport
from zeroplan import estimate
from zeroplan.architectures.spec import TransformerSpec, numels
from zeroplan.engines.reference import predict_peak, reference_run
from zeroplan.formulas.collectives import ring_bytes_per_rank
from zeroplan.formulas.commtime import calls_per_optimizer_step
from zeroplan.formulas.dtypes import BYTES_PER_ELEMENT, canonical_dtype, dtype_bytes
from zeroplan.formulas.cuda_workspaces import library_workspaces
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES
from zeroplan.formulas.peak import PHASES as PEAK_PHASES
from zeroplan.render.table import format_table

RING_OPS = ("all-reduce", "reduce-scatter", "all-gather")
GLOO_NOTE = (
    "gloo runs a reduce-scatter as a full all-reduce followed by a local copy, so on the wire it sends "
    "twice the ring volume counted here (seen with --wire: gpt-tiny at N_d = 2 sends 1.06x the logical "
    "bytes at stage 0, 1.59x at stages 1-2 and 1.42x at stage 3, i.e. 1.5x and 1.34x of stage 0's "
    "ratio, as (2+1)/2 and (1+1+2)/3 predict); derived comm bytes are the logical ring bytes per rank "
    "((N_d-1)*ceil(n/N_d)*b per observed call, x2 for all-reduce), which is what NCCL's ring sends."
)


def _dtype(name: str) -> str:
    """The planner's name of a dtype (``bfloat16`` -> ``bf16``), or the name as observed if it has none."""
    try:
        return canonical_dtype(name)
    except ValueError:
        return name


def _key(op: str, phase: str, dtype: str) -> str:
    return f"{op}|{phase}|{_dtype(dtype)}"


def observed_collectives(calls: list[list], nd: int, group_sizes: list | None = None) -> dict[str, dict]:
    """Observed calls summed per (op, phase, dtype): ``calls`` and ``elements`` are counted at dispatch;
    ``derived_bytes_per_rank`` is the planner's ring rule applied to each call (derived, not measured;
    None for a collective the rule does not cover) over the call's group (``group_sizes``, in call order,
    as seen at dispatch; None or missing: ``nd``)."""
    out: dict[str, dict] = {}
    sizes = list(group_sizes or []) + [None] * len(calls)
    for (op, phase, dtype, elements), size in zip(calls, sizes):
        row = out.setdefault(_key(op, phase, dtype), {"calls": 0, "elements": 0, "derived_bytes_per_rank": 0})
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


def predicted_peak(config: ValidateConfig, meta: dict, stage: int, foreach: bool):
    """The reference profile's peak per phase for this row, or None for models it does not describe."""
    spec = spec_for(config.model_name, config.params)  # model_name: the default preset when none is given
    if not isinstance(spec, TransformerSpec):
        return None
    cuda = str(meta["device"]).startswith("cuda")
    seq = config.seq_len or spec.max_seq_len
    run = reference_run(spec, meta["world_size"], stage, config.batch_per_rank, seq, config.checkpointing,
                        foreach, stat_bytes=4 if cuda else 2, grad_accum=config.grad_accum)  # fmt: skip
    if not cuda:
        return predict_peak(run)
    resident = (library_workspaces(tuple(meta.get("cuda_capability", (9, 0))), spec.biased_linear),)
    return predict_peak(run, block_bytes=CUDA_BLOCK_BYTES, resident=resident)


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
    tensor_numels = numels(expected_shapes(spec_for(config.model_name, config.params)))
    predicted = estimate(tensor_numels=tensor_numels, gpus=nd, stage=stage, param_dtype=config.param_dtype).stages[0]
    pred_states = predicted.memory.model_states_bytes
    boundary = [r["boundary_bytes"] for r in rank_rows]
    measured_states = max(b[-1] for b in boundary)
    steady = all(len(set(b)) == 1 for b in boundary)
    states_err = (measured_states - pred_states) / pred_states

    # per optimizer step: a collective that runs every micro-step counts G times (commtime's one rule)
    calls = {c: calls_per_optimizer_step(stage, c.op, config.grad_accum) for c in predicted.collectives}
    pred_coll = {_key(c.op, c.phase, c.dtype): {"elements": c.elements * n,
                                                "bytes_per_rank": c.bytes_per_rank * n}
                 for c, n in calls.items()}  # fmt: skip
    # Measured: what was observed per call at dispatch, summed per (op, phase, dtype), every step of
    # every rank. It must equal the prediction in elements; bytes are only derived from it.
    steps = [observed_collectives(s, nd) for r in rank_rows for s in r["calls_by_step"][1:]]
    measured_coll = steps[-1]
    elements_of = lambda coll: {k: v["elements"] for k, v in coll.items()}
    collectives_match = all(elements_of(s) == elements_of(pred_coll) for s in steps)
    pred_elements = sum(v["elements"] for v in pred_coll.values())
    measured_elements = sum(v["elements"] for v in measured_coll.values())
    derived_comm = sum(v["derived_bytes_per_rank"] or 0 for v in measured_coll.values())
    pred_comm = sum(c.bytes_per_rank * n for c, n in calls.items())
    peaks = {
        p: max(r["peak_bytes_by_phase"][p] for r in rank_rows) for p in rank_rows[0]["peak_bytes_by_phase"]
    }
    peak = peak_rows(config, meta, stage, rank_rows)
    parities = [r["parity"] for r in rank_rows if r["parity"] is not None]
    parity_ok = all(p["ok"] for p in parities) if parities else None
    checks = {
        "model_states_within_tolerance": abs(states_err) <= config.tolerance,
        "model_states_steady": steady,
        "collectives_match": collectives_match,
        "peak_within_tolerance": None if peak["peak_rel_error"] is None
        else abs(peak["peak_rel_error"]) <= config.peak_tolerance,
        "parity": parity_ok,
    }
    return ReportRow.model_validate({
        "stage": stage,
        "world_size": nd,
        "mode": "simulated" if config.simulated else "real",
        "backend": meta["backend"],
        "device": meta["device"],
        "model": config.model_label,
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
        "predicted_collective_elements": pred_elements,
        "measured_collective_elements": measured_elements,
        "collective_elements_rel_error": (
            (measured_elements - pred_elements) / pred_elements if pred_elements else float(measured_elements != 0)
        ),
        "predicted_comm_bytes_per_rank": pred_comm,
        # the ring rule applied to each observed call: derived from the measurement, not measured
        "derived_comm_bytes_per_rank": derived_comm,
        "derived_comm_rel_error": (derived_comm - pred_comm) / pred_comm if pred_comm else float(derived_comm != 0),
        "predicted_collectives": pred_coll,
        "measured_collectives": measured_coll,
        # calls rank 0 issued while building the runtime (none predicted; reported, not checked)
        "measured_setup_collectives": observed_collectives(rank_rows[0]["calls_by_step"][0], nd),
        # every call rank 0 issued in the last step, in order: [op, phase, dtype, elements]
        "observed_calls_last_step": rank_rows[0]["calls_by_step"][-1],
        "measured_peak_bytes": max(peaks.values()),
        **peak,
        "checkpointing": config.checkpointing,
        "seq_len": config.seq_len,
        "micro_batch": config.batch_per_rank,
        "grad_accum": config.grad_accum,
        "foreach": rank_rows[0].get("foreach"),
        # the rank furthest from the reference (a failing rank if any)
        "parity": min(parities, key=lambda p: (p["ok"], -p["param_mean_abs_diff"])) if parities else None,
        "seconds": max(r["seconds"] for r in rank_rows),
        "step_time_s": {
            "probed": max(r["step_time_s"]["probed"] for r in rank_rows),
            "unprobed": max(r["step_time_s"]["unprobed"] for r in rank_rows),
            "unprobed_steps": rank_rows[0]["step_time_s"]["unprobed_steps"],
        },
        # --wire: bytes really sent on loopback per rank per step (rank 0's reading of the shared counter)
        "wire_bytes_per_rank": rank_rows[0].get("wire_bytes_per_rank"),
        # the profiler's backend-level communication events of the last step (real runs; rank 0)
        "profiler_comms": rank_rows[0].get("profiler_comms"),
        "wire_to_derived": (
            rank_rows[0]["wire_bytes_per_rank"] / derived_comm
            if rank_rows[0].get("wire_bytes_per_rank") is not None and derived_comm
            else None
        ),
        "checks": checks,
        "ok": all(v is not False for v in checks.values()),
    }).model_dump()


def build_report(config: ValidateConfig, worlds: list[tuple[dict, list[list[dict]]]]) -> dict:
    """The whole result: config, one row per (world size, stage), notes, overall ``ok``."""
    rows = []
    for meta, ranks in worlds:
        for i, stage in enumerate(config.stages):
            rows.append(compare(config, meta, stage, [rank_rows[i] for rank_rows in ranks]))
    notes = [GLOO_NOTE] if any(r["backend"] == "gloo" for r in rows) else []
    report = ValidationReport(
        schema_id=SCHEMA,
        config=config.model_dump(),
        torch=worlds[0][0].get("torch") if worlds else None,
        rows=rows,
        notes=notes,
        ok=all(r["ok"] for r in rows),
    )
    return report.model_dump(by_alias=True)


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
    cols = ["stage", "N_d", "mode", "backend", "states pred", "states meas", "err", "coll elems pred",
            "coll elems meas", "err", "comm/rank pred", "comm/rank derived", "peak init", "peak fwd",
            "peak bwd", "peak opt", "peak err", "parity", "ok"]  # fmt: skip
    wire = any(r.get("wire_bytes_per_rank") is not None for r in report["rows"])
    ds = any(r.get("deepspeed_estimator_bytes") is not None for r in report["rows"])
    if ds:  # DeepSpeed's own estimator beside zeroplan's: which was closer to the measured peak
        cols[-2:-2] = ["DS estimator", "DS est err"]
    if wire:
        cols[-2:-2] = ["wire/rank", "wire/derived"]
    lines = []
    for r in report["rows"]:
        p = r["measured_peak_bytes_by_phase"]
        parity = "-" if r["parity"] is None else ("ok" if r["checks"]["parity"] else "FAIL")
        lines.append([
            str(r["stage"]), str(r["world_size"]), r["mode"], r["backend"],
            _size(r["predicted_model_states_bytes"]), _size(r["measured_model_states_bytes"]),
            _pct(r["model_states_rel_error"]),
            f"{r['predicted_collective_elements']:,}", f"{r['measured_collective_elements']:,}",
            _pct(r["collective_elements_rel_error"]),
            _size(r["predicted_comm_bytes_per_rank"]), _size(r["derived_comm_bytes_per_rank"]),
            _size(p["init"]), _size(p["forward"]), _size(p["backward"]), _size(p["optimizer_step"]),
            "-" if r["peak_rel_error"] is None else _pct(r["peak_rel_error"]),
            parity, "yes" if r["ok"] else "NO",
        ])  # fmt: skip
        if ds:
            lines[-1][-2:-2] = [_size(r["deepspeed_estimator_bytes"]), _pct(r["deepspeed_estimator_rel_error"])]
        if wire:
            ratio = r.get("wire_to_derived")
            lines[-1][-2:-2] = [
                _size(r["wire_bytes_per_rank"] or 0),
                "-" if ratio is None else f"{ratio:.3f}x",
            ]
    first = report["rows"][0] if report["rows"] else {}
    dtype = report["config"]["param_dtype"]
    what = first.get("engine_label") or f"{dtype} params/grads, fp32 master + Adam m, v"
    out = [f"model {first.get('model')} (Ψ = {first.get('psi')}), {what}",
           *format_table([cols, *lines], left=4), ""]  # fmt: skip
    out.append(
        ("states: parameters, gradients and Adam's states live after the last backward (fsdp2 frees gradients "
         "at zero_grad)" if first.get("engine") == "fsdp2" else "states: model states live at the step boundary")
        + " (measured: every live tensor byte) vs zeroplan; "
        f"err = (measured - predicted) / predicted, tolerance {100 * report['config']['tolerance']:g}%. "
        "coll elems: elements of every collective per step (measured: each c10d call observed at dispatch; "
        "must equal the prediction per collective, phase and dtype, at every step). "
        "comm/rank: bytes one rank sends per step; derived = the ring rule applied to each observed call "
        "(a formula on the measurement, not a measurement: --wire measures bytes). "
        "peak: largest live bytes measured within each phase; peak err: largest (measured - predicted) / "
        f"measured over the phases (zeroplan.engines.{first.get('engine') or 'reference'}), tolerance {100 * report['config']['peak_tolerance']:g}%."
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
