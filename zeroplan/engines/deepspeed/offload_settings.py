"""DeepSpeed's offload sections as the engine profile reads them: ``zero_optimization.offload_optimizer`` and
``offload_param``, with DeepSpeed 0.19.8's keys and defaults (runtime/zero/offload_config.py
``DeepSpeedZeroOffloadOptimizerConfig``, ``DeepSpeedZeroOffloadParamConfig``), the combinations the profile
predicts, and their ds_config spelling. What offload allocates where: ``offload.py``."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from zeroplan.engines.deepspeed.nvme import check_nvme

OPTIMIZER_BUFFER_COUNT = 4
"""offload_config.py ``DeepSpeedZeroOffloadOptimizerConfig.buffer_count``'s default."""
PARAM_BUFFER_COUNT = 5
"""offload_config.py ``DeepSpeedZeroOffloadParamConfig.buffer_count``'s default."""
PARAM_BUFFER_SIZE = 100_000_000
"""offload_config.py ``DeepSpeedZeroOffloadParamConfig.buffer_size``'s default (``pp_int(1e8)``)."""
PARAM_MAX_IN_CPU = 1_000_000_000
"""offload_config.py ``DeepSpeedZeroOffloadParamConfig.max_in_cpu``'s default (``pp_int(1e9)``)."""


class OffloadTarget(BaseModel):
    """One offload section (``offload_optimizer`` or ``offload_param``), DeepSpeed 0.19.8's defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    device: Literal["none", "cpu", "nvme"] = "none"
    """where the states go (``OffloadDeviceEnum``); "none": on the GPU."""
    pin_memory: bool = True
    """page-locked host buffers (``pin_memory``, default true)."""
    nvme_path: Optional[str] = None
    """the NVMe mount point; required with ``device: nvme``."""
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    """optimizer: the fraction of the optimizer states on the host (ZeRO-3 partial offload)."""
    buffer_count: Optional[int] = Field(None, ge=0)
    """``device: nvme``: the swap pool's buffers (None: DeepSpeed's default, ``OPTIMIZER_BUFFER_COUNT`` for the
    optimizer, ``PARAM_BUFFER_COUNT`` for parameters; nvme.py, nvme_param.py)."""
    buffer_size: Optional[int] = Field(None, ge=1)
    """parameters on NVMe: elements per swap buffer (None: DeepSpeed's default, ``PARAM_BUFFER_SIZE``)."""
    max_in_cpu: Optional[int] = Field(None, ge=0)
    """parameters on NVMe: elements of 16-bit partitions kept in host memory (None: DeepSpeed's ``PARAM_MAX_IN_CPU``)."""

    @property
    def on(self) -> bool:
        return self.device != "none"


NO_TARGET = OffloadTarget()


def read_target(section: object, key: str) -> OffloadTarget:
    """An ``OffloadTarget`` from a parsed section (``config._OffloadSection``, or None: absent)."""
    if section is None:
        return NO_TARGET
    device = section.device or "none"
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"deepspeed config: zero_optimization.{key}.device={device!r}: expected none, cpu or nvme")
    if getattr(section, "super_offload", False):
        raise ValueError(f"deepspeed config: zero_optimization.{key}.super_offload=true: not modelled by the profile "
                         "(superchip offload, stage3.py SuperOffloadOptimizer)")  # fmt: skip
    nvme_param = key == "offload_param" and device == "nvme"  # the keys only parameter swapping reads
    sizes = {"buffer_size": _given(section.buffer_size, PARAM_BUFFER_SIZE),
             "max_in_cpu": _given(section.max_in_cpu, PARAM_MAX_IN_CPU)} if nvme_param else {}  # fmt: skip
    return OffloadTarget(device=device, pin_memory=section.pin_memory, nvme_path=section.nvme_path,
                         ratio=getattr(section, "ratio", 1.0),
                         buffer_count=getattr(section, "buffer_count", None), **sizes)  # fmt: skip


def _given(value: int, default: int) -> Optional[int]:
    """None where the parsed key holds DeepSpeed's default (the section writes it back only when set)."""
    return None if value == default else int(value)


def check_offload(stage: int, optimizer: OffloadTarget, param: OffloadTarget) -> None:
    """ValueError (one line naming the key) for a combination DeepSpeed refuses or the profile does not predict.

    DeepSpeed: ``offload_param`` is ZeRO-3's only (stage3.py; offload_config.py "Valid only with stage 3");
    ``ratio`` is read at ZeRO-3 only; NVMe needs ``nvme_path``. ``torch_adam`` with offload is DeepSpeed's too:
    torch's Adam steps the host partitions (engine.py ``get_optimizer_configuration``); DeepSpeedCPUAdam is asserted
    only for 16-bit master weights (``_enforce_cpu_offload``, called by base_optimizer.py
    ``_configure_master_weights`` for ``fp16_master_weights_and_gradients`` / ``bf16_master_weights_and_grads``,
    keys the profile does not read).
    NVMe: ``offload_optimizer`` and ``offload_param`` at ZeRO-3 are predicted (nvme.py, nvme_param.py); refused with
    the reason (``nvme.check_nvme``): nvme at ZeRO-1/2 (stage_1_and_2.py has no swapper), an optimizer pool below
    Adam's 4 buffers; a parameter pool whose buffers are smaller than a swapped partition, when the model is known
    (``nvme_param.param_swap``).
    Not predicted either: a ``ratio`` below 1 (ZeRO-3's partial offload keeps some sub-groups on the GPU)."""
    for key, t in (("offload_optimizer", optimizer), ("offload_param", param)):
        where = f"deepspeed config: zero_optimization.{key}"
        if t.device == "nvme" and not t.nvme_path:
            raise ValueError(f"{where}.device='nvme' needs {key}.nvme_path (runtime/zero/offload_config.py)")
        if t.device == "nvme":
            check_nvme(stage, key, t.buffer_count)
    if param.on and stage != 3:
        raise ValueError(f"deepspeed config: zero_optimization.offload_param needs ZeRO stage 3, not {stage} "
                         "(runtime/zero/offload_config.py: valid only with stage 3)")  # fmt: skip
    if optimizer.ratio != 1.0 and (stage != 3 or optimizer.on):
        why = "read at ZeRO-3 only" if stage != 3 else "partial offload is not modelled by the profile"
        raise ValueError(f"deepspeed config: zero_optimization.offload_optimizer.ratio={optimizer.ratio:g}: {why}")


def target_block(t: OffloadTarget) -> dict:
    """The ds_config section that ``read_target`` reads back as ``t`` (``ratio`` only when below 1)."""
    block: dict = {"device": t.device, "pin_memory": t.pin_memory}
    if t.nvme_path is not None:
        block["nvme_path"] = t.nvme_path
    if t.ratio != 1.0:
        block["ratio"] = t.ratio
    for key in ("buffer_count", "buffer_size", "max_in_cpu"):
        if getattr(t, key) is not None:
            block[key] = getattr(t, key)
    return block
