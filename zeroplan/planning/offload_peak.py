"""The peak of an offload option: its stage's peak with the offloaded model states moved to the host.

Which terms move is decided from the peak's named terms (``zeroplan.engines.reference``), by what
DeepSpeed's offload puts in host memory (DeepSpeed 0.19, ``runtime/zero/stage_1_and_2.py`` with
``cpu_offload`` and ``runtime/zero/stage3.py`` with ``offload_optimizer``/``offload_param``) and ZeRO-Offload
(Ren et al. 2021, sec. 4), the same placement as ``zeroplan.formulas.offload.offloaded_states``:

- optimizer offload: the fp32 master (stage_1_and_2.py ``single_partition_of_fp32_groups``, stage3.py
  ``fp32_partitioned_groups_flat``, created on the offload device), Adam's m, v and step and the fp32
  gradient of the master (the step runs on the host: ``DeepSpeedCPUAdam``), and its temporaries; at
  stages 2-3 the reduced 16-bit gradient shard too (copied to the host as each partition is reduced,
  ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``; at stage 1 the full gradients stay on the GPU);
- parameter offload (stage 3): the 16-bit parameter shard (``ds_tensor`` kept on the host,
  stage3.py ``offload_param``); the gathered units stay on the GPU while they compute.

Moved in the phases after ``init`` only: there these terms are model states, live at every moment of
forward, backward and the optimizer step (``reference.backward_moments`` etc. hold ``_states(run)`` in each),
so removing them from a phase's largest moment gives that phase's peak exactly (``tests/test_offload.py``
recomputes it from the moments). ``init`` is kept as the reference runtime builds it (the model and the
fp32 master on the GPU, ``validate/runtime.py:Runtime.__init__``): a runtime that then moves them out
peaks there too, and one that builds them on the host peaks lower, so the init phase is an upper bound.
Not counted: the GPU staging of offload traffic (one unit's shard fetched before its all-gather, under
a gathered unit / N_d; DeepSpeed's pinned bounce buffers live on the host).

This is the reference (paper) plan's judgement. The engines model their own offload, GPU staging and host
buffers included: ``zeroplan/engines/deepspeed/offload.py`` (``offload_optimizer``/``offload_param``) and
``zeroplan/engines/fsdp2/offload.py`` (``CPUOffloadPolicy``); ``plan --engine deepspeed`` takes its offload
rows from there (``EngineEstimate.host``).
"""

from __future__ import annotations

from zeroplan.formulas.offload import Offload
from zeroplan.formulas.peak import TOP_TERMS, PeakEstimate, PhasePeak, Term
from zeroplan.formulas.stages import get_stage

OPTIMIZER_TERMS: tuple[str, ...] = (
    "fp32 master", "Adam m, v, step", "fp32 gradient of the master", "Adam temporaries",
)  # fmt: skip
"""Names (or name prefixes) of the reference engine's terms that optimizer offload puts on the host."""
GRADIENT_SHARD = "16-bit gradient shard"
"""The reduced gradient shard (stages 2-3), on the host with optimizer offload."""
PARAMETER_SHARD = "16-bit parameter shard"
"""The 16-bit parameter shard (stage 3), on the host with parameter offload."""
KEPT_PHASE = "init"


def moved_names(stage: int, offload: Offload) -> tuple[str, ...]:
    """Term names (prefixes) ``offload`` moves to the host at ``stage``."""
    names: list[str] = []
    if offload.optimizer != "none":
        names += OPTIMIZER_TERMS
        if get_stage(stage).shards_gradients:
            names.append(GRADIENT_SHARD)
    if offload.params != "none":
        names.append(PARAMETER_SHARD)
    return tuple(names)


def _moves(term: Term, names: tuple[str, ...]) -> bool:
    return term.name.startswith(names)


def offload_peak(peak: PeakEstimate, stage: int, offload: Offload, block_bytes: int) -> PeakEstimate:
    """``peak`` (of ``stage`` without offload) with the terms ``offload`` moves taken off the GPU in every
    phase after init; ``block_bytes``: the allocator block the peak's terms were rounded to."""
    names = moved_names(stage, offload)
    phases = []
    for p in peak.phases:
        if p.phase == KEPT_PHASE or not names:
            phases.append(p)
            continue
        moved = sum(t.rounded(block_bytes) for t in p.terms if _moves(t, names))
        kept = tuple(t for t in p.terms if not _moves(t, names))
        phases.append(PhasePeak(p.phase, p.bytes - moved, f"{p.moment} ({offload.label})", kept))
    top = max(phases, key=lambda p: p.bytes)
    largest = tuple(sorted((t for t in top.terms if t.bytes), key=lambda t: -t.bytes)[:TOP_TERMS])
    return PeakEstimate(tuple(phases), top.bytes, top.phase, largest)
