"""Reading per-tensor sizes from a JSON file, for exact padding (``zeroplan estimate --shapes``)."""

from __future__ import annotations

from pathlib import Path

from zeroplan.files import read_json
from zeroplan.architectures.limits import MAX_PARAMS, show


def numels_from_shapes(shapes: object) -> tuple[int, ...]:
    """Element counts from a list of shapes, a {name: shape} mapping, or a list of element counts.

    Accepts what ``{n: list(p.shape) for n, p in model.named_parameters()}`` dumps to JSON.
    """
    items = list(shapes.values()) if isinstance(shapes, dict) else shapes
    if not isinstance(items, list) or not items:
        raise ValueError("shapes: expected a non-empty JSON list of shapes or an object {name: shape}")
    numels = []
    for item in items:
        dims = item if isinstance(item, list) else [item]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims) or not dims:
            raise ValueError(f"shapes: {item!r} is not a shape of positive whole dimensions")
        numel = 1
        for d in dims:  # stop at the limit: a product of 400-digit dimensions is never computed
            numel *= d
            if numel > MAX_PARAMS:
                raise ValueError(f"shapes: {show(item)}: more than {MAX_PARAMS:.0e} elements in one tensor")
        numels.append(numel)
    return tuple(numels)


def load_numels(path: str | Path) -> tuple[int, ...]:
    """Element counts of every tensor listed in a JSON shapes file; ValueError with one line if malformed."""
    return numels_from_shapes(read_json(path, "shapes file"))
