"""``offload_optimizer: cpu`` at ZeRO-1/2 on a mixture-of-experts decoder (transformers 5.24's 3-D expert tensors,
DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py with ``cpu_offload``): which runs the offload profile
(engines/deepspeed/offload.py) covers, as measured (benchmarks/ds_moe_opt_rows.py offload; rows in
tests/data/measured/deepspeed_moe_offload.json, predicted again by tests/test_deepspeed_moe_opt.py;
docs/engines/deepspeed.md "BF16_Optimizer and offload on mixture-of-experts").

Every gradient in one bucket (Ψ <= ``reduce_bucket_size``: DeepSpeed's default 5e8 on a model below 500M
parameters): no hook and no ``reduce_gradients`` walk reduces before the bucket is full, the epilogue reduces it
once (``overlapping_partition_gradients_reduce_epilogue`` -> ``reduce_ipg_grads``) and ``copy_grads_in_partition``
sends the rank's slices to the host: the dense schedule. Measured on Mixtral, Qwen3-MoE, Qwen2-MoE and
DeepSeek-V3 at ZeRO-1 and ZeRO-2, fp32 and bf16, both ranks (gloo, N_d = 2): within target (``MEASURED_ONE_BUCKET``).

More than one bucket (``reduce_bucket_size`` < Ψ). An expert tensor larger than the bucket is reduced on its own
(``extra_large_param_to_reduce``), and under ``cpu_offload`` first cloned
(``reduce_independent_p_g_buckets_and_remove_grads``: ``_offload_gradient_safety_enabled``,
``grad_reduc.detach().clone()``); each reduced slice of the rank's partition is copied for its norm
(``set_norm_for_param_grad_in_gpu``: ``.to(get_norm_dtype())``, fp64 where the device has it, runtime/zero/utils.py:
8 B an element, in fp32 too), sent to the host (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``) and its
gradient cleared (``clear_grad_attribute``, offload only). Live storages at Mixtral's ZeRO-1 fp32 peak
(5,000-element buckets, benchmarks/ds_moe_opt_rows.py offload --trace mixtral-wide:z1-fp32-small): rank 0 at layer 0's
``down_proj`` call, the 2,097,152-B fp64 copy of its 262,144-element ``gate_up_proj`` slice beside that gradient's
1,048,576-B clone and the later parameters' gradients still in ``param.grad``.

ZeRO-1 without ``overlap_comm`` reduces in that walk after backward (``reduce_gradients``), replayed per rank by
``offload_walk.stage1_offload_walk`` (a dense rule too, so it lives there: on gpt-tiny bf16 at 5,000-element
buckets, 5,184-element weights, its moment is 13,664-35,336 B below the measured backward peak,
tests/test_engine_offload.py ``MEASURED``: unchanged). Measured (every family, fp32 and bf16, both ranks): the backward within 0.006 %; before, up to
1,370,028 B (4.63 %) under, and DeepSeek-V3 bf16 1.58 % over (the offload profile's fp32 upcast,
``offload._hook_upcast``, at the final norm's hook: ZeRO-1 without ``overlap_comm`` copies nothing in backward).
ZeRO-2 (and ZeRO-1 with ``overlap_comm``) reduce from the hooks inside a sparse MLP's backward (moe12_hooks.py),
where neither term is modelled: refused (``MEASURED_SEVERAL_BUCKETS``)."""

from __future__ import annotations

from typing import Optional

from zeroplan.engines.deepspeed.offload_walk import offload_walk_applies
from zeroplan.engines.deepspeed.settings import Settings

SRC = "runtime/zero/stage_1_and_2.py"

MEASURED_ONE_BUCKET = "fp32 within 440 B, bf16 up to 0.103 % over"
"""Backward, measured - predicted, every family, ZeRO-1 and ZeRO-2 at 5e8-element buckets (every other phase within
880 B; G = 2 as G = 1); the rows: tests/data/measured/deepspeed_moe_offload.json."""
MEASURED_SEVERAL_BUCKETS = "ZeRO-2 up to 4.38 % under, Mixtral fp32 at 5,000-element buckets"


def moe_offload_limit(s: Settings, psi: int) -> Optional[str]:
    """Why the ZeRO-1/2 peak of a sparse model with ``offload_optimizer`` under ``s`` is not given, or None: a device
    other than cpu (not measured on a sparse model), or gradients in more than one bucket (``reduce_bucket_size`` <
    Ψ = ``psi``; module docstring)."""
    o = s.offload_optimizer
    if not o.on:
        return None
    if o.device != "cpu":  # measured: cpu, in fp32, bf16 and fp16 (nvme: ZeRO-3 only, nvme.check_nvme)
        return f"offload_optimizer to {o.device} not measured on routed experts"
    if s.reduce_bucket_size < psi and not offload_walk_applies(s, psi):
        how = f"ZeRO-{s.stage}" + (" with overlap_comm" if s.overlaps else "")
        return (f"offload_optimizer with reduce_bucket_size {s.reduce_bucket_size:,} < Ψ = {psi:,} at {how}: "
                "reduced from the gradient hooks, an expert gradient larger than the bucket cloned and each reduced "
                f"slice's fp64 norm copy ({SRC} reduce_independent_p_g_buckets_and_remove_grads, "
                "set_norm_for_param_grad_in_gpu) are not modelled on routed experts (measured "
                f"{MEASURED_SEVERAL_BUCKETS}); use reduce_bucket_size >= {psi:,}, or ZeRO-1 without overlap_comm")
    return None
