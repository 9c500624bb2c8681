"""Validated inputs of the planner (pydantic). Every field states its unit; errors quote the value."""

from __future__ import annotations

import math
from typing import Optional

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from zeroplan.formulas.dtypes import canonical_dtype
from zeroplan.formulas.optimizers import OPTIMIZERS
from zeroplan.formulas.stages import get_stage


class PrecisionPolicy(BaseModel):
    """Dtypes of the model states and the optimizer; K of the ZeRO paper follows from these.

    The defaults are the paper's mixed-precision Adam: fp16 parameters and gradients, an fp32 master
    copy and fp32 Adam momentum and variance (2 + 2 + 12 bytes per parameter). bf16 costs the same bytes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    param_dtype: str = "fp16"
    """dtype of the working parameters that forward and backward use."""
    grad_dtype: Optional[str] = None
    """dtype of gradients and of their reduction; defaults to ``param_dtype``."""
    master_weights: Optional[bool] = None
    """keep an fp32 master copy in the optimizer; defaults to on when ``param_dtype`` is not fp32."""
    optimizer: str = "adam"
    """one of ``zeroplan.formulas.optimizers.OPTIMIZERS``."""
    optimizer_dtype: str = "fp32"
    """dtype of optimizer states that have a choice (Adam m and v, SGD momentum)."""

    @field_validator("param_dtype", "optimizer_dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return canonical_dtype(v)

    @field_validator("grad_dtype")
    @classmethod
    def _grad_dtype(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else canonical_dtype(v)

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: str) -> str:
        key = str(v).strip().lower()
        if key not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {v!r}: expected one of {', '.join(OPTIMIZERS)}")
        return key

    @property
    def resolved_grad_dtype(self) -> str:
        return self.grad_dtype or self.param_dtype

    @property
    def master_dtype(self) -> Optional[str]:
        """'fp32' when an fp32 master copy is kept, else None."""
        keep = self.master_weights if self.master_weights is not None else self.param_dtype != "fp32"
        return "fp32" if keep else None

    def resolved(self) -> dict:
        """The policy with defaults filled in, as JSON outputs report it."""
        return {
            "param_dtype": self.param_dtype,
            "grad_dtype": self.resolved_grad_dtype,
            "master_dtype": self.master_dtype,
            "optimizer": self.optimizer,
            "optimizer_dtype": self.optimizer_dtype,
        }


class EstimateConfig(BaseModel):
    """One question to the planner: a model on ``gpus`` GPUs, N_d = gpus / model_parallel."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: Optional[float] = None
    """Ψ for the whole model, in parameters (elements); give this or ``tensor_numels``."""
    tensor_numels: Optional[tuple[int, ...]] = None
    """elements of every parameter tensor of the whole model; enables exact per-tensor padding."""
    gpus: int = 1
    """total GPUs = N_d x N_m."""
    model_parallel: int = 1
    """N_m, the tensor/pipeline model-parallel degree; the paper divides model states by it."""
    stage: Optional[int] = None
    """show only this ZeRO stage (0-3); None shows all four."""
    gpu_memory_bytes: Optional[int] = None
    """memory of one GPU in bytes, to mark which stages fit; None to skip."""
    policy: PrecisionPolicy = PrecisionPolicy()

    @field_validator("params")
    @classmethod
    def _params(cls, v: Optional[float]) -> Optional[float]:
        if v is None:
            return v
        if isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"params={v}: must be a positive finite number of parameters")
        if not float(v).is_integer():
            raise ValueError(f"params={v}: must be a whole number of parameters")
        return float(v)

    @field_validator("tensor_numels")
    @classmethod
    def _numels(cls, v: Optional[tuple[int, ...]]) -> Optional[tuple[int, ...]]:
        if v is not None and (not v or any(n < 1 for n in v)):
            raise ValueError("tensor_numels: need at least one tensor, each of >= 1 element")
        return v

    @field_validator("gpus", "model_parallel", mode="before")
    @classmethod
    def _whole(cls, v: object, info) -> object:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{info.field_name}={v!r}: must be a whole number")
        if v < 1:
            raise ValueError(f"{info.field_name}={v}: must be >= 1")
        return v

    @field_validator("stage")
    @classmethod
    def _stage(cls, v: Optional[int]) -> Optional[int]:
        return v if v is None else get_stage(v).number

    @field_validator("gpu_memory_bytes")
    @classmethod
    def _memory(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v < 1:
            raise ValueError(f"gpu_memory_bytes={v}: must be >= 1")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "EstimateConfig":
        if (self.params is None) == (self.tensor_numels is None):
            raise ValueError("give exactly one of params and tensor_numels")
        check_split(self.gpus, self.model_parallel)
        return self

    @property
    def nd(self) -> int:
        return self.gpus // self.model_parallel


def check_split(gpus: int, model_parallel: int) -> None:
    """ValueError unless N_m divides the GPU count (gpus = N_d x N_m)."""
    if gpus % model_parallel:
        raise ValueError(f"model_parallel={model_parallel} does not divide gpus={gpus}: gpus must be N_d x N_m")


def error_line(exc: ValidationError) -> str:
    """The first validation error as one line, without pydantic's decoration."""
    err = exc.errors()[0]
    msg = str(err["msg"]).removeprefix("Value error, ")
    loc = ".".join(str(p) for p in err["loc"])
    return msg if not loc or loc.split(".")[-1] in msg else f"{loc}: {msg}"
