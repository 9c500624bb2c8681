"""FSDP2 behind the engine contract (``zeroplan/engines/base.py``): ``estimate``, the planner's options in
FSDP2's vocabulary, and the plan (the cheapest candidate whose predicted peak fits)."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.engines.base import Candidate, EngineEstimate, EnginePlan, PlannerOptions, Workload
from zeroplan.engines.fsdp2.collectives import micro_steps, unit_collectives
from zeroplan.engines.fsdp2.launcher import settings_snippet
from zeroplan.engines.fsdp2.moments import predict_peak
from zeroplan.engines.fsdp2.settings import Settings
from zeroplan.engines.fsdp2.terms import fsdp2_run, mesh_ranks, model_states, resharded
from zeroplan.formulas.collectives import Collective, ring_bytes_per_rank
from zeroplan.formulas.dtypes import canonical_dtype, dtype_bytes
from zeroplan.formulas.memory import MemoryBreakdown
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES
from zeroplan.policy import PrecisionPolicy

def estimate(workload: Workload, nd: int, settings: Settings) -> tuple[EngineEstimate, ...]:
    """The one FSDP2 configuration ``settings`` describes, on ``settings.rank`` of ``nd`` ranks; its
    collectives count one optimizer step of ``workload.grad_accum`` micro-steps (``micro_steps``)."""
    run = fsdp2_run(workload, nd, settings)
    st = model_states(run.units, nd, settings)
    coll = tuple(
        Collective(c.op, c.phase, m * c.elements, c.dtype,
                   m * ring_bytes_per_rank(c.op, c.elements, c.group_size, dtype_bytes(c.dtype)), m)
        for c in unit_collectives(run.units, nd, settings)
        for m in (micro_steps(c, workload.grad_accum),)
    )  # fmt: skip
    memory = MemoryBreakdown(st.params_bytes, st.grads_bytes, st.optimizer_bytes)
    peak = predict_peak(run) if run.acts is not None else None
    return (EngineEstimate("fsdp2", settings.label(), 3 if resharded(run) else 2, memory, peak, coll,
                           beside_states=mesh_ranks(run)),)  # fmt: skip


# ---- planning: the cheapest configuration whose predicted peak fits ----

# Cheapest first: keeping blocks gathered (False) sends no backward all-gather; resharding adds one
# all-gather per block (1.5x the traffic); checkpointing adds one forward per block (~1/3 more compute,
# Korthikanti et al. 2022, section 4). Traffic is cheaper to add than compute on one node, so resharding
# is tried before checkpointing.
CANDIDATES: tuple[tuple[bool, str], ...] = ((False, "none"), (True, "none"), (False, "full"), (True, "full"))


@dataclass(frozen=True)
class Fsdp2Option:
    """One candidate: its settings, checkpointing, the estimate and whether its peak fits."""

    settings: Settings
    checkpointing: str
    estimate: EngineEstimate
    fits: bool

    @property
    def snippet(self) -> str:
        return settings_snippet(self.settings, self.checkpointing)


def plan_options(workload: Workload, nd: int, capacity_bytes: int, settings: Settings) -> tuple[Fsdp2Option, ...]:
    """Every candidate of ``CANDIDATES`` (``settings`` gives the policy), cheapest first, with its peak."""
    if workload.spec is None:
        raise ValueError("planning FSDP2 needs an architecture (its peak): give a model")
    out = []
    for reshard, ckpt in CANDIDATES:
        s = settings.model_copy(update={"reshard_after_forward": reshard})
        w = Workload(workload.shapes, workload.spec, workload.seq_len, workload.micro_batch, ckpt,
                     workload.grad_accum, workload.foreach)  # fmt: skip
        (row,) = estimate(w, nd, s)
        out.append(Fsdp2Option(s, ckpt, row, row.peak.peak_bytes <= capacity_bytes))
    return tuple(out)


def recommend(workload: Workload, nd: int, capacity_bytes: int, settings: Settings) -> Fsdp2Option | None:
    """The cheapest candidate whose predicted peak fits in ``capacity_bytes``; None if none does."""
    return next((o for o in plan_options(workload, nd, capacity_bytes, settings) if o.fits), None)


# ---- the planner's side (estimate, plan, sweep): options -> Settings, the byte convention, the plan ----

PLANNER_OPTIONS: tuple[str, ...] = ("reshard_after_forward", "param_dtype", "reduce_dtype")
"""The ``PlannerOptions`` fields in FSDP2's vocabulary (``fully_shard`` and ``MixedPrecisionPolicy``)."""
PLAN_ORDER = ("keep blocks gathered (no backward all-gather), then reshard (one more all-gather per block), "
              "then checkpointing (one more forward per block), then both")  # fmt: skip


def planner_settings(options: PlannerOptions) -> Settings:
    """FSDP2's ``Settings`` from the planner's options, as ``fully_shard`` runs on CUDA with NCCL and a
    model built in fp32, on the ``--gpu`` preset's compute capability where given; an option not given keeps
    FSDP2's default (reshard after forward, no mixed precision)."""
    given: dict = {}
    if options.reshard_after_forward is not None:
        given["reshard_after_forward"] = options.reshard_after_forward
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(options, key) is not None:
            given[key] = canonical_dtype(getattr(options, key))
    if options.gpu_capability is not None:  # the --gpu preset's: sizes the cuBLAS workspaces
        given["cuda_capability"] = options.gpu_capability
    return Settings(**given)


def planner_policy(settings: Settings) -> PrecisionPolicy:
    """The byte convention of FSDP2's model states (``model_states``): parameters and gradients in the module
    dtype, no master copy, Adam's m and v in the module dtype."""
    return PrecisionPolicy(param_dtype=settings.module, master_weights=False, optimizer="adam",
                           optimizer_dtype=settings.module)  # fmt: skip


def planner_plan(workload: Workload, nd: int, capacity_bytes: int, options: PlannerOptions) -> EnginePlan:
    """``zeroplan plan --engine fsdp2``: every candidate of ``plan_options`` (cheapest first) with the
    snippet of exactly the configuration predicted; the recommendation is ``recommend``'s."""
    settings = planner_settings(options)
    if settings.foreach is None:  # the snippet names the foreach path the prediction used
        settings = settings.model_copy(update={"foreach": workload.foreach})
    options_ = plan_options(workload, nd, capacity_bytes, settings)
    chosen = next((o for o in options_ if o.fits), None)  # ``recommend``'s choice, without a second search
    candidates = tuple(
        Candidate(f"reshard_after_forward={o.settings.reshard_after_forward}, checkpointing {o.checkpointing}",
                  o.estimate, o.fits, o.snippet, alloc_trace=_trace_of(workload, nd, o))
        for o in options_
    )  # fmt: skip
    index = None if chosen is None else options_.index(chosen)
    return EnginePlan(candidates, index, "fsdp2", PLAN_ORDER, settings)


def _trace_of(workload: Workload, nd: int, option: Fsdp2Option):
    """The candidate's allocation trace, made on demand (``Candidate.alloc_trace``)."""
    from dataclasses import replace

    from zeroplan.engines.fsdp2.alloc_trace import alloc_traces

    return lambda: alloc_traces(replace(workload, checkpointing=option.checkpointing), nd, option.settings)[0]


def planner_block_bytes(settings: Settings) -> int:
    """The allocator block every peak term is rounded to (``predict_peak``): 512 on CUDA, none on CPU."""
    return CUDA_BLOCK_BYTES if settings.device == "cuda" else 1
