"""ZeRO++ hpZ's coordinator replay (zeropp.py ``HpzCoordinator``) in one loop, as ``zero3_replay.fused_replay`` is
``Coordinator``'s: a speed-up, no rule. The same fetches, waits, queue pops, prefetches and releases, event by
event, with hpZ's three additions as ``HpzCoordinator`` makes them: each all-gather split in two calls, the
parameters with a secondary partition first (over the secondary group of H ranks), then the others (over N_d); a
parameter's secondary made at its release (``__release_param`` -> ``partition``); the secondary elements alive after
each event. tests/test_deepspeed_hpz_replay.py compares every field with ``HpzCoordinator``'s on random and real
traces."""

from __future__ import annotations

from bisect import bisect_left

from zeroplan.engines.deepspeed.zero3_replay import AVAILABLE, NOT_AVAILABLE, _issue, _pop_expected, _prefetch


def _issue_split(todo: list[int], sec: set[int], hpz: int, nd: int, groups: list[int], i: int, state: tuple,
                 numels: tuple[int, ...], padded: list[int], backward: bool, counts: list[int]) -> None:
    """``HpzCoordinator.all_gather`` of ``todo`` (ascending, not available): the parameters with a secondary in one
    call over ``hpz`` ranks, then the others over ``nd`` (a part left empty makes no call). ``counts``: [elements
    available, in open flat buffers, gathered, the high], updated."""
    for part, group in (([p for p in todo if p in sec], hpz), ([p for p in todo if p not in sec], nd)):
        if part:
            counts[0], counts[1], counts[2] = _issue(part, i, state, numels, padded, backward, *counts[:3])
            counts[3] = counts[2] if counts[2] > counts[3] else counts[3]
            groups.append(group)


def _waits(params: frozenset, i: int, state: tuple, numels: tuple[int, ...], counts: list[int]) -> None:
    """``Coordinator.wait`` of each of the module's ``params`` in the registry, in the set's order, at event ``i``."""
    status, registry, handles, issued, own = state[:5]
    for p in params:
        if p in registry:
            hid = registry.pop(p)
            h = handles[hid]
            if not h[3]:
                h[3] = True
                for q in h[0]:
                    status[q] = AVAILABLE
                if h[1]:
                    for q in h[0]:
                        own[q] = numels[q]
                    counts[2] += h[4]
                    counts[3] = counts[2] if counts[2] > counts[3] else counts[3]
            h[2] -= 1
            if h[2] == 0:
                issued[hid]["popped"] = i
                counts[2] -= h[1]
                counts[1] -= h[1]


def hpz_fused_replay(steps: tuple[tuple[bool, int, bool], ...], record: tuple, numels: tuple[int, ...], nd: int,
                     hpz: int, sec_numel: list[int], start: frozenset, bucket: int, max_live: int, max_reuse: int,
                     gather: type) -> tuple[tuple, tuple[int, ...], tuple[int, ...], frozenset]:
    """``HpzCoordinator.replay`` over ``steps`` with the coordinator's ``record`` (``coordinator._recorded``), each
    parameter's secondary elements ``sec_numel``, the secondaries of ``start`` alive: (``Stage3Schedule``'s fields,
    the secondary elements after each event, each call's group, the secondaries alive at the end)."""
    modules, persist, padded, queue, uses, before = record[:6]
    n = len(numels)
    status = [AVAILABLE if x else NOT_AVAILABLE for x in persist]
    users, opened, fetched_for, own = [0] * n, [False] * len(modules), [-(10**10)] * n, [0] * n
    registry: dict[int, int] = {}
    handles, issued, calls, regathered, gathers = [], [], [0, 0, 0, 0], [], []
    state = (status, registry, handles, issued, own, calls, regathered, gathers, gather)
    gathered, highs, buffers, secondary, groups = [], [], [], [], []
    sec = set(start)
    sec_mem = sum(sec_numel[p] for p in sec)
    step = at = forward_peak = backward_peak = 0
    counts = [0, 0, 0, 0]  # elements available, in open flat buffers, gathered; the event's high
    end = len(queue) if bucket > 0 else 0  # no prefetch at bucket 0 (or below)
    for i, (is_fetch, m, backward) in enumerate(steps):
        counts[3] = counts[2]
        params = modules[m]
        if is_fetch:
            if params:
                for p in params:
                    if status[p] == NOT_AVAILABLE:  # all_gather takes the ones not available
                        todo = sorted([q for q in params if status[q] == NOT_AVAILABLE])
                        _issue_split(todo, sec, hpz, nd, groups, i, state, numels, padded, backward, counts)
                        break
                if not opened[m]:
                    opened[m] = True
                    for p in params:
                        users[p] += 1
                _waits(params, i, state, numels, counts)
                for p in params:
                    if fetched_for[p] < step:  # Coordinator.pop_expected: these leave the queue
                        at = _pop_expected(queue, at, [q for q in params if fetched_for[q] < step], fetched_for, step)
                        break
            limit = min(max_live - counts[0], bucket)
            if limit > 0 and at < end:  # else Coordinator.prefetch takes nothing
                at, chosen, numel = _prefetch(queue, at, limit, status, numels, fetched_for)
                if numel:
                    _issue_split(sorted(chosen), sec, hpz, nd, groups, i, state, numels, padded, backward, counts)
            step += 1
        else:
            if params and opened[m]:
                opened[m] = False
                for p in params:
                    users[p] -= 1
            reach = before[step] + max_reuse
            for p in params:  # __params_to_release, then __release_param (its secondary made first)
                if status[p] == AVAILABLE and not users[p] and not persist[p] and fetched_for[p] <= step:
                    u = uses[p]
                    k = bisect_left(u, step)
                    if not (k < len(u) and before[u[k]] < reach):
                        if p not in sec:
                            sec.add(p)
                            sec_mem += sec_numel[p]
                        status[p] = NOT_AVAILABLE
                        counts[2] -= own[p]
                        counts[0] -= numels[p]
        gathered.append(counts[2])
        highs.append(counts[3])
        buffers.append(counts[1])
        secondary.append(sec_mem)
        if backward:
            backward_peak = counts[3] if counts[3] > backward_peak else backward_peak
        elif counts[3] > forward_peak:
            forward_peak = counts[3]
    return ((tuple(gathered), tuple(highs), forward_peak, backward_peak, tuple(regathered), *calls, tuple(buffers),
             tuple(gathers)), tuple(secondary), tuple(groups), frozenset(sec))  # fmt: skip
