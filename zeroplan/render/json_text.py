"""The one JSON writer of every output (``json_text``), apart from the documents' models of ``render.schemas`` (which
re-exports it): a table that prints a ds_config writes it without loading the thirty document models (a speed-up,
no rule; docs/benchmarks.md, "2026-12-03, startup")."""

import json
from typing import Optional


def json_text(obj: object, indent: Optional[int] = None) -> str:
    """``obj`` as JSON text. Every JSON output goes through here: NaN and infinity are not JSON, so they
    raise ValueError (the ranges of ``zeroplan.types`` keep them from being computed at all)."""
    return json.dumps(obj, indent=indent, allow_nan=False)
