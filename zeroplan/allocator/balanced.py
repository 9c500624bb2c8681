"""Balanced stretches of a plain replay answered without touching a block: a speed-up, no rule.

A *balanced stretch* is a run of allocs whose last ``m`` ids are exactly the ids the ``m`` frees right after them
free, in any order (a layer's scratch tensors allocated then dropped; an alloc freed at once): ~25% of an FSDP2
trace's events. In the plain replay (``replay._Run.plain``: no memory limit, no ``max_split_size``) such a
stretch whose ``m`` requests are each served by a cached block leaves the allocator as it found it: a request
takes the best fit (the first block by (size, address) of at least its rounded size) and splits off its front
when ``_should_split``, the rest cached; freeing the fronts merges every piece back (free mapped blocks are never
adjacent, and nothing else changes between), so the pools hold the same (size, address) blocks after. What the
stretch changes is the stats: allocated and requested rise by every block handed out (a block's size: the
rounded request when split, else the whole cached block), then fall back, so their peaks are the current values
plus those sums; its ids are never live after it. ``walk`` finds those blocks read-only (the pool as it is, less
the blocks the stretch's earlier requests took, plus the rests their splits left) and ``plain_loop.freed_tail``
finds the stretch (its frees among others); a stretch that needs a new segment, a live id, a recorded segment
address or a request of 0 bytes or less, is replayed event by event as without them.

Under ``expandable_segments`` the same holds where no page is mapped (every request served by mapped free
bytes: reserved, the segment log and the unmapped ranges unchanged; a freed front merges with mapped free
neighbours only, the pieces of its own block): a split leaves any rest of 512 B or more, and ``get_free_block``
moves from the best fit with unmapped room right after it (a segment's free tail, or a block before a hole
``empty_cache`` unmapped) to the next block by (size, address) when that one grows to less (``_walk_on``); a
stretch meeting a block of the best fit's size there, or two such blocks in a row, is replayed.

Not touched, and not read in the plain replay: ``Block.gc_base`` (garbage collection needs a memory limit), the
pools' ``clock`` (counted only then), which ``Block`` object holds a cached range, the ``blocks`` dict's order.
tests/test_allocator_balanced.py and tests/test_allocator_expandable_walk.py compare the replays with and without
(``STRETCHES``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from zeroplan.allocator.config import is_small, least_split_rest, round_size

STRETCHES = True
"""Balanced stretches answered by ``walk`` (False: every event replayed, for the tests)."""


def walk(run, allocs: Sequence) -> bool:
    """The balanced stretch of ``allocs`` (then the frees of all of them) on ``run`` (``replay._Run``, plain):
    the stats' peaks it reaches and the addresses it hands out (``details``), nothing else changed; False
    (nothing done) when a request is not served by a cached block (or ``_walk_on`` stops).

    The overlay of each pool met: how many of each size's blocks the stretch took (best fit takes a size's
    blocks in address order, so always its first ones), the rests its splits left (size, address, unmapped room
    after, the request that split it) and the largest of them, where its last search of a size ended."""
    live, requests, overlay, last, carved, state = run.live, run.alloc._requests, {}, None, None, None  # fmt: skip
    handed = requested = 0
    found, expandable, asked = [] if run.details else None, run.alloc.config.expandable_segments, (None, None)
    for _, ident, size, stream, address in allocs:
        if address is not None or type(size) is not int or ident in live:
            return False
        if asked[0] != size or asked[1] != stream:  # (the same request as the last one: its rounded size and pool)
            request = requests.get(asked := (size, stream))
            if request is None:  # a request first met (``_Run.step`` raises for a size of 0 or less)
                if size <= 0:
                    return False
                request = _request(run.alloc, size, stream)
            rounded, pool = request
        if pool is not last:
            if carved is not None:
                rests.append(carved)
                top = max(top, carved[0])
            if state is not None:
                state[2] = top
            last, sizes, by_size, blocks = pool, pool.sizes, pool.by_size, pool.blocks
            low = least_split_rest(pool.small, expandable)  # ``_should_split``: a rest of ``low`` or more
            state = overlay.get(pool) or overlay.setdefault(pool, [{}, [], 0, 0, None])
            taken, rests, top = state[0], state[1], state[2]
            carved = None
        if carved is not None and carved[0] >= rounded == carved[3]:
            best = carved  # the rest the last request of this size left: the best fit (it was one less ``r``)
        else:
            if carved is not None:
                rests.append(carved)
                if carved[0] > top:
                    top = carved[0]
            # the pool's best fit: the first block of a size not taken, from where the last search of this
            # size found one (the sizes before it are all taken: ``taken`` only grows)
            index, best = state[3] if state[4] == rounded else bisect_left(sizes, rounded), None
            while index < len(sizes):
                held = sizes[index]
                first = taken.get(held, 0)
                if first < len(by_size[held]):
                    address = by_size[held][first]  # (every segment expandable with the option, none without)
                    best = (held, address, _room(blocks[address]) if expandable else 0)
                    break
                index += 1
            state[3], state[4] = index, rounded
            if top >= rounded:  # a rest (unsorted, the largest ``top``) the best fit? (a loop: rests are few)
                rest = None
                for r in rests:
                    if r[0] >= rounded and (rest is None or r < rest):
                        rest = r
                if rest is not None and (best is None or rest < best):
                    best, held = rest, None
            if best is None:
                return False  # a new segment (expandable segments: pages mapped)
            if best[2]:  # unmapped room after it: ``_expandable_fit``'s walk
                best, held, first = _walk_on(best, held, first, index, sizes, by_size, blocks, taken, rests, top)
                if best is None:
                    return False
            if held is not None:
                taken[held] = first + 1
            else:
                rests.remove(best)
        remaining = best[0] - rounded
        if remaining >= low:
            carved = (remaining, best[1] + rounded, best[2], rounded)
            handed += rounded
        else:
            carved = None
            handed += best[0]
        requested += size
        if found is not None:
            found.append((ident, best[1]))
    stats = run.alloc.stats
    for stat, rise in ((stats.allocated, handed), (stats.requested, requested)):
        if stat.current + rise > stat.peak:
            stat.peak = stat.current + rise
    if found is not None:
        run.addresses.extend(found)
    return True


def _room(block) -> int:
    """The unmapped bytes right after ``block`` of an expandable segment (``_growable`` less its size)."""
    after = block.next
    return after.size if after is not None and not after.mapped else 0


def _walk_on(best: tuple, held, first: int, index: int, sizes, by_size, blocks, taken, rests, top: int) -> tuple:
    """``_expandable_fit``'s walk from the best fit ``best`` (size, address, unmapped room after it): a pool's
    block of size ``held`` (its ``first`` not taken, at ``sizes[index]``) or one of ``rests`` (``held`` None).
    The block after it by (size, address) is taken when it grows to less, ``best`` kept else: (the block,
    ``held`` and ``first`` of it where it is the pool's), or Nones where ``walk`` stops: the next block also with
    room after it, or of ``best``'s size (taken out of address order). ``top``: no rest is larger."""
    if held is not None and first + 1 < len(by_size[held]):
        return None, None, None
    nxt = None
    for index in range(index + (held is not None), len(sizes)):  # the pool's next: the first not taken
        size = sizes[index]
        if taken.get(size, 0) < len(by_size[size]):
            block = blocks[by_size[size][taken.get(size, 0)]]
            nxt = (size, block.address, _room(block))
            break
    rest = min([r for r in rests if r > best], default=None) if top >= best[0] else None
    if rest is not None and (nxt is None or rest < nxt):
        nxt = rest
    if nxt is None or nxt[0] >= best[0] + best[2]:  # ``best`` grows to less or as much: kept
        return best, held, first
    if nxt[2]:
        return None, None, None
    return (rest, None, 0) if nxt is rest else (nxt, nxt[0], taken.get(nxt[0], 0))


def _request(alloc, size: int, stream: int) -> tuple:
    """``CachingAllocator.malloc``'s (rounded size, pool) of a request first met (kept, as ``malloc`` keeps it)."""
    rounded = round_size(size, alloc.config)
    request = alloc._requests[size, stream] = (rounded, alloc._pool(stream, is_small(rounded)))
    return request
