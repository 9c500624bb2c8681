"""torchrun (``torch.distributed.run``) as the launcher of a real run, plus a file naming the failed rank.

    python -m validate.launch FAILURES.json -- TORCHRUN_ARGS... -m validate.worker WORKER_ARGS...

Runs ``torch.distributed.run.run`` in this process (this process is torchrun's agent). When a rank
fails, torchrun stops the others and raises ``ChildFailedError``; its first failure (global rank, exit
code, local rank) is written to FAILURES.json for ``validate.harness`` to report, and the exit code is 1.

One node (``--standalone``), ``-m MODULE``, no restarts (every run of the validator and its tests): the
ranks are forked from this process instead, after it imported MODULE (``_fork_world``), as torchrun would
start them in every other respect: the same environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of a store this process holds, ``TORCHELASTIC_USE_AGENT_STORE``), the same
log files (``--log-dir``/``--redirects``), the same FAILURES.json. torchrun starts each rank as a new
interpreter, which imports torch and the worker again: 3-4 CPU-s a rank (6-7 with DeepSpeed) on 2 shared
cores, most of a small run (issue 16: the suite's time budget). ``ZEROPLAN_VALIDATE_TORCHRUN=1`` keeps
torchrun's own ranks (to compare).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback
from typing import NoReturn

from validate.lifeline import die_with_parent

TORCHRUN_ENV = "ZEROPLAN_VALIDATE_TORCHRUN"
# what a worker's main imports itself, beyond its module's imports; imported once here, before the fork
PRELOAD = {"validate.engines.deepspeed": ("deepspeed", "deepspeed.ops", "deepspeed.comm.comm")}
STOP_GRACE_S = 30.0  # torchrun's own: SIGTERM to the ranks left, SIGKILL after this


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    failures_path, rest = argv[0], argv[1:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(rest)
    if _forkable(args):
        sys.exit(_fork_world(args, failures_path))
    try:
        run(args)
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        others = {r: f.exitcode for r, f in exc.failures.items() if r != rank}
        _write_failures(failures_path, rank, first.local_rank, first.exitcode, others)
        sys.exit(1)


def _write_failures(path: str, rank: int, local_rank: int, exitcode: int, others: dict[int, int]) -> None:
    with open(path, "w") as f:
        json.dump({"rank": rank, "local_rank": local_rank, "exitcode": exitcode,
                   "others": {str(r): c for r, c in others.items()}}, f)  # fmt: skip


def _forkable(args) -> bool:
    """One node, a Python module, no restarts, no tee: what ``_fork_world`` does exactly as torchrun."""
    return (
        args.standalone and args.module and not args.no_python and not args.run_path
        and args.max_restarts == 0 and args.tee == "0" and str(args.nproc_per_node).isdigit()
        and os.environ.get(TORCHRUN_ENV) != "1"
    )  # fmt: skip


def _fork_world(args, failures_path: str) -> int:
    """Import the worker, fork ``--nproc-per-node`` ranks of it, wait; on the first failed rank stop the
    others (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) and write FAILURES.json. Returns the exit code."""
    nproc, module = int(args.nproc_per_node), args.training_script
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun
    if module in PRELOAD:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the DeepSpeed worker's main, before its import
    importlib.import_module(module)
    for name in PRELOAD.get(module, ()):
        importlib.import_module(name)
    logs = os.path.join(args.log_dir, "none", "attempt_0") if args.log_dir and args.redirects != "0" else None
    sys.stdout.flush()
    sys.stderr.flush()
    ranks, ports = {}, []
    for local_rank in range(nproc):  # forked before the store's thread exists; each waits for the port
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            for w in ports:
                os.close(w)
            os.close(write)
            _rank(local_rank, nproc, module, args.training_script_args, read, logs)
        os.close(read)
        ranks[pid] = local_rank
        ports.append(write)
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=3600), wait_for_workers=False)
    for w in ports:
        os.write(w, str(store.port).encode())
        os.close(w)
    failed = _wait(ranks)
    if failed is None:
        return 0
    local_rank, code = failed
    others = _stop(ranks)
    _write_failures(failures_path, local_rank, local_rank, code, others)
    print(f"validate.launch: rank {local_rank} exited with code {code}; then {others}", file=sys.stderr)
    return 1


def _wait(ranks: dict[int, int]) -> tuple[int, int] | None:
    """Reap ranks as they exit (``ranks``: pid -> local rank, emptied as they go); the first failure."""
    while ranks:
        pid, status = os.wait()
        if pid in ranks:
            local_rank, code = ranks.pop(pid), os.waitstatus_to_exitcode(status)
            if code != 0:
                return local_rank, code
    return None


def _stop(ranks: dict[int, int]) -> dict[int, int]:
    """SIGTERM every rank left, SIGKILL after ``STOP_GRACE_S``; {local rank: exit code} of those failed."""
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    deadline, codes = time.monotonic() + STOP_GRACE_S, {}
    while ranks:
        for pid in list(ranks):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    return {r: c for r, c in sorted(codes.items()) if c != 0}


def _rank(local_rank: int, nproc: int, module: str, argv: list[str], port_fd: int, logs: str | None) -> None:
    """The forked rank: torchrun's environment and log files, then ``python -u -m module argv``; no return."""
    die_with_parent()  # the kernel's parent-death signal is not inherited across fork

    def setup() -> None:
        port = os.read(port_fd, 16).decode()
        os.close(port_fd)
        if not port:  # the launcher died before it held the store
            os._exit(1)
        os.environ.update(_rank_env(local_rank, nproc, port))
        if logs is not None:
            folder = os.path.join(logs, str(local_rank))
            os.makedirs(folder, exist_ok=True)
            for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
                out = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(out, fd)
                os.close(out)

    run_as_main(module, argv, setup, unbuffered=True)


def run_as_main(module: str, argv: list[str], setup=lambda: None, unbuffered: bool = False) -> NoReturn:
    """In a forked process: ``setup()``, then ``python [-u] -m module argv`` as a new interpreter would run it
    (a fresh ``__main__``, its imports already loaded), shown as that command line; exits with its exit code
    and never returns (``os._exit``: nothing of the parent's, no atexit handler, runs in this process)."""
    _show_command_line([sys.executable, *(["-u"] if unbuffered else []), "-m", module, *argv])
    code = 1
    try:
        setup()
        # unbuffered, as torchrun's ``python -u``: a rank that ends with os._exit loses nothing it printed
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      errors="backslashreplace")  # fmt: skip
        sys.argv = [module, *argv]
        sys.modules.pop(module, None)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _show_command_line(words: list[str]) -> None:
    """Show ``words`` as this process's command line (``/proc/self/cmdline``, ``ps``): the forked rank's
    is the launcher's until then; now it reads as torchrun's rank's would (``python -u -m validate.worker``),
    which is how a rank is found and counted. Written over the argument area in place, as setproctitle does
    (``/proc/self/stat`` fields 48-49: its start and end), padded with NULs, cut if longer."""
    import ctypes

    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
    except (OSError, IndexError, ValueError):
        return
    text = b"\0".join(w.encode() for w in words)[: end - start - 1]
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def _rank_env(local_rank: int, nproc: int, port: str) -> dict[str, str]:
    """What torchrun's agent sets for a rank of one node (``LocalElasticAgent._start_workers``)."""
    rank, n = str(local_rank), str(nproc)
    return {
        "RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": "0", "ROLE_RANK": rank, "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": n, "WORLD_SIZE": n, "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": n,
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }  # fmt: skip


if __name__ == "__main__":
    main()
