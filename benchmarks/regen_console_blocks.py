"""Rewrite every `$ zeroplan ...` console block of README.md and docs/ from the current code.

    PYTHONPATH=$PWD python benchmarks/regen_console_blocks.py            # rewrite, list what changed
    PYTHONPATH=$PWD python benchmarks/regen_console_blocks.py --check    # exit 1 if a block is stale
    PYTHONPATH=$PWD python benchmarks/regen_console_blocks.py --skip-validate

Each distinct command runs once (in a scratch directory linking the inputs blocks name). A block that still
matches its output (tests/test_docs_console.py's rule) is left byte for byte; a stale one is rewritten,
keeping the lines it elides with `...` and the prefix lines it cuts with ` ...` (tests/clicheck.py,
regenerate_block). `validate` blocks start real ranks (about a minute on 2 CPU cores). Review `git diff`:
prose next to a block that quotes its numbers is not rewritten.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from clicheck import (  # noqa: E402
    console_blocks,
    console_workdir,
    output_lines,
    regenerate_block,
    run_console,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a block is stale")
    parser.add_argument("--skip-validate", action="store_true", help="leave `zeroplan validate` blocks alone")
    args = parser.parse_args()
    blocks = [b for b in console_blocks() if not (args.skip_validate and b.argv[0] == "validate")]
    outputs: dict[str, list[str]] = {}
    stale = []
    with tempfile.TemporaryDirectory() as scratch:
        workdir = console_workdir(Path(scratch))
        for block in blocks:
            if block.command not in outputs:
                outputs[block.command] = output_lines(run_console(block.argv, workdir))
            new = regenerate_block(block.expected, outputs[block.command])
            if list(new) != list(block.expected):
                stale.append((block, new))
    # Rewrite bottom-up within each file so earlier line numbers stay valid.
    for block, new in sorted(stale, key=lambda s: (str(s[0].path), -s[0].line)):
        print(f"{'stale' if args.check else 'rewrote'} {block.where}: {block.command}")
        if not args.check:
            lines = block.path.read_text().split("\n")
            start, end = block.body
            lines[start:end] = new
            block.path.write_text("\n".join(lines))
    print(f"{len(blocks)} blocks, {len(outputs)} commands, {len(stale)} stale")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
