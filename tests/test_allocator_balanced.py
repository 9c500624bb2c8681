"""Balanced stretches answered by a read-only best fit (``allocator/balanced.py``) against the replay without
them (``STRETCHES`` False) and the request-by-request one (plain tuples through ``_Run.step``): every field of the
``Replay`` equal (peaks per phase, segments and their blocks, the segment log, every address), on real traces of
each engine and on seeded traces built of balanced stretches."""

from __future__ import annotations

import random
import sys

import pytest

from zeroplan.allocator import balanced, replay
from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.allocator.replay import Event

from alloc_draws import mixed_background  # a sibling module, as background and golden

MiB = 1 << 20


def _three(events, conf: str, monkeypatch, details: bool = True) -> tuple:
    """(with stretches, without, request by request) of ``events``; how many stretches ``walk`` answered."""
    module, cfg, served = sys.modules["zeroplan.allocator.replay"], parse_alloc_conf(conf), []
    plain_loop, walk = sys.modules["zeroplan.allocator.plain_loop"], balanced.walk
    with monkeypatch.context() as m:
        m.setattr(plain_loop, "walk", lambda run, allocs: walk(run, allocs) and not served.append(len(allocs)))
        fast = replay(events, cfg, details=details)
    with monkeypatch.context() as m:
        m.setattr(balanced, "STRETCHES", False)
        without = replay(events, cfg, details=details)
    with monkeypatch.context() as m:
        m.setattr(module, "alloc_runs", lambda events: {})
        full = replay([tuple(e) for e in events], cfg, details=details)
    return fast, without, full, served


def _engine_traces():
    from zeroplan.engines import deepspeed, fsdp2, reference
    from zeroplan.engines.deepspeed.alloc_trace import alloc_traces as deepspeed_traces
    from zeroplan.engines.fsdp2.alloc_trace import alloc_traces as fsdp2_traces
    from zeroplan.engines.reference.alloc_trace import alloc_traces as reference_traces
    from zeroplan.estimation.workload import model_workload
    from zeroplan.presets import resolve_model

    w = model_workload(resolve_model("llama2-7b"), 1024, 1, "none", 1, True)
    full = model_workload(resolve_model("llama2-7b"), 1024, 2, "full", 2, True)
    return {
        "fsdp2-reshard": fsdp2_traces(w, 8, fsdp2.Settings())[0],
        "fsdp2-keep-bf16": fsdp2_traces(w, 8, fsdp2.Settings(reshard_after_forward=False, param_dtype="bf16"))[0],
        "fsdp2-ckpt-k4": fsdp2_traces(full, 8, fsdp2.Settings(reshard_after_forward=4))[0],
        "fsdp2-tp2": fsdp2_traces(full, 8, fsdp2.Settings(tp=2))[0],
        "deepspeed-zero3": deepspeed_traces(w, 8, deepspeed.Settings(stage=3))[0],
        "deepspeed-zero2-overlap": deepspeed_traces(full, 8, deepspeed.Settings(stage=2, overlap_comm=True))[0],
        "reference": reference_traces(full, 8, reference.Settings())[0],
    }


@pytest.mark.parametrize("conf", ["", "roundup_power2_divisions:4", "expandable_segments:True", "max_split_size_mb:64"])
def test_real_traces_replay_the_same_with_stretches(conf, monkeypatch):
    """FSDP2, DeepSpeed and reference traces of llama2-7b: the same replay with stretches, without, and request by
    request (details on and off); the plain replays (no ``max_split_size``; expandable segments too,
    tests/test_allocator_expandable_walk.py) answer a hundred or more FSDP2 stretches."""
    served_all = 0
    for name, trace in _engine_traces().items():
        for details in (True, False):
            fast, without, full, served = _three(trace.events, conf, monkeypatch, details)
            assert fast == without == full, (name, conf, details)
            served_all += len(served)
            if name.startswith("fsdp2") and conf != "max_split_size_mb:64":
                assert len(served) > 100 and max(served) > 5, (name, len(served))
    assert (served_all > 0) == (conf != "max_split_size_mb:64"), conf


def _stretch_trace(seed: int) -> list[Event]:
    """Seeded: live tensors of random sizes (small and large pool, two streams) freed at random, leaving cached
    blocks, a phase now and then (its peaks reset: the stretch after it makes them), and balanced stretches:
    allocs of equal or mixed sizes freed in any order (last first, first first, shuffled), some larger than any
    cached block (a new segment: replayed), some after allocs that stay live, some among frees of older tensors."""
    rng, events, live, ident = random.Random(seed), [], [], 0
    for _ in range(60):
        ident = mixed_background(rng, events, live, ident, 8, halves=False)
        base = rng.choice([rng.randint(1, 400_000), rng.randint(MiB, 12 * MiB), rng.randint(30 * MiB, 80 * MiB)])
        sizes = [base if rng.random() < 0.5 else rng.randint(1, 2 * base) for _ in range(rng.randrange(1, 14))]
        stream = rng.choice([0, 0, 5])
        kept = []
        for _ in range(rng.randrange(3)):  # allocs before the stretch that stay live
            events.append(Event("alloc", ident, base, stream))
            kept.append(ident)
            ident += 1
        ids = list(range(ident, ident + len(sizes)))
        ident += len(sizes)
        events += [Event("alloc", i, s, rng.choice([stream, stream, 0])) for i, s in zip(ids, sizes)]
        order = rng.choice(["last", "first", "shuffled", "among"])
        freed = ids[::-1] if order == "last" else ids if order == "first" else rng.sample(ids, len(ids))
        if order == "first":
            freed = [ids[-1], *ids[:-1]]
        if order == "among":  # among frees of older tensors, in any order (an FSDP2 layer's gathered parameters)
            older = [live.pop(rng.randrange(len(live))) for _ in range(min(len(live), rng.randrange(6)))]
            freed = rng.sample(freed + older, len(freed) + len(older))
        events += [Event("free", i) for i in freed]
        live += kept
    return events


@pytest.mark.parametrize("seed", range(10))
def test_seeded_stretches_replay_exactly(seed, monkeypatch):
    """Seeded stretches (equal and mixed sizes, split and unsplit blocks, two streams and pools, some needing a
    new segment): the same replay with stretches, without, and request by request; most stretches answered,
    some refused (a new segment)."""
    events = _stretch_trace(seed)
    for conf in ("", "roundup_power2_divisions:4"):
        for details in (True, False):
            fast, without, full, served = _three(events, conf, monkeypatch, details)
            assert fast == without == full, (seed, conf, details)
            assert len(served) > 20 and max(served) > 5, (seed, served)


def test_a_stretch_makes_the_phase_peak(monkeypatch):
    """Cached blocks (one split, one handed out whole) serve a stretch right after a phase starts: its peaks are
    the current values plus the blocks handed out (allocated: the rounded request when split, the whole block
    when not) and the requests (requested)."""
    events = [Event("alloc", 0, 30 * MiB), Event("alloc", 1, 4 * MiB), Event("alloc", 2, 64), Event("free", 0),
              Event("free", 1), Event("phase", "p"), Event("alloc", 3, 10 * MiB), Event("alloc", 4, 59 * MiB // 2),
              Event("free", 4), Event("free", 3)]  # fmt: skip
    fast, without, full, served = _three(events, "", monkeypatch)
    assert fast == without == full and served == [2]
    peak = fast.phases["p"]  # 10 MiB split off the 20 MiB segment; the 30 MiB one whole (half a MiB left)
    assert peak.allocated_bytes == 512 + 10 * MiB + 30 * MiB
    assert peak.requested_bytes == 64 + 10 * MiB + 59 * MiB // 2
    assert fast.allocated_peak_bytes == 512 + 40 * MiB  # the stretch's, above the 34 MiB live before it


def test_a_run_freed_next_is_a_stretch(monkeypatch):
    """A run of equal allocs (``alloc_runs``) whose last is freed next joins the events after it: with too few
    cached blocks it is replayed (new segments), then cached blocks serve a run as one stretch (3 MiB carved 6 to
    a 20 MiB block; 19.5 MiB given the whole block), its peaks the blocks handed out."""
    from zeroplan.allocator.runs import MIN_RUN

    n, half = 3 * MIN_RUN, 39 * MiB // 2
    events = [Event("alloc", i, half) for i in range(n)] + [Event("alloc", -1, 64)]
    events += [Event("free", i) for i in range(n)]  # n cached blocks of 20 MiB
    for start, size, count in ((n, 20 * MiB, 2 * n), (3 * n, 3 * MiB, n), (4 * n, half, n // 2)):
        ids = range(start, start + count)
        events += [Event("alloc", i, size) for i in ids] + [Event("free", i) for i in reversed(ids)]
        events += [Event("phase", f"after {start}")]
    fast, without, full, served = _three(events, "", monkeypatch)
    assert fast == without == full and served == [n, n // 2], served
    assert fast.phases[f"after {3 * n}"].allocated_bytes == 512 + n // 2 * 20 * MiB
    assert fast.phases[f"after {3 * n}"].requested_bytes == 64 + n // 2 * half
    assert fast.reserved_peak_bytes == 2 * n * 20 * MiB + 2 * MiB  # the first: n segments more (and the small one)

