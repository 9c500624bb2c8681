"""A model of PyTorch's CUDA caching allocator (``DeviceCachingAllocator``), one device, in pure Python.

Follows ``c10/cuda/CUDACachingAllocator.cpp`` (see ``zeroplan.allocator.config`` for the version read):

- ``malloc``: round the request (``round_size``), pick the pool (small <= 1 MiB, else large; one pool per
  stream: a block freed on one stream is never handed to another), take the best cached block
  (``get_free_block``: smallest size, then lowest address; never an oversize block for a small request,
  an oversize one only within ``max_non_split_rounding`` of the request), else a new segment
  (``alloc_block``: ``get_allocation_size``), on failure free cached blocks and retry
  (``release_available_cached_blocks``, ``release_cached_blocks``), else out of memory.
- ``should_split``: the small pool (or expandable segments) splits when >= 512 B remain; the large pool
  only when more than 1 MiB (``kSmallSize``) remains and the request is under ``max_split_size``. A block
  that is not split is handed out whole, and ``allocated_bytes`` (``max_memory_allocated``) counts the
  whole block (``alloc_found_block``: ``increase_stat(allocated_bytes, block->size)``);
  ``requested_bytes`` counts the request.
- ``free``: the block returns to its pool and merges with free neighbours of its segment
  (``free_block``, ``try_merge_blocks``); a block used on another stream (``recordStream``) stays out of the
  pool until that stream is done (``free_requested`` then ``free_completed``).
- ``empty_cache``: every cached segment that is entirely free is returned (``release_cached_blocks``);
  expandable segments unmap their free pages.
- Expandable segments: one virtual range per stream and pool, mapped in pages of 2 MiB (small) or 20 MiB
  (large) at the lowest free address (``find_expandable_block``, ``map_block``).
- ``garbage_collection_threshold`` acts when a memory limit is set (``capacity_bytes`` stands for
  ``set_per_process_memory_fraction``), reclaiming the oldest unsplit large blocks (``garbage_collect_cached_blocks``).

Not modelled: CUDA graph private pools, IPC, ``cudaMallocAsync``; ``capacity_bytes`` is what ``cudaMalloc``
can still get (the card less everything outside the allocator, ``zeroplan.formulas.outside_allocator``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroplan.allocator.blocks import Block, Pool, Segment, SegmentInfo, segment_infos
from zeroplan.allocator.config import (
    NO_LIMIT, AllocatorConfig, allocation_size, is_small, least_split_rest, round_size,
)  # fmt: skip
from zeroplan.allocator.expandable import allocate_expandable, unmap_free

SEGMENT_ALIGN = 2 << 20
"""Model addresses of new segments are 2 MiB aligned and increasing (only ties between equal sizes use them)."""


class OutOfMemory(RuntimeError):
    """``cudaMalloc`` failed after every retry: the allocator raises ``torch.OutOfMemoryError`` here."""

    def __init__(self, size: int, reserved: int, allocated: int) -> None:
        super().__init__(f"out of memory: {size:,} B requested with {reserved:,} B reserved, "
                         f"{allocated:,} B allocated")  # fmt: skip
        self.size, self.reserved, self.allocated = size, reserved, allocated


@dataclass
class Stat:
    """``Stat``: current and peak (``reset_peak_stat`` sets peak to current)."""

    current: int = 0
    peak: int = 0

    def add(self, amount: int) -> None:
        current = self.current = self.current + amount
        if current > self.peak:
            self.peak = current

    def reset_peak(self) -> None:
        self.peak = self.current


@dataclass
class Stats:
    """The aggregate ``DeviceStats`` the model keeps (bytes)."""

    allocated: Stat = field(default_factory=Stat)  # ``allocated_bytes.all``: block sizes
    reserved: Stat = field(default_factory=Stat)  # ``reserved_bytes.all``: mapped segment bytes
    requested: Stat = field(default_factory=Stat)  # ``requested_bytes.all``: what the program asked for
    segments: Stat = field(default_factory=Stat)  # ``segment.all``: count
    num_alloc_retries: int = 0
    num_ooms: int = 0

    def reset_peaks(self) -> None:
        for stat in (self.allocated, self.reserved, self.requested, self.segments):
            stat.reset_peak()


class CachingAllocator:
    """One device's caching allocator. ``capacity_bytes``: what ``cudaMalloc`` can get in all (None: unlimited)."""

    def __init__(self, config: AllocatorConfig = AllocatorConfig(), capacity_bytes: int | None = None) -> None:
        self.config, self.capacity = config, capacity_bytes
        self.stats = Stats()
        self.pools: dict[tuple[int, bool], Pool] = {}
        self.unmapped: dict[tuple[int, bool], list[Block]] = {}
        self.segments: dict[int, Segment] = {}
        self.clock = {True: [0], False: [0]}  # ``get_free_blocks_call_count`` of the small and large pool
        # (segment_alloc | segment_free | segment_map | segment_unmap, address, bytes, stream), in order
        self.log: list[tuple[str, int, int, int]] = []
        self._next_address = 1 << 32
        self._requests: dict[tuple[int, int], tuple[int, Pool]] = {}  # (size, stream): (rounded size, pool)
        self._collects = config.garbage_collection_threshold > 0 and capacity_bytes is not None

    # -- public operations -------------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0, segment_address: int | None = None) -> Block:
        """``DeviceCachingAllocator::malloc``; ``segment_address``: where a new segment goes (a replayed trace's)."""
        if size <= 0:
            raise ValueError(f"size={size}: an allocation must be > 0 bytes (torch allocates nothing for 0)")
        request = self._requests.get((size, stream))
        if request is None:  # each (size, stream) met rounded and its pool found once (a trace repeats them)
            rounded = round_size(size, self.config)
            request = self._requests[size, stream] = (rounded, self._pool(stream, is_small(rounded)))
        rounded, pool = request
        block = self._get_free_block(pool, rounded)
        if block is None:
            if self._collects:
                self._garbage_collect()
            new = self._alloc_block
            block = (new(pool, rounded, stream, segment_address)
                     or (self._release_available(pool, rounded) and new(pool, rounded, stream, segment_address))
                     or (self._release_cached() and new(pool, rounded, stream, segment_address, retry=True)))  # fmt: skip
        if block is None:
            self.stats.num_ooms += 1
            raise OutOfMemory(size, self.stats.reserved.current, self.stats.allocated.current)
        return self._alloc_found_block(pool, block, rounded, size, self._should_split(block, rounded))

    def free(self, block: Block) -> None:
        """``free`` with no other stream using the block: it is cached at once."""
        self.free_requested(block, pending=False)

    def free_requested(self, block: Block, pending: bool = True) -> None:
        """The program dropped the block (``allocated_bytes`` falls); ``pending``: another stream still uses it."""
        if not block.allocated:
            raise ValueError(f"block at {block.address:#x} freed twice")
        block.allocated = False
        self.stats.allocated.current -= block.size  # ``Stat.add`` of a negative amount: no new peak
        if pending:
            block.pending = True
        else:
            self._free_block(block)

    def free_completed(self, block: Block) -> None:
        """The other streams are done with a pending block: it joins its pool (``process_events``)."""
        if block.pending:
            block.pending = False
            self._free_block(block)

    def empty_cache(self) -> None:
        """``emptyCache``: return every entirely free segment (and unmap free pages of expandable ones)."""
        self._release_cached()

    def release_segment(self, address: int) -> None:
        """``release_block`` of the (entirely free) segment at ``address``: a replayed ``segment_free``."""
        segment = self.segments.get(address)
        if segment is None or segment.expandable:
            raise ValueError(f"segment_free at {address:#x}: no such segment in the model")
        block = segment.head
        if block.is_split() or block.allocated or block.pending:
            raise ValueError(f"segment_free at {address:#x}: the model's segment is still in use")
        self._release_block(block)

    def segment_infos(self) -> tuple[SegmentInfo, ...]:
        """Every segment, by address (``torch.cuda.memory._snapshot()['segments']``)."""
        return tuple(info for a in sorted(self.segments) for info in segment_infos(self.segments[a]))

    # -- choosing a block ----------------------------------------------------------------------------
    def _pool(self, stream: int, small: bool) -> Pool:
        key = (stream, small)
        if key not in self.pools:
            self.pools[key] = Pool(small, self.clock[small])
        return self.pools[key]

    def _get_free_block(self, pool: Pool, size: int) -> Block | None:
        """``get_free_block``: best fit by (size, address), with the oversize rules of ``max_split_size``."""
        cfg = self.config
        if self._collects:
            pool.clock[0] += 1
        block = pool.first(size)
        if block is None:
            return None
        if block.segment.expandable:
            if not cfg.expandable_segments:  # only non-expandable blocks when the option was turned off
                while block is not None and block.segment.expandable:
                    block = pool.after(block)
                if block is None:
                    return None
            else:  # best fit on the size the block can grow to
                nxt = pool.after(block)
                while block.segment.expandable and nxt is not None and _growable(nxt) < _growable(block):
                    block = nxt
                    nxt = pool.after(block)
        if size < cfg.max_split_size_bytes <= block.size:
            return None  # no oversize block for a request that could be split
        if size >= cfg.max_split_size_bytes and block.size >= size + cfg.max_non_split_rounding_bytes:
            return None
        pool.remove(block)
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        """``should_split``: small pool or expandable segments, >= 512 B left; large pool, > 1 MiB left."""
        small, expandable = block.small, self.config.expandable_segments
        return block.size - size >= least_split_rest(small, expandable) and (
            small or expandable or size < self.config.max_split_size_bytes)

    def _alloc_found_block(self, pool: Pool, block: Block, size: int, requested: int, split: bool) -> Block:
        """``alloc_found_block``: split off the front ``size`` bytes when ``split``, else hand the block out whole."""
        if split:
            front = Block(block.address, size, block.stream, block.small, block.segment)
            front.prev, front.next = block.prev, block
            if block.prev is not None:
                block.prev.next = front
            else:
                block.segment.head = front
            block.prev = front
            block.address += size
            block.size -= size
            pool.insert(block)
            block = front
        block.allocated, block.requested = True, requested
        stats = self.stats
        stat = stats.allocated  # ``Stat.add``, inlined (a replay's hottest calls)
        current = stat.current = stat.current + block.size
        if current > stat.peak:
            stat.peak = current
        stat = stats.requested
        current = stat.current = stat.current + requested
        if current > stat.peak:
            stat.peak = current
        return block

    # -- segments ------------------------------------------------------------------------------------
    def _fits(self, size: int) -> bool:
        return self.capacity is None or self.stats.reserved.current + size <= self.capacity

    def _alloc_block(
        self, pool: Pool, size: int, stream: int, address: int | None, retry: bool = False
    ) -> Block | None:
        """``alloc_block``: a new segment of ``get_allocation_size`` bytes (or expandable pages); None when
        ``cudaMalloc`` would fail."""
        if retry:
            self.stats.num_alloc_retries += 1
        if self.config.expandable_segments:
            return allocate_expandable(self, pool, size, stream, address)
        alloc = allocation_size(size)
        if not self._fits(alloc):
            return None
        if address is None or address in self.segments:
            address = self._next_address
        self._next_address = max(self._next_address, address + -(-alloc // SEGMENT_ALIGN) * SEGMENT_ALIGN)
        segment = Segment(address, stream, pool.small)
        segment.head = Block(address, alloc, stream, pool.small, segment)
        self.segments[address] = segment
        self.stats.reserved.add(alloc)
        self.stats.segments.add(1)
        self.log.append(("segment_alloc", address, alloc, stream))
        return segment.head

    def _release_block(self, block: Block) -> None:
        """``release_block``: ``cudaFree`` of an unsplit free segment."""
        self._pool(block.stream, block.small).remove(block)
        del self.segments[block.segment.address]
        self.stats.reserved.add(-block.size)
        self.stats.segments.add(-1)
        self.log.append(("segment_free", block.address, block.size, block.stream))

    def _release_available(self, pool: Pool, size: int) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size`` set, free oversize cached blocks."""
        limit = self.config.max_split_size_bytes
        if limit == NO_LIMIT:
            return False
        key = max(size, limit)
        found = pool.first(key)
        if found is not None and not found.segment.expandable and not found.is_split():
            self._release_block(found)
            return True
        released = 0
        for block in sorted(pool, key=lambda b: (-b.size, -b.address)):
            if released >= key or block.size < limit:
                break
            if not block.is_split() and not block.segment.expandable:
                self._release_block(block)
                released += block.size
        return released >= key

    def _release_cached(self) -> bool:
        """``release_cached_blocks``: pending frees complete (synchronize), then every unsplit free segment goes."""
        for block in [b for s in list(self.segments.values()) for b in s.blocks() if b.pending]:
            self.free_completed(block)
        for pool in list(self.pools.values()):
            for block in pool:
                if block.segment.expandable:
                    unmap_free(self, pool, block)
                elif not block.is_split():
                    self._release_block(block)
        return True

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: above ``threshold x capacity`` reserved, free the unsplit large
        cached blocks at least as old (in ``get_free_block`` calls) as the average, until under it."""
        threshold = int(self.config.garbage_collection_threshold * self.capacity)
        if self.stats.reserved.current <= threshold:
            return
        target, reclaimed = self.stats.reserved.current - threshold, 0
        large = [b for (s, small), p in self.pools.items() if not small for b in p]
        freeable = [b for b in large if not b.is_split() and not b.segment.expandable]
        freed = True
        while reclaimed < target and freed and freeable:
            average = sum(self.clock[False][0] - b.gc_base for b in freeable) / len(freeable)
            freed = False
            for block in list(freeable):
                if self.clock[False][0] - block.gc_base >= average:
                    freed = True
                    reclaimed += block.size
                    freeable.remove(block)
                    self._release_block(block)

    # -- frees ---------------------------------------------------------------------------------------
    def _free_block(self, block: Block) -> None:
        """``free_block``: merge with free neighbours, then back into the pool."""
        pool = self._pool(block.stream, block.small)
        self.stats.requested.current -= block.requested  # ``Stat.add`` of a negative amount: no new peak
        block.requested = 0
        prev, nxt = block.prev, block.next  # a neighbour that is allocated (most are) merges nothing
        if prev is not None and not prev.allocated:
            self._try_merge(pool, block, prev)
        if nxt is not None and not nxt.allocated:
            self._try_merge(pool, block, nxt)
        pool.insert(block)

    def _try_merge(self, pool: Pool, dst: Block, src: Block | None) -> int:
        """``try_merge_blocks``: absorb a free neighbour with the same mapping; returns the bytes absorbed."""
        if src is None or src.allocated or src.pending or src.mapped != dst.mapped:  # ``not free_for_merge()``
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            self.unmapped[(src.stream, src.small)].remove(src)
        if dst.prev is src:
            dst.address, dst.prev = src.address, src.prev
            if src.prev is not None:
                src.prev.next = dst
            else:
                dst.segment.head = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size
        return src.size


def _growable(block: Block) -> int:
    """``expandable_size``: a block's size plus the unmapped space right after it."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


