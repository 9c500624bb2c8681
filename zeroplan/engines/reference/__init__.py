"""Engine profile of the bundled reference runtime (``validate/``): what it allocates, phase by phase.

Data for ``zeroplan.formulas.peak``: ``moments(run)`` lists, per phase, the points where live memory
can peak and the terms live there; each term names the ``validate/<file>.py:<function>`` that
allocates it. Stages are read from ``zeroplan.formulas.stages`` (what is sharded), not tested by number.

Conventions of the runtime (``validate/runtime.py``): sharding units are the root (parameters outside
the decoder layers, ``architectures.spec.block_prefix``: embeddings, final norm, an untied head) and one
unit per decoder layer; 16-bit parameters and gradients (``a`` bytes), an fp32
master shard with Adam's m and v (``S`` elements per rank: every tensor padded to a multiple of N_d,
``zeroplan.formulas.sharding.flat_shard_numel``; at stage 0 the whole unpadded model). Forward and backward
phases of every step after the first hold m and v, so a phase's peak (the largest over steps)
includes them. Moments within the block loop are taken at the first block to run (the last in
backward), where the most activations are alive; blocks are identical.

Files, as the FSDP2 and DeepSpeed packages: ``settings`` (``Settings``, the run the peak describes),
``terms`` (the run and one function per term), ``collectives`` (model states and collectives: the stage
table), ``moments`` (the phases), ``plan`` (``estimate`` and the planner's side). The runtime has no
launcher config. This module re-exports the names other modules use.
"""

from __future__ import annotations

from zeroplan.engines.base import Engine
from zeroplan.engines.reference.alloc_trace import alloc_traces
from zeroplan.engines.reference.collectives import stage_rows
from zeroplan.engines.reference.declared import COMM_COUNT, RUN_OPTIONS
from zeroplan.engines.reference.live import live_settings
from zeroplan.engines.reference.moments import (
    backward_moments,
    forward_moments,
    init_moments,
    moments,
    optimizer_moments,
    predict_peak,
)
from zeroplan.engines.reference.plan import (
    PLANNER_OPTIONS,
    estimate,
    ds_config_batch,
    ds_config_policy,
    ds_config_sweep_batches,
    planner_block_bytes,
    planner_peak_limits,
    planner_policy,
    planner_settings,
)
from zeroplan.engines.reference.settings import (
    ADAM_STEP_BYTES,
    CUDA_STAT_BYTES,
    MASTER_BYTES,
    PEAK_OPTIMIZERS,
    Settings,
    peak_limit,
)
from zeroplan.engines.reference.terms import FINAL_NORM_PREFIX, ReferenceRun, reference_run

__all__ = [
    "ADAM_STEP_BYTES", "CUDA_STAT_BYTES", "FINAL_NORM_PREFIX", "MASTER_BYTES", "PEAK_OPTIMIZERS", "PLANNER_OPTIONS",
    "ReferenceRun", "Settings", "backward_moments", "estimate", "peak_limit", "planner_peak_limits",
    "forward_moments", "init_moments", "moments", "optimizer_moments", "planner_block_bytes", "planner_policy",
    "planner_settings", "predict_peak", "reference_run", "stage_rows", "ENGINE",
]  # fmt: skip

ENGINE = Engine("reference", estimate, Settings, planner_settings, planner_policy, PLANNER_OPTIONS,
                block_bytes=planner_block_bytes, batch=ds_config_batch, sweep_batches=ds_config_sweep_batches,
                file_policy=ds_config_policy, own_peak_limits=planner_peak_limits, alloc_trace=alloc_traces,
                live_settings=live_settings,
                run_options=RUN_OPTIONS, runner="validate.engines.reference_run", comm_count=COMM_COUNT)  # fmt: skip
"""The reference runtime as the registry knows it (``zeroplan.engines``): the ZeRO ladder (no own search); a
ds_config, where given, completes its policy and sets its batch as DeepSpeed would."""
