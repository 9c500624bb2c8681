"""What a live module and optimizer say about a run (``zeroplan.estimate(model=module, optimizer=opt)``), as every
engine reads it: ``LiveRun`` (read by ``zeroplan.estimation.live.read_live``), and the checks the engines' own
``Engine.live_settings`` share. Each engine maps it onto its own vocabulary in its package's ``live.py``."""

from dataclasses import dataclass
from typing import Optional

from zeroplan.types import show


@dataclass(frozen=True)
class LiveRun:
    """What the objects say: the parameters' dtype and, with an optimizer, its zeroplan name, the dtype of its
    states, its multi-tensor path (``foreach``), Adam's ``amsgrad`` (a third state, ``max_exp_avg_sq``) and
    ``fused`` kernel: an engine that models those sets them in its settings; ``estimation.live.live_settings``
    refuses the others."""

    dtype: str
    optimizer: Optional[str] = None
    state_dtype: Optional[str] = None
    foreach: Optional[bool] = None
    amsgrad: bool = False
    fused: bool = False


def no_live_settings(run: LiveRun, given: dict) -> tuple[dict, dict]:
    """``Engine.live_settings`` of an engine that reads nothing of the objects but the shapes."""
    return {}, {}


def adam_only(engine: str, run: LiveRun) -> None:
    """ValueError unless the optimizer (where given) is Adam or AdamW: the engines whose profiles model Adam's
    states only (fsdp2, deepspeed)."""
    if run.optimizer is not None and run.optimizer not in ("adam", "adamw"):
        raise ValueError(f"engine={engine}: the optimizer is {run.optimizer}; the {engine} profile models Adam "
                         "and AdamW states")  # fmt: skip


def agree(given: dict, read: dict) -> None:
    """Each keyword given that the objects also say must say the same (any spelling of a dtype)."""
    from zeroplan.formulas.dtypes import canonical_dtype

    for key, value in read.items():
        if key not in given:
            continue
        try:
            mine = canonical_dtype(given[key])
        except (TypeError, ValueError):
            mine = given[key]  # not a dtype (or a bad one: the policy refuses it by name)
        if isinstance(mine, str) and mine.strip().lower() != value:
            raise ValueError(f"{key}={show(given[key])} contradicts the objects, which say {value}: leave it out")
