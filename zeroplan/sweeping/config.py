"""``SweepConfig``: a grid of planner questions (pydantic), checked by the same types as ``estimate``.

Byte counts of a sweep stay exact int64: ``MAX_PARAMS`` and ``MAX_GPUS`` keep them below 2**63.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from zeroplan.formulas.offload import NO_OFFLOAD, Offload, check_offload
from zeroplan.parsing import parse_offload
from zeroplan.policy import PrecisionPolicy
from zeroplan.presets import ModelName, get_model
from zeroplan.types import ByteSize, Checkpointing, Count, Params, StageNumber

MAX_PARAMS = 2**57
"""Largest Ψ a sweep accepts (1.4e17): no per-GPU byte count exceeds 64·Ψ (at most 20 bytes of model
state per parameter, 2·4 bytes sent per parameter by an fp32 all-reduce), so int64 stays exact."""

MAX_GPUS = 2**40
"""Largest GPU count a sweep accepts; with ``MAX_PARAMS`` it keeps ring byte counts below 2**63."""


class SweepConfig(BaseModel):
    """A grid of planner questions: every combination of ``params`` x ``gpus`` x ``model_parallel``,
    each answered for every stage in ``stages``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: Optional[tuple[Params, ...]] = None
    """Ψ values of the whole model, in parameters; give this, ``tensor_numels`` or ``model``."""
    tensor_numels: Optional[tuple[Count, ...]] = Field(None, min_length=1)
    """elements of every parameter tensor of one model (exact padding); replaces ``params``."""
    model: Optional[ModelName] = None
    """reference model preset (``zeroplan.presets``): its tensors, and its shape for activations."""
    micro_batch: tuple[Count, ...] = (1,)
    """sequences per GPU per micro-step; changes only the activation columns (needs ``model``)."""
    seq_len: Optional[Count] = None
    """tokens per sequence for activations; default the preset's."""
    checkpointing: Checkpointing = "full"
    """activation recomputation assumed: none, selective or full (``zeroplan.formulas.activations``)."""
    gpus: tuple[Count, ...] = (1,)
    """total GPU counts = N_d x N_m."""
    model_parallel: tuple[Count, ...] = (1,)
    """N_m values; combinations where N_m does not divide ``gpus`` are left out of the grid."""
    stages: tuple[StageNumber, ...] = (0, 1, 2, 3)
    """ZeRO stages (0-3) to report for every configuration."""
    offload: tuple[Offload, ...] = (NO_OFFLOAD,)
    """where states live (``zeroplan.parsing.parse_offload``); (stage, offload) pairs DeepSpeed lacks are
    left out."""
    gpu_memory_bytes: Optional[ByteSize] = None
    """memory of one GPU in bytes, for the ``fits`` column; None leaves it empty."""
    policy: PrecisionPolicy = PrecisionPolicy()

    @field_validator("offload", mode="before")
    @classmethod
    def _offload(cls, v: object) -> object:
        if isinstance(v, (list, tuple)):
            return tuple(parse_offload(x) for x in v)
        return v

    @field_validator("params", "gpus", "model_parallel", "stages", "offload", "micro_batch")
    @classmethod
    def _listed(cls, v: Optional[tuple], info: ValidationInfo) -> Optional[tuple]:
        if v is None:
            return v
        if not v:
            raise ValueError(f"{info.field_name}: give at least one value")
        seen = set()
        for x in v:
            if x in seen:
                shown = x.label if isinstance(x, Offload) else f"{x:g}"
                raise ValueError(f"{info.field_name}: {shown} is listed twice")
            seen.add(x)
        return v

    @field_validator("params")
    @classmethod
    def _params(cls, v: Optional[tuple[float, ...]]) -> Optional[tuple[float, ...]]:
        for p in v or ():
            if p > MAX_PARAMS:
                raise ValueError(f"params={p:g}: above {MAX_PARAMS:.3g}, byte counts would overflow int64")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        for g in v:
            if g > MAX_GPUS:
                raise ValueError(f"gpus={g}: above {MAX_GPUS}, byte counts could overflow int64")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SweepConfig":
        if sum(x is not None for x in (self.params, self.tensor_numels, self.model)) != 1:
            raise ValueError("give exactly one of params, tensor_numels and model")
        if self.model is None and (self.micro_batch != (1,) or self.seq_len is not None):
            raise ValueError("micro_batch and seq_len change only activations, which need a reference model")
        if self.numels and sum(self.numels) > MAX_PARAMS:
            raise ValueError(f"tensor_numels: {sum(self.numels):g} elements, above {MAX_PARAMS:.3g}")
        if not any(g % m == 0 for g in self.gpus for m in self.model_parallel):
            raise ValueError(
                f"no model_parallel in {list(self.model_parallel)} divides any gpus in {list(self.gpus)}"
            )
        if not self.pairs:
            offloads = ", ".join(o.label for o in self.offload)
            raise ValueError(
                f"offload ({offloads}) is possible at none of stages {list(self.stages)}: {_why(self)}"
            )
        return self

    @property
    def numels(self) -> Optional[tuple[int, ...]]:
        """Every tensor of the model: ``tensor_numels`` or the preset's; None for a bare Ψ."""
        if self.model is not None:
            return get_model(self.model).tensor_numels
        return self.tensor_numels

    @property
    def pairs(self) -> tuple[tuple[int, Offload], ...]:
        """The (stage, offload) pairs to report, stage-major; pairs DeepSpeed lacks are left out."""
        return tuple((s, o) for s in self.stages for o in self.offload if _possible(s, o))


def _possible(stage: int, offload: Offload) -> bool:
    try:
        check_offload(stage, offload)
    except ValueError:
        return False
    return True


def _why(config: SweepConfig) -> str:
    """``check_offload``'s reason for the first pair, e.g. 'stage 0: optimizer offload needs ...'."""
    try:
        check_offload(config.stages[0], config.offload[0])
    except ValueError as exc:
        return str(exc)
    return ""
