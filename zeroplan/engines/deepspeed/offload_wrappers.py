"""The offload of each wrapper that has one (``Wrapper.offload``, offload_terms.py ``WrapperOffload``), DeepSpeed
0.19.8: ``DeepSpeedZeroOptimizer``'s ``cpu_offload`` (runtime/zero/stage_1_and_2.py, ZeRO-1/2: ``ZERO12_OFFLOAD``)
and ``DeepSpeedZeroOptimizer_Stage3``'s ``offload_optimizer`` / ``offload_param`` (runtime/zero/stage3.py and the
swappers of runtime/swap_tensor/, ZeRO-3: ``ZERO3_OFFLOAD``). Each is chosen with its wrapper (``wrapper.py
wrapper_for``); offload.py and offload_terms.py ask it, never the stage. The terms and moments are offload.py's."""

from __future__ import annotations

from zeroplan.engines.deepspeed.nvme import step_terms
from zeroplan.engines.deepspeed.offload import (_zero3_offload_moments, flat_host_terms, hook_upcasts, host_at_states_init,
                                                nvme_step_bytes, zero3_host_terms)
from zeroplan.engines.deepspeed.offload_terms import S12, WrapperOffload
from zeroplan.engines.deepspeed.offload_walk import stage1_offload_walk
from zeroplan.engines.deepspeed.run import DSRun
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES, Settings
from zeroplan.engines.deepspeed.terms import DSTerm, aligned_flat_numel
from zeroplan.formulas.peak import Moment, Term
from zeroplan.formulas.sharding import flat_shard_numel


class CpuOffload12(WrapperOffload):
    """``DeepSpeedZeroOptimizer`` with ``cpu_offload`` (stage_1_and_2.py): the full 16-bit flat group stays on the
    GPU, the fp32 partition, its gradient and Adam's states go to the host (offload.py module docstring)."""

    host_terms = staticmethod(flat_host_terms)

    def gpu_terms(self, s: Settings, numels: tuple[int, ...]) -> tuple[DSTerm, ...]:
        """With ``offload_optimizer``: the staging buffer of the largest parameter and the global norm."""
        if not s.offload_optimizer.on:
            return ()
        return (DSTerm("gradient staging buffer (largest tensor)", "persistent", max(numels), s.dtype,
                       f"{S12} DeepSpeedZeroOptimizer.__init__ (temp_grad_buffer_for_gpu_offload)"),
                DSTerm("gradient norm scalar", "lazy", 1, "fp32",
                       f"{S12} complete_grad_norm_calculation_for_cpu_offload"))  # fmt: skip

    def traffic(self, run: DSRun) -> tuple[int, int]:
        """Each reduced gradient slice of the partition to the host in fp32 at the boundary
        (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), the 16-bit partition back after the step
        (``param_buffer_of_bit16_for_cpu_offload_groups``)."""
        s = run.settings
        if not s.offload_optimizer.on:
            return 0, 0
        part = aligned_flat_numel(run.numels, run.nd) // run.nd
        return part * DTYPE_BYTES[s.dtype], part * 4

    def moments(self, run: DSRun, moments: tuple[Moment, ...]) -> tuple[Moment, ...]:
        """The hooks' fp32 copies of a gradient slice (offload.py ``hook_upcasts``), then ZeRO-1's walk after
        backward (offload_walk.py ``stage1_offload_walk``)."""
        return (*hook_upcasts(run, moments), *stage1_offload_walk(run))


class Stage3Offload(WrapperOffload):
    """``DeepSpeedZeroOptimizer_Stage3`` with ``offload_optimizer`` and / or ``offload_param`` (stage3.py; NVMe:
    partitioned_optimizer_swapper.py, partitioned_param_swapper.py)."""

    host_terms = staticmethod(zero3_host_terms)
    host_at_states_init = staticmethod(host_at_states_init)
    nvme_step_bytes = staticmethod(nvme_step_bytes)

    def fp32_norm(self, s: Settings) -> bool:
        """With ``offload_optimizer`` the global norm is kept and all-reduced in fp32, not fp64 (measured: gpt-tiny
        bf16 at N_d = 2, the step's all-reduce of one fp32 element, the model states 4 B below fp64's)."""
        return s.offload_optimizer.on

    def traffic(self, run: DSRun) -> tuple[int, int]:
        """The gradient partition down every micro-step in the gradient dtype, the 16-bit partition up after the
        step; ``offload_param``: every micro-step's forward and backward fetch every partition
        (``ds_tensor.to(device)``), and without ``offload_optimizer`` the updated partition goes back down."""
        s = run.settings
        p, g = DTYPE_BYTES[s.dtype], DTYPE_BYTES[s.grad_dtype]
        o, prm = s.offload_optimizer.on, s.offload_param.on
        part = flat_shard_numel(run.numels, run.nd)
        h2d = d2h = 0
        if o:
            d2h += part * g * run.grad_accum
            h2d += part * p if not prm else 0
        if prm:
            h2d += part * p * 2 * run.grad_accum
            d2h += part * p if not o else 0
        return h2d, d2h

    def moments(self, run: DSRun, moments: tuple[Moment, ...]) -> tuple[Moment, ...]:
        """With ``offload_optimizer``: offload.py ``_zero3_offload_moments``."""
        if not run.settings.offload_optimizer.on:
            return tuple(moments)
        return tuple(_zero3_offload_moments(run, list(moments)))

    def nvme_step_terms(self, run: DSRun) -> tuple[Term, ...]:
        """``offload_optimizer.device: nvme``: the swapper's first step (nvme.py ``step_terms``)."""
        s = run.settings
        if s.offload_optimizer.device != "nvme":
            return ()
        slices = tuple(-(-n // run.nd) for n in run.numels)
        return tuple(step_terms(flat_shard_numel(run.numels, run.nd), slices, s.grad_dtype == "fp32"))


ZERO12_OFFLOAD = CpuOffload12()
ZERO3_OFFLOAD = Stage3Offload()
