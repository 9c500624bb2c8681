"""Processes of a run die with their parent: ``PR_SET_PDEATHSIG`` (Linux), checked against a race.

The parent (``zeroplan validate``) starts the launcher with ``die_with_parent`` as its ``preexec_fn``;
the launcher (torchrun) and every rank call it first thing. When a parent dies, even by SIGKILL, the
kernel sends SIGKILL to its children, so a killed run leaves no rank behind. A process whose parent
died before it could ask is caught by the check that follows: its parent pid changed, or the run's
root process (``ROOT_ENV``) is gone.

The run's scratch folder has a lifeline too (``guard``): a small janitor process, outside the run and
in a session of its own, holds a pipe from the parent. When the pipe closes (the parent is done, or
died, even by SIGKILL: the kernel closes its end) the janitor kills what is left of the run (processes
carrying ``RUN_ENV``), removes the folder and exits, so a run leaves nothing a later run has to clean.
The ranks keep all their scratch in that folder (``TMPDIR`` points into it).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ROOT_ENV = "ZEROPLAN_VALIDATE_ROOT"  # pid of the ``zeroplan validate`` process that owns the run
RUN_ENV = "ZEROPLAN_VALIDATE_RUN"  # marks every process of one run (found in /proc/PID/environ)

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies; exit now if it already has."""
    if _libc is None:
        return
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)
    root = os.environ.get(ROOT_ENV)
    if root and root.isdigit() and not _alive(int(root)):
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def marked_pids(marker: str) -> set[int]:
    """Processes whose environment carries ``RUN_ENV=marker`` (a run's launcher and ranks)."""
    needle = f"{RUN_ENV}={marker}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def kill_marked(marker: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process of the run ``marker`` until none is left (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while (left := marked_pids(marker)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def guard(folder: Path, marker: str) -> subprocess.Popen:
    """Start the janitor of ``folder``: it waits for EOF on its stdin (close ``.stdin`` when done; the
    kernel closes it if this process dies), then kills the run ``marker`` and removes ``folder``."""
    env = {k: v for k, v in os.environ.items() if k != RUN_ENV}  # never one of the processes it kills
    return subprocess.Popen(
        [sys.executable, "-m", "validate.lifeline", str(folder), marker], stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
    )  # fmt: skip


def _janitor(folder: str, marker: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the end of the pipe ends it
    sys.stdin.buffer.read()  # returns at EOF: the parent closed the pipe or is gone
    kill_marked(marker)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    _janitor(sys.argv[1], sys.argv[2])


def leave_world(barrier: bool = True) -> None:
    """A rank's last act, every result written: leave together (``barrier``: the process group's; none on a
    simulated run), then leave without tearing anything down. A rank that closes its gloo pairs while a peer still
    sends aborts the peer, and gloo's (and the profiler's) threads are still joinable at interpreter exit, where a
    C++ std::thread destructor aborts the process ("terminate called without an active exception", SIGABRT; seen
    under torchrun on 2 shared cores even after a barrier). The launcher reads only the exit code."""
    if barrier:
        import torch.distributed as dist

        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
