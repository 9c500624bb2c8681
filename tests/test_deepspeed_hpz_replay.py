"""ZeRO++ hpZ's coordinator replay in one loop (``zero3_hpz_replay.hpz_fused_replay``, read by zeropp.py
``_hpz_replay``; a speed-up, no rule: issue 16's plan speed, Llama-2-70B on 2,048 GPUs) equals ``HpzCoordinator``'s
replay, kept in zeropp.py as the reference: every schedule field, each all-gather's fields in order, the secondary
elements after each event, each call's group and the secondaries left, on 400 random module trees and uses (with
secondaries alive at the start, as a warm micro-step) and on the presets' and tests/data/hf_configs' traces."""

from __future__ import annotations

import math
import random

import pytest

from tests.test_deepspeed_coordinator_fast import SETTINGS, _fields, _random_settings, _random_trace, _real_cases, \
    _workload_trace
from zeroplan.engines.deepspeed.zeropp import HpzCoordinator, HpzSchedule, Stage3Schedule, _hpz_replay


def _plain(trace, numels, nd, hpz, threshold, bucket, max_live, max_reuse, start):
    """``_hpz_replay`` as it was (main at 9c9090d): ``HpzCoordinator``'s replay; an error as its text."""
    try:
        c = HpzCoordinator(trace, numels, nd, hpz, threshold, bucket, max_live, max_reuse, secondary=start)
        base = c.replay(trace)
    except (ValueError, KeyError) as e:
        return repr(e)
    return HpzSchedule(**{f: getattr(base, f) for f in Stage3Schedule.__dataclass_fields__},
                       secondary=tuple(c.secondary), groups=tuple(c.group_of)), frozenset(c.sec)


def _fast(*args):
    _hpz_replay.cache_clear()
    try:
        return _hpz_replay(*args)
    except (ValueError, KeyError) as e:
        return repr(e)


def _check(args):
    want, got = _plain(*args), _fast(*args)
    assert got == want, args[1:]
    if not isinstance(want, str):
        assert _fields(got[0]) == _fields(want[0])
        assert got[0].secondary == want[0].secondary and got[0].groups == want[0].groups
    return want


def test_hpz_replay_equals_the_coordinator_on_random_traces():
    rng = random.Random(20)
    seen = {"two calls": 0, "secondary made": 0, "warm": 0, "prefetch": 0}
    for _ in range(400):
        trace, numels = _random_trace(rng)
        for _ in range(2):
            nd, threshold, bucket, max_live, max_reuse = _random_settings(rng, numels)
            hpz = rng.choice((2, 4, 8))
            nd = hpz * rng.choice((1, 2, 3))
            start = frozenset(rng.sample(range(len(numels)), rng.randint(0, len(numels)))) if rng.random() < 0.4 \
                else frozenset()
            want = _check((trace, numels, nd, hpz, threshold, bucket, max_live, max_reuse, start))
            if isinstance(want, str):
                continue
            sched, left = want
            seen["two calls"] += any(a.issued == b.issued for a, b in zip(sched.gathers, sched.gathers[1:]))
            seen["secondary made"] += len(left) > len(start)
            seen["warm"] += bool(start)
            seen["prefetch"] += bucket > 0 and len(sched.gathers) > 0
    assert min(seen.values()) >= 10, seen


@pytest.mark.parametrize("name,kind,hf", _real_cases())
def test_hpz_replay_equals_the_coordinator_on_real_traces(name, kind, hf):
    workload, trace = _workload_trace(name, kind, hf)
    numels = tuple(math.prod(shape) for _, shape in workload.shapes)
    for nd, hpz in ((16, 8), (64, 2)):
        for threshold, bucket, max_live, max_reuse in SETTINGS[:3]:
            cold = _check((trace, numels, nd, hpz, threshold, bucket, max_live, max_reuse, frozenset()))
            assert not isinstance(cold, str), cold
            _check((trace, numels, nd, hpz, threshold, bucket, max_live, max_reuse, cold[1]))  # a warm micro-step
