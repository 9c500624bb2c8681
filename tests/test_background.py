"""The session's background jobs (tests/background.py): rows from the child, errors with their traceback, a job
no child has started run by the test itself and never twice, readers last. Jobs here are stdlib calls: cheap."""

from __future__ import annotations

import signal
import time
from types import ModuleType, SimpleNamespace

import pytest

from background import INLINE_ENV, Jobs, last_readers


def _jobs(jobs: list[tuple[str, dict]]) -> Jobs:
    started = Jobs()
    started.start(jobs)
    return started


def test_rows_come_from_the_child_and_an_error_brings_its_traceback():
    jobs = _jobs([("ok", {"fn": "json:loads", "kwargs": {"s": "[1, 2]"}}),
                  ("bad", {"fn": "json:loads", "kwargs": {"s": "{"}})])  # fmt: skip
    try:
        assert jobs.proc.wait(timeout=60) == 0  # both run by the child (unstarted, a test would run them itself)
        assert jobs.result("ok", {"fn": "json:loads", "kwargs": {"s": "[1, 2]"}}) == [1, 2]
        assert (jobs.dir / "ok.json").exists()
        with pytest.raises(RuntimeError, match=r"bad, run in the background:\n(.|\n)*JSONDecodeError"):
            jobs.result("bad", {"fn": "json:loads", "kwargs": {"s": "{"}})
        assert set(jobs.waited) == {"ok", "bad"} and len(jobs.summary()) == 2
        assert all(line.endswith(" CPU-s") and "nan" not in line for line in jobs.summary())  # the child's times
    finally:
        jobs.stop()
    assert not jobs.dir.exists()


def test_a_job_the_child_has_not_started_runs_here_once():
    # the child sleeps through its first job; the second is claimed here first, so the child skips it
    jobs = _jobs([("sleep", {"fn": "background:sleep", "kwargs": {"secs": 2}}),
                  ("late", {"fn": "json:loads", "kwargs": {"s": "3"}})])  # fmt: skip
    try:
        assert jobs.result("late", {"fn": "json:loads", "kwargs": {"s": "3"}}) == 3
        assert jobs.proc.wait(timeout=60) == 0 and not (jobs.dir / "sleep.err").exists()  # it slept
        assert not (jobs.dir / "late.json").exists() and "late" not in jobs.waited
        assert jobs.result("other", {"fn": "json:loads", "kwargs": {"s": "4"}}) == 4  # not a job: run here
        (line,) = jobs.summary()  # the job run here, with its CPU time; not the call that was no job
        assert line.startswith("background late: run by the test that read it first, ") and line.endswith(" CPU-s")
    finally:
        jobs.stop()


def test_no_background_when_told(monkeypatch):
    monkeypatch.setenv(INLINE_ENV, "1")
    jobs = _jobs([("one", {"fn": "json:loads", "kwargs": {"s": "1"}})])
    try:
        assert jobs.proc is None and jobs.result("one", {"fn": "json:loads", "kwargs": {"s": "1"}}) == 1
    finally:
        jobs.stop()


def test_readers_run_last_whole_modules_in_order():
    a, b, c = ModuleType("a"), ModuleType("b"), ModuleType("c")
    b.BACKGROUND_CLI, c.DEEPSPEED_WORLD = {"x": []}, {2: list}
    items = [SimpleNamespace(module=m, name=n) for m, n in [(b, 1), (a, 2), (c, 3), (b, 4), (a, 5)]]
    assert [i.name for i in last_readers(items)] == [2, 5, 1, 3, 4]


def test_unread_jobs_are_stopped_at_the_end():
    jobs = _jobs([("long", {"fn": "background:sleep", "kwargs": {"secs": 600}}),
                  ("never", {"fn": "json:loads", "kwargs": {"s": "1"}})])  # fmt: skip
    deadline = time.monotonic() + 60
    while not (jobs.dir / "long.claim").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (jobs.dir / "long.claim").exists()  # the child is in its first job
    time.sleep(0.5)
    assert jobs.proc.poll() is None and not (jobs.dir / "long.err").exists()  # still in it (it was a TypeError)
    jobs.stop()
    assert jobs.proc.returncode == -signal.SIGTERM and not jobs.dir.exists()
