"""The parent's side of the tensor-parallel runner (``validate.engines.fsdp2_tp``) under ``zeroplan validate
--engine fsdp2 --tp T``: every rank's prediction (``zeroplan.engines.fsdp2`` with ``tp``, on the mesh
(R x) S x T), compared through ``validate.compare`` into the same report rows as FSDP2's runner.

Collectives per group: each observed call carries the mesh dimension of its process group (the runner
matches its ranks to this rank's ``tp``, ``dp_shard`` and ``dp_replicate`` groups), and each predicted one
its ``mesh_dim``; both are keyed ``op|phase [dim]|dtype``, so a TP all-reduce can never stand in for an HSDP
one, and matched call by call in issue order within each key, at every steady step of every rank.
"""

from __future__ import annotations

from dataclasses import replace

TP_RUNNER_CHANGES = (
    "one intra-op thread per rank (OMP_NUM_THREADS=1, validate.harness)",
    "each collective returns only once gloo's worker thread has let its tensors go (DTensor's functional ones "
    "waited where issued; validate/engines/fsdp2_gloo_release.py): each free counted before the rank's next op",
    "CausalLM's head called as the module lm_head (tp_forward) so ColwiseParallel's hooks run; the loss under "
    "loss_parallel(), or without it the plain loss on the all-gathered logits (validate/engines/fsdp2_tp.py)",
    "no parity check: the TP runner does not train a single-process reference",
)
"""What the TP runner changes in what it measures, beyond the probes (``ReportRow.runner_changes``)."""
HF_PLAN_CHANGE = ("transformers' tp_plan (--tp-plan transformers) applied to the validator's CausalLM (transformers' "
                  "llama module names) by transformers' own apply_tensor_parallelism and _expand_parallel_plan, on the "
                  "meta device, not through from_pretrained(tp_plan='auto') (validate/engines/fsdp2_tp_hf.py)")


def runner_changes(meta: dict) -> list[str]:
    """``TP_RUNNER_CHANGES``, and with transformers' plan how it is applied (``HF_PLAN_CHANGE``)."""
    return [*TP_RUNNER_CHANGES, *((HF_PLAN_CHANGE,) if meta.get("tp_plan") == "transformers" else ())]


def _tagged(phase: str, dim: str) -> str:
    """A phase named with the mesh dimension its collective ran over: ``backward [dp_replicate]``."""
    return f"{phase} [{dim}]"


def predict(config, meta: dict, rank: int):
    """The FSDP2 + TP estimate row of ``rank`` of the world ``meta`` describes (the run ``config`` asks for)."""
    from validate.engines.fsdp2_tp import TpRun
    from validate.models import spec_for
    from zeroplan.architectures.spec import transformer_shapes
    from zeroplan.engines import fsdp2 as profile
    from zeroplan.engines.base import Workload

    run = TpRun.from_validate(config)
    spec = spec_for(config.model_name, None)
    workload = Workload(transformer_shapes(spec), spec, run.seq_len, run.batch,
                        "full" if run.checkpointing else "none", 1, False)  # fmt: skip
    settings = profile.Settings(tp=run.tp, sequence_parallel=run.sequence_parallel, loss_parallel=run.loss_parallel,
                                device="cpu", backend="gloo", tp_plan=run.tp_plan,
                                rank=rank, foreach=False, param_dtype=run.param_dtype,
                                **({"dp_replicate": run.dp_replicate} if run.dp_replicate > 1 else {}))  # fmt: skip
    (row,) = profile.estimate(workload, meta["world_size"], settings)
    return row


def _steps(row: dict, steps: int) -> list[list[list]]:
    """A rank's calls per step (step -1 first: setup), each ``[op, phase [dim], dtype, elements]``."""
    out: list[list[list]] = [[] for _ in range(steps + 1)]
    for c in row["calls"]:
        out[c["step"] + 1].append([c["op"], _tagged(c["phase"], c["dim"]), c["dtype"], c["elements"]])
    return out


def compare(config, meta: dict, rows: list[dict]) -> dict:
    """The report row of one world (``validate.schema.ReportRow``), every rank against its own prediction."""
    from validate.compare import Prediction, Readings, finish
    from validate.compare import compare as compare_rows
    from zeroplan.formulas.peak import PHASES as PEAK_PHASES

    nd, steps = meta["world_size"], meta["steps"]
    predicted = {r["rank"]: predict(config, meta, r["rank"]) for r in rows}
    first = predicted[0]
    by_rank = {r: p.peak.by_phase() for r, p in predicted.items()}
    calls = {r["rank"]: _steps(r, steps) for r in rows}
    sizes = [len(c["group"]) for c in rows[0]["calls"] if c["step"] == steps - 1]
    readings = Readings(
        states_bytes=max(r["readings_bytes"]["after_backward"][-1] for r in rows),
        steady=all(len(set(r["readings_bytes"]["boundary"])) == 1 for r in rows),
        peak_bytes_by_phase={p: max(r["peak_bytes_by_phase"][p] for r in rows) for p in PEAK_PHASES},
        steps=[s for r in rows for s in calls[r["rank"]][1:]],  # every step (step -1, the setup, apart)
        last_step=calls[0][-1], setup_calls=calls[0][0], nd=nd, group_sizes=sizes,
        peak_by_rank={r["rank"]: r["peak_bytes_by_phase"] for r in rows},
    )  # fmt: skip
    tagged = tuple(replace(c, phase=_tagged(c.phase, c.mesh_dim)) for c in first.collectives)
    prediction = Prediction(first, collectives=tagged, beside_states=first.beside_states, per_call=True,
                            peak_by_phase={p: max(b[p] for b in by_rank.values()) for p in PEAK_PHASES},
                            peak_by_rank=by_rank)  # fmt: skip
    row = compare_rows(prediction, readings, config.tolerance, config.peak_tolerance)
    return finish({
        **row, "world_size": nd, "mode": "real", "backend": meta["backend"], "device": meta["device"],
        "model": config.model_label, "psi": config.psi, "engine": "fsdp2", "runner_changes": runner_changes(meta),
        "adam_step_bytes": max(r["optimizer_state_bytes"].get("step", 0) for r in rows),
        "probe_breakdown": rows[0]["probe_breakdown"], "checkpointing": config.checkpointing,
        "seq_len": config.seq_len, "micro_batch": config.batch_per_rank, "foreach": False, "parity": None,
        "seconds": max(r["seconds"] for r in rows),
        "step_time_s": {"probed": max(r["step_time_s"]["probed"] for r in rows),
                        "unprobed": max(r["step_time_s"]["unprobed"] for r in rows),
                        "unprobed_steps": rows[0]["step_time_s"]["unprobed_steps"]},
        "wire_bytes_per_rank": None, "profiler_comms": None, "wire_to_derived": None,
    }, None)  # fmt: skip


def build_report(config, worlds: list[tuple[dict, list[list[dict]]]]) -> dict:
    """The whole ``zeroplan validate --engine fsdp2 --tp T`` result (``validate.schema.ValidationReport``)."""
    from validate.compare import GLOO_NOTE
    from validate.schema import SCHEMA, ValidationReport

    rows = [compare(config, meta, [rank_rows[0] for rank_rows in ranks]) for meta, ranks in worlds]
    notes = [GLOO_NOTE, "collectives are keyed op|phase [mesh dim]|dtype: each counted on its own process group"]
    report = ValidationReport(schema_id=SCHEMA, config=config.model_dump(),
                              torch=worlds[0][0].get("torch") if worlds else None, rows=rows, notes=notes,
                              ok=all(r["ok"] for r in rows))  # fmt: skip
    return report.model_dump(by_alias=True)
