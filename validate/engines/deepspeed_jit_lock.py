"""A stale lock in torch's JIT-extension cache, refused before a DeepSpeed world starts.

DeepSpeed builds its C++ ops (``fused_adam``, ``cpu_adam``, ...) with torch's ``cpp_extension.load``, which
serialises builds with a ``FileBaton`` on ``<build directory>/lock``: the builder creates the file and removes it
when done; every other process waits while it exists (``FileBaton.wait``: sleeps, forever). A build killed
midway leaves the file, and every later load of that op sleeps without end (seen: every DeepSpeed world on the
development machine for an hour, ranks in nanosleep). The build directory is torch's
(``torch/utils/cpp_extension.py:_get_build_directory``): ``$TORCH_EXTENSIONS_DIR/<op>`` when that is set, else
``~/.cache/torch_extensions/py<major><minor>_<cpu|cuXYZ|rocmXYZ>/<op>``; a build runs with that directory as its
working directory (ninja and the compiler: ``_run_ninja_build``), which is how a live build is told from a stale
lock here (a lock taken a moment before ninja starts reads as stale: hence "if no build is running").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def extensions_root() -> Path:
    """The folder holding one build directory per op, as torch computes it."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    hip, cuda = torch.version.hip, torch.version.cuda
    device = f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{device}"


def _building_in() -> set[Path]:
    """The working directories of this host's processes (a build runs in its op's build directory)."""
    out = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            out.add(Path(os.readlink(proc / "cwd")))
        except OSError:  # gone, or not ours to read
            continue
    return out


def check_extension_locks(root: Path | None = None) -> None:
    """ValueError (one line, naming the file) for an op's ``lock`` with no process building in its folder."""
    root = extensions_root() if root is None else root
    locks = sorted(root.glob("*/lock"))
    if not locks:
        return
    building = _building_in()
    stale = [lock for lock in locks if lock.parent.resolve() not in building]
    if stale:
        raise ValueError(f"{stale[0]}: a torch JIT-extension lock with no build running (a killed build left it); "
                         "DeepSpeed would wait on it forever: delete it if no build is running, and run again")  # fmt: skip
