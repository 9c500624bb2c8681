"""Where the live CUDA bytes of a reading come from: the caching allocator's own record, by allocation site.

A diagnostic for the CUDA-only residuals of FSDP2 (docs/validate.md "On a GPU"): a step-boundary reading
says how many bytes are live, not which tensors. With ``ZEROPLAN_CUDA_SNAPSHOT=DIR`` in the environment,
``validate.probes.MemoryProbe`` records the allocator's history on CUDA
(``torch.cuda.memory._record_memory_history``, Python stacks) and the FSDP2 runner writes the allocator's
snapshot (``torch.cuda.memory._snapshot``) at each reading of the last step as ``DIR/<reading>.pickle``.
Nothing changes without the variable, and nothing on CPU. ``python -m validate.cuda_snapshot DIR`` prints,
per snapshot, the live bytes grouped by where they were allocated (``live_by_site``, pure), so a residual
names its allocation site; the pickles open in https://pytorch.org/memory_viz as well.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

ENV = "ZEROPLAN_CUDA_SNAPSHOT"
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
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
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


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python -m validate.cuda_snapshot DIR (the ZEROPLAN_CUDA_SNAPSHOT directory of a run)")
    print(report(Path(sys.argv[1])))
