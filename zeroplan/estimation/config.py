"""``EstimateConfig``: one question to ``zeroplan.estimate`` (pydantic). Every field states its unit."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from zeroplan.policy import PrecisionPolicy
from zeroplan.types import ByteSize, GpuCount, Numel, Params, StageNumber, check_split, check_total


class EstimateConfig(BaseModel):
    """One question to the planner: a model on ``gpus`` GPUs, N_d = gpus / model_parallel."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: Optional[Params] = None
    """Ψ for the whole model, in parameters (elements); give this or ``tensor_numels``."""
    tensor_numels: Optional[tuple[Numel, ...]] = Field(None, min_length=1)
    """elements of every parameter tensor of the whole model; enables exact per-tensor padding."""
    gpus: GpuCount = 1
    """total GPUs = N_d x N_m."""
    model_parallel: GpuCount = 1
    """N_m, the tensor/pipeline model-parallel degree; the paper divides model states by it."""
    stage: Optional[StageNumber] = None
    """show only this ZeRO stage (0-3); None shows all four."""
    gpu_memory_bytes: Optional[ByteSize] = None
    """memory of one GPU in bytes, to mark which stages fit; None to skip."""
    policy: PrecisionPolicy = PrecisionPolicy()

    @model_validator(mode="after")
    def _consistent(self) -> "EstimateConfig":
        if (self.params is None) == (self.tensor_numels is None):
            raise ValueError("give exactly one of params and tensor_numels")
        check_split(self.gpus, self.model_parallel)
        check_total(self.tensor_numels or ())
        return self

    @property
    def nd(self) -> int:
        return self.gpus // self.model_parallel
