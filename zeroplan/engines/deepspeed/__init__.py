"""DeepSpeed ZeRO 1-3 as an engine, in DeepSpeed **0.19.8**'s words (issues 11 and 16). File paths in
``source`` strings are relative to the installed ``deepspeed/`` package; nothing here imports DeepSpeed.

Split the way DeepSpeed splits its runtime:

- ``config.py``: the ``ds_config.json`` schema, its one reader (``parse_ds_config``, ``from_deepspeed``,
  ``load_deepspeed``, ``merge_deepspeed``) and the paper planner's writer (``deepspeed_config``);
  ``batch.py``: the batch DeepSpeed derives from it (``ds_batch``, ``run_batch``, ``sweep_micro_batches``).
- ``settings.py``: ``Settings`` (the keys that change memory or traffic, DeepSpeed's defaults; ``to_ds_config``
  writes them back), ``DTYPE_BYTES``, the optimizer classes DeepSpeed builds; ``wrapper.py``: the wrapper chosen
  once (``wrapper_for``), the only module that imports the wrappers, and what asks it (``ds_run``, ``terms``,
  ``collectives``).
- ``terms.py``: every buffer of model states (``DSTerm``); ``collectives.py``: what is sent; ``estimator.py``:
  DeepSpeed's own estimators.
- ``trace.py`` (ZeRO-3's module hooks) and ``coordinator.py`` (``PartitionedParameterCoordinator`` replayed).
- The moments of a step: ``run.py`` and ``phases.py`` (shared), ``zero12.py`` (``DeepSpeedZeroOptimizer``,
  stage_1_and_2.py), ``bf16.py`` (``BF16_Optimizer``), ``zero3.py`` (``DeepSpeedZeroOptimizer_Stage3``).
- Offload (``offload_optimizer``, ``offload_param``, issue 21): ``offload_settings.py`` (the sections, their
  refusals), ``offload_terms.py`` (what stays on the GPU), ``offload.py`` (the host, the moments, PCIe),
  ``offload_one_memory.py`` (a CPU-only run: GPU and host one memory).
- ``profile.py`` (``estimate``, the engine contract) and ``plan.py`` (candidates, ``recommend``, ``planner_*``).

Checked against real DeepSpeed on gloo CPU by ``validate/engines/deepspeed.py`` (``tests/test_deepspeed_*.py``).

Glossary: Ψ (psi) parameter elements of the model; N_d (``nd``) data-parallel ranks; a *partition* is one
rank's 1/N_d of a flat group (ZeRO-1/2: the padded flat group; ZeRO-3: ceil(n / N_d) of each tensor); a
*bucket* is the elements one collective call carries (``reduce_bucket_size``, ``allgather_bucket_size``);
sizes are elements (``_numel``) until ``DTYPE_BYTES`` turns them into bytes; a *moment* is a point of a
phase (init, forward, backward, optimizer step) with the terms alive there, and a phase's peak is its
largest moment.
"""

from zeroplan.engines.base import Engine
from zeroplan.engines.deepspeed.alloc_trace import alloc_traces
from zeroplan.engines.deepspeed.batch import DsBatch, ds_batch, planner_batch, run_batch, sweep_micro_batches
from zeroplan.engines.deepspeed.collectives import DSCollective, greedy_buckets
from zeroplan.engines.deepspeed.declared import LAUNCHER, RUN_OPTIONS
from zeroplan.engines.deepspeed.live import live_settings
from zeroplan.engines.deepspeed.config import (DEEPSPEED_OPTIMIZERS, DEFAULT_BUCKET_NUMEL, NVME_PATH,
                                               STAGE3_PREFETCH_NUMEL, DeepSpeedConfig, deepspeed_config,
                                               from_deepspeed, load_deepspeed, merge_deepspeed, merge_ds_config,
                                               parse_ds_config)
from zeroplan.engines.deepspeed.build import build_snippet
from zeroplan.engines.deepspeed.coordinator import Coordinator, Stage3Gather, Stage3Schedule, stage3_schedule
from zeroplan.engines.deepspeed.estimator import ds_estimate_zero2_bytes, ds_estimate_zero3_bytes
from zeroplan.engines.deepspeed.phases import (backward_moments, forward_moments, init_moments, moments,
                                               optimizer_moments)
from zeroplan.engines.deepspeed.plan import (BUCKET_CHOICES, PLAN_ORDER, PLANNER_OPTIONS, VOCABULARY,
                                             Recommendation, Tried, candidates,
                                             planner_block_bytes, planner_peak_limits, planner_plan,
                                             planner_plan_options, planner_policy, planner_settings, ranked, recommend, sent_bytes_per_step)
from zeroplan.engines.deepspeed.profile import estimate
from zeroplan.engines.deepspeed.run import DSRun, Wrapper, _trace
from zeroplan.engines.deepspeed.settings import (DEEPSPEED_VERSION, DTYPE_BYTES, NCCL_START_ALIGNMENT_FACTOR,
                                                 DsDtype, Settings, inner_optimizer_class, optimizer_class,
                                                 to_ds_config)
from zeroplan.engines.deepspeed.terms import DSTerm, aligned_flat_numel, model_state_bytes, persistent_numel
from zeroplan.engines.deepspeed.trace import FETCH, RELEASE, Stage3Trace, TraceEvent, stage3_trace
from zeroplan.engines.deepspeed.wrapper import collectives, ds_estimate_bytes, ds_run, memory_breakdown, terms, wrapper_for
from zeroplan.engines.deepspeed.zero3 import zero_init_moments
from zeroplan.engines.deepspeed.zero12 import _partition_allocations, _stage1_kept_gradients

# ZeRO-3's partition is the one sharding rule (``formulas.sharding.flat_shard_numel``); the name stays importable
# here for tests/test_deepspeed_zero_init.py until it imports the rule itself.

__all__ = [
    "BUCKET_CHOICES", "DEEPSPEED_OPTIMIZERS", "DEEPSPEED_VERSION", "DEFAULT_BUCKET_NUMEL", "DTYPE_BYTES", "FETCH",
    "NCCL_START_ALIGNMENT_FACTOR", "NVME_PATH", "VOCABULARY", "PLANNER_OPTIONS", "PLAN_ORDER", "Tried", "ranked", "sent_bytes_per_step", "RELEASE", "STAGE3_PREFETCH_NUMEL",
    "Coordinator", "DSCollective", "DSRun", "DSTerm", "DeepSpeedConfig", "DsBatch", "DsDtype", "Recommendation",
    "Settings", "Stage3Gather", "Stage3Schedule", "Stage3Trace", "TraceEvent", "Wrapper",
    "_partition_allocations", "_stage1_kept_gradients", "_trace",
    "backward_moments", "build_snippet", "candidates", "collectives", "deepspeed_config", "ds_batch",
    "ds_estimate_bytes", "ds_estimate_zero2_bytes", "ds_estimate_zero3_bytes", "ds_run", "estimate",
    "aligned_flat_numel", "forward_moments", "from_deepspeed", "greedy_buckets", "init_moments",
    "inner_optimizer_class", "load_deepspeed", "memory_breakdown", "merge_deepspeed", "merge_ds_config", "planner_batch",
    "model_state_bytes", "moments",
    "optimizer_class", "optimizer_moments", "parse_ds_config", "persistent_numel", "planner_block_bytes",
    "planner_plan", "planner_policy", "planner_settings", "recommend", "run_batch",
    "stage3_schedule", "stage3_trace", "sweep_micro_batches", "terms", "to_ds_config", "wrapper_for",
    "zero_init_moments", "ENGINE",
]  # fmt: skip

ENGINE = Engine("deepspeed", estimate, Settings, planner_settings, planner_policy, PLANNER_OPTIONS, planner_plan,
                ds_estimate_bytes, "DeepSpeed's estimator", planner_block_bytes, batch=planner_batch,
                sweep_batches=sweep_micro_batches, read_settings_file=Settings.from_ds_config,
                own_options=VOCABULARY, alloc_trace=alloc_traces,
                own_peak_limits=planner_peak_limits, plan_options=planner_plan_options,
                live_settings=live_settings,
                launcher=LAUNCHER, run_options=RUN_OPTIONS, runner="validate.engines.deepspeed_run")  # fmt: skip
"""DeepSpeed as the registry knows it (``zeroplan.engines``): its batch is the ds_config's."""
