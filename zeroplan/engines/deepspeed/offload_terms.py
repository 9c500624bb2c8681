"""What DeepSpeed's offload leaves of the wrappers' model-state terms on the GPU (``on_gpu``) and how it changes
their collectives (``offload_collectives``), DeepSpeed 0.19.8; the host side and the moments: ``offload.py``.
Imported by ``run.py`` and ``wrapper.py``, so it imports neither."""

from __future__ import annotations

from dataclasses import replace

from zeroplan.engines.deepspeed.settings import Settings
from zeroplan.engines.deepspeed.terms import DSTerm, aligned_flat_numel
from zeroplan.formulas.peak import Term
from zeroplan.formulas.sharding import flat_shard_numel

S12 = "runtime/zero/stage_1_and_2.py"

MOVED_WITH_OPTIMIZER = ("fp32 master partition", "Adam m and v", "Adam step tensor", "overflow buffer",
                        "step scalars", "gradient partition")  # fmt: skip
"""Model-state terms (``terms.py``) that ``offload_optimizer`` puts on the host (the step scalars become one
norm on the GPU: ``_gpu_extras``)."""
def offloads(s: Settings) -> bool:
    return s.offload_optimizer.on or s.offload_param.on


def _moved(s: Settings, name: str) -> bool:
    if s.offload_param.on and name == "16-bit parameter partition":
        return True
    return s.offload_optimizer.on and name.startswith(MOVED_WITH_OPTIMIZER)


def _gpu_extras(s: Settings, numels: tuple[int, ...], nd: int) -> tuple[DSTerm, ...]:
    """What offload adds on the GPU: ZeRO-1/2's staging buffer of the largest parameter and the global norm."""
    if not s.offload_optimizer.on:
        return ()
    norm = DSTerm("gradient norm scalar", "lazy", 1, "fp32", f"{S12} complete_grad_norm_calculation_for_cpu_offload")
    if s.stage == 3:
        return ()
    return (DSTerm("gradient staging buffer (largest tensor)", "persistent", max(numels), s.dtype,
                   f"{S12} DeepSpeedZeroOptimizer.__init__ (temp_grad_buffer_for_gpu_offload)"), norm)  # fmt: skip


def on_gpu(s: Settings, numels: tuple[int, ...], nd: int, terms: tuple[DSTerm, ...]) -> tuple[DSTerm, ...]:
    """The wrapper's model-state terms (``terms.py``) less what offload puts on the host, plus its GPU buffers;
    ZeRO-3's global norm in fp32 (``_fp32_norm``)."""
    if not offloads(s):
        return terms
    kept = (replace(t, dtype="fp32", source=f"{t.source}; fp32 with offload_optimizer (measured 4 B)")
            if _fp32_norm(s) and t.name == "grad-norm scalar" else t for t in terms if not _moved(s, t.name))
    return (*kept, *_gpu_extras(s, numels, nd))


def _fp32_norm(s: Settings) -> bool:
    """ZeRO-3 with ``offload_optimizer`` keeps and all-reduces its global norm in fp32, not fp64 (measured:
    gpt-tiny bf16 at N_d = 2, the step's all-reduce of one fp32 element, the model states 4 B below fp64's)."""
    return s.stage == 3 and s.offload_optimizer.on


PARAM_NORMS = "per-parameter gradient norms (fp64, norm_for_param_grads)"
"""ZeRO-3 with ``offload_optimizer``: one fp64 scalar per parameter, made in backward, freed by ``_post_step``."""


def param_norm_count(numels: tuple[int, ...], nd: int, rank: int | None) -> int:
    """ZeRO-3 with ``offload_optimizer``: the parameters whose norm ``rank`` keeps from backward to the step.
    stage3.py ``partition_grads`` skips a parameter whose partition on the rank holds no real element
    (``contains_real_data``: ceil(n / N_d)·rank < n) and otherwise, at the accumulation boundary,
    ``_offload_grad_partition_at_boundary`` stores ``_constant_buffered_norm2`` of its partition (an fp64 scalar)
    in ``norm_for_param_grads``, which ``_post_step -> reset_cpu_buffers`` empties. Every rank described
    (``rank`` None): rank 0's, every parameter. Measured (gpt-tiny bf16, 28 tensors, N_d = 1 and 2, MemTracker):
    28 × 8 = 224 B freed by ``reset_cpu_buffers``."""
    r = rank or 0
    return sum(1 for n in numels if -(-n // nd) * r < n)


def offload_collectives(s: Settings, collectives: tuple) -> tuple:
    """The wrapper's collectives (``collectives.py``) as offload issues them: ZeRO-3's norm all-reduce in fp32."""
    if not _fp32_norm(s):
        return collectives
    return tuple(replace(c, dtype="fp32") if (c.op, c.phase, c.dtype) == ("all-reduce", "optimizer_step", "fp64")
                 else c for c in collectives)


TORCH_ADAM_STEP = "torch Adam's step temporaries on the host (torch_adam)"
TORCH_ADAM_SRC = "torch/optim/adam.py (torch 2.13)"


def torch_adam_step_temporaries(s: Settings, numels: tuple[int, ...], nd: int) -> Term | None:
    """``optimizer.params.torch_adam`` with ``offload_optimizer`` cpu: torch's Adam/AdamW steps the host's fp32 master
    partition, one tensor per group (ZeRO-1/2 ``single_partition_of_fp32_groups``, ZeRO-3 one sub-group's
    ``fp32_partitioned_groups_flat``), and its update allocates on the host while ``step`` runs, on top of the
    steady host terms (``offload.host_terms``). DeepSpeed passes ``foreach`` from the config (engine.py
    ``_configure_basic_optimizer``: ``{'foreach': foreach}``, None by default), and torch's default on CPU tensors is
    the single-tensor path (optimizer.py ``_default_to_fused_or_foreach``: CPU is not in
    ``_get_foreach_kernels_supported_devices``). ``_single_tensor_adam``: ``denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)``: the sqrt and the quotient, both fp32 of the tensor, alive together: 8 B per
    element of the largest tensor (the partition). ``foreach: true``, ``_multi_tensor_adam``: ``exp_avg_sq_sqrt =
    torch._foreach_sqrt(device_exp_avg_sqs)`` then in-place ``_foreach_div_`` / ``_foreach_add_``: 4 B per element
    of the group. (Adam without ``adam_w_mode`` and a weight decay adds ``grad.add(param)``: not read, 0.)
    Measured (gpt-tiny fp32, N_d = 1, DS_ACCELERATOR=cpu, MemTracker; partition 36,324 elements): the step's peak
    290,956 B (ZeRO-1 and ZeRO-2) and 290,596 B (ZeRO-3) above the profile without it; this term 290,592 B."""
    if not (s.torch_adam and s.offload_optimizer.on and s.offload_optimizer.device == "cpu"):
        return None
    part = flat_shard_numel(numels, nd) if s.stage == 3 else aligned_flat_numel(numels, nd) // nd
    per = 4 if s.foreach else 8
    how = "_multi_tensor_adam: _foreach_sqrt" if s.foreach else "_single_tensor_adam: exp_avg_sq.sqrt() / bias_correction2_sqrt"
    return Term(TORCH_ADAM_STEP, part * per, f"{TORCH_ADAM_SRC} {how} (fp32 partition)", 1 if s.foreach else 2)
