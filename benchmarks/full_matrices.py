"""The suite's live matrices in full: every row CI leaves out of a covering slice (tests/suite_slices.py).

CI runs a covering slice of the largest real-engine matrices (issue 16: the suite's time budget); this runs
pytest on every module that slices one (those importing ``ci_slice``), with ``ZEROPLAN_FULL_MATRICES=1``, so
each runs all its rows with the same assertions. Extra arguments go to pytest. Timings: docs/benchmarks.md.

    PYTHONPATH=$PWD python benchmarks/full_matrices.py [-k nd4 ...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


IMPORT = re.compile(r"^from tests\.suite_slices import ci_slice\b", re.MULTILINE)


def sliced_modules() -> list[str]:
    """The test modules that declare a CI slice (found by their import of ``ci_slice``: none forgotten)."""
    modules = (ROOT / "tests").glob("test_*.py")
    return sorted(str(p.relative_to(ROOT)) for p in modules if IMPORT.search(p.read_text()))


def main(extra: list[str]) -> int:
    env = {**os.environ, "ZEROPLAN_FULL_MATRICES": "1"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *sliced_modules(), *extra]
    print(" ".join(argv[2:]), flush=True)
    return subprocess.call(argv, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
