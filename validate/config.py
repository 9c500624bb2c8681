"""What ``zeroplan validate`` runs: one matrix of stages x world sizes x model, real or simulated."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ValidateConfig(BaseModel):
    """A validation matrix. Sizes are element counts, times are seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: tuple[int, ...] = Field((0, 1, 2, 3), description="ZeRO stages to run, each 0-3")
    world_sizes: tuple[int, ...] = Field((2, 4), description="N_d values; one process group each")
    model: str = Field("gpt-tiny", description="preset of validate.models.PRESETS")
    params: float | None = Field(None, description="instead of model: a GPT-style model of about Ψ params")
    simulated: bool = Field(False, description="one process plays rank 0 of the world on a fake group")
    fake_tensors: bool | None = Field(None, description="FakeTensorMode; default: on when simulated on CPU")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    steps: int = Field(3, description="training steps; >= 2 so a steady state is seen after Adam's lazy init")
    batch_per_rank: int = Field(2, description="micro-batch: sequences (or samples) per rank per step")
    checkpointing: Literal["none", "full"] = Field("none", description="full: every block recomputed in backward")
    foreach: bool | None = Field(None, description="Adam's foreach path; default: as torch chooses for the device")
    peak_tolerance: float = Field(0.02, description="largest relative error of any phase's peak still ok")
    seq_len: int | None = Field(None, description="tokens per sequence (GPT); default: the spec's max")
    lr: float = Field(1e-3, description="Adam learning rate")
    tolerance: float = Field(0.01, description="largest relative error of model states still ok")
    timeout_s: float = Field(600.0, description="wall-clock limit of one world size's processes")
    wire: bool = Field(
        False, description="also count loopback bytes in a private network namespace (Linux, gloo)"
    )

    @field_validator("stages")
    @classmethod
    def _stages(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [s for s in v if s not in (0, 1, 2, 3)]
        if bad or not v:
            raise ValueError(f"stage={bad or list(v)}: each must be one of 0, 1, 2, 3")
        return tuple(sorted(set(v)))

    @field_validator("world_sizes")
    @classmethod
    def _world(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [n for n in v if n < 1]
        if bad or not v:
            raise ValueError(f"world-size={bad or list(v)}: each must be >= 1")
        return tuple(sorted(set(v)))

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"steps={v}: must be >= 2 (step 1 creates Adam's states)")
        return v

    @field_validator("batch_per_rank", "seq_len")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"{v}: batch and sequence sizes must be >= 1")
        return v

    @field_validator("params", "lr", "tolerance", "timeout_s", "peak_tolerance")
    @classmethod
    def _positive_float(cls, v: float | None, info) -> float | None:
        if v is not None and not (v > 0 and v != float("inf")):
            raise ValueError(f"{info.field_name}={v}: must be a positive finite number")
        return v

    @model_validator(mode="after")
    def _wire_needs_real(self) -> ValidateConfig:
        if self.wire and self.simulated:
            raise ValueError("--wire counts real traffic: it needs a real (not --simulated) run")
        return self

    @model_validator(mode="after")
    def _known_model(self) -> ValidateConfig:
        from validate.models import PRESETS

        if self.params is None and self.model not in PRESETS:
            raise ValueError(f"model={self.model!r}: expected one of {', '.join(PRESETS)} (or give --params)")
        return self
