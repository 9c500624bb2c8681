"""``zeroplan plan --engine deepspeed``: the configurations DeepSpeed's planner tries, the one it recommends,
each with the ds_config of exactly that prediction (``to_ds_config``), and the planner hooks of the engine
contract (``planner_settings``, ``planner_policy``, ``planner_plan``, ``planner_block_bytes``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zeroplan.engines.base import Candidate, EngineEstimate, EnginePlan, PlannerOptions, Workload
from zeroplan.engines.deepspeed.config import to_ds_config
from zeroplan.engines.deepspeed.profile import estimate
from zeroplan.engines.deepspeed.settings import Settings
from zeroplan.policy import PrecisionPolicy


BUCKET_CHOICES: tuple[int, ...] = (500_000_000, 200_000_000, 50_000_000, 5_000_000)
"""Bucket sizes ``recommend`` tries (elements): DeepSpeed's default, then smaller ones as its docs suggest
for memory-bound runs (``reduce_bucket_size`` / ``allgather_bucket_size``)."""


def build_snippet(s: Settings, config_path: str = "ds_config.json") -> Optional[str]:
    """How to build the model for ``s`` as the profile predicted it: under ``deepspeed.zero.Init`` with the
    run's ds_config (``Settings.zero_init``; as ``validate/engines/deepspeed.py`` ``build_model`` does), or
    None where the model is built as usual (whole, then partitioned by ``deepspeed.initialize``)."""
    if not s.builds_partitioned:
        return None
    return (
        "import deepspeed\n\n"
        "# ZeRO-3 as predicted: each module is partitioned as it is built (partition_parameters.py Init), so no\n"
        "# rank holds the whole model; initialise weights through model.apply (each module gathered for it).\n"
        "# Hugging Face: HfDeepSpeedConfig(ds_config) before from_pretrained does the same.\n"
        f"with deepspeed.zero.Init(config_dict_or_path={config_path!r}):\n"
        "    model = build_model()  # your model's constructor\n"
        "engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),\n"
        f"                                               config={config_path!r})\n"
    )


@dataclass(frozen=True)
class Recommendation:
    """The configuration ``recommend`` chose, its prediction, and what it tried."""

    settings: Settings
    estimate: EngineEstimate
    ds_config: dict
    tried: tuple[tuple[int, int, int], ...]
    """(stage, bucket elements, predicted peak bytes) of every candidate, in the order tried."""


def candidates(base: Settings) -> tuple[tuple[str, Settings], ...]:
    """What ``recommend`` tries, in its order: ZeRO-1, 2, 3 with each of ``BUCKET_CHOICES``, then ZeRO-3
    without prefetch (``stage3_prefetch_bucket_size`` 0: a module's parameters are released after use unless
    reused within ``stage3_max_reuse_distance``, ``stage3_schedule``; more all-gathers, no overlap)."""
    out = []
    for stage, prefetch in ((1, None), (2, None), (3, None), (3, 0)):
        for bucket in BUCKET_CHOICES:
            update = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
            if prefetch is not None:
                update["prefetch_bucket_size"] = prefetch
            label = f"ZeRO-{stage}, buckets {bucket:.0e}".replace("e+0", "e") + (", no prefetch" if prefetch == 0 else "")
            out.append((label, base.model_copy(update=update)))
    return tuple(out)


def recommend(workload: Workload, nd: int, memory_bytes: int, base: Settings,
              stat_bytes: Optional[int] = None) -> Optional[Recommendation]:
    """The first of ``candidates`` (lowest ZeRO stage: least traffic; then the largest bucket: fewest calls;
    ZeRO-3 without prefetch last) whose predicted peak fits ``memory_bytes``; None when none does. Other
    keys come from ``base``."""
    tried = []
    for _, s in candidates(base):
        (est,) = estimate(workload, nd, s, stat_bytes)
        peak = est.peak.peak_bytes if est.peak is not None else est.model_states_bytes
        tried.append((s.stage, s.reduce_bucket_size, peak))
        if peak <= memory_bytes:
            return Recommendation(s, est, to_ds_config(s, workload.micro_batch, workload.grad_accum), tuple(tried))
    return None


# --- the planner's side (estimate, plan, sweep): options -> Settings, the byte convention, the plan ----------

PLANNER_OPTIONS: tuple[str, ...] = ("ds_config", "stage")
"""The ``PlannerOptions`` fields in DeepSpeed's vocabulary: a ``ds_config.json`` and ``--stage``."""
PLAN_ORDER = ("the lowest ZeRO stage (least traffic), then the largest bucket (fewest calls), ZeRO-3 without "
              "prefetch last (parameters released after use, re-gathered in backward)")


def planner_settings(options: PlannerOptions) -> Settings:
    """DeepSpeed's ``Settings`` from ``--deepspeed-config`` (absent keys: DeepSpeed 0.19.8's defaults) and
    ``--stage`` (fills in a config without a stage; a contradiction is refused)."""
    config = dict(options.ds_config) if options.ds_config is not None else {}
    zero = config.get("zero_optimization")
    if options.stage is None and not (isinstance(zero, dict) and "stage" in zero):
        raise ValueError("--engine deepspeed needs the ZeRO stage: give --stage or zero_optimization.stage in "
                         "--deepspeed-config")  # fmt: skip
    return Settings.from_ds_config(config, options.stage)


def planner_policy(settings: Settings) -> PrecisionPolicy:
    """The byte convention of DeepSpeed's model states: 16-bit (or fp32) parameters, gradients in
    ``grad_accum_dtype``, an fp32 master partition (a clone even in fp32) and fp32 Adam m and v."""
    return PrecisionPolicy(param_dtype=settings.dtype, grad_dtype=settings.grad_dtype, master_weights=True,
                           optimizer=settings.optimizer, optimizer_dtype="fp32")  # fmt: skip


def planner_plan(workload: Workload, nd: int, capacity_bytes: int, options: PlannerOptions) -> EnginePlan:
    """``zeroplan plan --engine deepspeed``: every (stage, bucket) ``recommend`` may try, in its order, each
    with the ds_config of exactly that prediction; the recommendation is ``recommend``'s. The other keys
    come from ``--deepspeed-config`` (the plan chooses the stage: the file's is one of the candidates)."""
    config = dict(options.ds_config) if options.ds_config is not None else {}
    zero = dict(config.get("zero_optimization") or {})
    zero.pop("stage", None)
    base = Settings.from_ds_config({**config, "zero_optimization": zero}, 1)
    chosen = recommend(workload, nd, capacity_bytes, base)
    out, index = [], None
    for label, s in candidates(base):
        (est,) = estimate(workload, nd, s)
        need = est.peak.peak_bytes if est.peak is not None else est.model_states_bytes
        if chosen is not None and s == chosen.settings:
            index = len(out)
        out.append(Candidate(label, est, need <= capacity_bytes, to_ds_config(s, workload.micro_batch, workload.grad_accum),
                             s.reduce_bucket_size, build_snippet(s)))  # fmt: skip
    return EnginePlan(tuple(out), index, "deepspeed", PLAN_ORDER, base)


def planner_block_bytes(settings: Settings) -> int:
    """The allocator block the peak is rounded to: none (``estimate`` sums the terms as allocated)."""
    return 1
