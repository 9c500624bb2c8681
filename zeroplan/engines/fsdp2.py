"""FSDP2: the ``fully_shard`` code for a planned option, as text the user copies.

``torch.distributed.fsdp.fully_shard`` (PyTorch >= 2.6 public API). ``reshard_after_forward=True`` is
ZeRO-3 (parameters gathered again for backward), ``False`` is ZeRO-2 (unsharded parameters kept from
forward to backward). FSDP2 has no stage-1 equivalent; its ``CPUOffloadPolicy`` moves parameters,
gradients and the optimizer step to the CPU together, i.e. stage 3 + optimizer and parameter offload.
No dependency on PyTorch: this builds a string.
"""

from __future__ import annotations

from zeroplan.formulas.offload import NO_OFFLOAD, Offload, check_offload
from zeroplan.policy import BF16_MIXED, PrecisionPolicy

_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def fsdp2_snippet(stage: int, offload: Offload = NO_OFFLOAD, policy: PrecisionPolicy = BF16_MIXED) -> str:
    """FSDP2 ``fully_shard`` code for ``stage`` and ``offload``, or a comment saying it has no equivalent."""
    check_offload(stage, offload)
    if stage == 0:
        return (
            "# ZeRO stage 0 is plain data parallelism: no FSDP needed.\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "model = DDP(model)  # gradients all-reduced in buckets during backward\n"
        )
    if stage == 1:
        return "# FSDP2 has no stage-1 equivalent (sharded optimizer states only); use DeepSpeed stage 1.\n"
    full_offload = offload == Offload("cpu", "cpu")
    if offload.any and not full_offload:
        return (
            f"# FSDP2 has no equivalent of stage {stage} + {offload.label}: its CPUOffloadPolicy offloads\n"
            "# parameters, gradients and the optimizer step together\n"
            "# (stage 3 + optimizer->cpu, params->cpu).\n"
        )
    dtype = _TORCH_DTYPE.get(policy.param_dtype, "torch.bfloat16")
    reduce = _TORCH_DTYPE.get(policy.resolved_grad_dtype, dtype)
    reshard = "True" if stage == 3 else "False"
    why = (
        "parameters gathered again for backward" if stage == 3 else "parameters kept unsharded until backward"
    )
    imports = "fully_shard, MixedPrecisionPolicy" + (", CPUOffloadPolicy" if full_offload else "")
    offload_arg = "\n    offload_policy=CPUOffloadPolicy(pin_memory=True)," if full_offload else ""
    return (
        "import torch\n"
        f"from torch.distributed.fsdp import {imports}\n\n"
        f"# ZeRO stage {stage}: reshard_after_forward={reshard} "
        f"({why}).\n"
        "# FSDP2 keeps sharded parameters in their original dtype (fp32) and casts them for compute, so the\n"
        "# optimizer needs no master copy: fp32 params + fp32 grads + Adam m, v = 16 bytes/param per shard.\n"
        "kwargs = dict(\n"
        f"    mp_policy=MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={reduce}),\n"
        f"    reshard_after_forward={reshard},{offload_arg}\n"
        ")\n"
        "for block in model.layers:  # one FSDP unit per block: one all-gather and reduce-scatter each\n"
        "    fully_shard(block, **kwargs)\n"
        "fully_shard(model, **kwargs)\n"
        "# Gradient accumulation: model.set_requires_gradient_sync(False) on all but the last micro-step\n"
        "# skips the reduce-scatter but keeps unsharded gradients (more memory than the plan assumes).\n"
    )
