"""Every `$ zeroplan ...` line in a fenced block of README.md and docs/ prints what the block shows.

The comparison rule (exact lines; `...` alone elides lines; a line ending in ` ...` is a prefix) is in
tests/clicheck.py and docs/index.md. Each distinct command runs once per session (README and docs share
several); `validate` blocks start real ranks and carry the `distributed` marker. When an intended change
moves a number, rewrite every block from the current code and review the diff:

    PYTHONPATH=$PWD python benchmarks/regen_console_blocks.py
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

import pytest

from clicheck import (
    CONSOLE_INPUTS,
    ELIDED,
    ROOT,
    console_blocks,
    console_files,
    console_matches,
    console_workdir,
    output_lines,
    regenerate_block,
    run_console,
)

BLOCKS = console_blocks()
REGEN = "PYTHONPATH=$PWD python benchmarks/regen_console_blocks.py"
# Blocks known stale on main in a page another change owns, by their exact text: each fails (strict
# xfail) until that text changes; any edit of the block (by hand or by REGEN) makes the test plain again.
# docs/plan.md is rewritten with the plan output (issue 16, "The plan"); regenerate it after that merge.
STALE_ELSEWHERE: dict[str, set[str]] = {}


def _digest(block) -> str:
    return hashlib.sha1("\n".join([block.command, *block.expected]).encode()).hexdigest()[:12]


# Each distinct `validate` command is one of the session's background jobs (tests/background.py: started at
# collection, niced, its launchers forked, while the other tests run; this module runs last). They name no file
# of the scratch directory (asserted), so they run where the session does.
BACKGROUND_CLI = {f"validate-{i}": list(argv[1:]) for i, argv in
                  enumerate(dict.fromkeys(tuple(b.argv) for b in BLOCKS if b.argv[0] == "validate"))}  # fmt: skip


@pytest.fixture(scope="module")
def console(request, tmp_path_factory, background):
    """``console(block)`` -> output lines of the block's command, each distinct command run once."""
    from background import cli_job, key

    workdir = console_workdir(tmp_path_factory.mktemp("console"))

    @functools.cache
    def output(command: str) -> tuple[str, ...]:
        block = next(b for b in BLOCKS if b.command == command)
        if block.argv[0] != "validate":
            return tuple(output_lines(run_console(block.argv, workdir)))
        assert not set(block.argv) & set(CONSOLE_INPUTS), block.where
        name = next(n for n, args in BACKGROUND_CLI.items() if args == block.argv[1:])
        out = background.result(key(request.module, name), cli_job(BACKGROUND_CLI[name]))
        assert out["returncode"] == 0, f"zeroplan {block.command}: exit {out['returncode']}\n{out['stdout']}{out['stderr']}"
        return tuple(output_lines(out["stdout"]))

    return lambda block: list(output(block.command)), workdir


def _param(block, stale_fails: bool = True):
    marks = [pytest.mark.distributed] if block.argv[0] == "validate" else []
    if stale_fails and _digest(block) in STALE_ELSEWHERE.get(str(block.path.relative_to(ROOT)), ()):
        marks.append(pytest.mark.xfail(reason=f"stale on main, owned elsewhere: run {REGEN}", strict=True))
    return pytest.param(block, id=block.where, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_console_block_prints_what_the_docs_show(console, block):
    output, workdir = console
    actual = output(block)
    assert console_matches(block.expected, actual), (
        f"{block.where}: `{block.command}` no longer prints what the block shows; after review run {REGEN}\n"
        + "\n".join(block.expected) + "\n--- printed now ---\n" + "\n".join(actual)
    )  # fmt: skip
    if not block.expected and "--out" in block.argv:  # a command that prints nothing wrote its file
        out = workdir / block.argv[block.argv.index("--out") + 1]
        assert out.stat().st_size > 0


NUMBERED = [b for b in BLOCKS if any(re.search(r"\d", e) for e in b.expected)]


@pytest.mark.parametrize("block", [_param(b, stale_fails=False) for b in NUMBERED])
def test_changing_any_number_a_block_shows_fails_it(console, block):
    # The rule elides lines and line ends only where the block says `...`: each number shown is compared.
    output, _ = console
    actual = output(block)
    for i, line in enumerate(block.expected):
        for number in re.finditer(r"\d+", line):
            end = number.end() - 1
            changed = line[:end] + str((int(line[end]) + 1) % 10) + line[end + 1:]
            mutated = [*block.expected[:i], changed, *block.expected[i + 1:]]
            assert not console_matches(mutated, actual), f"{block.where}:{i + 1} {changed!r} still matches"


def test_every_console_line_of_the_docs_is_collected():
    # A `$ zeroplan` line outside a fence, or in a fence the parser skips, would be a block no test runs.
    dollar_lines = sum(p.read_text().count("\n$ zeroplan ") for p in console_files())
    assert len(BLOCKS) == dollar_lines
    assert {b.path.name for b in BLOCKS} >= {"README.md", "estimate.md", "plan.md", "sweep.md", "validate.md"}


@pytest.mark.parametrize("expected, actual, ok", [
    (["a 1", "b 2"], ["a 1", "b 2", ""], True),  # trailing blank lines and spaces are ignored
    (["a 1", "b 2"], ["a 1", "b 3"], False),
    (["a 1", ELIDED], ["a 1", "b 2", "c 3"], True),  # `...` elides any number of lines
    ([ELIDED, "c 3"], ["a 1", "b 2", "c 3"], True),
    (["a 1", ELIDED, "c 3"], ["a 1", "c 3"], True),  # ... including none
    (["a 1", "c 3"], ["a 1", "b 2", "c 3"], False),  # but only where it is written
    (["a 1", ELIDED], ["a 2", "b 2"], False),
    (["long line 1 ..."], ["long line 1 and more"], True),  # a prefix line
    (["long line 1 ..."], ["long line 2 and more"], False),
    (["long line 1 ..."], ["long line 1 and more", "next"], False),  # a prefix line is one line
    ([], [], True),
    ([], ["printed"], False),  # a block without output promises the command prints nothing
])  # fmt: skip
def test_the_comparison_rule(expected, actual, ok):
    assert console_matches(expected, actual) is ok


def test_regeneration_keeps_what_a_block_elides():
    old = ("head 1", "", "row a 10", ELIDED, "Recommendation: take 3 of ...", ELIDED, "tail 7")
    new = ["head 2", "", "row a 11", "row b 12", "Recommendation: take 4 of 5 options", "x", "tail 8"]
    assert regenerate_block(old, new) == ["head 2", "", "row a 11", ELIDED, "Recommendation: take 4 of ...",
                                          ELIDED, "tail 8"]  # fmt: skip
    assert console_matches(regenerate_block(old, new), new)
    assert regenerate_block(("a 1", "b 2"), ["a 1", "b 3", "c"]) == ["a 1", "b 3", "c"]


def test_the_docs_say_the_rule_and_the_command():
    index = (ROOT / "docs" / "index.md").read_text()
    assert "benchmarks/regen_console_blocks.py" in index and "`...`" in index
    assert Path(ROOT / "benchmarks" / "regen_console_blocks.py").is_file()
