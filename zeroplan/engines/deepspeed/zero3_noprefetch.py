"""ZeRO-3's coordinator replay without prefetching (``stage3_prefetch_bucket_size`` 0), straight from its record
(``coordinator._recorded``): a speed-up, no rule. The general replay (``coordinator.Coordinator``) gives the very
same schedule; tests/test_deepspeed_coordinator_fast.py compares every field on random and real traces.

Without a prefetch each fetch all-gathers the module's own parameters that are not gathered yet (one call, its
handle issued and popped at that fetch: every parameter it gathers is one the fetch then waits for), and nothing
is in flight between events: no registry, no prefetch queue, no flat buffer open after an event, and no
parameter fetched for a later step (``__most_recent_step_id_param_fetched_for`` is never past the current step:
the queue pops exactly the module's parameters at its step). Persistent parameters are always available and never
freed: only the others are followed. A parameter is in use (``ds_active_sub_modules``) while a module holding it
is between its fetch and its release: counted per parameter, a module's fetch and release counted once each."""

from __future__ import annotations

from bisect import bisect_left


def noprefetch_replay(steps: tuple[tuple[bool, int, bool], ...], gathered_by: tuple[tuple[int, ...], ...],
                      numels: tuple[int, ...], padded: list[int], uses: dict[int, list[int]], before: list[int],
                      max_reuse: int, gather: type) -> tuple:
    """The replay of ``steps`` (``Stage3Trace.steps``) with no prefetch; ``gathered_by[m]``: module ``m``'s
    non-persistent parameters, ascending. Returns ``Stage3Schedule``'s fields in order, each all-gather a
    ``gather`` (``coordinator.Stage3Gather``, passed in), its fields written as its ``__init__`` writes them."""
    n = len(numels)
    available = [False] * n  # non-persistent parameters: AVAILABLE (else NOT_AVAILABLE; never INFLIGHT after an event)
    users = [0] * n  # modules holding the parameter between their fetch and release
    opened = [False] * len(gathered_by)
    own = [0] * n  # elements a gathered parameter holds: its padded buffer (alone in its call) or its own numel
    gathered, highs, issued, regathered = [], [], [], []
    calls = [0, 0, 0, 0]  # forward calls, elements, backward calls, elements
    mem = step = forward_peak = backward_peak = 0
    new = object.__new__
    for i, (is_fetch, m, backward) in enumerate(steps):
        high = mem
        ps = gathered_by[m]
        if is_fetch:
            if ps:
                if len(ps) == 1:  # most modules: one parameter (no list made)
                    todo = () if available[ps[0]] else ps
                else:
                    todo = [p for p in ps if not available[p]]
                if todo:
                    elements = padded[todo[0]] if len(todo) == 1 else sum(map(padded.__getitem__, todo))
                    at = 2 if backward else 0
                    calls[at] += 1
                    calls[at + 1] += elements
                    if backward:
                        regathered += todo
                    g = new(gather)
                    d = g.__dict__
                    d["params"], d["issued"], d["elements"], d["popped"] = tuple(todo), i, elements, i
                    issued.append(g)
                    if len(todo) == 1:  # _all_gather_sequential: the parameter is its padded buffer
                        p = todo[0]
                        own[p] = elements
                        mem += elements
                        high = mem if mem > high else high
                    elif elements:  # one flat buffer, each parameter copied out, the buffer freed at the last wait
                        copied = 0
                        for p in todo:
                            own[p] = numels[p]
                            copied += numels[p]
                        top = mem + elements + copied
                        high = top if top > high else high
                        mem += copied
                    for p in todo:
                        available[p] = True
                if not opened[m]:
                    opened[m] = True
                    for p in ps:
                        users[p] += 1
            step += 1
        elif ps:
            if opened[m]:
                opened[m] = False
                for p in ps:
                    users[p] -= 1
            reach = before[step] + max_reuse
            for p in ps:  # __params_to_release, then __release_param
                if available[p] and not users[p]:
                    u = uses[p]
                    k = bisect_left(u, step)
                    if not (k < len(u) and before[u[k]] < reach):
                        available[p] = False
                        mem -= own[p]
        gathered.append(mem)
        highs.append(high)
        if backward:
            if high > backward_peak:
                backward_peak = high
        elif high > forward_peak:
            forward_peak = high
    return (tuple(gathered), tuple(highs), forward_peak, backward_peak, tuple(regathered), *calls,
            (0,) * len(steps), tuple(issued))  # fmt: skip
