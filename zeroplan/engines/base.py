"""What every engine profile answers, so the planner and the validator never ask which engine it is.

An engine (the bundled reference runtime, PyTorch FSDP2, DeepSpeed ZeRO) is one module in
``zeroplan/engines/`` that turns a ``Workload`` (what is trained) and its own settings (in the engine's
vocabulary: a ZeRO stage, ``reshard_after_forward``, a ``ds_config.json``) into ``EngineEstimate`` rows:
model states, the peak per phase (``zeroplan.formulas.peak``: moments of named terms, each citing the
engine file and function it comes from) and the collectives of one optimizer step. ``get_engine`` in
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

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

from zeroplan.architectures.spec import Shape, TransformerSpec
from zeroplan.engines.declared import EngineOption, Launcher, RunOption
from zeroplan.engines.live import LiveRun, no_live_settings
from zeroplan.formulas.activation_terms import activation_limit
from zeroplan.formulas.collectives import Collective
from zeroplan.formulas.memory import MemoryBreakdown
from zeroplan.formulas.offload import HostMemory
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

    def __hash__(self) -> int:
        """The fields' hash, computed once per object: every engine's caches are keyed by the workload, whose
        ~1,000 parameter shapes cost ~0.1 ms to hash. Not a field: equality, ``repr``, ``asdict`` and
        ``replace`` are the dataclass's; a pickle or copy leaves it out (a string's hash is per process)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))  # the dataclass's own rule
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        """The fields, for ``pickle`` and ``copy``: not the cached hash."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}


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
    peak_rank: Optional[int] = None
    """the rank this row describes: the one whose peak is the largest over ranks (``worst_rank``), where the
    engine's ranks differ; None: every rank holds the same (the reference runtime)."""
    host: Optional[HostMemory] = None
    """the engine's offload on this rank (DeepSpeed ``offload_optimizer``/``offload_param``, FSDP2
    ``CPUOffloadPolicy``): host memory term by term and the PCIe traffic of a step; None: nothing offloaded
    (``memory`` and ``peak`` are GPU memory either way)."""

    @property
    def model_states_bytes(self) -> int:
        return self.memory.model_states_bytes


def worst_rank(rows: Mapping[int, EngineEstimate]) -> EngineEstimate:
    """The row of the rank that peaks highest (then holds the most model states; the lowest rank of a tie),
    named in its ``peak_rank``: a job dies on its worst GPU. ``rows``: rank -> that rank's row."""
    def need(item: tuple[int, EngineEstimate]) -> tuple[int, int, int]:
        rank, row = item
        return (row.peak.peak_bytes if row.peak is not None else 0, row.model_states_bytes, -rank)

    rank, row = max(rows.items(), key=need)
    return replace(row, peak_rank=rank)


# ---- the planner's side: what `estimate`, `plan` and `sweep` were asked, and what `plan` may answer ----


@dataclass(frozen=True, init=False)
class PlannerOptions:
    """What the planner commands were asked, for an engine's ``planner_settings(options) -> Settings``.

    The fields every engine's vocabulary draws on (the paper's stages and policy, ``--stage``, the ``--gpu``
    preset), then ``own``: each engine's own options by name, declared once in its ``Engine.own_options``
    (FSDP2's ``reshard_after_forward``, DeepSpeed's ``ds_config``, ...). Which of the fields an engine reads is
    data (``Engine.options``), so the commands refuse the others in one line instead of ignoring them.
    """

    stages: tuple[int, ...] = (0, 1, 2, 3)
    """reference: the ZeRO stages to estimate, one row each."""
    policy: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    """reference: dtypes of the model states and the optimizer (the paper's vocabulary)."""
    flat_layout: bool = True
    """the shapes are the model's real tensors (per-tensor padding); False for a bare Ψ."""
    stage: Optional[int] = None
    """deepspeed: ``--stage``, the ZeRO stage when the ds_config gives none (a contradiction is refused)."""
    gpu_capability: Optional[tuple[int, int]] = None
    """the compute capability of the ``--gpu`` preset (``formulas.cuda_workspaces.capability_of``), which sizes
    the cuBLAS workspaces of a peak (reference, fsdp2: ``Settings.cuda_capability``); None: no preset given,
    or one whose library workspaces are not modelled (ROCm): the engine's default, an H100's (9, 0)."""
    grad_accum: int = 1
    """micro-steps per optimizer step, G (the run's ``Workload.grad_accum``): what a peak limit may depend on
    (DeepSpeed: ``moe_offload.moe_offload_limit``)."""
    own: Mapping[str, Any] = field(default_factory=dict)
    """the engine's own options (``Engine.own_options``) by name, checked by their declaration; every one it
    declares is present (its default where not given) when ``zeroplan.engines.planner_options`` made them."""

    def __init__(self, stages: tuple[int, ...] = (0, 1, 2, 3), policy: Optional[PrecisionPolicy] = None,
                 flat_layout: bool = True, stage: Optional[int] = None,
                 gpu_capability: Optional[tuple[int, int]] = None, own: Optional[Mapping[str, Any]] = None,
                 grad_accum: int = 1, **named: Any) -> None:  # fmt: skip
        """``named``: own options by keyword, as ``own`` (``PlannerOptions(reshard_after_forward=4)``)."""
        values = dict(stages=stages, policy=PrecisionPolicy() if policy is None else policy, flat_layout=flat_layout,
                      stage=stage, gpu_capability=gpu_capability, grad_accum=grad_accum,
                      own={**(own or {}), **named})  # fmt: skip
        for name, value in values.items():
            object.__setattr__(self, name, value)


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
    trace_inputs: Optional[tuple] = field(default=None, compare=False, repr=False)
    """(workload, N_d, settings, *engine extras) of exactly this configuration, for ``Engine.alloc_trace`` (the
    planner replays its allocation trace for reserved bytes; an engine may append what its estimate already built,
    e.g. FSDP2's run of the peak rank); None: not given."""
    pins: tuple[tuple[str, object], ...] = ()
    """the engine's own options, (name, value), that plan this configuration again without the search that chose
    part of it (FSDP2: its mesh), for ``plan --max-micro-batch`` (``planning/largest_batch.py``); (): none."""


@dataclass(frozen=True)
class EnginePlan:
    """An engine's answer to ``zeroplan plan``: every candidate, cheapest first, and the one to run."""

    candidates: tuple[Candidate, ...]
    recommended: Optional[int]
    """index of the cheapest candidate that fits; None when none does."""
    order: str
    """why the candidates are in this order (cheapest first), for the plan's reason."""
    base: object = None
    """the engine ``Settings`` the candidates vary (their byte convention: ``Engine.policy``)."""


class EngineOptions(BaseModel):
    """The engine-vocabulary options of a planner question (``EstimateConfig``, ``PlanConfig``,
    ``SweepConfig``), by name, as given: each is an option some engine declares (``Engine.own_options``:
    FSDP2's ``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``, DeepSpeed's ``ds_config``, ...);
    ``zeroplan.engines.planner_options`` checks them against the engine asked (refusing those it does not
    declare, by name) and makes the ``PlannerOptions`` its ``planner_settings`` reads. None: not given."""

    model_config = ConfigDict(extra="allow", frozen=True)

    def __hash__(self) -> int:  # a dict value: hash its canonical JSON (configs are lru_cache keys)
        return hash(json.dumps(self.model_dump(), sort_keys=True, default=repr))

    def value(self, name: str) -> Any:
        """The option ``name`` as given; None when it was not."""
        return (self.model_extra or {}).get(name)

    @property
    def ds_config(self) -> Optional[dict[str, Any]]:
        """The parsed ``ds_config.json``, where given: the commands read its batch (``Engine.batch``) and the
        reference engine its precision (``Engine.file_policy``) at the edge, whichever engine runs."""
        return self.value("ds_config")

    @property
    def given(self) -> tuple[str, ...]:
        """The options that were given, in the order given."""
        return tuple(k for k, v in (self.model_extra or {}).items() if v is not None)


# ---- the registry's record: what an engine package declares, once (``zeroplan.engines`` registers it) ----

EstimateFn = Callable[[Workload, int, BaseModel], "tuple[EngineEstimate, ...]"]
PlanFn = Callable[[Workload, int, int, PlannerOptions], EnginePlan]
BatchRule = Callable[[Optional[Mapping[str, Any]], Optional[int], Optional[int], Optional[int], tuple[str, str]],
                     "tuple[int, int]"]  # fmt: skip
SweepBatchRule = Callable[[Optional[Mapping[str, Any]], tuple[int, ...], tuple[int, ...], Optional[tuple[int, ...]],
                           str], Optional[tuple[int, ...]]]  # fmt: skip


def command_line_batch(settings_file: Optional[Mapping[str, Any]], nd: Optional[int], micro_batch: Optional[int],
                       grad_accum: Optional[int], names: tuple[str, str] = ("micro_batch", "grad_accum")):
    """The batch rule of an engine whose settings set no batch: the command line's (1 where not given)."""
    return (micro_batch or 1, grad_accum or 1)


def command_line_sweep_batches(settings_file, gpus, model_parallel, micro_batches, name="micro_batch"):
    """``sweep``'s micro-batches of an engine whose settings set no batch: None (the command line's stand)."""
    return None


PEAK_CHECKPOINTING: tuple[str, ...] = ("none", "full")
"""The checkpointing modes every engine's peak models (``Workload.checkpointing``); selective has no peak."""


PLANNER_INPUTS: tuple[str, ...] = ("model", "model_parallel", "checkpointing")
"""The ``PeakLimit.option`` values that name an input of the planner's configs (the others: the architecture
read from the model, an engine's own option)."""


@dataclass(frozen=True)
class PeakLimit:
    """Why an engine's peak model does not cover a run: the input that takes it outside, as the planner's
    configs name it (``model``: no architecture, ``model_parallel``, ``checkpointing``; ``architecture``: a
    family or feature the activations do not derive; ``policy``), and the one-line reason."""

    option: str
    reason: str


def no_own_peak_limits(options: PlannerOptions, spec: TransformerSpec) -> Optional[PeakLimit]:
    """``Engine.own_peak_limits`` of an engine whose peak covers every run the shared limits allow."""
    return None


def same_options(options: PlannerOptions) -> PlannerOptions:
    """``Engine.plan_options`` of an engine whose own plan reads the planner's options as given."""
    return options


@dataclass(frozen=True)
class Engine:
    """One engine as its package declares it (``ENGINE`` in ``zeroplan/engines/<name>/__init__.py``): its
    ``--engine`` name, its functions, its vocabulary, its batch rule and its launcher. Everything outside
    ``zeroplan/engines/`` asks this record (``zeroplan.engines.get_engine``), never the package."""

    name: str
    estimate: EstimateFn
    settings: type[BaseModel]
    planner_settings: Callable[[PlannerOptions], BaseModel]
    """its ``Settings`` from the planner's options (``PlannerOptions``)."""
    policy: Callable[[BaseModel], PrecisionPolicy]
    """the byte convention its model states follow, for the convention line and the "vs DP" ratio."""
    options: tuple[str, ...]
    """the shared ``PlannerOptions`` fields in its vocabulary (``stages``, ``policy``, ``stage``); with
    ``own_options`` all it reads; the commands refuse the others."""
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
    batch: BatchRule = command_line_batch
    """(micro-batch, accumulation) of the run from its settings file (parsed; None: none given) at N_d (None:
    the command varies it) and the command line's values (None: not given); ValueError on a contradiction."""
    sweep_batches: SweepBatchRule = command_line_sweep_batches
    """``sweep``'s micro-batches over the grid from its settings file; None: the command line's stand."""
    file_policy: Optional[Callable[[Mapping[str, Any], dict], dict]] = None
    """the precision-policy fields (and ``stage``) given on the command line completed from its settings file
    (the reference engine reads a ds_config's precision); None: the engine reads no policy from a file."""
    read_settings_file: Optional[Callable[[Mapping[str, Any]], BaseModel]] = None
    """its ``Settings`` from its settings file alone (the validator's ``--deepspeed-config``); None: it has none."""
    own_options: tuple[EngineOption, ...] = ()
    """its own vocabulary, declared here once (an option several engines read is declared by each): the
    commands route them to it by name (``PlannerOptions.own``) and refuse them for every other engine; adding
    an option is one declaration plus its CLI flag (``zeroplan.cli_options.OWN_OPTION_PARAMS``)."""
    alloc_trace: Optional[Callable[[Workload, int, BaseModel], tuple[Any, ...]]] = None
    """``(workload, nd, settings) -> tuple[AllocTrace, ...]``: each ``estimate`` row's step as an ordered
    allocation trace (``zeroplan.allocator.step_trace``; needs an architecture), which the allocator model
    replays for reserved bytes; None: the engine has none."""
    live_settings: Callable[[LiveRun, dict], tuple[dict, dict]] = no_live_settings
    """``(run read from a live module and optimizer, keywords given) -> (policy keywords, Settings fields)``: how
    ``zeroplan.estimate(model=module, optimizer=opt)`` reaches this engine (its package's ``live.py``); a
    keyword contradicting the objects is refused there. Default: nothing read but the shapes."""
    own_peak_limits: Callable[[PlannerOptions, TransformerSpec], Optional[PeakLimit]] = no_own_peak_limits
    """what of an architecture and the planner's options the engine's own peak does not model (the reference
    runtime: its one policy; every engine: no dropout, ``dropout.dropout_limit``); ``peak_limits`` adds the limits every engine shares."""
    launcher: Optional[Launcher] = None
    """what ``plan`` prints for the recommendation of its own search (``plan``); None: none printed."""
    run_options: tuple[RunOption, ...] = ()
    """its validator run's own options (``zeroplan validate --engine NAME``), declared here once: ``validate.config``
    reads them from this record, checks their type and refuses them for every other engine."""
    runner: Optional[str] = None
    """the validator's runner of this engine: the dotted name of a module under ``validate/engines/`` (imported by
    the validator only, on first use) with ``run(config) -> report`` and ``worker_module(config)`` (what its ranks
    run), and optionally ``run_defaults(data) -> data``, ``check_run(config)`` (ValueError in one line),
    ``default_model``, ``installed``/``MISSING``, ``STATES``; None: ``zeroplan validate`` cannot train it."""
    comm_count: Optional[tuple[str, str]] = None
    """how its collective rows count, as ``estimate``'s footnote says (one step; G micro-steps, ``{accum}``) where
    that is not the calls the engine itself issues (the reference engine: the ZeRO paper's volumes)."""
    plan_options: Callable[[PlannerOptions], PlannerOptions] = same_options
    """the planner's options as its own ``plan`` uses them, less what that search chooses itself (DeepSpeed: the
    ds_config's ZeRO stage): ``plan``'s config check asks ``peak_limits`` with these, so a plan answers with the rows
    it models and names the others instead of being refused for a setting it does not keep."""

    def peak_limits(self, options: PlannerOptions, spec: Optional[TransformerSpec], checkpointing: str = "none",
                    model_parallel: int = 1) -> Optional[PeakLimit]:
        """None when this engine's peak model covers the run; else the first input outside it and why. The
        one check estimate, plan and sweep ask (and ``estimate`` raises the reason of)."""
        if spec is None:
            return PeakLimit("model", "the peak needs an architecture (--model)")
        if model_parallel != 1:
            return PeakLimit("model_parallel",
                             f"the peak is modelled without tensor parallelism (N_m = {model_parallel})")
        if checkpointing not in PEAK_CHECKPOINTING:
            return PeakLimit("checkpointing", f"the peak knows checkpointing none and full, not {checkpointing}")
        why = activation_limit(spec)  # the family first: what no engine models
        if why is not None:
            return PeakLimit("architecture", why)
        return self.own_peak_limits(options, spec)

    @property
    def reads(self) -> tuple[str, ...]:
        """Its whole vocabulary: the shared ``PlannerOptions`` fields it reads, then its own options' names."""
        return (*self.options, *(o.name for o in self.own_options))

    @property
    def one_row(self) -> bool:
        """Whether it answers one row (the sharding its settings select) rather than one per ZeRO stage."""
        return "stages" not in self.options
