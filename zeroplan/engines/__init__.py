"""One module per training engine: what it allocates and sends (``base.py``: the contract), reading its
configuration and emitting it for a planned option.

``ENGINES`` maps each ``--engine`` name to the module's ``estimate`` and ``SETTINGS`` to its ``Settings``
model; ``get_engine`` looks one up. Add an engine with one line in each dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable

from pydantic import AfterValidator, BaseModel

from zeroplan.engines import deepspeed, fsdp2, reference
from zeroplan.engines.base import EngineEstimate, Workload

EstimateFn = Callable[[Workload, int, BaseModel], "tuple[EngineEstimate, ...]"]

ENGINES: dict[str, EstimateFn] = {
    "reference": reference.estimate,
    "deepspeed": deepspeed.estimate,
    "fsdp2": fsdp2.estimate,
}
SETTINGS: dict[str, type[BaseModel]] = {
    "reference": reference.Settings,
    "deepspeed": deepspeed.Settings,
    "fsdp2": fsdp2.Settings,
}


@dataclass(frozen=True)
class Engine:
    """One registered engine: its ``--engine`` name, ``estimate`` function and ``Settings`` model."""

    name: str
    estimate: EstimateFn
    settings: type[BaseModel]


PLANNER_ENGINES: tuple[str, ...] = ("reference",)
"""Engines whose ``Settings`` the planner commands (estimate, plan, sweep) can build from their options
today. The others are reached through their module's ``estimate`` (Python) and ``zeroplan validate
--engine``; the commands refuse them with one line rather than guess their settings."""


def get_engine(name: str) -> Engine:
    """The planner engine called ``name``; ValueError (one line) for an unknown one or one the planner
    commands cannot configure yet (``PLANNER_ENGINES``)."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: known engines are {', '.join(ENGINES)}")
    if name not in PLANNER_ENGINES:
        raise ValueError(
            f"engine {name!r}: not yet configurable from estimate, plan or sweep (planner engines: "
            f"{', '.join(PLANNER_ENGINES)}); measure it with `zeroplan validate --engine {name}` or call "
            f"zeroplan.engines.{name}.estimate from Python"
        )
    return Engine(name, ENGINES[name], SETTINGS[name])


EngineName = Annotated[str, AfterValidator(lambda v: get_engine(v).name)]
"""``--engine``: the name of an engine the planner commands can configure (``get_engine``)."""
