"""Start the ranks of a validation run, wait for them with a timeout, leave nothing behind.

Each world size gets its own processes (``python -m validate.worker``), rendezvousing through a file
store in a private temporary directory, one session per rank so a whole rank can be killed. When a rank
exits non-zero or the timeout passes, every rank is killed and ``RunFailed`` names the rank and quotes
the end of its log; no result is returned, so no partial result file is ever written.
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

from validate.config import ValidateConfig

LOG_TAIL_CHARS = 1500
POLL_S = 0.05  # short enough that the crashing rank is seen before its peers notice


class RunFailed(RuntimeError):
    """A rank crashed or the run outlived its timeout."""


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-LOG_TAIL_CHARS:].strip()


# Without iproute2's ``ip``, ``lo`` is brought up with the SIOCGIFFLAGS / SIOCSIFFLAGS ioctls (IFF_UP = 1).
LOOPBACK_UP = (
    "import fcntl, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "f = struct.unpack('16sH14x', fcntl.ioctl(s, 0x8913, struct.pack('16sH14x', b'lo', 0)))[1]; "
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH14x', b'lo', f | 1))"
)


def _network_namespace() -> tuple[subprocess.Popen, list[str]]:
    """A process holding a fresh network namespace with only loopback up, and the prefix that runs a
    command inside it. Every byte the ranks send then crosses ``lo`` of that namespace alone."""
    if not shutil.which("unshare") or not shutil.which("nsenter"):
        raise RunFailed("--wire needs unshare and nsenter (util-linux) and a Linux kernel")
    holder = subprocess.Popen(
        ["unshare", "-n", "--", "sh", "-c",
         f'(ip link set lo up || "{sys.executable}" -c "{LOOPBACK_UP}") && echo up && exec sleep 86400'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    if holder.stdout.readline().strip() != "up":
        _kill([holder])
        raise RunFailed(f"--wire: could not create a network namespace: {holder.stderr.read().strip()}")
    return holder, ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"]


def run_world(config: ValidateConfig, nd: int, simulated: bool) -> tuple[dict, list[list[dict]]]:
    """Run every stage of ``config`` at world size ``nd``; returns (meta, rows of each rank)."""
    nprocs = 1 if simulated else nd
    env = dict(os.environ)
    # Ranks share few cores: one intra-op thread each keeps N_d processes from oversubscribing them.
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="zeroplan-validate-") as tmp:
        procs, logs, prefix, holders = [], [], [], []
        try:
            if config.wire:
                holder, prefix = _network_namespace()
                holders.append(holder)  # killed with the ranks, whatever happens
                env["GLOO_SOCKET_IFNAME"] = "lo"
            for rank in range(nprocs):
                logs.append(Path(tmp, f"rank{rank}.log"))
                cmd = prefix + [
                    sys.executable, "-m", "validate.worker", "--config", config.model_dump_json(),
                    "--world-size", str(nd), "--rank", str(rank), "--out", str(Path(tmp, f"rank{rank}.json")),
                ]  # fmt: skip
                cmd += ["--simulated"] if simulated else ["--init", f"file://{tmp}/store"]
                with open(logs[-1], "w") as log:
                    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True))  # fmt: skip
            deadline, exits = time.monotonic() + config.timeout_s, []  # exits: ranks in the order seen
            while len(exits) < nprocs:
                exits += [r for r, p in enumerate(procs) if p.poll() is not None and r not in exits]
                failed = [r for r in exits if procs[r].returncode != 0]
                if failed:  # the first rank seen to fail is the cause; its peers fail because it did
                    r = failed[0]
                    others = ", ".join(f"{o} (code {procs[o].returncode})" for o in failed[1:])
                    raise RunFailed(
                        f"world size {nd}: rank {r} exited with code {procs[r].returncode}"
                        + (f", then ranks {others}" if others else "")
                        + f"; all ranks stopped. Its log ends:\n{_tail(logs[r])}"
                    )
                if time.monotonic() > deadline:
                    raise RunFailed(
                        f"world size {nd}: no result after {config.timeout_s:g} s (a rank hangs?); "
                        "all ranks stopped"
                    )
                time.sleep(POLL_S)
            results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nprocs)]
        finally:
            _kill(procs + holders)
    return results[0]["meta"], [res["rows"] for res in results]


def run_matrix(config: ValidateConfig) -> list[tuple[dict, list[list[dict]]]]:
    """Every world size of ``config``, one after the other."""
    return [run_world(config, nd, config.simulated) for nd in config.world_sizes]
