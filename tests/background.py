"""The session's largest real-engine runs, started at collection in one niced child while the other tests run.

Issue 16 (the suite's wall time on two cores): the suite used 1.3 cores of 2 (956 CPU-s in 748 s of wall,
2026-12-01), since most tests are one process; the real-engine runs are a few rank processes each and need
nothing from the tests but their settings. So every run a collected module declares (the shared DeepSpeed
worlds, tests/deepspeed_world.py; ``zeroplan validate`` runs, ``BACKGROUND_VALIDATE``) is a job: at
collection one child process starts them one after the other, at the lowest CPU priority, and the modules
that read them run last (``last_readers``), so the jobs run on the core the other tests leave idle.

A test that reads a job (``Jobs.result``) takes its rows when they are there; waits for a job that is
running, the child and its ranks given back normal priority (as root: an unprivileged process cannot raise
a priority, and then the niced ranks have the cores the waiting test leaves them); and runs a job that has
not started itself, in the test process, as before (a job is claimed by whoever starts it first: an
exclusive file, so it never runs twice). A job's error fails the tests that read it, with its traceback.
The jobs no test read are stopped at the session's end, and the session's summary says when each job's
rows were ready and how long the tests waited for them. ``ZEROPLAN_TEST_INLINE=1``: no background, every
job runs in the test that first reads it.
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
from pathlib import Path
from types import SimpleNamespace

INLINE_ENV = "ZEROPLAN_TEST_INLINE"
FORK_ENV = "ZEROPLAN_TEST_FORK_LAUNCHERS"  # "0": the background jobs start every launcher as a new interpreter
TESTS = Path(__file__).resolve().parent


DECLARED = ("DEEPSPEED_WORLD", "BACKGROUND_VALIDATE", "BACKGROUND_CLI")  # what a module declares (module docstring)


def readers(modules) -> list:
    """The modules that read a job (any of ``DECLARED``), in the order given."""
    return [m for m in modules if any(getattr(m, name, None) for name in DECLARED)]


def last_readers(items: list) -> list:
    """``items`` with every test of a module that reads a job moved to the end, in their order (whole modules,
    so that a module's fixtures are set up once)."""
    ids = {id(m) for m in readers({getattr(i, "module", None): None for i in items})}
    return sorted(items, key=lambda i: id(getattr(i, "module", None)) in ids)  # stable


def session_jobs(modules, worlds, scratch: Path) -> list[tuple[str, dict]]:
    """Every job the ``modules`` declare, in the order they read them: the shared DeepSpeed worlds
    (``DEEPSPEED_WORLD``; ``worlds``: tests/deepspeed_world.py ``SharedWorlds``), ``zeroplan validate`` runs as
    the API runs them (``BACKGROUND_VALIDATE``: a function of a scratch folder returning ``{name:
    ValidateConfig}``) and as the command line does (``BACKGROUND_CLI``: ``{name: [argument, ...]}``)."""
    jobs: dict[str, dict] = {}
    for m in readers(modules):
        for nd in getattr(m, "DEEPSPEED_WORLD", {}):
            jobs.setdefault(*worlds.job(nd))
        for name, config in getattr(m, "BACKGROUND_VALIDATE", lambda _: {})(scratch).items():
            jobs[key(m, name)] = validate_job(config)
        for name, args in getattr(m, "BACKGROUND_CLI", {}).items():
            jobs[key(m, name)] = cli_job(args)
    return list(jobs.items())


def key(module, name: str) -> str:
    """The job ``name`` of a test module."""
    return f"{module.__name__.rsplit('.', 1)[-1]}-{name}"


def validate_job(config) -> dict:
    return {"fn": "background:validate_report", "kwargs": {"config": config.model_dump_json()}}


def validate_report(config: str) -> dict:
    """``zeroplan validate``'s report of a ``ValidateConfig`` (JSON), as ``validate.api.run_validation``."""
    from validate.api import run_validation
    from validate.config import ValidateConfig

    return run_validation(ValidateConfig.model_validate_json(config))


def zeroplan(*args: str, env: dict | None = None) -> SimpleNamespace:
    """``zeroplan ARGS`` in this process (typer's CliRunner): exit code, stdout and stderr as a console shows
    them. The parent's side of a run is the same code either way (the ranks are the launcher's children); a
    subprocess would import torch and the validator again, 4-5 CPU-s a run (issue 16: the suite's time budget)."""
    from typer.testing import CliRunner

    from zeroplan.cli import app_for

    result = CliRunner().invoke(app_for(list(args)), list(args), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a bug, not an exit: its traceback, as the subprocess would print it
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def cli_job(args: list[str]) -> dict:
    return {"fn": "background:validate_cli", "kwargs": {"args": list(args)}}


def validate_cli(args: list[str]) -> dict:
    """``zeroplan validate ARGS --json FILE`` (``zeroplan``): exit code, stdout, stderr and the report read back."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        proc = zeroplan("validate", *args, "--json", str(out))
        report = json.loads(out.read_text()) if out.exists() else None
    return {**vars(proc), "report": report}


def validate_json(jobs: Jobs, module, name: str) -> tuple[SimpleNamespace, dict]:
    """The module's ``BACKGROUND_CLI`` run ``name``: ``zeroplan validate``'s output and report; exit code 0."""
    out = jobs.result(key(module, name), cli_job(module.BACKGROUND_CLI[name]))
    proc = SimpleNamespace(returncode=out["returncode"], stdout=out["stdout"], stderr=out["stderr"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, out["report"]


def sleep(secs: float) -> None:
    """A job that only waits (the mechanism's own tests: a job still running; ``time.sleep`` takes no keyword,
    and a job is called with keywords)."""
    time.sleep(secs)


def cpu_s() -> float:
    """User + system CPU seconds of this process and the children it has reaped (a job's launcher and ranks)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def call(job: dict):
    """Run one job: ``{"fn": "module:function", "kwargs": {...}}``."""
    import importlib

    module, name = job["fn"].split(":")
    return getattr(importlib.import_module(module), name)(**job["kwargs"])


# The child: each job in turn, once claimed (KEY.claim, created exclusively), writing KEY.json or KEY.err.
# Its runs fork their launchers from it (validate/harness.py ``fork_launchers``: torch and the workers imported
# once, not once per world), with OMP_NUM_THREADS as the harness gives every launcher, so the same at import.
_CHILD = """
import json, os, sys, traceback
from pathlib import Path
sys.path.insert(0, sys.argv[2])
os.environ.setdefault("OMP_NUM_THREADS", "1")
from background import FORK_ENV, call, cpu_s
jobs = json.loads((Path(sys.argv[1]) / "jobs.json").read_text())
if os.environ.get(FORK_ENV) != "0" and any(job["fn"].startswith(("background:validate", "validate.")) for _, job in jobs):
    from validate.harness import fork_launchers
    fork_launchers()
out = Path(sys.argv[1])
for key, job in jobs:
    if (out / "stop").exists():  # the session is over (a job that turned SIGTERM into its own clean exit)
        break
    try:
        os.close(os.open(out / f"{key}.claim", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        continue  # a test runs it itself
    start = cpu_s()
    try:
        rows = call(job)
    except Exception:
        (out / f"{key}.err").write_text(traceback.format_exc())
        continue
    finally:
        (out / f"{key}.cpu").write_text(f"{cpu_s() - start:.1f}")
    (out / f"{key}.tmp").write_text(json.dumps(rows))
    (out / f"{key}.tmp").rename(out / f"{key}.json")
"""


class Jobs:
    """The session's jobs ([(key, job)], in the order the tests read them) and their one niced child."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="zeroplan-jobs-"))  # also the modules' scratch folder
        self.jobs: dict[str, dict] = {}
        self.ready: dict[str, float] = {}
        self.waited: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.proc = None

    def start(self, jobs: list[tuple[str, dict]]) -> None:
        """Start the child on ``jobs`` ([(key, job)], in the order the tests read them)."""
        self.jobs, self.started = dict(jobs), time.time()
        if self.jobs and os.environ.get(INLINE_ENV) != "1":
            (self.dir / "jobs.json").write_text(json.dumps(jobs))
            with open(self.dir / "log", "w") as log:  # not the terminal: pytest captures it per test
                self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(self.dir), str(TESTS)], stdout=log,
                                             stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))  # fmt: skip

    def _claim(self, key: str) -> bool:
        try:
            os.close(os.open(self.dir / f"{key}.claim", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def result(self, key: str, job: dict):
        """The job's result: the child's, waited for if need be, or run here if the child has not started it."""
        t0 = time.monotonic()
        if self.proc is None or key not in self.jobs or self._claim(key):
            start = cpu_s()
            try:
                return call(job)
            finally:
                if key in self.jobs:
                    self.cpu[key] = cpu_s() - start
        done, failed = self.dir / f"{key}.json", self.dir / f"{key}.err"
        if not (done.exists() or failed.exists()):
            _renice(self.proc.pid, 0)
        while not (done.exists() or failed.exists()):
            if self.proc.poll() is not None and not (done.exists() or failed.exists()):
                raise RuntimeError(f"the session's background jobs ended ({self.proc.returncode}) before {key}; "
                                   f"their log ends:\n{(self.dir / 'log').read_text()[-4000:]}")
            time.sleep(0.2)
        self.waited[key] = time.monotonic() - t0
        self.ready[key] = (done if done.exists() else failed).stat().st_mtime - self.started
        if (self.dir / f"{key}.cpu").exists():
            self.cpu[key] = float((self.dir / f"{key}.cpu").read_text())
        if failed.exists():
            raise RuntimeError(f"{key}, run in the background:\n{failed.read_text()}")
        return json.loads(done.read_text())

    def stop(self) -> None:
        """Stop the jobs no test read (the validator's lifelines take the launchers and ranks with the child)."""
        if self.proc is not None and self.proc.poll() is None:
            (self.dir / "stop").touch()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def summary(self) -> list[str]:
        """One line per job read from the background: when its rows were ready, how long the tests waited, its CPU
        time (user + sys of the child's call and the processes it reaped); one line per job a test ran itself."""
        lines = [f"background {key}: ready {self.ready[key]:.0f} s after collection, the tests waited "
                 f"{self.waited[key]:.1f} s, {self.cpu.get(key, float('nan')):.1f} CPU-s" for key in self.waited]
        return lines + [f"background {key}: run by the test that read it first, {cpu:.1f} CPU-s"
                        for key, cpu in self.cpu.items() if key not in self.waited]  # fmt: skip


def _renice(root: int, niceness: int) -> None:
    """``root``, every process under it and each of their threads (Linux keeps a priority per thread) at
    ``niceness``, where this process may (root: any; otherwise only up, which does nothing here)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)
            except (OSError, ValueError):
                pass
