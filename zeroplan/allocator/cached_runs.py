"""A run's requests that the pool's cached blocks serve, taken a block at a time (``runs.fast_forward``'s first part).

A speed-up, no rule: ``malloc``'s best fit, split and hand-out for each request, grouped by the cached block that
serves them; tests/test_allocator_plain_loop.py and tests/test_allocator_replay.py compare the replay with the
request-by-request one.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from operator import itemgetter

from zeroplan.allocator.blocks import Block, Pool
from zeroplan.allocator.config import least_split_rest

_new = object.__new__
_EVENT_ID = itemgetter(1)  # an ``Event``'s id


def take_cached(run, events: Sequence, rounded: int, pool: Pool) -> int:
    """The requests of the run ``events`` (``fast_forward``'s: one size and stream, new ids, no memory limit, no
    ``max_split_size``: ``run.plain``) up to a settled point, each served by a cached block as ``malloc`` would
    (best fit: the first block of the smallest size >= ``r``; split when ``_should_split``, else handed out
    whole): how many were served (it stops at a settled point or at a block of an expandable segment).

    While the smallest cached size >= ``r`` is ``s``, a block of ``s`` bytes serves ``m = s // r`` requests in a
    row: each split leaves the rest (``s - r``, ``s - 2r``, ...) as the only cached block between ``r`` and
    ``s``, the best fit of the next request, until less than ``r`` is left; the ``m``-th request splits off the
    last ``r`` bytes when the rest ``s mod r`` is over 1 MiB (512 B in the small pool) or takes the ``r + s mod
    r`` left whole (a larger rest would have been split off before it: ``r`` > 1 MiB in the large pool, ``r`` >=
    512 B in the small one). Then the next request takes the next block of ``s`` bytes (by address). So the next
    ``k m`` requests take the first ``k`` blocks of size ``s``, ``m`` each, in address order: taken together (a
    speed-up, no rule); a run that ends inside a block is served request by request there."""
    sizes, by_size, blocks, stats = pool.sizes, pool.by_size, pool.blocks, run.alloc.stats
    size, n, i, clock = events[0].size, len(events), 0, pool.clock[0]
    limit = least_split_rest(pool.small, False) - 1  # a larger remainder is split off (none expandable here)
    while i < n:
        index = bisect_left(sizes, rounded)
        if index == len(sizes):  # settled
            break
        whole = sizes[index]
        held = by_size[whole]
        if blocks[held[0]].segment.expandable:
            break
        per = whole // rounded  # requests per block
        k = min(len(held), (n - i) // per)
        if not k:  # the run ends inside this block: one at a time
            run.fast_step(events[i])
            i += 1
            continue
        taken = [blocks.pop(a) for a in held[:k]]  # none expandable: ``fast_forward`` is here without the option
        if len(held) == k:
            del by_size[whole], sizes[index]
        else:
            del held[:k]
        rest = whole - per * rounded
        split = rest > limit  # else the last request takes the rest whole
        _split_fronts(taken, per, rounded, size, list(map(_EVENT_ID, events[i:i + k * per])), run, split, clock)
        if split:  # the rests, at the blocks' ends, cached (``Pool.insert``)
            for b in taken:
                blocks[b.address] = b
            _cached_after(pool, rest, [b.address for b in taken])
        stats.allocated.add(k * (per * rounded if split else whole))  # a run only allocates: its peak is
        stats.requested.add(k * per * size)  # where it ends
        i += k * per
    return i


def _split_fronts(taken: list[Block], per: int, rounded: int, size: int, ids: list, run, split: bool,
                  clock: int) -> None:  # fmt: skip
    """``per`` requests of ``size`` bytes (``rounded``) served by each of ``taken`` in turn, for ``ids`` in order:
    blocks of ``rounded`` bytes split off its front (as ``plain_loop.plain_allocs`` splits inline: each
    ``Block(...)`` made without its ``__init__``), the block keeping what is left after them, its age base
    ``clock`` (``Pool.insert``: cached as a rest); the last request splits off one more (``split``) or takes the
    block whole."""
    live, addresses = run.live, run.addresses if run.details else None
    count, at = per if split else per - 1, 0
    for block in taken:
        prev, address, segment = block.prev, block.address, block.segment
        shared = (rounded, block.stream, block.small, segment, size, True, False, True, 0)
        for ident in ids[at:at + count]:
            front = _new(Block)
            front.size, front.stream, front.small, front.segment, front.requested, front.allocated, front.pending, \
                front.mapped, front.gc_base = shared  # fmt: skip
            front.address, front.prev = address, prev
            if prev is None:
                segment.head = front
            else:
                prev.next = front
            prev = front
            live[ident] = front
            if addresses is not None:
                addresses.append((ident, address))
            address += rounded
        at += count
        if count:
            prev.next, block.prev, block.gc_base = block, prev, clock
            block.size -= address - block.address
            block.address = address
        if not split:
            ident = ids[at]
            at += 1
            block.allocated, block.requested = True, size
            live[ident] = block
            if addresses is not None:
                addresses.append((ident, address))


def _cached_after(pool: Pool, size: int, new: list[int]) -> None:
    """``new`` (ascending addresses of blocks of ``size``) added to ``pool``'s addresses of that size."""
    held = pool.by_size.get(size)
    if held is None:
        pool.by_size[size] = new
        insort(pool.sizes, size)
    elif held[-1] < new[0]:
        held.extend(new)
    else:
        for address in new:
            insort(held, address)


def walk_run(run, allocs: Sequence) -> bool:
    """``balanced.walk`` of a balanced stretch that is a run of equal requests (``allocs``: ``Event``s of one int size
    > 0 and stream, no segment address, distinct ids; freed right after, in any order): the peaks it reaches and the
    addresses it hands out (``details``), in closed form; False (nothing done) when it needs a new segment, or
    meets a block of an expandable segment, a live id or a request not met before.

    The requests take the pool's cached blocks as ``take_cached`` gives them out (best fit: a block of ``s`` bytes
    serves ``s // r`` requests in a row, then the next block of ``s`` bytes, then the next size), each block's
    rest less than ``r`` (none reused); a run that ends inside a block splits its last requests off its front (the
    block keeps at least ``r`` more). Nothing changes in the pools: the frees put every piece back (``balanced``). A
    speed-up, no rule: a size's blocks counted at once, not a request at a time (tests/test_allocator_plain_loop.py
    compares it with ``walk`` and the request-by-request replay)."""
    _, _, size, stream, _ = allocs[0]
    request = run.alloc._requests.get((size, stream))
    if request is None or not run.live.keys().isdisjoint(map(_EVENT_ID, allocs)):
        return False
    rounded, pool = request
    sizes, by_size, blocks = pool.sizes, pool.by_size, pool.blocks
    limit = least_split_rest(pool.small, False) - 1  # a larger remainder is split off (none expandable here)
    index, left, handed, taken = bisect_left(sizes, rounded), len(allocs), 0, [] if run.details else None
    while left:
        if index == len(sizes):
            return False  # a new segment
        whole = sizes[index]
        held = by_size[whole]
        if blocks[held[0]].segment.expandable:
            return False
        per = whole // rounded
        k = min(len(held), left // per)
        handed += k * (per * rounded if whole - per * rounded > limit else whole)
        left -= k * per
        if taken is not None:
            taken += [(address, per) for address in held[:k]]
        if left and k < len(held):  # the run ends inside the next block: each of its requests split off
            handed += left * rounded
            if taken is not None:
                taken.append((held[k], left))
            left = 0
        index += 1
    stats = run.alloc.stats
    for stat, rise in ((stats.allocated, handed), (stats.requested, len(allocs) * size)):
        if stat.current + rise > stat.peak:
            stat.peak = stat.current + rise
    if taken is not None:
        starts = [address + j * rounded for address, count in taken for j in range(count)]
        run.addresses.extend(zip(map(_EVENT_ID, allocs), starts))
    return True
