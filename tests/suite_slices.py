"""What CI runs of the suite's largest live matrices, and how to run all of them (issue 16: the time budget).

Where a matrix of real-engine runs costs more than the suite's budget allows, CI runs a covering slice of
it, declared beside the matrix with the reason for each row kept: every setting of the matrix (stage,
dtype, bucket kind, optimizer, N_d, family) still runs live at least once. The rows left out are not
unchecked: each stays checked against its recorded measurement by tests/test_measured_rows.py (no run
needed), and all of them run live with ``ZEROPLAN_FULL_MATRICES=1``, which benchmarks/full_matrices.py
sets (docs/benchmarks.md, "The full matrices").
"""

from __future__ import annotations

import os

FULL_ENV = "ZEROPLAN_FULL_MATRICES"
FULL = os.environ.get(FULL_ENV, "") == "1"


def ci_slice(everything: list, kept: list) -> list:
    """``everything`` with ``ZEROPLAN_FULL_MATRICES=1``, else the items of ``kept`` in ``everything``'s order."""
    missing = [k for k in kept if k not in everything]
    if missing:
        raise ValueError(f"slice names rows the matrix does not have: {missing}")
    return list(everything) if FULL else [x for x in everything if x in kept]
