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


def _plain_gathers(s, trace, numels, nd, hpz, grad_accum):
    """``zeropp_gathers`` as it was (main at 9c9090d): both hpZ replays made, no cache."""
    from zeroplan.engines.deepspeed.zeropp import GATHER_SRC, QWZ_SRC, hpz_schedule, qwz_groups, stage3_schedule

    args = (s.param_persistence_threshold, s.prefetch_bucket_size, s.max_live_parameters, s.max_reuse_distance)
    if hpz:
        later = (hpz_schedule(trace, numels, nd, hpz, *args, warm=True), grad_accum - 1)
        scheds = ((hpz_schedule(trace, numels, nd, hpz, *args), 1), *((later,) if grad_accum > 1 else ()))
    else:
        scheds = ((stage3_schedule(trace, numels, nd, *args), grad_accum),)
    rows = {}
    for sched, times in scheds:
        groups = sched.groups if isinstance(sched, HpzSchedule) else (nd,) * len(sched.gathers)
        for g, group in zip(sched.gathers, groups):
            phase = "backward" if trace.events[g.issued].backward_phase else "forward"
            calls = [(s.dtype, g.elements, GATHER_SRC)]
            if s.quantized_weights:
                calls = [("int8", g.elements, QWZ_SRC), ("fp32", qwz_groups(g.elements // group) * group, QWZ_SRC)]
            for dtype, elements, src in calls:
                row = rows.setdefault((phase, group, dtype), [0, 0, src])
                row[0] += times
                row[1] += times * elements
    return tuple((phase, group, dtype, calls, elements, src)
                 for (phase, group, dtype), (calls, elements, src) in rows.items())


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-qwz", "tiny-qwen3-moe", "gpt2"])
def test_zeropp_gathers_equal_the_plain_rows(name):
    """``zeropp_gathers``' rows, cached per schedule's arguments and with the warm replay made only for G > 1, equal
    the rows built each time, for hpZ and not, qwZ and not, G = 1 and 3, in turn (the cache warm)."""
    from zeroplan.engines.deepspeed import Settings
    from zeroplan.engines.deepspeed.zeropp import zeropp_gathers

    workload, trace = _workload_trace(name, "hf", True)
    numels = tuple(math.prod(shape) for _, shape in workload.shapes)
    for _ in range(2):
        for hpz in (0, 2):
            for quantized in (False, True):
                for grad_accum in (1, 3):
                    for dtype in ("bf16", "fp16"):
                        s = Settings(stage=3, dtype=dtype, quantized_weights=quantized, prefetch_bucket_size=2_000)
                        try:
                            want = _plain_gathers(s, trace, numels, 8, hpz, grad_accum)
                        except ValueError as e:  # qwZ's quantizer finds no group size: the same error
                            with pytest.raises(ValueError, match=str(e)[:30]):
                                zeropp_gathers(s, trace, numels, 8, hpz, grad_accum)
                            continue
                        assert zeropp_gathers(s, trace, numels, 8, hpz, grad_accum) == want
