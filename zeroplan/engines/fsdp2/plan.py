"""FSDP2 behind the engine contract (``zeroplan/engines/base.py``): ``estimate``, the planner's options in
FSDP2's vocabulary, and the plan (the cheapest candidate whose predicted peak fits)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Optional

from zeroplan.engines.base import (Candidate, EngineEstimate, EnginePlan, PeakLimit,
                                  PlannerOptions, Workload, worst_rank)
from zeroplan.engines.fsdp2.collectives import run_collectives
from zeroplan.engines.fsdp2.launcher import settings_snippet
from zeroplan.engines.fsdp2.mesh import (AUTO, gathered_floor, mesh_pins, possible_sizes,
                                         resolve_mesh, shard_groups, shard_rank, shard_sizes, smallest_fitting)
from zeroplan.formulas.mesh import DEFAULT_GPUS_PER_NODE
from zeroplan.engines.fsdp2.fit_floor import over_floor
from zeroplan.engines.fsdp2.leaders import predict_peak
from zeroplan.engines.fsdp2.moments import init_moments
from zeroplan.engines.fsdp2.optimizer_step import optimizer_moments
from zeroplan.engines.fsdp2.offload import host_memory
from zeroplan.engines.fsdp2.param import distinct_ranks, distinct_shapes, total_numel
from zeroplan.engines.fsdp2.settings import Settings
from zeroplan.engines.fsdp2.tp import tp_acts
from zeroplan.engines.fsdp2.tp_loss import check_loss_parallel
from zeroplan.engines.fsdp2.tp_estimate import (mesh_search, tp_estimate, tp_mesh, tp_rows, tp_search,
                                                tp_workload)
from zeroplan.engines.fsdp2.terms import Fsdp2Run, fsdp2_run, mesh_ranks, resharded, run_states
from zeroplan.engines.fsdp2.units import wrapping_of
from zeroplan.engines.fsdp2.wrap import Wrapping
from zeroplan.formulas.dtypes import canonical_dtype, dtype_bytes
from zeroplan.formulas.memory import MemoryBreakdown
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES
from zeroplan.architectures.spec import TransformerSpec
from zeroplan.formulas.dropout import dropout_limit
from zeroplan.policy import PrecisionPolicy

def estimate(workload: Workload, nd: int, settings: Settings, made: dict | None = None,
             collectives: bool = True, over: int | None = None) -> tuple[EngineEstimate, ...]:
    """The one FSDP2 configuration ``settings`` describes, on ``settings.rank`` of ``nd`` ranks (None: the
    rank peaking highest of those whose shards differ, ``distinct_ranks``, named in ``peak_rank``), on a 2-D
    HSDP mesh when ``dp_replicate``/``dp_shard`` say so (engines/fsdp2/mesh.py); its collectives count one
    optimizer step of ``workload.grad_accum`` micro-steps (``micro_steps``). With ``tp`` T > 1: the TP-local
    model on N_d / T data-parallel ranks (engines/fsdp2/tp.py ``tp_estimate``). ``made``: filled with {rank: its
    run} (with TP: the data-parallel rank's TP-local run), for the plan's allocation trace of the rank that peaks
    (``alloc_traces``' ``run``). ``collectives`` False: the rows' collectives left empty (the plan's search reads
    only the peaks of most configurations; ``with_collectives`` adds them to a row later, the same tuple). ``over``:
    a budget; a configuration whose peak is proven above it gives no row, (), as soon as it is (``_estimate``: the
    plan's search asks only whether most configurations fit; a speed-up, no rule)."""
    check_loss_parallel(settings.tp, settings.loss_parallel)
    if (settings.tp or 1) > 1:
        return tp_estimate(workload, nd, settings, dp_estimate, made, collectives, over)
    return dp_estimate(workload, nd, settings, made, collectives, over)


def dp_estimate(workload: Workload, nd: int, settings: Settings, made: dict | None = None,
                collectives: bool = True, over: int | None = None) -> tuple[EngineEstimate, ...]:
    """``estimate`` on ``nd`` data-parallel ranks (with ``tp``: ``workload`` is the TP-local one)."""
    settings = resolve_mesh(settings, nd)  # HSDP: R replicas of S-way shards; the profile is sized by S
    if settings.rank is None:  # the ranks of one shard group differ; the replicas repeat them
        ranks = distinct_ranks(distinct_shapes(workload.shapes), shard_groups(settings, nd)[1])
        runs: list = []  # the first rank's run, which the others reuse (Fsdp2Run.for_rank: a speed-up)
        rows = {}
        for r in ranks:
            row = rows[r] = _estimate(workload, nd, settings.model_copy(update={"rank": r}), runs, made,
                                      collectives, over)  # fmt: skip
            if row is None:  # its peak is over ``over``: so is the worst rank's
                return ()
        return (worst_rank(rows),)
    row = _estimate(workload, nd, settings, None, made, collectives, over)
    return () if row is None else (row,)


def rank_run(workload: Workload, nd: int, settings: Settings):
    """(the run of ``settings.rank`` on its shard group, the shard group's size): rank r is shard r mod S of an
    HSDP mesh (``settings`` resolved by ``resolve_mesh``, a rank given); ``estimate`` and the allocation trace
    (``alloc_trace.py``) describe the same run."""
    settings = settings.model_copy(update={"rank": shard_rank(settings, nd)})  # rank r is shard r mod S
    replicate, nd = shard_groups(settings, nd)
    run = fsdp2_run(workload, nd, settings, replicate)
    if (settings.tp or 1) > 1 and run.acts is not None:  # engines/fsdp2/tp.py
        run = replace(run, acts=_tp_acts(run.acts, workload.spec, settings.tp, workload.micro_batch * workload.seq_len,
                                         dtype_bytes(settings.param), settings.sequence_parallel,
                                         settings.backend == "gloo", workload.seq_len, settings.loss_parallel))
    return run, nd


def _tp_acts(*args):
    """``tp_acts(*args)``, a function of its arguments' values (frozen dataclasses, numbers, flags), kept by them
    (``_kept_tp_acts``): the mesh search asks it for every rank and shard group it tries at one T (a speed-up)."""
    try:
        return _kept_tp_acts(*args)
    except TypeError:  # an unhashable argument: built each time
        return tp_acts(*args)


_kept_tp_acts = lru_cache(maxsize=64)(tp_acts)


def _estimate(workload: Workload, nd: int, settings: Settings, runs: list | None = None, made: dict | None = None,
              collectives: bool = True, over: int | None = None) -> EngineEstimate | None:
    """One rank's row; ``runs``: the first rank's run, shared by the others of one estimate (only Adam's states
    depend on the rank: ``Fsdp2Run.for_rank``); ``made``: {rank: its run}, filled. None when its peak is proven
    over ``over`` (a budget): by a moment outside backward of the first rank's run (``fit_floor.over_floor``), or
    by its whole peak."""
    rank, first = settings.rank, not runs
    if runs:
        run, nd = runs[0].for_rank(shard_rank(settings, nd)), shard_groups(settings, nd)[1]
    else:
        run, nd = rank_run(workload, nd, settings)
        if runs is not None:
            runs.append(run)
    if made is not None:
        made[rank] = run
    if over is not None and first and over_floor(run, over):
        return None
    settings = run.settings
    st = run_states(run)  # model_states(run.units, nd, settings), once per run
    coll = run_collectives(run, workload.grad_accum) if collectives else ()
    memory = MemoryBreakdown(st.params_bytes, st.grads_bytes, st.optimizer_bytes)
    host = None
    if settings.offload_policy == "cpu":  # CPUOffloadPolicy: the model states live on the host (offload.py)
        memory, host = MemoryBreakdown(0, 0, 0), host_memory(run, optimizer_moments(run), workload.grad_accum,
                                                             init_moments(run))
    peak = predict_peak(run) if run.acts is not None else None
    if over is not None and peak is not None and peak.peak_bytes > over:
        return None
    return EngineEstimate("fsdp2", run.settings.label(), 3 if resharded(run) else 2, memory, peak, coll,
                          beside_states=mesh_ranks(run), peak_rank=rank, host=host)  # fmt: skip


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
    wrapping: Optional[Wrapping] = None  # settings.wrap in the model's names (units.wrapping_of)
    run: Optional[Fsdp2Run] = field(default=None, compare=False, repr=False)
    """the run of the rank it peaks on (``estimate``'s ``made``; with TP its TP-local run): its allocation
    trace's run."""

    @property
    def snippet(self) -> str:
        return settings_snippet(self.settings, self.checkpointing, self.wrapping)


def plan_options(workload: Workload, nd: int, capacity_bytes: int, settings: Settings,
                 shards: tuple[int, ...] = (), until_fit: bool = False, memo: dict | None = None,
                 upto: int | None = None, peaks_only: bool = False,
                 only: int | None = None) -> tuple[Fsdp2Option, ...]:
    """Every candidate of ``CANDIDATES`` (``settings`` gives the policy), cheapest first, with its peak; a
    wrapping file keeps its own ``reshard_after_forward`` values, so only checkpointing varies. With ``shards``
    (``--dp-shard auto``: engines/fsdp2/mesh.py shard_sizes) each candidate on the smallest shard group of
    them whose peak fits (HSDP across the rest), else on the largest; ``until_fit``: none after the first that
    fits. ``memo``: each estimate by (its resolved settings, checkpointing), shared by the plans of one mesh
    search (``tp_estimate.mesh_search`` asks the same configuration again: a speed-up, no rule); ``upto``: the
    candidates up to that index only (the mesh search's first pass: a later first fit cannot win); ``only``: the
    candidate of that index alone (its second pass: those before it fit on no shard group). Each
    configuration is estimated without its collectives (``estimate``'s ``collectives``: a shard group the
    bisection passes over never shows them), which each candidate returned gets (``with_collectives``) unless
    ``peaks_only`` (the mesh search's ranking: only the fits, ``with_collectives`` for the one it compares)."""
    if workload.spec is None:
        raise ValueError("planning FSDP2 needs an architecture (its peak): give a model")
    own = isinstance(settings.wrap, Wrapping)
    if shards:  # the groups whose model states alone cannot fit dropped: a lower bound (mesh.states_floor)
        local = tp_workload(workload, settings.tp) if (settings.tp or 1) > 1 else workload
        shards = possible_sizes(shards, total_numel(local.shapes), settings, capacity_bytes)
    out, top = [], shards[-1] if shards else None
    for reshard, ckpt in _candidates(own, upto, only):
        w = replace(workload, checkpointing=ckpt)

        def option(shard: int | None, reshard=reshard, w=w) -> tuple[tuple[Settings, EngineEstimate, bool, dict], bool]:
            # smallest_fitting returns the row of the largest group, or of one that fits: of no other
            return _configured(w, nd, capacity_bytes, settings, own, reshard, shard, memo, shard == top)


        s, row, fits, made = smallest_fitting(shards, option) if shards else option(None)[0]
        run = made.get((row.peak_rank or 0) // (s.tp or 1))  # the run the trace replays (made by data-parallel rank)
        row = row if peaks_only else with_collectives(row, w, s, run) if run is not None else estimate(w, nd, s)[0]
        out.append(Fsdp2Option(_run_settings(w, nd, s, run), ckpt, row, fits, wrapping_of(w, s), run))
        if fits and until_fit:  # the mesh search ranks by the first that fits (tp_estimate.mesh_search)
            break
    return tuple(out)


def _candidates(own: bool, upto: int | None, only: int | None = None) -> tuple[tuple[bool | None, str], ...]:
    """``plan_options``' (reshard_after_forward, checkpointing) pairs, up to index ``upto`` (``only``: that one
    alone); a wrapping file keeps its own reshard values (None)."""
    pairs = ((None, "none"), (None, "full")) if own else CANDIDATES
    return pairs[only:only + 1] if only is not None else pairs[:None if upto is None else upto + 1]


def _configured(w: Workload, nd: int, capacity_bytes: int, settings: Settings, own: bool, reshard, shard: int | None,
                memo: dict | None, need_row: bool = True) -> tuple[tuple[Settings, EngineEstimate | None, bool, dict], bool]:
    """((the resolved settings, the row without collectives, whether its peak fits, {rank: run}), fits) of one
    candidate on shard group ``shard`` (None: as ``settings`` give), by ``memo`` when it holds it. ``need_row`` False:
XX
    rule), which a later ask for its row builds."""
    s = _candidate_settings(nd, settings, own, reshard, shard)
    got = memo.get((s, w.checkpointing)) if memo is not None else None
    if got is not None and (got[0][1] is not None or not need_row):
        return got
    made: dict = {}
    rows = estimate(w, nd, s, made, collectives=False, over=None if need_row else capacity_bytes)
    if not rows:  # proven over the budget
        if memo is not None:
            memo[s, w.checkpointing] = (s, None, False, made), False
        return (s, None, False, made), False
    (row,) = rows
    fits = row.peak.peak_bytes <= capacity_bytes
    if memo is not None:
        memo[s, w.checkpointing] = (s, row, fits, made), fits
    return (s, row, fits, made), fits


def _candidate_settings(nd: int, settings: Settings, own: bool, reshard, shard: int | None) -> Settings:
    """The settings of a candidate (``reshard_after_forward``, unless a wrapping file keeps its own) on shard
    group ``shard`` (None: as ``settings`` give), the mesh resolved on N_d / T (``tp_estimate.tp_mesh``)."""
    update = ({} if own else {"reshard_after_forward": reshard}) | (
        {} if shard is None else {"dp_shard": shard, "dp_replicate": None})  # fmt: skip
    return tp_mesh(settings.model_copy(update=update), nd)


def first_fit(workload: Workload, nd: int, capacity_bytes: int, options: PlannerOptions, memo: dict | None = None,
              upto: int | None = None) -> tuple[int | None, int]:
    """(the index of the first candidate that fits, or None; the candidates tried): what ``mesh_plan(..., until_fit=
    True, upto=upto)`` recommends and lists on the mesh ``options`` name (no ``auto``), without its plan (the mesh
    search's first pass, ``tp_estimate.mesh_search``). A candidate that keeps its units gathered after forward
    whose gathered parameters alone exceed ``capacity_bytes`` (``mesh.gathered_floor``, a lower bound on its
    peak) cannot fit: it is not estimated; the others only as far as ``fit_floor.over_floor`` settles it."""
    settings = _mesh_settings(workload, nd, options)
    own = isinstance(settings.wrap, Wrapping)
    local = tp_workload(workload, settings.tp) if (settings.tp or 1) > 1 else workload
    kept = settings.model_copy(update={"reshard_after_forward": False})  # the candidates that keep units gathered
    floor = gathered_floor(total_numel(local.shapes), kept)
    tried = _candidates(own, upto)
    for k, (reshard, ckpt) in enumerate(tried):
        if reshard is False and floor > capacity_bytes:
            continue
        w = replace(workload, checkpointing=ckpt)
        if _configured(w, nd, capacity_bytes, settings, own, reshard, None, memo, need_row=False)[1]:
            return k, k + 1
    return None, len(tried)


def with_collectives(row: EngineEstimate, workload: Workload, settings: Settings, run: Fsdp2Run) -> EngineEstimate:
    """``row`` (``estimate`` of ``workload`` on ``settings``, without collectives) with the collectives ``estimate``
    gives it: those of ``run``, the run of its ``peak_rank`` (``run_collectives``, the same on every rank of a run),
    then with TP the TP group's (``tp_estimate.tp_rows``)."""
    coll = run_collectives(run, workload.grad_accum)
    return replace(row, collectives=(*coll, *tp_rows(workload, settings)) if (settings.tp or 1) > 1 else coll)


def _run_settings(w: Workload, nd: int, s: Settings, run: Fsdp2Run | None) -> Settings:
    """The settings the chosen run has (``fsdp2_run``'s: the blocks' ``reshard_after_forward`` of a wrapping
    file), as ``s`` names the rank: taken from ``run`` when the estimate made it, else built. With TP the run
    is the TP-local one on N_d / T ranks, whose settings leave a flat shard group unnamed: ``s`` names the mesh
    the snippet builds (``tp_mesh``), and only ``reshard_after_forward`` is the run's."""
    if run is not None and (s.tp or 1) > 1:
        value = run.settings.reshard_after_forward
        return s if s.reshard_after_forward == value else s.model_copy(update={"reshard_after_forward": value})
    if run is not None:
        return run.settings.model_copy(update={"rank": s.rank})
    return fsdp2_run(w, shard_groups(s, nd // (s.tp or 1))[1], s).settings


def recommend(workload: Workload, nd: int, capacity_bytes: int, settings: Settings) -> Fsdp2Option | None:
    """The cheapest candidate whose predicted peak fits in ``capacity_bytes``; None if none does."""
    return next((o for o in plan_options(workload, nd, capacity_bytes, settings) if o.fits), None)


# ---- the planner's side (estimate, plan, sweep): options -> Settings, the byte convention, the plan ----

PLANNER_OPTIONS: tuple[str, ...] = ()
"""The shared ``PlannerOptions`` fields FSDP2 reads: none (its vocabulary is its own, ``VOCABULARY``)."""


PLAN_ORDER = ("keep blocks gathered (no backward all-gather), then reshard (one more all-gather per block), "
              "then checkpointing (one more forward per block), then both")  # fmt: skip


def planner_settings(options: PlannerOptions) -> Settings:
    """FSDP2's ``Settings`` from the planner's options, as ``fully_shard`` runs on CUDA with NCCL and a
    model built in fp32, on the ``--gpu`` preset's compute capability where given; an option not given keeps
    FSDP2's default (reshard after forward, no mixed precision)."""
    given: dict = {}
    if options.own.get("reshard_after_forward") is not None:
        given["reshard_after_forward"] = options.own["reshard_after_forward"]
    for key in ("param_dtype", "reduce_dtype"):
        if options.own.get(key) is not None:
            given[key] = canonical_dtype(options.own[key])
    if options.gpu_capability is not None:  # the --gpu preset's: sizes the cuBLAS workspaces
        given["cuda_capability"] = options.gpu_capability
    if options.own.get("dp_shard") == AUTO:
        raise ValueError("dp_shard=auto: only plan searches the mesh; give a number (R x S = N_d)")
    if options.own.get("tp") == AUTO:
        raise ValueError("tp=auto: only plan searches the TP degree; give a number (1, 2, 4, 8)")
    given.update({k: v for k, v in options.own.items()  # the rest of VOCABULARY as checked
                  if v is not None and k != "gpus_per_node" and k not in given})  # fmt: skip
    if given.get("device") == "cpu":  # a CPU run is on gloo (users' CPU CI runners), as the validator's
        given["backend"] = "gloo"
    return Settings(**given)


def planner_peak_limits(options: PlannerOptions, spec: TransformerSpec) -> Optional[PeakLimit]:
    """``Engine.own_peak_limits``: a run with dropout is refused (``dropout.dropout_limit``)."""
    why = dropout_limit(spec, "fsdp2")
    return None if why is None else PeakLimit("architecture", why)


def planner_policy(settings: Settings) -> PrecisionPolicy:
    """The byte convention of FSDP2's model states (``model_states``): parameters and gradients in the module
    dtype, no master copy, Adam's m and v in the module dtype."""
    return PrecisionPolicy(param_dtype=settings.module, master_weights=False, optimizer="adam",
                           optimizer_dtype=settings.module)  # fmt: skip


MESH_OPTIONS = ("tp", "dp_shard", "dp_replicate")
"""The mesh's dimensions. ``plan`` searches them all when none is given; one given pins the mesh: exactly what is
given, tp 1 and the flat group where not given, ``auto`` searching that dimension (``planner_plan``)."""


def planner_plan(workload: Workload, nd: int, capacity_bytes: int, options: PlannerOptions) -> EnginePlan:
    """``zeroplan plan --engine fsdp2``. With no mesh dimension given (``MESH_OPTIONS``) the mesh is searched, as
    ``--tp auto --dp-shard auto`` (``tp_estimate.mesh_search``: replicate x shard x tp, TP within a node, shard
    groups of whole nodes): a plan answers with the mesh to run, not the flat group alone, which past a few
    nodes rarely fits (llama3-405b on 2,048 H100s) and sends every gradient across nodes. A given value plans
    exactly that mesh: ``--tp 1`` (or ``--dp-replicate 1``) the flat group without TP, as before. The dtypes are
    not searched: they change the numerics, which only the user chooses; the plan's default is
    ``MixedPrecisionPolicy(param_dtype=bf16)`` over fp32 shards, torchtitan's (``mixed_precision_param``)."""
    if all(options.own.get(k) is None for k in MESH_OPTIONS):
        options = replace(options, own={**options.own, "tp": AUTO, "dp_shard": AUTO})
    return mesh_plan(workload, nd, capacity_bytes, options)


def mesh_plan(workload: Workload, nd: int, capacity_bytes: int, options: PlannerOptions,
              until_fit: bool = False, memo: dict | None = None, upto: int | None = None,
              peaks_only: bool = False, only: int | None = None) -> EnginePlan:
    """The plan of the mesh ``options`` give (``auto``: searched): every candidate of ``plan_options`` (cheapest
    first) with the snippet of exactly the configuration predicted; the recommendation is ``recommend``'s
    (``until_fit``: no candidate after it, for the mesh search's ranking; ``memo``, ``upto``, ``peaks_only``,
    ``only``: ``plan_options``')."""
    search = options.own.get("dp_shard") == AUTO
    if options.own.get("tp") == AUTO:  # ``--tp auto``: the smallest TP degree within a node that fits (tp.py)
        if search and options.own.get("dp_replicate") is None:  # and ``--dp-shard auto``: R x S x T (tp_estimate)
            return mesh_search(workload, nd, capacity_bytes, options, mesh_plan, first_fit)
        return tp_search(workload, nd, capacity_bytes, options, mesh_plan)
    if search and options.own.get("dp_replicate") is not None:
        raise ValueError("dp_shard=auto searches the mesh: give no dp_replicate with it")
    if search:  # ``--dp-shard auto``: shard groups of whole nodes (mesh.py shard_sizes)
        options = replace(options, own={**options.own, "dp_shard": None})
    settings = _mesh_settings(workload, nd, options)
    node, t = options.own.get("gpus_per_node") or DEFAULT_GPUS_PER_NODE, settings.tp or 1
    # with tp: N_d / T data-parallel ranks, G / T of them per node (tp innermost, inside a node)
    # (a node of one data-parallel rank, T = G: groups of two nodes and up; FSDP2 at S = 1 is not modelled)
    shards = tuple(s for s in shard_sizes(nd // t, max(1, node // t)) if s >= 2) if search else ()
    options_ = plan_options(workload, nd, capacity_bytes, settings, shards, until_fit, memo, upto, peaks_only, only)
    chosen = next((o for o in options_ if o.fits), None)  # ``recommend``'s choice, without a second search
    candidates = tuple(
        Candidate(f"reshard_after_forward={o.settings.reshard_after_forward}, checkpointing {o.checkpointing}"
                  + (f", mesh {o.settings.dp_replicate} x {o.settings.dp_shard}" if o.settings.dp_replicate else "")
                  + (f", tp {o.settings.tp}" if (o.settings.tp or 1) > 1 else "")
                  + (f", CPUOffloadPolicy(pin_memory={o.settings.pin_memory})" if o.settings.offload_policy == "cpu" else ""),
                  o.estimate, o.fits, o.snippet,
                  trace_inputs=(replace(workload, checkpointing=o.checkpointing), nd,  # the rank it peaks on
                                o.settings.model_copy(update={"rank": o.estimate.peak_rank or 0}), o.run),
                  pins=mesh_pins(o.settings, nd))
        for o in options_
    )  # fmt: skip
    index = None if chosen is None else options_.index(chosen)
    return EnginePlan(candidates, index, PLAN_ORDER, settings)


def _mesh_settings(workload: Workload, nd: int, options: PlannerOptions) -> Settings:
    """The settings ``mesh_plan`` predicts on a mesh ``options`` name: the snippet names the mesh predicted
    (``tp_mesh``) and the foreach path the prediction used."""
    settings = tp_mesh(planner_settings(options), nd)
    if settings.foreach is None:
        settings = settings.model_copy(update={"foreach": workload.foreach})
    return settings


def planner_block_bytes(settings: Settings) -> int:
    """The allocator block every peak term is rounded to (``predict_peak``): 512 on CUDA, none on CPU."""
    return CUDA_BLOCK_BYTES if settings.device == "cuda" else 1
