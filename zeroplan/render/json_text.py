"""The one JSON writer of every output (``json_text``), apart from the documents' models of ``render.schemas`` (which
re-exports it): a table that prints a ds_config writes it without loading the thirty document models (a speed-up,
no rule; docs/benchmarks.md, "2026-12-03, startup").

Indented text is ``json.dumps(obj, indent=indent, allow_nan=False)`` byte for byte, written faster where a document
repeats itself (a speed-up, no rule; docs/benchmarks.md, "seventh session"): ``json.dumps`` indents in pure Python,
token by token (its C encoder has no indent), and an engine plan's ``collectives`` list one call per unit, ~1,100
flat objects of 13 distinct ones per row (FSDP2 on Llama-2-70B: 215,000 tokens, a fifth of the plan's CPU time).
Here a flat object (every value a string, number, boolean or null) is written once per distinct content, by
``json.dumps`` itself, and reused indented to its place; everything else is walked as ``json.dumps`` walks it.
tests/test_json_text.py compares the two on drawn documents and on the slowest plan's and an estimate's documents
(the golden outputs of tests/data/golden hold theirs)."""

import json
from typing import Optional

_SCALARS = frozenset((str, int, float, bool, type(None)))


def json_text(obj: object, indent: Optional[int] = None) -> str:
    """``obj`` as JSON text. Every JSON output goes through here: NaN and infinity are not JSON, so they
    raise ValueError (the ranges of ``zeroplan.types`` keep them from being computed at all)."""
    if indent is None or type(indent) is not int or indent < 0:  # compact: json's C encoder already
        return json.dumps(obj, indent=indent, allow_nan=False)
    return _Indented(indent).text(obj, 0)


class _Indented:
    """``json.dumps(..., indent=indent, allow_nan=False)``'s text, each distinct flat object written once."""

    def __init__(self, indent: int) -> None:
        self.indent, self.pad = indent, " " * indent
        self.flat: dict[tuple, str] = {}  # a flat object's text, by its items, their types and its depth

    def text(self, obj: object, depth: int) -> str:
        kind = type(obj)
        if kind is dict and obj:
            if set(map(type, obj.values())) <= _SCALARS:
                return self._flat(obj, depth)
            if set(map(type, obj)) == {str}:  # (json coerces other keys: its own walk, below)
                inner = "\n" + self.pad * (depth + 1)
                return "{" + inner + ("," + inner).join([json.dumps(k) + ": " + self.text(v, depth + 1)
                                                         for k, v in obj.items()]) + "\n" + self.pad * depth + "}"
        if (kind is list or kind is tuple) and obj:
            inner = "\n" + self.pad * (depth + 1)
            return "[" + inner + ("," + inner).join([self.text(v, depth + 1) for v in obj]) + "\n" + \
                self.pad * depth + "]"  # fmt: skip
        return self._dumped(obj, depth)  # a scalar, an empty container, a subclass: as json writes it

    def _flat(self, obj: dict, depth: int) -> str:
        """A flat object's text at ``depth``: found once per content and depth. The keys' and values' types are in the
        memo's key (1, 1.0 and True are equal, and written apart); a zero key or value is never memoised (0.0 and
        -0.0 are equal too)."""
        key = (tuple(obj.items()), tuple(map(type, obj.values())), tuple(map(type, obj)), depth)
        text = self.flat.get(key)
        if text is None:
            text = self._dumped(obj, depth)  # NaN and infinity raise here
            if 0 not in obj.values() and 0 not in obj:
                self.flat[key] = text
        return text

    def _dumped(self, obj: object, depth: int) -> str:
        text = json.dumps(obj, indent=self.indent, allow_nan=False)
        return text if depth == 0 or "\n" not in text else text.replace("\n", "\n" + self.pad * depth)
