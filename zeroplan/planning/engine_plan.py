"""``plan`` for an engine with its own search (``Engine.plan``: fsdp2, deepspeed): its candidates as plan rows."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from zeroplan.allocator.gc_pause import gc_paused
from zeroplan.allocator.reserved import NO_CUDA_ALLOCATOR, ReservedEstimate, fit_bytes, replayed_on, reserved_of
from zeroplan.engines import get_engine
from zeroplan.engines.base import Candidate
from zeroplan.estimation.workload import model_workload
from zeroplan.formulas.collectives import counted_rows, tp_degree
from zeroplan.formulas.commtime import Links, compute_time_s, engine_step_time, ring_link
from zeroplan.formulas.offload import NO_OFFLOAD, OffloadBreakdown
from zeroplan.planning.config import PlanConfig
from zeroplan.planning.cut_first import cut_first
from zeroplan.planning.records import LAUNCHER_KEYS, Plan, PlanOption
from zeroplan.planning.reserved_fit import AFTER_FIT, NOT_REPLAYED, first_fragmentation, fit_quantity, live_over

@gc_paused()  # its candidates' moments, traces and replays make many objects and free few (allocator/gc_pause.py)
def engine_plan_config(config: PlanConfig) -> Plan:
    """``plan`` for an engine with its own search (``Engine.plan``: fsdp2, deepspeed): every candidate the
    engine tries, cheapest first, each with its predicted peak and exactly the configuration to run; the
    recommendation is the cheapest that fits within the headroom (``reserved_fit``: on reserved bytes)."""
    engine = get_engine(config.engine)
    nd = config.nd
    budget = int(config.memory_bytes * (1 - config.headroom))
    spec = config.model_architecture
    workload = model_workload(spec, config.sequence_length, config.micro_batch, config.checkpointing,
                              config.grad_accum, config.foreach)  # fmt: skip
    options = config.planner_options
    if engine.own_options:  # the node size, for an engine that searches a mesh (fsdp2 --dp-shard auto)
        options = replace(options, own={**options.own, "gpus_per_node": config.gpus_per_node})
    answer = engine.plan(workload, nd, budget, options)
    traced = tuple(engine.alloc_trace is not None and c.trace_inputs is not None for c in answer.candidates)
    on_cpu = tuple(t and not replayed_on(c.trace_inputs[2]) for c, t in zip(answer.candidates, traced))
    # not replayed: a CPU run (no CUDA allocator), or a live peak alone over the budget
    over = tuple(t and (cpu or live_over(c.estimate.peak, budget))
                 for c, t, cpu in zip(answer.candidates, traced, on_cpu))  # fmt: skip
    traces, held, fit, why = replayed_in_order(engine, answer.candidates, traced, over, on_cpu, config, budget)
    recommended = fit.index(True) if True in fit else None
    ring = ring_link(nd, 1, config.gpus_per_node, config.intra_link, config.inter_link)
    links = Links(config.intra_link, config.inter_link, config.gpus_per_node)  # time per link (commtime)
    whole = config.tensor_numels
    tokens = config.tokens_per_micro_step * config.grad_accum
    rows = [candidate_row(config, c, fits_c, reserved, reason, nd, links, sum(whole), tokens)
            for c, fits_c, reserved, reason in zip(answer.candidates, fit, held, why)]  # fmt: skip
    headroom = f"{config.headroom:.0%} of GPU memory kept free"
    recommendation = launchers = advice = None
    if recommended is not None:
        recommendation = rows[recommended]
        chosen = answer.candidates[recommended]
        launchers = dict.fromkeys(LAUNCHER_KEYS)  # the engine's declared launcher: what it predicted, as run
        if engine.launcher is not None:
            launchers[engine.launcher.key] = chosen.launcher
        if engine.launcher is not None and chosen.build is not None:  # how the model is built (deepspeed.zero.Init)
            launchers[f"{engine.launcher.key}_build"] = chosen.build
        reason = (f"the cheapest of {len(rows)} {engine.name} configurations that fits on "
                  f"{config.gpus} GPUs with {headroom} (tried in order: {answer.order})")  # fmt: skip
    else:
        reason = f"no {engine.name} configuration fits on {config.gpus} GPUs with {headroom}"
        least = min((o for o in rows if o.peak is not None), key=lambda o: o.peak.peak_bytes, default=None)
        if least is not None:
            advice = cut_first(least.peak, least.stage, config)
    policy = engine.policy(answer.base)
    replayed = any(t and not cpu for t, cpu in zip(traced, on_cpu))  # "fits" on reserved bytes, else on live ones
    return Plan(
        config=config,
        params=sum(whole),
        psi=sum(whole),
        gpu_memory_bytes=config.memory_bytes,
        budget_bytes=budget,
        host_budget_bytes=None,
        intra=config.intra_link,
        inter=config.inter_link,
        ring=ring,
        host_link=config.host_link,
        tokens_per_step=tokens,
        activation_bytes=None,  # in the peak of every candidate (their checkpointing), not apart
        bytes_per_param=policy.bytes_per_param,
        k=policy.k,
        options=tuple(rows),
        recommendation=recommendation,
        reason=reason,
        launchers=launchers,
        fit_basis=f"fits on {fit_quantity(config.alloc_conf if replayed else None)} ({engine.name} engine, "
                  f"docs/engines/{engine.name}.md) within the headroom",
        cut_first=advice,
        fragmentation=first_fragmentation(rows, traces, budget, config.micro_batch),
    )  # fmt: skip


def replayed_in_order(engine, candidates, traced, over, on_cpu, config: PlanConfig, budget: int) -> tuple[list, ...]:
    """Each candidate's allocation trace, reserved bytes, fit and why it has no reserved bytes (None: it has), in
    the engine's order: replayed up to the first row that fits, every row with ``--replay-all``
    (``reserved_fit.AFTER_FIT``); a row over the budget on its live peak alone, or on a CPU, is never replayed."""
    traces: list = []
    held: list[Optional[ReservedEstimate]] = []
    fit: list[Optional[bool]] = []
    why: list[Optional[str]] = []
    for c, t, o, cpu in zip(candidates, traced, over, on_cpu):
        trace = reserved = fits_c = None
        reason = NO_CUDA_ALLOCATOR if cpu else NOT_REPLAYED if o else None
        if t and not o and True in fit and not config.replay_all:
            reason = AFTER_FIT
        else:
            trace = engine.alloc_trace(*c.trace_inputs)[0] if t and not o else None
            reserved = None if trace is None else reserved_of(trace, config.alloc_conf)
            fits_c = fit_bytes(c.estimate.model_states_bytes, c.estimate.peak, reserved) <= budget
        traces.append(trace)
        held.append(reserved)
        fit.append(fits_c)
        why.append(reason)
    return traces, held, fit, why


def candidate_row(config: PlanConfig, c: Candidate, fits_c: Optional[bool], reserved: Optional[ReservedEstimate],
                  not_replayed: Optional[str], nd: int, links: Links, psi: int, tokens: int) -> PlanOption:
    """One candidate of the engine's search as a plan row (psi: the model's parameters, Ψ): its peak, fit (None:
    not decided, ``AFTER_FIT``), reserved bytes (``not_replayed``: why none), comm and step time, and host offload."""
    e = c.estimate
    counted = counted_rows(e.collectives)  # each distinct row and its count: integer sums, exact (a speed-up)
    # a data-parallel rank's tokens, its 6·Ψ·tokens FLOPs split over the T GPUs of its tensor-parallel group
    compute_s = None if config.flops is None else compute_time_s(psi, tokens, tp_degree(tuple(k for k, _ in counted)), config.flops,
                                                                 config.mfu)  # fmt: skip
    # the engine's rows count one optimizer step (EngineEstimate.collectives): not multiplied again
    time = engine_step_time(e.collectives, nd, links, config.grad_accum, config.algorithm, c.bucket_numel,
                            compute_s)  # fmt: skip
    host = e.host  # the engine's own offload (DeepSpeed offload_optimizer/offload_param): host bytes per rank
    return PlanOption(
        e.stage, e.label, NO_OFFLOAD if host is None else host.offload, None, None,
        states=OffloadBreakdown(e.memory, 0, 0, 0, 0, 0, 0) if host is None else
        OffloadBreakdown(e.memory, host.host_bytes, 0, host.h2d_bytes, host.d2h_bytes, 0, 0),
        fits=fits_c,
        comm_volume_elements=sum(k.volume_elements * n for k, n in counted),
        comm_bytes_per_rank=sum(k.bytes_per_rank * n for k, n in counted),
        time=time,
        pcie_s=0.0 if host is None else max(host.h2d_bytes, host.d2h_bytes) / config.host_link.bandwidth_bytes_per_s,
        peak=e.peak,
        candidate=c.label,
        peak_rank=e.peak_rank,
        reserved=reserved,
        host=host,
        not_replayed=not_replayed,
        pins=c.pins,
    )  # fmt: skip
