"""Processes of a run die with their parent: ``PR_SET_PDEATHSIG`` (Linux), checked against a race.

The parent (``zeroplan validate``) starts the launcher with ``die_with_parent`` as its ``preexec_fn``;
the launcher (torchrun) and every rank call it first thing. When a parent dies, even by SIGKILL, the
kernel sends SIGKILL to its children, so a killed run leaves no rank behind. A process whose parent
died before it could ask is caught by the check that follows: its parent pid changed, or the run's
root process (``ROOT_ENV``) is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

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
