"""Communication time per optimizer step: an alpha-beta estimate over the collectives of a ZeRO stage.

This is an estimate, not a measurement. A collective over n ranks of S bytes takes

    t = f(op, n) · S / B + steps(op, n) · α

with B the per-GPU bus bandwidth of the slowest link the data-parallel ring crosses and α the latency
of one step. f is the nccl-tests "bus bandwidth" factor (nccl-tests doc/PERFORMANCE.md):
2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter and all-gather, so f·S is what each rank sends
(``Collective.bytes_per_rank``, padding included). Ring: 2(n-1) steps for all-reduce, n-1 otherwise
(Patarasuk & Yuan 2009); an all-to-all (ZeRO++ qgZ) (n-1)/n and n-1 steps, pairwise exchange
(``collectives.PASSES``: nccl-tests ``AlltoAllGetBw``; Thakur, Rabenseifner & Gropp 2005). Tree (NCCL's double binary tree, all-reduce only): 2·ceil(log2 n) steps,
same bandwidth term. Each bucket of ``bucket_numel`` elements is a separate call, so pays α again.

Time per link: with ``Links`` (the intra-node link, the network, the node size, N_m) each collective is
placed on the mesh it names (``zeroplan.formulas.collectives.on_mesh``) and charged to its own link class
and group size: a group inside one node runs on the intra-node link, one that crosses nodes at the slowest
link it crosses (``crossing_link``), with the larger α. HSDP's dp_shard traffic can stay on NVLink while
only the dp_replicate all-reduce crosses the network. A bare ``Link`` charges every collective to it (the
flat model's one ring).

Ignored: protocol choice (LL/LL128/Simple) and achieved vs nominal bandwidth (nccl-tests typically
reaches 70-90% of nominal), NVLink SHARP / in-network reduction, contention with tensor/pipeline
parallel traffic and with other jobs, hierarchical (2-level) algorithms, kernel launch and
synchronisation gaps, stragglers, and the memory traffic of the reduction itself.
"""

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, TypeVar

from zeroplan.formulas.collectives import PASSES, Collective, distinct_rows, on_mesh
from zeroplan.formulas.mesh import DEFAULT_GPUS_PER_NODE
from zeroplan.formulas.sharding import ceil_div
from zeroplan.formulas.stages import get_stage

ALGORITHMS: tuple[str, ...] = ("ring", "tree")

L = TypeVar("L", bound="Link")


class Link(Protocol):
    """What the alpha-beta model reads of a link: ``zeroplan.presets.LinkSpec`` (the presets and options
    build it; the formulas only read it, so they import no preset)."""

    @property
    def name(self) -> str: ...
    @property
    def bandwidth_gbps(self) -> float: ...
    @property
    def alpha_s(self) -> float: ...
    @property
    def bandwidth_bytes_per_s(self) -> float: ...
    def model_copy(self: L, *, update: dict[str, Any] | None = None, deep: bool = False) -> L: ...
FORWARD_SHARE = 1 / 3
"""Forward share of training FLOPs: 2Ψ of 6Ψ per token forward, 4Ψ backward (Kaplan et al. 2020, sec. 2.1)."""


def latency_steps(op: str, n: int, algorithm: str = "ring") -> int:
    """Sequential steps of one call: ring 2(n-1) for all-reduce, n-1 otherwise; tree 2·ceil(log2 n)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
    if n <= 1:
        return 0
    if algorithm == "tree" and op == "all-reduce":
        return 2 * math.ceil(math.log2(n))
    return PASSES[op] * (n - 1)


def alpha_beta_time_s(
    op: str, size_bytes: float, n: int, bandwidth_bytes_per_s: float, alpha_s: float, algorithm: str = "ring"
) -> float:
    """t = f·S/B + steps·α with the nccl-tests bus-bandwidth factor f (2(n-1)/n all-reduce, (n-1)/n else)."""
    if n <= 1:
        return 0.0
    factor = PASSES[op] * (n - 1) / n
    return factor * size_bytes / bandwidth_bytes_per_s + latency_steps(op, n, algorithm) * alpha_s


def ring_link(nd: int, nm: int, gpus_per_node: int, intra: L, inter: Link) -> L:
    """The link that limits the data-parallel ring: intra-node if the whole group fits in one node.

    Model-parallel ranks are placed inside a node first (as Megatron-LM places tensor parallelism), so a
    node holds max(1, gpus_per_node // nm) ranks of one data-parallel group. A ring that leaves the node
    runs at the slowest link it crosses (``crossing_link``).
    """
    if nd <= max(1, gpus_per_node // nm):
        return intra
    return crossing_link(intra, inter)


def crossing_link(intra: L, inter: Link) -> L:
    """A ring that leaves the node: the slowest link it crosses (one NIC per GPU, as in DGX/HGX nodes) and
    the larger α."""
    # every field is replaced, from fields the links' model already checked (``LinkSpec``)
    return intra.model_copy(update=dict(
        name=f"{intra.name} + {inter.name}",
        scope="inter",
        bandwidth_gbps=min(intra.bandwidth_gbps, inter.bandwidth_gbps),
        alpha_s=max(intra.alpha_s, inter.alpha_s),
        source="slowest link of a ring that crosses nodes",
    ))  # fmt: skip


@dataclass(frozen=True)
class Links:
    """The links of a cluster, for time per link: each collective is charged to the link class its group
    spans (``zeroplan.formulas.mesh``) on N_d data-parallel ranks of N_m GPUs each."""

    intra: Link
    inter: Link
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    nm: int = 1

    def of(self, link_class: str) -> Link:
        """The link a group of ``link_class`` runs at: intra-node, or the slowest it crosses."""
        return self.intra if link_class == "intra" else self.crossing

    @cached_property
    def crossing(self) -> Link:
        """``crossing_link(intra, inter)``, made once (``of`` is asked for every collective of a plan)."""
        return crossing_link(self.intra, self.inter)


def _placed(collectives: tuple[Collective, ...], nd: int, link: Link | Links) -> tuple[tuple[Collective, Link], ...]:
    """Each collective with the link it is charged to: its own class's (``Links``), or the one ``Link``."""
    if not isinstance(link, Links):
        return tuple((c, link) for c in collectives)
    return tuple((c, link.of(c.link)) for c in on_mesh(collectives, nd, link.nm, link.gpus_per_node))


def runs_every_micro_step(stage: int, op: str) -> bool:
    """How often a collective runs under gradient accumulation.

    Gradient reductions run every micro-step once gradients are sharded (stage >= 2: DeepSpeed ZeRO-2/3
    reduce each micro-batch's gradients as backward produces them), else once per optimizer step (DDP
    ``no_sync`` and DeepSpeed stage 0/1 accumulate locally and reduce at the boundary). Parameter
    all-gathers run every micro-step at stage 3 (forward and backward), else once after the optimizer step.
    """
    row = get_stage(stage)
    return row.shards_parameters if op == "all-gather" else row.shards_gradients


def calls_per_optimizer_step(stage: int, op: str, grad_accum: int) -> int:
    """Calls of a collective per optimizer step of ``grad_accum`` micro-steps: G if it runs every
    micro-step (``runs_every_micro_step``), else 1. The reference runtime follows it (validate/stage*.py)."""
    if grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum}: must be >= 1")
    return grad_accum if runs_every_micro_step(stage, op) else 1


@dataclass(frozen=True)
class TimedCollective:
    """A collective of one step with how often it runs and how long one call takes."""

    collective: Collective
    every_micro_step: bool
    calls_per_step: int
    seconds_per_call: float

    @property
    def seconds(self) -> float:
        return self.calls_per_step * self.seconds_per_call


@dataclass(frozen=True)
class StepTime:
    """Estimated communication (and optionally compute) time of one optimizer step on one rank."""

    link: str  # the limiting link, e.g. "nvlink4" or "nvlink4 + ib-ndr" (the slowest any collective runs at)
    algorithm: str
    collectives: tuple[TimedCollective, ...]
    compute_s: float | None  # None when no FLOP/s estimate was given
    exposed_comm_s: float | None  # communication not hidden behind compute; None without compute_s

    @cached_property
    def comm_s(self) -> float:
        """All communication run back to back (no overlap); summed once (the text and JSON outputs read it)."""
        return sum(c.seconds for c in self.collectives)

    @property
    def step_s(self) -> float | None:
        return None if self.compute_s is None else self.compute_s + self.exposed_comm_s


def compute_time_s(psi_total: float, tokens: float, nm: int, peak_flops: float, mfu: float) -> float:
    """6·Ψ·tokens FLOPs (Kaplan et al. 2020, sec. 2.1) split over N_m GPUs, at mfu·peak FLOP/s each."""
    return 6 * psi_total * tokens / (nm * peak_flops * mfu)


def exposed_comm_s(timed: tuple[TimedCollective, ...], compute_s: float, grad_accum: int) -> float:
    """Communication left after overlapping each phase's collectives with that phase's compute.

    Per micro-step, forward compute is 1/3 and backward 2/3 of the step's compute / grad_accum;
    collectives of a phase hide behind it up to its length. Collectives that run once per step run in
    the last micro-step; the all-gather after the optimizer step is never hidden.
    """
    phase_compute = {"forward": compute_s / grad_accum * FORWARD_SHARE,
                     "backward": compute_s / grad_accum * (1 - FORWARD_SHARE)}  # fmt: skip
    every = dict.fromkeys(phase_compute, 0.0)
    once = dict.fromkeys(phase_compute, 0.0)
    exposed = 0.0
    for t in timed:
        phase = t.collective.phase
        if phase not in phase_compute:
            exposed += t.seconds
        elif t.every_micro_step:
            every[phase] += t.seconds_per_call
        else:
            once[phase] += t.seconds_per_call
    for phase, f in phase_compute.items():
        exposed += (grad_accum - 1) * max(0.0, every[phase] - f) + max(0.0, every[phase] + once[phase] - f)
    return exposed


def step_time(
    stage: int,
    collectives: tuple[Collective, ...],
    nd: int,
    link: Link | Links,
    grad_accum: int = 1,
    algorithm: str = "ring",
    bucket_numel: int | None = None,
    compute_s: float | None = None,
) -> StepTime:
    """Time of the collectives of one optimizer step (``zeroplan.formulas.collectives.step_collectives``) on ``link``.

    One call of a collective costs bytes_per_rank / B plus α for every step of every bucket
    (``bucket_numel`` elements per bucket; None = one bucket per collective).
    """
    _check_step(grad_accum, bucket_numel)
    placed = _placed(collectives, nd, link)
    timed = tuple(
        TimedCollective(c, runs_every_micro_step(stage, c.op), calls_per_optimizer_step(stage, c.op, grad_accum),
                        _call_seconds(c.op, c.elements, c.bytes_per_rank, c.group_size or nd, on, algorithm,
                                      bucket_numel))
        for c, on in placed
    )  # fmt: skip
    return _step_time(_slowest(placed, link), algorithm, timed, compute_s, grad_accum)


def engine_step_time(
    collectives: tuple[Collective, ...],
    nd: int,
    link: Link | Links,
    grad_accum: int = 1,
    algorithm: str = "ring",
    bucket_numel: int | None = None,
    compute_s: float | None = None,
) -> StepTime:
    """Time of an engine's collectives (``EngineEstimate.collectives``), which already count one optimizer
    step: each row runs in ``Collective.micro_steps`` micro-steps (1 or ``grad_accum``), one call per
    micro-step of 1/micro_steps of its bytes, so nothing is multiplied again (``step_time`` multiplies the
    paper's per-micro-step rows by ``calls_per_optimizer_step``). Exposure (``exposed_comm_s``): a row that
    runs every micro-step hides behind each micro-step's phase, one that runs once behind the last one's.
    """
    _check_step(grad_accum, bucket_numel)
    kinds, rows = distinct_rows(collectives)
    placed = _placed(kinds, nd, link)
    timed = []
    for c, on in placed:
        if c.micro_steps not in (1, grad_accum):
            raise ValueError(f"a {c.op} runs in {c.micro_steps} micro-steps: expected 1 or grad_accum={grad_accum}")
        seconds = _call_seconds(c.op, ceil_div(c.elements, c.micro_steps), c.bytes_per_rank / c.micro_steps,
                                c.group_size or nd, on, algorithm, bucket_numel)  # fmt: skip
        timed.append(TimedCollective(c, c.micro_steps > 1, c.micro_steps, seconds))
    return _step_time(_slowest(placed, link), algorithm, tuple(map(timed.__getitem__, rows)), compute_s, grad_accum)


def _slowest(placed: tuple[tuple[Collective, Link], ...], link: Link | Links) -> Link:
    """The limiting link of a step: the slowest any of its collectives runs at (the intra-node one if none)."""
    default = link.intra if isinstance(link, Links) else link
    return min((on for _, on in placed), key=lambda on: on.bandwidth_gbps, default=default)


def _check_step(grad_accum: int, bucket_numel: int | None) -> None:
    if grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum}: must be >= 1")
    if bucket_numel is not None and bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel}: must be >= 1")


def _call_seconds(op: str, elements: int, nbytes: float, nd: int, link: Link, algorithm: str,
                  bucket_numel: int | None) -> float:
    """One call over ``nd`` ranks (its group): its bytes over the link's bandwidth plus α for every latency
    step of every bucket."""
    buckets = 1 if bucket_numel is None else max(1, ceil_div(elements, bucket_numel))
    return nbytes / link.bandwidth_bytes_per_s + buckets * latency_steps(op, nd, algorithm) * link.alpha_s


def _step_time(link: Link, algorithm: str, timed: tuple[TimedCollective, ...], compute_s: float | None,
               grad_accum: int) -> StepTime:
    exposed = None if compute_s is None else exposed_comm_s(timed, compute_s, grad_accum)
    return StepTime(link.name, algorithm, timed, compute_s, exposed)
