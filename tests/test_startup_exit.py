"""How a ``zeroplan`` process ends (``zeroplan.cli_exit``; docs/benchmarks.md, "2026-12-03, fifth session,
startup3"): a one-answer command run as the process's command skips the interpreter's teardown and nothing else; the
answer, the exit code, stderr and ``atexit``'s functions are as before. Each case runs in a fresh interpreter."""

import re
import subprocess
import sys

import pytest

PLAN = ["plan", "--model", "llama2-7b", "--gpus", "8", "--gpu", "a100-40gb"]
ESTIMATE = ["estimate", "--params", "7.5e9", "--gpus", "64"]

WATCHED = """
import atexit, os, sys
end_now = os._exit
def watched(code):  # the process ends here, without the teardown
    os.write(2, b"os._exit(%d)\\n" % code)
    end_now(code)
os._exit = watched
atexit.register(lambda: os.write(2, b"atexit ran\\n"))
sys.argv = ["zeroplan", *ARGV]
BEFORE
from zeroplan.cli_exit import ended
from zeroplan.cli import main
ENDING
"""


def fresh(argv: list[str], ending: str = "ended(main)", before: str = "") -> subprocess.CompletedProcess:
    code = WATCHED.replace("ARGV", repr(argv)).replace("ENDING", ending).replace("BEFORE", before)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


@pytest.mark.parametrize("argv", [PLAN, ESTIMATE, ["estimate", "--params", "7.5e9", "--gpus", "0"], ["--help"],
                                  ["plan", "--help"], ["plan", "--gpus", "8", "--bogus"]])
def test_a_one_answer_command_ends_as_before_less_the_teardown(argv):
    quick, plain = fresh(argv), fresh(argv, "main()")
    assert (quick.returncode, quick.stdout) == (plain.returncode, plain.stdout)
    assert plain.stderr.endswith("atexit ran\n") and "os._exit" not in plain.stderr
    assert quick.stderr == f"{plain.stderr}os._exit({quick.returncode})\n"
    assert quick.returncode == (2 if "0" in argv or "--bogus" in argv else 0)


def test_the_console_script_and_python_m_end_so():
    quick = fresh(ESTIMATE, "__import__('zeroplan.cli').cli.command()")
    assert quick.returncode == 0 and "P_os+g+p" in quick.stdout and quick.stderr == "atexit ran\nos._exit(0)\n"
    module = subprocess.run([sys.executable, "-m", "zeroplan.cli", *ESTIMATE], capture_output=True, text=True)
    assert (module.returncode, module.stdout, module.stderr) == (0, quick.stdout, "")


def test_other_commands_and_a_thread_left_running_end_with_the_teardown(tmp_path):
    out = tmp_path / "s.csv"
    sweep = fresh(["sweep", "--params", "1e9", "--gpus", "8", "--out", str(out)])  # writes a file: not one answer
    assert sweep.returncode == 0 and sweep.stderr == "atexit ran\n" and out.exists()
    # the thread must outlive the command even on a loaded machine (0.3 s did not, once: the estimate took longer
    # and ended by os._exit, as it should with no thread left), so it sleeps 2 s
    running = "import threading, time\nthreading.Thread(target=time.sleep, args=(2.0,)).start()\n"
    waited = fresh(ESTIMATE, before=running)
    assert waited.returncode == 0 and waited.stderr == "atexit ran\n"


def test_a_flush_that_fails_is_the_interpreters_to_report():
    # stdout that cannot be flushed at exit (set by an atexit function): the interpreter's exit reports it and
    # exits 120, as it did (a write that fails during the command is click's: it pacifies the streams, exit 1)
    failing = ("import io\nclass Closed(io.StringIO):\n    def flush(self):\n        raise BrokenPipeError(32, 'pipe')\n"
               "atexit.register(lambda: setattr(sys, 'stdout', Closed()))\n")
    quick, plain = fresh(ESTIMATE, before=failing), fresh(ESTIMATE, "main()", before=failing)
    assert quick.returncode == plain.returncode == 120
    assert re.sub("0x[0-9a-f]+", "", quick.stderr) == re.sub("0x[0-9a-f]+", "", plain.stderr)  # the stream's id
    assert "BrokenPipeError" in quick.stderr and "os._exit" not in quick.stderr
