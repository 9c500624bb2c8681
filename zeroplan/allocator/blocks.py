"""Blocks, segments and the per-stream free pools of the caching allocator model (no policy here).

Mirrors ``Block``, ``BlockPool`` and ``BlockComparatorSize`` of ``c10/cuda/CUDACachingAllocator.cpp``: a
segment is one ``cudaMalloc`` (or one expandable virtual range), split into a doubly linked list of blocks
by address; a free block sits in the pool of its (stream, small|large) kind, ordered by (size, address), so
that the first block of at least the rounded request size is the best fit.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass


class Block:
    """A piece of a segment: allocated, cached free, or (expandable segments) unmapped address space."""

    __slots__ = ("address", "size", "requested", "stream", "small", "allocated", "mapped", "prev", "next",
                 "segment", "gc_base", "pending")  # fmt: skip

    def __init__(self, address: int, size: int, stream: int, small: bool, segment: Segment) -> None:
        self.address, self.size, self.stream, self.small, self.segment = address, size, stream, small, segment
        self.requested = 0
        self.allocated = False
        self.pending = False  # freed by the program, still in use by another stream (``event_count > 0``)
        self.mapped = True
        self.prev: Block | None = None
        self.next: Block | None = None
        self.gc_base = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def free_for_merge(self) -> bool:
        return not self.allocated and not self.pending

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        state = "alloc" if self.allocated else "pending" if self.pending else "free" if self.mapped else "unmapped"
        return f"Block({self.address:#x}, {self.size}, {state})"


class Segment:
    """One ``cudaMalloc`` (``expandable`` False) or one expandable virtual range mapped in ``page`` units."""

    __slots__ = ("address", "stream", "small", "expandable", "page", "head")

    def __init__(self, address: int, stream: int, small: bool, expandable: bool = False, page: int = 0) -> None:
        self.address, self.stream, self.small, self.expandable, self.page = address, stream, small, expandable, page
        self.head: Block | None = None

    def blocks(self) -> list[Block]:
        out, block = [], self.head
        while block is not None:
            out.append(block)
            block = block.next
        return out

    def mapped_bytes(self) -> int:
        return sum(b.size for b in self.blocks() if b.mapped)


class Pool:
    """The cached free blocks of one (stream, small|large) kind, ordered by (size, address): the sizes held, sorted,
    and each size's addresses, sorted (a pool of ~2,900 blocks holds ~10-24 sizes: best fit bisects the few sizes,
    and a block comes and goes within its size's list rather than shifting every larger block's key;
    docs/benchmarks.md, FSDP2 `plan` speed, fourteenth pass)."""

    __slots__ = ("sizes", "by_size", "blocks", "small", "clock")

    def __init__(self, small: bool, clock: list[int]) -> None:
        self.sizes: list[int] = []  # the distinct sizes of the blocks held, ascending
        self.by_size: dict[int, list[int]] = {}  # size: the addresses of its blocks, ascending
        self.blocks: dict[int, Block] = {}  # address: block
        self.small = small
        self.clock = clock  # ``get_free_blocks_call_count``, shared by the streams' pools of one kind

    def insert(self, block: Block) -> None:
        """``insert_into_blocks``: also stamps the block's age base for garbage collection."""
        block.gc_base = self.clock[0]
        size, address = block.size, block.address
        addresses = self.by_size.get(size)
        if addresses is None:
            self.by_size[size] = [address]
            insort(self.sizes, size)
        else:
            insort(addresses, address)
        self.blocks[address] = block

    def remove(self, block: Block) -> None:
        size, address = block.size, block.address
        addresses = self.by_size[size]
        if len(addresses) == 1:
            del self.by_size[size], self.sizes[bisect_left(self.sizes, size)]
        else:
            del addresses[bisect_left(addresses, address)]
        del self.blocks[address]

    def first(self, size: int) -> Block | None:
        """The best fit: the block of the smallest size >= ``size``, the lowest address among them."""
        sizes = self.sizes
        index = bisect_left(sizes, size)
        return self.blocks[self.by_size[sizes[index]][0]] if index < len(sizes) else None

    def after(self, block: Block) -> Block | None:
        """The next block in (size, address) order after ``block`` (held)."""
        addresses = self.by_size[block.size]
        index = bisect_right(addresses, block.address)
        if index < len(addresses):
            return self.blocks[addresses[index]]
        sizes = self.sizes
        index = bisect_right(sizes, block.size)
        return self.blocks[self.by_size[sizes[index]][0]] if index < len(sizes) else None

    def __iter__(self):
        """The blocks in (size, address) order, listed first (a caller may remove them as it goes)."""
        by_size, blocks = self.by_size, self.blocks
        return iter([blocks[a] for s in self.sizes for a in by_size[s]])


@dataclass(frozen=True)
class BlockInfo:
    """One block of a segment as the model holds it (the snapshot's ``blocks`` entries)."""

    address: int
    size: int
    requested_size: int
    state: str  # "active_allocated", "active_pending_free", "inactive" (torch's names)


@dataclass(frozen=True)
class SegmentInfo:
    """One segment: address, mapped bytes, stream, pool (torch's ``segment_type``) and its blocks."""

    address: int
    total_size: int
    stream: int
    segment_type: str  # "small" or "large"
    expandable: bool
    blocks: tuple[BlockInfo, ...]

    @property
    def allocated_size(self) -> int:
        return sum(b.size for b in self.blocks if b.state == "active_allocated")


def segment_infos(segment: Segment) -> list[SegmentInfo]:
    """The segment as torch's snapshot shows it: one entry per contiguous mapped range (``snapshot()``: an
    expandable segment with unmapped holes is several), each with its blocks."""
    state = {(True, False): "active_allocated", (False, True): "active_pending_free", (False, False): "inactive"}
    ranges: list[list[BlockInfo]] = [[]]
    for b in segment.blocks():
        if b.mapped:
            ranges[-1].append(BlockInfo(b.address, b.size, b.requested, state[(b.allocated, b.pending)]))
        elif ranges[-1]:
            ranges.append([])
    kind = "small" if segment.small else "large"
    return [SegmentInfo(r[0].address, sum(b.size for b in r), segment.stream, kind, segment.expandable, tuple(r))
            for r in ranges if r]  # fmt: skip
