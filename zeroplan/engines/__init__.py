"""One module per training engine: what it allocates and sends (``base.py``: the contract), reading its
configuration and emitting it for a planned option.

``ENGINES`` maps each ``--engine`` name to the module's ``estimate`` and ``SETTINGS`` to its ``Settings``
model; ``get_engine`` looks one up. Add an engine with one line in each dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel

from zeroplan.engines import reference
from zeroplan.engines.base import EngineEstimate, Workload

EstimateFn = Callable[[Workload, int, BaseModel], "tuple[EngineEstimate, ...]"]

ENGINES: dict[str, EstimateFn] = {
    "reference": reference.estimate,
}
SETTINGS: dict[str, type[BaseModel]] = {
    "reference": reference.Settings,
}


@dataclass(frozen=True)
class Engine:
    """One registered engine: its ``--engine`` name, ``estimate`` function and ``Settings`` model."""

    name: str
    estimate: EstimateFn
    settings: type[BaseModel]


def get_engine(name: str) -> Engine:
    """The engine called ``name``; ValueError (one line, listing the names) otherwise."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: known engines are {', '.join(ENGINES)}")
    return Engine(name, ENGINES[name], SETTINGS[name])
