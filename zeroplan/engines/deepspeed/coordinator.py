"""ZeRO-3's ``PartitionedParameterCoordinator`` (runtime/zero/partitioned_param_coordinator.py, 0.19.8)
replayed over a module trace (``trace.py``): which parameters are gathered after each hook, the flat buffers
of coalesced all-gathers still open, and every all-gather call."""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate, chain, compress, count, repeat
from operator import itemgetter

from zeroplan.engines.deepspeed.trace import Stage3Trace
from zeroplan.engines.deepspeed.zero3_noprefetch import noprefetch_replay
from zeroplan.engines.deepspeed.zero3_replay import (AVAILABLE, INFLIGHT, NOT_AVAILABLE, _pop_expected, _prefetch,
                                                     fused_replay)

@dataclass(frozen=True)
class Stage3Gather:
    """One all-gather of the coordinator (partition_parameters.py ``all_gather_coalesced``): the parameters it
    gathers (indices), the event that issued it (a module's own fetch or the prefetch after it), its elements
    (the output: each parameter padded to N_d) and the event whose wait popped its last parameter from the
    inflight registry (its flat buffer, if coalesced, is freed there; -1: still in flight at the end)."""

    params: tuple[int, ...]
    issued: int
    elements: int
    popped: int

    def __init__(self, params: tuple[int, ...], issued: int, elements: int, popped: int) -> None:
        d = self.__dict__  # the dataclass's __init__ without frozen setattr (a 405B replay: ~1,300 calls)
        d["params"], d["issued"], d["elements"], d["popped"] = params, issued, elements, popped


@dataclass(frozen=True)
class Stage3Schedule:
    """What ``stage3_schedule`` found for one steady-state micro-step (elements, on one rank).

    ``gathered[i]``: gathered non-persistent parameter elements after event ``i`` (each parameter's own
    tensor, plus the flat buffer of a coalesced all-gather while one of its parameters is still waiting in
    the inflight registry); ``high[i]``: the most during the event. ``regathered``: parameters all-gathered
    in backward (indices). Calls and elements of the all-gathers, forward and backward, elements as the
    output tensor (each parameter padded to N_d)."""

    gathered: tuple[int, ...]
    high: tuple[int, ...]
    forward_peak: int
    backward_peak: int
    regathered: tuple[int, ...]
    forward_calls: int
    forward_elements: int
    backward_calls: int
    backward_elements: int
    buffers: tuple[int, ...] = ()
    """``buffers[i]``: the part of ``gathered[i]`` that is flat buffers of coalesced all-gathers still open (their
    parameters were copied out at the first wait; the buffer lives until the registry pops the last one)."""
    gathers: tuple[Stage3Gather, ...] = ()
    """every all-gather call, in order."""

    def event(self, trace: Stage3Trace, mark: str) -> int:
        """The first event of ``mark``'s span after which the most is gathered."""
        first, last = trace.span(mark)
        return max(range(first, last + 1), key=lambda i: (self.gathered[i], -i))

    def at(self, trace: Stage3Trace, mark: str) -> int:
        """The most gathered after any event of ``mark``'s span."""
        return self.gathered[self.event(trace, mark)]


def stage3_schedule(trace: Stage3Trace, numels: tuple[int, ...], nd: int, persistence_threshold: int,
                    prefetch_bucket_size: int, max_live_parameters: int, max_reuse_distance: int) -> Stage3Schedule:
    """Replay partitioned_param_coordinator.py ``PartitionedParameterCoordinator`` (0.19.8) over ``trace``."""
    return _stage3_schedule(trace, numels, nd, persistence_threshold, prefetch_bucket_size, max_live_parameters,
                            max_reuse_distance)  # fmt: skip


@lru_cache(maxsize=4)  # read only: every prefetch setting's replay of one trace records the same (a speed-up, no rule)
def _recorded(trace: Stage3Trace, numels: tuple[int, ...], nd: int, threshold: int) -> tuple:
    """``Coordinator``'s record of the first step: each module's parameters as a set (asked at every fetch and
    release), the persistent ones, each parameter's padded share, the prefetch queue, each parameter's uses, the
    elements of the modules before each step (``Coordinator`` reads these six) and each module's non-persistent
    parameters, ascending (``zero3_noprefetch``'s)."""
    modules = [frozenset(ps) for ps in trace.modules]
    persist = [n <= threshold for n in numels]  # parameter_offload.py mark_persistent_parameters
    padded = [-(-n // nd) * nd for n in numels]  # _all_gather_sequential buffer / _all_gather_dtype share
    steps = trace.steps  # record_module: __submodule_order, the fetches' modules (in C: a speed-up, no rule)
    order = list(compress(map(itemgetter(1), steps), map(itemgetter(0), steps)))
    # record_parameters: __param_order, each module's parameters sorted by ds_id, with the step it is used at
    ordered = [sorted(ps) for ps in modules]
    at_step = list(map(ordered.__getitem__, order))
    queue = list(zip(chain.from_iterable(at_step), chain.from_iterable(map(repeat, count(), map(len, at_step)))))
    uses: dict[int, list[int]] = defaultdict(list)
    for p, step in queue:  # each parameter's steps, ascending
        uses[p].append(step)
    uses = dict(uses)  # a parameter never fetched has none (KeyError, as before)
    numel_of = numels.__getitem__
    module_numel = [sum(map(numel_of, ps)) for ps in trace.modules]
    # elements of the modules before step k (__params_to_release counts every parameter)
    before = list(accumulate(map(module_numel.__getitem__, order), initial=0))
    gathered = [not x for x in persist].__getitem__
    gathered_by = tuple([tuple(filter(gathered, ps)) for ps in ordered])  # zero3_noprefetch's
    return modules, persist, padded, queue, uses, before, gathered_by




@dataclass
class _Handle:
    """An ``all_gather_coalesced`` handle: its parameters, its flat buffer's elements (0: one parameter,
    ``_all_gather_sequential``, whose buffer is the parameter), how many still wait in the registry, and
    whether its first wait has run (``wait()`` copies every parameter out of the flat buffer)."""

    params: list[int]
    flat: int
    waiting: int
    done: bool = False


class Coordinator:
    """One rank's ``PartitionedParameterCoordinator`` at the steady state: the parameter order recorded by
    the first step (``record_module``/``record_parameters``) replayed as a prefetch queue, with the memory
    gathered counted in elements (each parameter's own tensor, plus open coalesced flat buffers)."""

    def __init__(self, trace: Stage3Trace, numels: tuple[int, ...], nd: int, threshold: int, bucket: int,
                 max_live: int, max_reuse: int) -> None:
        self.numels, self.bucket = numels, bucket
        self.max_live, self.max_reuse = max_live, max_reuse
        self.modules, self.persist, self.padded, self.queue, self.uses, self.before = _recorded(trace, numels, nd,
                                                                                               threshold)[:6]
        self.status = [AVAILABLE if self.persist[p] else NOT_AVAILABLE for p in range(len(numels))]
        self.active: list[set[int]] = [set() for _ in numels]  # ds_active_sub_modules
        self.fetched_for = [-(10**10)] * len(numels)  # __most_recent_step_id_param_fetched_for
        self.own = [0] * len(numels)  # elements a gathered parameter holds
        self.registry: dict[int, int] = {}  # __inflight_param_registry: parameter -> handle
        self.handles: list[_Handle] = []
        self.issued: list[list] = []  # per call: [params, event, elements, popped]
        self.calls = {True: [0, 0], False: [0, 0]}  # forward phase?: [calls, elements]
        self.regathered: list[int] = []
        self.step = self.next_in_queue = 0
        self.avail = self.mem = self.high = self.flat = self.event = 0  # elements; the event being replayed

    def grow(self, n: int) -> None:
        self.mem += n
        if self.mem > self.high:
            self.high = self.mem

    def all_gather(self, params, forward: bool) -> None:
        """__all_gather_params_ -> all_gather_coalesced; ``forward``: the phase the call is counted in."""
        status = self.status
        todo = sorted([p for p in params if status[p] == NOT_AVAILABLE])
        if not todo:
            return
        padded, numels = self.padded, self.numels
        elements = sum([padded[p] for p in todo])
        self.avail += sum([numels[p] for p in todo])
        self.calls[forward][0] += 1
        self.calls[forward][1] += elements
        if not forward:
            self.regathered.extend(todo)
        hid = len(self.handles)
        self.issued.append([tuple(todo), self.event, elements, -1])
        if len(todo) == 1:  # _all_gather_sequential: param.data is the padded buffer
            self.own[todo[0]] = self.padded[todo[0]]
            self.grow(self.padded[todo[0]])
            self.handles.append(_Handle(todo, 0, 1))
        else:  # _all_gather_dtype: one flat buffer; wait() copies each parameter out (torch.cat)
            self.grow(elements)
            self.flat += elements
            self.handles.append(_Handle(todo, elements, len(todo)))
        for p in todo:
            self.status[p], self.registry[p] = INFLIGHT, hid

    def wait(self, p: int) -> None:
        """fetch_sub_module: ``__inflight_param_registry.pop(param).wait()``."""
        if p not in self.registry:
            return
        hid = self.registry.pop(p)
        h = self.handles[hid]
        if not h.done:
            h.done = True
            status = self.status
            for q in h.params:
                status[q] = AVAILABLE
            if h.flat:
                own, numels = self.own, self.numels
                for q in h.params:  # each copied out in turn (grow's high after each: the same as the sum's)
                    own[q] = numels[q]
                    self.grow(numels[q])
        h.waiting -= 1
        if h.waiting == 0:
            self.issued[hid][3] = self.event
            self.mem -= h.flat
            self.flat -= h.flat

    def free(self, p: int) -> None:
        """__release_param."""
        if self.status[p] == AVAILABLE and not self.active[p] and not self.persist[p]:
            self.status[p] = NOT_AVAILABLE
            self.mem -= self.own[p]
            self.avail -= self.numels[p]

    def released(self, p: int) -> bool:
        """__params_to_release: whether parameter ``p`` of the module being released is not reused within
        ``max_reuse`` elements."""
        step = self.step
        if self.persist[p] or self.fetched_for[p] > step:  # "reuse skipped by prefetch"
            return False
        uses = self.uses[p]
        k = bisect.bisect_left(uses, step)  # its next use in __submodule_order[step_id:]
        return not (k < len(uses) and self.before[uses[k]] - self.before[step] < self.max_reuse)

    def pop_expected(self, params: frozenset[int]) -> None:
        """fetch_sub_module: the module's own parameters leave the head of the queue."""
        fetched_for, step, queue = self.fetched_for, self.step, self.queue
        expected = [p for p in params if fetched_for[p] < step]
        if not expected:
            return
        self.next_in_queue = _pop_expected(queue, self.next_in_queue, expected, fetched_for, step)

    def prefetch(self, forward: bool) -> None:
        """fetch_sub_module: up to ``stage3_prefetch_bucket_size`` elements (and ``max_live_parameters``) of
        the queue, gathered in one call."""
        limit = min(self.max_live - self.avail, self.bucket)
        self.next_in_queue, chosen, numel = _prefetch(self.queue, self.next_in_queue, limit, self.status, self.numels,
                                                      self.fetched_for)
        if numel:
            self.all_gather(chosen, forward)

    def fetch(self, m: int, forward: bool) -> None:
        """fetch_sub_module; ``forward``: the phase (calls counted there)."""
        params = self.modules[m]
        if params:  # a module without parameters gathers, waits for and pops nothing: only its prefetch
            status = self.status
            for p in params:
                if status[p] == NOT_AVAILABLE:  # all_gather takes only these: none, no call
                    self.all_gather(params, forward)
                    break
            active, registry = self.active, self.registry
            for p in params:
                active[p].add(m)
                if p in registry:
                    self.wait(p)
            self.pop_expected(params)
        if self.bucket > 0:
            self.prefetch(forward)
        self.step += 1

    def release(self, m: int) -> None:
        """release_sub_module (a module without parameters releases nothing): each parameter's use by ``m``
        ended, those ``__params_to_release`` names freed (``released`` reads no state ``free`` changes)."""
        active, persist, fetched_for, uses_of, before = self.active, self.persist, self.fetched_for, self.uses, self.before
        step, max_reuse, free = self.step, self.max_reuse, self.free
        for p in self.modules[m]:
            active[p].discard(m)
            # ``released(p)``, inlined (a speed-up: ~4,500 calls per replay)
            if persist[p] or fetched_for[p] > step:
                continue
            uses = uses_of[p]
            k = bisect.bisect_left(uses, step)
            if not (k < len(uses) and before[uses[k]] - before[step] < max_reuse):
                free(p)

    def replay(self, trace: Stage3Trace) -> Stage3Schedule:
        """Every event of ``trace`` in order, and what was gathered after each."""
        gathered, high, buffers = [], [], []
        forward_peak = backward_peak = 0
        fetch, release = self.fetch, self.release
        for i, (is_fetch, module, backward) in enumerate(trace.steps):
            self.high, self.event = self.mem, i
            if is_fetch:
                fetch(module, not backward)
            else:
                release(module)
            gathered.append(self.mem)
            high.append(self.high)
            buffers.append(self.flat)
            if not backward:
                if self.high > forward_peak:
                    forward_peak = self.high
            elif self.high > backward_peak:
                backward_peak = self.high
        return Stage3Schedule(tuple(gathered), tuple(high), forward_peak, backward_peak, tuple(self.regathered),
                              *self.calls[True], *self.calls[False], tuple(buffers),
                              tuple(Stage3Gather(*g) for g in self.issued))  # fmt: skip


@lru_cache(maxsize=256)
def _stage3_schedule(trace: Stage3Trace, numels: tuple[int, ...], nd: int, threshold: int, bucket: int,
                     max_live: int, max_reuse: int) -> Stage3Schedule:
    """``stage3_schedule`` (cached: the planner asks for the same schedule at every candidate): ``Coordinator``'s
    replay, run by ``zero3_noprefetch`` without a prefetch and by ``zero3_replay`` with one (a speed-up, no rule:
    the very same schedule)."""
    record = _recorded(trace, numels, nd, threshold)
    if bucket > 0:
        fields = fused_replay(trace.steps, record, numels, bucket, max_live, max_reuse, Stage3Gather)
    else:
        fields = noprefetch_replay(trace.steps, record[6], numels, record[2], record[4], record[5], max_reuse,
                                   Stage3Gather)  # fmt: skip
    return Stage3Schedule(*fields)
