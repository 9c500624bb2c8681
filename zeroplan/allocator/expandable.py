"""``expandable_segments:True``: one virtual range per stream and pool, physical pages mapped on demand.

``CUDACachingAllocator.cpp`` Note [Expandable Segments], ``find_expandable_block``, ``map_block``,
``try_allocate_expandable_block``, ``unmap_block``: a new request that no cached block fits maps pages
(2 MiB in the small pool, 20 MiB in the large one) at the lowest address with enough free and unmapped
room, merging with the free block right before it, so a segment grows instead of a new one being made;
``empty_cache`` unmaps the whole free pages. Reserved bytes are the mapped pages.
"""

from __future__ import annotations

from typing import Any, Protocol

from zeroplan.allocator.blocks import Block, Pool, Segment
from zeroplan.allocator.config import PAGE_BYTES


class CachingAllocator(Protocol):
    """What these functions use of the allocator that calls them (``zeroplan.allocator.caching.CachingAllocator``),
    named here so the two modules do not import each other."""

    capacity: int | None
    stats: Any  # caching.Stats: ``reserved`` is what mapping pages changes
    unmapped: dict[tuple[int, bool], list[Block]]
    segments: dict[int, Segment]
    log: list[tuple[str, int, int, int]]
    _next_address: int

    def _fits(self, size: int) -> bool: ...

    def _try_merge(self, pool: Pool, dst: Block, src: Block | None) -> int: ...

VIRTUAL_BYTES = 1 << 40
"""Address space of one expandable segment when no capacity is given (torch: 9/8 of the card's memory)."""


def _allocatable(block: Block | None) -> bool:
    return block is not None and not block.allocated and not block.pending


def _room(block: Block | None, size: int) -> bool:
    """``has_available_address_space``: free and unmapped bytes from ``block`` on reach ``size``."""
    total = 0
    while total < size and _allocatable(block):
        total += block.size
        block = block.next
    return total >= size


def _find(alloc: CachingAllocator, small: bool, stream: int, size: int, address: int | None) -> Block:
    """``find_expandable_block``: the lowest-address unmapped block (or the free one before it) with room,
    else a new segment's single unmapped block."""
    unmapped = alloc.unmapped.setdefault((stream, small), [])
    for candidate in sorted(unmapped, key=lambda b: b.address):
        if _allocatable(candidate.prev):
            candidate = candidate.prev
        if _room(candidate, size):
            return candidate
    page = PAGE_BYTES[small]
    virtual = VIRTUAL_BYTES if alloc.capacity is None else -(-(alloc.capacity * 9 // 8) // page) * page
    if address is None or address in alloc.segments:  # a replayed trace says where the segment's first page went
        address = alloc._next_address
    alloc._next_address = max(alloc._next_address, address + virtual)
    segment = Segment(address, stream, small, expandable=True, page=page)
    block = Block(address, virtual, stream, small, segment)
    block.mapped = False
    segment.head = block
    alloc.segments[address] = segment
    unmapped.append(block)
    return block


def _map(alloc: CachingAllocator, pool: Pool, block: Block, size: int) -> bool:
    """``map_block``: map the pages under ``[block, block + size)``, merge with free neighbours, cache it."""
    segment = block.segment
    begin = (block.address - segment.address) // segment.page
    end = -(-(block.address + size - segment.address) // segment.page)
    mapped = (end - begin) * segment.page
    if not alloc._fits(mapped):
        return False
    alloc.unmapped[(block.stream, block.small)].remove(block)
    start, block.mapped = block.address, True
    if mapped < block.size:
        rest = Block(block.address + mapped, block.size - mapped, block.stream, block.small, segment)
        rest.mapped = False
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        alloc.unmapped[(block.stream, block.small)].append(rest)
        block.size = mapped
    alloc._try_merge(pool, block, block.prev)
    alloc._try_merge(pool, block, block.next)
    pool.insert(block)
    alloc.stats.reserved.add(mapped)
    alloc.log.append(("segment_map", start, mapped, block.stream))
    return True


def allocate_expandable(
    alloc: CachingAllocator, pool: Pool, size: int, stream: int, address: int | None = None
) -> Block | None:
    """``try_allocate_expandable_block``: a free block of at least ``size`` bytes, mapping pages as needed;
    ``address``: where a new segment starts (a replayed trace's first ``segment_map``)."""
    candidate = _find(alloc, pool.small, stream, size, address)
    if not candidate.mapped:
        if not _map(alloc, pool, candidate, min(candidate.size, size)):
            return None
    while candidate.size < size:
        nxt = candidate.next
        if not _map(alloc, pool, nxt, min(size - candidate.size, nxt.size)):
            return None
        candidate = nxt  # it absorbed the free block before it
    pool.remove(candidate)
    return candidate


def unmap_free(alloc: CachingAllocator, pool: Pool, block: Block) -> None:
    """``unmap_block``: unmap the whole pages inside a free block; release the segment once nothing is mapped."""
    segment, page = block.segment, block.segment.page
    first = segment.address + -(-(block.address - segment.address) // page) * page
    last = segment.address + (block.address + block.size - segment.address) // page * page
    if first >= last:
        return
    pool.remove(block)
    for start, length in ((block.address, first - block.address), (last, block.address + block.size - last)):
        if length > 0:  # the partial pages before and after stay mapped and cached
            piece = Block(start, length, block.stream, block.small, segment)
            if start < first:
                piece.prev, piece.next = block.prev, block
                if block.prev is not None:
                    block.prev.next = piece
                else:
                    segment.head = piece
                block.prev = piece
            else:
                piece.prev, piece.next = block, block.next
                if block.next is not None:
                    block.next.prev = piece
                block.next = piece
            pool.insert(piece)
    block.address, block.size, block.mapped = first, last - first, False
    alloc._try_merge(pool, block, block.prev)
    alloc._try_merge(pool, block, block.next)
    alloc.unmapped.setdefault((block.stream, block.small), []).append(block)
    alloc.stats.reserved.add(-(last - first))
    alloc.log.append(("segment_unmap", first, last - first, block.stream))
    if block.prev is None and block.next is None:
        alloc.unmapped[(block.stream, block.small)].remove(block)
        del alloc.segments[segment.address]
