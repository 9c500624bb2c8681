"""Measurements that do not trust the runtime's bookkeeping: memory per phase and collectives per step.

- Memory on CPU: ``torch.distributed._tools.mem_tracker.MemTracker`` sees every storage created under it
  at dispatch level (and storage resizes), so its running total is every live tensor byte, whatever the
  runtime thinks it holds. On CUDA: the caching allocator's ``memory_allocated`` and
  ``max_memory_allocated`` (which round each block up to 512 bytes), less what was allocated before the
  probe started; cuBLAS workspaces (allocated through the same allocator, one per handle) are released
  before each step-boundary reading, so they count in phase peaks but not in model states.
- Traffic: a ``TorchDispatchMode`` sees every ``torch.ops.c10d`` call with its tensors and records what
  it observes per call: the collective, its full size in elements, the dtype, the phase and the step.
  Nothing is converted to bytes here: the comparison with the planner is in elements
  (``validate.report``); bytes on the wire are measured separately (``--wire``, the profiler's events).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from validate.compare import RESERVED_PREFIX  # the breakdown key of max_memory_reserved per phase

PHASES = ("init", "forward", "backward", "optimizer step")

# c10d op -> (collective, index of the argument holding the full-size tensor(s))
C10D_OPS = {
    "allreduce_": ("all-reduce", 0),
    "_reduce_scatter_base_": ("reduce-scatter", 1),
    "_allgather_base_": ("all-gather", 0),
    "alltoall_base_": ("all-to-all", 0),  # all_to_all_single (ZeRO++ qgZ): the output, the size of the input
}


@dataclass(frozen=True)
class CommCall:
    """One collective as observed at dispatch: which one, its full size in elements, dtype, phase, step."""

    op: str  # "all-reduce", "reduce-scatter", "all-gather", or the c10d op name of any other collective
    phase: str
    step: int
    elements: int
    dtype: str
    group_size: int | None = None  # ranks of the process group it ran on (None: not readable at dispatch)


def _group_size(args) -> int | None:
    """Size of the process group a c10d op was dispatched on (a ScriptObject there; ``ProcessGroup.unbox``)."""
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except (AttributeError, RuntimeError):
                return None
    return None


class CommCounter(TorchDispatchMode):
    """Records every ``c10d`` op dispatched while active, tagged with ``phase`` and ``step``."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.step = "setup", -1
        self.calls: list[CommCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            op, at = C10D_OPS.get(name, (name, 0))
            arg = args[at] if args else None
            tensors = list(arg) if isinstance(arg, (list, tuple)) else [arg]
            tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
            elements = sum(t.numel() for t in tensors)
            dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "?"
            self.calls.append(CommCall(op, self.phase, self.step, elements, dtype, _group_size(args)))
        return func(*args, **(kwargs or {}))


def _tracker():
    """A MemTracker that keeps only the whole-process peak: its per-module peaks (unused here) cost a walk
    over every module on every op, a third of the time of a simulated 1B-parameter step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class GlobalPeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    return GlobalPeakTracker()


def _clear_cublas_workspaces() -> None:
    # cuBLAS workspaces come from the caching allocator and outlive the matmul that made them.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize()
        clear()


def _reset_tracker_peak(tracker) -> None:
    # MemTracker has no public per-phase reset; its peak is these two fields (torch 2.4-2.13).
    snap = tracker.get_tracker_snapshot("current")
    tracker._peak_mem_snap = snap
    tracker._peak_mem = {dev: s["Total"] for dev, s in snap.items()}


def _on_devices(snapshot: dict) -> list[dict]:
    """MemTracker's per-device snapshots, less the meta device: a meta tensor has a size but no memory
    (FSDP2's meta-device init builds the whole model there before ``to_empty``)."""
    return [s for dev, s in snapshot.items() if torch.device(dev).type != "meta"]


class MemoryProbe:
    """Live bytes at step boundaries and the peak of each phase, on CPU (MemTracker) or CUDA (allocator)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.tracker = None
        self.peaks: dict[str, int] = {}
        self.reserved_peaks: dict[str, int] = {}  # CUDA: max_memory_reserved per phase (largest over steps)
        self._phase: str | None = None
        self.baseline = 0  # CUDA: bytes allocated before the probe started
        self._settled: int | None = None  # the last settled step-boundary reading
        self.recording = False  # CUDA allocator history for validate.cuda_snapshot (ZEROPLAN_CUDA_SNAPSHOT)

    def __enter__(self) -> MemoryProbe:  # noqa: PYI034 - typing.Self needs Python 3.11
        if self.cuda:
            from validate.cuda_snapshot import start_recording

            self.recording = start_recording()  # ZEROPLAN_CUDA_SNAPSHOT set: the allocator's history, by site
            _clear_cublas_workspaces()  # left by earlier work (the parity reference); not ours
            torch.cuda.synchronize()
            # segments cached by earlier rows of this process are returned, so that this row's reserved bytes
            # start from what is live, as the allocator model's replay does (zeroplan.allocator.reserved)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            self.tracker = _tracker()
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)
        if self.recording:
            from validate.cuda_snapshot import stop_recording

            stop_recording()

    def current_bytes(self) -> int:
        """Live bytes; on CUDA including the library workspaces the step keeps (``release_workspaces``)."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated() - self.baseline
        return sum(s["Total"] for s in _on_devices(self.tracker.get_tracker_snapshot("current")))

    def settled_bytes(self, wait_s: float = 2.0, poll_s: float = 0.002, polls: int = 3) -> int:
        """``current_bytes`` once no collective's temporary is still held; sleeps only when needed.

        gloo's worker thread drops its reference to a finished collective's tensors a moment after
        ``wait()`` has returned, so a temporary passed to the step's last collective can still be alive
        for that moment. A reading equal to the last settled one has nothing in flight (a late
        temporary only adds bytes) and is returned at once: from the second step on, a steady runtime
        is read without sleeping. Otherwise the reading is repeated ``poll_s`` apart until ``polls``
        readings agree (at most ``wait_s``).
        """
        import time

        last = self.current_bytes()
        if last == self._settled:
            return last
        same, deadline = 0, time.monotonic() + wait_s
        while same < polls and time.monotonic() < deadline:
            time.sleep(poll_s)
            now = self.current_bytes()
            same = same + 1 if now == last else 0
            last = now
        self._settled = last
        return last

    def release_workspaces(self) -> int:
        """CUDA: free the cuBLAS / cuBLASLt workspaces and return the bytes that freed (0 on CPU).

        They are left alone while the steps run, so each phase's peak holds them as an unprobed run does
        (``zeroplan.formulas.cuda_workspaces``); called once after the last step, the bytes it frees
        are the measured workspace, which the step-boundary readings subtract to give tensors alone.
        """
        if not self.cuda:
            return 0
        before = self.current_bytes()
        _clear_cublas_workspaces()
        return before - self.current_bytes()

    def breakdown(self) -> dict[str, int]:
        """MemTracker's own split of the live bytes on CPU; on CUDA the allocator's own counters."""
        if self.cuda:
            stats = torch.cuda.memory_stats()
            # requested: what the tensors asked for (torch >= 2.1); allocated - requested is the allocator's
            # rounding and the blocks it handed out whole (validate.cuda_snapshot.slack_bytes)
            keys = ("allocated_bytes.all.current", "requested_bytes.all.current", "reserved_bytes.all.peak",
                    "num_alloc_retries", "num_ooms")
            # max_memory_reserved per phase (reset per phase and per row): measured_reserved_bytes_by_phase
            by_phase = {f"{RESERVED_PREFIX}{p}": b for p, b in self.reserved_peaks.items()}
            return {**{k: stats[k] for k in keys if k in stats}, **by_phase}
        out: dict[str, int] = {}
        for snap in _on_devices(self.tracker.get_tracker_snapshot("current")):
            for key, value in snap.items():
                name = getattr(key, "value", key)
                out[name] = out.get(name, 0) + value
        return {k: v for k, v in out.items() if v}

    def _peak_bytes(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return sum(s["Total"] for s in _on_devices(self.tracker.get_tracker_snapshot("peak")))

    def phase(self, name: str | None) -> None:
        """Close the open phase (keeping its largest peak over steps) and open ``name``."""
        if self._phase is not None:
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), self._peak_bytes())
            if self.cuda:  # reserved bytes are the allocator's own (no baseline: segments, not tensors)
                reserved = torch.cuda.max_memory_reserved()
                self.reserved_peaks[self._phase] = max(self.reserved_peaks.get(self._phase, 0), reserved)
        self._phase = name
        if name is not None:
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            else:
                if name == "forward":  # its per-module stats refuse a second forward otherwise
                    self.tracker.reset_mod_stats()
                _reset_tracker_peak(self.tracker)


def loopback_tx_bytes() -> int:
    """Bytes sent on ``lo`` so far, from ``/proc/net/dev`` (of this process's network namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])  # receive: 8 fields, then transmit bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


# Backend-level events of the profiler: gloo names its algorithms ("gloo:all_reduce" ...), NCCL wraps each
# collective in "record_param_comms" (with message sizes) and "nccl:*" events.
PROFILED_PREFIXES = ("gloo:", "nccl:", "record_param_comms")


class ProfiledComms:
    """A second, backend-level view of the traffic: the profiler's communication events of one step.

    gloo records the algorithm it actually runs (a reduce-scatter shows up as ``gloo:all_reduce`` of
    the full buffer); NCCL records ``record_param_comms`` with message sizes. Events are kept as the
    profiler gives them (name, input shapes, scalar inputs) and summed per name.
    """

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self.summary: dict[str, dict] = {}

    def __enter__(self) -> ProfiledComms:  # noqa: PYI034 - typing.Self needs Python 3.11
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        for event in self._profile.events():
            if not event.name.startswith(PROFILED_PREFIXES):
                continue
            row = self.summary.setdefault(event.name, {"calls": 0, "input_numel": 0, "examples": []})
            row["calls"] += 1
            row["input_numel"] += sum(math.prod(s) for s in event.input_shapes if s)
            if len(row["examples"]) < 2:
                scalars = [
                    x for x in getattr(event, "concrete_inputs", []) or [] if isinstance(x, (int, float, str))
                ]
                row["examples"].append({"input_shapes": event.input_shapes, "scalars": scalars})
