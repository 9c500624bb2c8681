"""JSON and CSV views of a sweep (the DataFrame of ``zeroplan.sweep``). Nothing is computed here.

The frame's own methods do the work; this module needs no pandas import of its own.
"""

from __future__ import annotations

import json

from zeroplan.sweeping.config import SweepConfig

SCHEMA = "zeroplan.sweep/1"


def to_records(frame) -> list[dict]:
    """Rows as plain Python values (``fits`` None when unknown), for JSON."""
    nullable = ("fits", "reduction_vs_dp", "activation_bytes", "total_bytes", "total_fits")
    out = frame.astype({**dict.fromkeys(nullable, object), "name": str, "offload": str, "collectives": str})
    for column in nullable:  # unknown fit or activations, no ratio when nothing stays on the GPU
        out[column] = out[column].where(out[column].notna(), None)
    return out.to_dict(orient="records")


def to_json(frame, config: SweepConfig) -> str:
    """The sweep as one JSON object: schema, the fixed inputs, and ``rows`` (one per configuration, stage)."""
    doc = {
        "schema": SCHEMA,
        "inputs": {
            "gpu_memory_bytes": config.gpu_memory_bytes,
            "policy": config.policy.resolved(),
        },
        "columns": list(frame.columns),
        "rows": [],
    }
    # One row per line keeps a big sweep greppable and diffable; the rest is indented as usual.
    head = json.dumps(doc, indent=2).removesuffix("[]\n}").removesuffix("[]}")
    rows = ",\n".join("    " + json.dumps(r) for r in to_records(frame))
    return f"{head}[\n{rows}\n  ]\n}}\n"


def to_csv(frame) -> str:
    """The sweep as CSV with a header row; ``fits`` is empty when no GPU memory was given."""
    return frame.to_csv(index=False, lineterminator="\n")

