"""The reference runtime behind the engine contract (``zeroplan/engines/base.py``): ``estimate`` (one row
per ZeRO stage) and the planner's options in its vocabulary (the paper's: stages, a policy). The planner's
ladder of stages and offload (``zeroplan.planning.plan``) plans it; it has no search of its own."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from zeroplan.engines.base import EngineEstimate, PeakLimit, PlannerOptions, Workload
from zeroplan.engines.reference.collectives import optimizer_step, stage_rows
from zeroplan.engines.reference.moments import predict_peak
from zeroplan.engines.reference.settings import Settings, peak_limit
from zeroplan.engines.reference.terms import reference_run
from zeroplan.formulas.cuda_workspaces import library_workspaces
from zeroplan.policy import PrecisionPolicy

def estimate(workload: Workload, nd: int, settings: Settings) -> tuple[EngineEstimate, ...]:
    """One row per requested ZeRO stage: model states and collectives from the stage table
    (``collectives.stage_rows``: the paper's formulas with the runtime's padding), the peak per phase from
    ``predict_peak`` when ``workload.spec`` is set (else None).

    With ``grad_accum`` = G > 1 every buffer the runtime keeps across micro-steps (the gradient buffer
    or shard, master, Adam states) exists at G = 1 already, so forward and backward of later micro-steps
    see nothing new alive, and stages 0-1 reduce once at the last micro-step exactly as at G = 1; what
    G adds is, at stages 2-3, the in-flight reduction of later micro-steps: a reduce-scatter into a
    temporary of the unit's shard next to its pack buffer (``_accumulation_moments``), which is a phase's
    peak only where it outgrows the unit's autograd gradients it replaces (N_d = 1 at most ties); on gloo
    (``settings.backend``) the reduce-scatter's copy of its input (``terms.gloo_copy``) makes it outgrow
    them by the unit's shard.
    Collectives of one optimizer step (the engine contract), every micro-step's calls summed
    (``collectives.optimizer_step``).
    """
    if nd < 1:
        raise ValueError(f"nd={nd}: must be >= 1")
    numels = tuple(math.prod(s) for _, s in workload.shapes)
    limit = None if workload.spec is None else peak_limit(settings.policy, workload.spec)
    if limit is not None:
        raise ValueError(limit.reason)
    rows = stage_rows(numels, nd, settings)
    out = []
    for row in rows:
        peak = None
        if workload.spec is not None:
            run = reference_run(
                workload.spec, nd, row.stage.number, workload.micro_batch, workload.seq_len,
                workload.checkpointing, workload.foreach, stat_bytes=settings.stat_bytes,
                grad_accum=workload.grad_accum, shapes=workload.shapes,
            )  # fmt: skip
            run = replace(run, gloo=settings.backend == "gloo", amsgrad=settings.amsgrad)
            cap = settings.cuda_capability
            resident = () if cap is None else (library_workspaces(cap, workload.spec.biased_linear),)
            peak = predict_peak(run, block_bytes=settings.block_bytes,
                                allocator_overhead_bytes=settings.allocator_overhead_bytes, resident=resident)  # fmt: skip
        number = row.stage.number
        collectives = optimizer_step(row.collectives, number, workload.grad_accum)
        out.append(EngineEstimate("reference", f"ZeRO-{number}", number, row.memory, peak, collectives))
    return tuple(out)


# ---- the planner's side: options -> Settings and the byte convention ----

PLANNER_OPTIONS: tuple[str, ...] = ("stages", "policy")
"""The ``PlannerOptions`` fields in the reference runtime's vocabulary (the paper's: stages, a policy)."""


def planner_settings(options: PlannerOptions) -> Settings:
    """The reference runtime's ``Settings``: the requested stages and policy, the planner's CUDA target (the
    ``--gpu`` preset's compute capability where given, else the default's)."""
    cap = {} if options.gpu_capability is None else {"cuda_capability": options.gpu_capability}
    return Settings(stages=options.stages, policy=options.policy, flat_layout=options.flat_layout, **cap)


def planner_peak_limits(options: PlannerOptions, spec) -> Optional[PeakLimit]:
    """``Engine.own_peak_limits``: the run the profile describes (``settings.peak_limit``) in the policy asked."""
    return peak_limit(options.policy, spec)


def planner_policy(settings: Settings) -> PrecisionPolicy:
    """The byte convention of the model states: the policy as given."""
    return settings.policy


def planner_block_bytes(settings: Settings) -> int:
    """The allocator block every peak term is rounded to."""
    return settings.block_bytes


# A ds_config given to the reference engine (``--deepspeed-config``) is read as DeepSpeed reads it: its
# precision completes the paper's policy and its batch keys set the run's batch. DeepSpeed's reader is
# imported when a file is given, so `estimate` without one never loads it.


def ds_config_policy(config, given: dict) -> dict:
    """``Engine.file_policy``: the policy fields given, completed from a parsed ds_config
    (``zeroplan.engines.deepspeed.merge_ds_config``; a contradiction is refused)."""
    from zeroplan.engines.deepspeed.config import merge_ds_config

    return merge_ds_config(config, given)


def ds_config_batch(config, nd, micro_batch, grad_accum, names=("micro_batch", "grad_accum")) -> tuple[int, int]:
    """``Engine.batch``: the ds_config's batch where one is given (DeepSpeed's rule), else the command line's."""
    if config is None:
        return (micro_batch or 1, grad_accum or 1)
    from zeroplan.engines.deepspeed.batch import planner_batch

    return planner_batch(config, nd, micro_batch, grad_accum, names)


def ds_config_sweep_batches(config, gpus, model_parallel, micro_batches, name="micro_batch"):
    """``Engine.sweep_batches``: DeepSpeed's for a given ds_config, else None (the command line's stand)."""
    if config is None:
        return None
    from zeroplan.engines.deepspeed.batch import sweep_micro_batches

    return sweep_micro_batches(config, gpus, model_parallel, micro_batches, name)
