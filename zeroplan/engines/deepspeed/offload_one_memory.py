"""A CPU-only run's view of DeepSpeed's offload: the GPU and the host are one memory (``DS_ACCELERATOR=cpu``), so
what MemTracker measures is the GPU moments plus the host bytes alive at each (``one_memory_by_phase``); the
validator compares with it (``validate/engines/deepspeed_compare.py``)."""

from __future__ import annotations

from zeroplan.engines.deepspeed.offload import FETCHED, POST_STEP, STEP_ENTRY, ZERO3_STATES_INIT, host_memory
from zeroplan.engines.deepspeed.phases import moments
from zeroplan.engines.deepspeed.run import DSRun
from zeroplan.engines.deepspeed.terms import PERSISTENT_PARAMS
from zeroplan.formulas.sharding import flat_shard_numel

HOST_FROM = ("initialize_optimizer_states", "fp32 master: converted and cloned", "partitioned parameters gathered once")
"""The init moments from which the optimizer's host buffers exist (its construction: ``stage_1_and_2.py
__init__``, ``stage3.py _create_fp32_partitions``); the moments before them (the cast, the flat copy, ZeRO-3's
build) hold none."""


def one_memory_by_phase(run: DSRun) -> dict[str, int]:
    """Each phase's peak where the GPU and the host are one memory (a CPU-only run, ``DS_ACCELERATOR=cpu``): every
    GPU moment plus the host bytes alive there (none before the optimizer's construction, ``HOST_FROM``; Adam's
    m and v from the first step, as on the GPU), the largest per phase. What the validator measures on CPU."""
    host = host_memory(run)
    out: dict[str, int] = {}
    for m in moments(run):
        if m.phase != "init":  # the step's host temporaries (HostMemory.step_terms) in the optimizer step only, and
            # not at ZeRO-3's moments around the update (torch Adam's per-tensor temporaries are made inside
            # ``self.optimizer.step()``): ``step`` entry, before ``_partition_all_parameters``, and ``_post_step``
            # (measured: the wide GPT-2 bf16, 2 blocks, N_d = 2, offload_optimizer cpu: the step's peak is the update
            # with the temporaries, 4 B under; 45,040 B over before, the persistent parameters' 45,056 B counted
            # beside the temporaries at the step's entry)
            inside = m.phase == "optimizer_step" and m.name not in (STEP_ENTRY, POST_STEP)
            extra = host.step_peak_bytes if inside else host.steady_bytes
        elif m.name == ZERO3_STATES_INIT:  # ZeRO-3's own init peak on the host (offload.py host_at_states_init)
            extra = host.init_peak_bytes
        else:
            extra = host.init_bytes if m.name in HOST_FROM else 0
        # the partitions copied up for an all-gather: on one memory ``ds_tensor.to(device)`` is the tensor itself
        # (measured: ZeRO-3 with offload_param peaks as without it on CPU)
        same = sum(t.bytes for t in m.terms if t.name.startswith(FETCHED))
        out[m.phase] = max(out.get(m.phase, 0), m.total() - same + extra)
        if m.name == STEP_ENTRY:
            out[m.phase] = max(out[m.phase], fp16_overflow_check(run, m) + host.steady_bytes)
    return out


def fp16_overflow_check(run: DSRun, entry) -> int:
    """ZeRO-3 fp16 with ``offload_optimizer``: ``step`` frees the persistent parameters
    (``_partition_all_parameters``), then checks the gradient partition for overflow (stage3.py
    ``_overflow_check_and_loss_scale_update -> check_overflow -> has_overflow``: ``torch.isinf(
    self.grad_partitions_flat_buffer).any()``, then ``torch.isnan``), a bool tensor of the partition's elements, 1 B
    each, one at a time, on the host (the buffer is made on ``self.device``, the CPU under offload): the GPU at
    ``entry`` (``STEP_ENTRY``) less the persistent parameters, plus that temporary; 0 in bf16/fp32 (no check). On
    the GPU itself the moment is never a peak (at most ``STEP_ENTRY``'s bytes); on one memory it is the step's peak
    when the partition outweighs the persistent parameters. Measured (moefp16, 2026-12-02, Mixtral fp16, N_d = 2,
    tests/data/measured/deepspeed_moe_fp16_nvme.json): 716,981 B (4.76 %) under at 5,000-element buckets and 208,833 B
    (716,864 less the 508,160 persistent bytes) at DeepSpeed's before; 129 B under with it. ``STEP_ENTRY`` is ZeRO-3's
    with ``offload_optimizer`` only (its wrapper's offload moments, offload.py ``_zero3_offload_moments``)."""
    if run.settings.dtype != "fp16":
        return 0
    persistent = sum(t.bytes for t in entry.terms if t.name == PERSISTENT_PARAMS)
    return entry.total() - persistent + flat_shard_numel(run.numels, run.nd)
