"""Every notebook in notebooks/ runs top to bottom, without a GPU or network, under plain `pytest`.

Executed with nbclient in the notebook's own directory (so relative data paths work) and
MPLBACKEND=agg (tests/conftest.py); a cell that raises fails the test with that cell's error.
"""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120


def test_the_three_capacity_planning_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_will_70b_fit.ipynb",
        "02_stage_tradeoffs.ipynb",
        "03_predicted_vs_measured.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
    assert os.environ.get("MPLBACKEND") == "agg"
    book = nbformat.read(path, as_version=4)
    # Committed without outputs: what a reader opens is what this test runs, not stale results.
    assert all(
        not c.get("outputs") and c.get("execution_count") is None for c in book.cells if c.cell_type == "code"
    )
    NotebookClient(
        book,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    images = [
        o for c in book.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})
    ]
    assert images, "every notebook shows at least one figure"
