"""ZeRO-1 and ZeRO-2 (``DeepSpeedZeroOptimizer``, runtime/zero/stage_1_and_2.py, DeepSpeed 0.19.8) on a
mixture-of-experts decoder (transformers 5.24: one (E, 2f, d) ``experts.gate_up_proj`` and one (E, d, f)
``experts.down_proj`` per sparse layer): which runs the profile's moments cover, as measured
(tests/test_deepspeed_moe12.py; docs/engines/deepspeed.md "ZeRO-1/2 and mixture-of-experts").

An expert tensor's gradient larger than ``reduce_bucket_size`` is not copied into the bucket but reduced in
place at the next gradient hook (``reduce_independent_p_g_buckets_and_remove_grads`` ->
``extra_large_param_to_reduce``; ``reduce_ipg_grads`` -> ``average_tensor``). Measured on Mixtral, Qwen2-MoE,
Qwen3-MoE and DeepSeek-V3, both ranks, every phase (fp32, gloo, N_d = 2; rows in tests/test_deepspeed_moe12.py):

- reduced after backward: ZeRO-1 without ``overlap_comm`` (``reduce_gradients``, in parameter order: reduce.py
  ``_stage1_reduce``; a gradient larger than the bucket reduced in place and, stage 1 clearing none, kept to the
  step), at any bucket; or from the hooks with every gradient in one bucket (Ψ <= ``reduce_bucket_size``: no
  hook reduces, the bucket goes after backward, reduce.py ``_epilogue_reduce``): within 0.0074 % (648 B;
  DeepSeek-V3's one-bucket backward 440 B, at its head's hook: moe12_hooks.head_hook_bucket).
- reduced from the hooks (ZeRO-2, ZeRO-1 with ``overlap_comm``) in more than one bucket: a bucket reduced at a hook
  inside a sparse MLP's backward (``gate_up_proj``'s, the router's or the post-attention norm's) with the hooked
  gradient and an expert gradient larger than the bucket waiting beside it, the block's saved tensors partly
  released, and a rank's ``grads_in_partition`` allocated there or held from an earlier bucket; the last block's
  working set without the weight gradients gone at the hooks: moe12_hooks.py (found by live-storage traces at each
  rank's backward peak, benchmarks/ds_moe12_rows.py ``trace``). Buckets below every expert tensor (5,000
  elements), between the expert tensors (Mixtral 200,000: Mixtral-8x7B's case at DeepSpeed's 5e8; DeepSeek-V3
  50,000; Qwen3-MoE 150,000; Qwen2-MoE 100,000) and above both (300,000): within 3,720 B (0.021 %, Qwen3-MoE);
  the gate-up backward with a partition a ``down_proj`` hook allocated (``_gate_up_backward``), the gathered rows'
  backward after a gate-up hook whose gradient waits; the head's hook allocating the bucket
  and, the head's gradient larger than the bucket, the final norm's weight-product backward with it waiting
  (``head_hook_bucket``: DeepSeek-V3's rank 0 at 50,000, 61,800 B (0.75 %) under before, now 440 B over).
  Before (the partition placed at a block's first op): misses up to +3.99 % / -1.26 %.
  bf16 (Mixtral at 5,000 and 200,000, DeepSeek-V3 at 5,000 and 50,000): within 15,912 B (0.24 %).
  Qwen2-MoE with buckets from its ``gate_up_proj`` (E·2f·d) up to Ψ: a bucket reduced at a hook of its shared
  SwiGLU (called first, run backward last: ``moe12_hooks._at_shared_hook``) or of the routed experts' ``down_proj``
  (``_at_hook``, role "down"), a rank's partition or the bucket's flattened copy allocated there: refused before
  (up to +5.2 % under: N_d 3 at 1,000,000); now 21 rows, buckets from 131,072 to 1,434,686, fp32 and bf16, N_d 2
  and 3, ZeRO-2 and ZeRO-1 with overlap_comm, every phase within 2,200 B under and 33,144 B over (0.13 %, ZeRO-1
  with overlap_comm at 700,000, unchanged) (tests/data/measured/deepspeed_moe12_qwen2.json). Refused
  (``zero12_moe_limit``): nothing of these.
- fp16 (DeepSpeedZeroOptimizer with its loss scaler, DeepSpeed's fp16 capability answered yes on CPU:
  validate/engines/deepspeed_changes.py ``fp16_on_cpu``): reducing from the hooks, refused before as not measured;
  measured on the four families, ZeRO-2 and ZeRO-1 with overlap_comm, buckets below, between and above the expert
  tensors and Qwen2-MoE's shared-hook range (16 rows): every phase as bf16's (the same bytes per element), within
  15,912 B (0.25 %, DeepSeek-V3 at 5,000, as in bf16) under and 480 B over
  (tests/data/measured/deepspeed_moe12_fp16.json).
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
from zeroplan.engines.deepspeed.moe_offload import moe_offload_limit
from zeroplan.engines.deepspeed.settings import Settings

ZERO12_MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
"""The sparse families whose ZeRO-1/2 peaks are measured (tests/test_deepspeed_moe12.py)."""


def model_numel(spec: TransformerSpec) -> int:
    """Ψ: every parameter's elements (``transformer_shapes``), the gradients one bucket must hold."""
    return sum(math.prod(shape) for _, shape in transformer_shapes(spec))


def zero12_moe_limit(s: Settings, spec: TransformerSpec, grad_accum: int = 1) -> Optional[str]:
    """Why the ZeRO-1/2 peak of the sparse model ``spec`` under ``s`` is not given, or None (module docstring):
    outside ``ZERO12_MOE_FAMILIES``, or with ``offload_optimizer`` where ``moe_offload.moe_offload_limit`` refuses.
    fp32, bf16 and fp16 (``DeepSpeedZeroOptimizer``), reduced after backward or from the hooks at any bucket, and
    ``BF16_Optimizer`` (no hook reduces: bf16.py; tests/test_deepspeed_moe_opt.py): measured (module docstring).
    ``grad_accum``: G, micro-steps per optimizer step."""
    if spec.model_type not in ZERO12_MOE_FAMILIES:
        return f"model_type {spec.model_type!r} not measured (measured: {', '.join(ZERO12_MOE_FAMILIES)})"
    if s.offload_optimizer.on:  # measured: one bucket, ZeRO-1's walk, ZeRO-2 from the largest tensor (moe_offload.py)
        largest = max(math.prod(shape) for _, shape in transformer_shapes(spec))
        return moe_offload_limit(s, model_numel(spec), largest, grad_accum)
    return None

