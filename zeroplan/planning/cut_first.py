"""Which term to cut first: read off a peak's largest terms, the first some lever in the user's hands cuts."""

from __future__ import annotations

import functools
from typing import Callable, Optional

from zeroplan.formulas.peak import PeakEstimate, Term
from zeroplan.planning.config import PlanConfig
from zeroplan.number_formats import format_bytes

LEVERS = ("checkpointing", "micro-batch", "stage", "gpus")
"""What ``cut_first`` may advise, cheapest first in the user's hands."""


def _is_activation(term: Term) -> bool:
    """Terms that grow with micro-batch x sequence length (activations, logits, the batch)."""
    return "activation_terms" in term.source or term.source.endswith("measure_stage")


def _term_bytes(peak: Optional[PeakEstimate], name: str) -> Optional[int]:
    """The largest term called ``name`` in any phase of ``peak`` (0 when absent); None without a peak."""
    if peak is None:
        return None
    return max((t.bytes for p in peak.phases for t in p.terms if t.name == name), default=0)


def cut_first(
    peak: PeakEstimate,
    stage: int,
    config: PlanConfig,
    next_stage: Optional[PeakEstimate] = None,
    more_gpus: Optional[PeakEstimate | Callable[[], Optional[PeakEstimate]]] = None,
) -> str:
    """Which term to cut first: the largest live term at the peak that some lever cuts. Saved block
    activations: checkpointing (when off); other activations: the micro-batch (when > 1), else the
    sequence length. Anything else: a higher stage if the next stage's peak (``next_stage``) holds less
    of it, else more GPUs if the peak at 2·N_d (``more_gpus``) does; a term neither cuts (e.g. the model
    as an engine builds it before sharding) is skipped. ``more_gpus`` may be a function that returns that
    peak: it is then estimated only when a term reaches that lever (an engine estimate at 2·N_d is a
    fifth of a 405B plan)."""
    more = functools.cache(more_gpus if callable(more_gpus) else lambda: more_gpus)
    for t in peak.peak_terms:
        if _is_activation(t):
            if t.name.startswith("saved activations") and config.checkpointing == "none":
                lever = "checkpointing (--checkpointing full keeps only each block's input)"
            elif config.micro_batch > 1:
                lever = f"micro-batch (--micro-batch below {config.micro_batch}; --grad-accum keeps the batch)"
            else:
                lever = f"sequence length (--seq-len below {config.sequence_length})"
        elif (_term_bytes(next_stage, t.name) if next_stage is not None else t.bytes) < t.bytes:
            lever = f"stage (ZeRO stage {stage + 1} holds less of it)"
        elif (_term_bytes(more(), t.name) if more() is not None else t.bytes) < t.bytes:
            lever = f"gpus (2 x N_d = {2 * config.nd} holds less of it)"
        else:
            continue
        size = format_bytes(t.bytes, "GiB")
        return f"{lever}: {t.name}, {size}, is the largest term it cuts at the {peak.peak_phase} peak"
    t = peak.peak_terms[0]
    return (
        f"no lever cuts the largest terms at the {peak.peak_phase} peak ({t.name}, "
        f"{format_bytes(t.bytes, 'GiB')}): the {config.engine} engine allocates them whatever the stage, "
        "N_d, micro-batch or checkpointing"
    )
