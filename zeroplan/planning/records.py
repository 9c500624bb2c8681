"""Typed, frozen results of ``zeroplan.plan``. ``zeroplan.planning.plan`` fills them; renderers read them."""

from dataclasses import dataclass
from typing import Optional

from zeroplan.allocator.reserved import ReservedEstimate
from zeroplan.formulas.commtime import StepTime
from zeroplan.formulas.peak import PeakEstimate
from zeroplan.formulas.offload import NO_OFFLOAD, HostMemory, Offload, OffloadBreakdown
from zeroplan.planning.config import PlanConfig
from zeroplan.policy import ByteRows
from zeroplan.presets import LinkSpec


@dataclass(frozen=True)
class PlanOption:
    """One (stage, offload) option: placement, fit, sizes, traffic and time. Model-dependent fields are
    None when the plan was asked without a model."""

    stage: int
    name: str
    offload: Offload
    max_params: Optional[int]  # largest Ψ with model states filling the whole GPU (ZeRO Table 2)
    max_params_with_headroom: Optional[int]  # the same with the headroom kept free
    states: Optional[OffloadBreakdown] = None  # per GPU
    fits: Optional[bool] = None
    min_gpus: Optional[int] = None  # None: no N_d up to MAX_GPUS fits (or no model)
    comm_volume_elements: Optional[int] = None  # per optimizer step, paper's count, accumulation included
    comm_bytes_per_rank: Optional[int] = None  # per optimizer step, ring bytes each rank sends
    time: Optional[StepTime] = None
    pcie_s: Optional[float] = None  # offload traffic time per step on the host link, full duplex
    peak: Optional[PeakEstimate] = None  # the engine's peak per GPU (no offload, an architecture given)
    candidate: Optional[str] = None  # an engine's own configuration (plan --engine fsdp2|deepspeed), its words
    peak_rank: Optional[int] = None  # the rank whose peak ``peak`` is, the largest (EngineEstimate.peak_rank); None: all alike
    reserved: Optional[ReservedEstimate] = None  # the allocator model's reserved bytes (no offload, a trace)
    host: Optional[HostMemory] = None  # an engine's own offload record (EngineEstimate.host): steady bytes and init's
    # peak apart; None: no offload, or a reference row (states.host_bytes: the steady bytes, init not on the host)
    not_replayed: Optional[str] = None  # why ``reserved`` is None though the engine has a trace: its live peak alone
    # exceeds the budget (planning.reserved_fit.live_over, NOT_REPLAYED); None: replayed, or no trace
    pins: tuple = ()  # the engine's options that plan this row again as it is (Candidate.pins; largest_batch.py)

    @property
    def label(self) -> str:
        if self.candidate is not None:
            return self.candidate
        return f"{self.stage}" if not self.offload.any else f"{self.stage} + {self.offload.label}"


LAUNCHER_KEYS: tuple[str, ...] = ("deepspeed", "fsdp2")
"""``plan --json``'s launcher keys of a recommendation (``render/schemas.py``), each the ``Engine.launcher.key`` of a
built-in engine (``tests/test_registry.py`` checks it); null where another engine, or the ladder, answered."""


@dataclass(frozen=True)
class Plan:
    """The answer of ``zeroplan.plan``: resolved inputs, every option, the recommendation and why."""

    config: PlanConfig
    params: Optional[int]  # Ψ of the whole model, None without a model
    psi: Optional[int]  # Ψ per model-parallel rank
    gpu_memory_bytes: int
    budget_bytes: int  # (1 - headroom) x GPU memory: what model states may use
    host_budget_bytes: Optional[int]  # host memory per GPU, None when not given
    intra: LinkSpec
    inter: LinkSpec
    ring: LinkSpec  # the link that limits the data-parallel ring
    host_link: LinkSpec
    tokens_per_step: int  # per data-parallel rank per optimizer step
    activation_bytes: Optional[int]  # per GPU, Korthikanti et al. 2022; None if not estimated
    bytes_per_param: ByteRows  # the policy's byte convention, ("bf16 params", 2), ...
    k: float  # the paper's K: optimizer-state bytes per parameter, master copy included
    options: tuple[PlanOption, ...]  # stages 0-3 without offload, then the offload options
    recommendation: Optional[PlanOption]
    reason: str
    launchers: Optional[dict[str, object]]  # the recommendation's configuration under each of LAUNCHER_KEYS; with
    # an engine's own plan, only its entry (its ``Engine.launcher.key``) is set (the configuration it predicted),
    # the others None; "{key}_build" too where it has one (DeepSpeed ZeRO-3: the model built under zero.Init)
    fit_basis: str = ""  # how fits was decided: on the peak, or on model states and why
    cut_first: Optional[str] = None  # which term to cut first, from the peak's largest terms
    fragmentation: Optional[str] = None  # what to change when reserved, not live, bytes are what does not fit

    @property
    def headroom_bytes(self) -> int:
        """GPU memory kept free of model states: what activations and buffers must fit in."""
        return self.gpu_memory_bytes - self.budget_bytes

    @property
    def stages(self) -> tuple[PlanOption, ...]:
        """The four options without offload, stage 0 to 3."""
        return tuple(o for o in self.options if not o.offload.any)

    @property
    def offload_options(self) -> tuple[PlanOption, ...]:
        return tuple(o for o in self.options if o.offload.any)

    def option(self, stage: int, offload: Offload = NO_OFFLOAD) -> PlanOption:
        return next(o for o in self.options if o.stage == stage and o.offload == offload)
