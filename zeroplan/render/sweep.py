"""JSON and CSV views of a sweep (the DataFrame of ``zeroplan.sweep``). Nothing is computed here.

The frame's own methods do the work; this module needs no pandas import of its own.
"""

from __future__ import annotations

import json

from zeroplan.render.schemas import PolicyOut, SweepDoc, SweepInputs
from zeroplan.sweeping.config import SweepConfig


def to_records(frame) -> list[dict]:
    """Rows as plain Python values (``fits`` None when unknown), for JSON."""
    nullable = ("fits", "reduction_vs_dp", "activation_bytes", "total_bytes", "total_fits")
    out = frame.astype({**dict.fromkeys(nullable, object), "name": str, "offload": str, "collectives": str})
    for column in nullable:  # unknown fit or activations, no ratio when nothing stays on the GPU
        out[column] = out[column].where(out[column].notna(), None)
    return out.to_dict(orient="records")


def to_json(frame, config: SweepConfig) -> str:
    """The sweep as one JSON object: schema, the fixed inputs, and ``rows`` (one per configuration, stage)."""
    doc = SweepDoc(
        inputs=SweepInputs(
            gpu_memory_bytes=config.gpu_memory_bytes, policy=PolicyOut(**config.policy.resolved())
        ),
        columns=list(frame.columns),
        rows=[],
    )
    # One row per line keeps a big sweep greppable and diffable; the rest is indented as usual.
    head = json.dumps(doc.dump(), indent=2).removesuffix("[]\n}").removesuffix("[]}")
    # Rows are the frame's columns, which are ``SweepRow``'s fields by construction (``COLUMNS``); they are
    # not validated one by one here (that would double the time of a million-row sweep): the tests do.
    rows = ",\n".join("    " + json.dumps(r) for r in to_records(frame))
    return f"{head}[\n{rows}\n  ]\n}}\n"


def to_csv(frame) -> str:
    """The sweep as CSV with a header row; ``fits`` is empty when no GPU memory was given."""
    return frame.to_csv(index=False, lineterminator="\n")

