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
        size = rng.choice([rng.randint(1, 900_000), rng.randint(2 * MiB, 30 * MiB)])
        stream = rng.choice([0, 0, 2])
        for _ in range(rng.randrange(1, 30)):
            events.append(Event("alloc", ident, size, stream))
            live.append(ident)
            ident += 1
        rng.shuffle(live)
        for _ in range(rng.randrange(len(live) + 1)):
            events.append(Event("free", live.pop()))
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
