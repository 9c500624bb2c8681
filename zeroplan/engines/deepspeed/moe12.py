"""ZeRO-1 and ZeRO-2 (``DeepSpeedZeroOptimizer``, runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8) on a
mixture-of-experts decoder (transformers 5.24: one (E, 2f, d) ``experts.gate_up_proj`` and one (E, d, f)
``experts.down_proj`` per sparse layer): which runs the profile's moments cover, as measured
(tests/test_deepspeed_moe12.py; docs/engines/deepspeed.md "ZeRO-1/2 and mixture-of-experts").

An expert tensor's gradient larger than ``reduce_bucket_size`` is not copied into the bucket but reduced in
place at the next gradient hook (``reduce_independent_p_g_buckets_and_remove_grads`` ->
``extra_large_param_to_reduce``; ``reduce_ipg_grads`` -> ``average_tensor``). Where the profile's terms hold:

- reduced after backward: ZeRO-1 without ``overlap_comm`` (``reduce_gradients``, in parameter order: reduce.py
  ``_stage1_reduce``; a gradient larger than the bucket reduced in place and, stage 1 clearing none, kept to the
  step), at any bucket; or from the hooks with every gradient in one bucket (Ψ <= ``reduce_bucket_size``: no
  hook reduces, the bucket goes after backward, reduce.py ``_epilogue_reduce``). Measured on Mixtral,
  Qwen2-MoE, Qwen3-MoE and DeepSeek-V3, both ranks, every phase: within 0.0074 % (648 B; DeepSeek-V3's
  one-bucket backward 69,304 B of 2.0 GB, 0.0035 %).
- reduced from the hooks (ZeRO-2, ZeRO-1 with ``overlap_comm``) in more than one bucket: not modelled. A rank's
  ``grads_in_partition`` is allocated (``copy_grads_in_partition``) at the hook that reduces its first bucket,
  which may be one inside a sparse MLP's backward (an expert tensor's, or the router's that reduces the expert
  gradient before it), with the block's saved tensors partly released and an expert gradient waiting for its
  reduction beside it; the profile's moments place the allocation at a block's first op
  (``zero12._partition_allocations``) and know the hooks inside GPT's and Llama's dense blocks only
  (``reduce._hook_activations``). Live storages at the measured peak (5,000-element buckets, rank 0): Mixtral's
  and Qwen3-MoE's at layer 1's router hook (its ``gate_up_proj`` gradient, 1 MB / 0.79 MB, beside the new
  partition), Qwen2-MoE's at layer 1's ``gate_up_proj`` hook (both expert gradients alive); DeepSeek-V3's rank 1
  after its last layer's routed ``down_proj`` hook. Backward misses (measured - predicted, rank 0 / rank 1):
  5,000-element buckets, ZeRO-2: Mixtral +0.27 % / 0.00 %, Qwen3-MoE +1.44 % / 0.00 %, Qwen2-MoE +3.99 % /
  -1.04 %, DeepSeek-V3 -1.02 % / -1.06 %; ZeRO-1 with ``overlap_comm``: Mixtral +0.24 % / 0.00 %; 300,000-element
  buckets (every expert tensor within one), Mixtral ZeRO-2 -1.26 % / +0.40 %, ZeRO-1 with ``overlap_comm``
  -1.19 % / +0.38 %. Refused (``zero12_moe_limit``), so that no printed peak is one of them.
- bf16 (DeepSpeedZeroOptimizer, ``grad_accum_dtype`` bf16): the backward and the step as in fp32 (within 648 B,
  DeepSeek-V3's backward 472 B over); the forward was 64,000 B (Mixtral, +0.48 %) and 68,032 B (DeepSeek-V3,
  +1.09 %) under at ZeRO-1 and ZeRO-2 alike until transformers' bf16 logits kept beside their fp32 upcast became a
  term (``phases.forward_moments``, found by the differential matrix, seed 3 draws 4 and 20): now Mixtral 384 B over,
  DeepSeek-V3 480 B over (its routers' fp32 weight copies, 2 x 2,048 B, and bias buffers, 32 B: ``run.router_copies``,
  ``run._fp32_buffers``; 3,648 B under without them).
"""

from __future__ import annotations

import math
from typing import Optional

from zeroplan.architectures.spec import TransformerSpec, transformer_shapes
from zeroplan.engines.deepspeed.settings import Settings, optimizer_class
from zeroplan.engines.deepspeed.zero12 import reduces_from_hooks

SRC = "runtime/zero/stage_1_and_2.py"

ZERO12_MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
"""The sparse families whose ZeRO-1/2 peaks are measured (tests/test_deepspeed_moe12.py)."""


def model_numel(spec: TransformerSpec) -> int:
    """Ψ: every parameter's elements (``transformer_shapes``), the gradients one bucket must hold."""
    return sum(math.prod(shape) for _, shape in transformer_shapes(spec))


def zero12_moe_limit(s: Settings, spec: TransformerSpec) -> Optional[str]:
    """Why the ZeRO-1/2 peak of the sparse model ``spec`` under ``s`` is not given, or None (module docstring):
    outside ``ZERO12_MOE_FAMILIES``, with ``offload_optimizer`` or DeepSpeed's ``BF16_Optimizer`` (not measured on a
    sparse model), or reducing from the hooks in more than one
    bucket (``reduce_bucket_size`` < Ψ)."""
    if spec.model_type not in ZERO12_MOE_FAMILIES:
        return f"model_type {spec.model_type!r} not measured (measured: {', '.join(ZERO12_MOE_FAMILIES)})"
    if s.offload_optimizer.on:
        return f"offload_optimizer to {s.offload_optimizer.device} not measured on routed experts"
    if optimizer_class(s) != "DeepSpeedZeroOptimizer":  # bf16 with fp32 gradient accumulation at ZeRO-1
        return f"{optimizer_class(s)} (runtime/bf16_optimizer.py) not measured on routed experts"
    psi = model_numel(spec)
    if reduces_from_hooks(s) and s.reduce_bucket_size < psi:
        how = "ZeRO-2" if s.partition_gradients else "ZeRO-1 with overlap_comm"
        return (f"{how} with reduce_bucket_size {s.reduce_bucket_size:,} < Ψ = {psi:,}: gradients are reduced at "
                f"hooks inside the sparse MLPs' backward ({SRC} reduce_independent_p_g_buckets_and_remove_grads, "
                "extra_large_param_to_reduce), where a rank's grads_in_partition is allocated beside an expert "
                f"gradient: not modelled (measured misses up to 4 %); use reduce_bucket_size >= {psi:,}, ZeRO-1 "
                "without overlap_comm, or ZeRO-3")
    return None
