"""ZeRO-3's coordinator replay (``coordinator.Coordinator``) in one loop: a speed-up, no rule. ``fused_replay`` runs
the same fetches, waits, queue pops, prefetches, releases and all-gathers, event by event, in the same order (the
waits in the order of the module's parameter set, as ``Coordinator.fetch``), with its state in locals and plain
lists: the schedule is the very same (tests/test_deepspeed_coordinator_fast.py compares every field on random and
real traces).

What differs is bookkeeping only: a handle is a list ``[params, flat elements, waiting, done, elements copied out]``;
``ds_active_sub_modules`` is a count per parameter of the modules holding it between their fetch and release (a
module's fetch adds it to each of its parameters' sets, its release removes it from each: the set of ``p`` is the
open modules holding ``p``); copying a coalesced call's parameters out of its flat buffer raises the elements
gathered by their sum at once (each step only adds: the same high)."""

from __future__ import annotations

from bisect import bisect_left

NOT_AVAILABLE, INFLIGHT, AVAILABLE = 0, 1, 2
"""partition_parameters.py ``ZeroParamStatus`` (coordinator.py's ``Coordinator`` reads them from here)."""


def _prefetch(queue: list[tuple[int, int]], at: int, limit: int, status: list[int], numels: tuple[int, ...],
              fetched_for: list[int]) -> tuple[int, set[int], int]:
    """fetch_sub_module's prefetch walk of the queue from ``at`` (``Coordinator.prefetch`` and the fused replay):
    (where it stops, the parameters chosen, their elements)."""
    chosen: set[int] = set()
    numel, end = 0, len(queue)
    while at < end and numel < limit:
        p, used_at = queue[at]
        at += 1
        if status[p] == NOT_AVAILABLE and p not in chosen:
            chosen.add(p)
            numel += numels[p]
        if used_at > fetched_for[p]:
            fetched_for[p] = used_at
    return at, chosen, numel


def _pop_expected(queue: list[tuple[int, int]], at: int, expected: list[int], fetched_for: list[int], step: int) -> int:
    """fetch_sub_module (``Coordinator.pop_expected`` and the fused replay): the module's ``expected`` parameters (not fetched for this step) leave the head
    of the queue from ``at``; returns where the queue's head is then."""
    end, want, popped = len(queue), len(expected), set()
    while at < end and len(popped) < want:
        p, used_at = queue[at]
        at += 1
        fetched_for[p] = used_at
        popped.add(p)
    if popped != set(expected):
        raise ValueError(f"ZeRO-3 trace: step {step} expected {sorted(expected)} next in the queue, "
                         f"got {sorted(popped)}")  # fmt: skip
    return at


def _issue(todo: list[int], i: int, state: tuple, numels: tuple[int, ...], padded: list[int], backward: bool,
           avail: int, flat: int, mem: int) -> tuple[int, int, int]:
    """``Coordinator.all_gather`` of ``todo`` (ascending, not available) at event ``i``: its handle and call
    recorded (its ``gather``, without the call: a speed-up); returns the elements available, in open flat
    buffers and gathered then."""
    status, registry, handles, issued, own, calls, regathered, gathers, gather = state
    if len(todo) == 1:
        elements, copied = padded[todo[0]], numels[todo[0]]
    else:
        elements, copied = sum(map(padded.__getitem__, todo)), sum(map(numels.__getitem__, todo))
    at = 2 if backward else 0
    calls[at] += 1
    calls[at + 1] += elements
    if backward:
        regathered += todo
    hid = len(handles)
    g = object.__new__(gather)  # a ``Stage3Gather``, its fields written as its ``__init__`` writes them
    d = g.__dict__
    d["params"], d["issued"], d["elements"], d["popped"] = tuple(todo), i, elements, -1
    gathers.append(g)
    issued.append(d)  # ``popped`` written at its last wait
    if len(todo) == 1:  # _all_gather_sequential: param.data is the padded buffer
        own[todo[0]] = elements
        handles.append([todo, 0, 1, False, copied])
    else:  # _all_gather_dtype: one flat buffer; wait() copies each parameter out
        handles.append([todo, elements, len(todo), False, copied])
        flat += elements
    for p in todo:
        status[p], registry[p] = INFLIGHT, hid
    return avail + copied, flat, mem + elements


def fused_replay(steps: tuple[tuple[bool, int, bool], ...], record: tuple, numels: tuple[int, ...], bucket: int,
                 max_live: int, max_reuse: int, gather: type) -> tuple:
    """``Coordinator.replay`` over ``steps`` (``Stage3Trace.steps``) with the coordinator's ``record``
    (``coordinator._recorded``). Returns ``Stage3Schedule``'s fields in order, each all-gather a ``gather``
    (``coordinator.Stage3Gather``, passed in: coordinator.py imports this module)."""
    modules, persist, padded, queue, uses, before = record[:6]
    n = len(numels)
    status = [AVAILABLE if x else NOT_AVAILABLE for x in persist]
    users, opened, fetched_for, own = [0] * n, [False] * len(modules), [-(10**10)] * n, [0] * n
    registry: dict[int, int] = {}
    handles, issued, calls, regathered, gathers = [], [], [0, 0, 0, 0], [], []
    state = (status, registry, handles, issued, own, calls, regathered, gathers, gather)
    gathered, highs, buffers = [], [], []
    step = at = avail = mem = flat = forward_peak = backward_peak = 0
    end = len(queue) if bucket > 0 else 0  # no prefetch at bucket 0 (or below)
    for i, (is_fetch, m, backward) in enumerate(steps):
        high = mem
        params = modules[m]
        if is_fetch:
            if params:
                for p in params:
                    if status[p] == NOT_AVAILABLE:  # all_gather takes the ones not available: one call
                        todo = sorted([q for q in params if status[q] == NOT_AVAILABLE])
                        avail, flat, mem = _issue(todo, i, state, numels, padded, backward, avail, flat, mem)
                        high = mem if mem > high else high
                        break
                if not opened[m]:
                    opened[m] = True
                    for p in params:
                        users[p] += 1
                for p in params:
                    if p in registry:  # Coordinator.wait
                        hid = registry.pop(p)
                        h = handles[hid]
                        if not h[3]:
                            h[3] = True
                            for q in h[0]:
                                status[q] = AVAILABLE
                            if h[1]:
                                for q in h[0]:
                                    own[q] = numels[q]
                                mem += h[4]
                                high = mem if mem > high else high
                        h[2] -= 1
                        if h[2] == 0:
                            issued[hid]["popped"] = i
                            mem -= h[1]
                            flat -= h[1]
                for p in params:
                    if fetched_for[p] < step:  # Coordinator.pop_expected: these leave the queue
                        at = _pop_expected(queue, at, [q for q in params if fetched_for[q] < step], fetched_for, step)
                        break
            limit = min(max_live - avail, bucket)
            if limit > 0 and at < end:  # else Coordinator.prefetch takes nothing
                at, chosen, numel = _prefetch(queue, at, limit, status, numels, fetched_for)
                if numel:
                    avail, flat, mem = _issue(sorted(chosen), i, state, numels, padded, backward, avail, flat, mem)
                    high = mem if mem > high else high
            step += 1
        else:
            if params and opened[m]:
                opened[m] = False
                for p in params:
                    users[p] -= 1
            reach = before[step] + max_reuse
            for p in params:  # __params_to_release, then __release_param
                if status[p] == AVAILABLE and not users[p] and not persist[p] and fetched_for[p] <= step:
                    u = uses[p]
                    k = bisect_left(u, step)
                    if not (k < len(u) and before[u[k]] < reach):
                        status[p] = NOT_AVAILABLE
                        mem -= own[p]
                        avail -= numels[p]
        gathered.append(mem)
        highs.append(high)
        buffers.append(flat)
        if backward:
            if high > backward_peak:
                backward_peak = high
        elif high > forward_peak:
            forward_peak = high
    return (tuple(gathered), tuple(highs), forward_peak, backward_peak, tuple(regathered), *calls, tuple(buffers),
            tuple(gathers))  # fmt: skip
