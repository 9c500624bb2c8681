"""``zeroplan.plan(model=<torch.nn.Module>, optimizer=<torch.optim.Optimizer>)``: the plan of a live model.

The module and its optimizer are read exactly as ``zeroplan.estimate(model=...)`` reads them (one home:
``zeroplan.estimation.estimate.live_model``, docs/python-api.md): a ``transformers`` model whose config zeroplan
reads is planned as that architecture (its family's activations and peak, the rows of ``plan(model="<its
config.json>")``), any other module as its tensors flattened (model states and traffic, no peak). The
objects' dtypes and optimizer become the policy keywords of the reference engine; an engine with its own
search (fsdp2, deepspeed) builds its settings from its options alone, so a setting the objects give that its
search would not use is refused in one line rather than planned for another run.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from typing import Optional

from pydantic import ConfigDict, model_validator

from zeroplan.architectures.spec import TransformerSpec, numels, transformer_shapes
from zeroplan.planning.config import PlanConfig
from zeroplan.presets import DEFAULT_SEQ_LEN


class LivePlanConfig(PlanConfig):
    """A ``PlanConfig`` whose model is a live module: its architecture or, for any other module, its tensors."""

    model_config = ConfigDict(**{**PlanConfig.model_config, "arbitrary_types_allowed": True})

    architecture: Optional[TransformerSpec] = None
    """the module's ``transformers`` config, read (``estimation.workload.module_architecture``)."""
    module_numels: Optional[tuple[int, ...]] = None
    """without an architecture: the module's parameters flattened (each distinct tensor once)."""

    @model_validator(mode="after")
    def _one_model(self) -> "LivePlanConfig":
        if (self.architecture is None) == (self.module_numels is None) or self.model or self.params is not None:
            raise ValueError("a live plan takes the module's architecture or its tensors, and nothing else")
        return self

    @cached_property
    def model_architecture(self) -> Optional[TransformerSpec]:
        return self.architecture

    @property
    def tensor_numels(self) -> Optional[tuple[int, ...]]:
        if self.architecture is not None:
            return numels(transformer_shapes(self.architecture))
        return self.module_numels

    @property
    def sequence_length(self) -> int:
        """As for a config file: ``seq_len``, else min(maximum positions, ``DEFAULT_SEQ_LEN``)."""
        if self.seq_len is not None or self.architecture is None:
            return self.seq_len or DEFAULT_SEQ_LEN
        return min(self.architecture.max_seq_len, DEFAULT_SEQ_LEN)

    @property
    def transformer(self) -> Optional[TransformerSpec]:
        return self.architecture


def live_plan_config(module: object, params: object, options: dict) -> LivePlanConfig:
    """The plan's config of ``module`` (and ``options["optimizer"]``, a ``torch.optim`` optimizer): the
    objects read by ``live_model``; a keyword (or a field of ``policy=``) that contradicts them, and a setting
    of theirs an engine's own search would not plan, refused in one line."""
    from zeroplan.engines import get_engine, split_keywords
    from zeroplan.estimation.estimate import api_batch, live_model
    from zeroplan.estimation.live import check_module_dtype
    from zeroplan.policy import PrecisionPolicy

    if params is not None:
        raise ValueError("give one of params and model")
    fields = {k: options.pop(k) for k in list(options) if k in PlanConfig.model_fields}
    name = fields.get("engine", PlanConfig.model_fields["engine"].default)
    engine = get_engine(name)
    given = fields.pop("policy", None)
    named = None
    if given is not None:  # the policy's fields as keywords: checked against the objects like estimate's
        written = given.model_dump(exclude_unset=True)
        named = written.pop("optimizer", None) if "optimizer" in options else None  # the object's keyword
        options = {**written, **options}
    architecture, shapes, foreach, live, module_dtype = live_model(module, name, options, fields.pop("foreach", None))
    if named is not None and options.get("optimizer", named) != named:
        raise ValueError(f"optimizer={named} contradicts the objects, which say {options['optimizer']}: leave it out")
    if architecture is None and engine.plan is not None:
        raise ValueError(f"plan(engine={name}) searches by predicted peak, which needs an architecture: "
                         f"{type(module).__name__} has no transformers config zeroplan reads; plan it with "
                         "engine='reference' (model states) or estimate(model=...)")  # fmt: skip
    policy, engine_options = split_keywords(name, options)
    if engine_options.ds_config is not None:  # the file's batch (run_batch), at the planned N_d
        fields["micro_batch"], fields["grad_accum"] = api_batch(
            name, engine_options.ds_config, fields.get("gpus", PlanConfig.model_fields["gpus"].default),
            fields.get("model_parallel", 1), fields.get("micro_batch"), fields.get("grad_accum"))  # fmt: skip
    config = LivePlanConfig(
        architecture=architecture,
        module_numels=None if shapes is None else tuple(_numel(s) for _, s in shapes),
        engine_options=engine_options,
        **({} if policy is None else {"policy": PrecisionPolicy(**policy)}),
        **({} if foreach is None else {"foreach": foreach}),
        **fields,
    )
    settings = _searched_settings(engine, config.planner_options)
    for key, value in live:  # fsdp2's module_dtype, deepspeed's optimizer: not options of the engine's search
        if getattr(settings, key) != value:
            raise ValueError(f"plan(engine={name}) plans {key}={getattr(settings, key)} (its search takes it from "
                             f"its options), the objects say {value}: use estimate(model=...), or objects "
                             "that agree")  # fmt: skip
    check_module_dtype(module_dtype, name, engine.policy(settings).param_dtype)
    return config


def _searched_settings(engine, options):
    """The engine's settings for the plan's options; for an engine that searches the ZeRO stage and was given
    none (deepspeed without ``zero_optimization.stage``), those of stage 1: the dtypes and optimizer the
    objects are checked against do not depend on it."""
    try:
        return engine.planner_settings(options)
    except ValueError:
        if engine.plan is None or options.stage is not None:
            raise
        return engine.planner_settings(replace(options, stage=1))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
