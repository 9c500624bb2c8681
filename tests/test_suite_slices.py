"""The suite's CI slices (tests/suite_slices.py): a slice keeps the matrix's order, names only rows the
matrix has, and benchmarks/full_matrices.py finds every module that slices one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.suite_slices import FULL_ENV, ci_slice

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(os.environ.get(FULL_ENV) == "1", reason=f"{FULL_ENV}=1 runs every row: no slice to check")
def test_a_slice_keeps_the_matrix_order_and_refuses_unknown_rows():
    assert ci_slice([4, 1, 3, 2], [2, 4]) == [4, 2]
    with pytest.raises(ValueError, match=r"does not have: \[5\]"):
        ci_slice([1, 2], [2, 5])


def test_full_matrices_env_runs_every_row():
    code = "from tests.suite_slices import ci_slice; print(ci_slice([1, 2, 3], [2]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, FULL_ENV: "1"}).stdout  # fmt: skip
    assert out.strip() == "[1, 2, 3]"


def test_the_benchmark_finds_every_sliced_module():
    spec = importlib.util.spec_from_file_location("full_matrices", ROOT / "benchmarks" / "full_matrices.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.sliced_modules() == ["tests/test_deepspeed_engine.py", "tests/test_fsdp2_engine.py",
                                       "tests/test_offload_deepspeed_run.py", "tests/test_peak.py"]  # fmt: skip
