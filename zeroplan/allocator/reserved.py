"""What a step's trace makes the CUDA caching allocator reserve: ``torch.cuda.max_memory_reserved`` per phase
(and ``max_memory_allocated``, whole blocks), from an engine's allocation trace
(``zeroplan.allocator.step_trace``) replayed under the user's ``PYTORCH_CUDA_ALLOC_CONF``
(``config.parse_alloc_conf``; "" is torch's defaults). Reserved bytes are what runs out: a job fails when
``cudaMalloc`` cannot get a new segment, not when live tensors reach the card's size (docs/allocator.md).

Measured against the H200 (``notebooks/data/h200/``, docs/allocator.md): the order inside a transition is the
profile's, not the recorded one, so the reserved prediction is an estimate with the errors listed there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zeroplan.allocator.config import parse_alloc_conf

if TYPE_CHECKING:  # the replay's modules are imported where a trace is replayed, not by every command
    from zeroplan.allocator.step_trace import AllocTrace


@dataclass(frozen=True)
class ReservedEstimate:
    """The allocator model's answer for one step (bytes; phases in ``formulas.peak.PHASES`` order)."""

    reserved_bytes: int
    """``max_memory_reserved`` over init and the steps: the segments ``cudaMalloc`` gave the allocator."""
    reserved_phases: dict[str, int]
    """the same per phase (peaks reset at each phase start, as ``reset_peak_memory_stats``)."""
    allocated_bytes: int
    """``max_memory_allocated``: live blocks, each request rounded and some handed out whole."""
    alloc_conf: str = ""
    """``PYTORCH_CUDA_ALLOC_CONF`` as given ("": torch's defaults)."""

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved beyond allocated at their peaks: cached free blocks, split tails, other streams' pools."""
        return self.reserved_bytes - self.allocated_bytes


def reserved_of(trace: AllocTrace, alloc_conf: str = "") -> ReservedEstimate:
    """Replay ``trace`` through the allocator model under ``alloc_conf`` (ValueError in one line if bad)."""
    from zeroplan.allocator.replay import replay

    result = replay(trace.events, parse_alloc_conf(alloc_conf), details=False, runs=trace.runs)
    phases = {name: p.reserved_bytes for name, p in result.phases.items()}
    return ReservedEstimate(result.reserved_peak_bytes, phases, result.allocated_peak_bytes, alloc_conf)


NO_CUDA_ALLOCATOR = "not replayed: a CPU run (--device cpu) has no CUDA caching allocator; it fits on its live peak"
"""Why a CPU run's reserved bytes are ``—`` / null (``replayed_on``): plan's footnote and JSON, estimate's note."""


def replayed_on(settings) -> bool:
    """Whether a run under an engine's ``settings`` has a CUDA caching allocator to replay: not with ``device`` cpu
    (FSDP2's and DeepSpeed's own ``--device``: a CPU tensor's storage comes from ``c10/core/CPUAllocator.cpp``,
    malloc and free per tensor, no segments, blocks or cache: reserved is allocated is live), so "fits" is on the
    live peak (``fit_bytes`` with no reserved); an engine without the option (reference) trains on the GPU."""
    return getattr(settings, "device", "cuda") != "cpu"


def engine_reserved(engine, workload, nd: int, settings, alloc_conf: str = "") -> tuple[ReservedEstimate | None, ...] | None:
    """Each row of ``engine.estimate(workload, nd, settings)`` replayed (``Engine.alloc_trace``); None when the
    engine has no trace, the workload no architecture or the run no CUDA allocator (``replayed_on``)."""
    if engine.alloc_trace is None or workload.spec is None or not replayed_on(settings):
        return None
    return tuple(reserved_of(t, alloc_conf) for t in engine.alloc_trace(workload, nd, settings))


def fit_bytes(model_states_bytes: int, peak, reserved: ReservedEstimate | None) -> int:
    """What "fits" compares with the GPU's memory, the best-informed quantity known: the allocator's reserved
    bytes (with a trace), else the peak of live bytes (with an architecture), else the model states."""
    if reserved is not None:
        return reserved.reserved_bytes
    return model_states_bytes if peak is None else peak.peak_bytes
