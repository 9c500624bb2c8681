"""A launcher forked from a process that opted in (``validate.harness.fork_launchers``: the test session's background
jobs) starts as the new interpreter it replaces: same session rule, parent-death signal, environment, TMPDIR,
signal handlers, no janitor pipe, output in the log, a fresh ``__main__`` with its arguments, the exit code.
One process runs a probe module both ways (~2 CPU-s: it imports torch once, as a launcher would)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import ctypes, json, os, signal, sys, tempfile
lifeline = int(os.environ["PROBE_LIFELINE"])
try:
    os.fstat(lifeline)
    lifeline_open = True
except OSError:
    lifeline_open = False
deathsig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(deathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
print("to the log")
json.dump({
    "name": __name__, "argv": sys.argv[1:], "own_session": os.getsid(0) == os.getpid(),
    "parent": os.getppid() == int(os.environ["PROBE_PARENT"]), "run": os.environ.get("PROBE_RUN"),
    "tmp": tempfile.gettempdir(), "deathsig": deathsig.value, "lifeline_open": lifeline_open,
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sighup_default": signal.getsignal(signal.SIGHUP) == signal.SIG_DFL,
    "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
}, open(sys.argv[1], "w"))
sys.exit(7)
"""

DRIVER = """
import json, os, signal, sys, tempfile
os.environ["OMP_NUM_THREADS"] = "1"
folder = sys.argv[1]
sys.path.insert(0, folder)
from validate import harness
tempfile.gettempdir()  # cached here, as a parent that made temporary files has it
signal.signal(signal.SIGTERM, lambda *a: None)  # as run_matrix's handlers in the parent
signal.signal(signal.SIGHUP, lambda *a: None)
signal.signal(signal.SIGINT, lambda *a: None)  # as pytest's or a CLI's own
for mode in ("exec", "fork"):
    if mode == "fork":
        harness.fork_launchers(workers=())
    os.makedirs(f"{folder}/tmp-{mode}")
    read, write = os.pipe()  # stands for the janitor's pipe
    env = {**os.environ, "TMPDIR": f"{folder}/tmp-{mode}", "PROBE_RUN": mode, "PROBE_LIFELINE": str(write),
           "PROBE_PARENT": str(os.getpid()), "PYTHONPATH": os.pathsep.join([folder, os.environ["PYTHONPATH"]])}
    with open(f"{folder}/{mode}.log", "w") as log:
        proc = harness._start([sys.executable, "-m", "probe_launcher", f"{folder}/{mode}.json", "x"], log, env, write)
    code = proc.wait()
    print(json.dumps({"mode": mode, "type": type(proc).__name__, "code": code, "log": open(f"{folder}/{mode}.log").read(),
                      "probe": json.load(open(f"{folder}/{mode}.json"))}))
"""


def test_a_forked_launcher_starts_as_a_new_interpreter(tmp_path):
    (tmp_path / "probe_launcher.py").write_text(PROBE)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    runs = {r["mode"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert runs["exec"]["type"] == "Popen" and runs["fork"]["type"] == "_Forked"
    for mode, run in runs.items():
        assert run["code"] == 7 and run["log"] == "to the log\n", run
        probe = run["probe"]
        assert probe == {
            "name": "__main__", "argv": [str(tmp_path / f"{mode}.json"), "x"], "own_session": True, "parent": True,
            "run": mode, "tmp": str(tmp_path / f"tmp-{mode}"), "deathsig": 9, "lifeline_open": False,
            "sigterm_default": True, "sighup_default": True, "sigint_raises": True,
        }  # fmt: skip
