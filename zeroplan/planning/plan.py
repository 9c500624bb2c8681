"""Capacity planning: does a model fit, on how few GPUs, how large a model fits, and what to run.

Every number comes from the pure formulas (``zeroplan.formulas.memory`` via ``zeroplan.formulas.offload``,
``zeroplan.formulas.collectives``, ``zeroplan.formulas.commtime``); this module only searches over them:

- fit: per-GPU model states <= (1 - headroom) x GPU memory (and offloaded bytes <= host memory if given);
- ``max_params``: the largest whole-model Ψ that fits on N_d x N_m GPUs. With headroom 0 it is the ZeRO
  paper's "theoretical max" of Table 2 (model states only, Ψ/N_m per GPU, sharded over N_d);
- ``min_gpus``: the fewest GPUs N_d x N_m (N_m fixed) that fit, up to ``MAX_GPUS``; None when no N_d fits
  (stages 0 and 1 keep a full copy of parameters or gradients, so some models never fit);
- the recommendation: the first option, in order of increasing communication and offload cost, that fits.

With an architecture every option is decided on the engine's peak per GPU; an offload option on its
stage's peak with the offloaded model states on the host (``zeroplan.planning.offload_peak``). The advice
on what to cut is ``zeroplan.planning.cut_first``; an engine with its own search answers through
``zeroplan.planning.engine_plan``.
"""

from __future__ import annotations

import os
from typing import Annotated, Callable, Optional

from pydantic import ConfigDict, Field

from zeroplan.engines import get_engine
from zeroplan.allocator.reserved import fit_bytes, reserved_of
from zeroplan.architectures.limits import check_total
from zeroplan.engines.base import EngineOptions
from zeroplan.estimation.live import is_optimizer
from zeroplan.formulas.activations import activation_bytes
from zeroplan.formulas.collectives import step_collectives
from zeroplan.formulas.commtime import Links, compute_time_s, ring_link, step_time
from zeroplan.formulas.offload import NO_OFFLOAD, Offload, OffloadBreakdown, offloaded_states
from zeroplan.formulas.sharding import shard_numel
from zeroplan.formulas.stages import get_stage
from zeroplan.number_formats import format_bytes
from zeroplan.planning.config import PlanConfig
from zeroplan.planning.cut_first import cut_first
from zeroplan.planning.engine_plan import engine_plan_config
from zeroplan.planning.records import Plan, PlanOption
from zeroplan.planning.ladder_peaks import option_peaks
from zeroplan.planning.reserved_fit import NOT_REPLAYED, first_fragmentation, live_over
from zeroplan.policy import BF16_MIXED, PrecisionPolicy
from zeroplan.types import ByteCount, Flag, GpuCount, Numel, StageNumber, checked_call

_STRICT = ConfigDict(arbitrary_types_allowed=True)
"""Public search functions check their arguments with the types of ``zeroplan.types`` (ValidationError,
never a TypeError or a wrong answer: ``min_gpus((), ...)`` used to return 1, ``max_params(nan, ...)`` 0)."""


MAX_GPUS = 2**20
"""``min_gpus`` searches N_d x N_m up to this many GPUs; a model that needs more is reported as None."""
MAX_PARAMS = 10**18
"""``max_params`` above this means the GPU holds no model state that grows with Ψ (everything offloaded)."""
PADDING_SCAN = 4096
"""N_d values tried above the padding-free bound in ``min_gpus`` (padding adds < N_d elements per tensor)."""

_CPU, _NVME = Offload("cpu"), Offload("nvme")
LADDER: tuple[tuple[int, Offload], ...] = (
    (0, NO_OFFLOAD),
    (1, NO_OFFLOAD),
    (2, NO_OFFLOAD),
    (1, _CPU),
    (2, _CPU),
    (3, NO_OFFLOAD),
    (3, _CPU),
    (3, Offload("cpu", "cpu")),
    (3, _NVME),
    (3, Offload("nvme", "nvme")),
)
"""Options from cheapest to dearest, as the Hugging Face DeepSpeed guide ranks them for speed: stage 0 >
1 > 2 > 2 + offload > 3 > 3 + offloads (transformers docs, "How to choose which ZeRO stage and offloads
to use"); NVMe after CPU (ZeRO-Infinity, Rajbhandari et al. 2021: NVMe bandwidth is lower than PCIe)."""
TIERS: tuple[str, ...] = ("none", "cpu", "nvme")


def tier(offload: Offload) -> str:
    """The deepest device an option offloads to: 'none' < 'cpu' < 'nvme'."""
    return max(offload.optimizer, offload.params, key=TIERS.index)


def rank_states(
    numels: tuple[int, ...],
    nd: int,
    stage: int,
    offload: Offload = NO_OFFLOAD,
    policy: PrecisionPolicy = BF16_MIXED,
    micro_steps: int = 1,
    flat_layout: bool = True,
) -> OffloadBreakdown:
    """Model states of one rank (GPU, host, NVMe) and its offload traffic, for one MP rank's tensors."""
    return offloaded_states(
        numels, nd, stage, offload, policy.param_bytes, policy.grad_bytes, policy.states, policy.master_dtype,
        micro_steps, flat_layout,
    )  # fmt: skip


def fits(states: OffloadBreakdown, gpu_budget_bytes: int, host_budget_bytes: Optional[int] = None) -> bool:
    """GPU model states within the GPU budget and, when a host budget (per GPU) is given, host bytes too."""
    host_ok = host_budget_bytes is None or states.host_bytes <= host_budget_bytes
    return states.gpu.model_states_bytes <= gpu_budget_bytes and host_ok


@checked_call(_STRICT)
def max_params(
    gpu_budget_bytes: ByteCount,
    stage: StageNumber,
    nd: GpuCount,
    nm: GpuCount = 1,
    offload: Offload = NO_OFFLOAD,
    policy: PrecisionPolicy = BF16_MIXED,
    host_budget_bytes: Optional[ByteCount] = None,
) -> Optional[int]:
    """Largest whole-model Ψ whose per-GPU states fit (ZeRO Table 2: Ψ/N_m per GPU, sharded over N_d).

    Ψ is one bare tensor per MP rank (``ceil(Ψ/N_m)`` elements, padded to N_d at sharded stages), and
    memory never decreases with Ψ, so doubling then bisection over integers finds the exact answer.
    Returns 0 if not even one parameter fits, None if no Ψ up to ``MAX_PARAMS`` fills the GPU.
    """

    def ok(psi: int) -> bool:
        states = rank_states((shard_numel(psi, nm),), nd, stage, offload, policy, flat_layout=False)
        return fits(states, gpu_budget_bytes, host_budget_bytes)

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi):
        if hi > MAX_PARAMS:
            return None
        lo, hi = hi, hi * 2
    return _bisect_last_true(ok, lo, hi)


@checked_call(_STRICT)
def min_gpus(
    tensor_numels: Annotated[tuple[Numel, ...], Field(min_length=1)],
    gpu_budget_bytes: ByteCount,
    stage: StageNumber,
    nm: GpuCount = 1,
    offload: Offload = NO_OFFLOAD,
    policy: PrecisionPolicy = BF16_MIXED,
    host_budget_bytes: Optional[ByteCount] = None,
    flat_layout: Flag = True,
) -> Optional[int]:
    """Fewest GPUs N_d x N_m (N_m = ``nm`` fixed) on which the whole model's tensors fit; None if none do.

    Without padding, memory never increases with N_d (a shard is ceil(n/N_d)), so the padding-free bound
    is bisected first; the exact (padded) memory is at least that bound and exceeds it by fewer than N_d
    elements per tensor, so a short upward scan from there finds the exact answer.
    """
    check_total(tensor_numels)  # each size is checked by its type, their sum here
    numels = tuple(shard_numel(n, nm) for n in tensor_numels)

    def ok(nd: int, layout: bool) -> bool:
        states = rank_states(numels, nd, stage, offload, policy, flat_layout=layout)
        return fits(states, gpu_budget_bytes, host_budget_bytes)

    max_nd = MAX_GPUS // nm
    if max_nd < 1 or not ok(max_nd, False):
        return None
    first = _bisect_first_true(lambda nd: ok(nd, False), 1, max_nd)
    for nd in range(first, min(max_nd, first + PADDING_SCAN) + 1):
        if ok(nd, flat_layout):
            return nd * nm
    return None


def _bisect_last_true(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest x in [lo, hi) with ok(x), given ok(lo) and not ok(hi) and ok monotone decreasing."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _bisect_first_true(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """Smallest x in [lo, hi] with ok(x), given ok(hi) and ok monotone increasing."""
    if ok(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _option(
    config: PlanConfig, stage: int, offload: Offload, tensors, links, compute_s, budget, host, peak=None, trace=None,
    traced: bool = False,
) -> PlanOption:
    """One option of the ladder; ``tensors``: (the model's tensor sizes, ``config.tensor_numels`` built once;
    those of one MP rank), or (None, None); ``traced``: the engine has its trace (``trace`` None: not built,
    its live peak alone exceeding the budget)."""
    whole, numels = tensors
    row = get_stage(stage)
    nm, nd, policy = config.model_parallel, config.nd, config.policy
    # The searches' bodies (``raw_function``): the config has checked every argument once already, and
    # re-validating the 1,137 tensor sizes of llama3-405b per option cost a tenth of the plan's time.
    whole_gpu = max_params.raw_function(config.memory_bytes, stage, nd, nm, offload, policy, host)
    sizes = dict(  # with no headroom the budget is the whole GPU: one search
        max_params=whole_gpu,
        max_params_with_headroom=whole_gpu if budget == config.memory_bytes else
        max_params.raw_function(budget, stage, nd, nm, offload, policy, host),
    )  # fmt: skip
    if numels is None:
        return PlanOption(stage, row.name, offload, **sizes)
    layout = config.params is None  # a model's tensors (a preset, a config file, a live module): flat groups
    states = rank_states(numels, nd, stage, offload, policy, config.grad_accum, layout)
    collectives = step_collectives(stage, numels, nd, policy.param_dtype, policy.resolved_grad_dtype, layout)
    time = step_time(
        stage, collectives, nd, links, config.grad_accum, config.algorithm, config.bucket_numel, compute_s
    )
    volume = sum(t.calls_per_step * t.collective.volume_elements for t in time.collectives)
    skipped = traced and live_over(peak, budget)  # reserved >= live: settled without the replay
    held = None if trace is None or skipped else reserved_of(trace, config.alloc_conf)
    need = fit_bytes(states.gpu.model_states_bytes, peak, held)
    return PlanOption(
        stage, row.name, offload, **sizes,
        states=states,
        fits=fits(states, budget, host) if peak is None else need <= budget and fits(states, budget, host),
        peak=peak,
        reserved=held,
        not_replayed=NOT_REPLAYED if skipped else None,
        min_gpus=min_gpus.raw_function(whole, budget, stage, nm, offload, policy, host, layout),
        comm_volume_elements=volume,
        comm_bytes_per_rank=sum(t.calls_per_step * t.collective.bytes_per_rank for t in time.collectives),
        time=time,
        pcie_s=max(states.h2d_bytes, states.d2h_bytes) / config.host_link.bandwidth_bytes_per_s,
    )  # fmt: skip


def _recommend(config: PlanConfig, options: tuple[PlanOption, ...]) -> tuple[Optional[PlanOption], str]:
    if options[0].fits is None:
        return None, "no model given (--model or --params): only the largest model that fits is reported"
    allowed = TIERS[: TIERS.index(config.offload) + 1]
    by_key = {(o.stage, o.offload): o for o in options}
    ladder = [by_key[key] for key in LADDER if tier(key[1]) in allowed]
    headroom = f"{config.headroom:.0%} of GPU memory kept free"
    for o in ladder:
        if o.fits:
            return o, f"the cheapest option that fits on {config.gpus} GPUs with {headroom}"
    feasible = [o for o in ladder if o.min_gpus is not None]
    if not feasible:
        return None, f"no option fits on up to {MAX_GPUS} GPUs with {headroom}"
    best = min(feasible, key=lambda o: o.min_gpus)
    if any(o.peak is not None for o in options):  # min_gpus counts model states: a lower bound on the peak's
        return None, (
            f"nothing fits on {config.gpus} GPUs with {headroom} (offload allowed: {config.offload}); "
            f"the fewest GPUs whose model states fit: {best.min_gpus} with stage {best.label} (a lower "
            "bound: the peak adds activations and buffers)"
        )
    return None, (
        f"nothing fits on {config.gpus} GPUs with {headroom} (offload allowed: {config.offload}); "
        f"the fewest GPUs that fit: {best.min_gpus} with stage {best.label}"
    )


def plan_config(config: PlanConfig) -> Plan:
    """Evaluate every (stage, offload) option of ``config`` and recommend one; an engine with its own
    search (``Engine.plan``) answers through ``engine_plan_config``."""
    if get_engine(config.engine).plan is not None:
        return engine_plan_config(config)
    nm, nd = config.model_parallel, config.nd
    budget = int(config.memory_bytes * (1 - config.headroom))
    host = None
    if config.host_memory_bytes is not None:
        host = config.host_memory_bytes // min(config.gpus_per_node, config.gpus)
    whole = config.tensor_numels
    numels = None if whole is None else tuple(shard_numel(n, nm) for n in whole)
    ring = ring_link(nd, nm, config.gpus_per_node, config.intra_link, config.inter_link)
    links = Links(config.intra_link, config.inter_link, config.gpus_per_node, nm)  # time per link (commtime)
    tokens = config.tokens_per_micro_step * config.grad_accum
    compute_s = None
    if whole is not None and config.flops is not None:
        compute_s = compute_time_s(sum(whole), tokens, nm, config.flops, config.mfu)
    keys = tuple((s, NO_OFFLOAD) for s in range(4)) + tuple(k for k in LADDER if k[1].any)
    peaks, fit_basis, traces = option_peaks(config, keys, budget_bytes=budget)
    options = tuple(
        _option(config, s, off, (whole, numels), links, compute_s, budget, host, peaks.get((s, off)),
                traces.get((s, off)), (s, off) in traces)
        for s, off in keys
    )  # fmt: skip
    recommendation, reason = _recommend(config, options)
    allowed = [k for k in LADDER if tier(k[1]) in TIERS[: TIERS.index(config.offload) + 1]]
    by_key = {(o.stage, o.offload): o for o in options}
    fragmentation = first_fragmentation([by_key[k] for k in allowed], [traces.get(k) for k in allowed], budget,
                                        config.micro_batch)  # fmt: skip
    advice = None
    with_peak = [o for o in options if o.peak is not None]
    if with_peak:
        target = recommendation if recommendation is not None and recommendation.peak is not None else None
        target = target or min(with_peak, key=lambda o: o.peak.peak_bytes)
        key = (target.stage, target.offload)
        advice = cut_first(target.peak, target.stage, config, peaks.get((target.stage + 1, target.offload)),
                           lambda: option_peaks(config, (key,), 2 * config.nd, traced=False)[0].get(key))  # fmt: skip
    spec = config.transformer
    activations = None
    if spec is not None:  # N_m taken as tensor parallelism with sequence parallelism (formulas.activations)
        activations = activation_bytes(
            spec, config.sequence_length, config.micro_batch, config.checkpointing, nm
        )
    return Plan(
        config=config,
        params=None if whole is None else sum(whole),
        psi=None if numels is None else sum(numels),
        gpu_memory_bytes=config.memory_bytes,
        budget_bytes=budget,
        host_budget_bytes=host,
        intra=config.intra_link,
        inter=config.inter_link,
        ring=ring,
        host_link=config.host_link,
        tokens_per_step=tokens,
        activation_bytes=activations,
        bytes_per_param=config.policy.bytes_per_param,
        k=config.policy.k,
        options=options,
        recommendation=recommendation,
        reason=reason,
        launchers=None,  # the rows are the reference runtime's: no other engine's configuration is printed
        fit_basis=fit_basis,
        cut_first=advice,
        fragmentation=fragmentation,
    )


def plan(model: Optional[str] = None, params: Optional[float] = None, **options: object) -> Plan:
    """Plan training ``model`` (a preset name) or ``params`` (Ψ) on a GPU preset or memory size.

    Keywords are ``PlanConfig`` fields, e.g. ``zeroplan.plan("llama2-70b", gpu="h100-80gb", gpus=64)``
    or ``zeroplan.plan(gpu_memory_bytes=32 * 10**9, gpus=64)`` (ZeRO Table 2). Raises ValueError or
    ``pydantic.ValidationError`` on bad input. An engine's own options are keywords too
    (``zeroplan.plan("llama2-7b", gpu="h100-80gb", engine="fsdp2", param_dtype="bf16")``; ``ds_config=``
    for deepspeed): they go to ``PlanConfig.engine_options``. ``model`` may be a ``torch.nn.Module``, with
    ``optimizer=<torch.optim.Optimizer>``: read as ``estimate`` reads them (``planning/live.py``).
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):  # a torch.nn.Module (planning/live.py)
        from zeroplan.planning.live import live_plan_config

        return plan_config(live_plan_config(model, params, options))
    if is_optimizer(options.get("optimizer")):
        raise ValueError(f"optimizer={type(options['optimizer']).__name__}: an optimizer object needs model=<the "
                         "torch.nn.Module it trains>")  # fmt: skip
    mine = {k: options.pop(k) for k in list(options) if k not in PlanConfig.model_fields}  # the engine's, by name
    if mine:
        options["engine_options"] = EngineOptions(**mine)
    if model is not None and mine.get("ds_config") is not None:  # the file's batch (run_batch), at the planned N_d
        from zeroplan.estimation.estimate import api_batch

        fields = PlanConfig.model_fields
        options["micro_batch"], options["grad_accum"] = api_batch(
            options.get("engine", fields["engine"].default), mine["ds_config"],
            options.get("gpus", fields["gpus"].default),
            options.get("model_parallel", fields["model_parallel"].default),
            options.get("micro_batch"), options.get("grad_accum"))  # fmt: skip
    return plan_config(PlanConfig(model=model, params=params, **options))
