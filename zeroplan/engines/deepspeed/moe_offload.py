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

ZeRO-2 reduces from the hooks, inside a sparse block's backward (moe12_hooks.py). With every gradient within a bucket
(the largest tensor <= ``reduce_bucket_size`` < Ψ; issue 19, 2026-12-02) no clone is made and no
``grads_in_partition`` exists under ``cpu_offload`` (``copy_grads_in_partition`` returns after the host copy): a
bucket reduced at a hook holds ``allreduce_bucket``'s flattened copy, then, freed, the fp64 copy of each of its
parameters' slices in the rank's partition in turn (``norm_copy``; 16-bit: ``.to(fp32)`` for the host copy after it,
half its size), the larger of the two, beside the hook's activations (``norms_at_hooks``). Live storages at
Mixtral's ZeRO-2 fp32 rank 1 peak (300,000-element buckets, benchmarks/ds_moe12_rows.py trace mixtral-wide 2 300000
--offload): layer 2's ``gate_up_proj`` hook, its 1,048,576-B gradient waiting beside the 1,048,576-B fp64 copy of the
whole ``down_proj`` slice (720,528 B under before); bf16 at layer 2's ``q_proj`` hook with the 2,097,152-B fp64 copy
of a whole ``gate_up_proj``. Measured: ``MEASURED_FROM_HOOKS``. Still refused: a bucket below the largest tensor
(the clone, ``MEASURED_SEVERAL_BUCKETS``), ``overlap_comm`` (two buckets; ``MEASURED_OVERLAP``), and G > 1 (measured at
G = 2: ``MEASURED_FROM_HOOKS_G2``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from zeroplan.engines.deepspeed.offload_walk import _slice, offload_walk_applies
from zeroplan.engines.deepspeed.run import DSRun
from zeroplan.engines.deepspeed.settings import Settings
from zeroplan.formulas.peak import Term

SRC = "runtime/zero/stage_1_and_2.py"

MEASURED_ONE_BUCKET = "fp32 within 440 B, bf16 up to 0.103 % over"
"""Backward, measured - predicted, every family, ZeRO-1 and ZeRO-2 at 5e8-element buckets (every other phase within
880 B; G = 2 as G = 1); the rows: tests/data/measured/deepspeed_moe_offload.json."""
MEASURED_SEVERAL_BUCKETS = "ZeRO-2 up to 4.38 % under, Mixtral fp32 at 5,000-element buckets"
MEASURED_OVERLAP = "ZeRO-1 with overlap_comm up to 2.49 % under and 2.79 % over, Mixtral at 300,000-element buckets"
"""Backward, N_d = 2: rank 1 720,528 B (fp32) and 458,904 B (bf16) under (no norm copy at its hooks), bf16 rank 0
564,584 B over (the per-block upcast); benchmarks/ds_moe12_rows.py buckets mixtral-wide 1o:300000 --offload
[--dtype bf16], 2026-12-02; not recorded as rows."""
MEASURED_FROM_HOOKS = "within 3,488 B under and 66,920 B (0.44 %, Mixtral bf16 at 300,000) over"
"""ZeRO-2 with buckets between the largest tensor and Ψ, measured - predicted, every phase of every rank: 30 rows,
Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3, fp32 and bf16, N_d 2 and 3, two or three buckets each (before: 3.1 %
under to 6.1 % over; tests/data/measured/deepspeed_moe_offload_hooks.json, tests/test_deepspeed_moe_opt.py)."""
MEASURED_FROM_HOOKS_G2 = "at G = 2 up to 1.73 % over and 2.94 % under"
"""The same region at G = 2 (issue 19, 2026-12-02), measured - predicted: Mixtral fp32 at 300,000-element buckets
backward rank 0 524,664 B over (-1.73 %), rank 1 196,240 B under (+0.63 %); DeepSeek-V3 bf16 at 100,000 rank 1
268,848 B under (+2.94 %); every other phase within 0.011 % (benchmarks/ds_moe12_rows.py buckets ... --offload --ga 2,
N_d 2; tests/data/measured/deepspeed_moe_offload_hooks_g2.json): outside +1 % / -0.5 %, so refused."""


def moe_offload_limit(s: Settings, psi: int, largest: int, grad_accum: int = 1) -> Optional[str]:
    """Why the ZeRO-1/2 peak of a sparse model with ``offload_optimizer`` under ``s`` is not given, or None: a device
    other than cpu (not measured on a sparse model), or gradients in more than one bucket (``reduce_bucket_size`` <
    Ψ = ``psi``) reduced from the hooks with an expert gradient larger than the bucket (< ``largest``, the largest
    tensor: cloned), with ``overlap_comm`` or without ``contiguous_gradients``, or at G = ``grad_accum`` > 1
    (``MEASURED_FROM_HOOKS_G2``) (module docstring)."""
    o = s.offload_optimizer
    if not o.on:
        return None
    if o.device != "cpu":  # measured: cpu, in fp32, bf16 and fp16 (nvme: ZeRO-3 only, nvme.check_nvme)
        return f"offload_optimizer to {o.device} not measured on routed experts"
    bucket = s.reduce_bucket_size
    if bucket >= psi or offload_walk_applies(s, psi):
        return None
    how = f"ZeRO-{s.stage}" + (" with overlap_comm" if s.overlaps else "")
    if s.overlaps or not s.contiguous_gradients:
        what = "with overlap_comm" if s.overlaps else "without contiguous_gradients"
        return (f"offload_optimizer with reduce_bucket_size {bucket:,} < Ψ = {psi:,} at {how}: reduced from the hooks "
                f"{what}, not modelled on routed experts (measured {MEASURED_OVERLAP}); use reduce_bucket_size >= "
                f"{psi:,}, ZeRO-2 without overlap_comm, or ZeRO-1 without overlap_comm")
    if bucket < largest:
        return (f"offload_optimizer with reduce_bucket_size {bucket:,} < the largest tensor ({largest:,}) at {how}: "
                "reduced from the hooks, an expert gradient larger than the bucket cloned and reduced at the next "
                f"hook ({SRC} reduce_independent_p_g_buckets_and_remove_grads, _offload_gradient_safety_enabled) is not "
                f"modelled on routed experts (measured {MEASURED_SEVERAL_BUCKETS}); use reduce_bucket_size >= "
                f"{largest:,}, or ZeRO-1 without overlap_comm")
    if grad_accum > 1:
        return (f"offload_optimizer with reduce_bucket_size {bucket:,} < Ψ = {psi:,} at {how} and "
                f"gradient_accumulation_steps {grad_accum}: reduced from the hooks while accumulating, not modelled on "
                f"routed experts (measured {MEASURED_FROM_HOOKS_G2}); use gradient_accumulation_steps 1 (a larger "
                f"micro-batch), or reduce_bucket_size >= {psi:,}")
    return None  # ZeRO-2 from the hooks, every gradient in a bucket, G = 1: ``norms_at_hooks`` (MEASURED_FROM_HOOKS)


def norms_at_hooks(run: DSRun) -> bool:
    """Whether the sparse hook reductions (moe12_hooks.py ``sparse_hook_partitions``) hold the fp64 norm copies of
    ``norm_copy`` instead of a ``grads_in_partition``, and the offload profile's per-block upcast
    (offload.py ``_hook_upcast``) is not counted: a sparse model at ZeRO-2 with ``offload_optimizer`` and more than one
    bucket, none smaller than the largest tensor (max(numels) <= ``reduce_bucket_size`` < Ψ), without ``overlap_comm``,
    ``contiguous_gradients`` on: what was measured (``moe_offload_limit`` refuses the rest; their predictions, recorded
    with the refused rows, unchanged)."""
    s, spec = run.settings, run.spec
    return (spec is not None and spec.moe is not None and s.offload_optimizer.on and s.partition_gradients
            and not s.overlaps and s.contiguous_gradients and max(run.numels) <= s.reduce_bucket_size < sum(run.numels))


def norm_copy(run: DSRun, rank: int, params: Iterable[int]) -> Term:
    """Under ``cpu_offload`` a reduction (``reduce_ipg_grads``) sends each of the bucket's parameters overlapping the
    rank's partition to the host in turn (``copy_grads_in_partition``, no ``grads_in_partition``): its slice copied
    for the norm (``set_norm_for_param_grad_in_gpu``: ``.to(get_norm_dtype())``, fp64 where the device has it, 8 B
    an element in fp32 and bf16 alike; then, 16-bit, ``.to(fp32)`` for the host copy, 4 B, after it is freed), after
    ``allreduce_bucket``'s flattened copy is freed: the largest slice of ``params`` in ``rank``'s partition, 8 B an
    element."""
    flat = run.flat
    largest = max((_slice(flat.offsets, flat.part, i, rank) for i in params), default=0)
    return Term("fp64 copy of the rank's largest slice in the bucket (its norm)", 8 * largest,
                f"{SRC} copy_grads_in_partition -> set_norm_for_param_grad_in_gpu (.to(get_norm_dtype()))")
