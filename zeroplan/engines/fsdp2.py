"""Launcher configuration for a planned option, as text the user copies: DeepSpeed JSON and FSDP2 Python.

No dependency on DeepSpeed or PyTorch: these functions build a dict and a string.

- DeepSpeed: keys exactly as the DeepSpeed configuration docs spell them (``zero_optimization``,
  ``offload_optimizer``, ``offload_param``, ``stage3_*``; deepspeed.ai/docs/config-json). Bucket sizes
  are DeepSpeed's defaults (5e8 elements; ``stage3_prefetch_bucket_size`` 5e7), written out so the plan's
  latency estimate and the run use the same buckets.
- FSDP2: ``torch.distributed.fsdp.fully_shard`` (PyTorch >= 2.6 public API). ``reshard_after_forward=True``
  is ZeRO-3 (parameters gathered again for backward), ``False`` is ZeRO-2 (unsharded parameters kept
  from forward to backward). FSDP2 has no stage-1 equivalent; its ``CPUOffloadPolicy`` moves parameters,
  gradients and the optimizer step to the CPU together, i.e. stage 3 + optimizer and parameter offload.
"""

from __future__ import annotations

from typing import Optional

from zeroplan.estimation.config import PrecisionPolicy
from zeroplan.formulas.offload import Offload, check_offload
from zeroplan.planning.config import DEFAULT_BUCKET_NUMEL, POLICY

STAGE3_PREFETCH_NUMEL = 50_000_000
"""DeepSpeed's default ``stage3_prefetch_bucket_size`` (5e7 elements)."""
NVME_PATH = "/local_nvme"
"""Placeholder mount point for ZeRO-Infinity; replace with a local NVMe path."""
_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def _offload_block(device: str) -> dict:
    block: dict = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = NVME_PATH
    return block


def deepspeed_config(
    stage: int,
    offload: Offload = Offload(),
    micro_batch: int = 1,
    grad_accum: int = 1,
    policy: PrecisionPolicy = POLICY,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> dict:
    """A DeepSpeed config dict for ``stage`` and ``offload`` (dump it with ``json.dumps``)."""
    check_offload(stage, offload)
    zero: dict = {"stage": stage}
    if stage >= 1:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=bucket_numel)
    if stage in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=bucket_numel, reduce_scatter=True)
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=STAGE3_PREFETCH_NUMEL,
            stage3_param_persistence_threshold=100_000,
            stage3_max_live_parameters=1_000_000_000,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if offload.optimizer != "none":
        zero["offload_optimizer"] = _offload_block(offload.optimizer)
    if offload.params != "none":
        zero["offload_param"] = _offload_block(offload.params)
    config: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
    }
    if policy.param_dtype in ("bf16", "fp16"):
        config[policy.param_dtype] = {"enabled": True}
    config["zero_optimization"] = zero
    return config


def fsdp2_snippet(stage: int, offload: Offload = Offload(), policy: PrecisionPolicy = POLICY) -> str:
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


def launcher_texts(
    stage: int,
    offload: Offload,
    micro_batch: int,
    grad_accum: int,
    policy: PrecisionPolicy,
    bucket_numel: Optional[int] = None,
) -> dict[str, object]:
    """Both launchers for one option: {"deepspeed": dict, "fsdp2": str}."""
    ds = deepspeed_config(
        stage, offload, micro_batch, grad_accum, policy, bucket_numel or DEFAULT_BUCKET_NUMEL
    )
    return {"deepspeed": ds, "fsdp2": fsdp2_snippet(stage, offload, policy)}
