"""The caching allocator model's pool kept by size (``blocks.Pool``: the sorted distinct sizes, each size's sorted
addresses) answers as one list of its blocks sorted by (size, address), the order torch's ``BlockComparatorSize``
keeps: best fit, the next block, iteration, on seeded random inserts and removes. Pure math."""

from __future__ import annotations

import random
from bisect import bisect_left

from zeroplan.allocator.blocks import Block, Pool, Segment


def _check(pool: Pool, held: list[tuple[int, int]], rng: random.Random) -> None:
    """``pool`` against ``held``, the plain sorted list of its blocks' (size, address)."""
    assert [(b.size, b.address) for b in pool] == held
    assert len(pool.blocks) == len(held)
    assert pool.sizes == sorted({s for s, _ in held})
    for size in {*(s for s, _ in held), *(rng.randrange(1, 40) * 512 for _ in range(5))}:
        index = bisect_left(held, (size, -1))
        got = pool.first(size)
        assert (None if got is None else (got.size, got.address)) == (held[index] if index < len(held) else None)
    for at, block in enumerate(pool):
        nxt = pool.after(block)
        assert (None if nxt is None else (nxt.size, nxt.address)) == (held[at + 1] if at + 1 < len(held) else None)


def test_the_pool_by_size_answers_as_the_list_sorted_by_size_and_address():
    rng = random.Random("pool-by-size")
    for _ in range(40):
        pool, held, blocks = Pool(False, [0]), [], {}
        segment = Segment(0, 0, False)
        for _ in range(rng.randrange(1, 120)):
            if held and rng.random() < 0.4:  # remove a block held
                size, address = held.pop(rng.randrange(len(held)))
                pool.remove(blocks.pop(address))
            else:  # a new block: few sizes (as a replay's pools), distinct addresses
                size, address = rng.choice((512, 1024, 2048, 1 << 20, 3 << 20)), rng.randrange(1 << 30) * 512
                if address in blocks:
                    continue
                block = blocks[address] = Block(address, size, 0, False, segment)
                pool.insert(block)
                held.append((size, address))
                held.sort()
            _check(pool, held, rng)
