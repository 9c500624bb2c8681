"""Start the ranks of a validation run, wait for them with a timeout, leave nothing behind.

A real run is launched by torchrun (``torch.distributed.run``, wrapped by ``validate.launch`` so that the
first failed rank is written to a file): ``--nproc-per-node`` ranks on this node, ``--standalone`` on one
node, or ``--nnodes/--node-rank/--master-addr/--master-port`` across nodes (run the same command on
every node). A simulated run is one process on a fake group. Either way the parent supervises one
child, the launcher, in its own session.

Nothing outlives the run, whatever ends it:
- a rank that fails or a run past ``timeout_s`` (counted from the launch): the launcher's session is
  killed, then every process whose environment carries this run's marker (``lifeline.RUN_ENV``);
  ``RunFailed`` names the rank and quotes the end of its log; no result is returned, so no file is written;
- SIGTERM or SIGHUP to the parent: the same cleanup, then ``Interrupted``; SIGINT: the same, then
  ``KeyboardInterrupt``;
- SIGKILL to the parent (nothing can run in it): the launcher and each rank have asked the kernel to
  kill them when their parent dies (``lifeline.die_with_parent``), so the ranks die with it; the
  temporary folder, which holds all the ranks' scratch (``TMPDIR``), is removed by its janitor
  (``lifeline.guard``), which outlives the parent; ``remove_stale_dirs`` (folders whose owner, named in
  the folder's name by pid and start time, is gone) stays as a second line for a janitor killed too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from validate.config import ValidateConfig
from validate.lifeline import ROOT_ENV, RUN_ENV, die_with_parent, guard, kill_marked, marked_pids  # noqa: F401

LOG_TAIL_CHARS = 1500
POLL_S = 0.05
TMP_PREFIX = "zeroplan-validate-"


class RunFailed(RuntimeError):
    """A rank crashed or the run outlived its timeout."""


class Interrupted(RuntimeError):
    """The parent got SIGTERM or SIGHUP; every process of the run is gone and its files removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name}: stopped; all ranks stopped, temporary files removed")
        self.signum = signum


class NotNodeZero(Exception):
    """A node other than 0 of a multi-node run finished its ranks; node 0 holds the result."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def remove_stale_dirs(root: str | None = None) -> list[Path]:
    """Remove temporary folders of runs whose parent is gone (killed by SIGKILL); returns them."""
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
        pid, start, *_ = d.name.removeprefix(TMP_PREFIX).split("-") + ["", ""]
        if pid.isdigit() and _start_time(int(pid)) != start:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _run_dir() -> Path:
    """The run's scratch folder in the temporary directory; ValueError (one line) naming it if it cannot be
    made (an unwritable or missing ``TMPDIR``): no output is involved, the environment is."""
    me = os.getpid()
    try:
        remove_stale_dirs()
        return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{me}-{_start_time(me)}-"))
    except OSError as exc:
        where = os.environ.get("TMPDIR") or tempfile.gettempdir()
        raise ValueError(f"cannot create the run's temporary folder in TMPDIR={where!r} ({exc.strerror or exc}): "
                         "set TMPDIR to a writable directory") from None


def _stop(proc: subprocess.Popen | None, marker: str) -> None:
    """Kill the launcher's session and every process of this run; wait until they are gone."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc is not None:
        proc.wait()
    kill_marked(marker)


def _tail(*paths: Path) -> str:
    text = "".join(p.read_text(errors="replace") for p in paths if p.exists())
    return text[-LOG_TAIL_CHARS:].strip()


# Without iproute2's ``ip``, ``lo`` is brought up with the SIOCGIFFLAGS / SIOCSIFFLAGS ioctls (IFF_UP = 1).
LOOPBACK_UP = (
    "import fcntl, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "f = struct.unpack('16sH14x', fcntl.ioctl(s, 0x8913, struct.pack('16sH14x', b'lo', 0)))[1]; "
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH14x', b'lo', f | 1))"
)


def _in_network_namespace(cmd: list[str]) -> list[str]:
    """``cmd`` run in a fresh network namespace with only loopback up: every byte the ranks send then
    crosses ``lo`` of that namespace alone. The namespace lives as long as the command."""
    if not shutil.which("unshare"):
        raise RunFailed("--wire needs unshare (util-linux) and a Linux kernel")
    up = f'(ip link set lo up 2>/dev/null || "{sys.executable}" -c "{LOOPBACK_UP}")'
    return ["unshare", "-n", "--", "sh", "-c", f'{up} && exec "$@"', "sh", *cmd]


def launch_command(
    config: ValidateConfig, nd: int, tmp: Path, simulated: bool, worker_args: tuple[str, ...] = ()
) -> list[str]:
    """The launcher's command line: torchrun for a real run, one worker for a simulated one; ``worker_args``:
    more arguments of the engine's worker (the DeepSpeed runner's ds_configs)."""
    module = config.runner.worker_module(config)  # the engine's runner: the module its ranks run
    worker = ["-m", module, "--config", config.model_dump_json(), "--out", str(tmp / "result.json"),
              *worker_args]  # fmt: skip
    if simulated:
        return [sys.executable, *worker, "--simulated", "--world-size", str(nd), "--rank", "0", "--raw"]
    nodes = (
        ["--standalone"]
        if config.nnodes == 1
        else ["--node-rank", str(config.node_rank), "--master-addr", config.master_addr,
              "--master-port", str(config.master_port)]
    )  # fmt: skip
    torchrun = [
        "--nnodes", str(config.nnodes), *nodes, "--nproc-per-node", str(nd // config.nnodes),
        "--max-restarts", "0", "--monitor-interval", "0.1",
        "--log-dir", str(tmp / "logs"), "--redirects", "3",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "validate.launch", str(tmp / "failures.json"), "--", *torchrun, *worker, "--raw"]
    return _in_network_namespace(cmd) if config.wire else cmd


def _rank_log(tmp: Path, local_rank: int) -> list[Path]:
    found = sorted((tmp / "logs").glob(f"**/attempt_*/{local_rank}"))
    return [found[-1] / "stdout.log", found[-1] / "stderr.log"] if found else []


def _failure(config: ValidateConfig, nd: int, tmp: Path, code: int) -> RunFailed:
    failures = tmp / "failures.json"
    if not failures.exists():  # the launcher itself failed (rendezvous, bad arguments) or a simulated rank
        return RunFailed(
            f"world size {nd}: the launcher exited with code {code}; all ranks stopped. Its log ends:\n"
            + _tail(tmp / "launcher.log")
        )
    f = json.loads(failures.read_text())
    # ranks torchrun stopped with SIGTERM because of the first failure are not failures of their own
    others = ", ".join(f"{r} (code {c})" for r, c in f["others"].items() if c != -signal.SIGTERM)
    local = f["rank"] - config.node_rank * (nd // config.nnodes)
    log = _tail(*_rank_log(tmp, local)) if 0 <= local < nd // config.nnodes else "(on another node)"
    return RunFailed(
        f"world size {nd}: rank {f['rank']} exited with code {f['exitcode']}"
        + (f", then ranks {others}" if others else "")
        + f"; all ranks stopped. Its log ends:\n{log}"
    )


def run_world(
    config: ValidateConfig, nd: int, simulated: bool, worker_args: tuple[str, ...] = ()
) -> tuple[dict, list[list[dict]]]:
    """Run every stage of ``config`` at world size ``nd``; returns (meta, rows of each rank)."""
    deadline = time.monotonic() + config.timeout_s  # from the launch, not from the ranks' start
    marker = uuid.uuid4().hex
    env = {**os.environ, RUN_ENV: marker, ROOT_ENV: str(os.getpid())}
    # Ranks share few cores: one intra-op thread each keeps N_d processes from oversubscribing them.
    env.setdefault("OMP_NUM_THREADS", "1")
    if config.wire:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    tmp, proc = _run_dir(), None
    janitor = guard(tmp, marker)  # removes tmp and the run's processes even if this process is SIGKILLed
    env["TMPDIR"] = str(tmp)  # every rank's own scratch lands in the folder the janitor removes
    try:
        with open(tmp / "launcher.log", "w") as log:
            proc = _start(launch_command(config, nd, tmp, simulated, worker_args), log, env, janitor.stdin.fileno())
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"world size {nd}: no result after {config.timeout_s:g} s (a rank hangs?); all ranks stopped"
                )
            time.sleep(POLL_S)
        if proc.returncode != 0:
            raise _failure(config, nd, tmp, proc.returncode)
        result = tmp / "result.json"
        if not result.exists():
            if config.nnodes > 1 and config.node_rank != 0:
                raise NotNodeZero(
                    f"node {config.node_rank}: its {nd // config.nnodes} ranks finished; node 0 prints and "
                    "writes the result"
                )
            raise RunFailed(f"world size {nd}: the ranks exited without a result. Log:\n{_tail(tmp / 'launcher.log')}")
        out = json.loads(result.read_text())
    finally:
        _stop(proc, marker)
        shutil.rmtree(tmp, ignore_errors=True)
        janitor.stdin.close()
        janitor.wait()
    return out["meta"], out["ranks"]


# Forked launchers (issue 16, the suite's time budget). A new interpreter for the launcher imports torch and
# the worker again (~2 CPU-s a world, 2026-12-02; most of a small run's parent side). A process that opts in
# (``fork_launchers``: the test session's background jobs) imports them once and forks each launcher from
# itself instead, where that is the same start: the command is ``python -m MODULE ...``, this process has no
# thread beyond those it had when it opted in (so no OpenMP pool a child could inherit broken: it only ever
# supervised), and OMP_NUM_THREADS is what the launcher's own torch would read at import. The fork runs as
# ``subprocess.Popen(start_new_session=True, preexec_fn=die_with_parent)`` then exec would: its own session,
# dying with this process, the run's environment, output to the log, default signal handlers, a fresh
# ``__main__`` (``launch.run_as_main``). One difference: ``/proc/PID/environ`` keeps this process's
# environment, so ``kill_marked`` does not find a forked launcher or its ranks; ``_stop`` kills their session
# and the parent-death signal takes them with a killed parent, as before. ``zeroplan validate`` never opts in.
_FORK: dict[str, object] = {}  # threads: at the opt-in; workers: the modules to import


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def fork_launchers(
    workers: tuple[str, ...] = ("validate.worker", "validate.engines.fsdp2", "validate.engines.fsdp2_tp"),
) -> None:
    """From now on, start each run's launcher by forking this process (above); what the launchers import, torch
    and the ``workers``, is imported here at the first launch."""
    _FORK.update(threads=_threads(), workers=workers)


def _forkable(cmd: list[str], env: dict[str, str]) -> bool:
    """Whether ``_start`` forks ``cmd`` (above); imports what the launchers import, once."""
    if _FORK.get("threads") != _threads() or cmd[:2] != [sys.executable, "-m"]:
        return False
    if os.environ.get("OMP_NUM_THREADS") != env.get("OMP_NUM_THREADS"):
        return False
    import importlib

    for module in ("torch.distributed.run", "validate.launch", *_FORK["workers"]):
        importlib.import_module(module)
    return _threads() == _FORK["threads"]  # importing torch started none either


class _Forked:
    """A forked launcher, as much of ``subprocess.Popen`` as ``run_world`` and ``_stop`` use."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def _start(cmd: list[str], log, env: dict[str, str], lifeline: int):
    """Start the launcher ``cmd`` in a session of its own, output to ``log``, dying with this process; a forked
    one closes the janitor's pipe ``lifeline`` (a new interpreter never has it), so that its EOF still means
    that this process is gone."""
    me = os.getpid()
    if not _forkable(cmd, env):
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(me))  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _Forked(pid)
    from validate.launch import run_as_main

    def setup() -> None:
        os.close(lifeline)
        os.setsid()
        os.environ.clear()
        os.environ.update(env)
        die_with_parent(me)
        tempfile.tempdir = None  # the run's TMPDIR, not the one this process found
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    run_as_main(cmd[2], cmd[3:], setup)


def _raise_interrupted(signum: int, _frame) -> None:
    raise Interrupted(signum)


def run_matrix(config: ValidateConfig) -> list[tuple[dict, list[list[dict]]]]:
    """Every world size of ``config``, one after the other; SIGTERM and SIGHUP end it cleanly."""
    import threading

    main = threading.current_thread() is threading.main_thread()  # only there can handlers be set
    handlers = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)} if main else {}
    try:
        return [run_world(config, nd, config.simulated) for nd in config.world_sizes]
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
