"""``zeroplan plan --engine deepspeed``: the configurations DeepSpeed's planner tries, the one it recommends,
each with the ds_config of exactly that prediction (``to_ds_config``), and the planner hooks of the engine
contract (``planner_settings``, ``planner_policy``, ``planner_plan``, ``planner_block_bytes``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Optional

from zeroplan.engines.base import (Candidate, EngineEstimate, EngineOption, EnginePlan, PeakLimit,
                                   PlannerOptions, Workload)
from zeroplan.engines.deepspeed.build import at_stage, build_snippet, build_update, check_hf_build, check_zero_init
from zeroplan.engines.deepspeed.moe import zero3_moe_limit
from zeroplan.engines.deepspeed.moe12 import model_numel, zero12_moe_limit
from zeroplan.engines.deepspeed.profile import estimate
from zeroplan.engines.deepspeed.offload import offload_label
from zeroplan.engines.deepspeed.offload_terms import offloads
from zeroplan.engines.deepspeed.config import parse_ds_config
from zeroplan.engines.deepspeed.offload_settings import NO_TARGET, OffloadTarget, read_target
from zeroplan.engines.deepspeed.zeropp import all_secondaries_numel
from zeroplan.engines.deepspeed.zeropp_settings import ZEROPP_KEYS, node_keys
from zeroplan.formulas.dtypes import BYTES_PER_ELEMENT
from zeroplan.engines.deepspeed.settings import Settings, to_ds_config
from zeroplan.formulas.collectives import on_mesh
from zeroplan.formulas.mesh import DEFAULT_GPUS_PER_NODE
from zeroplan.architectures.spec import TransformerSpec
from zeroplan.formulas.dropout import dropout_limit
from zeroplan.policy import PrecisionPolicy
from zeroplan.types import show


BUCKET_CHOICES: tuple[int, ...] = (500_000_000, 200_000_000, 50_000_000, 5_000_000)
"""Bucket sizes ``recommend`` tries (elements): DeepSpeed's default, then smaller ones as its docs suggest
for memory-bound runs (``reduce_bucket_size`` / ``allgather_bucket_size``)."""


@dataclass(frozen=True)
class Recommendation:
    """The configuration ``recommend`` chose, its prediction, and what it tried."""

    settings: Settings
    estimate: EngineEstimate
    ds_config: dict
    tried: tuple[tuple[int, int, int], ...]
    """(stage, bucket elements, predicted peak bytes) of every candidate, in the order tried."""


def candidates(base: Settings) -> tuple[tuple[str, Settings], ...]:
    """What ``recommend`` tries: ``plain_candidates``, then ``offload_candidates``. ``ranked`` orders them."""
    return (*plain_candidates(base), *offload_candidates(base))


def plain_candidates(base: Settings) -> tuple[tuple[str, Settings], ...]:
    """ZeRO-1, 2, 3 with each of ``BUCKET_CHOICES``, then ZeRO-3 without prefetch (``stage3_prefetch_bucket_size``
    0: a module's parameters are released after use unless reused within ``stage3_max_reuse_distance``,
    ``stage3_schedule``; more all-gathers, no overlap); no offload."""
    out = []
    plain = {"offload_optimizer": NO_TARGET, "offload_param": NO_TARGET}
    for stage, prefetch in ((1, None), (2, None), (3, None), (3, 0)):
        for bucket in BUCKET_CHOICES:
            update = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket, **plain,
                      **at_stage(stage)}
            if stage < 3:  # ZeRO++ is ZeRO-3's (zeropp_settings.py): the file's hpZ/qwZ keys do not carry down
                update.update(hpz_partition_size=1, quantized_weights=False)
            if prefetch is not None:
                update["prefetch_bucket_size"] = prefetch
            label = _bucket_label(stage, bucket) + (", no prefetch" if prefetch == 0 else "")
            out.append((label, base.model_copy(update=update)))
    return tuple(out)


def _bucket_label(stage: int, bucket: int) -> str:
    return f"ZeRO-{stage}, buckets {bucket:.0e}".replace("e+0", "e")


def hpz_candidates(base: Settings, nd: int, gpus_per_node: int, numels: tuple[int, ...] = (),
                   capacity_bytes: Optional[int] = None) -> tuple[tuple[str, Settings], ...]:
    """ZeRO-3 with ZeRO++ hpZ over one node (``zero_hpz_partition_size`` = GPUs per node) at each of
    ``BUCKET_CHOICES``: every rank also keeps a secondary partition of the parameters, 1/H of the model in the
    model dtype, and the backward all-gathers run inside the node (``zeropp.py``), so fewer bytes cross nodes.
    None where hpZ moves nothing off the network or DeepSpeed refuses it: N_d within one node, or not a
    multiple of the node (utils/groups.py ``_create_zero_param_parallel_group`` asserts that H divides the
    world), and where every parameter's secondary partition (``numels``), alive from ``deepspeed.initialize``
    to the first step's end (``zeropp.py``), is alone more than ``capacity_bytes``: no hpZ row could fit (as
    the offload rows, estimated only where they can be the answer). The planner asks only where the ds_config
    does not set the key (``planner_plan``)."""
    if gpus_per_node <= 1 or nd <= gpus_per_node or nd % gpus_per_node:
        return ()
    secondaries = all_secondaries_numel(numels, nd, gpus_per_node) * BYTES_PER_ELEMENT[base.dtype]
    if capacity_bytes is not None and secondaries > capacity_bytes:
        return ()
    plain = {"offload_optimizer": NO_TARGET, "offload_param": NO_TARGET}
    return tuple((f"{_bucket_label(3, bucket)}, hpZ {gpus_per_node}",
                  base.model_copy(update={"stage": 3, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                          "hpz_partition_size": gpus_per_node, **plain}))
                 for bucket in BUCKET_CHOICES)  # fmt: skip


def offload_candidates(base: Settings) -> tuple[tuple[str, Settings], ...]:
    """``candidates``' offload rows, DeepSpeed's default buckets: ``offload_optimizer`` cpu at ZeRO-1, 2 and 3,
    then ZeRO-3 with ``offload_param`` too (ZeRO-Offload and ZeRO-Infinity's CPU half); the file's own offload
    sections (``pin_memory``) where it has them. None where the base cannot offload (BF16_Optimizer:
    ``Settings``' checks)."""
    opt = base.offload_optimizer if base.offload_optimizer.on else OffloadTarget(device="cpu")
    prm = base.offload_param if base.offload_param.on else OffloadTarget(device="cpu")
    out = []
    for stage, param in ((1, NO_TARGET), (2, NO_TARGET), (3, NO_TARGET), (3, prm)):
        update = {"stage": stage, "reduce_bucket_size": BUCKET_CHOICES[0], "allgather_bucket_size": BUCKET_CHOICES[0],
                  **at_stage(stage)}
        try:
            s = Settings.model_validate({**base.model_dump(), **update, "offload_optimizer": opt, "offload_param": param})
        except ValueError:
            continue
        out.append((f"ZeRO-{stage}, {offload_label(s)}", s))
    return tuple(out)


def inter_node_bytes_per_step(est: EngineEstimate, nd: int, gpus_per_node: int) -> int:
    """Bytes one rank sends per optimizer step over the network between nodes: those of its collectives whose
    group spans nodes (``formulas/collectives.py on_mesh``: a flat group of N_d > GPUs per node does; hpZ's
    secondary group of one node does not)."""
    return sum(c.bytes_per_rank for c in on_mesh(est.collectives, nd, 1, gpus_per_node) if c.link == "inter")


def sent_bytes_per_step(est: EngineEstimate) -> int:
    """Bytes one rank sends per optimizer step as ``zeroplan plan`` prints them (its sent/rank/step column,
    planning/engine_plan.py ``engine_plan_config``): the ring bytes of the estimate's collectives, which count
    one optimizer step already (``EngineEstimate.collectives``; every micro-step's calls included)."""
    return sum(c.bytes_per_rank for c in est.collectives)


@dataclass(frozen=True)
class Tried:
    """One candidate, estimated once: its label, settings, estimate, predicted peak and bytes sent per step (of
    them across nodes: ``inter_node_bytes_per_step``)."""

    label: str
    settings: Settings
    estimate: EngineEstimate
    peak_bytes: int
    sent_bytes: int
    inter_node_bytes: int = 0


PLAN_ORDER = ("no offload before offload (PCIe traffic and a CPU optimizer step), then the fewest bytes sent per "
              "rank per step (the sent/rank/step column), then the largest bucket (fewest calls, each paying the link "
              "latency), then the lowest ZeRO stage")
"""What ``ranked`` orders by, as the plan states it. DeepSpeed's ZeRO-1/2 all-reduce their gradients
(``use_multi_rank_bucket_allreduce``: 2 passes, not a reduce-scatter's 1) and all-gather the flat group, so
they send about as much as ZeRO-3 (gathers in forward and backward, a reduce-scatter) and, with small
parameters kept gathered (``stage3_param_persistence_threshold``), more: "lowest stage = least traffic",
the order before, is not true of DeepSpeed."""
PLAN_ORDER_HPZ = PLAN_ORDER.replace("then the fewest bytes sent per rank per step",
                                    "then the fewest bytes sent across nodes per rank per step (hpZ all-gathers "
                                    "inside a node in backward), then the fewest bytes sent per rank per step")
"""``PLAN_ORDER`` with the hpZ rows (``hpz_candidates``): without them the bytes across nodes are every
candidate's whole traffic (N_d over more than one node) or none (one node), so the order is the same."""


def ranked(workload: Workload, nd: int, base: Settings, stat_bytes: Optional[int] = None,
           which: Optional[Callable[[Settings], tuple[tuple[str, Settings], ...]]] = None,
           gpus_per_node: int = DEFAULT_GPUS_PER_NODE) -> tuple[Tried, ...]:
    """Every one of ``candidates`` (or ``which(base)``) estimated once, in the plan's order (``PLAN_ORDER``,
    ``PLAN_ORDER_HPZ``; ties keep the order of ``candidates``: the lower stage, prefetch before none)."""
    out = []
    for label, s in (which or candidates)(base):
        (est,) = estimate(workload, nd, s, stat_bytes)
        peak = est.peak.peak_bytes if est.peak is not None else est.model_states_bytes
        out.append(Tried(label, s, est, peak, sent_bytes_per_step(est),
                         inter_node_bytes_per_step(est, nd, gpus_per_node)))
    return tuple(sorted(out, key=lambda t: (offloads(t.settings), t.inter_node_bytes, t.sent_bytes,
                                            -t.settings.reduce_bucket_size)))  # fmt: skip


def recommend(workload: Workload, nd: int, memory_bytes: int, base: Settings,
              stat_bytes: Optional[int] = None) -> Optional[Recommendation]:
    """The first of ``ranked`` (``PLAN_ORDER``) whose predicted peak fits ``memory_bytes``; None when none
    does. Other keys come from ``base``."""
    tried = []
    for t in ranked(workload, nd, base, stat_bytes):
        tried.append((t.settings.stage, t.settings.reduce_bucket_size, t.peak_bytes))
        if t.peak_bytes <= memory_bytes:
            ds = to_ds_config(t.settings, workload.micro_batch, workload.grad_accum)
            return Recommendation(t.settings, t.estimate, ds, tuple(tried))
    return None


# --- the planner's side (estimate, plan, sweep): options -> Settings, the byte convention, the plan ----------

PLANNER_OPTIONS: tuple[str, ...] = ("stage",)
"""The shared ``PlannerOptions`` fields DeepSpeed reads: ``--stage`` (its file: ``VOCABULARY``)."""


def check_ds_config(v: object) -> dict:
    """``ds_config``: a parsed ``ds_config.json`` (a JSON object); its keys are read by ``Settings.from_ds_config``."""
    if not isinstance(v, Mapping):
        raise ValueError(f"ds_config={show(v)}: expected a parsed ds_config.json (a dict)")
    return dict(v)


def planner_settings(options: PlannerOptions) -> Settings:
    """DeepSpeed's ``Settings`` from ``--deepspeed-config`` (absent keys: DeepSpeed 0.19.8's defaults) and
    ``--stage`` (fills in a config without a stage; a contradiction is refused)."""
    config = dict(options.own.get("ds_config") or {})
    zero = config.get("zero_optimization")
    if options.stage is None and not (isinstance(zero, dict) and "stage" in zero):
        raise ValueError("--engine deepspeed needs the ZeRO stage: give --stage or zero_optimization.stage in "
                         "--deepspeed-config")  # fmt: skip
    return on_device(Settings.from_ds_config(config, options.stage, **build_update(options.own)), options)


def on_device(settings: Settings, options: PlannerOptions) -> Settings:
    """``settings`` on the planner's device: ``device`` (own option; None: cuda, a planner predicts the GPU) and
    the ``--gpu`` preset's compute capability (``PlannerOptions.gpu_capability``; None: H100/H200's (9, 0))."""
    update: dict = {"device": options.own.get("device") or "cuda", **node_keys(options.own)}
    if options.gpu_capability is not None:  # the --gpu preset's: sizes the cuBLAS workspaces
        update["cuda_capability"] = tuple(options.gpu_capability)
    return settings.model_copy(update=update)


def _device(value: object) -> str:
    """``--device`` (``Settings.device``): cuda or cpu."""
    if value not in ("cuda", "cpu"):
        raise ValueError(f"device={value!r}: expected cuda or cpu")
    return value  # type: ignore[return-value]


VOCABULARY: tuple[EngineOption, ...] = (
    EngineOption("ds_config", check_ds_config, None, "the parsed ds_config.json (None: DeepSpeed's defaults)"),
    EngineOption("zero_init", check_zero_init, None, "ZeRO-3: the model built under deepspeed.zero.Init (default at "
                 "stage 3) or whole, then partitioned by deepspeed.initialize"),
    EngineOption("hf_zero3_build", check_hf_build, None, "ZeRO-3 under zero.Init, a transformers model: built by "
                 "transformers (an HfDeepSpeedConfig alive: from_config, the HF Trainer) or by the script (default)"),
    EngineOption("device", _device, None,
                 "cuda (default) or cpu (the CPU accelerator: no CUDA block rounding or library workspaces)"),
)  # fmt: skip
"""DeepSpeed's own vocabulary, declared once (``Engine.own_options``): its ``ds_config.json`` and
``Settings.zero_init`` (None: DeepSpeed's way at stage 3), ``Settings.hf_zero3_build`` (None: the script's own
build) and ``Settings.device`` (None: cuda)."""


def planner_peak_limits(options: PlannerOptions, spec: TransformerSpec) -> Optional[PeakLimit]:
    """``Engine.own_peak_limits``: a run with dropout is refused (``dropout.dropout_limit``), and a
    mixture-of-experts model outside what was measured (``moe_limit``)."""
    why = dropout_limit(spec, "deepspeed") or moe_limit(options, spec)
    return None if why is None else PeakLimit("architecture", why)


def planner_plan_options(options: PlannerOptions) -> PlannerOptions:
    """``Engine.plan_options``: less the ZeRO stage, which ``planner_plan`` chooses (and checks the file's itself)."""
    config = dict(options.own.get("ds_config") or {})
    if isinstance(config.get("zero_optimization"), dict):
        config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items() if k != "stage"}
    return replace(options, stage=None, own={**options.own, "ds_config": config or None})


def moe_limit(options: PlannerOptions, spec: TransformerSpec) -> Optional[str]:
    """Why DeepSpeed's peak of a sparse model is not given, or None. Measured (DeepSpeed 0.19.8, transformers'
    classes): ZeRO-1 and ZeRO-2 where ``moe12.zero12_moe_limit`` allows (reduced after backward, or from the hooks
    in fp32, bf16 and fp16: tests/test_deepspeed_moe12.py), ZeRO-3 where ``moe.zero3_moe_limit`` allows
    (test_deepspeed_moe.py). A plan (asking without the file's stage: ``planner_plan_options``) answers with those rows (``moe_candidates``)."""
    if spec.moe is None:
        return None
    config = options.own.get("ds_config") or {}
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", options.stage)
    if stage is None:  # plan: the rows are filtered (moe_candidates); ZeRO-1 is measured on every family it covers
        why = zero12_moe_limit(Settings(stage=1), spec)
    elif stage == 3:
        why = zero3_moe_limit(spec.model_type, zero)
    else:
        try:
            why = zero12_moe_limit(Settings.from_ds_config(config, options.stage), spec, options.grad_accum)
        except ValueError:
            return None  # the file's own error, raised by planner_settings in one line
    if why is None:
        return None
    at = f"ZeRO-{stage}" if stage is not None else "any stage (plan searches ZeRO-1 to 3)"
    return f"model_type {spec.model_type!r}: DeepSpeed's peak of routed experts at {at} is not modelled: {why}"


def moe_candidates(rows: tuple[tuple[str, Settings], ...], spec: Optional[TransformerSpec], zero: dict,
                   dropped: Optional[dict[str, str]] = None, grad_accum: int = 1) -> tuple[tuple[str, Settings], ...]:
    """``rows`` less, for a sparse model, those whose peak is not modelled (``zero12_moe_limit`` at G =
    ``grad_accum``, ``zero3_moe_limit`` of the file's ZeRO keys with the row's own); each one left out is added to
    ``dropped`` (label -> why) where given."""
    if spec is None or spec.moe is None:
        return rows

    def why(s: Settings) -> Optional[str]:
        if s.stage == 3:
            return zero3_moe_limit(spec.model_type, {**zero, **to_ds_config(s)["zero_optimization"]})
        return zero12_moe_limit(s, spec, grad_accum)

    out = []
    for label, s in rows:
        reason = why(s)
        if reason is None:
            out.append((label, s))
        elif dropped is not None:
            dropped[label] = reason
    return tuple(out)


def _dropped_reason(dropped: dict[str, str]) -> str:
    """``plan``'s note of the sparse model's rows left out (``moe_candidates``), grouped by why."""
    by_why: dict[str, list[str]] = {}
    for label, why in dropped.items():
        by_why.setdefault(why, []).append(label)
    return "; ".join(f"{', '.join(labels)}: {why}" for why, labels in by_why.items())


def planner_policy(settings: Settings) -> PrecisionPolicy:
    """The byte convention of DeepSpeed's model states: 16-bit (or fp32) parameters, gradients in
    ``grad_accum_dtype``, an fp32 master partition (a clone even in fp32) and fp32 Adam m and v."""
    return PrecisionPolicy(param_dtype=settings.dtype, grad_dtype=settings.grad_dtype, master_weights=True,
                           optimizer=settings.optimizer, optimizer_dtype="fp32")  # fmt: skip


def planner_plan(workload: Workload, nd: int, capacity_bytes: int, options: PlannerOptions) -> EnginePlan:
    """``zeroplan plan --engine deepspeed``: every (stage, bucket) of ``candidates``, each estimated once, in
    the plan's order (``ranked``), each with the ds_config of exactly that prediction; the recommendation is
    the first that fits (``recommend``'s). The other keys come from ``--deepspeed-config`` (the plan chooses
    the stage: the file's is one of the candidates)."""
    config = dict(options.own.get("ds_config") or {})
    zero = dict(config.get("zero_optimization") or {})
    if "stage" in zero:  # the file as `estimate` reads it (a stage of 4, 0 or "3" refused), then searched
        Settings.from_ds_config(config, None)
    zero.pop("stage", None)
    # the file's offload sections set the offload rows' keys (pin_memory); the plan chooses where to offload
    sections = parse_ds_config(config).zero_optimization if zero else None
    targets = tuple(read_target(getattr(sections, k, None), k) for k in ("offload_optimizer", "offload_param"))
    zero = {k: v for k, v in zero.items() if k not in ("offload_optimizer", "offload_param")}
    # the base's stage is a placeholder the candidates replace; ZeRO++'s keys are read at ZeRO-3, theirs
    base = Settings.from_ds_config({**config, "zero_optimization": zero}, 3 if ZEROPP_KEYS & zero.keys() else 1)
    base = on_device(base.model_copy(update=dict(zip(("offload_optimizer", "offload_param"), targets))), options)
    base = base.model_copy(update=build_update(options.own))  # the ZeRO-3 rows' build (build.py at_stage)
    node = options.own.get("gpus_per_node") or DEFAULT_GPUS_PER_NODE
    # hpZ over one node where the file leaves it unset (a file that sets it, even to 1, fixes it: every ZeRO-3 row
    # has the file's); the ZeRO-3 rows with and without it ranked together, by bytes across nodes first
    numels = tuple(math.prod(shape) for _, shape in workload.shapes)
    spec = workload.spec  # a sparse model: only the rows whose peak is modelled (moe_candidates; no hpZ rows)
    hpz = () if "zero_hpz_partition_size" in zero else hpz_candidates(base, nd, node, numels, capacity_bytes)
    dropped: dict[str, str] = {}  # the sparse model's rows left out, label -> why (``moe_candidates``)
    hpz, g = moe_candidates(hpz, spec, zero, dropped, workload.grad_accum), workload.grad_accum
    order = ranked(workload, nd, base,
                   which=lambda b: moe_candidates((*plain_candidates(b), *hpz), spec, zero, dropped, g),
                   gpus_per_node=node)  # fmt: skip
    # the offload rows where they can be the answer: nothing fits without, or the file asks for offload (they
    # come after every other row, PLAN_ORDER; estimating them when they cannot be chosen tripled the plan's time)
    if offloads(base) or all(t.peak_bytes > capacity_bytes for t in order):
        order = (*order, *ranked(workload, nd, base,
                                  which=lambda b: moe_candidates(offload_candidates(b), spec, zero, dropped, g),
                                  gpus_per_node=node))  # fmt: skip
    if not order:  # every row left out (moe_candidates): no answer to rank, the reasons instead, in one line
        raise ValueError(f"no configuration plan searches has a modelled peak: {_dropped_reason(dropped)}")
    index = next((i for i, t in enumerate(order) if t.peak_bytes <= capacity_bytes), None)
    out = tuple(Candidate(t.label, t.estimate, t.peak_bytes <= capacity_bytes,
                          to_ds_config(t.settings, workload.micro_batch, workload.grad_accum),
                          t.settings.reduce_bucket_size, build_snippet(t.settings),
                          trace_inputs=(workload, nd, _traced(t))) for t in order)  # fmt: skip
    why = PLAN_ORDER_HPZ if hpz else PLAN_ORDER
    if spec is not None and spec.moe is not None:
        why += (f"; routed experts (Ψ = {model_numel(spec):,} elements): rows whose peak is not modelled left out "
                f"(moe_limit, docs/engines/deepspeed.md): {_dropped_reason(dropped) if dropped else 'none'}")
    return EnginePlan(out, index, why, base)


def _traced(t: Tried) -> Settings:
    """The settings of ``t``'s allocation trace: of the rank its estimate names (not found again by estimating)."""
    return t.settings.model_copy(update={"rank": t.estimate.peak_rank})


def planner_block_bytes(settings: Settings) -> int:
    """The allocator block every peak term is rounded to (``profile.device_terms``): 512 on CUDA, none on CPU."""
    return settings.block_bytes
