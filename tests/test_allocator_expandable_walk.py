"""Balanced stretches under ``expandable_segments:True`` answered by ``balanced.walk`` (``_walk_on``: the best fit
with unmapped room after it kept, or the next block by (size, address) taken when it grows to less, as
``get_free_block``) against the replay without stretches and the request-by-request one: every field of the
``Replay`` equal, on seeded traces with holes unmapped by ``empty_cache`` (blocks with finite room after them),
pending frees, two streams, and on hand-made pools where each choice of the walk shows in the addresses."""

from __future__ import annotations

import random
import sys
from collections import Counter

import pytest

from zeroplan.allocator import balanced
from zeroplan.allocator.replay import Event

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_allocator_balanced import _three  # noqa: E402

MiB = 1 << 20
EXPANDABLE = "expandable_segments:True"


def _expandable_trace(seed: int) -> list[Event]:
    """Seeded: live tensors (up to 210 MiB, or a little under a size freed before) freed at random, some pending
    (``free_requested`` then ``free_completed``), ``empty_cache`` now and then (whole free pages unmapped: holes
    after mapped free blocks), phases, and balanced stretches of mixed sizes on two streams freed in any order,
    some among frees of older tensors."""
    rng, events, live, ident, pending, freed, sizes = random.Random(seed), [], [], 0, [], [MiB], {}

    def size_of(scale: int) -> int:
        return rng.choice([rng.randint(1, 900_000), rng.randint(MiB, scale * MiB), rng.randint(MiB, 3 * scale * MiB),
                           max(1, rng.choice(freed) - rng.randint(0, 2 * MiB))])  # fmt: skip

    for _ in range(60):
        for _ in range(rng.randrange(10)):
            sizes[ident] = size_of(70)
            events.append(Event("alloc", ident, sizes[ident], rng.choice([0, 0, 5])))
            live.append(ident)
            ident += 1
        rng.shuffle(live)
        for _ in range(rng.randrange(len(live) + 1)):
            freed.append(sizes[live[-1]])
            pending += [live[-1]] if rng.random() < 0.1 else []
            events.append(Event("free_requested" if pending and pending[-1] == live[-1] else "free", live.pop()))
        if pending and rng.random() < 0.5:
            events += [Event("free_completed", i) for i in pending]
            pending = []
        for action, odds in (("empty_cache", 0.3), ("phase", 0.3)):
            if rng.random() < odds:
                events.append(Event(action, f"p{rng.randrange(4)}" if action == "phase" else None))
        stream = rng.choice([0, 0, 5])
        for _ in range(rng.randrange(4)):
            base, n = size_of(rng.choice([2, 12, 40])), rng.randrange(1, 10)
            ids = list(range(ident, ident + n))
            ident += n
            for i in ids:
                size = base if rng.random() < 0.4 else size_of(rng.choice([2, 12, 40]))
                events.append(Event("alloc", i, size, rng.choice([stream, stream, 0])))
            older = [live.pop(rng.randrange(len(live))) for _ in range(min(len(live), rng.randrange(-2, 4)))]
            events += [Event("free", i) for i in rng.sample([*ids, *older], n + len(older))]
    return events


def _walks(monkeypatch) -> Counter:
    """Spies on ``_walk_on``: what each call did (from the pool's block or a rest; kept, moved on, stopped)."""
    seen, walk_on = Counter(), balanced._walk_on

    def spy(best, held, *args):
        rests = list(args[-2])
        out = walk_on(best, held, *args)
        did = "kept" if out[0] is best else "stopped" if out[0] is None else "rest" if out[0] in rests else "pool"
        seen["pool" if held is not None else "rest", did] += 1
        return out

    monkeypatch.setattr(balanced, "_walk_on", spy)
    return seen


@pytest.mark.parametrize("seed", range(12))
def test_seeded_expandable_stretches_replay_exactly(seed, monkeypatch):
    """The same replay with stretches, without, and request by request (details on and off); stretches
    answered in every trace, some refused (pages mapped)."""
    events = _expandable_trace(seed)
    for details in (True, False):
        fast, without, full, served = _three(events, EXPANDABLE, monkeypatch, details)
        assert fast == without == full, (seed, details)
        assert len(served) > 20 and max(served) > 3, (seed, served)


def test_seeded_traces_take_every_way_of_the_walk(monkeypatch):
    """Over the seeded traces ``_walk_on`` keeps the best fit, moves on to a pool's block and to a rest, and
    stops, from a pool's block and from a rest: each way the tests above prove is taken."""
    seen = _walks(monkeypatch)
    for seed in range(12):
        fast, without, full, served = _three(_expandable_trace(seed), EXPANDABLE, monkeypatch, False)
        assert fast == full
    for key in [("pool", d) for d in ("kept", "pool", "rest", "stopped")] + [("rest", "kept"), ("rest", "pool")]:
        assert seen[key] > 0, (key, seen)


def _holes(stretch: list[int], second: int | None = None) -> list[Event]:
    """A large pool of cached blocks at known places (20 MiB pages from ``S``): ``P`` = [S+10, S+20) MiB free with
    one unmapped page after it (``empty_cache``: it grows to 30 MiB), ``E`` = [S+45, S+45+e) free and mapped
    round it (``e`` = 30 MiB, or ``second``), the last page full; then a stretch of ``stretch`` (MiB)."""
    e = 30 * MiB if second is None else second
    events = [Event("alloc", "a", 10 * MiB), Event("alloc", "b", 30 * MiB), Event("alloc", "c", 5 * MiB),
              Event("alloc", "e", e), Event("alloc", "f", 75 * MiB - 45 * MiB - e + 5 * MiB),
              Event("alloc", "g", 20 * MiB), Event("free", "b"), Event("free", "e"), Event("empty_cache")]  # fmt: skip
    events += [Event("alloc", i, size * MiB) for i, size in enumerate(stretch)]
    return events + [Event("free", i) for i in reversed(range(len(stretch)))]


@pytest.mark.parametrize(("stretch", "second", "at"), [
    ([8], None, [10]),  # E grows to no less than P: P kept
    ([8], 30 * MiB - 512, [45]),  # E grows to less: taken
    ([8, 8], 30 * MiB - 512, [45, 53]),  # E's rest after it, before P
    ([8, 2], None, [10, 18]),  # P's rest the best fit of 2 MiB: it grows to 22 MiB, E to more: kept
])  # fmt: skip
def test_the_walk_keeps_or_moves_on_as_get_free_block(stretch, second, at, monkeypatch):
    """Hand-made pools: the stretch is answered by the walk, at the addresses ``get_free_block`` picks (MiB
    from the segment's start), the same replay as without stretches and request by request."""
    fast, without, full, served = _three(_holes(stretch, second), EXPANDABLE, monkeypatch)
    assert fast == without == full and served == [len(stretch)]
    start = min(address for _, address in full.addresses)
    assert [(address - start) // (MiB // 2) / 2 for _, address in full.addresses[-len(stretch):]] == at


def test_a_block_of_the_same_size_after_the_best_fit_is_replayed(monkeypatch):
    """``P`` and a free block of its size after it (not growing): ``get_free_block`` takes the second (out of
    address order for the walk's overlay): the stretch is replayed, the same replay."""
    fast, without, full, served = _three(_holes([8], 10 * MiB), EXPANDABLE, monkeypatch)
    assert fast == without == full and served == []
    start = min(address for _, address in full.addresses)
    assert full.addresses[-1][1] - start == 45 * MiB


def test_a_large_block_with_less_than_a_mib_left_splits(monkeypatch):
    """Expandable segments split any rest of 512 B or more (the large pool too): the stretch's allocated peak is
    the request's rounded size, not the block's."""
    events = [Event("alloc", "a", 10 * MiB), Event("alloc", "b", 10 * MiB), Event("alloc", "c", 2 * MiB),
              Event("free", "a"), Event("phase", "p"), Event("alloc", 0, 10 * MiB - 4096), Event("free", 0)]
    fast, without, full, served = _three(events, EXPANDABLE, monkeypatch)
    assert fast == without == full and served == [1]
    assert fast.phases["p"].allocated_bytes == 12 * MiB + 10 * MiB - 4096
