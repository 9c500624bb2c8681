"""What every engine profile answers, so the planner and the validator never ask which engine it is.

An engine (the bundled reference runtime, PyTorch FSDP2, DeepSpeed ZeRO) is one module in
``zeroplan/engines/`` that turns a ``Workload`` (what is trained) and its own settings (in the engine's
vocabulary: a ZeRO stage, ``reshard_after_forward``, a ``ds_config.json``) into ``EngineEstimate`` rows:
model states, the peak per phase (``zeroplan.formulas.peak``: moments of named terms, each citing the
engine file and function it comes from) and the collectives of one optimizer step. ``ENGINES`` in
``zeroplan.engines`` maps the ``--engine`` name to that module's ``estimate`` function.

Contract of an engine module ``zeroplan/engines/<name>.py``:

- ``Settings``: a pydantic model of the engine's options (``extra="forbid"``), with the engine's
  defaults (and the engine version they come from).
- ``estimate(workload: Workload, nd: int, settings: Settings) -> tuple[EngineEstimate, ...]``: one row
  per configuration the settings describe (the reference engine: one per requested ZeRO stage; FSDP2
  and DeepSpeed: the one sharding the settings select). Pure: numbers in, frozen records out.

The validator side of an engine lives in ``validate/engines/<name>.py`` (the real engine under the
shared probes); it compares its measurements with this module's ``estimate`` row by row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from zeroplan.architectures.spec import Shape, TransformerSpec
from zeroplan.formulas.collectives import Collective
from zeroplan.formulas.memory import MemoryBreakdown
from zeroplan.formulas.peak import PeakEstimate, Term
from zeroplan.policy import PrecisionPolicy

Checkpointing = Literal["none", "full"]


@dataclass(frozen=True)
class Workload:
    """What is trained, whatever the engine: the parameters and, with an architecture, one micro-step.

    ``spec`` is None for a bare list of tensors (``--params`` or ``--shapes``): model states and
    collectives are still exact, but activations, and so the peak, need an architecture.
    """

    shapes: tuple[tuple[str, Shape], ...]
    """every parameter as (name, shape), in ``named_parameters()`` order (``transformer_shapes(spec)``)."""
    spec: Optional[TransformerSpec] = None
    seq_len: int = 1
    """tokens per sequence."""
    micro_batch: int = 1
    """sequences per rank per micro-step."""
    checkpointing: Checkpointing = "none"
    """``full``: every decoder layer recomputed in backward (``torch.utils.checkpoint`` per block)."""
    grad_accum: int = 1
    """micro-steps per optimizer step."""
    foreach: bool = False
    """the optimizer's multi-tensor (``foreach``) path; torch's default is True on CUDA, False on CPU."""
    transformers: bool = False
    """the module tree is Hugging Face transformers' (``LlamaForCausalLM``: body and ``lm_head`` called as
    modules), not validate/transformer.py ``CausalLM`` (head applied by the root); ZeRO-3's hook order."""


@dataclass(frozen=True)
class EngineEstimate:
    """One engine configuration on one rank: model states, the peak per phase, one step's collectives."""

    engine: str
    """the ``--engine`` name: reference, fsdp2, deepspeed."""
    label: str
    """what runs, in the engine's words: ``ZeRO-3``, ``fully_shard reshard_after_forward=True``."""
    stage: Optional[int]
    """the ZeRO stage it corresponds to (0-3; FSDP2 full sharding is 3), for tables and comparisons."""
    memory: MemoryBreakdown
    """model states one rank holds between steps."""
    peak: Optional[PeakEstimate]
    """the peak per phase; None without an architecture (``Workload.spec`` is None)."""
    collectives: tuple[Collective, ...]
    """what one rank issues in one optimizer step (every micro-step's calls: ``Collective.micro_steps``), with
    the engine's sizes, dtypes and phases."""
    beside_states: tuple[Term, ...] = ()
    """the engine's persistent terms that live beside the model states between steps, not part of them
    (FSDP2's post-forward mesh ranks, ``engines/fsdp2/terms.py mesh_ranks``): what a reading of the memory
    between steps holds besides ``memory`` (the validator compares the two)."""

    @property
    def model_states_bytes(self) -> int:
        return self.memory.model_states_bytes


# ---- the planner's side: what `estimate`, `plan` and `sweep` were asked, and what `plan` may answer ----


@dataclass(frozen=True)
class PlannerOptions:
    """What the planner commands were asked, for an engine's ``planner_settings(options) -> Settings``.

    The shared fields first, then each engine's own vocabulary; None means "not given: the engine's
    default". Which of the vocabulary fields an engine reads is data (``zeroplan.engines.Engine.options``),
    so the commands refuse the others in one line instead of ignoring them.
    """

    stages: tuple[int, ...] = (0, 1, 2, 3)
    """reference: the ZeRO stages to estimate, one row each."""
    policy: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    """reference: dtypes of the model states and the optimizer (the paper's vocabulary)."""
    flat_layout: bool = True
    """the shapes are the model's real tensors (per-tensor padding); False for a bare Ψ."""
    stage: Optional[int] = None
    """deepspeed: ``--stage``, the ZeRO stage when the ds_config gives none (a contradiction is refused)."""
    ds_config: Optional[Mapping[str, Any]] = None
    """deepspeed: the parsed ``ds_config.json`` (None: DeepSpeed's defaults for every key)."""
    reshard_after_forward: Optional[bool | int] = None
    """fsdp2: ``fully_shard(reshard_after_forward=...)``: True, False or the post-forward group size."""
    param_dtype: Optional[str] = None
    """fsdp2: ``MixedPrecisionPolicy.param_dtype``."""
    reduce_dtype: Optional[str] = None
    """fsdp2: ``MixedPrecisionPolicy.reduce_dtype``."""
    gpu_capability: Optional[tuple[int, int]] = None
    """the compute capability of the ``--gpu`` preset (``formulas.cuda_workspaces.capability_of``), which sizes
    the cuBLAS workspaces of a peak (reference, fsdp2: ``Settings.cuda_capability``); None: no preset given,
    or one whose library workspaces are not modelled (ROCm): the engine's default, an H100's (9, 0)."""


@dataclass(frozen=True)
class Candidate:
    """One configuration an engine's planner tried: its estimate, whether its predicted peak fits, and
    exactly what to run for it (a ds_config dict, a ``fully_shard`` snippet)."""

    label: str
    """the configuration in the engine's words, e.g. ``reshard_after_forward=False, checkpointing none``."""
    estimate: EngineEstimate
    fits: bool
    launcher: object
    bucket_numel: Optional[int] = None
    """elements per collective call the configuration uses (DeepSpeed's buckets); None: one call per row."""
    build: Optional[str] = None
    """how the model must be built for the prediction to hold (DeepSpeed ZeRO-3: under
    ``deepspeed.zero.Init``); None: as usual."""


@dataclass(frozen=True)
class EnginePlan:
    """An engine's answer to ``zeroplan plan``: every candidate, cheapest first, and the one to run."""

    candidates: tuple[Candidate, ...]
    recommended: Optional[int]
    """index of the cheapest candidate that fits; None when none does."""
    launcher_key: str
    """where the recommendation's configuration goes in ``plan --json``: ``deepspeed`` or ``fsdp2``."""
    order: str
    """why the candidates are in this order (cheapest first), for the plan's reason."""
    base: object = None
    """the engine ``Settings`` the candidates vary (their byte convention: ``Engine.policy``)."""


class EngineOptions(BaseModel):
    """The engine-vocabulary options of a planner question (``EstimateConfig``, ``PlanConfig``,
    ``SweepConfig``); None: not given. ``zeroplan.engines.planner_options`` checks them against the
    engine's vocabulary and makes the ``PlannerOptions`` its ``planner_settings`` reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ds_config: Optional[dict[str, Any]] = None
    """deepspeed: the parsed ``ds_config.json``."""
    reshard_after_forward: Optional[StrictBool | StrictInt] = None
    """fsdp2: True, False, or the post-forward group size (a divisor of N_d, torch's rule)."""
    param_dtype: Optional[str] = None
    """fsdp2: ``MixedPrecisionPolicy.param_dtype``."""
    reduce_dtype: Optional[str] = None
    """fsdp2: ``MixedPrecisionPolicy.reduce_dtype``."""

    def __hash__(self) -> int:  # a dict field: hash its canonical JSON (configs are lru_cache keys)
        return hash(json.dumps(self.model_dump(), sort_keys=True))

    @property
    def given(self) -> tuple[str, ...]:
        """The fields that were given, in field order."""
        return tuple(k for k in type(self).model_fields if getattr(self, k) is not None)
