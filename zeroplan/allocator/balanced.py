"""Balanced stretches of a plain replay answered without touching a block: a speed-up, no rule.

A *balanced stretch* is a run of allocs whose last ``m`` ids are exactly the ids the ``m`` frees right after them
free, in any order (a layer's scratch tensors allocated then dropped; an alloc freed at once): ~25% of an FSDP2
trace's events. In the plain replay (``replay._Run.plain``: no memory limit, no ``max_split_size``) such a
stretch whose ``m`` requests are each served by a cached block of a non-expandable segment leaves the allocator
as it found it: a request takes the best fit (the first block by (size, address) of at least its rounded size)
and splits off its front when ``_should_split``, the rest cached; freeing the fronts merges every piece back
(free blocks are never adjacent, and nothing else changes between), so the pools hold the same (size, address)
blocks after. What the stretch changes is the stats: allocated and requested rise by every block handed out (a
block's size: the rounded request when split, else the whole cached block), then fall back, so their peaks are
the current values plus those sums; its ids are never live after it. ``walk`` finds those blocks read-only (the
pool as it is, less the blocks the stretch's earlier requests took, plus the rests their splits left) and
``stretch_length`` finds the stretch; a stretch that needs a new segment, or meets a block of an expandable segment,
a live id, a recorded segment address or a request not met before, is replayed event by event as without them.

Not touched, and not read in the plain replay: ``Block.gc_base`` (garbage collection needs a memory limit), the
pools' ``clock`` (counted only then), which ``Block`` object holds a cached range, the ``blocks`` dict's order.
tests/test_allocator_balanced.py compares the replays with and without (``STRETCHES``). Under ``expandable_segments``
(every block of an expandable segment) no stretch is looked for.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from operator import itemgetter

from zeroplan.allocator.config import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, is_small, round_size

STRETCHES = True
"""Balanced stretches answered by ``walk`` (False: every event replayed, for the tests)."""

_ID = itemgetter(1)  # an ``Event``'s id


def stretch_length(allocs: Sequence, frees: Sequence) -> int:
    """The largest ``m`` (up to ``_LONGEST``) such that the first ``m`` of ``frees`` free the last ``m`` of ``allocs``
    (distinct ids), 0 if none; only where the first free is of the last alloc (every stretch of an FSDP2 trace
    is; a cheap test for the ~3 in 4 transitions that have none). The ids met on one side and not yet on the
    other are toggled in a set, empty after ``k`` steps exactly when the two sides hold the same ``k`` ids."""
    n = len(allocs)
    if frees[0][1] != allocs[-1][1] or not STRETCHES:
        return 0
    odd, m = set(), 0
    for k in range(min(n, len(frees), _LONGEST)):
        mine, freed = allocs[n - 1 - k][1], frees[k][1]
        if mine != freed:
            odd ^= {mine, freed}
        if not odd:
            m = k + 1
    if len(set(map(_ID, allocs[n - m:]))) != m:  # an id allocated twice: replayed (``_Run.step`` raises)
        return 0
    return m


_LONGEST = 4096  # a longer stretch is found in part (its last 4,096 allocs) or not at all: replayed


def walk(run, allocs: Sequence) -> bool:
    """The balanced stretch of ``allocs`` (then the frees of all of them) on ``run`` (``replay._Run``, plain):
    the stats' peaks it reaches and the addresses it hands out (``details``), nothing else changed; False
    (nothing done) when a request is not served by a cached block of a non-expandable segment.

    The overlay of each pool met: how many of each size's blocks the stretch took (best fit takes a size's
    blocks in address order, so always its first ones), the rests its splits left (size, address) and the
    largest of them, where its last search of a size ended."""
    live, requests, overlay, last, carved, state = run.live, run.alloc._requests, {}, None, None, None  # fmt: skip
    handed = requested = 0
    found = [] if run.details else None
    for _, ident, size, stream, address in allocs:
        if address is not None or type(size) is not int or ident in live:
            return False
        request = requests.get((size, stream))
        if request is None:  # a request first met (``_Run.step`` raises for a size of 0 or less)
            if size <= 0:
                return False
            request = _request(run.alloc, size, stream)
        rounded, pool = request
        if pool is not last:
            if carved is not None:
                rests.append(carved[:2])
                top = max(top, carved[0])
            if state is not None:
                state[2] = top
            last, sizes, by_size, blocks, small = pool, pool.sizes, pool.by_size, pool.blocks, pool.small
            state = overlay.get(pool) or overlay.setdefault(pool, [{}, [], 0, 0, None])
            taken, rests, top = state[0], state[1], state[2]
            carved = None
        if carved is not None and carved[0] >= rounded == carved[2]:
            best = carved  # the rest the last request of this size left: the best fit (it was one less ``r``)
        else:
            if carved is not None:
                rests.append(carved[:2])
                top = max(top, carved[0])
            # the pool's best fit: the first block of a size not taken, from where the last search of this
            # size found one (the sizes before it are all taken: ``taken`` only grows)
            index, best = state[3] if state[4] == rounded else bisect_left(sizes, rounded), None
            while index < len(sizes):
                held = sizes[index]
                first = taken.get(held, 0)
                if first < len(by_size[held]):
                    best = (held, by_size[held][first])
                    break
                index += 1
            state[3], state[4] = index, rounded
            if top >= rounded:  # a rest (unsorted, the largest ``top``) the best fit?
                rest = min([r for r in rests if r[0] >= rounded], default=None)
                if rest is not None and (best is None or rest < best):
                    rests.remove(rest)
                    best, held = rest, None
            if best is None or held is not None and blocks[best[1]].segment.expandable:
                return False  # a new segment, or ``plain_loop._expandable_fit``'s walk
            if held is not None:
                taken[held] = first + 1
        remaining = best[0] - rounded
        if remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE:  # ``_should_split``
            carved = (remaining, best[1] + rounded, rounded)
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


def _request(alloc, size: int, stream: int) -> tuple:
    """``CachingAllocator.malloc``'s (rounded size, pool) of a request first met (kept, as ``malloc`` keeps it)."""
    rounded = round_size(size, alloc.config)
    request = alloc._requests[size, stream] = (rounded, alloc._pool(stream, is_small(rounded)))
    return request
