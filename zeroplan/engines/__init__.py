"""One module per training engine: what it allocates and sends (``base.py``: the contract), reading its
configuration and emitting it for a planned option.

``REGISTRY`` maps each ``--engine`` name to an ``Engine``: the module's functions and what the planner
commands may ask it, as data. ``get_engine`` looks one up; ``ENGINES`` and ``SETTINGS`` are views of it.
Add an engine with one entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Optional

from pydantic import AfterValidator, BaseModel

from zeroplan.engines import deepspeed, fsdp2, reference
from zeroplan.engines.base import EngineEstimate, EngineOptions, EnginePlan, PlannerOptions, Workload
from zeroplan.policy import PrecisionPolicy
from zeroplan.types import show

EstimateFn = Callable[[Workload, int, BaseModel], "tuple[EngineEstimate, ...]"]
PlanFn = Callable[[Workload, int, int, PlannerOptions], EnginePlan]


@dataclass(frozen=True)
class Engine:
    """One registered engine: its ``--engine`` name, the functions of its module, and its vocabulary."""

    name: str
    estimate: EstimateFn
    settings: type[BaseModel]
    planner_settings: Callable[[PlannerOptions], BaseModel]
    """its ``Settings`` from the planner's options (``base.PlannerOptions``)."""
    policy: Callable[[BaseModel], PrecisionPolicy]
    """the byte convention its model states follow, for the convention line and the "vs DP" ratio."""
    options: tuple[str, ...]
    """the ``PlannerOptions`` fields in its vocabulary; the commands refuse the others."""
    plan: Optional[PlanFn] = None
    """``zeroplan plan``'s search by predicted peak over the engine's own options; None: the planner's
    ladder of ZeRO stages and offload (``zeroplan.planning.plan.LADDER``)."""
    own_estimator: Optional[Callable[[BaseModel, tuple[int, ...], int], int]] = None
    """the engine's own memory estimator for the same run, shown beside the prediction; None if it has none."""
    own_estimator_name: str = ""
    block_bytes: Callable[[BaseModel], int] = lambda settings: 1
    """the allocator block its peak terms are rounded to, for the settings given."""
    plan_chooses: tuple[str, ...] = ()
    """``plan`` options its own search decides (refused when given: fsdp2 tries both checkpointing modes)."""

    @property
    def one_row(self) -> bool:
        """Whether it answers one row (the sharding its settings select) rather than one per ZeRO stage."""
        return "stages" not in self.options


REGISTRY: dict[str, Engine] = {
    "reference": Engine("reference", reference.estimate, reference.Settings, reference.planner_settings,
                        reference.planner_policy, reference.PLANNER_OPTIONS,
                        block_bytes=reference.planner_block_bytes),
    "deepspeed": Engine("deepspeed", deepspeed.estimate, deepspeed.Settings, deepspeed.planner_settings,
                        deepspeed.planner_policy, deepspeed.PLANNER_OPTIONS, deepspeed.planner_plan,
                        deepspeed.ds_estimate_bytes, "DeepSpeed's estimator",
                        deepspeed.planner_block_bytes),
    "fsdp2": Engine("fsdp2", fsdp2.estimate, fsdp2.Settings, fsdp2.planner_settings, fsdp2.planner_policy,
                    fsdp2.PLANNER_OPTIONS, fsdp2.planner_plan, block_bytes=fsdp2.planner_block_bytes,
                    plan_chooses=("checkpointing",)),
}  # fmt: skip
ENGINES: dict[str, EstimateFn] = {name: e.estimate for name, e in REGISTRY.items()}
SETTINGS: dict[str, type[BaseModel]] = {name: e.settings for name, e in REGISTRY.items()}

PLANNER_ENGINES: tuple[str, ...] = tuple(REGISTRY)
"""Engines the planner commands (estimate, plan, sweep) can configure: all of them."""


def planner_options(
    engine: Engine,
    options: EngineOptions,
    *,
    stage: Optional[int] = None,
    policy: Optional[PrecisionPolicy] = None,
    flat_layout: bool = True,
) -> PlannerOptions:
    """The ``PlannerOptions`` ``engine.planner_settings`` reads; ValueError (one line) for an option outside
    the engine's vocabulary (``Engine.options``): ``stage`` is the reference engine's stage to show or
    DeepSpeed's ``--stage``, ``policy`` the reference engine's precision policy (None: not given)."""
    asked = [*options.given, *(["stage"] if stage is not None else []), *(["policy"] if policy is not None else [])]
    for name in asked:
        fields = {"stage": ("stage", "stages")}.get(name, (name,))
        if not set(fields) & set(engine.options):
            what = "a precision policy (param_dtype, grad_dtype, ...)" if name == "policy" else name
            raise ValueError(f"{what} does not apply to engine {engine.name!r} (it reads: "
                             f"{', '.join(engine.options)})")  # fmt: skip
    return PlannerOptions(
        stages=(0, 1, 2, 3) if stage is None else (stage,),
        policy=policy if policy is not None else PrecisionPolicy(),
        flat_layout=flat_layout,
        stage=stage,
        **{k: getattr(options, k) for k in options.given},
    )


def split_keywords(name: str, keywords: dict) -> tuple[Optional[dict], EngineOptions]:
    """The Python API's remaining keywords (``zeroplan.estimate(..., **kw)``) split into ``PrecisionPolicy``
    fields (None when there are none) and ``EngineOptions``: a keyword goes to the engine's options unless
    it is a policy field and the engine reads a policy (``param_dtype`` is the reference engine's policy
    dtype and FSDP2's ``MixedPrecisionPolicy.param_dtype``)."""
    engine = get_engine(name)
    mine = {k: v for k, v in keywords.items() if k in EngineOptions.model_fields
            and not (k in PrecisionPolicy.model_fields and "policy" in engine.options)}  # fmt: skip
    policy = {k: v for k, v in keywords.items() if k not in mine}
    return (policy or None), EngineOptions(**mine)


def get_engine(name: str) -> Engine:
    """The engine called ``name``; ValueError (one line) for an unknown one or a non-string (a dict or a list
    from the Python API would be a TypeError in the lookup: unhashable)."""
    if not isinstance(name, str) or name not in REGISTRY:
        shown = repr(name) if isinstance(name, str) else show(name)
        raise ValueError(f"unknown engine {shown}: known engines are {', '.join(REGISTRY)}")
    return REGISTRY[name]


EngineName = Annotated[str, AfterValidator(lambda v: get_engine(v).name)]
"""``--engine``: the name of a registered engine (``get_engine``)."""
