"""Replay an ordered allocation trace through the allocator model: allocated and reserved, current and peak,
per phase, and the segments it ends with.

A trace is a sequence of events, each an ``Event`` or a plain tuple ``(action, id, size, stream)``:

- ``("alloc", id, size, stream)``: a tensor of ``size`` bytes on ``stream`` (0: the default stream);
- ``("free", id)``: the tensor is dropped and its block cached at once;
- ``("free_requested", id)`` / ``("free_completed", id)``: the same in two steps, for a block another
  stream still uses (``recordStream``): ``allocated`` falls at the first, the block is reusable at the second;
- ``("phase", name)``: a new phase starts; peaks are reset to the current values
  (``torch.cuda.reset_peak_memory_stats``) and the phase's peaks recorded when the next one starts;
- ``("empty_cache",)``: ``torch.cuda.empty_cache()``;
- ``("segment_free", address)``: one recorded ``cudaFree`` (a replayed snapshot's ``segment_free``).

The first ``alloc`` that cannot get memory (``capacity_bytes``) stops the replay: ``oom`` says where.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from zeroplan.allocator.blocks import Block, SegmentInfo
from zeroplan.allocator.caching import CachingAllocator, OutOfMemory
from zeroplan.allocator.config import NO_LIMIT, AllocatorConfig
from zeroplan.allocator.gc_pause import gc_paused
from zeroplan.allocator.plain_loop import plain_allocs, plain_events, plain_frees
from zeroplan.allocator.runs import alloc_runs, fast_forward

ACTIONS = ("alloc", "free", "free_requested", "free_completed", "phase", "empty_cache", "segment_free")


class Event(NamedTuple):
    """One step of a trace (see the module docstring); ``segment_address``: where a recorded trace's new
    segment went, so that ties between equal-size blocks break as on the GPU."""

    action: str
    id: object = None
    size: int = 0
    stream: int = 0
    segment_address: int | None = None


@dataclass(frozen=True)
class PhasePeak:
    """``max_memory_allocated`` and ``max_memory_reserved`` over one phase (bytes, whole blocks / segments)."""

    allocated_bytes: int
    reserved_bytes: int
    requested_bytes: int


@dataclass(frozen=True)
class Replay:
    """What the allocator model ends with after a trace."""

    allocated_bytes: int
    allocated_peak_bytes: int
    reserved_bytes: int
    reserved_peak_bytes: int
    requested_bytes: int
    requested_peak_bytes: int
    phases: dict[str, PhasePeak]
    segments: tuple[SegmentInfo, ...]
    segment_log: tuple[tuple[str, int, int, int], ...]
    """Every ``segment_alloc`` / ``segment_free`` / ``segment_map`` / ``segment_unmap`` in order:
    (action, address, bytes, stream)."""
    addresses: tuple[tuple[object, int], ...] = ()
    """(id, address the model gave it) of every ``alloc`` in order (a replayed snapshot's ids are the recorded
    addresses, so any difference is a block placed elsewhere)."""
    oom: tuple[int, int] | None = None
    """(index of the event, bytes requested) of the allocation that ran out of memory; None if none did."""
    num_alloc_retries: int = 0

    def segment_sizes(self) -> list[int]:
        """Bytes of each ``cudaMalloc`` (``segment_alloc``) or expandable-segment mapping (``segment_map``), in order."""
        return [size for action, _, size, _ in self.segment_log if action in ("segment_alloc", "segment_map")]


_ACTIONS = frozenset(ACTIONS)
_SIZE = itemgetter(2)  # an event's size


def _event(raw) -> Event:
    event = raw if isinstance(raw, Event) else Event(*raw)
    if event.action not in _ACTIONS:
        raise ValueError(f"trace event {tuple(raw)!r}: action must be one of {', '.join(ACTIONS)}")
    if event.action == "alloc" and (not isinstance(event.size, int) or event.size <= 0):
        raise ValueError(f"trace event {tuple(raw)!r}: an alloc needs a size > 0 bytes")
    return event


def _run_events(raws: Sequence) -> Sequence[Event]:
    """``[_event(raw) for raw in raws]`` for a run (``alloc_runs``: allocs of one size and stream): a run of
    ``Event``s is its own answer once its size is checked (a trace's runs hold ~half its events)."""
    if set(map(type, raws)) == {Event} and set(map(type, map(_SIZE, raws))) == {int} and raws[0].size > 0:
        return raws  # every one an ``Event`` of an int size (equal: ``alloc_runs``), checked in C
    return [_event(raw) for raw in raws]


class _Run:
    """The state of one replay: the allocator, live blocks by id, phase bookkeeping."""

    def __init__(self, config: AllocatorConfig, capacity_bytes: int | None) -> None:
        self.alloc = CachingAllocator(config, capacity_bytes)
        self.live: dict[object, Block] = {}
        self.addresses: list[tuple[object, int]] = []
        self.phases: dict[str, PhasePeak] = {}
        self.phase: str | None = None
        self.overall = [0, 0, 0]  # whole-trace peaks of allocated, reserved, requested (phases reset the stats')
        self.fast_step = self.step  # ``step`` of an ``Event``, through ``_plain_steps`` where it applies (``runs``)
        self.plain = False  # ``_plain_steps`` applies: no memory limit, no ``max_split_size`` (``runs.take_cached``)
        self.details = True  # ``addresses`` kept

    def _fold_overall(self) -> None:
        s = self.alloc.stats
        self.overall = [max(o, p) for o, p in zip(self.overall, (s.allocated.peak, s.reserved.peak, s.requested.peak))]

    def close_phase(self) -> None:
        if self.phase is not None:
            s, old = self.alloc.stats, self.phases.get(self.phase)
            peak = PhasePeak(s.allocated.peak, s.reserved.peak, s.requested.peak)
            if old is not None:  # a phase that comes back (the next step's forward) keeps its largest peak
                peak = PhasePeak(*(max(a, b) for a, b in zip(
                    (old.allocated_bytes, old.reserved_bytes, old.requested_bytes),
                    (peak.allocated_bytes, peak.reserved_bytes, peak.requested_bytes))))  # fmt: skip
            self.phases[self.phase] = peak

    def step(self, event: Event) -> None:
        a = self.alloc
        if event.action == "alloc":
            if event.id in self.live:
                raise ValueError(f"trace event alloc {event.id!r}: that id is still live")
            block = a.malloc(event.size, event.stream, event.segment_address)
            self.live[event.id] = block
            self.addresses.append((event.id, block.address))
        elif event.action in ("free", "free_requested"):
            block = self.live.get(event.id) if event.action == "free_requested" else self.live.pop(event.id, None)
            if block is None or not block.allocated:
                raise ValueError(f"trace event {event.action} {event.id!r}: no live allocation has that id")
            a.free_requested(block, pending=event.action == "free_requested")
        elif event.action == "free_completed":
            block = self.live.pop(event.id, None)
            if block is None:
                raise ValueError(f"trace event free_completed {event.id!r}: no allocation has that id")
            a.free_completed(block)
        elif event.action == "phase":
            self.close_phase()
            self._fold_overall()
            self.phase = str(event.id)
            a.stats.reset_peaks()
        elif event.action == "empty_cache":
            a.empty_cache()
        else:
            a.release_segment(int(event.id))


def replay(events: Iterable, config: AllocatorConfig = AllocatorConfig(), capacity_bytes: int | None = None,
           details: bool = True, runs: dict[int, int] | None = None) -> Replay:  # fmt: skip
    """Run ``events`` through a fresh allocator (``config``; ``capacity_bytes``: what ``cudaMalloc`` can get);
    ``details`` False leaves ``segments``, ``segment_log`` and ``addresses`` empty (the peaks are all a plan
    reads, and listing ~2,000 segments' blocks cost a tenth of its replay); ``runs``: ``alloc_runs(events)``
    where the caller knows it (``AllocTrace.runs``), None: found here."""
    with gc_paused():
        return _replay(events, config, capacity_bytes, details, runs)


def _replay(events: Iterable, config: AllocatorConfig, capacity_bytes: int | None, details: bool,
            known: dict[int, int] | None) -> Replay:  # fmt: skip
    run, oom = _Run(config, capacity_bytes), None
    events = events if isinstance(events, (list, tuple)) else list(events)
    # runs of equal allocations settle into a fixed pattern, copied once proved (``runs``: no memory limit)
    runs = ({} if capacity_bytes is not None else alloc_runs(events) if known is None else dict(known))
    plain = capacity_bytes is None and config.max_split_size_bytes == NO_LIMIT
    run.plain, run.details = plain, details
    if plain:
        run.fast_step = _plain_steps(run, config.expandable_segments)
    index, count = 0, len(events)
    if plain:  # no memory limit: no ``OutOfMemory`` to stop at
        _plain_loop(run, events, runs)
        index = count
    live, addresses, malloc, release = run.live, run.addresses, run.alloc.malloc, run.alloc.free_requested
    while index < count:
        length = runs.get(index)
        if length and fast_forward(run, _run_events(events[index:index + length])):
            index += length
            continue
        event = events[index]
        try:
            # ``run.step(_event(event))`` inlined for a well-formed ``Event`` alloc or free (most of a trace);
            # anything else, and every error, goes through ``step``
            if type(event) is Event and event.action == "alloc" and type(event.size) is int and event.size > 0 \
                    and event.id not in live:
                block = live[event.id] = malloc(event.size, event.stream, event.segment_address)
                addresses.append((event.id, block.address))
            elif type(event) is Event and event.action == "free" and event.id in live and live[event.id].allocated:
                release(live.pop(event.id), pending=False)
            else:
                run.step(_event(event))
        except OutOfMemory as exc:
            oom = (index, exc.size)
            break
        index += 1
    run.close_phase()
    run._fold_overall()
    s, (allocated, reserved, requested) = run.alloc.stats, run.overall
    segments, log, addresses = (run.alloc.segment_infos(), tuple(run.alloc.log), tuple(run.addresses)) if details \
        else ((), (), ())
    return Replay(s.allocated.current, allocated, s.reserved.current, reserved, s.requested.current,
                  requested, run.phases, segments, log, addresses, oom, s.num_alloc_retries)  # fmt: skip


def _plain_loop(run: _Run, events: Sequence, runs: dict[int, int]) -> None:
    """``_replay``'s loop where ``_plain_steps`` applies (no memory limit): the events between two runs
    (``alloc_runs``) through ``plain_loop`` (an ``Event``) or ``_Run.step``; each run fast-forwarded, or, when
    ``fast_forward`` refuses it, replayed with the events after it (a speed-up, no rule: the same calls in the
    same order as the loop in ``_replay``, without its per-event run look-up). A run whose last alloc is freed
    next (FSDP2: 723 of 11,927,020 B) is left to the part after it, where ``plain_loop.walk`` serves it with its
    frees when cached blocks can (expandable segments too, where no page is mapped), else ``fast_forward``:
    tests/test_allocator_balanced.py, tests/test_allocator_expandable_walk.py."""
    generic, index, expandable = run.step, 0, run.alloc.config.expandable_segments
    for start in (*sorted(runs), len(events)):
        length = runs.get(start)
        if length and _freed_next(events, start + length):
            continue  # a run whose last alloc is freed next: in the part after, where ``balanced`` may serve it
        part = events[index:start]
        if set(map(type, part)) <= {Event}:  # a trace's (``step_trace``): the loop with both steps inlined
            plain_events(run, part, expandable, generic, _event)
            part = ()
        for event in part:
            if type(event) is Event:
                run.fast_step(event)
            else:
                generic(_event(event))
        if length and fast_forward(run, _run_events(events[start:start + length])):
            index = start + length
        else:
            index = start


def _freed_next(events: Sequence, end: int) -> bool:
    """Whether the event at ``end`` frees the one before it (an ``Event`` alloc)."""
    if end >= len(events):
        return False
    last, after = events[end - 1], events[end]
    return type(after) is Event and after.action == "free" and after.id == last.id


def _plain_steps(run: _Run, expandable: bool) -> Callable[[Event], None]:
    """``run.step`` of one ``Event`` without a memory limit and with ``max_split_size`` unset (no oversize rule, no
    garbage collection, no retry), where ``CachingAllocator.malloc`` / ``free`` reduce to best fit, split and merge:
    the loop's own free and alloc (``plain_loop``), on one event, for ``fast_forward``'s requests one by one; anything
    else through ``run.step`` (a speed-up, no rule: tests/test_allocator_replay.py compares it with the
    request-by-request replay)."""
    generic = run.step

    def step(event: Event) -> None:
        (plain_frees if event[0] == "free" else plain_allocs)(run, (event,), expandable, generic, _event)

    return step
