"""How long `zeroplan estimate` takes end to end, against `python -c "import torch"` in the same run.

Target (issue: planner core): under a quarter of the torch import. Run: python benchmarks/cli_latency.py
Each command runs as a fresh process, alternating, several times; medians are compared because this
machine is shared and noisy. Both the wall time and the CPU time (user + sys of the child, from
``getrusage(RUSAGE_CHILDREN)``) are printed; the ratios use CPU time, which a loaded machine inflates far
less than wall time. zeroplan's modules are byte-compiled first (``byte_compile``), as ``pip install``
leaves them: with ``PYTHONDONTWRITEBYTECODE`` set and no ``__pycache__``, every run would compile the
package from source (about 0.1 CPU-s), which an installed ``torch`` never does; and each zeroplan command runs once
untimed with bytecode writing on (``warm_generated_code``), as after an installed zeroplan's first command.
"""

from __future__ import annotations

import compileall
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPEATS = 7
ZEROPLAN = shutil.which("zeroplan") or "zeroplan"
COMMANDS = {
    "zeroplan estimate": [ZEROPLAN, "estimate", "--params", "7.5e9", "--gpus", "64"],
    "import zeroplan.cli": [sys.executable, "-P", "-c", "import zeroplan.cli"],  # -P: not the cwd's checkout first
    "zeroplan plan --json (7b)": [ZEROPLAN, "plan", "--model", "llama2-7b", "--gpus", "8", "--gpu", "a100-40gb",
                                  "--json"],
    "zeroplan --help": [ZEROPLAN, "--help"],  # the whole group's help, through rich (typer's help formatter)
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
}
"""Issue 16: the estimate start-up (target < 0.25 of the torch import), the CLI module's import that every command
pays (``import zeroplan.cli``: typer and the option blocks, no pydantic), a small plan's JSON and the group's
``--help``."""


def wall_and_cpu_s(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + sys) of one run of ``argv`` as a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def compare(commands: dict[str, list[str]], repeats: int) -> dict[str, float]:
    """Run each command ``repeats`` times, alternating; print the median wall and CPU time of each and return
    the median CPU seconds."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, argv in commands.items():
            times[name].append(wall_and_cpu_s(argv))
    cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    for name, t in times.items():
        wall = statistics.median(w for w, _ in t)
        print(f"{name:30s} CPU median {cpu[name] * 1e3:6.0f} ms, wall median {wall * 1e3:6.0f} ms "
              f"({repeats} runs)")
    return cpu


def byte_compile() -> None:
    """Write the ``__pycache__`` of the zeroplan that runs (ignored by git), as an installed package has."""
    import zeroplan

    compileall.compile_dir(os.path.dirname(zeroplan.__file__), quiet=1)


def with_before(commands: dict[str, list[str]], before: str) -> dict[str, list[str]]:
    """Each zeroplan command twice: as it is, and with the checkout ``before`` first on PYTHONPATH (interleaved,
    so that both share the machine's load)."""
    out: dict[str, list[str]] = {}
    for name, argv in commands.items():
        out[name] = argv
        if "torch" not in name:
            out[f"before: {name}"[:30]] = ["env", f"PYTHONPATH={before}", *argv]
    return out


def medians_of(commands: dict[str, list[str]], repeats: int, before: str | None = None) -> dict[str, float]:
    """``compare``'s CPU medians of ``commands``, byte-compiled as installed; with ``before`` (another checkout)
    each zeroplan command also run from it (``with_before``)."""
    byte_compile()
    if before is not None:
        compileall.compile_dir(os.path.join(before, "zeroplan"), quiet=1)
        commands = with_before(commands, before)
    warm_generated_code(commands)
    return compare(commands, repeats)


def warm_generated_code(commands: dict[str, list[str]]) -> None:
    """Each zeroplan command run once with bytecode writing on, untimed, as an installed package's first run leaves
    it: ``cli_startup.CodeCache`` keeps the code dataclasses and typing generate in ``__pycache__`` beside the
    bytecode (docs/benchmarks.md, "2026-12-03, startup"); with ``PYTHONDONTWRITEBYTECODE`` set (this machine) no
    run would ever write it, which no installed zeroplan sees past its first command."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for name, argv in commands.items():
        if "torch" not in name:
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)  # ``env PYTHONPATH=...``: its own


def main() -> None:
    """Run: python benchmarks/cli_latency.py [--before DIR] (DIR: another checkout, e.g. ``git worktree add``)."""
    before = os.path.abspath(sys.argv[sys.argv.index("--before") + 1]) if "--before" in sys.argv else None
    medians = medians_of(COMMANDS, REPEATS, before)
    torch_s = medians['python -c "import torch"']
    for name, m in medians.items():
        print(f"{name:30s} {m / torch_s:5.3f}x the torch import (CPU time)")
    ratio = medians["zeroplan estimate"] / torch_s
    print(f"CPU-time ratio zeroplan estimate / import torch: {ratio:.3f} (target < 0.25)")


if __name__ == "__main__":
    main()
