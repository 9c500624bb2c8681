"""Where the live CUDA bytes of a reading come from: the caching allocator's own record, by allocation site.

A diagnostic for the CUDA-only residuals of FSDP2 (docs/validate.md "On a GPU"): a step-boundary reading
says how many bytes are live, not which tensors. With ``ZEROPLAN_CUDA_SNAPSHOT=DIR`` in the environment,
``validate.probes.MemoryProbe`` records the allocator's history on CUDA
(``torch.cuda.memory._record_memory_history``, Python stacks) and the FSDP2 runner writes the allocator's
snapshot (``torch.cuda.memory._snapshot``) at each reading of the last step as ``DIR/<reading>.pickle``.
Nothing changes without the variable, and nothing on CPU. ``python -m validate.cuda_snapshot DIR`` prints,
per snapshot, the live bytes grouped by where they were allocated (``live_by_site``, pure), so a residual
names its allocation site; the pickles open in https://pytorch.org/memory_viz as well.

Whole-process history for the allocator model (``zeroplan.allocator``, docs/allocator.md): with
``ZEROPLAN_CUDA_HISTORY=DIR``, ``record_process_history`` (called at interpreter start by the
``sitecustomize.py`` that ``validate/gpu_check.sh`` puts on ``PYTHONPATH``, see ``HOOK``) records every
allocator event of the process from its first CUDA allocation on, without stacks, and at exit writes
``DIR/<label>_<pid>.json``: the compact snapshot (``zeroplan.allocator.snapshot.compact``), the allocator's
own counters (``torch.cuda.memory_stats``), ``PYTORCH_CUDA_ALLOC_CONF`` and the device's used bytes
(``torch.cuda.mem_get_info``) beside ``memory_reserved``, whose difference is the CUDA context and every
other allocation outside PyTorch (derived). ``python -m validate.cuda_snapshot replay DIR`` replays each
file through the model on any machine, torch not needed, and says whether every segment matches.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

ENV = "ZEROPLAN_CUDA_SNAPSHOT"
HISTORY_ENV = "ZEROPLAN_CUDA_HISTORY"
LABEL_ENV = "ZEROPLAN_CUDA_HISTORY_LABEL"
SNAPSHOT_ENTRIES = 200_000
"""Trace entries ``start_recording`` keeps (it also caps a whole-process history recorded beside it)."""
HISTORY_ENTRIES = 5_000_000
"""Trace entries kept (a ring buffer: more would drop the first ones and the replay would refuse the history)."""
HOOK = "import validate.cuda_snapshot as _z\n_z.record_process_history()\n"
"""The ``sitecustomize.py`` gpu_check.sh writes: every Python process of a step records its history."""
STAT_KEYS = ("allocated_bytes.all.peak", "allocated_bytes.all.current", "reserved_bytes.all.peak",
             "reserved_bytes.all.current", "requested_bytes.all.peak", "requested_bytes.all.current",
             "num_alloc_retries", "num_ooms", "segment.all.peak")  # fmt: skip
OURS = ("torch/distributed", "torch/optim", "torch/nn", "torch/autograd", "torch/utils/checkpoint",
        "validate/", "zeroplan/")  # fmt: skip
"""Frames that say who allocated a block; allocator, dispatch and tensor plumbing frames are skipped."""


def snapshot_dir() -> Path | None:
    """The directory of ``ZEROPLAN_CUDA_SNAPSHOT``, or None when unset or empty."""
    value = os.environ.get(ENV, "")
    return Path(value) if value else None


def start_recording() -> bool:
    """Record the allocator's history (Python stacks) when the variable is set and CUDA is in use."""
    import torch

    if snapshot_dir() is None or not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, stacks="python")
    return True


def stop_recording() -> None:
    """Stop the history ``start_recording`` began."""
    import torch

    torch.cuda.memory._record_memory_history(enabled=None)


def dump(label: str) -> None:
    """Write the allocator's snapshot as ``<dir>/<label>.pickle`` (when recording)."""
    import torch

    directory = snapshot_dir()
    if directory is None or not torch.cuda.is_available():
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{label}.pickle", "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)


def _short(filename: str) -> str | None:
    """``filename`` from the first ``OURS`` part on (``torch/optim/adam.py``), None when it has none."""
    found = [filename.find(part) for part in OURS if part in filename]
    return filename[min(found):] if found else None


def _site(frames: list[dict], depth: int) -> str:
    """The first ``depth`` frames (innermost first) in code that allocates on purpose (``OURS``)."""
    kept = [f"{_short(str(f.get('filename', '')))}:{f.get('line', '?')} {f.get('name', '?')}"
            for f in frames if _short(str(f.get("filename", ""))) is not None]  # fmt: skip
    return " <- ".join(kept[:depth]) or "(no Python frame recorded)"


def _live(snapshot: dict) -> list[dict]:
    return [b for seg in snapshot.get("segments", []) for b in seg.get("blocks", []) if b.get("state") == "active_allocated"]


def live_by_site(snapshot: dict, depth: int = 2) -> list[tuple[str, int, int]]:
    """(site, bytes, blocks) of every live block (``active_allocated``) of an allocator snapshot, largest
    first. Bytes are the block sizes the allocator counts in ``memory_allocated`` (rounded to 512 B)."""
    sites: dict[str, list[int]] = {}
    for block in _live(snapshot):
        entry = sites.setdefault(_site(block.get("frames", []), depth), [0, 0])
        entry[0] += int(block.get("size", 0))
        entry[1] += 1
    return sorted(((s, b, n) for s, (b, n) in sites.items()), key=lambda x: -x[1])


def slack_bytes(snapshot: dict) -> tuple[int, int]:
    """(slack over 512-B rounding, blocks carrying it): live block bytes beyond each request rounded up to
    512 B. The allocator hands out a cached large block whole when what would remain is under 1 MiB
    (CUDACachingAllocator.cpp ``should_split``), and ``memory_allocated`` counts the whole block: bytes
    no tensor asked for, which depend on what was freed before."""
    extra = [int(b.get("size", 0)) - -(-int(b.get("requested_size", b.get("size", 0))) // 512) * 512
             for b in _live(snapshot)]  # fmt: skip
    return sum(e for e in extra if e > 0), sum(1 for e in extra if e > 0)


def report(directory: Path, top: int = 15) -> str:
    """Every snapshot of ``directory``: its live bytes and the ``top`` sites."""
    lines = []
    for path in sorted(directory.glob("*.pickle")):
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        sites, (slack, carrying) = live_by_site(snapshot), slack_bytes(snapshot)
        lines.append(f"{path.stem}: {sum(b for _, b, _ in sites):,} B live in {sum(n for *_, n in sites)} blocks; "
                     f"{slack:,} B of them beyond the requests' 512-B rounding, in {carrying} blocks")  # fmt: skip
        lines += [f"  {b:>14,} B {n:>5} blocks  {s}" for s, b, n in sites[:top]]
    return "\n".join(lines)


def record_process_history() -> bool:
    """With ``ZEROPLAN_CUDA_HISTORY`` set and a GPU visible: record the allocator's events from now on (no stacks)
    and write the history at exit. Silent and inert otherwise (on CPU, or without the variable)."""
    directory = os.environ.get(HISTORY_ENV, "")
    if not directory:
        return False
    import atexit

    import torch

    if not torch.cuda.is_available():
        return False

    def start() -> None:  # a recording that cannot start must not stop the run it would have recorded
        try:
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                     max_entries=HISTORY_ENTRIES)  # fmt: skip
        except (RuntimeError, TypeError) as exc:
            print(f"validate.cuda_snapshot: no allocator history: {exc}".splitlines()[0], file=sys.stderr)

    # at CUDA's lazy initialisation, before the first allocation; a process that never touches CUDA records nothing
    torch.cuda._lazy_call(start)
    atexit.register(_write_quietly, Path(directory))
    return True


def _write_quietly(directory: Path) -> None:
    try:
        write_history(directory)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"validate.cuda_snapshot: history not written: {exc}".splitlines()[0], file=sys.stderr)


def write_history(directory: Path) -> Path | None:
    """Write this process's history as ``<label>_<pid>.json`` (nothing when it never allocated on the GPU)."""
    import torch

    from zeroplan.allocator.snapshot import compact

    if not torch.cuda.is_initialized():
        return None
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    data = compact(torch.cuda.memory._snapshot())
    data["meta"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                    "capability": list(torch.cuda.get_device_capability(0)),
                    "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                    "stats": {k: stats[k] for k in STAT_KEYS if k in stats},
                    "device_used_bytes": total - free, "reserved_bytes_at_exit": torch.cuda.memory_reserved(),
                    "entries_cap": SNAPSHOT_ENTRIES if snapshot_dir() else HISTORY_ENTRIES,
                    "argv": sys.argv[:8]}  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{os.environ.get(LABEL_ENV, 'run')}_{os.getpid()}.json"
    path.write_text(json.dumps(data, separators=(",", ":")))
    return path


def replay_history(data: dict) -> str:
    """One line: the recorded history through the allocator model, segment by segment, and the peaks."""
    from zeroplan.allocator import parse_alloc_conf, replay
    from zeroplan.allocator.snapshot import compare, trace_events

    meta = data.get("meta", {})
    trace = (data.get("device_traces") or [[]])[0]
    if not trace:
        return "no events (a probe with ZEROPLAN_CUDA_SNAPSHOT stops and clears the recording: see its pickles)"
    cap = meta.get("entries_cap", SNAPSHOT_ENTRIES)  # no meta: a probe's pickle, recorded with SNAPSHOT_ENTRIES
    if len(trace) >= cap:
        return f"{len(trace)} events: the ring buffer wrapped, the history does not start at an empty allocator"
    result = replay(trace_events(data), parse_alloc_conf(meta.get("alloc_conf", "")))
    got, stats = compare(data, result), meta.get("stats", {})
    verdict = "exact" if got.exact else (f"DIFFERS: {len(got.segment_sizes)} segment sizes, {len(got.addresses)} "
                                         f"addresses, {len(got.final_segments)} final segments")  # fmt: skip
    return (f"{len(trace)} events, {len(result.segment_sizes())} segments: {verdict}; reserved peak model "
            f"{result.reserved_peak_bytes:,} B, measured {stats.get('reserved_bytes.all.peak', 0):,} B; allocated "
            f"peak model {result.allocated_peak_bytes:,} B, measured {stats.get('allocated_bytes.all.peak', 0):,} B; "
            f"outside the allocator {meta.get('device_used_bytes', 0) - meta.get('reserved_bytes_at_exit', 0):,} B "
            "(derived: device used - reserved)")  # fmt: skip


def _load(path: Path) -> dict:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    with open(path, "rb") as f:  # a ZEROPLAN_CUDA_SNAPSHOT pickle: the history up to that reading, with stacks
        return pickle.load(f)


def replay_report(directory: Path) -> str:
    """``replay_history`` for every ``*.json`` history and ``*.pickle`` snapshot under ``directory``."""
    lines = []
    for path in sorted([*directory.rglob("*.json"), *directory.rglob("*.pickle")]):
        try:
            lines.append(f"{path.relative_to(directory)}: {replay_history(_load(path))}")
        except (ValueError, KeyError) as exc:
            lines.append(f"{path.relative_to(directory)}: not replayable: {exc}")
    return "\n".join(lines)


USAGE = ("usage: python -m validate.cuda_snapshot DIR (the ZEROPLAN_CUDA_SNAPSHOT directory of a run) | "
         "python -m validate.cuda_snapshot replay DIR (the ZEROPLAN_CUDA_HISTORY directory)")  # fmt: skip

if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "replay" and Path(args[1]).is_dir():
        print(replay_report(Path(args[1])))
    elif len(args) == 1 and Path(args[0]).is_dir():
        print(report(Path(args[0])))
    else:
        sys.exit(USAGE)
