"""What ``zeroplan validate`` runs: one matrix of stages x world sizes x model, real or simulated."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from zeroplan.types import Count, PositiveFinite, StageNumber

DEFAULT_WORLD_SIZES = (2, 4)
"""N_d values of a real run: the smallest group that shards, and one that pads uneven tensors."""
DEFAULT_SIMULATED_WORLD_SIZES = (64,)
"""N_d of a simulated run: the ZeRO paper's Table 1 example (one process plays rank 0)."""


class ValidateConfig(BaseModel):
    """A validation matrix. Sizes are element counts, times are seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: tuple[StageNumber, ...] = Field(
        (0, 1, 2, 3), min_length=1, description="ZeRO stages to run, each 0-3"
    )
    world_sizes: tuple[Count, ...] = Field(
        DEFAULT_WORLD_SIZES, min_length=1,
        description="N_d values; one process group each. Default 2 and 4; 64 when simulated",
    )  # fmt: skip
    model: str = Field("gpt-tiny", description="preset of validate.models.PRESETS or zeroplan, or a config.json path")
    params: PositiveFinite | None = Field(
        None, description="instead of model: a GPT-style model of about Ψ params"
    )
    simulated: bool = Field(False, description="one process plays rank 0 of the world on a fake group")
    fake_tensors: bool | None = Field(None, description="FakeTensorMode; default: on when simulated on CPU")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    steps: int = Field(3, description="training steps; >= 2 so a steady state is seen after Adam's lazy init")
    batch_per_rank: Count = Field(2, description="sequences (or samples) per rank per step")
    seq_len: Count | None = Field(None, description="tokens per sequence (GPT); default: the spec's max")
    lr: PositiveFinite = Field(1e-3, description="Adam learning rate")
    tolerance: PositiveFinite = Field(0.01, description="largest relative error of model states still ok")
    timeout_s: PositiveFinite = Field(600.0, description="wall-clock limit of one world size's processes")
    wire: bool = Field(
        False, description="also count loopback bytes in a private network namespace (Linux, gloo)"
    )

    @model_validator(mode="before")
    @classmethod
    def _default_world_sizes(cls, data: object) -> object:
        """No world sizes given: 64 when simulated, else the field's default."""
        if isinstance(data, dict) and data.get("world_sizes") is None:
            data = {k: v for k, v in data.items() if k != "world_sizes"}
            if data.get("simulated"):
                data["world_sizes"] = DEFAULT_SIMULATED_WORLD_SIZES
        return data

    @field_validator("stages", "world_sizes")
    @classmethod
    def _sorted(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(set(v)))

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"steps={v}: must be >= 2 (step 1 creates Adam's states)")
        return v

    @model_validator(mode="after")
    def _wire_needs_real(self) -> ValidateConfig:
        if self.wire and self.simulated:
            raise ValueError("--wire counts real traffic: it needs a real (not --simulated) run")
        return self

    @model_validator(mode="after")
    def _known_model(self) -> ValidateConfig:
        from validate.models import spec_for

        if self.params is None:
            spec_for(self.model, None)  # ValueError, one line, for an unknown name or a bad config file
        return self
