"""Every stored golden output (`tests/golden.py`) is printed again, byte for byte.

Guards refactorings: no number, key, key order, column or line of `estimate`, `plan` and `sweep` may
change unnoticed. To change an output on purpose, regenerate explicitly (see `tests/golden.py`).
"""

import csv
import io
import json

import pytest

from golden import COMMANDS, GOLDEN, run


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_output_equals_the_stored_one(name):
    expected = (GOLDEN / name).read_text()
    got = run(COMMANDS[name])
    if name.endswith(".json"):
        # Parsed first, so a failure names the differing value; then the bytes (key order, layout).
        assert json.loads(got) == json.loads(expected)
    elif name.endswith(".csv"):
        assert list(csv.reader(io.StringIO(got))) == list(csv.reader(io.StringIO(expected)))
    assert got == expected


def test_every_stored_file_has_a_command():
    stored = {p.name for p in GOLDEN.iterdir() if p.is_file()}
    assert stored == set(COMMANDS)
