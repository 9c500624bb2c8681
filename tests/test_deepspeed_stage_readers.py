"""Issue 16, row 1: DeepSpeed's optimizer wrapper is chosen once (settings.py ``optimizer_class``, wrapper.py
``wrapper_for``) and the profile's phase, wrapper and offload modules ask it (``run.Wrapper``, its ``offload``:
offload_terms.py ``WrapperOffload``, offload_wrappers.py), never the ZeRO stage. Checked on the source (``ast``,
nothing imported): a comparison that reads the stage (``s.stage == 3``, ``settings.stage in (1, 2)``, ``stage != 3``)
in zeroplan/engines/deepspeed/ outside the readers of the settings and the config fails. A stage only printed
(``f"ZeRO-{s.stage}"``) or passed on is not a test."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zeroplan" / "engines" / "deepspeed"

READERS: dict[str, str] = {
    # module -> why it reads the stage: the settings and the config, where DeepSpeed reads it too
    "settings.py": "the stage decides the wrapper (optimizer_class), partition_gradients, overlap_comm's default and "
                   "the refusals (engine.py _configure_optimizer, config.py overlap_comm_valid)",
    "config.py": "parse_ds_config reads zero_optimization.stage and the keys of that stage",
    "offload_settings.py": "check_offload refuses offload_param and ratio below ZeRO-3 (runtime/zero/offload_config.py)",
    "zeropp_settings.py": "refuses the ZeRO++ keys below ZeRO-3 (ZeRO++ is stage3.py's)",
    "nvme.py": "check_nvme refuses nvme below ZeRO-3 (stage_1_and_2.py has no swapper), called by check_offload",
    "plan.py": "the planner makes its candidates stage by stage and reads the file's stage",
    "build.py": "at_stage: the build fields a plan's row writes at its stage (zero.Init partitions at ZeRO-3 only)",
}
STILL_TESTING: dict[str, str] = {
    # module -> why it still tests the stage outside the readers (to be moved onto the wrapper; the list only shrinks):
    # none left (estimator.py's ds_estimate_bytes is Wrapper.ds_estimate, terms.py's persistent_numel ZeRO-3's own)
}


def _reads_stage(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "stage") or (isinstance(node, ast.Name) and node.id == "stage")


def stage_tests(source: str) -> list[int]:
    """The lines of ``source`` where a comparison reads the stage."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
                  and any(_reads_stage(n) for n in (node.left, *node.comparators)))


def _offenders() -> dict[str, list[int]]:
    found = {p.name: stage_tests(p.read_text()) for p in sorted(PACKAGE.glob("*.py"))}
    return {name: lines for name, lines in found.items() if lines and name not in READERS}


def test_only_the_readers_test_the_stage():
    """Every other module asks the run's wrapper (``run.wrapper``, ``wrapper_for``): the 16 tests of the stage in the
    offload modules, alloc_trace.py, estimator.py and terms.py on main went to it (2026-12-02, branch stagewrap)."""
    offenders = _offenders()
    assert {m: lines for m, lines in offenders.items() if m not in STILL_TESTING} == {}
    stale = set(STILL_TESTING) - set(offenders)
    assert not stale, f"no longer tests the stage, remove from STILL_TESTING: {sorted(stale)}"
    assert set(READERS) <= {p.name for p in PACKAGE.glob("*.py")}


def test_the_scan_finds_a_stage_test():
    """The check fails where it should: each form the offload modules had is found, a stage only printed is not."""
    source = ("def f(s, settings, stage, run):\n"
              "    a = s.stage == 3\n"
              "    b = settings.overlaps and settings.stage in (1, 2)\n"
              "    c = stage != 3\n"
              "    d = run.settings.stage < 3\n"
              "    return f'ZeRO-{s.stage}', g(stage=s.stage)\n")
    assert stage_tests(source) == [2, 3, 4, 5]
