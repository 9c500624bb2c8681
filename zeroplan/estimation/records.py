"""Typed, frozen results of the planner. Formulas return these; renderers read them."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Collective:
    """One collective a rank takes part in per training step."""

    op: str  # "all-reduce" | "reduce-scatter" | "all-gather"
    phase: str  # "forward" | "backward" | "optimizer step"
    elements: int  # full (unsharded) size of the collective, in elements
    dtype: str
    bytes_per_rank: int  # bytes one rank sends on a ring algorithm

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU model states in bytes (ZeRO paper, section 3.1)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class StageEstimate:
    """Memory and communication of one ZeRO stage for one configuration."""

    stage: int
    name: str
    memory: MemoryBreakdown
    reduction_vs_dp: float  # DP model states / this stage's model states
    collectives: tuple[Collective, ...]
    fits: bool | None = None  # None when no GPU memory was given

    @property
    def comm_volume_elements(self) -> int:
        """The paper's count: an all-reduce moves 2x its size, reduce-scatter and all-gather 1x."""
        return sum(c.elements * (2 if c.op == "all-reduce" else 1) for c in self.collectives)

    @property
    def comm_bytes_per_rank(self) -> int:
        return sum(c.bytes_per_rank for c in self.collectives)


@dataclass(frozen=True)
class Estimate:
    """The answer of ``zeroplan.estimate``: inputs as resolved, the byte convention, one row per stage."""

    psi: int  # parameters per model-parallel rank
    total_params: int
    gpus: int
    nd: int
    nm: int
    gpu_memory_bytes: int | None
    bytes_per_param: tuple[tuple[str, float], ...]  # ("fp16 params", 2), ...
    k: float  # the paper's K: optimizer-state bytes per parameter, master copy included
    stages: tuple[StageEstimate, ...]

    def stage(self, number: int) -> StageEstimate:
        return next(s for s in self.stages if s.stage == number)
