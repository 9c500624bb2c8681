"""The replay's loop without a memory limit (``replay._plain_loop``): a stretch of ``Event``s between two runs, each
free and each alloc served by a cached block done in the loop itself (``CachingAllocator.free`` / ``malloc``
reduced to merge, best fit and split, the allocated and requested stats kept in locals), anything else through
``_Run.step``; the runs' ``fast_forward`` asks it one event at a time (``replay._plain_steps``).

A speed-up, no rule: the same operations in the same order as ``CachingAllocator``'s, without a Python call per
event or a stats attribute per update (an FSDP2 replay walks ~12,000 such events); tests/test_allocator_replay.py
and tests/test_allocator_plain_loop.py compare the replay with the request-by-request one."""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby
from operator import itemgetter

from zeroplan.allocator.balanced import stretch_length, walk
from zeroplan.allocator.blocks import Block, Pool
from zeroplan.allocator.config import K_MIN_BLOCK_SIZE, K_SMALL_SIZE


def plain_events(run, events: Sequence, expandable: bool, generic: Callable, event_of: Callable) -> None:
    """Replay ``events`` (every one an ``Event``) on ``run`` (``replay._Run``, no memory limit, no
    ``max_split_size``); ``expandable``: the config's ``expandable_segments``; ``generic``: ``run.step``, for
    what the loop does not do itself (each event through ``event_of``, ``replay._event``, first). The frees and
    the allocs in a row each go through one call (``groupby``, in C: a transition frees, then allocates); the
    balanced stretch where allocs meet frees (``balanced``) answered by its read-only walk where it can be."""
    allocs = ()  # the allocs in a row last met, kept while the frees after them may balance their tail
    for action, group in groupby(events, _ACTION):
        if action == "free":
            if allocs:  # the frees after allocs: a balanced stretch between them answered by ``walk``
                group = list(group)
                m = stretch_length(allocs, group)
                plain_allocs(run, allocs[:-m] if m else allocs, expandable, generic, event_of)
                if m and not walk(run, allocs[-m:]):
                    plain_allocs(run, allocs[-m:], expandable, generic, event_of)
                    plain_frees(run, group[:m], False, generic, event_of)
                group, allocs = group[m:], ()
            plain_frees(run, group, False, generic, event_of)
            continue
        if allocs:
            plain_allocs(run, allocs, expandable, generic, event_of)
            allocs = ()
        if action == "alloc":
            allocs = list(group)
        else:
            for event in group:
                generic(event_of(event))
    if allocs:
        plain_allocs(run, allocs, expandable, generic, event_of)


_ACTION = itemgetter(0)


def plain_frees(run, events: Iterable, expandable: bool, generic: Callable, event_of: Callable) -> None:
    """``plain_events`` of frees in a row (``CachingAllocator.free``: merged with the free mapped neighbours,
    ``_try_merge``; ``expandable`` unread, ``plain_allocs``' signature)."""
    live, pools, stats = run.live, run.alloc.pools, run.alloc.stats
    allocated, requested = stats.allocated, stats.requested
    a_cur, r_cur = allocated.current, requested.current
    for event in events:
        block = live.pop(event[1], None)
        if block is None or not block.allocated:  # ``_Run.step`` raises (the id not live: popped or not)
            allocated.current, requested.current = a_cur, r_cur
            generic(event_of(event))
            a_cur, r_cur = allocated.current, requested.current
            continue
        block.allocated = False
        a_cur -= block.size
        r_cur -= block.requested
        block.requested = 0
        pool = pools[block.stream, block.small]
        sizes, by_size, blocks = pool.sizes, pool.by_size, pool.blocks
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated and not prev.pending and prev.mapped:  # ``_try_merge``
            _merge_prev(block, prev, pool)
        if nxt is not None and not nxt.allocated and not nxt.pending and nxt.mapped:
            held = by_size[nxt.size]  # ``Pool.remove(nxt)``
            if len(held) == 1:
                del by_size[nxt.size], sizes[bisect_left(sizes, nxt.size)]
            else:
                del held[bisect_left(held, nxt.address)]
            del blocks[nxt.address]
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
            block.size += nxt.size
        block.gc_base = pool.clock[0]  # ``Pool.insert``
        size, address = block.size, block.address
        held = by_size.get(size)
        if held is None:
            by_size[size] = [address]
            insort(sizes, size)
        else:
            insort(held, address)
        blocks[address] = block
    allocated.current, requested.current = a_cur, r_cur


def plain_allocs(run, events: Iterable, expandable: bool, generic: Callable, event_of: Callable) -> None:
    """``plain_events`` of allocs in a row (``CachingAllocator.malloc`` reduced: served by a cached block, best
    fit, split when ``_should_split``; a new segment through ``generic``)."""
    live, addresses, requests, stats = run.live, run.addresses, run.alloc._requests, run.alloc.stats
    allocated, requested, details, new_block = stats.allocated, stats.requested, run.details, object.__new__
    a_cur, a_peak, r_cur, r_peak = allocated.current, allocated.peak, requested.current, requested.peak
    for event in events:
        _, ident, size, stream, address = event
        request = requests.get((size, stream)) if address is None and type(size) is int and ident not in live \
            else None
        if request is not None:
            rounded, pool = request
            sizes, by_size, blocks = pool.sizes, pool.by_size, pool.blocks
            index = bisect_left(sizes, rounded)  # ``Pool.first``
            if index < len(sizes):
                held = by_size[sizes[index]]
                block = blocks.pop(held[0])
                # ``Pool.remove`` of the first block of its size; on an expandable segment too where no unmapped room
                # follows it: ``_expandable_fit``'s walk stops there at once, every later block being at least as
                # large (a speed-up, no rule)
                if not block.segment.expandable or expandable and ((after := block.next) is None or after.mapped):
                    if len(held) == 1:
                        del by_size[sizes[index]], sizes[index]
                    else:
                        del held[0]
                else:  # back: the walk takes one out (``Pool.remove``), or ``malloc`` decides
                    blocks[block.address] = block
                    block = _expandable_fit(pool, block) if expandable else None
            else:
                block = None
            if block is not None:
                remaining = block.size - rounded
                if remaining >= K_MIN_BLOCK_SIZE if block.small or expandable else remaining > K_SMALL_SIZE:
                    # a split front made inline (as a call: +15 M instructions, FSDP2 Llama-2-70B's plan)
                    front, prev = new_block(Block), block.prev  # ``Block(...)``, its fields set here at once
                    front.address, front.size, front.stream, front.small, front.segment = \
                        block.address, rounded, block.stream, block.small, block.segment
                    front.mapped, front.pending, front.gc_base, front.prev, front.next = True, False, 0, prev, block
                    if prev is not None:
                        prev.next = front
                    else:
                        block.segment.head = front
                    block.prev = front
                    block.address += rounded
                    block.size = remaining
                    block.gc_base = pool.clock[0]  # ``Pool.insert``
                    address = block.address
                    held = by_size.get(remaining)
                    if held is None:
                        by_size[remaining] = [address]
                        insort(sizes, remaining)
                    else:
                        insort(held, address)
                    blocks[address] = block
                    block = front
                block.allocated, block.requested = True, size
                a_cur += block.size
                a_peak = a_cur if a_cur > a_peak else a_peak
                r_cur += size
                r_peak = r_cur if r_cur > r_peak else r_peak
                live[ident] = block
                if details:
                    addresses.append((ident, block.address))
                continue
        allocated.current, allocated.peak, requested.current, requested.peak = a_cur, a_peak, r_cur, r_peak
        generic(event_of(event))
        a_cur, a_peak, r_cur, r_peak = allocated.current, allocated.peak, requested.current, requested.peak
    allocated.current, allocated.peak, requested.current, requested.peak = a_cur, a_peak, r_cur, r_peak


def _expandable_fit(pool: Pool, block: Block) -> Block:
    """``_get_free_block``'s walk on expandable segments from the best fit ``block``: on to the next block while it
    can grow to less (``_growable``), which it takes out of ``pool``."""
    sizes, by_size, blocks = pool.sizes, pool.by_size, pool.blocks
    after = block.next  # ``_growable`` and ``Pool.after`` inlined (a speed-up, no rule)
    grows = block.size + (after.size if after is not None and not after.mapped else 0)
    while block.segment.expandable:
        held = by_size[block.size]  # ``Pool.after(block)``
        index = bisect_right(held, block.address)
        if index < len(held):
            nxt = blocks[held[index]]
        else:
            index = bisect_right(sizes, block.size)
            if index == len(sizes):
                break
            nxt = blocks[by_size[sizes[index]][0]]
        after = nxt.next
        nxt_grows = nxt.size + (after.size if after is not None and not after.mapped else 0)
        if nxt_grows >= grows:
            break
        block, grows = nxt, nxt_grows
    pool.remove(block)
    return block


def _merge_prev(block: Block, prev: Block, pool: Pool) -> None:
    """``_try_merge`` of ``block`` with the free block before it (rare: a free block is merged with what comes
    after it)."""
    pool.remove(prev)
    block.address, block.prev = prev.address, prev.prev
    if prev.prev is not None:
        prev.prev.next = block
    else:
        block.segment.head = block
    block.size += prev.size
