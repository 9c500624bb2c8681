"""Seeded pieces of the random allocation traces the allocator tests draw (test_allocator_plain_loop.py,
test_allocator_balanced.py): one home for the background they share, each drawing from ``rng`` in a fixed order."""

from __future__ import annotations

import random

from zeroplan.allocator.replay import Event

MiB = 1 << 20


def some_freed(rng: random.Random, events: list, live: list, at_most: int) -> None:
    """``live`` shuffled, then up to ``at_most`` - 1 of its tensors (a random count) freed, the last first."""
    rng.shuffle(live)
    for _ in range(rng.randrange(at_most)):
        events.append(Event("free", live.pop()))


def mixed_background(rng: random.Random, events: list, live: list, ident: int, most: int, halves: bool) -> int:
    """Fewer than ``most`` tensors of random sizes (small pool or 1-40 MiB; streams 0, 0 or 5) made live, some of
    the live ones freed (up to half with ``halves``), a phase three times in ten; the next id."""
    for _ in range(rng.randrange(most)):
        size = rng.choice([rng.randint(1, 900_000), rng.randint(MiB, 40 * MiB)])
        events.append(Event("alloc", ident, size, rng.choice([0, 0, 5])))
        live.append(ident)
        ident += 1
    some_freed(rng, events, live, (len(live) // 2 if halves else len(live)) + 1)
    if rng.random() < 0.3:
        events.append(Event("phase", f"p{rng.randrange(4)}"))
    return ident


def equal_allocs(rng: random.Random, events: list, live: list, ident: int, most: int) -> tuple[int, int, int]:
    """One to ``most`` - 1 equal tensors (small pool or 2-30 MiB; streams 0, 0 or 2) made live: (next id, size,
    stream)."""
    size = rng.choice([rng.randint(1, 900_000), rng.randint(2 * MiB, 30 * MiB)])
    stream = rng.choice([0, 0, 2])
    for _ in range(rng.randrange(1, most)):
        events.append(Event("alloc", ident, size, stream))
        live.append(ident)
        ident += 1
    return ident, size, stream
