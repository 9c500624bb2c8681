"""Prediction next to measurement, one row per (world size, stage), and the verdict.

Predictions come from ``zeroplan.engines.reference`` on the parameters the ranks built (their
``named_parameters()`` shapes, recorded by ``validate.worker``), with the runtime's precision: 16-bit
parameters and gradients (``ValidateConfig.param_dtype``, bf16 by default), fp32 master copy, Adam with
fp32 m and v. The comparison itself is ``validate.compare``'s, shared with the other engines' runners.
"""

from __future__ import annotations

import math

from validate.compare import Prediction, Readings, finish
from validate.compare import compare as compare_rows
from validate.compare import key as _key  # noqa: F401 - the runners' and tests' name for it
from validate.compare import observed_collectives  # noqa: F401 - re-exported: its home is validate.compare
from validate.compare import GLOO_NOTE
from validate.config import ValidateConfig
from validate.models import expected_shapes, spec_for
from validate.schema import SCHEMA, ValidationReport
from zeroplan.architectures.spec import TransformerSpec, transformer_shapes
from zeroplan.engines.base import EngineEstimate, PlannerOptions, Workload
from zeroplan.engines import get_engine
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES
from zeroplan.policy import PrecisionPolicy
from zeroplan.render.table import format_table

RUNNER_CHANGES = (
    "one intra-op thread per rank (OMP_NUM_THREADS=1, validate.harness)",
    "after each backward and at each step boundary the probe waits until gloo has let go of the last "
    "collective's buffer before reading (MemoryProbe.settled_bytes: timing only)",
)
"""What the runner does to the runtime it measures, beyond the probes (the reference runtime is the
validator's own: its collectives are synchronous as written, validate/collectives.py)."""


def reference_estimate(config: ValidateConfig, meta: dict, stage: int, shapes, foreach: bool) -> EngineEstimate:
    """``zeroplan.engines.reference``'s row for this run, from the parameters the ranks built (``shapes``: the
    model's ``named_parameters()``, ``zeroplan.architectures.module_shapes``). The peak profile sizes its units
    from those shapes (``reference_run`` reads ``Workload.shapes``), so it speaks for any model whose tensors
    are the architecture's (the same names, in ``named_parameters()`` order) and whose run its peak model covers
    (``Engine.peak_limits``: no dropout, the runtime's policy): otherwise no peak."""
    spec = spec_for(config.model_name, config.params)  # model_name: the default preset when none is given
    shapes = tuple((name, tuple(shape)) for name, shape in shapes)
    reference, policy = get_engine("reference"), PrecisionPolicy(param_dtype=config.param_dtype)
    peak_spec = (
        spec if isinstance(spec, TransformerSpec) and [n for n, _ in transformer_shapes(spec)] == [n for n, _ in shapes]
        and reference.peak_limits(PlannerOptions(policy=policy), spec, config.checkpointing) is None else None
    )  # fmt: skip
    cuda = str(meta["device"]).startswith("cuda")
    seq = (config.seq_len or spec.max_seq_len) if peak_spec is not None else 1
    workload = Workload(shapes, peak_spec, seq, config.batch_per_rank, config.checkpointing, config.grad_accum, foreach)
    settings = reference.settings(stages=(stage,), policy=policy,
                        block_bytes=CUDA_BLOCK_BYTES if cuda else 1, stat_bytes=4 if cuda else 2,
                        cuda_capability=tuple(meta.get("cuda_capability", (9, 0))) if cuda else None,
                        backend="fake" if config.simulated else "nccl" if cuda else "gloo",
                        amsgrad=config.amsgrad)  # fmt: skip
    (row,) = reference.estimate(workload, meta["world_size"], settings)
    return row


def predicted_peak(config: ValidateConfig, meta: dict, stage: int, foreach: bool):
    """The reference profile's peak per phase for the model ``config`` builds, or None where it has none."""
    shapes = expected_shapes(spec_for(config.model_name, config.params))
    return reference_estimate(config, meta, stage, shapes, foreach).peak


def compare(config: ValidateConfig, meta: dict, stage: int, rank_rows: list[dict]) -> dict:
    """The JSON row of one stage at one world size, from every rank's measurements."""
    nd = meta["world_size"]
    foreach = rank_rows[0].get("foreach", config.foreach)  # rows of older workers lack it
    predicted = reference_estimate(config, meta, stage, rank_rows[0]["param_shapes"], bool(foreach))
    boundary = [r["boundary_bytes"] for r in rank_rows]
    phases = rank_rows[0]["peak_bytes_by_phase"]
    readings = Readings(
        states_bytes=max(b[-1] for b in boundary),
        steady=all(len(set(b)) == 1 for b in boundary),
        peak_bytes_by_phase={p.replace(" ", "_"): max(r["peak_bytes_by_phase"][p] for r in rank_rows) for p in phases},
        # every step of every rank must match; the first list holds the calls made while building the runtime
        steps=[s for r in rank_rows for s in r["calls_by_step"][1:]],
        last_step=rank_rows[0]["calls_by_step"][-1],
        setup_calls=rank_rows[0]["calls_by_step"][0],
        nd=nd,
    )
    row = compare_rows(Prediction(predicted), readings, config.tolerance, config.peak_tolerance)
    parities = [r["parity"] for r in rank_rows if r["parity"] is not None]
    return finish({
        **row,
        "world_size": nd,
        "mode": "simulated" if config.simulated else "real",
        "backend": meta["backend"],
        "device": meta["device"],
        "model": config.model_label,
        "psi": sum(math.prod(s) for _, s in rank_rows[0]["param_shapes"]),
        "engine_label": None,
        "runner_changes": list(RUNNER_CHANGES),
        "adam_step_bytes": max(r["adam_step_bytes"] for r in rank_rows),
        # CPU: MemTracker's own categories (bytes); CUDA: allocator counters (memory_stats)
        "probe_breakdown": rank_rows[0]["probe_breakdown"],
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
            rank_rows[0]["wire_bytes_per_rank"] / row["derived_comm_bytes_per_rank"]
            if rank_rows[0].get("wire_bytes_per_rank") is not None and row["derived_comm_bytes_per_rank"]
            else None
        ),
    }, all(p["ok"] for p in parities) if parities else None)


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


def _runner(engine: object):
    """The validator's runner of a report's engine (``Engine.runner``); None for one not registered (an old file)."""
    from validate.config import runner_of

    try:
        return runner_of(get_engine(engine or "reference"))
    except ValueError:
        return None


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
    max_v = ", max v (amsgrad)" if report["config"].get("amsgrad") else ""
    what = first.get("engine_label") or f"{dtype} params/grads, fp32 master + Adam m, v{max_v}"
    out = [f"model {first.get('model')} (Ψ = {first.get('psi')}), {what}",
           *format_table([cols, *lines], left=4), ""]  # fmt: skip
    out.append(
        f"states: {getattr(_runner(first.get('engine')), 'STATES', 'model states live at the step boundary')}"
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
    changes = list(dict.fromkeys(c for r in report["rows"] for c in r.get("runner_changes") or []))
    if changes:
        out.append("runner changes (what the runner does to the engine it measures, beyond the probes; each "
                   "row's runner_changes): " + "; ".join(changes) + ".")  # fmt: skip
    out += report["notes"]
    bad = [f"stage {r['stage']} N_d={r['world_size']}: " + ", ".join(k for k, v in r["checks"].items() if v is False)
           for r in report["rows"] if not r["ok"]]  # fmt: skip
    out.append("all rows within tolerance" if report["ok"] else "OUT OF TOLERANCE: " + "; ".join(bad))
    return "\n".join(out)
