"""The CLI tests' shared helpers: invoke a command in-process, read its JSON, the one check every test
of bad input makes (exit 2, nothing on stdout, one line on stderr), and the console blocks of the docs
(find, run, compare and rewrite them: tests/test_docs_console.py, benchmarks/regen_console_blocks.py)."""

import difflib
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from zeroplan.cli import app

runner = CliRunner()


def run(*args: str):
    """``zeroplan ARGS`` in-process (typer's CliRunner)."""
    return runner.invoke(app, list(args))


def run_json(*args: str) -> dict:
    """``zeroplan ARGS --json``, which must succeed, parsed."""
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_one_line_error(result, message: str) -> None:
    """``result`` of CliRunner.invoke failed as the README promises, with ``message`` in its one line."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroplan: error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.output


# ---------------------------------------------------------------------------------------------------------
# Console blocks in README.md and docs/: every `$ zeroplan ...` line is run and its output compared.
#
# The rule for what may differ (docs/index.md "Console blocks"): a block shows a command's stdout exactly,
# line for line, with trailing spaces and trailing blank lines ignored, except that
#   - a line that is `...` alone stands for any number of lines (zero or more) the block leaves out;
#   - a line ending in ` ...` stands for one line that starts with the text before ` ...`.
# Nothing else is fuzzy: every number a block shows must be printed by the current code, so a command
# whose output is not reproducible (a measured time) must leave that line out with `...`. A command with
# no output lines must print nothing (and write its `--out` file). Relative input files named in a block
# are the repository's files in CONSOLE_INPUTS; the commands run in a scratch directory that links them.
# Regenerate every block from the current code: `python benchmarks/regen_console_blocks.py`.


ROOT = Path(__file__).resolve().parents[1]
ELIDED = "..."
PREFIX_MARK = " ..."
# name a block uses -> the repository file it means (linked into the scratch directory)
CONSOLE_INPUTS = {"ds_config.json": "tests/data/golden/inputs/ds_config.json", "notebooks": "notebooks",
                  "ds_config_auto.json": "tests/data/integrations/ds_configs/accelerate_zero_stage3.json",
                  "accelerate_fsdp2.yaml": "tests/data/integrations/accelerate/fsdp2_llama.yaml",
                  "torchtitan_qwen3.toml": "tests/data/integrations/torchtitan/qwen3_32b.toml",
                  "llama3_8b.toml": "tests/data/integrations/torchtitan/llama3_8b.toml",
                  "qwen3-8b.json": "tests/data/hf_configs/qwen3-8b.json"}


@dataclass(frozen=True)
class ConsoleBlock:
    """One `$ zeroplan ...` line of a fenced block and the output lines the document shows under it."""

    path: Path
    line: int  # 1-based line of the `$` line
    command: str  # without the `$ ` and without a trailing `# comment`
    expected: tuple[str, ...]
    body: tuple[int, int]  # 0-based [start, end) of the output lines in the file

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.command, comments=True)
        assert words[0] == "zeroplan", self
        return words[1:]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def console_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def console_blocks(root: Path = ROOT) -> list[ConsoleBlock]:
    """Every `$ zeroplan` command in a fenced block of README.md and docs/**/*.md, in file order."""
    blocks = []
    for path in console_files(root):
        lines = path.read_text().splitlines()
        fence = None
        for i, line in enumerate(lines):
            if line.lstrip().startswith("```"):
                fence = None if fence is not None else i
                continue
            if fence is None or not line.startswith("$ zeroplan "):
                continue  # another `$ ` command (pip, python) ends the block above it and is not run
            end = i + 1
            while end < len(lines) and not lines[end].lstrip().startswith(("```", "$ ")):
                end += 1
            command = line[2:].split("  #")[0].strip()
            blocks.append(ConsoleBlock(path, i + 1, command, tuple(lines[i + 1:end]), (i + 1, end)))
    return blocks


def _line_matches(expected: str, actual: str) -> bool:
    if expected.endswith(PREFIX_MARK):
        return actual.startswith(expected[: -len(PREFIX_MARK)].rstrip())
    return expected.rstrip() == actual.rstrip()


def output_lines(stdout: str) -> list[str]:
    lines = [line.rstrip() for line in stdout.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def console_matches(expected: list[str] | tuple[str, ...], actual: list[str]) -> bool:
    """Whether ``actual`` (output_lines) is what ``expected`` shows, by the rule atop this section."""
    expected, actual = output_lines("\n".join(expected)), output_lines("\n".join(actual))
    # reach[j]: the first i expected lines can match the first j actual lines
    reach = [True] + [False] * len(actual)
    for e in expected:
        if e == ELIDED:
            for j in range(1, len(actual) + 1):
                reach[j] = reach[j] or reach[j - 1]
        else:
            reach = [False] + [reach[j] and _line_matches(e, actual[j]) for j in range(len(actual))]
    return reach[len(actual)]


def run_console(argv: list[str], cwd: Path) -> str:
    """stdout of ``zeroplan ARGV`` in ``cwd``, in-process; `validate` as tests/background.py ``zeroplan`` runs it
    (its ranks are the launcher's forked children either way; a child process would import torch and the
    validator again, ~4-5 CPU-s: issue 16, the suite's time budget).

    AssertionError if the command fails (exit status not 0)."""
    from background import zeroplan

    here = os.getcwd()
    os.chdir(cwd)
    try:
        result = zeroplan(*argv) if argv[0] == "validate" else run(*argv)
    finally:
        os.chdir(here)
    code = result.returncode if argv[0] == "validate" else result.exit_code
    assert code == 0, f"zeroplan {shlex.join(argv)}: exit {code}\n{result.stdout}{result.stderr}"
    return result.stdout


def console_workdir(path: Path, root: Path = ROOT) -> Path:
    """``path`` made a scratch directory holding links to CONSOLE_INPUTS."""
    path.mkdir(parents=True, exist_ok=True)
    for name, target in CONSOLE_INPUTS.items():
        link = path / name
        if not link.exists():
            link.symlink_to(root / target)
    return path


def _key(line: str) -> str:
    """A line with numbers and column spacing masked: the same line of a later output has the same key."""
    return re.sub(r"\s+", " ", re.sub(r"\d+", "0", line)).strip()


def _find_key(line: str, actual: list[str], start: int) -> int | None:
    """Index of the first line of ``actual[start:]`` that is ``line`` with its numbers changed, or None."""
    key = _key(line[: -len(PREFIX_MARK)] if line.endswith(PREFIX_MARK) else line)
    return next((j for j in range(start, len(actual)) if _key(actual[j]).startswith(key)), None)


def _find(line: str, actual: list[str], start: int) -> int:
    """Index of the line of ``actual[start:]`` that an old shown line ``line`` most likely became."""
    found = _find_key(line, actual, start)
    if found is not None:
        return found
    scores = [(difflib.SequenceMatcher(None, line, actual[j]).ratio(), -j) for j in range(start, len(actual))]
    best = max(scores, default=(0.0, 0))
    if best[0] < 0.5:
        raise ValueError(f"no line of the new output resembles {line!r}: edit this block by hand")
    return -best[1]


def _cut_like(old: str, new: str) -> str:
    """``new`` cut after as many words as the shown prefix ``old`` (ending in ` ...`) had."""
    words = len(old[: -len(PREFIX_MARK)].split())
    ends = [m.end() for m in re.finditer(r"\S+", new)]
    return new if len(ends) <= words else new[: ends[words - 1]] + PREFIX_MARK


def _run_span(shown: list[str], actual: list[str], cursor: int, first: bool, last: bool) -> tuple[int, int]:
    """[start, end) in ``actual`` of a run of shown lines; ``first``/``last``: no `...` before/after it."""
    if first:
        start = 0
    else:
        start = _find_key(shown[0], actual, cursor)
        if start is None:
            start = max(cursor, len(actual) - len(shown)) if last else _find(shown[0], actual, cursor)
    if last:
        return start, len(actual)
    end = _find_key(shown[-1], actual, start) if len(_key(shown[-1])) >= 3 else None
    if end is None or end - start > len(shown) + 20:  # a run grows or shrinks by a few lines (a new row)
        return start, min(start + len(shown), len(actual))
    return start, end + 1


def regenerate_block(expected: tuple[str, ...], actual: list[str]) -> list[str]:
    """The block's lines rewritten from ``actual`` (output_lines), keeping what it elides and where.

    A block that still matches is returned unchanged. Each run of shown lines between `...` markers is
    found again in the new output: the first run starts at the first line (unless the block starts with
    `...`), the last ends at the last line (unless it ends with `...`); other ends are the lines whose text,
    numbers masked, is the old first and last line's. Prefix lines stay cut after as many words. Review
    the diff."""
    old = [e.rstrip() for e in expected]
    while old and not old[-1]:
        old.pop()
    if console_matches(old, actual):
        return list(expected)
    runs: list[list[str]] = [[]]
    for e in old:
        if e == ELIDED:
            runs.append([])
        else:
            runs[-1].append(e)
    out, cursor = [], 0
    for n, shown in enumerate(runs):
        if n:
            out.append(ELIDED)
        if not shown:
            continue
        start, end = _run_span(shown, actual, cursor, n == 0, n == len(runs) - 1)
        prefixes = [o for o in shown if o.endswith(PREFIX_MARK)]
        for line in actual[start:end]:
            cut = next((o for o in prefixes if _find_key(o, [line], 0) == 0), None)
            out.append(_cut_like(cut, line) if cut else line)
        cursor = end
    return out
