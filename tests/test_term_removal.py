"""benchmarks/term_removal.py (issue 16: drop each named term, does a test catch it?) can only count what its
patch reaches: ``peak.rounded_total``, the sum every peak makes. Its patch patched ``Moment.total`` until a
speed-up (049a051) made ``peak_of`` sum without it, and the script then reported "0 of 0" for every engine.
This checks, on one recorded row of each engine, that the patch sees the row's terms and that dropping its
largest one moves the prediction and fails the row's check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def term_removal():
    spec = importlib.util.spec_from_file_location("term_removal", ROOT / "benchmarks" / "term_removal.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("term_removal", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("engine", ["reference", "fsdp2", "deepspeed"])
def test_dropping_a_rows_largest_term_moves_its_prediction_and_fails_its_check(term_removal, engine):
    M = term_removal.M
    row = M.load(engine)["rows"][0]
    sizes = term_removal.term_sizes([row])
    assert sizes, "the patch sees no term of the prediction"
    largest = max(sizes, key=sizes.get)
    baseline = term_removal._checked(row, M.predict(row))
    assert M.check_record(row) == []
    with term_removal.without(largest):
        assert term_removal._checked(row, M.predict(row)) != baseline
        assert M.check_record(row), f"{row['name']}: dropping {largest!r} ({sizes[largest]:,} B) passed"
    assert term_removal._checked(row, M.predict(row)) == baseline  # restored


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_dropping_a_draws_largest_term_fails_its_draw_check(term_removal, engine, tmp_path):
    """The differential draws' count (``draws_table``) reaches the replayed prediction, and ``draw_misses`` fails
    when the largest term that changes it is dropped."""
    from tests.test_differential import draw_misses

    record = next(r for r in term_removal.draw_records() if r["draw"]["engine"] == engine)
    sizes = term_removal.term_sizes([[record]], lambda rs: term_removal.replay_all(rs, tmp_path))
    assert sizes, "the patch sees no term of the replayed prediction"
    (got,) = term_removal.replay_all([record], tmp_path)
    assert draw_misses(record, got) == []
    for name in sorted(sizes, key=sizes.get, reverse=True):  # the largest term in some phase's largest moment
        with term_removal.without(name):
            (dropped,) = term_removal.replay_all([record], tmp_path)
        if dropped.predicted != got.predicted:
            break
    assert draw_misses(record, dropped), f"{record['name']}: dropping {name!r} ({sizes[name]:,} B) passed"
