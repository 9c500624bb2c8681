"""``SweepConfig``: a grid of planner questions (pydantic), checked by the same types as ``estimate``.

Byte counts of a sweep stay exact int64: the ranges of ``zeroplan.types`` (Ψ <= 1e15, GPUs <= 2**24,
activations <= 1 EiB) keep them below 2**63.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cached_property
from typing import Annotated, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from zeroplan.allocator.config import parse_alloc_conf
from zeroplan.architectures.spec import TransformerSpec, transformer_shapes
from zeroplan.architectures.spec import numels as numels_of
from zeroplan.engines import EngineName, get_engine, planner_options
from zeroplan.engines.base import PLANNER_INPUTS, EngineOptions, PlannerOptions
from zeroplan.estimation.config import preset_memory
from zeroplan.estimation.workload import check_seq_len, device_foreach
from zeroplan.formulas.activations import activation_bytes
from zeroplan.formulas.cuda_workspaces import capability_of
from zeroplan.formulas.offload import NO_OFFLOAD, Offload, check_offload
from zeroplan.parsing import parse_offload
from zeroplan.policy import PrecisionPolicy
from zeroplan.presets import GpuName, ModelRef, model_seq_len, resolve_model
from zeroplan.types import model_name
from zeroplan.types import (
    BatchCount, ByteSize, Checkpointing, Flag, Fraction, GpuCount, Numel, Params, SeqLen, StageNumber, check_bytes,
    check_total,
)  # fmt: skip

MAX_ROWS = 10**8
"""Most rows one sweep may have (counted before pairs that do not divide are left out): 1e8 rows is
about 20 GB of CSV; the command streams it in chunks, but ``zeroplan.sweep`` returns one DataFrame of
about 200 bytes a row. Split a larger grid into several sweeps."""


ENGINE_MAX_EVALUATIONS = 4096
"""Most (N_d, micro-batch, stage) estimates one sweep of a one-row engine (fsdp2, deepspeed) may ask: each is
a full ``Engine.estimate`` (a walk over the step's moments), not a vectorised formula."""
ENGINE_MAX_LAYER_EVALUATIONS = ENGINE_MAX_EVALUATIONS * 32
"""The same budget in estimates x layers: a walk grows with the layer count, so a model deeper than 32 layers
gets proportionally fewer estimates (512 at the 256-layer bound, about 0.3 CPU s each: docs/limits.md)."""


class SweepConfig(BaseModel):
    """A grid of planner questions: every combination of ``params`` x ``gpus`` x ``model_parallel``,
    each answered for every stage in ``stages``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: Optional[tuple[Params, ...]] = None
    """Ψ values of the whole model, in parameters; give this, ``tensor_numels`` or ``model``."""
    tensor_numels: Optional[tuple[Numel, ...]] = Field(None, min_length=1)
    """elements of every parameter tensor of one model (exact padding); replaces ``params``."""
    model: Optional[Annotated[ModelRef, BeforeValidator(model_name)]] = None
    """model preset (``zeroplan.presets``) or the path of a Hugging Face ``config.json``: its tensors, its
    shape for activations and the peak per GPU."""
    micro_batch: tuple[BatchCount, ...] = (1,)
    """sequences per GPU per micro-step; changes only the activation columns (needs ``model``)."""
    seq_len: Optional[SeqLen] = None
    """tokens per sequence for activations; default the preset's."""
    checkpointing: Checkpointing = "full"
    """activation recomputation assumed: none, selective or full (``zeroplan.formulas.activations``); the
    peak columns know none and full (full stays the default, as before the peak existed)."""
    foreach: Flag = True
    """the optimizer's multi-tensor path, for the peak; not given (or None): torch's default for the run's device
    (``zeroplan.estimation.workload.device_foreach``)."""
    engine: EngineName = "reference"
    """the training engine of the peak columns (``zeroplan.engines.get_engine``)."""
    gpus: tuple[GpuCount, ...] = (1,)
    """total GPU counts = N_d x N_m."""
    model_parallel: tuple[GpuCount, ...] = (1,)
    """N_m values; combinations where N_m does not divide ``gpus`` are left out of the grid."""
    stages: tuple[StageNumber, ...] = (0, 1, 2, 3)
    """ZeRO stages (0-3) to report for every configuration."""
    offload: tuple[Offload, ...] = (NO_OFFLOAD,)
    """where states live (``zeroplan.parsing.parse_offload``); (stage, offload) pairs DeepSpeed lacks are
    left out."""
    gpu: Optional[GpuName] = None
    """GPU preset (``zeroplan.presets.gpu_presets``): its memory for the ``fits`` column (unless
    ``gpu_memory_bytes`` is given) and its compute capability for the peak's cuBLAS workspaces, as ``plan``."""
    gpu_memory_bytes: Optional[ByteSize] = None
    """memory of one GPU in bytes, for the ``fits`` column; overrides the preset's; None (and no preset) leaves it
    empty."""
    headroom: Fraction = 0.0
    """fraction of GPU memory kept free beyond what is predicted, in [0, 1): every ``*fits`` column compares
    with (1 - headroom) x GPU memory (as ``plan --headroom``; 0 by default)."""
    alloc_conf: str = ""
    """``PYTORCH_CUDA_ALLOC_CONF`` of the runs, for ``reserved_bytes`` (``zeroplan.allocator``); "": torch's
    defaults."""
    policy: PrecisionPolicy = PrecisionPolicy()
    """the reference engine's precision policy; refused (when not the default) for the other engines."""
    engine_options: EngineOptions = EngineOptions()
    """options in the engine's own vocabulary (``--reshard-after-forward``, ``--deepspeed-config``, ...)."""

    @model_validator(mode="before")
    @classmethod
    def _preset_memory(cls, data: object) -> object:
        return device_foreach(preset_memory(data))

    @field_validator("offload", mode="before")
    @classmethod
    def _offload(cls, v: object) -> object:
        if isinstance(v, (list, tuple)):
            return tuple(parse_offload(x) for x in v)
        return v

    @field_validator("params", "gpus", "model_parallel", "stages", "offload", "micro_batch")
    @classmethod
    def _listed(cls, v: Optional[tuple], info: ValidationInfo) -> Optional[tuple]:
        if v is None:
            return v
        if not v:
            raise ValueError(f"{info.field_name}: give at least one value")
        seen = set()
        for x in v:
            if x in seen:
                shown = x.label if isinstance(x, Offload) else f"{x:g}"
                raise ValueError(f"{info.field_name}: {shown} is listed twice")
            seen.add(x)
        return v

    @field_validator("alloc_conf")
    @classmethod
    def _alloc_conf(cls, v: str) -> str:
        parse_alloc_conf(v)  # one line naming the bad part
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "SweepConfig":
        if sum(x is not None for x in (self.params, self.tensor_numels, self.model)) != 1:
            raise ValueError("give exactly one of params, tensor_numels and model")
        if self.model is None and (self.micro_batch != (1,) or self.seq_len is not None):
            raise ValueError("micro_batch and seq_len change only activations, which need a reference model")
        if self.model is None and self.alloc_conf:
            raise ValueError("alloc_conf changes only reserved_bytes, which need a model (an allocation trace)")
        check_total(self.tensor_numels or ())
        lists = (self.params or (1,), self.gpus, self.model_parallel, self.micro_batch, self.pairs)
        rows = math.prod(len(x) for x in lists)
        if rows > MAX_ROWS:
            raise ValueError(f"the grid has up to {rows:,} rows, above the limit of {MAX_ROWS:.0e}: split it")
        if self.model is not None:  # the largest activations of the grid must stay a sane byte count
            seq_len = self.sequence_length
            check_seq_len(self.spec, seq_len)
            act = activation_bytes(self.spec, seq_len, max(self.micro_batch), self.checkpointing, 1)
            check_bytes(act or 0, f"activations at seq_len={seq_len}, micro_batch={max(self.micro_batch)}")
        if not any(g % m == 0 for g in self.gpus for m in self.model_parallel):
            raise ValueError(
                f"no model_parallel in {list(self.model_parallel)} divides any gpus in {list(self.gpus)}"
            )
        engine = get_engine(self.engine)
        _ = self.planner_options(self.engine_stages[0] if engine.one_row else None)  # the engine's vocabulary
        if engine.one_row:
            nm = next((m for m in self.model_parallel if m != 1), 1)
            # every stage swept: a limit may refuse one stage and not another (DeepSpeed's moe_limit)
            limit = next((lim for st in self.engine_stages if (lim := engine.peak_limits(
                self.planner_options(st), self.spec, self.checkpointing, nm)) is not None), None)  # fmt: skip
            bad = limit.option if limit is not None else ("offload" if self.offload != (NO_OFFLOAD,) else None)
            if bad is not None and bad not in (*PLANNER_INPUTS, "offload"):
                raise ValueError(limit.reason)  # the architecture or the engine's own options
            if bad is not None:
                raise ValueError(
                    f"sweep --engine {self.engine} evaluates the engine's own configuration, which needs a model "
                    "(an architecture), model_parallel=1, no offload and checkpointing none or full; got "
                    f"{bad}={getattr(self, bad)!r}"
                )  # fmt: skip
            evaluations = len(self.gpus) * len(self.micro_batch) * len(self.engine_stages)
            limit = min(ENGINE_MAX_EVALUATIONS, ENGINE_MAX_LAYER_EVALUATIONS // self.spec.n_layer)
            if evaluations > limit:
                raise ValueError(f"sweep --engine {self.engine}: {evaluations} engine estimates (gpus x micro_batch x "
                                 f"stages) of a {self.spec.n_layer}-layer model, above the limit of {limit} "
                                 f"({ENGINE_MAX_EVALUATIONS}, fewer above 32 layers): split the sweep")  # fmt: skip
            engine.planner_settings(self.planner_options(self.engine_stages[0]))  # a bad ds_config: before any work
        if not self.pairs:
            offloads = ", ".join(o.label for o in self.offload)
            raise ValueError(
                f"offload ({offloads}) is possible at none of stages {list(self.stages)}: {_why(self)}"
            )
        return self

    @property
    def budget_bytes(self) -> Optional[int]:
        """What the ``*fits`` columns compare with: (1 - headroom) x GPU memory, as ``plan``; None without
        a GPU memory."""
        return None if self.gpu_memory_bytes is None else int(self.gpu_memory_bytes * (1 - self.headroom))

    @cached_property
    def spec(self) -> Optional[TransformerSpec]:
        """The architecture ``model`` names; None without one."""
        return None if self.model is None else resolve_model(self.model)

    @property
    def sequence_length(self) -> Optional[int]:
        """``seq_len``, or the model's default (``zeroplan.presets.model_seq_len``); None without a model."""
        if self.model is None:
            return None
        return self.seq_len if self.seq_len is not None else model_seq_len(self.model, self.spec)

    @property
    def numels(self) -> Optional[tuple[int, ...]]:
        """Every tensor of the model: ``tensor_numels`` or the architecture's; None for a bare Ψ."""
        if self.spec is not None:
            return numels_of(transformer_shapes(self.spec))
        return self.tensor_numels

    def planner_options(self, stage: Optional[int] = None) -> PlannerOptions:
        """What the engine's ``planner_settings`` reads: the stages and policy (reference), one ``stage``
        (deepspeed), the engine options; ValueError for an option outside the engine's vocabulary."""
        engine = get_engine(self.engine)
        reads_policy = "policy" in engine.options or self.policy != PrecisionPolicy()
        planner = planner_options(engine, self.engine_options, stage=stage,
                                  policy=self.policy if reads_policy else None)  # fmt: skip
        planner = replace(planner, gpu_capability=None if self.gpu is None else capability_of(self.gpu))
        return replace(planner, stages=self.stages) if stage is None else planner

    @property
    def engine_stages(self) -> tuple[Optional[int], ...]:
        """Rows per configuration of a one-row engine (``Engine.one_row``): one per ``stages`` given (an
        engine that reads a stage: DeepSpeed), else one, the stage its settings select (None)."""
        return self.stages if "stages" in self.model_fields_set else (None,)

    @property
    def byte_policy(self) -> PrecisionPolicy:
        """The byte convention of the rows' model states: the policy, or a one-row engine's own."""
        engine = get_engine(self.engine)
        if not engine.one_row:
            return self.policy
        return engine.policy(engine.planner_settings(self.planner_options(self.engine_stages[0])))

    @property
    def pairs(self) -> tuple[tuple[int, Offload], ...]:
        """The (stage, offload) pairs to report, stage-major; pairs DeepSpeed lacks are left out."""
        return tuple((s, o) for s in self.stages for o in self.offload if _possible(s, o))


def _possible(stage: int, offload: Offload) -> bool:
    try:
        check_offload(stage, offload)
    except ValueError:
        return False
    return True


def _why(config: SweepConfig) -> str:
    """``check_offload``'s reason for the first pair, e.g. 'stage 0: optimizer offload needs ...'."""
    try:
        check_offload(config.stages[0], config.offload[0])
    except ValueError as exc:
        return str(exc)
    return ""
