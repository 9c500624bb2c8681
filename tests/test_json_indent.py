"""``render.json_indent.dumps_indented`` writes ``json.dumps(obj, indent=n, allow_nan=False)``'s text, byte for byte
(every indented JSON output goes through it: ``render.schema_parts.json_text``), and raises its errors."""

from __future__ import annotations

import enum
import json
import random

import pytest

from zeroplan.render.json_indent import dumps_indented

STRINGS = ["", "a", 'q"uote', "back\\slash", "tab\tnew\nline", "é ü 中文 🙂", "\x00\x1f", "</script>", "nvlink4 + ib-ndr"]
NUMBERS = [0, -1, 7, 2**70, -(2**63), 0.0, -0.0, 0.1, 1e-7, 1e16, 1.5e300, 2.5, -3.25e-10, 123456789.123]


def _draw(rng: random.Random, depth: int) -> object:
    """A random JSON document: scalars, containers of scalars alone (the encoder's fast path) and nested ones."""
    pick = rng.random()
    if depth == 0 or pick < 0.35:
        return rng.choice([*STRINGS, *NUMBERS, True, False, None])
    if pick < 0.55:
        return {rng.choice(STRINGS) + str(i): rng.choice([*STRINGS, *NUMBERS, None]) for i in range(rng.randrange(4))}
    if pick < 0.7:
        return [rng.choice([*NUMBERS, True, None]) for _ in range(rng.randrange(4))]
    if pick < 0.85:
        return {f"k{i}": _draw(rng, depth - 1) for i in range(rng.randrange(1, 4))}
    items = [_draw(rng, depth - 1) for _ in range(rng.randrange(1, 4))]
    return tuple(items) if rng.random() < 0.3 else items


def test_random_documents_equal_json_dumps():
    rng = random.Random(16)
    for _ in range(400):
        doc, indent = _draw(rng, 5), rng.choice((0, 1, 2, 4))
        assert dumps_indented(doc, indent) == json.dumps(doc, indent=indent, allow_nan=False)


class Level(enum.IntEnum):
    LOW = 1


class Name(str, enum.Enum):
    A = "a"


@pytest.mark.parametrize("doc", [
    {1: "int key", "b": [1, 2]}, {"x": {2.5: None, True: 1}}, {"e": [Level.LOW, {"n": Name.A}]}, [{"s": {"a"}}],
    {"deep": [[[[[[1]]]]]], "empty": [{}, [], ""]}, 3.5, "top", None, [], {},
])  # fmt: skip
def test_other_keys_and_types_as_json_dumps(doc):
    """Keys that are not strings, enum members and sets (json.dumps's TypeError) go to json.dumps itself."""
    try:
        want = json.dumps(doc, indent=2, allow_nan=False)
    except TypeError as e:
        with pytest.raises(TypeError, match=str(e)):
            dumps_indented(doc, 2)
    else:
        assert dumps_indented(doc, 2) == want


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_floats_raise_as_json_dumps(bad):
    for doc in (bad, [1, bad], {"a": {"b": bad}}, {"a": [bad, [1]]}):
        with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
            dumps_indented(doc, 2)


def test_cycle_raises_as_json_dumps():
    doc: dict = {"a": [1, {}]}
    doc["a"][1]["again"] = doc
    with pytest.raises(ValueError, match="Circular reference detected"):
        dumps_indented(doc, 2)
