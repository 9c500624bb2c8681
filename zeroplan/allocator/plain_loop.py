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

import zeroplan.allocator.balanced as balanced
from zeroplan.allocator.balanced import walk as _walk
from zeroplan.allocator.blocks import Block, Pool
from zeroplan.allocator.cached_runs import walk_run
from zeroplan.allocator.config import least_split_rest
from zeroplan.allocator.runs import MIN_RUN, fast_forward


def plain_events(run, events: Sequence, expandable: bool, generic: Callable, event_of: Callable) -> None:
    """Replay ``events`` (every one an ``Event``) on ``run`` (``replay._Run``, no memory limit, no
    ``max_split_size``); ``expandable``: the config's ``expandable_segments``; ``generic``: ``run.step``, for
    what the loop does not do itself (each event through ``event_of``, ``replay._event``, first). The frees and
    the allocs in a row each go through one call (``groupby``, in C: a transition frees, then allocates); the
    balanced stretch where allocs meet frees (``balanced``; its frees among others: ``freed_tail``) answered by its
    read-only walk where it can be, the other frees then replayed."""
    allocs = ()  # the allocs in a row last met, kept while the frees after them may balance their tail
    for action, group in groupby(events, _ACTION):
        if action == "free":
            if allocs:  # the frees after allocs: a balanced stretch between them answered by ``walk``
                group = list(group)
                m, freed = freed_tail(allocs, group)
                if m < len(allocs):  # (no call for none: a stretch is often the whole row)
                    plain_allocs(run, allocs[:-m] if m else allocs, expandable, generic, event_of)
                if m and walk(run, allocs[-m:]):
                    if m == len(group):
                        allocs = ()
                        continue  # every free the stretch's
                    group = [event for event in group if event[1] not in freed]  # the others, in their order
                elif m and not (_run_like(allocs[-m:]) and fast_forward(run, allocs[-m:])):  # refused: replayed
                    plain_allocs(run, allocs[-m:], expandable, generic, event_of)
                allocs = ()
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


def freed_tail(allocs: Sequence, frees: Sequence) -> tuple[int, set]:
    """The largest ``m`` (up to ``_LONGEST``) such that each of the last ``m`` of ``allocs`` (distinct ids) is freed
    once by ``frees``, with the set of their ids; 0 if none (``frees`` names an id twice: replayed, ``_Run.step``
    raises). Such a stretch is balanced whatever other frees come between its own (a speed-up, no rule): the
    caching allocator's free blocks are never adjacent (a free merges with its free neighbours), so which ranges
    are cached after the frees depends only on the set of ranges freed, not on their order: the stretch's frees
    put back the ranges its allocs took (``balanced``), and the others' then free the same ranges as they would
    have, in their order, without the stretch."""
    freed, n = set(map(_ID, frees)), len(allocs)
    if allocs[-1][1] not in freed or len(freed) != len(frees) or not balanced.STRETCHES:
        return 0, freed
    m = min(n, len(frees), _LONGEST)
    ids = set(map(_ID, allocs[n - m:]))
    if ids <= freed:  # the longest possible (most stretches): found in C
        return (m, ids) if len(ids) == m else (0, freed)  # an id allocated twice: replayed (``_Run.step`` raises)
    m = 1
    while allocs[n - 1 - m][1] in freed:  # (``m`` < the longest possible, whose ids are not all freed)
        m += 1
    ids = set(map(_ID, allocs[n - m:]))
    return (m, ids) if len(ids) == m else (0, freed)


def walk(run, allocs: Sequence) -> bool:
    """``balanced.walk`` of the stretch ``allocs``; a run of at least ``MIN_RUN`` equal requests (FSDP2: 723
    sharded-parameter gradients freed at the optimizer step) in closed form, ``cached_runs.walk_run`` (a speed-up,
    no rule; its split rule is that of segments not expandable)."""
    if len(allocs) >= MIN_RUN and not run.alloc.config.expandable_segments and _run_like(allocs):
        return walk_run(run, allocs)  # (ids distinct: ``freed_tail``; most stretches are short: no call to look)
    return _walk(run, allocs)


def _run_like(allocs: Sequence) -> bool:
    """Whether ``allocs`` is a run (``runs.alloc_runs``) of ``Event``s of an int size > 0: one refused by the walk
    is fast-forwarded (``runs.fast_forward``: cached blocks taken, new segments' periods copied), not replayed
    request by request."""
    return len(allocs) >= MIN_RUN and len(set(map(_REQUEST, allocs))) == 1 and allocs[0][4] is None \
        and set(map(type, map(_SIZE, allocs))) == {int} and allocs[0][2] > 0


_ACTION = itemgetter(0)
_REQUEST = itemgetter(2, 3, 4)  # an ``Event``'s size, stream and segment address
_SIZE = itemgetter(2)
_ID = itemgetter(1)  # an ``Event``'s id
_LONGEST = 4096  # a longer stretch is found in part (its last 4,096 allocs) or not at all: replayed


def plain_frees(run, events: Iterable, expandable: bool, generic: Callable, event_of: Callable) -> None:
    """``plain_events`` of frees in a row (``CachingAllocator.free``: merged with the free mapped neighbours,
    ``_try_merge``; ``expandable`` unread, ``plain_allocs``' signature)."""
    live, pools, stats, stream, small = run.live, run.alloc.pools, run.alloc.stats, None, None
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
        size = block.size
        a_cur -= size
        r_cur -= block.requested
        block.requested = 0
        if block.stream != stream or block.small is not small:  # the pool of the free before, most often
            stream, small = block.stream, block.small
            pool = pools[stream, small]
            sizes, by_size, blocks = pool.sizes, pool.by_size, pool.blocks
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated and not prev.pending and prev.mapped:  # ``_try_merge``
            _merge_prev(block, prev, pool)
            size = block.size
        if nxt is not None and not nxt.allocated and not nxt.pending and nxt.mapped:
            merged = nxt.size
            held = by_size[merged]  # ``Pool.remove(nxt)``
            del held[bisect_left(held, nxt.address)]
            if not held:
                del by_size[merged], sizes[bisect_left(sizes, merged)]
            del blocks[nxt.address]
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            size += merged
            block.size = size
        # ``Pool.insert``, its age stamp left: ``gc_base`` is 0 in every block without a memory limit (the pools'
        # clock counts only with one), and garbage collection, its one reader, needs one (a speed-up, no rule)
        address = block.address
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
    fit, split when ``_should_split``, or by a new segment, ``_alloc_block``, split the same way; anything else
    through ``generic``)."""
    live, addresses, requests, stats = run.live, run.addresses, run.alloc._requests, run.alloc.stats
    allocated, requested, details, new_block = stats.allocated, stats.requested, run.details, object.__new__
    new_segment = run.alloc._alloc_block  # (no memory limit: never None)
    split_small, split_large = least_split_rest(True, expandable), least_split_rest(False, expandable)
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
            else:  # none fits: a new segment (``malloc``'s ``_alloc_block`` at once; expandable: through ``generic``)
                block = None if expandable else new_segment(pool, rounded, stream, None)
            if block is not None:
                remaining = block.size - rounded
                if remaining >= (split_small if block.small else split_large):  # ``_should_split``
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
                    address = block.address  # ``Pool.insert`` (its age stamp: see ``plain_frees``)
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
