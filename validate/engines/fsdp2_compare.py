"""The parent's side of the FSDP2 runner: the profile's row (``zeroplan.engines.fsdp2``) for each world the
ranks (``validate.engines.fsdp2``) measured, compared through ``validate.compare``, and the report.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from validate.models import spec_for

RUN_DTYPES = ("fp32", "bf16")
"""The dtypes a run may ask for (``validate.engines.fsdp2.DTYPES`` maps them to torch's)."""


@dataclass(frozen=True)
class Fsdp2Settings:
    """One FSDP2 run, in FSDP2's own vocabulary."""

    model: str = "gpt-tiny"  # a validate.models preset, a zeroplan model preset or a config.json path
    params: float | None = None  # instead of model: a GPT-style model of about this many parameters
    param_dtype: str = "fp32"  # MixedPrecisionPolicy.param_dtype (fp32: no mixed precision)
    reduce_dtype: str | None = None  # MixedPrecisionPolicy.reduce_dtype (None: the param dtype)
    reshard_after_forward: bool | int = True  # on the blocks; the root keeps FSDP2's default
    checkpointing: bool = False  # checkpoint_wrapper on every block
    selective_ac: int | str = 1  # with checkpointing: layers k, 2k, ... only (1-based), or "op" (fsdp2.shard)
    foreach: bool | None = None  # torch.optim.Adam(foreach=...); None: torch's default for the device
    amsgrad: bool = False  # torch.optim.Adam(amsgrad=...): a third state, max_exp_avg_sq
    fused: bool | None = None  # torch.optim.Adam(fused=...)
    steps: int = 2
    batch_per_rank: int = 2
    seq_len: int | None = None  # None: the model's maximum
    lr: float = 1e-3
    init: str = "materialized"  # or "meta": built on the meta device, sharded, to_empty, then initialised
    hf: bool = False  # train transformers' own class of the model's config.json (deepspeed.py hf_builder)
    labels: bool = True  # hf: loss from forward(labels=...) inside the root's forward; False: outside it
    dp_replicate: int = 1  # HSDP: replicas R of the 2-D mesh (R, N_d / R) given to fully_shard (mesh_dims)
    wrap: str | dict = "blocks"  # the fully_shard calls: a preset (blocks, torchtitan) or a wrapping file's JSON

    def __post_init__(self) -> None:
        if self.init not in ("materialized", "meta"):
            raise ValueError(f"init={self.init!r}: expected materialized or meta")
        if self.hf and self.params is not None:
            raise ValueError("hf=True: a config.json model (hf_builder), not params=")
        if not self.labels and not self.hf:
            raise ValueError("labels=False: hf runs only (the validator's CausalLM computes its loss outside)")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in RUN_DTYPES:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(RUN_DTYPES)}")
        if not isinstance(self.dp_replicate, int) or self.dp_replicate < 1:
            raise ValueError(f"dp_replicate={self.dp_replicate!r}: must be a whole number >= 1")
        self.wrapping()  # a bad wrapping: one line, before any rank starts
        sac = self.selective_ac
        if (sac != "op" and (not isinstance(sac, int) or sac < 1)) or (sac != 1 and not self.checkpointing):
            raise ValueError(f"selective_ac={sac!r}: op or a whole number >= 1, other than 1 only with checkpointing")
        if self.steps < 1 or self.batch_per_rank < 1:
            raise ValueError(f"steps={self.steps}, batch_per_rank={self.batch_per_rank}: must be >= 1")

    def wrapping(self):
        """``wrap`` as the profile's ``Settings.wrap`` takes it: a preset name or a ``Wrapping``."""
        from zeroplan.engines.fsdp2.wrap import PRESETS, parse_wrapping

        if isinstance(self.wrap, str):
            if self.wrap not in PRESETS:
                raise ValueError(f"wrap={self.wrap!r}: expected one of {', '.join(PRESETS)} or a wrapping's JSON")
            return self.wrap
        return parse_wrapping(self.wrap)

    @classmethod
    def from_validate(cls, config) -> Fsdp2Settings:
        """The run ``zeroplan validate --engine fsdp2`` asks for (a ``validate.config.ValidateConfig``)."""
        rsf = config.reshard_after_forward
        return cls(model=config.model_name, params=config.params, param_dtype=config.param_dtype,
                   reduce_dtype=config.reduce_dtype, reshard_after_forward=True if rsf is None else rsf,
                   checkpointing=config.checkpointing == "full", foreach=config.foreach, steps=config.steps,
                   batch_per_rank=config.batch_per_rank, seq_len=config.seq_len, lr=config.lr,
                   init=config.fsdp2_init or "materialized", hf=bool(getattr(config, "hf", False)),
                   labels=getattr(config, "labels", None) is not False,
                   wrap=getattr(config, "fsdp_wrap", None) or "blocks",
                   dp_replicate=getattr(config, "dp_replicate", None) or 1)  # fmt: skip

    def mesh_dims(self, nd: int) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
        """``init_device_mesh``'s shape and names for N_d ranks: (N_d,) unnamed (flat, as before meshes were
        named), (R, N_d / R) named for HSDP."""
        if self.dp_replicate == 1:
            return (nd,), None
        if nd % self.dp_replicate:
            raise ValueError(f"dp_replicate={self.dp_replicate}: must divide N_d={nd}")
        return (self.dp_replicate, nd // self.dp_replicate), ("dp_replicate", "dp_shard")

    @classmethod
    def from_json(cls, text: str) -> Fsdp2Settings:
        data = json.loads(text)
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown FSDP2 settings: {', '.join(sorted(unknown))}")
        return cls(**data)


FAKE_TENSOR_PHASES = {
    "init": "FakeTensorMode: MemTracker also counts the fake tensors of DTensor's sharding propagation "
    "(mem_tracker.py:MemTracker.__torch_dispatch__ skips them only when no fake mode was active on entry); "
    "fully_shard makes DTensor parameters here. Checked with real tensors on the same fake group",
    "optimizer_step": "FakeTensorMode: Adam runs on DTensor parameters, whose sharding propagation makes fake "
    "tensors of the global shape that MemTracker counts (same cause as init). Checked with real tensors",
}


def predicted_run(config, meta: dict, rank: int = 0):
    """The FSDP2 profile's estimate of ``rank`` in this world (rank 0 holds the most between steps: padding is
    at the end; a rank with padding re-pads its shards at a meta-device init)."""
    return predict(Fsdp2Settings.from_validate(config), meta, rank)


def _workload(settings: Fsdp2Settings, meta: dict):
    """The ``Workload`` of the run ``settings`` describes (the transformers module tree when ``hf``)."""
    from zeroplan.architectures.spec import TransformerSpec, transformer_shapes
    from zeroplan.engines.base import Workload

    spec = spec_for(settings.model, settings.params)
    if not isinstance(spec, TransformerSpec):
        raise ValueError(f"model {settings.model}: --engine fsdp2 validates transformers only")
    cuda = str(meta["device"]).startswith("cuda")
    foreach = settings.foreach if settings.foreach is not None else cuda
    return Workload(transformer_shapes(spec), spec, settings.seq_len or spec.max_seq_len, settings.batch_per_rank,
                    "full" if settings.checkpointing else "none", foreach=bool(foreach),
                    transformers=settings.hf)  # fmt: skip


def predict(settings: Fsdp2Settings, meta: dict, rank: int = 0):
    """(the estimate row, the profile's Settings) of the run ``settings`` on ``rank`` of ``meta``'s world;
    ``hf``: the transformers module tree (``Workload.transformers``)."""
    from zeroplan.engines import fsdp2 as profile

    workload = _workload(settings, meta)
    cuda = str(meta["device"]).startswith("cuda")
    engine = profile.Settings(reshard_after_forward=settings.reshard_after_forward, param_dtype=settings.param_dtype,
                              reduce_dtype=settings.reduce_dtype, device="cuda" if cuda else "cpu",
                              backend=meta["backend"], rank=rank, init=settings.init,
                              cuda_capability=tuple(meta.get("cuda_capability", (9, 0))), wrap=settings.wrapping(),
                              **({"loss_in_forward": settings.labels} if settings.hf else {}),
                              **({"selective_ac": settings.selective_ac} if settings.selective_ac != 1 else {}),
                              **({"dp_replicate": settings.dp_replicate} if settings.dp_replicate > 1 else {}))  # fmt: skip
    (row,) = profile.estimate(workload, meta["world_size"], engine)
    return row, engine


def predicted_reserved(config, meta: dict) -> dict | None:
    """CUDA: the allocator model's reserved bytes per phase for rank 0's allocation trace (the run ``predict``
    describes, ``zeroplan.engines.fsdp2.alloc_trace``); None on CPU."""
    if not str(meta["device"]).startswith("cuda"):
        return None
    from zeroplan.allocator.reserved import reserved_of
    from zeroplan.engines.fsdp2.alloc_trace import alloc_traces

    settings = Fsdp2Settings.from_validate(config)
    _, engine = predict(settings, meta)
    (trace,) = alloc_traces(_workload(settings, meta), meta["world_size"], engine)
    try:  # the ranks inherit this process's PYTORCH_CUDA_ALLOC_CONF (validate/gpu_check.sh sets it per step)
        return reserved_of(trace, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")).reserved_phases
    except ValueError:  # an option the model refuses (backend:cudaMallocAsync): not predicted
        return None


def beside_states(predicted) -> tuple:
    """The terms the profile holds beside the model states between steps: its row's own list
    (``EngineEstimate.beside_states``: the post-forward mesh ranks of an int ``reshard_after_forward``)."""
    return predicted.beside_states


def runner_changes(meta: dict) -> list[str]:
    """What this runner changes in the FSDP2 it measures, beyond the probes (``ReportRow.runner_changes``)."""
    out = ["one intra-op thread per rank (OMP_NUM_THREADS=1, validate.harness)"]
    if meta["backend"] == "gloo":
        out.append("each synchronous collective returns only once gloo's worker thread has let its tensors go "
                   "(validate/engines/fsdp2_gloo_release.py): each free counted before the rank's next op")  # fmt: skip
    if meta.get("fake_tensors"):
        out.append("simulated: rank 0 of a fake process group under FakeTensorMode (validate.simulate)")
    elif meta["backend"] == "fake":
        out.append("simulated: rank 0 of a fake process group, real tensors (validate.simulate)")
    return out


def compare(config, meta: dict, rank_rows: list[dict]) -> dict:
    """The report row of one world size (``validate.schema.ReportRow``), through ``validate.compare``."""
    from validate.compare import Prediction, Readings, finish
    from validate.compare import compare as compare_rows
    from validate.tolerances import parity_tolerance
    from zeroplan.formulas.peak import PHASES as PEAK_PHASES

    nd = meta["world_size"]
    predicted, _ = predicted_run(config, meta)
    # the largest of the measured ranks' predictions, phase by phase (what the measured peak takes over them)
    by_rank = {0: predicted.peak.by_phase(), **{r: predicted_run(config, meta, r)[0].peak.by_phase()
                                                for r in sorted({row["rank"] for row in rank_rows} - {0})}}  # fmt: skip
    # model states = parameters + gradients + Adam: all live after backward from the second step on, beside
    # FSDP2's own persistent bookkeeping, a named term of the profile (beside_states)
    readings = Readings(
        states_bytes=max(r["readings_bytes"]["after_backward"][-1] for r in rank_rows),
        steady=all(len(set(r["readings_bytes"]["boundary"])) == 1 for r in rank_rows),
        peak_bytes_by_phase={p: max(r["peak_bytes_by_phase"][p] for r in rank_rows) for p in PEAK_PHASES},
        steps=[s for r in rank_rows for s in r["calls_by_step"][1:]],
        last_step=rank_rows[0]["calls_by_step"][-1],
        setup_calls=rank_rows[0]["calls_by_step"][0],
        nd=nd,
        group_sizes=rank_rows[0].get("group_sizes_by_step", [[]])[-1],
        unchecked_phases={p: why for p, why in FAKE_TENSOR_PHASES.items() if meta.get("fake_tensors")},
        peak_by_rank={r["rank"]: r["peak_bytes_by_phase"] for r in rank_rows},
    )
    # every rank against its own prediction (validate.compare._errors_by_rank); the largest of each shown
    prediction = Prediction(predicted, peak_by_phase={p: max(b[p] for b in by_rank.values()) for p in PEAK_PHASES},
                            beside_states=beside_states(predicted), per_call=True, peak_by_rank=by_rank,
                            reserved_by_phase=predicted_reserved(config, meta))  # fmt: skip
    row = compare_rows(prediction, readings, config.tolerance, config.peak_tolerance)
    parities = [r["parity"] for r in rank_rows if r["parity"] is not None]
    parity = None
    if parities:
        tol = parity_tolerance("fp32", nd, 1, config.lr).grad_rtol
        worst = max(parities, key=lambda p: p["grad_rel_diff"])
        parity = {**worst, "grad_rtol": tol, "ok": worst["grad_rel_diff"] <= tol}
    return finish({
        **row, "world_size": nd, "mode": "simulated" if config.simulated else "real",
        "backend": meta["backend"], "device": meta["device"], "model": config.model_label, "psi": config.psi,
        "engine": "fsdp2", "runner_changes": runner_changes(meta),
        "adam_step_bytes": max(r["optimizer_state_bytes"].get("step", 0) for r in rank_rows),
        "probe_breakdown": rank_rows[0]["probe_breakdown"],
        "checkpointing": config.checkpointing, "seq_len": config.seq_len, "micro_batch": config.batch_per_rank,
        "foreach": rank_rows[0]["foreach"], "parity": parity,
        "seconds": max(r["seconds"] for r in rank_rows),
        "step_time_s": {"probed": max(r["step_time_s"]["probed"] for r in rank_rows),
                        "unprobed": max(r["step_time_s"]["unprobed"] for r in rank_rows),
                        "unprobed_steps": rank_rows[0]["step_time_s"]["unprobed_steps"]},
        "wire_bytes_per_rank": None, "profiler_comms": None, "wire_to_derived": None,
    }, None if parity is None else parity["ok"])  # fmt: skip


def build_report(config, worlds: list[tuple[dict, list[list[dict]]]]) -> dict:
    """The whole ``zeroplan validate --engine fsdp2`` result (``validate.schema.ValidationReport``)."""
    from validate.compare import GLOO_NOTE
    from validate.schema import SCHEMA, ValidationReport

    rows = [compare(config, meta, [rank_rows[0] for rank_rows in ranks]) for meta, ranks in worlds]
    notes = [GLOO_NOTE] if any(r["backend"] == "gloo" for r in rows) else []
    if any(r["peak_unchecked_phases"] for r in rows):
        notes.append("FakeTensorMode rows: the init and optimizer_step peaks are reported, not checked "
                     "(peak_unchecked_phases says why); run with --real-tensors to check them")  # fmt: skip
    report = ValidationReport(schema_id=SCHEMA, config=config.model_dump(),
                              torch=worlds[0][0].get("torch") if worlds else None, rows=rows, notes=notes,
                              ok=all(r["ok"] for r in rows))  # fmt: skip
    return report.model_dump(by_alias=True)
