"""ZeRO-3's fast coordinator record and replays (a speed-up, no rule): ``coordinator._recorded`` equal to its
plain computation, and ``zero3_replay.fused_replay`` (a prefetch bucket) and
``zero3_noprefetch.noprefetch_replay`` (none), as ``stage3_schedule`` runs them, give the very schedule of the plain
event-by-event replay (``coordinator.Coordinator.replay``), every field (gathered and high elements after each
event, the peaks, the parameters gathered again in backward, the calls and elements per phase, the open flat
buffers, every all-gather with its event and the event that popped it), or the same error: on ~400 random
module trees and module-use sequences (random depths, parameters shared between modules, modules called twice,
forward hooks inside backward, persistence thresholds, prefetch buckets, live-parameter limits, reuse distances)
and on the traces of the presets and of tests/data/hf_configs (the validator's causal LM and transformers')."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed import coordinator as C
from zeroplan.engines.deepspeed import hook_order as H
from zeroplan.engines.deepspeed import zero3 as Z
from zeroplan.engines.deepspeed.run import _trace
from zeroplan.engines.deepspeed.trace import FETCH, RELEASE, Stage3Trace, TraceEvent
from zeroplan.presets import model_presets, resolve_model

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"


def _plain(trace, numels, nd, threshold, bucket, max_live, max_reuse):
    try:
        return C.Coordinator(trace, numels, nd, threshold, bucket, max_live, max_reuse).replay(trace)
    except ValueError as e:
        return str(e)


def _fast(trace, numels, nd, threshold, bucket, max_live, max_reuse):
    C._stage3_schedule.cache_clear()
    try:
        return C.stage3_schedule(trace, numels, nd, threshold, bucket, max_live, max_reuse)
    except ValueError as e:
        return str(e)


def _plain_record(trace, numels, nd, threshold):
    """``coordinator._recorded`` as main computed it, event by event (its first six items), and each module's
    non-persistent parameters ascending."""
    modules = [frozenset(ps) for ps in trace.modules]
    persist = [n <= threshold for n in numels]
    padded = [-(-n // nd) * nd for n in numels]
    order = [e.module for e in trace.events if e.op == FETCH]
    ordered = [sorted(ps) for ps in modules]
    queue = [(p, step) for step, m in enumerate(order) for p in ordered[m]]
    uses: dict[int, list[int]] = {}
    for step, m in enumerate(order):
        for p in modules[m]:
            uses.setdefault(p, []).append(step)
    module_numel = [sum(numels[p] for p in ps) for ps in trace.modules]
    before = [0]
    for m in order:
        before.append(before[-1] + module_numel[m])
    gathered_by = tuple(tuple(p for p in ps if not persist[p]) for ps in ordered)
    return modules, persist, padded, queue, uses, before, gathered_by


def _check_record(trace, numels, nd, threshold):
    C._recorded.cache_clear()
    got, want = C._recorded(trace, numels, nd, threshold), _plain_record(trace, numels, nd, threshold)
    assert len(got) == len(want) and all(type(g) is type(w) and g == w for g, w in zip(got, want))
    assert [type(q) for q in got[3]] == [tuple] * len(got[3]) and all(type(u) is list for u in got[4].values())


def _fields(schedule):
    """Each all-gather's ``__dict__`` items, in order (the fast replays write them as ``Stage3Gather.__init__``)."""
    return [list(g.__dict__.items()) for g in schedule.gathers]


def _random_trace(rng: random.Random) -> tuple[Stage3Trace, tuple[int, ...]]:
    """A random module tree walked forward then backward (children reversed; some modules never released in
    backward, some forward hooks in backward), with shared parameters, a module called twice and, at times,
    events shuffled into any module-use sequence (whose released modules are all fetched somewhere: the plain
    replay looks up the uses of every parameter it may release)."""
    n_params = rng.randint(1, 40)
    numels = tuple(rng.choice((0, 1, rng.randint(1, 50), rng.randint(1, 5_000), rng.randint(1, 10**6)))
                   for _ in range(n_params))  # fmt: skip
    n_modules = rng.randint(1, 30)
    modules = []
    for _ in range(n_modules):
        k = rng.choice((0, 1, 1, 2, 3, rng.randint(0, 8)))
        modules.append(tuple(rng.choice(range(n_params)) for _ in range(k)))
    children = {m: [] for m in range(n_modules)}
    for m in range(1, n_modules):
        children[rng.randrange(m)].append(m)
    if n_modules > 2 and rng.random() < 0.3:  # a module called from two places
        children[rng.randrange(n_modules)].append(rng.randrange(1, n_modules))
    events: list[TraceEvent] = []

    def forward(m: int, depth: int, in_backward) -> None:
        events.append(TraceEvent(FETCH, m, True, in_backward))
        for c in children[m] if depth < 12 else ():
            forward(c, depth + 1, in_backward)
        events.append(TraceEvent(RELEASE, m, True, in_backward))

    def backward(m: int, depth: int) -> None:
        events.append(TraceEvent(FETCH, m, False))
        if rng.random() < 0.1:  # a checkpointed forward recomputed in backward
            forward(m, depth, True)
        for c in reversed(children[m]) if depth < 12 else ():
            backward(c, depth + 1)
        if rng.random() < 0.85:
            events.append(TraceEvent(RELEASE, m, False))

    forward(0, 0, None)
    backward(0, 0)
    if rng.random() < 0.15:  # any module-use sequence (the queue may not match: the same error both ways)
        rng.shuffle(events)
    elif rng.random() < 0.2:
        events = [TraceEvent(rng.choice((FETCH, RELEASE)), rng.randrange(n_modules), rng.random() < 0.5)
                  for _ in range(rng.randint(1, 60))]  # fmt: skip
        fetched = {e.module for e in events if e.op == FETCH}  # a module released is fetched somewhere
        events = [e for e in events if e.module in fetched]
    return Stage3Trace(tuple(modules), tuple(events)), numels


def _random_settings(rng: random.Random, numels) -> tuple:
    total = sum(numels) or 1
    return (rng.choice((1, 2, 3, 4, 8, 16)), rng.choice((0, 0, 1, 50, 1_000, 10**5, -1)),
            rng.choice((0, 0, -5, 1, 100, 10_000, rng.randint(1, total), 5 * 10**7)),
            rng.choice((10**9, 1, rng.randint(1, total), total)),
            rng.choice((0, 1, rng.randint(0, 2 * total), 10**9)))  # fmt: skip


def test_fast_replays_equal_the_plain_replay_on_random_traces():
    rng = random.Random(16)
    kinds = {"prefetch": 0, "none": 0, "coalesced": 0, "popped later": 0, "regathered": 0}
    for _ in range(400):
        trace, numels = _random_trace(rng)
        if trace.events:  # the trace's forward fetches, kept, are the events' (hook_order.grad_ready_order's)
            H.grad_ready_order.cache_clear()
            assert H.grad_ready_order(trace, numels) == _plain_grad_ready_order(trace, numels)
        for _ in range(2):
            args = (trace, numels, *_random_settings(rng, numels))
            _check_record(*args[:4])
            want, got = _plain(*args), _fast(*args)
            assert got == want, args[1:]
            if not isinstance(want, str):  # each all-gather's fields written as Stage3Gather's __init__ writes them
                assert _fields(got) == _fields(want)
            kinds["prefetch" if args[4] > 0 else "none"] += 1
            if isinstance(want, str):  # not met: a trace's own record always has its fetches next in the queue
                continue
            kinds["coalesced"] += any(len(g.params) > 1 for g in want.gathers)
            kinds["popped later"] += any(g.popped > g.issued for g in want.gathers)
            kinds["regathered"] += bool(want.regathered)
    assert min(kinds.values()) >= 10, kinds  # every path was taken


def _real_cases():
    cases = [(name, "preset", None) for name in model_presets()]
    for path in sorted(CONFIGS.glob("*.json")):
        cases += [(path.stem, "hf", True), (path.stem, "hf", False)]
    return cases


def _workload_trace(name, kind, hf):
    if kind == "preset":
        spec = resolve_model(name)
    else:
        spec = spec_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, transformers=bool(hf))
    return workload, _trace(workload)[0]


SETTINGS = ((100_000, 50_000_000, 10**9, 10**9), (100_000, 0, 10**9, 10**9), (0, 5_000, 10**9, 0),
            (10_000, 0, 10**9, 0), (100, 20_000_000, 3 * 10**7, 10**6))
"""(persistence threshold, prefetch bucket, max live parameters, max reuse distance): the defaults, no
prefetch, small buckets, tight limits."""


@pytest.mark.parametrize("name,kind,hf", _real_cases())
def test_fast_replays_equal_the_plain_replay_on_real_traces(name, kind, hf):
    workload, trace = _workload_trace(name, kind, hf)
    numels = tuple(math.prod(shape) for _, shape in workload.shapes)
    for nd in (2, 64, 1024):
        for threshold, bucket, max_live, max_reuse in SETTINGS:
            args = (trace, numels, nd, threshold, bucket, max_live, max_reuse)
            _check_record(*args[:4])
            want = _plain(*args)
            assert not isinstance(want, str), want
            got = _fast(*args)
            assert got == want, args[2:]
            assert _fields(got) == _fields(want)


@pytest.mark.parametrize("name,kind,hf", _real_cases())
def test_built_trace_steps_events_and_hash_equal_the_plain_ones(name, kind, hf):
    """The trace builder keeps its steps and makes its events without ``TraceEvent.__init__`` (``trace._events``),
    and a trace hashes by its steps (a speed-up, no rule): the events equal ``TraceEvent``'s own, field for field;
    the steps those ``Stage3Trace.steps`` computes from the events; the same trace made again from its fields (steps
    then computed) equal, with the same hash."""
    _, trace = _workload_trace(name, kind, hf)
    plain = tuple(TraceEvent(e.op, e.module, e.forward) for e in trace.events)
    assert trace.events == plain and all(e.__dict__ == p.__dict__ for e, p in zip(trace.events, plain))
    again = Stage3Trace(trace.modules, plain, trace.marks, trace.names, trace.shapes)
    assert "_steps" not in again.__dict__
    assert trace.steps == again.steps == tuple((e.op == FETCH, e.module, e.backward_phase) for e in plain)
    assert trace.forward_fetches == again.forward_fetches == tuple(
        (i, e.module) for i, e in enumerate(plain) if e.op == FETCH and e.forward)  # fmt: skip
    assert again == trace and hash(again) == hash(trace)
    numels = tuple(math.prod(shape) for shape in trace.shapes)
    H.grad_ready_order.cache_clear()
    assert H.grad_ready_order(trace, numels) == _plain_grad_ready_order(trace, numels)


def _plain_grad_ready_order(trace, numels):
    """``hook_order.grad_ready_order`` (no ``calls``) as main computed it, from the events."""
    root, first, one_node = trace.events[0].module, {}, set()
    for pos, e in enumerate(trace.events):
        if e.op == FETCH and e.forward and e.module != root:
            own = [i for i in trace.modules[e.module] if i not in first]
            for i in own:
                first[i] = pos
            if len(own) > 1 and len({numels[i] for i in own}) == 1:
                one_node.update(own)
    end = len(trace.events)
    return tuple(sorted(range(len(numels)), reverse=True,
                        key=lambda i: (first.get(i, end), -i if i in one_node else i)))  # fmt: skip


def _plain_zero_init_moments(modules, nd, p, gathers=None):
    """``zero3._zero_init_moments`` as main computed it: every moment's numbers listed, the largest by ``max``."""
    part = lambda n: -(-n // nd)  # noqa: E731
    built, applied, before = [], [], 0
    for params in modules:
        done = 0
        for n in params:
            copy = n * p if p != 4 else 0
            built.append((before + done + n * 4 + copy, "created", before, done, n, copy))
            done += n * p
        parted, left = 0, sum(params)
        for n in params:
            built.append((before + parted * p + left * p + part(n) * p, "partitioned", before, parted * p, left * p,
                          part(n) * p))  # fmt: skip
            parted += part(n)
            left -= n
        before += sum(part(n) for n in params) * p
    for k, params in enumerate(modules if gathers is None else gathers):
        applied.append((before + sum(part(n) * nd for n in params) * p, k))
    out = [Z._zero_init_built(*max(built, key=lambda m: m[0])[1:])] if built else []
    if applied:
        total = max(applied, key=lambda m: m[0])[0]
        moment = Z._zero_init_moments.__wrapped__(((1,),), 1, 4, None if gathers is None else ((1,),))[-1]
        out.append(Z.Moment(moment.phase, moment.name, (
            Z.Term(moment.terms[0].name, before, moment.terms[0].source),
            Z.Term(moment.terms[1].name, total - before, moment.terms[1].source))))  # fmt: skip
    return tuple(out)


def test_zero_init_moments_equal_the_plain_ones():
    """``zero3._zero_init_moments`` keeps the largest moment's numbers as they come (a speed-up, no rule): equal to
    every moment listed and ``max``'s pick, on random layouts (equal sizes, empty modules, zero-sized parameters,
    gathers or not) and the presets' and tests/data/hf_configs' layouts."""
    rng = random.Random(3)
    cases = [(((4,), (4,)), 1, 4, None), (((4,), (4,), (4, 4)), 1, 4, None), (((2,), (2,)), 1, 2, ((2,), (2,)))]
    for _ in range(100):  # small equal sizes at N_d 1: moments of equal bytes (the first kept)
        modules = tuple(tuple(rng.choice((0, 2, 4)) for _ in range(rng.randint(0, 3)))
                        for _ in range(rng.randint(1, 6)))  # fmt: skip
        cases.append((modules, 1, rng.choice((2, 4)), rng.choice((None, modules[::-1]))))
    for _ in range(300):
        sizes = (0, 1, rng.randint(1, 100), rng.choice((64, 4096)), rng.randint(1, 10**7))
        modules = tuple(tuple(rng.choice(sizes) for _ in range(rng.choice((0, 1, 1, 2, 3, 6))))
                        for _ in range(rng.randint(0, 12)))  # fmt: skip
        gathers = rng.choice((None, (), modules[:2], tuple(reversed(modules)), ((5,), (5,), ())))
        cases.append((modules, rng.choice((1, 2, 3, 8, 1024)), rng.choice((2, 4)), gathers))
    for name, kind, hf in _real_cases()[::3]:
        workload, trace = _workload_trace(name, kind, hf)
        numels = tuple(math.prod(shape) for _, shape in workload.shapes)
        modules = tuple(tuple(numels[i] for i in ps) for ps in trace.modules)
        cases += [(modules, 1024, 2, None), (modules, 8, 4, modules[::2])]
    for args in cases:
        assert Z._zero_init_moments.__wrapped__(*args) == _plain_zero_init_moments(*args), args[1:3]
