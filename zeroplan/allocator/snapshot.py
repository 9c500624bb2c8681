"""A recorded ``torch.cuda.memory._snapshot()`` as a trace for the model, and the comparison of the two.

The snapshot format (``torch/cuda/memory.py``: ``_snapshot`` docstring, torch 2.11-2.13): ``segments`` (each
with ``address``, ``total_size``, ``stream``, ``segment_type`` and ``blocks`` of ``address``, ``size``,
``requested_size``, ``state``) and ``device_traces`` (one list per device, recorded while
``torch.cuda.memory._record_memory_history`` was on), whose entries carry ``action``, ``addr``, ``size``
and ``stream``. ``CUDACachingAllocator.cpp`` ``record_trace`` writes, in this order: ``segment_alloc`` (the
new segment's address and bytes) right before the ``alloc`` it serves (address and the *requested*
bytes), ``free_requested`` and ``free_completed`` (address), ``segment_free`` on ``cudaFree``,
``segment_map`` / ``segment_unmap`` for expandable segments, ``snapshot`` each time one is taken, ``oom``.

A replay is exact only if the history starts at an empty allocator (record from the process start, with
``max_entries`` above the number of events): a free of an address never allocated in the trace is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.allocator.replay import Event, Replay

TRACE_KEYS = ("action", "addr", "size", "stream")
"""What a compact trace entry keeps (frames and timestamps dropped)."""


def compact(snapshot: dict, device: int = 0) -> dict:
    """The parts of a snapshot the model replays and compares, without stacks: small enough to commit."""
    traces = snapshot.get("device_traces") or [[]]
    trace = [{k: e[k] for k in TRACE_KEYS if k in e} for e in traces[device]]
    segments = [{"address": s["address"], "total_size": s["total_size"], "stream": s.get("stream", 0),
                 "segment_type": s.get("segment_type", "large"), "is_expandable": bool(s.get("is_expandable")),
                 "blocks": [{k: b.get(k, 0) for k in ("address", "size", "requested_size", "state")}
                            for b in s.get("blocks", [])]}
                for s in snapshot.get("segments", []) if s.get("device", device) == device]  # fmt: skip
    return {"segments": segments, "device_traces": [trace]}


def trace_events(snapshot: dict, device: int = 0, phases: list[str] | None = None) -> list[Event]:
    """The snapshot's recorded history as replay events; its ``snapshot`` entries become ``phase`` events named
    by ``phases`` in order (when given), so that peaks are compared phase by phase."""
    events: list[Event] = []
    live: set[int] = set()
    new_segment: int | None = None
    names = iter(phases or ())
    for entry in (snapshot.get("device_traces") or [[]])[device]:
        action = entry.get("action")
        if action in ("segment_alloc", "segment_map"):  # where the next alloc's new segment (or pages) went
            new_segment = int(entry["addr"])
        elif action == "alloc":
            address = int(entry["addr"])
            events.append(Event("alloc", address, int(entry["size"]), int(entry.get("stream", 0)), new_segment))
            live.add(address)
            new_segment = None
        elif action in ("free_requested", "free_completed"):
            address = int(entry["addr"])
            if address not in live:
                raise ValueError(f"trace entry {action} at {address:#x}: allocated before the recording started "
                                 "(record from the process start, with max_entries above the event count)")  # fmt: skip
            events.append(Event(action, address))
            if action == "free_completed":
                live.discard(address)
        elif action == "segment_free":
            events.append(Event("segment_free", int(entry["addr"])))
        elif action == "snapshot" and phases is not None:
            name = next(names, None)
            if name is not None:
                events.append(Event("phase", name))
    return events


def recorded_segment_sizes(snapshot: dict, device: int = 0) -> list[int]:
    """Bytes of each recorded ``segment_alloc`` (``cudaMalloc``) or ``segment_map`` (expandable pages), in order."""
    trace = (snapshot.get("device_traces") or [[]])[device]
    return [int(e["size"]) for e in trace if e.get("action") in ("segment_alloc", "segment_map")]


@dataclass(frozen=True)
class Comparison:
    """Where a replay and the recording differ (empty tuples: they agree)."""

    segment_sizes: tuple[tuple[int, int | None, int | None], ...]  # (index, recorded, model) of each cudaMalloc
    addresses: tuple[tuple[int, int], ...]  # (recorded address, model address) of allocs placed elsewhere
    final_segments: tuple[str, ...]  # segments of the final snapshot the model does not hold as recorded

    @property
    def exact(self) -> bool:
        return not (self.segment_sizes or self.addresses or self.final_segments)


def compare(snapshot: dict, result: Replay, device: int = 0) -> Comparison:
    """Segment by segment: each ``cudaMalloc``'s bytes, each block's address, the final segments' blocks."""
    recorded, model = recorded_segment_sizes(snapshot, device), result.segment_sizes()
    n = max(len(recorded), len(model))
    recorded, model = recorded + [None] * (n - len(recorded)), model + [None] * (n - len(model))
    sizes = tuple((i, r, m) for i, (r, m) in enumerate(zip(recorded, model)) if r != m)
    moved = tuple((a, m) for a, m in result.addresses if isinstance(a, int) and a != m)
    ours = {s.address: [(b.address, b.size, b.state) for b in s.blocks] for s in result.segments}
    differ = []
    for seg in snapshot.get("segments", []):
        theirs = [(b["address"], b["size"], b["state"]) for b in seg.get("blocks", [])]
        if ours.get(seg["address"]) != theirs:
            differ.append(f"segment {seg['address']:#x} ({seg['total_size']:,} B): recorded {len(theirs)} blocks, "
                          f"model {len(ours.get(seg['address'], []))}")  # fmt: skip
    return Comparison(sizes, moved, tuple(differ))
