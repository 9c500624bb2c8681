"""The validator ends cleanly whatever ends it (signals to the parent), and runs across two "nodes".

Processes of a run are found by a token in their environment (inherited by the launcher and every
rank), not by pid, so neither pid reuse nor another session's runs can fool the checks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from validate.harness import TMP_PREFIX, remove_stale_dirs

TOKEN_ENV = "ZEROPLAN_TEST_TOKEN"


def run_pids(token: str) -> set[int]:
    """Processes (other than this test's) whose environment carries ``TOKEN_ENV=token``."""
    needle = f"{TOKEN_ENV}={token}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def start(args: list[str], token: str, tmpdir: Path, fault: str | None = None) -> subprocess.Popen:
    env = {**os.environ, TOKEN_ENV: token, "TMPDIR": str(tmpdir)}
    if fault:
        env["ZEROPLAN_VALIDATE_FAULT"] = fault
    cmd = [sys.executable, "-c", "from zeroplan.cli import main; main()", "validate", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def worker_count(token: str) -> int:
    n = 0
    for pid in run_pids(token):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            # a rank runs ``python [-u] -m validate.worker``; the launcher (``-m validate.launch``) names it later
            n += b"-m" in argv and argv[argv.index(b"-m") + 1] == b"validate.worker"
        except OSError:
            pass
    return n


@pytest.mark.distributed
@pytest.mark.parametrize("signum, code, message", [
    (signal.SIGTERM, 128 + signal.SIGTERM, "zeroplan: error: SIGTERM: stopped; all ranks stopped"),
    (signal.SIGINT, 130, "zeroplan: error: interrupted"),
    (signal.SIGKILL, -signal.SIGKILL, None),
])  # fmt: skip
def test_a_signal_to_the_parent_leaves_no_rank_and_no_folder(tmp_path, signum, code, message):
    token = uuid.uuid4().hex
    # rank 1 hangs, so the run is alive (rank 0 waits in a collective) until the signal ends it
    proc = start(["--model", "mlp-tiny", "--world-size", "2", "--stage", "0", "--timeout", "120"],
                 token, tmp_path, fault="hang:1")  # fmt: skip
    try:
        assert wait_for(lambda: worker_count(token) == 2, 90), "the two ranks never started"
        assert len(list(tmp_path.glob(f"{TMP_PREFIX}*"))) == 1
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == code
        if message is not None:
            assert err.startswith(message) and err.count("\n") == 1, err
        # ranks die with the parent: SIGKILL included (PR_SET_PDEATHSIG in the launcher and each rank)
        assert wait_for(lambda: not run_pids(token), 15), f"left running: {run_pids(token)}"
        # SIGKILL included: the folder's janitor (validate.lifeline.guard) outlives the parent and removes it
        assert wait_for(lambda: not list(tmp_path.glob(f"{TMP_PREFIX}*")), 15)
        assert remove_stale_dirs(str(tmp_path)) == []  # nothing left for a later run to clean
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in run_pids(token):
            os.kill(pid, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_two_nodes_on_one_host_run_one_world(tmp_path):
    # Two launchers with --nnodes 2 on localhost: the multi-node path (static rendezvous at node 0).
    token, port, out = uuid.uuid4().hex, free_port(), tmp_path / "result.json"
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--world-size", "2",
              "--stage", "3", "--model", "mlp-tiny", "--steps", "2", "--timeout", "150"]  # fmt: skip
    nodes = [start([*common, "--node-rank", "0", "--json", str(out)], token, tmp_path),
             start([*common, "--node-rank", "1"], token, tmp_path)]  # fmt: skip
    try:
        (out0, err0), (out1, err1) = (p.communicate(timeout=200) for p in nodes)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert nodes[0].returncode == 0, err0 + out0
    assert nodes[1].returncode == 0 and out1.startswith("node 1: its 1 ranks finished"), err1 + out1
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["world_size"], row["stage"], row["ok"]) == (2, 3, True)
    assert row["checks"]["collectives_match"] and row["parity"]["ok"]
    assert not run_pids(token)
