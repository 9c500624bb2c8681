"""The peak model: per phase, the largest sum of live terms over the moments an engine profile lists.

An engine profile (``zeroplan/engines/<engine>.py``) describes a training step as data: for each phase
(``init``, ``forward``, ``backward``, ``optimizer_step``) the moments at which memory can peak, each a
tuple of named terms (bytes, and the engine file/function or formula it comes from). This module only
sums and compares; it never asks which engine it is looking at.

GPU targets: the CUDA caching allocator rounds every block up to 512 bytes
(``c10/cuda/CUDACachingAllocator.cpp``: ``kMinBlockSize``), which ``max_memory_allocated`` counts, so
``block_bytes=512`` rounds each term's tensors up (a term groups ``tensors`` tensors of equal size).
Allocator overhead (reserved - allocated: fragmentation and cached free blocks) is a separate term,
``allocator_overhead_bytes``, zero until measured on a GPU.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import ClassVar, Optional

PHASES: tuple[str, ...] = ("init", "forward", "backward", "optimizer_step")
CUDA_BLOCK_BYTES = 512  # CUDACachingAllocator kMinBlockSize: every allocation rounds up to this
TOP_TERMS = 5
_BYTES = attrgetter("bytes")
_CUDA_BLOCKS = attrgetter("_cuda_blocks")


@dataclass(frozen=True)
class Term:
    """A live buffer (or group of ``tensors`` equal-size buffers) of ``bytes`` in total; ``source`` says where."""

    name: str
    bytes: int
    source: str
    tensors: int = 1

    def __init__(self, name: str, bytes: int, source: str, tensors: int = 1) -> None:  # noqa: A002
        # the dataclass's own __init__ with its fields written to __dict__ rather than through frozen
        # object.__setattr__ (2.4x less CPU per object: a 1,024-GPU DeepSpeed plan makes ~30,000 terms)
        d = self.__dict__
        d["name"], d["bytes"], d["source"], d["tensors"] = name, bytes, source, tensors
        # its CUDA blocks (``rounded_total``'s expression at ``CUDA_BLOCK_BYTES``), once per term, not a field: a
        # 1,024-GPU DeepSpeed plan's peaks sum ~160,000 terms (~30,000 objects), a lookup each
        d["_cuda_blocks"] = tensors * -((bytes // -(tensors or 1)) // CUDA_BLOCK_BYTES)

    def rounded(self, block_bytes: int) -> int:
        """Bytes once each tensor is rounded up to ``block_bytes`` (1: unchanged): ``rounded_total``."""
        return rounded_total((self,), block_bytes)


@dataclass(frozen=True)
class Moment:
    """One point of a phase at which memory may peak, with everything live there."""

    phase: str
    name: str
    terms: tuple[Term, ...]
    rank: ClassVar[Optional[int]] = None
    """Where a profile describes every rank at once and lists one rank's moment of a family of per-rank moments
    (DeepSpeed's ``DSRun.first_largest``), that rank; None: every rank's alike, one rank's run, or not said. Not a
    field: equality, ``repr`` and ``replace`` are the dataclass's (a moment renamed or rebuilt says no rank)."""

    def __init__(self, phase: str, name: str, terms: tuple[Term, ...], rank: Optional[int] = None) -> None:
        d = self.__dict__  # as ``Term.__init__`` (~18,000 moments in a 1,024-GPU DeepSpeed plan)
        d["phase"], d["name"], d["terms"] = phase, name, terms
        if rank is not None:
            d["rank"] = rank

    def total(self, block_bytes: int = 1) -> int:
        return rounded_total(self.terms, block_bytes)


def rounded_total(terms: Iterable[Term], block_bytes: int) -> int:
    """The terms' bytes, each term's ``tensors`` equal tensors rounded up to ``block_bytes`` B (1: unchanged): a
    term of b bytes over n tensors holds n·⌈⌈b/n⌉/B⌉·B; with x = b // -n, ⌈b/n⌉ = -x and ⌈-x/B⌉ = -(x // B). One
    expression per term: ``peak_of`` sums ~160k terms for a 1,024-GPU DeepSpeed plan, and a ``Term.rounded`` call
    per term took twice the CPU (a memo per term object no less: ~30k objects). A term of no tensors (0 bytes): 0."""
    if block_bytes <= 1:
        return sum(map(_BYTES, terms))
    if block_bytes == CUDA_BLOCK_BYTES:  # the same expression, computed by ``Term.__init__``
        return block_bytes * sum(map(_CUDA_BLOCKS, terms))
    return block_bytes * sum(t.tensors * -((t.bytes // -(t.tensors or 1)) // block_bytes) for t in terms)


@dataclass(frozen=True)
class PhasePeak:
    """The largest moment of one phase."""

    phase: str
    bytes: int
    moment: str
    terms: tuple[Term, ...]


@dataclass(frozen=True)
class PeakEstimate:
    """Per-phase peaks, the overall peak, its phase and its largest live terms (named)."""

    phases: tuple[PhasePeak, ...]
    peak_bytes: int
    peak_phase: str
    peak_terms: tuple[Term, ...]

    def by_phase(self) -> dict[str, int]:
        """{phase: bytes} in ``PHASES`` order."""
        return {p.phase: p.bytes for p in self.phases}


def peak_of(
    moments: Iterable[Moment], block_bytes: int = 1, allocator_overhead_bytes: int = 0, top: int = TOP_TERMS,
    resident: tuple[Term, ...] = (),
) -> PeakEstimate:
    """Max over each phase's moments of the summed terms (rounded to ``block_bytes``), plus overhead;
    ``resident`` terms are live in every phase after ``init`` (``formulas.cuda_workspaces``)."""
    if block_bytes < 1 or allocator_overhead_bytes < 0:
        raise ValueError(f"block_bytes={block_bytes}, allocator_overhead_bytes={allocator_overhead_bytes}")
    overhead = Term("allocator overhead (reserved - allocated)", allocator_overhead_bytes,
                    "measured on the GPU; 0 until measured")  # fmt: skip
    best: dict[str, tuple[int, Moment]] = {}  # phase -> (total, its first largest moment): each total summed once
    for m in moments:
        if m.phase not in PHASES:
            raise ValueError(f"phase={m.phase!r}: expected one of {', '.join(PHASES)}")
        total = rounded_total(m.terms, block_bytes)
        if m.phase not in best or total > best[m.phase][0]:
            best[m.phase] = (total, m)
    missing = [p for p in PHASES if p not in best]
    if missing:
        raise ValueError(f"the profile lists no moment for phase(s) {', '.join(missing)}")
    if resident:  # the same terms in every moment of a phase after init: added to its first largest alone
        extra = rounded_total(resident, block_bytes)
        for p in PHASES[1:]:
            total, m = best[p]
            best[p] = (total + extra, Moment(m.phase, m.name, (*m.terms, *resident)))
    phases = tuple(
        PhasePeak(p, best[p][0] + overhead.bytes, best[p][1].name, (*best[p][1].terms, overhead)) for p in PHASES
    )
    top_phase = max(phases, key=lambda p: p.bytes)
    largest = tuple(sorted((t for t in top_phase.terms if t.bytes), key=lambda t: -t.bytes)[:top])
    return PeakEstimate(phases, top_phase.bytes, top_phase.phase, largest)
