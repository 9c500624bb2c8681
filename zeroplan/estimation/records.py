"""Typed, frozen results of ``zeroplan.estimate``. Formulas fill them; renderers read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zeroplan.allocator.reserved import ReservedEstimate
from zeroplan.engines.base import Workload
from zeroplan.formulas.collectives import Collective
from zeroplan.formulas.memory import MemoryBreakdown
from zeroplan.formulas.offload import HostMemory
from zeroplan.formulas.peak import PeakEstimate
from zeroplan.policy import ByteRows, PrecisionPolicy


@dataclass(frozen=True)
class StageEstimate:
    """Memory and communication of one ZeRO stage for one configuration."""

    stage: int
    name: str
    memory: MemoryBreakdown
    reduction_vs_dp: Optional[float]  # DP model states / this stage's model states; None: none on the GPU (offload)
    collectives: tuple[Collective, ...]
    fits: bool | None = None  # None when no GPU memory was given; on the peak when it is known
    peak: Optional[PeakEstimate] = None  # the engine's peak per phase; None without an architecture
    own_estimate_bytes: Optional[int] = None  # the engine's own estimator for this run (DeepSpeed's), if any
    peak_rank: Optional[int] = None  # the rank whose peak this is, the largest (EngineEstimate.peak_rank); None: all alike
    reserved: Optional[ReservedEstimate] = None  # the allocator model's reserved bytes; None without a trace
    host: Optional[HostMemory] = None  # the engine's offload: host memory per rank (EngineEstimate.host); None: none

    @property
    def comm_volume_elements(self) -> int:
        """The paper's count (section 7): each collective's size times its passes."""
        return sum(c.volume_elements for c in self.collectives)

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
    policy: PrecisionPolicy
    bytes_per_param: ByteRows  # ("fp16 params", 2), ...
    k: float  # the paper's K: optimizer-state bytes per parameter, master copy included
    stages: tuple[StageEstimate, ...]
    engine: str = "reference"  # the engine whose model states, peak and collectives these are
    model: Optional[str] = None  # --model as given (preset, config path) or the module's class
    workload: Optional[Workload] = None  # the training step, with an architecture
    block_bytes: int = 1  # allocator block every peak term is rounded to (512: CUDA)
    allocator_overhead_bytes: int = 0  # the reference engine's overhead term (0); reserved bytes come from ``reserved``
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF the reserved bytes were replayed under ("": torch's defaults)
    own_estimator: Optional[str] = None  # name of the engine's own estimator shown beside ours, if any
    tp: int = 1  # the engine's tensor-parallel degree (FSDP2 ``--tp``): nd = GPUs / N_m holds nd / tp DP ranks
    gpus_per_node: int = 8  # the node size the collectives' links are read for (``zeroplan.formulas.mesh``)
    reserved_not_replayed: Optional[str] = None  # why no row has reserved bytes though the engine has a trace (a CPU
    # run: allocator.reserved.NO_CUDA_ALLOCATOR); None: replayed, or no trace

    def stage(self, number: int) -> StageEstimate:
        return next(s for s in self.stages if s.stage == number)
