"""The parent's side of the DeepSpeed runner: start its ranks through ``validate.harness``, compare with the
profile (``zeroplan.engines.deepspeed``) through ``validate.compare``, build the report. No DeepSpeed here.

The ranks (``validate.engines.deepspeed``) run under the same harness as the other engines' (torchrun behind
``validate.launch``, a lifeline to the parent, the run's marker, a timeout, SIGTERM/SIGHUP/SIGINT cleanup).
"""

from __future__ import annotations

import json
import os
import math
import statistics

from validate.compare import RING_OPS, Prediction, Readings, finish
from validate.compare import compare as compare_rows
from validate.harness import RunFailed

DEFAULT_STEPS = 2
PHASE_OF = {"optimizer step": "optimizer_step"}
"""The profile's phase names (``zeroplan.formulas.collectives``) -> this runner's (``CommCounter.phase``)."""


def ds_config(
    stage: int,
    dtype: str = "fp32",
    micro_batch: int = 2,
    lr: float = 1e-3,
    zero: dict | None = None,
    optimizer_params: dict | None = None,
    grad_accum_dtype: str | None = None,
) -> dict:
    """A ds_config dict: ZeRO ``stage``, ``dtype`` in fp32/bf16/fp16, Adam at ``lr``, extra ZeRO keys."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype={dtype!r}: expected fp32, bf16 or fp16")
    config: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": lr, **(optimizer_params or {})}},
        "zero_optimization": {"stage": stage, **(zero or {})},
        "steps_per_print": 10**9,
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return config


def builtin_configs(stages: tuple[int, ...], dtype: str, micro_batch: int, lr: float) -> list[dict]:
    """One ds_config per stage at DeepSpeed's defaults, except ``torch_adam: true`` (torch's AdamW: no
    ``fused_adam`` JIT build, ~3 min on a fresh machine; the profile models both)."""
    return [ds_config(s, dtype, micro_batch, lr, optimizer_params={"torch_adam": True}) for s in stages]


def run_configs(config, nd: int) -> list[dict]:
    """The ds_configs ``zeroplan validate --engine deepspeed`` trains at ``nd`` ranks: the user's, its batch
    written out as DeepSpeed derives it (``zeroplan.engines.deepspeed.ds_batch``; ``--micro-batch`` where
    the file has no batch key), else the built-in ones."""
    from zeroplan.engines.deepspeed import ds_batch

    if config.deepspeed_config is None:
        return builtin_configs(config.stages, config.param_dtype, config.batch_per_rank, config.lr)
    batch = ds_batch(config.deepspeed_config, nd)
    fixed = ({"train_micro_batch_size_per_gpu": batch.micro_batch, "gradient_accumulation_steps": batch.grad_accum}
             if batch else {"train_micro_batch_size_per_gpu": config.batch_per_rank})  # fmt: skip
    return [{"steps_per_print": 10**9, **config.deepspeed_config, **fixed}]


def run_world(
    configs: list[dict],
    nd: int,
    model: str = "gpt-tiny",
    steps: int = DEFAULT_STEPS,
    timeout_s: float = 900.0,
    seq_len: int | None = None,
    checkpointing: str = "none",
    runs: list[dict] | None = None,
    zero_init: bool = False,
) -> list[list[dict]]:
    """Run ``configs`` on ``nd`` gloo CPU ranks through ``validate.harness.run_world``; returns
    rows[rank][config]. ``runs``: per config, a ``model`` and ``checkpointing`` other than the world's (one
    world's ~30 s of setup shared by several models), ``zero_init``: build under ``deepspeed.zero.Init``
    (``build_model``), ``hf``: true builds the ``transformers`` model of the ``model`` config.json instead of
    the validator's (``hf_builder``), ``settle``: false leaves DeepSpeed's collectives asynchronous (no
    ``GlooSettled``: the engine's own handles). A failed rank or a timeout raises ``RunFailed``."""
    from validate.config import ValidateConfig
    from validate.harness import run_world as run_ranks

    config = ValidateConfig(engine="deepspeed", model=model, world_sizes=(nd,), steps=steps, timeout_s=timeout_s,
                            seq_len=seq_len, checkpointing=checkpointing, zero_init=zero_init,
                            stages=(3,) if zero_init else None, device="cpu")  # fmt: skip
    args = ("--configs", json.dumps(configs), *(("--runs", json.dumps(runs)) if runs else ()))
    _, ranks = run_ranks(config, nd, False, args)
    return ranks


def workload_for(
    model: str, micro_batch: int, seq_len: int | None, grad_accum: int = 1, checkpointing: str = "none",
    hf: bool = False,
):  # fmt: skip
    """The ``Workload`` the ranks train: the model's shapes (``named_parameters`` order), ``grad_accum``
    micro-steps of ``micro_batch`` sequences per optimizer step; ``hf``: the transformers model's module tree
    (a run with ``"hf": true``)."""
    from validate.models import expected_shapes, spec_for
    from zeroplan.engines.base import Workload

    spec = spec_for(model, None)
    return Workload(tuple(expected_shapes(spec)), spec, seq_len or spec.max_seq_len, micro_batch,
                    checkpointing=checkpointing, grad_accum=grad_accum, transformers=hf)  # fmt: skip


def one_memory(workload, nd: int, settings, stat_bytes: int) -> dict[str, int]:
    """A rank's predicted peak per phase with its offload's host bytes at each moment (``EngineEstimate.host``;
    ``zeroplan.engines.deepspeed.offload_one_memory.one_memory_by_phase``): what a CPU-only run measures, its "device" and
    host being one memory."""
    from zeroplan.engines.deepspeed.offload_one_memory import one_memory_by_phase
    from zeroplan.engines.deepspeed.wrapper import ds_run

    return one_memory_by_phase(ds_run(settings, workload, nd, stat_bytes))


def readings(rank_rows: list[dict], nd: int) -> Readings:
    """What DeepSpeed's ranks measured: model states at the step boundaries after init; collectives from the
    third step list (the second step: ZeRO-3 records its trace in the first)."""
    from zeroplan.formulas.peak import PHASES as PEAK_PHASES

    boundaries = [[b for k, b in r["boundary_bytes"].items() if k != "init"] for r in rank_rows]
    return Readings(
        states_bytes=max(b[-1] for b in boundaries),
        steady=all(len(set(b)) == 1 for b in boundaries),
        peak_bytes_by_phase={p: max(r["peak_bytes_by_phase"][p] for r in rank_rows) for p in PEAK_PHASES},
        steps=[r["calls_by_step"][k] for r in rank_rows for k in range(2, len(r["calls_by_step"]))],
        last_step=rank_rows[0]["calls_by_step"][-1],
        setup_calls=rank_rows[0]["calls_by_step"][0],
        nd=nd,
        group_sizes=rank_rows[0].get("call_groups_by_step", [None])[-1],  # hpZ: its own group (zeropp.py)
        peak_by_rank={r["rank"]: r["peak_bytes_by_phase"] for r in rank_rows},
    )


class StepSkipped(RunFailed):
    """DeepSpeed skipped a measured optimizer step: the run is refused, none of its numbers compared."""


def skipped_steps_reason(ds: dict, rank_rows: list[dict]) -> str | None:
    """Why the run's numbers are not a step's, in one line, or None: every rank applied every measured optimizer step.

    DeepSpeed skips a step whose gradients overflowed: ``engine.step`` -> the ZeRO optimizer's ``step`` sets
    ``overflow`` on a non-finite gradient norm (stage3.py / stage_1_and_2.py: ``is_invalid_grad_norm``) or, in fp16, on
    the loss scaler's overflow check (``check_overflow``), clears the gradients and returns before Adam
    (runtime/engine.py ``_take_model_step``: ``_step_applied = not overflow``, ``skipped_steps += 1``). Such a step
    allocates no optimizer state and updates nothing: its optimizer_step is not the step's peak, so comparing it
    with a prediction measures nothing. fp16's dynamic loss scale skips a user's first steps too, until the scale fits
    (DeepSpeed's ``initial_scale_power`` 16 by default): the validator measures applied steps only, so such a run is
    refused with the reason as well (docs/validate.md "A skipped step is refused")."""
    skipped = {r["rank"]: [k for k, a in enumerate(r.get("steps_applied", ()), 1) if not a] for r in rank_rows}
    skipped = {rank: steps for rank, steps in skipped.items() if steps}
    if not skipped:
        return None
    steps = sorted({k for ks in skipped.values() for k in ks})
    total = len(rank_rows[0].get("steps_applied", ()))
    why = ("fp16's loss scaler found an overflow (its dynamic scale skips a user's first steps until it fits; "
           "a lower fp16.initial_scale_power or a static loss_scale takes them)"
           if ds.get("fp16", {}).get("enabled") else
           "the gradient norm was not finite (ZeRO optimizer step: is_invalid_grad_norm)")  # fmt: skip
    return (f"DeepSpeed skipped optimizer step {', '.join(map(str, steps))} of {total} on rank "
            f"{', '.join(map(str, sorted(skipped)))}: {why}; a skipped step is not a measurement of the step, "
            "so the run is refused and nothing compared")  # fmt: skip


def refuse_skipped_steps(ds: dict, rank_rows: list[dict]) -> None:
    """Raise ``StepSkipped`` with ``skipped_steps_reason`` when a rank skipped a measured step."""
    if (why := skipped_steps_reason(ds, rank_rows)) is not None:
        raise StepSkipped(why)


def compare_row(
    ds: dict,
    nd: int,
    rank_rows: list[dict],
    workload,
    model_label: str,
    tolerance: float,
    peak_tolerance: float,
    seq_len: int | None = None,
) -> dict:
    """One ``ReportRow`` (validate/schema.py): ``zeroplan.engines.deepspeed.estimate`` for ``ds`` next to what
    every rank measured (``validate.compare``); DeepSpeed's own estimator beside it."""
    from dataclasses import replace

    from zeroplan.engines import deepspeed as D

    refuse_skipped_steps(ds, rank_rows)  # a skipped step's phases are not the step's: no number compared
    # how the ranks built the model, passed explicitly (the profile's default is zero.Init at stage 3)
    settings = D.Settings.from_ds_config(ds, zero_init=bool(rank_rows[0].get("zero_init", False)))
    if rank_rows[0].get("device_count"):  # the accelerator's, as the run saw it: qgZ's devices per node
        settings = settings.model_copy(update={"devices_per_node": rank_rows[0]["device_count"]})
    cuda = rank_rows[0].get("device") == "cuda"  # the CUDA runner's rows (validate/engines/deepspeed_cuda.py)
    settings = settings.model_copy(update={"device": "cuda" if cuda else "cpu",  # CUDA: 512-B blocks, workspaces
                                           # a transformers model under zero.Init: built by hf_zero3_build
                                           "hf_zero3_build": workload.transformers and settings.builds_partitioned})
    # MemTracker on CPU: LayerNorm's mean and rstd come in the input dtype (4 bytes only in fp32); CUDA: fp32 (None)
    stat = None if cuda else D.DTYPE_BYTES[settings.dtype]
    (est,) = D.estimate(workload, nd, settings, stat_bytes=stat)
    # every rank against its own prediction (ZeRO-1/2 ranks differ by their grads_in_partition)
    by_rank = {r["rank"]: D.estimate(workload, nd, settings.model_copy(update={"rank": r["rank"]}),
                                     stat_bytes=stat)[0].peak.by_phase()
               for r in rank_rows}  # fmt: skip
    host = None if cuda else est.host  # CUDA: the allocator counts the GPU alone, the profile's GPU peak
    if host is not None:  # offload on CPU: "GPU" and host are one memory, measured together (docs/engines/deepspeed.md)
        by_rank = {r: one_memory(workload, nd, settings.model_copy(update={"rank": r}), D.DTYPE_BYTES[settings.dtype])
                   for r in by_rank}  # fmt: skip
    numels = tuple(math.prod(sh) for _, sh in workload.shapes)
    collectives = tuple(replace(c, phase=PHASE_OF.get(c.phase, c.phase)) for c in est.collectives)
    # the profile predicts the ring collectives (DeepSpeed's scalar all-reduces are reported, not checked)
    top = {p: max(b[p] for b in by_rank.values()) for p in next(iter(by_rank.values()))}
    reserved = None
    if cuda:
        reserved = predicted_reserved(workload, nd, settings)
    prediction = Prediction(est, collectives, peak_by_phase=top, ops=RING_OPS, peak_by_rank=by_rank,
                            beside_states=() if host is None else host.terms, reserved_by_phase=reserved)  # fmt: skip
    row = compare_rows(prediction, readings(rank_rows, nd), tolerance, peak_tolerance)
    ds_est = D.ds_estimate_bytes(settings, numels, nd)
    peak = row["measured_peak_bytes"]
    step_s = [t for r in rank_rows for t in r["step_s"][1:]] or [t for r in rank_rows for t in r["step_s"]]
    return finish({
        **row, "world_size": nd, "mode": "real", "backend": "nccl" if cuda else "gloo", "device": "cuda" if cuda else "cpu",
        "model": model_label, "psi": sum(numels), "engine": "deepspeed",
        "runner_changes": rank_rows[0].get("runner_changes", []),
        "adam_step_bytes": 0,  # a profile term (``step scalars``), not an excess
        "probe_breakdown": rank_rows[0]["probe_breakdown"],
        "checkpointing": workload.checkpointing, "seq_len": seq_len, "micro_batch": workload.micro_batch,
        "foreach": settings.foreach, "parity": None,
        "seconds": max(sum(r["step_s"]) for r in rank_rows),
        "step_time_s": {"probed": statistics.median(step_s), "unprobed": 0.0, "unprobed_steps": 0},
        "wire_bytes_per_rank": None, "profiler_comms": None, "wire_to_derived": None,
        "deepspeed_estimator_bytes": ds_est, "deepspeed_estimator_rel_error": (peak - ds_est) / peak,
    }, None)  # fmt: skip


def run_validation(config) -> dict:
    """``zeroplan validate --engine deepspeed``: every world size of ``config`` through real DeepSpeed, under
    ``validate.harness.run_matrix`` (the ranks derive their ds_configs with ``run_configs``)."""
    from validate.engines.deepspeed_jit_lock import check_extension_locks
    from validate.harness import run_matrix
    from validate.schema import SCHEMA, ValidationReport

    check_extension_locks()  # a killed JIT build's lock would hang every rank: refused in one line first
    rows = []
    worlds = run_matrix(config)
    for nd, (_, ranks) in zip(config.world_sizes, worlds):
        for i, ds in enumerate(run_configs(config, nd)):
            workload = workload_for(config.model_name, ds["train_micro_batch_size_per_gpu"], config.seq_len,
                                    ds.get("gradient_accumulation_steps", 1), config.checkpointing)  # fmt: skip
            rows.append(compare_row(ds, nd, [r[i] for r in ranks], workload, config.model_label, config.tolerance,
                                    config.peak_tolerance, config.seq_len))  # fmt: skip
    overridden = any(r.get("fp16_capability_overridden") for _, ranks in worlds for r in ranks[0])
    fp16_note = ("fp16 on a CPU without oneDNN fp16: the runner answered DeepSpeed's capability check "
                 "(accelerator/cpu_accelerator.py is_fp16_supported) yes, so DeepSpeed's fp16 path ran as "
                 "written with torch's CPU kernels (validate/engines/deepspeed.py fp16_on_cpu)")  # fmt: skip
    notes = [
        "engine deepspeed: predictions from zeroplan.engines.deepspeed (DeepSpeed 0.19.8 profile); "
        "deepspeed_estimator_bytes is DeepSpeed's own estimate_zero2/3_model_states_mem_needs for the run; "
        "collectives compared per step from the second (ZeRO-3 records its trace in the first), "
        "ring ops only.",
        *([fp16_note] if overridden else []),
    ]
    torch_version = worlds[0][1][0][0]["torch"] if worlds else None
    return ValidationReport(schema_id=SCHEMA, config=config.model_dump(), torch=torch_version, rows=rows,
                            notes=notes, ok=all(r["ok"] for r in rows)).model_dump(by_alias=True)  # fmt: skip


def predicted_reserved(workload, nd: int, settings) -> dict | None:
    """The allocator model's ``max_memory_reserved`` per phase for the profile's allocation trace of ``settings``
    (rank ``settings.rank``), under this process's ``PYTORCH_CUDA_ALLOC_CONF``; None for an option it refuses."""
    from zeroplan.allocator.reserved import reserved_of
    from zeroplan.engines.deepspeed.alloc_trace import alloc_traces

    (trace,) = alloc_traces(workload, nd, settings)
    try:
        return reserved_of(trace, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")).reserved_phases
    except ValueError:  # e.g. backend:cudaMallocAsync, which the model does not replay
        return None
