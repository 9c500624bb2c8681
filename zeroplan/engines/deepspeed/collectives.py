"""The collectives DeepSpeed 0.19.8 issues in one steady-state step, per optimizer wrapper
(``zero12_collectives``, ``bf16_collectives``, ``zero3_collectives``), each citing the DeepSpeed function
that issues it; ``wrapper.py collectives`` asks the wrapper of the settings."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from zeroplan.engines.deepspeed.coordinator import stage3_schedule
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES, Settings
from zeroplan.engines.deepspeed.terms import aligned_flat_numel, persistent_numel, zero3_partition_numel
from zeroplan.engines.deepspeed.trace import Stage3Trace, stage3_trace
from zeroplan.engines.deepspeed.zeropp import zeropp_gathers
from zeroplan.engines.deepspeed.zeropp_settings import hpz_group
from zeroplan.formulas.collectives import Collective, ring_bytes_per_rank

@dataclass(frozen=True)
class DSCollective:
    """Collectives of one kind DeepSpeed issues per step: ``calls`` calls of ``elements`` in total.

    ``elements`` counts the full tensor of each call (an all-gather's output, an all-reduce's buffer,
    a reduce-scatter's input), as ``validate.probes.CommCounter`` records them. ``calls`` is exact where
    ``calls_exact`` (parameter-order buckets), else the greedy-bucket count in parameter order.
    """

    op: str
    phase: str
    calls: int
    elements: int
    dtype: str
    source: str
    calls_exact: bool = True
    micro_steps: int = 1
    """micro-steps of the optimizer step it runs in (1 or ``grad_accum``); ``calls`` and ``elements`` sum them."""
    group_size: int = 0
    """ranks in its process group; 0: all N_d (ZeRO++ hpZ's secondary group: ``zeropp.py``)."""


@lru_cache(maxsize=64)  # each candidate's collectives and moments, and each rank's run, ask the same
def greedy_buckets(numels: tuple[int, ...], bucket: int) -> tuple[int, ...]:
    """Element counts of the buckets DeepSpeed reduces, tensors taken in order: a bucket is sent before a
    tensor that would overflow it (a tensor larger than the bucket goes alone)
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``; stage3.py
    ``__reduce_and_partition_ipg_grads``)."""
    out, current = [], 0
    for n in numels:
        if current and current + n > bucket:
            out.append(current)
            current = 0
        current += n
    if current:
        out.append(current)
    return tuple(out)


GATHERS_SRC = ("runtime/zero/partitioned_param_coordinator.py fetch_sub_module -> __all_gather_params (the module's "
               "parameters, then the prefetch: one all_gather_coalesced call each; stage3_schedule)")


def zero3_collectives(s: Settings, numels: tuple[int, ...], nd: int, grad_accum: int,
                      trace: Optional[Stage3Trace]) -> tuple[DSCollective, ...]:
    """``DeepSpeedZeroOptimizer_Stage3``: the coordinator's all-gathers (``stage3_schedule``) in every
    micro-step, a reduce-scatter per bucket in every backward, the norm, the persistent re-gather."""
    p, g = s.dtype, s.grad_dtype
    persist = persistent_numel(s, numels)
    out = []
    if trace is None:
        trace = stage3_trace(tuple((f"t{i}.weight", (n,)) for i, n in enumerate(numels)))
    hpz = hpz_group(s.hpz_partition_size, nd)
    if hpz or s.quantized_weights:  # ZeRO++ (zeropp.py): the coordinator's calls by group, quantized
        out += [DSCollective("all-gather", phase, calls, elements, dtype, src, calls_exact=True, micro_steps=grad_accum,
                             group_size=0 if group == nd else group)
                for phase, group, dtype, calls, elements, src in zeropp_gathers(s, trace, numels, nd, hpz, grad_accum)]
    else:
        sched = stage3_schedule(trace, numels, nd, s.param_persistence_threshold, s.prefetch_bucket_size,
                                s.max_live_parameters, s.max_reuse_distance)  # fmt: skip
        for phase, calls, elements in (("forward", sched.forward_calls, sched.forward_elements),
                                       ("backward", sched.backward_calls, sched.backward_elements)):
            if calls:
                out.append(DSCollective("all-gather", phase, grad_accum * calls, grad_accum * elements, p, GATHERS_SRC,
                                        micro_steps=grad_accum))  # fmt: skip
    out += [
        DSCollective("reduce-scatter", "backward", grad_accum * len(greedy_buckets(numels, s.reduce_bucket_size)),
                     grad_accum * nd * zero3_partition_numel(numels, nd), g,
                     "runtime/zero/stage3.py __reduce_and_partition_ipg_grads -> __avg_scatter_grads -> "
                     "runtime/comm/coalesced_collectives.py reduce_scatter_coalesced, bucket by bucket (each gradient "
                     "padded to a multiple of N_d: measured at N_d = 3, 557,721 elements of Psi = 557,696)",
                     calls_exact=False,
                     micro_steps=grad_accum),
        DSCollective("all-reduce", "optimizer_step", 1, 1, "fp64",
                     "runtime/zero/stage3.py _get_norm_groups / get_grad_norm (fp64 global norm)"),
    ]  # fmt: skip
    if p == "fp16":  # measured with the CPU accelerator's fp16 check overridden (docs/engines/deepspeed.md)
        out.append(DSCollective("all-reduce", "optimizer_step", 1, 1, "uint8",
                                "runtime/zero/stage3.py _overflow_check_and_loss_scale_update (fp16 only) -> "
                                "has_overflow"))  # fmt: skip
    if persist:
        out.append(DSCollective("all-gather", "optimizer_step", sum(1 for n in numels if n <= s.param_persistence_threshold),
                                persist, p, "runtime/zero/stage3.py _post_step -> persistent parameters re-gathered "
                                "(parameter_offload.py persistent_parameters)"))  # fmt: skip
    return tuple(out)


def _flat_all_gather(s: Settings, numels: tuple[int, ...], nd: int) -> DSCollective:
    """ZeRO-1/2 and BF16_Optimizer after the step: the updated partitions gathered into the flat group."""
    return DSCollective("all-gather", "optimizer_step", 1, aligned_flat_numel(numels, nd), s.dtype,
                        "runtime/utils.py all_gather_dp_groups -> all_gather_into_tensor_dp_groups (one "
                        "all_gather_into_tensor of the padded flat group, whatever allgather_bucket_size: its shards "
                        "are cut only without all_gather_into_tensor; measured: one call at 5,000 elements)")  # fmt: skip


def bf16_collectives(s: Settings, numels: tuple[int, ...], nd: int, grad_accum: int,
                     trace: Optional[Stage3Trace]) -> tuple[DSCollective, ...]:
    """``BF16_Optimizer``: the engine all-reduces the flat gradients at the boundary, then the all-gather."""
    return (
        DSCollective("all-reduce", "backward", 1, aligned_flat_numel(numels, nd), s.dtype,
                     "runtime/bf16_optimizer.py BF16_Optimizer (engine.allreduce_gradients of the flat bf16 grads)"),
        _flat_all_gather(s, numels, nd),
    )  # fmt: skip


def zero12_collectives(s: Settings, numels: tuple[int, ...], nd: int, grad_accum: int,
                       trace: Optional[Stage3Trace]) -> tuple[DSCollective, ...]:
    """``DeepSpeedZeroOptimizer``: an all-reduce per bucket (every micro-step with ``partition_gradients``,
    ZeRO-2; at the boundary at ZeRO-1), the norm, the overflow check in 16 bits, the all-gather."""
    p, g = s.dtype, s.grad_dtype
    buckets = greedy_buckets(numels, s.reduce_bucket_size)
    micro = grad_accum if s.partition_gradients else 1
    out = [
        DSCollective("all-reduce", "backward", micro * len(buckets), micro * sum(numels), g,
                     "runtime/zero/stage_1_and_2.py average_tensor -> allreduce_and_scatter -> allreduce_bucket "
                     "(use_multi_rank_bucket_allreduce: an all-reduce per bucket, not a reduce-scatter)",
                     calls_exact=not s.partition_gradients and not s.overlaps,  # overlap_comm: from the hooks
                     micro_steps=micro),
        DSCollective("all-reduce", "optimizer_step", 1, 1, "fp32",
                     "runtime/zero/stage_1_and_2.py get_grad_norm_direct (the global gradient norm)"),
    ]  # fmt: skip
    if p in ("bf16", "fp16"):
        out.append(DSCollective("all-reduce", "optimizer_step", 1, 1, "uint8",
                                "runtime/zero/stage_1_and_2.py has_overflow (check_grad_overflow)"))  # fmt: skip
    out.append(_flat_all_gather(s, numels, nd))
    return tuple(out)


def to_collective(c: DSCollective, nd: int) -> Collective:
    """A ``DSCollective`` as the engine contract's ``Collective`` (bytes per rank on a ring), per optimizer
    step as counted (``micro_steps``)."""
    phase = "optimizer step" if c.phase == "optimizer_step" else c.phase
    nbytes = DTYPE_BYTES.get(c.dtype, 1)
    group = c.group_size or nd  # a ring over its own group (hpZ: the secondary group)
    return Collective(c.op, phase, c.elements, c.dtype, ring_bytes_per_rank(c.op, c.elements, group, nbytes),
                      c.micro_steps, group_size=c.group_size)
