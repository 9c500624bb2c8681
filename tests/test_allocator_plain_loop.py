"""The replay's fast paths without a memory limit (``allocator/plain_loop.py``: the loop with the free and the
alloc inlined; ``allocator/runs.py take_cached``: a run's requests served by cached blocks, whole ones taken
together) against the request-by-request replay: every field equal (peaks per phase, segments and their
blocks, the segment log, every address)."""

from __future__ import annotations

import random
import sys

import pytest

from zeroplan.allocator import replay
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.replay import Event

from alloc_draws import equal_allocs, mixed_background, some_freed  # a sibling module, as background and golden

MiB = 1 << 20
CONFS = ("", "max_split_size_mb:40", "expandable_segments:True", "roundup_power2_divisions:4")


def _full(events, conf: str, monkeypatch):
    module = sys.modules["zeroplan.allocator.replay"]  # the package's ``replay`` is the function
    with monkeypatch.context() as m:
        m.setattr(module, "alloc_runs", lambda events: {})
        return replay([tuple(e) for e in events], parse_alloc_conf(conf))  # every event through ``_Run.step``


def _cached_runs(seed: int) -> list[Event]:
    """Equal blocks freed (whole segments, or split with a tail), then runs of equal requests that the cached
    blocks serve (handed out whole, or split when over 1 MiB, or 512 B in the small pool, is left; a request
    the same size or up to 9 times smaller, so that a block serves several in a row), on two streams, with
    frees and phases between them."""
    rng, events, live, ident = random.Random(seed), [], [], 0
    for _ in range(40):
        ident, size, stream = equal_allocs(rng, events, live, ident, 30)
        some_freed(rng, events, live, len(live) + 1)
        smaller = max(1, rng.choice([size - rng.choice([0, 1, 4096, 600_000, 2 * MiB]), size // rng.randint(2, 9)]))
        for _ in range(rng.randrange(16, 60)):  # a run: ``alloc_runs`` fast-forwards it
            events.append(Event("alloc", ident, smaller, stream))
            live.append(ident)
            ident += 1
        if rng.random() < 0.2:
            events.append(Event("phase", f"p{rng.randrange(3)}"))
    return events


@pytest.mark.parametrize("conf", CONFS)
def test_cached_runs_and_inlined_steps_replay_exactly(conf, monkeypatch):
    """Seeded traces whose runs start on pools of cached equal blocks: the fast replay equals the full one; the
    runs take several blocks at once in some of them, whole or split (without a memory limit or
    ``max_split_size``)."""
    from zeroplan.allocator import cached_runs, runs

    served, take, fronts, split = [], runs.take_cached, [], cached_runs._split_fronts
    monkeypatch.setattr(runs, "take_cached", lambda *a: served.append(take(*a)) or served[-1])
    monkeypatch.setattr(cached_runs, "_split_fronts", lambda *a: fronts.append(a[1]) or split(*a))
    for seed in range(12):
        events = _cached_runs(seed)
        assert replay(events, parse_alloc_conf(conf)) == _full(events, conf, monkeypatch), (conf, seed)
        assert replay(events, parse_alloc_conf(conf), details=False).phases == \
            _full(events, conf, monkeypatch).phases, (conf, seed)  # fmt: skip
    plain = conf in ("", "roundup_power2_divisions:4")
    assert (max(served, default=0) > 1) == plain and (len(fronts) > 20) == plain, (conf, served[:20], len(fronts))
    assert (max(fronts, default=0) > 3) == plain, (conf, fronts[:20])  # several requests served by one block


def test_a_bad_event_amid_the_inlined_steps_fails_as_before():
    """A free of an id not live, or an alloc of an id still live, among ``Event``s: the same error as ``_Run.step``."""
    ok = [Event("alloc", 0, 4 * MiB), Event("free", 0), Event("alloc", 1, 2 * MiB)]
    with pytest.raises(ValueError, match="no live allocation"):
        replay([*ok, Event("free", 0)])
    with pytest.raises(ValueError, match="still live"):
        replay([*ok, Event("alloc", 1, 2 * MiB)])
    with pytest.raises(ValueError, match="size > 0"):
        replay([*ok, Event("alloc", 2, 0)])


def _interleaved_stretches(seed: int) -> list[Event]:
    """Seeded: live tensors of random sizes (both pools, two streams) freed at random, then stretches whose frees
    come shuffled among frees of other live tensors (before, between and after their own; some of allocs made
    just before the stretch), a phase now and then; some stretches need a new segment (replayed)."""
    rng, events, live, ident = random.Random(seed), [], [], 0
    for _ in range(50):
        ident = mixed_background(rng, events, live, ident, 10, halves=True)
        base = rng.choice([rng.randint(1, 400_000), rng.randint(MiB, 12 * MiB), rng.randint(30 * MiB, 80 * MiB)])
        stream = rng.choice([0, 0, 5])
        for _ in range(rng.randrange(3)):  # allocs right before the stretch: live, or among the others freed
            events.append(Event("alloc", ident, base, stream))
            live.append(ident)
            ident += 1
        ids = list(range(ident, ident + rng.randrange(1, 14)))
        ident += len(ids)
        events += [Event("alloc", i, base if rng.random() < 0.5 else rng.randint(1, 2 * base),
                         rng.choice([stream, stream, 0])) for i in ids]  # fmt: skip
        rng.shuffle(live)
        others = [live.pop() for _ in range(rng.randrange(min(len(live), 12) + 1))]
        freed = others + rng.sample(ids, len(ids))
        rng.shuffle(freed)
        events += [Event("free", i) for i in freed]
    return events


def test_stretches_among_other_frees_replay_exactly(monkeypatch):
    """A stretch whose frees come among frees of other tensors (``plain_loop.freed_tail``): walked, the others
    freed in their order; the same replay as without stretches and as request by request, in every field."""
    from zeroplan.allocator import balanced, plain_loop

    mixed, walk = [], balanced.walk

    def counted(run, allocs):
        served = walk(run, allocs)
        mixed.append(served and len(allocs) < len(groups.get(allocs[-1].id, ())))
        return served

    monkeypatch.setattr(plain_loop, "walk", counted)
    for seed in range(8):
        events = _interleaved_stretches(seed)
        groups, frees = {}, []  # the free group of each stretch's last id
        for e in [*events, Event("phase", "end")]:
            if e.action == "free":
                frees.append(e.id)
            elif frees:
                groups.update(dict.fromkeys(frees, frees))
                frees = []
        for conf in ("", "roundup_power2_divisions:4"):
            for details in (True, False):
                fast = replay(events, parse_alloc_conf(conf), details=details)
                with monkeypatch.context() as m:
                    m.setattr(balanced, "STRETCHES", False)
                    without = replay(events, parse_alloc_conf(conf), details=details)
                assert fast == without, (seed, conf, details)
                assert fast == _full(events, conf, monkeypatch) or not details, (seed, conf)
    assert sum(mixed) > 200, sum(mixed)  # stretches walked with other frees among theirs


def test_freed_tail():
    """The longest tail of allocs whose ids the frees free, in any order among others; none when the last alloc
    is not freed, or an id repeats."""
    from zeroplan.allocator.plain_loop import freed_tail

    a = [Event("alloc", i, 10) for i in range(6)]
    f = [Event("free", i) for i in (9, 5, 3, 7, 4)]
    assert freed_tail(a, f) == (3, {3, 4, 5})
    assert freed_tail(a, [Event("free", i) for i in (1, 2, 0, 5, 4, 3, 8)]) == (6, set(range(6)))
    assert freed_tail(a, [Event("free", 4), Event("free", 3)])[0] == 0  # the last alloc not freed
    assert freed_tail(a, [Event("free", 5), Event("free", 5)])[0] == 0  # freed twice
    assert freed_tail([*a, Event("alloc", 5, 10)], [Event("free", 5), Event("free", 4)])[0] == 0  # allocated twice


def _runs_freed_next(seed: int) -> list[Event]:
    """Seeded: blocks of a few sizes (both pools, two streams) allocated and freed, leaving cached blocks whole or
    split, then runs of equal requests (16 to 60, up to 9 to a block; some larger than any cached block: a new
    segment) freed right after (the last first, then in any order, among other frees), most in a phase of their own."""
    rng, events, live, ident = random.Random(seed), [], [], 0
    for _ in range(30):
        for _ in range(rng.randrange(1, 4)):
            ident, size, stream = equal_allocs(rng, events, live, ident, 40)
        some_freed(rng, events, live, len(live) + 1)
        if rng.random() < 0.3:
            events.append(Event("phase", f"p{rng.randrange(3)}"))
        size = max(1, rng.choice([size - rng.choice([0, 1, 4096, 600_000]), size // rng.randint(2, 9),
                                  size * rng.randint(2, 3)]))  # fmt: skip
        ids = list(range(ident, ident + rng.randrange(16, 60)))
        ident += len(ids)
        if rng.random() < 0.7:  # a phase of its own: its peaks are the run's
            events.append(Event("phase", f"run {ident}"))
        events += [Event("alloc", i, size, stream) for i in ids]
        rng.shuffle(live)
        freed = ids[:-1] + [live.pop() for _ in range(rng.randrange(min(3, len(live)) + 1))]
        rng.shuffle(freed)
        events += [Event("free", i) for i in (ids[-1], *freed)]  # (a run whose last alloc is freed next)
    return events


def test_runs_freed_next_walked_in_closed_form(monkeypatch):
    """A stretch that is a run of equal requests (``cached_runs.walk_run``): the same replay as ``balanced.walk``'s,
    as without stretches and as request by request, in every field; most runs answered (some end inside a block,
    some take several blocks of several sizes), some refused (a new segment)."""
    from zeroplan.allocator import balanced, cached_runs, plain_loop

    answers, walk_run = [], cached_runs.walk_run
    monkeypatch.setattr(plain_loop, "walk_run", lambda run, allocs: answers.append(walk_run(run, allocs)) or answers[-1])
    for seed in range(8):
        events = _runs_freed_next(seed)
        for conf in ("", "roundup_power2_divisions:4"):
            for details in (True, False):
                fast = replay(events, parse_alloc_conf(conf), details=details)
                with monkeypatch.context() as m:
                    m.setattr(plain_loop, "walk_run", balanced.walk)
                    walked = replay(events, parse_alloc_conf(conf), details=details)
                with monkeypatch.context() as m:
                    m.setattr(balanced, "STRETCHES", False)
                    without = replay(events, parse_alloc_conf(conf), details=details)
                assert fast == walked == without, (seed, conf, details)
                assert fast == _full(events, conf, monkeypatch) or not details, (seed, conf)
    assert answers.count(True) > 40 and answers.count(False) > 10, (answers.count(True), answers.count(False))
