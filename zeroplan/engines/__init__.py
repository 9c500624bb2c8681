"""One package per training engine: what it allocates and sends (``base.py``: the contract), reading its
configuration and emitting it for a planned option.

Each package declares its ``Engine`` record once (``ENGINE`` in its ``__init__.py``: functions, vocabulary,
batch rule, launcher, plan); this module only registers them, one line per engine, and imports a package
the first time it is asked for (``estimate --engine reference`` never loads DeepSpeed's profile).
Everything outside ``zeroplan/engines/`` asks ``get_engine(name)``; ``register`` adds an engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Annotated, Optional, Union

from pydantic import AfterValidator

from zeroplan.engines.base import Engine, EngineOptions, PlannerOptions
from zeroplan.policy import PrecisionPolicy
from zeroplan.types import show

REGISTRY: dict[str, Union[Engine, str]] = {}
"""``--engine`` name -> its ``Engine``, or the package that declares it (``ENGINE``), imported on first use."""


def register(name: str, engine: Union[Engine, str]) -> None:
    """Register an engine: its ``Engine`` record, or the dotted name of the module whose ``ENGINE`` it is."""
    if not isinstance(engine, (Engine, str)):
        raise ValueError(f"engine {name!r}: expected an Engine or the module that declares one")
    REGISTRY[name] = engine


register("reference", "zeroplan.engines.reference")
register("deepspeed", "zeroplan.engines.deepspeed")
register("fsdp2", "zeroplan.engines.fsdp2")

PLANNER_ENGINES: tuple[str, ...] = tuple(REGISTRY)
"""Engines the planner commands (estimate, plan, sweep) can configure: the built-in ones."""


def planner_options(
    engine: Engine,
    options: EngineOptions,
    *,
    stage: Optional[int] = None,
    policy: Optional[PrecisionPolicy] = None,
    flat_layout: bool = True,
) -> PlannerOptions:
    """The ``PlannerOptions`` ``engine.planner_settings`` reads; ValueError (one line) for an option outside
    the engine's vocabulary (``Engine.options`` and ``Engine.own_options``, each own option checked by its
    declaration): ``stage`` is the reference engine's stage to show or
    DeepSpeed's ``--stage``, ``policy`` the reference engine's precision policy (None: not given)."""
    asked = [*options.given, *(["stage"] if stage is not None else []), *(["policy"] if policy is not None else [])]
    own = {o.name: o for o in engine.own_options}
    for name in asked:
        fields = {"stage": ("stage", "stages")}.get(name, (name,))
        if not set(fields) & set(engine.reads):
            what = "a precision policy (param_dtype, grad_dtype, ...)" if name == "policy" else name
            raise ValueError(f"{what} does not apply to engine {engine.name!r} (it reads: {', '.join(engine.reads)})")
    return PlannerOptions(
        stages=(0, 1, 2, 3) if stage is None else (stage,),
        policy=policy if policy is not None else PrecisionPolicy(),
        flat_layout=flat_layout,
        stage=stage,
        own={name: o.default if (v := options.value(name)) is None else o.check(v) for name, o in own.items()},
    )


def split_keywords(name: str, keywords: dict) -> tuple[Optional[dict], EngineOptions]:
    """The Python API's remaining keywords (``zeroplan.estimate(..., **kw)``) split into ``PrecisionPolicy``
    fields (None when there are none) and ``EngineOptions``: a keyword goes to the engine's options (its own
    ones included, ``Engine.own_options``; ``planner_options`` refuses the others by name) unless it is a
    policy field and the engine reads a policy (``param_dtype`` is the reference engine's policy
    dtype and FSDP2's ``MixedPrecisionPolicy.param_dtype``)."""
    engine = get_engine(name)
    reads_policy = "policy" in engine.options
    own = {o.name for o in engine.own_options}
    mine = {k: v for k, v in keywords.items()  # not a policy field: an engine's option (refused by name if not its)
            if k not in PrecisionPolicy.model_fields or (k in own and not reads_policy)}
    policy = {k: v for k, v in keywords.items() if k not in mine}
    return (policy or None), EngineOptions(**mine)


def get_engine(name: str) -> Engine:
    """The engine called ``name``; ValueError (one line) for an unknown one or a non-string (a dict or a list
    from the Python API would be a TypeError in the lookup: unhashable)."""
    if not isinstance(name, str) or name not in REGISTRY:
        shown = repr(name) if isinstance(name, str) else show(name)
        raise ValueError(f"unknown engine {shown}: known engines are {', '.join(REGISTRY)}")
    entry = REGISTRY[name]
    if isinstance(entry, str):  # first use: the package declares it
        entry = REGISTRY[name] = importlib.import_module(entry).ENGINE
    return entry


def engine_for_file(kind: str) -> tuple[Engine, Callable]:
    """The engine that expresses a launcher file's run (``Engine.launcher_files``: ``torchtitan``,
    ``accelerate-fsdp``) and its reader; ValueError (one line) when none does. Loads every engine (a file
    path only, never ``estimate --params``)."""
    for name in REGISTRY:
        engine = get_engine(name)
        for known, reader in engine.launcher_files:
            if known == kind:
                return engine, reader
    raise ValueError(f"no engine expresses a {kind} file")


EngineName = Annotated[str, AfterValidator(lambda v: get_engine(v).name)]
"""``--engine``: the name of a registered engine (``get_engine``)."""
