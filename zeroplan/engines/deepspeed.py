"""DeepSpeed ZeRO 1-3 as an engine: reading ``ds_config.json``, what it allocates and sends, its JSON.

One module for everything DeepSpeed-specific (issue 11), in DeepSpeed **0.19.8**'s words; file paths
in ``source`` strings are relative to the installed ``deepspeed/`` package.

Reading for ``zeroplan estimate`` (``from_deepspeed``): the keys that decide model-state memory
(``zero_optimization.stage``, ``fp16``/``bf16``, ``optimizer``, ``data_types.grad_accum_dtype``,
``communication_data_type``). Offload is refused here with a pointer to ``zeroplan plan``.

The engine profile (``Settings``, ``estimate``; contract in ``zeroplan/engines/base.py``): the keys that
change memory or traffic (buckets, ``contiguous_gradients``, ``overlap_comm``, the ``stage3_*`` knobs,
precision, the optimizer and its ``torch_adam``/``adam_w_mode``/``foreach``) read strictly with the
defaults of ``runtime/zero/config.py`` ``DeepSpeedZeroConfig``; the optimizer class DeepSpeed builds
(``optimizer_class``); every buffer of model states and buckets (``terms``), the moments of each phase
at which memory peaks (``moments``: ``zeroplan.formulas.peak`` terms, activations from
``zeroplan.formulas.activation_terms``), the collectives as DeepSpeed issues them (``collectives``) and
DeepSpeed's own estimators restated (``ds_estimate_zero2_bytes``, ``ds_estimate_zero3_bytes``). Checked
against real DeepSpeed on gloo CPU by ``validate/engines/deepspeed.py`` (``tests/test_deepspeed_*.py``).

Writing (``deepspeed_config``): keys exactly as the DeepSpeed configuration docs spell them. No
dependency on DeepSpeed: these functions read and build dicts and records.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Literal, Optional

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, model_validator,
                      validate_call)

from zeroplan.engines.base import Candidate, EngineEstimate, EnginePlan, PlannerOptions, Workload
from zeroplan.files import read_json
from zeroplan.formulas.activation_terms import ModelActivations, model_activations
from zeroplan.formulas.collectives import Collective, ring_bytes_per_rank
from zeroplan.formulas.memory import MemoryBreakdown
from zeroplan.formulas.peak import Moment, PeakEstimate, Term, peak_of
from zeroplan.formulas.offload import NO_OFFLOAD, Offload, check_offload
from zeroplan.formulas.stages import get_stage
from zeroplan.policy import BF16_MIXED, PrecisionPolicy
from zeroplan.types import MAX_BATCH, MAX_GPUS, BatchCount, Numel, StageNumber

DEFAULT_BUCKET_NUMEL = 500_000_000
"""Elements per gradient bucket / all-gather call: DeepSpeed's default ``reduce_bucket_size`` and
``allgather_bucket_size`` (5e8); the plan's latency estimate uses it too."""
STAGE3_PREFETCH_NUMEL = 50_000_000
"""DeepSpeed's default ``stage3_prefetch_bucket_size`` (5e7 elements)."""
NVME_PATH = "/local_nvme"
"""Placeholder mount point for ZeRO-Infinity; replace with a local NVMe path."""

# DeepSpeed optimizer types (case-insensitive) -> zeroplan optimizer names. DeepSpeed's "Adam" runs
# AdamW unless adam_w_mode is false; both keep m and v, so the bytes are the same.
DEEPSPEED_OPTIMIZERS: dict[str, str] = {
    "adam": "adamw",
    "adamw": "adamw",
    "fusedadam": "adamw",
    "cpuadam": "adamw",
    "onebitadam": "adamw",
    "zerooneadam": "adamw",
    "lamb": "lamb",
    "onebitlamb": "lamb",
    "lion": "lion",
    "sgd": "sgd",
}
_DS_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


def _enabled(v: object, info: ValidationInfo) -> bool:
    if v == "auto":
        raise ValueError("the HF Trainer fills in 'auto'; give true or false")
    if not isinstance(v, bool):
        raise ValueError("must be true or false (a JSON boolean, not a string or number)")
    return v


def _number(v: object, info: ValidationInfo) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError("must be a finite JSON number")
    return v


def _flag(v: object, info: ValidationInfo) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true or false (a JSON boolean)")
    return v


def _elements(v: object, info: ValidationInfo) -> int:
    """A whole element count >= 0; DeepSpeed's ``pp_int`` fields take 5e8 as well as 500000000."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) or v < 0:
        raise ValueError("must be a whole number of elements >= 0")
    if v > 10**15:
        raise ValueError("must be at most 1e15 elements")
    return int(v)


def _text(v: object, info: ValidationInfo) -> str:
    if not isinstance(v, str):
        raise ValueError("must be a string")
    return v


Enabled = Annotated[bool, BeforeValidator(_enabled)]
Number = Annotated[float, BeforeValidator(_number)]
Text = Annotated[str, BeforeValidator(_text)]
Flag = Annotated[bool, BeforeValidator(_flag)]
Elements = Annotated[int, BeforeValidator(_elements)]


def _batch(v: object, info: ValidationInfo) -> Optional[int]:
    """A batch key: a JSON integer >= 1 (``train_batch_size`` up to MAX_BATCH · MAX_BATCH · MAX_GPUS), or
    ``"auto"``, which the HF Trainer fills in from its own arguments: here the command line's (None)."""
    if v is None or v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError("must be a whole number >= 1 (a JSON integer)")
    if v > MAX_BATCH * (MAX_BATCH * MAX_GPUS if info.field_name == "train_batch_size" else 1):
        raise ValueError(f"must be at most {MAX_BATCH * (MAX_BATCH * MAX_GPUS if info.field_name == 'train_batch_size' else 1)}")
    return v


BatchKey = Annotated[Optional[int], BeforeValidator(_batch)]


class _Section(BaseModel):
    """A section of ``ds_config.json``: the keys zeroplan reads are typed strictly; DeepSpeed's many
    other keys are allowed and not read."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class _Switch(_Section):
    enabled: Enabled = False
    """``fp16.enabled`` / ``bf16.enabled``; DeepSpeed's default is false."""


class _OffloadSection(_Section):
    device: Optional[Text] = "none"


class _Zero(_Section):
    stage: object = 0
    """checked by the stage table (``get_stage``), whose message names the key."""
    offload_optimizer: Optional[_OffloadSection] = None
    offload_param: Optional[_OffloadSection] = None
    # read by the engine profile (``Settings.from_ds_config``); None: DeepSpeed's default
    reduce_bucket_size: Optional[Elements] = None
    allgather_bucket_size: Optional[Elements] = None
    contiguous_gradients: Optional[Flag] = None
    overlap_comm: Optional[Flag] = None
    reduce_scatter: Optional[Flag] = None
    use_multi_rank_bucket_allreduce: Optional[Flag] = None
    stage3_prefetch_bucket_size: Optional[Elements] = None
    stage3_param_persistence_threshold: Optional[Elements] = None
    stage3_max_live_parameters: Optional[Elements] = None
    stage3_max_reuse_distance: Optional[Elements] = None


class _DataTypes(_Section):
    grad_accum_dtype: Optional[Text] = None


class _OptimizerParams(_Section):
    momentum: Number = 0
    """SGD momentum; 0 (DeepSpeed's and torch's default) keeps no momentum buffer."""
    torch_adam: Optional[Flag] = None
    adam_w_mode: Optional[Flag] = None
    foreach: Optional[Flag] = None


class _Optimizer(_Section):
    type: Text = ""
    params: _OptimizerParams = _OptimizerParams()


class DeepSpeedConfig(_Section):
    """The keys of a ``ds_config.json`` that decide model-state memory, with DeepSpeed's defaults."""

    zero_optimization: _Zero = _Zero()
    fp16: _Switch = _Switch()
    bf16: _Switch = _Switch()
    bfloat16: _Switch = _Switch()
    """the older spelling of ``bf16``."""
    data_types: _DataTypes = _DataTypes()
    communication_data_type: Optional[Text] = None
    optimizer: Optional[_Optimizer] = None
    train_batch_size: BatchKey = None
    train_micro_batch_size_per_gpu: BatchKey = None
    gradient_accumulation_steps: BatchKey = None


def _ds_error(exc: ValidationError) -> ValueError:
    """The first error of a ``DeepSpeedConfig`` as one line naming the key, e.g.
    "deepspeed config: fp16.enabled='false': must be true or false (...)"."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return ValueError(f"deepspeed config: {loc!r} must be an object")
    if isinstance(err.get("input"), (str, int, float, bool, type(None))):
        return ValueError(f"deepspeed config: {loc}={err['input']!r}: {msg}")
    return ValueError(f"deepspeed config: {loc}: {msg}")


def _ds_dtype(value: str, key: str) -> str:
    if value.lower() not in _DS_DTYPES:
        raise ValueError(f"deepspeed config: {key}={value!r}: expected one of fp32, fp16, bf16")
    return _DS_DTYPES[value.lower()]


def parse_ds_config(config: object) -> "DeepSpeedConfig":
    """The sections of a parsed ds_config.json that zeroplan reads, strictly typed; ValueError (one line
    naming the key) for anything else than a JSON object of the documented types."""
    if not isinstance(config, dict):
        raise ValueError("deepspeed config: expected a JSON object")
    try:
        return DeepSpeedConfig.model_validate(config)
    except ValidationError as exc:
        raise _ds_error(exc) from None


def from_deepspeed(config: object) -> dict:
    """Planner settings (``stage`` and ``PrecisionPolicy`` fields) from a parsed DeepSpeed config."""
    ds = parse_ds_config(config)
    zero = ds.zero_optimization
    for key in ("offload_optimizer", "offload_param"):
        section = getattr(zero, key)
        device = section.device if section is not None else None
        if device not in ("none", None):
            raise ValueError(
                f"deepspeed config: zero_optimization.{key}.device={device!r}: `zeroplan estimate` models "
                "GPU-resident states; use `zeroplan plan --offload cpu|nvme` for offload"
            )
    stage = get_stage(zero.stage, "deepspeed config: zero_optimization.stage").number

    fp16, bf16 = ds.fp16.enabled, ds.bf16.enabled or ds.bfloat16.enabled
    if fp16 and bf16:
        raise ValueError("deepspeed config: fp16.enabled and bf16.enabled are both true")
    param_dtype = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    settings: dict = {"stage": stage, "param_dtype": param_dtype}

    grad_dtype = ds.data_types.grad_accum_dtype or ds.communication_data_type
    if grad_dtype is not None:
        settings["grad_dtype"] = _ds_dtype(grad_dtype, "grad_accum_dtype/communication_data_type")

    optimizer = ds.optimizer
    if optimizer is not None and config["optimizer"]:  # an empty section is no optimizer
        kind = optimizer.type.lower()
        if kind not in DEEPSPEED_OPTIMIZERS:
            known = ", ".join(sorted(DEEPSPEED_OPTIMIZERS))
            raise ValueError(f"deepspeed config: optimizer.type={optimizer.type!r}: expected one of {known}")
        name = DEEPSPEED_OPTIMIZERS[kind]
        if name == "sgd" and optimizer.params.momentum:
            name = "sgd-momentum"
        settings["optimizer"] = name
    return settings


def load_deepspeed(path: str | Path) -> dict:
    """``from_deepspeed`` of a JSON file; ValueError with one line when it is missing or malformed."""
    return from_deepspeed(read_json(path, "deepspeed config"))


def merge_deepspeed(path: str | Path, given: dict) -> dict:
    """``given`` settings (stage and policy fields the user set) completed from a DeepSpeed config file.

    ValueError when an option contradicts the file: the user meant one of them, and guessing which
    would print a number for a run that does not exist.
    """
    from_file = load_deepspeed(path)
    clash = sorted(k for k in from_file if k in given and given[k] != from_file[k])
    if clash:
        raise ValueError(f"--{clash[0].replace('_', '-')} contradicts the DeepSpeed config; drop one of them")
    return given | from_file


@dataclass(frozen=True)
class DsBatch:
    """The batch a ds_config trains per rank: ``micro_batch`` sequences per micro-step, ``grad_accum``
    micro-steps per optimizer step (DeepSpeed's ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps`` after it has derived the missing ones)."""

    micro_batch: int
    grad_accum: int


def ds_batch(config: object, nd: Optional[int]) -> Optional[DsBatch]:
    """The batch DeepSpeed derives from a ds_config at ``nd`` data-parallel ranks (``runtime/config.py``
    ``DeepSpeedConfig._set_batch_related_parameters`` then ``_batch_assertion``); None when the file has no
    batch key (a fragment: the command line's batch applies). ValueError, one line, where DeepSpeed would
    refuse the file, or where the batch depends on N_d (``train_batch_size``) and ``nd`` is None (a
    command that varies N_d)."""
    ds = parse_ds_config(config)
    tb, mb, ga = ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps
    if tb is None and mb is None:
        if ga is None:
            return None
        raise ValueError("deepspeed config: gradient_accumulation_steps without train_batch_size or "
                         "train_micro_batch_size_per_gpu: DeepSpeed needs one of them")  # fmt: skip
    if tb is not None and nd is None:
        raise ValueError(f"deepspeed config: train_batch_size={tb} fixes the micro-batch for one N_d only, and "
                         "this command varies N_d: give train_micro_batch_size_per_gpu (and "
                         "gradient_accumulation_steps) instead")  # fmt: skip
    if tb is not None and mb is not None and ga is None:
        ga = tb // mb // nd
    elif tb is not None and ga is not None and mb is None:
        mb = tb // nd // ga
    elif tb is not None and mb is None:
        mb, ga = tb // nd, 1
    ga = ga or 1
    if mb < 1 or ga < 1 or (tb is not None and tb != mb * ga * nd):
        raise ValueError(f"deepspeed config: train_batch_size={tb} is not train_micro_batch_size_per_gpu x "
                         f"gradient_accumulation_steps x N_d = {mb} x {ga} x {nd}: DeepSpeed refuses it")  # fmt: skip
    return DsBatch(micro_batch=mb, grad_accum=ga)


def run_batch(config: Optional[dict], nd: Optional[int], micro_batch: Optional[int], grad_accum: Optional[int],
              names: tuple[str, str] = ("micro_batch", "grad_accum")) -> DsBatch:
    """The batch of the run: the ds_config's (``ds_batch``) where it sets one, else ``micro_batch`` and
    ``grad_accum`` (1 where None). A given value must agree with the file, one left None yields to it:
    which one the user meant is not ours to guess. ``names``: how the caller spells the two."""
    batch = ds_batch(config, nd) if config is not None else None
    if batch is None:
        return DsBatch(micro_batch or 1, grad_accum or 1)
    keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for name, key, given, value in zip(names, keys, (micro_batch, grad_accum), (batch.micro_batch, batch.grad_accum)):
        if given is not None and given != value:
            at = f" at N_d = {nd}" if nd is not None else ""
            raise ValueError(f"{name} {given} contradicts the DeepSpeed config, whose {key} is {value}{at}; "
                             "drop one of them")
    return batch


def sweep_micro_batches(config: Optional[dict], gpus: tuple[int, ...], model_parallel: tuple[int, ...],
                        micro_batches: Optional[tuple[int, ...]], name: str = "micro_batch") -> Optional[tuple[int, ...]]:
    """``sweep``'s micro-batches over the grid's N_d = gpus / model_parallel (pairs that divide): (the file's,)
    where the ds_config sets the batch (``run_batch``; ``train_batch_size`` only when every row has the same
    N_d), None where it does not (``micro_batches`` stand, None: given none). ValueError for several given, a
    contradiction, or a file that accumulates (a sweep row is one micro-step per step)."""
    nds = {g // m for g in gpus for m in model_parallel if g % m == 0}
    nd = next(iter(nds)) if len(nds) == 1 else None
    if config is None or ds_batch(config, nd) is None:
        return None
    if micro_batches is not None and len(micro_batches) > 1:
        raise ValueError(f"{name} lists several values and the DeepSpeed config sets the batch; drop one")
    batch = run_batch(config, nd, micro_batches[0] if micro_batches else None, None, names=(name, ""))
    if batch.grad_accum != 1:
        raise ValueError(f"the DeepSpeed config accumulates {batch.grad_accum} micro-steps per step and a sweep row "
                         "is one: use estimate or plan (grad_accum)")  # fmt: skip
    return (batch.micro_batch,)


def _offload_block(device: str) -> dict:
    block: dict = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = NVME_PATH
    return block


@validate_call(config=ConfigDict(arbitrary_types_allowed=True))
def deepspeed_config(
    stage: StageNumber,
    offload: Offload = NO_OFFLOAD,
    micro_batch: BatchCount = 1,
    grad_accum: BatchCount = 1,
    policy: PrecisionPolicy = BF16_MIXED,
    bucket_numel: Numel = DEFAULT_BUCKET_NUMEL,
) -> dict:
    """A DeepSpeed config dict for ``stage`` and ``offload`` (dump it with ``json.dumps``)."""
    check_offload(stage, offload)
    zero: dict = {"stage": stage}
    if stage >= 1:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=bucket_numel)
    if stage in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=bucket_numel, reduce_scatter=True)
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=STAGE3_PREFETCH_NUMEL,
            stage3_param_persistence_threshold=100_000,
            stage3_max_live_parameters=1_000_000_000,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if offload.optimizer != "none":
        zero["offload_optimizer"] = _offload_block(offload.optimizer)
    if offload.params != "none":
        zero["offload_param"] = _offload_block(offload.params)
    config: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
    }
    if policy.param_dtype in ("bf16", "fp16"):
        config[policy.param_dtype] = {"enabled": True}
    config["zero_optimization"] = zero
    return config


# ---------------------------------------------------------------------------------------------------------
# The engine profile: what DeepSpeed 0.19.8 ZeRO 1-3 allocates and sends (one rank, one parameter group,
# no offload). Checked against the real engine: validate/engines/deepspeed.py, docs/engines/deepspeed.md.
# ---------------------------------------------------------------------------------------------------------

DEEPSPEED_VERSION = "0.19.8"
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "int32": 4, "bool": 1}
DsDtype = Literal["fp32", "bf16", "fp16"]
# stage_1_and_2.py / bf16_optimizer.py __init__: "4-byte alignment/sizeof(fp16) = 2"; the flat group is
# padded to a multiple of this times N_d (``flatten_dense_tensors_aligned``).
NCCL_START_ALIGNMENT_FACTOR = 2
_ZERO_KEYS = {  # ds_config zero_optimization key -> Settings field
    "reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
    "contiguous_gradients": "contiguous_gradients", "overlap_comm": "overlap_comm",
    "reduce_scatter": "reduce_scatter", "use_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters", "stage3_max_reuse_distance": "max_reuse_distance",
}  # fmt: skip


class Settings(BaseModel):
    """The ds_config keys that change memory or traffic, with DeepSpeed 0.19.8's defaults.

    Defaults: ``runtime/zero/config.py`` ``DeepSpeedZeroConfig`` (reduce/allgather buckets 5e8
    elements, prefetch 5e7, persistence threshold 1e5, max live parameters / reuse distance 1e9,
    ``contiguous_gradients``, ``reduce_scatter`` and ``use_multi_rank_bucket_allreduce`` true,
    ``overlap_comm`` None -> ``stage == 3`` in ``overlap_comm_valid``); precision from ``fp16`` / ``bf16``
    ``enabled`` (fp32 when neither), ``grad_accum_dtype`` defaulting to the model dtype
    (``runtime/engine.py`` ``DeepSpeedEngine.get_data_types``); ``optimizer.params.torch_adam`` (false),
    ``adam_w_mode`` (true) and ``foreach`` (``DeepSpeedEngine._configure_basic_optimizer``). Sizes are
    elements.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    stage: Literal[1, 2, 3]
    dtype: DsDtype = "fp32"
    grad_accum_dtype: Optional[DsDtype] = None
    reduce_bucket_size: int = Field(DEFAULT_BUCKET_NUMEL, ge=1)
    allgather_bucket_size: int = Field(DEFAULT_BUCKET_NUMEL, ge=1)
    contiguous_gradients: bool = True
    overlap_comm: Optional[bool] = None
    reduce_scatter: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    prefetch_bucket_size: int = Field(STAGE3_PREFETCH_NUMEL, ge=0)
    param_persistence_threshold: int = Field(100_000, ge=0)
    max_live_parameters: int = Field(1_000_000_000, ge=0)
    max_reuse_distance: int = Field(1_000_000_000, ge=0)
    optimizer: Literal["adam", "adamw"] = "adam"
    adam_w_mode: bool = True
    torch_adam: bool = False
    foreach: Optional[bool] = None
    zero_init: Optional[bool] = None
    """ZeRO-3: the model built under ``deepspeed.zero.Init(config_dict_or_path=ds_config)``
    (runtime/zero/partition_parameters.py ``Init``: each module's parameters are created in the config's
    dtype and partitioned right after its ``__init__``, so no rank holds the whole model) or, False, built
    whole and partitioned by ``deepspeed.initialize``. Not a ds_config key: how the script builds the model.
    None: True at stage 3, DeepSpeed's documented way to build a model larger than one device (and what
    Hugging Face ``from_pretrained`` does when the config is ZeRO-3: ``is_deepspeed_zero3_enabled``);
    stages 1-2 never (``Init`` partitions parameters, which only ZeRO-3 does)."""

    @model_validator(mode="after")
    def _zero_init_stage(self) -> Settings:
        if self.zero_init and self.stage != 3:
            raise ValueError(f"zero_init: deepspeed.zero.Init partitions parameters for ZeRO-3 only, not stage {self.stage}")
        return self

    @property
    def builds_partitioned(self) -> bool:
        """Whether the model is built under ``deepspeed.zero.Init`` (``zero_init``; None: at stage 3)."""
        return self.stage == 3 and self.zero_init is not False

    @property
    def grad_dtype(self) -> str:
        """The gradient accumulation dtype (engine.py ``get_data_types``: the model dtype when absent)."""
        return self.grad_accum_dtype or self.dtype

    @property
    def overlaps(self) -> bool:
        """``overlap_comm`` as DeepSpeed resolves it (config.py ``overlap_comm_valid``)."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    @classmethod
    def from_ds_config(cls, config: object, stage: Optional[int] = None, zero_init: Optional[bool] = None) -> Settings:
        """Read a parsed ds_config.json strictly; absent keys take DeepSpeed 0.19.8's defaults.

        ``stage`` (``--stage``) fills in a config without ``zero_optimization.stage``; one that
        contradicts the file is refused. ``zero_init``: how the model is built (not in a ds_config; the
        field's doc). ValueError with one line naming the key.
        """
        ds = parse_ds_config(config)
        base = from_deepspeed(config)  # offload refused, dtypes and optimizer checked, one line each
        zero = ds.zero_optimization
        given = "stage" in (config.get("zero_optimization") or {})
        if stage is not None and given and stage != base["stage"]:
            raise ValueError(f"--stage {stage} contradicts zero_optimization.stage={base['stage']}; drop one of them")
        number = base["stage"] if given or stage is None else stage
        if number not in (1, 2, 3):
            raise ValueError(f"deepspeed config: zero_optimization.stage={number}: the DeepSpeed profile covers 1-3")
        if base.get("optimizer", "adamw") != "adamw":
            raise ValueError(f"deepspeed config: optimizer.type={ds.optimizer.type!r}: the profile covers Adam and AdamW")
        params = ds.optimizer.params if ds.optimizer is not None else _OptimizerParams()
        grad = ds.data_types.grad_accum_dtype
        found = {field: getattr(zero, key) for key, field in _ZERO_KEYS.items() if getattr(zero, key) is not None}
        kind = (ds.optimizer.type.lower() if ds.optimizer is not None and ds.optimizer.type else "adam")
        return cls(
            stage=number,
            dtype=base["param_dtype"],
            grad_accum_dtype=None if grad is None else _ds_dtype(grad, "data_types.grad_accum_dtype"),
            optimizer="adamw" if kind == "adamw" else "adam",
            **{k: v for k, v in (("adam_w_mode", params.adam_w_mode), ("torch_adam", params.torch_adam),
                                 ("foreach", params.foreach)) if v is not None},
            **found,
            **({} if zero_init is None else {"zero_init": zero_init}),
        )  # fmt: skip


@dataclass(frozen=True)
class DSTerm:
    """A buffer DeepSpeed allocates on each rank: ``numel`` elements of ``dtype``, alive per ``live``.

    ``live``: ``persistent`` (from ``deepspeed.initialize`` on, at every step boundary), ``lazy``
    (created by the first ``optimizer_step``, alive from then on), ``backward`` (allocated when backward
    starts, freed before it ends: the ZeRO-1/2 reduce buckets).
    """

    name: str
    live: str
    numel: int
    dtype: str
    source: str
    tensors: int = 1

    @property
    def bytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def term(self) -> Term:
        return Term(self.name, self.bytes, self.source, max(self.tensors, 1))


@dataclass(frozen=True)
class DSCollective:
    """Collectives of one kind DeepSpeed issues per step: ``calls`` calls of ``elements`` in total.

    ``elements`` counts the full tensor of each call (an all-gather's output, an all-reduce's buffer,
    a reduce-scatter's input), as ``validate.probes.CommCounter`` records them. ``calls`` is exact where
    ``calls_exact`` (parameter-order buckets), else the greedy-bucket count in parameter order.
    """

    op: str
    phase: str
    calls: int
    elements: int
    dtype: str
    source: str
    calls_exact: bool = True


def optimizer_class(s: Settings) -> str:
    """The wrapper DeepSpeed builds (engine.py ``_do_optimizer_sanity_check`` then ``_configure_optimizer``)."""
    if s.stage == 1 and s.dtype == "bf16" and s.grad_dtype == "fp32":
        return "BF16_Optimizer"  # engine.py _configure_bf16_optimizer -> runtime/bf16_optimizer.py
    if s.stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"  # engine.py _configure_zero_optimizer -> zero/stage3.py
    return "DeepSpeedZeroOptimizer"  # engine.py _configure_zero_optimizer -> zero/stage_1_and_2.py


def inner_optimizer_class(s: Settings) -> str:
    """The Adam inside (engine.py ``_configure_basic_optimizer``): torch's with ``torch_adam``, else
    DeepSpeed's ``FusedAdam`` (ops/adam/fused_adam.py; on CPU a JIT-built C++ op, ``fused_adam``)."""
    if s.torch_adam:  # type "Adam" runs AdamW unless adam_w_mode is false
        return "AdamW" if s.optimizer == "adamw" or s.adam_w_mode else "Adam"
    return "FusedAdam"


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def flat_padded_numel(numels: tuple[int, ...], nd: int) -> int:
    """ZeRO-1/2 and BF16_Optimizer: one flat group padded to 2·N_d (stage_1_and_2.py ``__init__``,
    ``flatten_dense_tensors_aligned(..., alignment=nccl_start_alignment_factor * world_size)``)."""
    return _ceil_to(sum(numels), NCCL_START_ALIGNMENT_FACTOR * nd)


def stage3_partition_numel(numels: tuple[int, ...], nd: int) -> int:
    """ZeRO-3: each tensor padded to N_d and split (partition_parameters.py ``_padding_size``,
    ``_partition_param``); a rank holds the sum of ceil(n / N_d)."""
    return sum(-(-n // nd) for n in numels)


def persistent_numel(s: Settings, numels: tuple[int, ...]) -> int:
    """ZeRO-3 parameters kept gathered (parameter_offload.py ``mark_persistent_parameters``: ds_numel <=
    stage3_param_persistence_threshold)."""
    return sum(n for n in numels if n <= s.param_persistence_threshold) if s.stage == 3 else 0


def _partition(s: Settings, numels: tuple[int, ...], nd: int) -> int:
    if s.stage == 3:
        return stage3_partition_numel(numels, nd)
    return flat_padded_numel(numels, nd) // nd


def terms(s: Settings, numels: tuple[int, ...], nd: int) -> tuple[DSTerm, ...]:
    """Every buffer of model states and buckets on one rank, for parameters of ``numels`` elements
    (``model.named_parameters()`` order) at N_d = ``nd``."""
    p, g, inner, kind = s.dtype, s.grad_dtype, inner_optimizer_class(s), optimizer_class(s)
    part = _partition(s, numels, nd)
    fused = 1 if inner == "FusedAdam" else 0
    out: list[DSTerm] = []
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        out += [
            DSTerm("16-bit parameter partition", "persistent", part, p,
                   "runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3._create_fp16_partitions_with_defragmentation (lp_param_buffer)"),
            DSTerm("fp32 master partition", "persistent", part, "fp32",
                   "runtime/zero/stage3.py _create_fp32_partitions (a clone, even when the model is fp32)"),
            DSTerm("gradient partition", "persistent", part, g,
                   "runtime/zero/stage3.py _setup_for_real_optimizer (grad_partitions_flat_buffer, grad_accum_dtype)"),
            DSTerm("reduce bucket (IPG)", "persistent", s.reduce_bucket_size if s.contiguous_gradients else 0, g,
                   "runtime/zero/stage3.py _setup_for_real_optimizer (ipg bucket, torch.empty(reduce_bucket_size))"),
            DSTerm("persistent parameters (gathered)", "lazy", persistent_numel(s, numels), p,
                   "runtime/zero/parameter_offload.py mark_persistent_parameters; gathered in forward and kept"),
            DSTerm("inf/nan tracker", "persistent", 1, "bool", "runtime/zero/stage3.py __init__ (inf_or_nan_tracker)"),
            DSTerm("overflow buffer", "persistent", fused, "int32",
                   "ops/adam/fused_adam.py FusedAdam.__init__ (_dummy_overflow_buf)"),
            DSTerm("grad-norm scalar", "lazy", 1, "fp64", "runtime/zero/stage3.py step (fp64 global norm; measured 8 B)"),
            DSTerm("Adam step tensor", "lazy", 1 - fused, "fp32", "torch/optim/adam.py _init_group (state['step'])"),
        ]  # fmt: skip
    else:
        flat = flat_padded_numel(numels, nd)
        bf16_opt = kind == "BF16_Optimizer"
        out += [
            DSTerm("16-bit flat parameters (full, padded)", "persistent", flat, p,
                   "runtime/bf16_optimizer.py BF16_Optimizer._setup_for_real_optimizer (bf16_groups_flat)" if bf16_opt
                   else "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__ (bit16_groups_flat)"),
            DSTerm("fp32 master partition", "persistent", part, "fp32",
                   "runtime/bf16_optimizer.py _setup_for_real_optimizer (fp32_groups_flat_partition)" if bf16_opt
                   else "runtime/zero/stage_1_and_2.py __init__ (single_partition_of_fp32_groups: .clone(), even in fp32)"),
        ]  # fmt: skip
        if bf16_opt:
            out.append(DSTerm("fp32 gradient accumulation buffer (full, padded)", "persistent", flat, g,
                              "runtime/bf16_optimizer.py _setup_for_real_optimizer (fp32_groups_gradients_flat)"))  # fmt: skip
        else:
            buffers = (2 if s.overlaps else 1) if s.contiguous_gradients else 0
            out.append(DSTerm("reduce bucket (IPG)" + (" x2 (overlap_comm)" if buffers == 2 else ""), "backward",
                              buffers * s.reduce_bucket_size, g,
                              "runtime/zero/stage_1_and_2.py setup_buckets (torch.empty(reduce_bucket_size) per comm "
                              "dtype, a second when overlap_comm), at the first gradient hook", tensors=max(buffers, 1)))  # fmt: skip
        out.append(DSTerm("overflow buffer", "persistent", fused, "int32",
                          "ops/adam/fused_adam.py FusedAdam.__init__ (_dummy_overflow_buf)"))  # fmt: skip
        out.append(DSTerm("step scalars", "lazy", 2 - fused, "fp32",
                          "the global grad norm kept by the optimizer (measured 4 B) and, with torch Adam, its "
                          "fp32 step tensor (torch/optim/adam.py _init_group)"))  # fmt: skip
    out.append(DSTerm(f"Adam m and v ({inner})", "lazy", 2 * part, "fp32",
                      "ops/adam/fused_adam.py FusedAdam.step (zeros_like exp_avg, exp_avg_sq) / torch/optim/adam.py "
                      "_init_group", tensors=2))  # fmt: skip
    return tuple(out)


def model_state_bytes(all_terms: tuple[DSTerm, ...], after_step: bool) -> int:
    """Bytes alive at a step boundary: persistent terms, plus lazy ones once a step has run."""
    lives = ("persistent", "lazy") if after_step else ("persistent",)
    return sum(t.bytes for t in all_terms if t.live in lives)


def memory_breakdown(s: Settings, numels: tuple[int, ...], nd: int) -> MemoryBreakdown:
    """Model states after a step, as params (16-bit and persistent gathered), grads, optimizer (master, m, v,
    scalars) and the ZeRO-3 bucket counted with the gradients (it holds them)."""
    params = grads = opt = 0
    for t in terms(s, numels, nd):
        if t.live == "backward":
            continue
        if "parameter" in t.name:
            params += t.bytes
        elif "gradient" in t.name or "bucket" in t.name:
            grads += t.bytes
        else:
            opt += t.bytes
    return MemoryBreakdown(params, grads, opt)


def greedy_buckets(numels: tuple[int, ...], bucket: int) -> tuple[int, ...]:
    """Element counts of the buckets DeepSpeed reduces, tensors taken in order: a bucket is sent before a
    tensor that would overflow it (a tensor larger than the bucket goes alone)
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``; stage3.py
    ``__reduce_and_partition_ipg_grads``)."""
    out, current = [], 0
    for n in numels:
        if current and current + n > bucket:
            out.append(current)
            current = 0
        current += n
    if current:
        out.append(current)
    return tuple(out)


def collectives(s: Settings, numels: tuple[int, ...], nd: int, grad_accum: int = 1,
                trace: Optional[Stage3Trace] = None) -> tuple[DSCollective, ...]:
    """One steady-state step's collectives (the second step on: ZeRO-3's first step records its trace).

    ``grad_accum`` micro-steps per step (measured at 2): ZeRO-2 reduces every micro-step, ZeRO-3 gathers
    in every micro-step's forward and reduce-scatters in every backward; ZeRO-1 and BF16_Optimizer reduce at
    the boundary only (engine.py ``allreduce_gradients``).

    ``numels`` in parameter order. Stage 1 reduces after backward in parameter order
    (``reduce_gradients`` walks ``bit16_groups``: calls exact); stage 2 and 3 in gradient-ready order
    (autograd's; the call count is the parameter-order bucket count, a bound, not exact).
    """
    if nd == 1:
        return ()
    kind, p, g = optimizer_class(s), s.dtype, s.grad_dtype
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        persist = persistent_numel(s, numels)
        out = []
        if trace is None:
            trace = stage3_trace(tuple((f"t{i}.weight", (n,)) for i, n in enumerate(numels)))
        sched = stage3_schedule(trace, numels, nd, s.param_persistence_threshold, s.prefetch_bucket_size,
                                s.max_live_parameters, s.max_reuse_distance)  # fmt: skip
        src = ("runtime/zero/partitioned_param_coordinator.py fetch_sub_module -> __all_gather_params (the module's "
               "parameters, then the prefetch: one all_gather_coalesced call each; stage3_schedule)")
        for phase, calls, elements in (("forward", sched.forward_calls, sched.forward_elements),
                                       ("backward", sched.backward_calls, sched.backward_elements)):
            if calls:
                out.append(DSCollective("all-gather", phase, grad_accum * calls, grad_accum * elements, p, src))
        out += [
            DSCollective("reduce-scatter", "backward", grad_accum * len(greedy_buckets(numels, s.reduce_bucket_size)),
                         grad_accum * sum(numels), g,
                         "runtime/zero/stage3.py __reduce_and_partition_ipg_grads -> "
                         "partitioned_param_data_shard / reduce_scatter_coalesced, bucket by bucket", calls_exact=False),
            DSCollective("all-reduce", "optimizer_step", 1, 1, "fp64",
                         "runtime/zero/stage3.py _get_norm_groups / get_grad_norm (fp64 global norm)"),
        ]  # fmt: skip
        if p == "fp16":  # measured with the CPU accelerator's fp16 check overridden (docs/engines/deepspeed.md)
            out.append(DSCollective("all-reduce", "optimizer_step", 1, 1, "uint8",
                                    "runtime/zero/stage3.py _overflow_check_and_loss_scale_update (fp16 only) -> "
                                    "has_overflow"))  # fmt: skip
        if persist:
            out.append(DSCollective("all-gather", "optimizer_step", sum(1 for n in numels if n <= s.param_persistence_threshold),
                                    persist, p, "runtime/zero/stage3.py _post_step -> persistent parameters re-gathered "
                                    "(parameter_offload.py persistent_parameters)"))  # fmt: skip
        return tuple(out)
    flat = flat_padded_numel(numels, nd)
    gather = DSCollective("all-gather", "optimizer_step", 1, flat, p, "runtime/utils.py all_gather_dp_groups -> "
                          "all_gather_into_tensor_dp_groups (one all_gather_into_tensor of the padded flat group, "
                          "whatever allgather_bucket_size: its shards are cut only without all_gather_into_tensor; "
                          "measured: one call at 5,000 elements)")  # fmt: skip
    if kind == "BF16_Optimizer":
        return (
            DSCollective("all-reduce", "backward", 1, flat, p,
                         "runtime/bf16_optimizer.py BF16_Optimizer (engine.allreduce_gradients of the flat bf16 grads)"),
            gather,
        )  # fmt: skip
    buckets = greedy_buckets(numels, s.reduce_bucket_size)
    micro = grad_accum if s.stage == 2 else 1
    out = [
        DSCollective("all-reduce", "backward", micro * len(buckets), micro * sum(numels), g,
                     "runtime/zero/stage_1_and_2.py average_tensor -> allreduce_and_scatter -> allreduce_bucket "
                     "(use_multi_rank_bucket_allreduce: an all-reduce per bucket, not a reduce-scatter)",
                     calls_exact=s.stage == 1 and not s.overlaps),  # overlap_comm: from the hooks
        DSCollective("all-reduce", "optimizer_step", 1, 1, "fp32",
                     "runtime/zero/stage_1_and_2.py get_grad_norm_direct (the global gradient norm)"),
    ]  # fmt: skip
    if p in ("bf16", "fp16"):
        out.append(DSCollective("all-reduce", "optimizer_step", 1, 1, "uint8",
                                "runtime/zero/stage_1_and_2.py has_overflow (check_grad_overflow)"))  # fmt: skip
    out.append(gather)
    return tuple(out)


def ds_estimate_zero2_bytes(psi: int, nd: int) -> int:
    """DeepSpeed's own ZeRO-2 estimate per GPU, no offload: 2Ψ + 18Ψ/N_d (runtime/zero/stage_1_and_2.py
    ``estimate_zero2_model_states_mem_needs``); shown beside the prediction, never used for it."""
    return 2 * psi + int(18 * psi / nd)


def ds_estimate_zero3_bytes(psi: int, largest_layer_numel: int, nd: int) -> int:
    """DeepSpeed's own ZeRO-3 estimate per GPU, no offload: 4·largest layer + 18Ψ/N_d
    (runtime/zero/stage3.py ``estimate_zero3_model_states_mem_needs``)."""
    return 4 * largest_layer_numel + int(18 * psi / nd)


def ds_estimate_bytes(s: Settings, numels: tuple[int, ...], nd: int) -> int:
    """DeepSpeed's own estimator for this run (ZeRO-1 has none: DeepSpeed's ZeRO-2 one is shown)."""
    if s.stage == 3:
        return ds_estimate_zero3_bytes(sum(numels), max(numels), nd)
    return ds_estimate_zero2_bytes(sum(numels), nd)


# --- the peak per phase --------------------------------------------------------------------------------

ACT_SRC = "zeroplan/formulas/activation_terms.py"


@dataclass(frozen=True)
class DSRun:
    """One rank of DeepSpeed training a transformer: settings, parameter sizes (``named_parameters``
    order), N_d, one micro-batch's activations, and the model's head and final norm sizes."""

    settings: Settings
    numels: tuple[int, ...]
    nd: int
    acts: ModelActivations
    head_numel: int
    final_norm_numel: int
    tied_head: bool
    checkpointing: str = "none"
    foreach: bool = False
    grad_accum: int = 1
    modules: tuple[tuple[int, ...], ...] = ()
    """parameter sizes module by module, in build order (``named_parameters`` grouped by owning module):
    what ``deepspeed.zero.Init`` partitions after each module's ``__init__``."""
    trace: Optional[Stage3Trace] = None
    """ZeRO-3's module trace (``stage3_trace``): what the coordinator fetches and releases, in order."""
    param_blocks: tuple[int, ...] = ()
    """per parameter (``named_parameters`` order), the index of its decoder block; -1 outside the blocks."""
    output_projections: tuple[int, ...] = ()
    """the parameters of the blocks' MLP output projections (GPT-2 ``mlp.c_proj``, Llama ``mlp.down_proj``)."""


def _act(name: str, nbytes: int, tensors: int = 1) -> Term:
    return Term(name, nbytes, ACT_SRC, tensors)


def _states(run: DSRun, after_step: bool = True) -> tuple[Term, ...]:
    lives = ("persistent", "lazy") if after_step else ("persistent",)
    return tuple(t.term() for t in terms(run.settings, run.numels, run.nd) if t.live in lives and t.bytes)


def _bucket(run: DSRun) -> tuple[Term, ...]:
    """ZeRO-1/2: the reduce bucket(s), allocated at the first gradient hook of each backward."""
    return tuple(t.term() for t in terms(run.settings, run.numels, run.nd) if t.live == "backward" and t.bytes)


def _pbytes(run: DSRun) -> int:
    return DTYPE_BYTES[run.settings.dtype]


# --- ZeRO-3: which parameters are gathered when (the coordinator's schedule over the module trace) ------

FETCH, RELEASE = "fetch", "release"


@dataclass(frozen=True)
class TraceEvent:
    """One hook of ZeRO-3's module trace: ``fetch`` (parameter_offload.py ``pre_sub_module_forward_function``
    / ``pre_sub_module_backward_function`` -> ``fetch_sub_module``) or ``release`` (``post_sub_module_forward_
    function`` / ``post_sub_module_backward_function`` -> ``release_sub_module``) of ``module``, in forward
    or backward."""

    op: Literal["fetch", "release"]
    module: int
    forward: bool
    in_backward: Optional[bool] = None
    """the training phase it happens in (all-gathers and peaks are counted there); None: backward iff not
    ``forward``. A forward hook inside backward (activation checkpointing's recomputed forward) sets True."""

    @property
    def backward_phase(self) -> bool:
        """Whether the event happens while backward runs."""
        return (not self.forward) if self.in_backward is None else self.in_backward


@dataclass(frozen=True)
class Stage3Trace:
    """One micro-step's module hooks as ZeRO-3 sees them: ``modules`` (per module, the indices of its
    parameters in ``named_parameters`` order, external ones included: partitioned_param_coordinator.py
    ``iter_params``), ``events`` (forward, then backward; a module fetched in backward and never released
    there, because no input of it needs a gradient, is released by ``release_backward_leftovers`` at the
    end) and ``marks``: (name, first event, last event) spans the peak moments read."""

    modules: tuple[tuple[int, ...], ...]
    events: tuple[TraceEvent, ...]
    marks: tuple[tuple[str, int, int], ...] = ()
    names: tuple[str, ...] = ()
    """the modules' names (``named_modules``), for reading; not used by the schedule."""

    def span(self, name: str) -> tuple[int, int]:
        """The (first, last) event of mark ``name``."""
        for mark, first, last in self.marks:
            if mark == name:
                return first, last
        raise KeyError(name)


@dataclass(frozen=True)
class Stage3Gather:
    """One all-gather of the coordinator (partition_parameters.py ``all_gather_coalesced``): the parameters it
    gathers (indices), the event that issued it (a module's own fetch or the prefetch after it), its elements
    (the output: each parameter padded to N_d) and the event whose wait popped its last parameter from the
    inflight registry (its flat buffer, if coalesced, is freed there; -1: still in flight at the end)."""

    params: tuple[int, ...]
    issued: int
    elements: int
    popped: int


@dataclass(frozen=True)
class Stage3Schedule:
    """What ``stage3_schedule`` found for one steady-state micro-step (elements, on one rank).

    ``gathered[i]``: gathered non-persistent parameter elements after event ``i`` (each parameter's own
    tensor, plus the flat buffer of a coalesced all-gather while one of its parameters is still waiting in
    the inflight registry); ``high[i]``: the most during the event. ``regathered``: parameters all-gathered
    in backward (indices). Calls and elements of the all-gathers, forward and backward, elements as the
    output tensor (each parameter padded to N_d)."""

    gathered: tuple[int, ...]
    high: tuple[int, ...]
    forward_peak: int
    backward_peak: int
    regathered: tuple[int, ...]
    forward_calls: int
    forward_elements: int
    backward_calls: int
    backward_elements: int
    buffers: tuple[int, ...] = ()
    """``buffers[i]``: the part of ``gathered[i]`` that is flat buffers of coalesced all-gathers still open (their
    parameters were copied out at the first wait; the buffer lives until the registry pops the last one)."""
    gathers: tuple[Stage3Gather, ...] = ()
    """every all-gather call, in order."""

    def event(self, trace: Stage3Trace, mark: str) -> int:
        """The first event of ``mark``'s span after which the most is gathered."""
        first, last = trace.span(mark)
        return max(range(first, last + 1), key=lambda i: (self.gathered[i], -i))

    def at(self, trace: Stage3Trace, mark: str) -> int:
        """The most gathered after any event of ``mark``'s span."""
        return self.gathered[self.event(trace, mark)]


def stage3_schedule(trace: Stage3Trace, numels: tuple[int, ...], nd: int, persistence_threshold: int,
                    prefetch_bucket_size: int, max_live_parameters: int, max_reuse_distance: int) -> Stage3Schedule:
    """Replay partitioned_param_coordinator.py ``PartitionedParameterCoordinator`` (0.19.8) over ``trace``."""
    return _stage3_schedule(trace, numels, nd, persistence_threshold, prefetch_bucket_size, max_live_parameters,
                            max_reuse_distance)  # fmt: skip


@lru_cache(maxsize=256)
def _stage3_schedule(trace: Stage3Trace, numels: tuple[int, ...], nd: int, threshold: int, bucket: int,
                     max_live: int, max_reuse: int) -> Stage3Schedule:
    """``stage3_schedule`` (cached: the planner asks for the same schedule at every candidate)."""

    NA, INFLIGHT, AVAILABLE = 0, 1, 2  # partition_parameters.py ZeroParamStatus
    persist = [n <= threshold for n in numels]  # parameter_offload.py mark_persistent_parameters
    padded = [-(-n // nd) * nd for n in numels]  # _all_gather_sequential buffer / _all_gather_dtype flat share
    order = [e.module for e in trace.events if e.op == FETCH]  # record_module: __submodule_order
    # record_parameters: __param_order, each module's parameters sorted by ds_id, with the step it is used at
    queue = [(p, step) for step, m in enumerate(order) for p in sorted(set(trace.modules[m]))]
    uses: dict[int, list[int]] = {}
    for step, m in enumerate(order):
        for p in set(trace.modules[m]):
            uses.setdefault(p, []).append(step)
    before = [0]  # elements of the modules before step k (__params_to_release counts every parameter)
    for m in order:
        before.append(before[-1] + sum(numels[p] for p in trace.modules[m]))

    status = [AVAILABLE if persist[p] else NA for p in range(len(numels))]
    active: list[set[int]] = [set() for _ in numels]  # ds_active_sub_modules
    fetched_for = [-(10**10)] * len(numels)  # __most_recent_step_id_param_fetched_for
    own = [0] * len(numels)  # elements a gathered parameter holds
    registry: dict[int, int] = {}  # __inflight_param_registry: parameter -> handle
    handles: dict[int, list] = {}  # handle -> [parameters, flat elements (0: one parameter), waiting, done]
    st = {"step": 0, "qi": 0, "avail": 0, "mem": 0, "high": 0, "flat": 0, "event": 0}
    issued: list[list] = []  # per call: [params, event, elements, popped]
    calls = {True: [0, 0], False: [0, 0]}
    regathered: list[int] = []

    def grow(n: int) -> None:
        st["mem"] += n
        st["high"] = max(st["high"], st["mem"])

    def all_gather(params, forward: bool) -> None:  # __all_gather_params_ -> all_gather_coalesced; forward: the phase
        todo = sorted(p for p in params if status[p] == NA)
        if not todo:
            return
        st["avail"] += sum(numels[p] for p in todo)
        calls[forward][0] += 1
        calls[forward][1] += sum(padded[p] for p in todo)
        if not forward:
            regathered.extend(todo)
        hid = len(handles)
        issued.append([tuple(todo), st["event"], sum(padded[p] for p in todo), -1])
        if len(todo) == 1:  # _all_gather_sequential: param.data is the padded buffer
            own[todo[0]] = padded[todo[0]]
            grow(padded[todo[0]])
            handles[hid] = [todo, 0, 1, False]
        else:  # _all_gather_dtype: one flat buffer; wait() copies each parameter out (torch.cat)
            flat = sum(padded[p] for p in todo)
            grow(flat)
            st["flat"] += flat
            handles[hid] = [todo, flat, len(todo), False]
        for p in todo:
            status[p], registry[p] = INFLIGHT, hid

    def wait(p: int) -> None:  # fetch_sub_module: __inflight_param_registry.pop(param).wait()
        if p not in registry:
            return
        hid = registry.pop(p)
        h = handles[hid]
        if not h[3]:
            h[3] = True
            for q in h[0]:
                status[q] = AVAILABLE
                if h[1]:
                    own[q] = numels[q]
                    grow(numels[q])
        h[2] -= 1
        if h[2] == 0:
            issued[hid][3] = st["event"]
            st["mem"] -= h[1]
            st["flat"] -= h[1]

    def free(p: int) -> None:  # __release_param
        if status[p] == AVAILABLE and not active[p] and not persist[p]:
            status[p] = NA
            st["mem"] -= own[p]
            st["avail"] -= numels[p]

    def to_release(m: int, step: int) -> set[int]:  # __params_to_release
        out = set()
        for p in set(trace.modules[m]):
            if persist[p] or fetched_for[p] > step:  # "reuse skipped by prefetch"
                continue
            k = bisect.bisect_left(uses[p], step)  # its next use in __submodule_order[step_id:]
            if k < len(uses[p]) and before[uses[p][k]] - before[step] < max_reuse:
                continue
            out.add(p)
        return out

    def fetch(m: int, forward: bool) -> None:  # fetch_sub_module; forward: the phase (calls counted there)
        step, params = st["step"], set(trace.modules[m])
        all_gather(params, forward)
        for p in params:
            active[p].add(m)
            wait(p)
        expected = {p for p in params if fetched_for[p] < step}
        popped = set()
        while st["qi"] < len(queue) and len(popped) < len(expected):
            p, used_at = queue[st["qi"]]
            st["qi"] += 1
            fetched_for[p] = used_at
            popped.add(p)
        if popped != expected:
            raise ValueError(f"ZeRO-3 trace: step {step} expected {sorted(expected)} next in the queue, got {sorted(popped)}")
        if bucket > 0:
            limit = min(max_live - st["avail"], bucket)
            chosen: set[int] = set()
            numel = 0
            while st["qi"] < len(queue) and numel < limit:
                p, used_at = queue[st["qi"]]
                st["qi"] += 1
                if status[p] == NA and p not in chosen:
                    chosen.add(p)
                    numel += numels[p]
                fetched_for[p] = max(fetched_for[p], used_at)
            if numel:
                all_gather(chosen, forward)
        st["step"] += 1

    def release(m: int, forward: bool) -> None:  # release_sub_module
        drop = to_release(m, st["step"])
        for p in set(trace.modules[m]):
            active[p].discard(m)
            if p in drop:
                free(p)

    gathered, high, buffers = [], [], []
    forward_peak = backward_peak = 0
    for i, e in enumerate(trace.events):
        st["high"], st["event"] = st["mem"], i
        (fetch if e.op == FETCH else release)(e.module, not e.backward_phase)
        gathered.append(st["mem"])
        high.append(st["high"])
        buffers.append(st["flat"])
        if not e.backward_phase:
            forward_peak = max(forward_peak, st["high"])
        else:
            backward_peak = max(backward_peak, st["high"])
    return Stage3Schedule(tuple(gathered), tuple(high), forward_peak, backward_peak, tuple(regathered),
                          calls[True][0], calls[True][1], calls[False][0], calls[False][1], tuple(buffers),
                          tuple(Stage3Gather(*g) for g in issued))  # fmt: skip


_LLAMA_FORWARD = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
"""modeling_llama.py LlamaDecoderLayer.forward runs these in this order (registered self_attn, mlp, then the
norms); GPT-2 blocks run in registration order."""


_MLP_PROJECTIONS = {"gpt": ("c_fc", "c_proj"), "llama": ("up_proj", "down_proj")}
"""A block's MLP input projection (the one run last before the activation product) and output projection
(validate/transformer.py GPT2MLP, LlamaMLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``)."""


def stage3_trace(shapes: tuple[tuple[str, tuple[int, ...]], ...], style: Optional[str] = None,
                 tied: bool = False, head_module: bool = False) -> Stage3Trace:
    """ZeRO-3's module trace of the validator's causal LM (validate/transformer.py ``CausalLM``) from its
    parameter names: every module called in forward gets its hooks (parameter_offload.py
    ``_register_deepspeed_module``), containers that are never called (the ``transformer``/``model`` body,
    the block ``ModuleList``) do not; the head weight is applied by the root (``F.linear``), so it is an
    external parameter of the root (``ZeROOrderedDict.__getitem__`` -> ``register_external_parameter``;
    measured: the root's fetch all-gathers it) and ``lm_head`` itself is never called. Backward mirrors
    forward: a module's pre-backward fetch, its children from the last, its post-backward release, except
    where no input needs a gradient (the root and the embeddings, fed token ids): those wait for
    ``release_backward_leftovers``.

    ``head_module``: the transformers model instead (modeling_llama.py ``LlamaForCausalLM.forward``,
    modeling_gpt2.py ``GPT2LMHeadModel.forward``: ``self.model(...)`` / ``self.transformer(...)``, then
    ``self.lm_head(hidden_states)``): the body is called (hooks, no parameters of its own; fed token ids, so no
    post-backward release) and ``lm_head`` is a module called after it, owning the head weight (the token
    embedding's when tied); the root has no parameter. Measured (tiny-llama, N_d = 2): the all-gathers equal
    this trace's call for call. Modules without parameters (LlamaRotaryEmbedding, the MLP's activation) have
    hooks too; left out: they gather nothing and the replay's reuse distance walks elements.

    Marks: per decoder block j, ``block j MLP input`` (the fetch of its MLP input projection) and ``block j output
    projection`` (the fetch of its MLP output projection, the block's last module), for the forward moments."""
    names = [name for name, _ in shapes]
    head = next((i for i, n in enumerate(names) if n == "lm_head.weight"), None)
    if head is None and tied:  # the head weight is the token embedding (CausalLM.head_weight; tied lm_head)
        head = next((i for i, n in enumerate(names) if n.endswith(("wte.weight", "embed_tokens.weight"))), None)
    children: dict[str, list[str]] = {"": []}
    params: dict[str, list[int]] = {"": []}
    for i, name in enumerate(names):
        owner = name.rpartition(".")[0]
        params.setdefault(owner, []).append(i)
        parts = owner.split(".") if owner else []
        for depth in range(len(parts)):
            parent, path = ".".join(parts[:depth]), ".".join(parts[: depth + 1])
            if path not in children:
                children[path] = []
                params.setdefault(path, [])
                children[parent].append(path)

    def is_list(path: str) -> bool:  # nn.ModuleList: children named 0, 1, ...
        return bool(children[path]) and all(c.rpartition(".")[2].isdigit() for c in children[path])

    def called(path: str) -> list[str]:
        """The modules ``path``'s forward calls, in order (containers never called are looked through)."""
        out = []
        for c in children.get(path, ()):
            if c == "lm_head" and style is not None and not head_module:
                continue  # CausalLM.forward: F.linear(x, self.head_weight)
            if is_list(c) or (path == "" and style is not None and not head_module and not params[c]):
                out += called(c)
            else:
                out.append(c)
        if style == "llama" and path.rpartition(".")[2].isdigit():  # a decoder layer; sorted() is stable
            rank = {name: i for i, name in enumerate(_LLAMA_FORWARD)}
            out.sort(key=lambda c: rank.get(c.rpartition(".")[2], 0))
        if head_module and path == "" and head is not None and "lm_head" not in out:
            out.append("lm_head")  # tied: lm_head.weight is not in named_parameters, the module is still called
        return out

    index: dict[str, int] = {}
    modules: list[tuple[int, ...]] = []

    def module(path: str) -> int:
        if path not in index:
            own = list(params.get(path, ()))
            if path == "" and style is not None and not head_module:  # the head weight, the root's external parameter
                own += [head] if head is not None else []
            if path == "lm_head" and head_module:  # a tied head owns the embedding's weight: not in the names
                own = [head] if head is not None else []
            index[path] = len(modules)
            modules.append(tuple(own))
        return index[path]

    top = called("")
    bodies = [c for c in top if c != "lm_head" and children[c]] if head_module else []
    top = called(bodies[0]) if bodies else top  # the transformers body's own calls
    first_block = next((i for i, c in enumerate(top) if c.rpartition(".")[2].isdigit()), len(top))
    no_grad_input = {"", *bodies} | set(top[:first_block] if style is not None else ())  # the embeddings: token ids in
    events: list[TraceEvent] = []
    spans: dict[str, list[int]] = {}
    last_block = next((c for c in reversed(top) if c.rpartition(".")[2].isdigit()), None)

    projections = _MLP_PROJECTIONS.get(style or "", ())

    def forward(path: str) -> None:
        start = len(events)
        events.append(TraceEvent(FETCH, module(path), True))
        block, _, leaf = path.rpartition(".mlp.")
        if leaf in projections and block.rpartition(".")[2].isdigit():
            what = "MLP input" if leaf == projections[0] else "output projection"
            spans[f"block {block.rpartition('.')[2]} {what}"] = [start, start]
        if path == "lm_head" and head_module:  # its fetch: the final norm's output made, the logits not yet
            spans["LM head forward"] = spans["LM head fetch"] = [start, start]
        for c in called(path):
            forward(c)
        if path == "" and not head_module:
            spans["LM head forward"] = [len(events) - 1, len(events) - 1]
        events.append(TraceEvent(RELEASE, module(path), True))
        if path == last_block:
            spans["last block forward"] = [start, len(events) - 1]

    def backward(path: str) -> None:
        start = len(events)
        events.append(TraceEvent(FETCH, module(path), False))
        if path == ("lm_head" if head_module else ""):
            spans["LM head backward"] = [start, start]
        for c in reversed(called(path)):
            backward(c)
        if path not in no_grad_input:
            events.append(TraceEvent(RELEASE, module(path), False))
        if path == last_block:
            spans["last block backward"] = [start, len(events) - 1]

    forward("")
    spans["forward end"] = [len(events) - 1, len(events) - 1]
    backward("")
    spans.setdefault("last block forward", spans["forward end"])
    spans.setdefault("last block backward", spans["LM head backward"])
    marks = tuple((k, v[0], v[1]) for k, v in spans.items())
    by_index = sorted(index, key=index.get)
    return Stage3Trace(tuple(modules), tuple(events), marks, tuple(p or "(root)" for p in by_index))


def _schedule(run: DSRun) -> Optional[Stage3Schedule]:
    """ZeRO-3's replayed coordinator for ``run`` (``stage3_schedule``); None below stage 3."""
    s = run.settings
    if s.stage != 3 or run.trace is None:
        return None
    return stage3_schedule(run.trace, run.numels, run.nd, s.param_persistence_threshold, s.prefetch_bucket_size,
                           s.max_live_parameters, s.max_reuse_distance)  # fmt: skip


GATHER_SRC = ("runtime/zero/partitioned_param_coordinator.py fetch_sub_module (prefetch), release_sub_module "
              "(__params_to_release); partition_parameters.py all_gather_coalesced")  # fmt: skip


def _gathered(run: DSRun, sched: Optional[Stage3Schedule], mark: str, during: bool = False) -> tuple[Term, ...]:
    """ZeRO-3 after the first step: the non-persistent parameters gathered at the peak moment ``mark`` of the
    trace (``stage3_schedule``: fetched or prefetched and not yet released) and, apart, the flat buffers of
    coalesced all-gathers still open there (measured: gpt-tiny checkpointed, N_d = 2 and 4, 21,312 B in the last
    block's MLP: its c_fc bias and c_proj weight, prefetched together). ``during``: the most while the mark's
    event runs (its wait frees a buffer only after its own all-gather), one term. ``sched``: ``_schedule(run)``
    (asked once per phase: hashing a 70B trace for the cache costs milliseconds)."""
    if sched is None:
        return ()
    p, i = _pbytes(run), sched.event(run.trace, mark)
    if during:
        return (Term(f"gathered parameters and open all-gather buffers (during {mark})", sched.high[i] * p, GATHER_SRC),)
    buffers = sched.buffers[i] if sched.buffers else 0
    return (Term(f"gathered parameters ({mark})", (sched.gathered[i] - buffers) * p, GATHER_SRC),
            *((Term("coalesced all-gather buffers awaiting their last module", buffers * p,
                    "runtime/zero/partition_parameters.py _all_gather_dtype (flat_tensor) held by "
                    "AllGatherCoalescedHandle until partitioned_param_coordinator.py fetch_sub_module pops the "
                    "call's last parameter"),) if buffers else ()))  # fmt: skip


def _blocks_saved(run: DSRun, n: int) -> Term:
    per = run.acts.block.saved if run.checkpointing == "none" else run.acts.block.ckpt_saved
    return _act(f"saved activations of {n} blocks", n * per, max(n, 1))


ZINIT = "runtime/zero/partition_parameters.py"


def _largest(moments: list[Moment]) -> Moment:
    return max(moments, key=lambda m: m.total())


def zero_init_moments(run: DSRun) -> tuple[Moment, ...]:
    """The model built under ``deepspeed.zero.Init``, module by module (``run.modules``): the worst moment
    of the builds and the worst of the weight initialisation (``Module.apply``).

    Each floating-point tensor is created as asked (fp32) and converted to the config's dtype, both alive
    for a moment (``zero_wrapper_for_fp_tensor_constructor``: ``tensor.data = tensor.data.to(dtype)``).
    After a module's ``__init__`` (``partition_after`` -> ``Init._post_init_method``) each of its parameters
    gets its partition, ceil(n / N_d) elements (``_partition_param``: ``ds_tensor = torch.empty(partition
    _size)``), before its full tensor is freed (``free_param``); the broadcast before it
    (``_zero_init_param``) is in place. The model's weight initialisation through ``Module.apply``
    (``apply_with_gather``) gathers one module's parameters at a time, each into a padded
    ceil(n / N_d)·N_d buffer (``_allgather_params_sequential``: ``flat_tensor``), then re-partitions them
    into the partitions they had. Measured: docs/engines/deepspeed.md "ZeRO-3 built under zero.Init".
    """
    p, nd = _pbytes(run), run.nd

    def part(n: int) -> int:  # partition_parameters.py _partition_numel
        return -(-n // nd)

    built, applied, before = [], [], 0
    for params in run.modules:
        done = 0  # this module's parameters created so far (full, in the config's dtype)
        for n in params:
            built.append(Moment("init", "zero.Init: a parameter created, then converted", (
                Term("partitions of the modules built before", before, f"{ZINIT} _partition_param (ds_tensor)"),
                Term("this module's parameters created before it", done, f"{ZINIT} zero_wrapper_for_fp_tensor_constructor"),
                Term("the parameter as created (fp32)", n * 4, f"{ZINIT} zero_wrapper_for_fp_tensor_constructor (fn(*args))"),
                Term("its copy in the config's dtype", n * p if p != 4 else 0,
                     f"{ZINIT} zero_wrapper_for_fp_tensor_constructor (tensor.data.to(target_fp_dtype))"))))  # fmt: skip
            done += n * p
        for i, n in enumerate(params):
            built.append(Moment("init", "zero.Init: a module's parameter partitioned", (
                Term("partitions of the modules built before", before, f"{ZINIT} _partition_param (ds_tensor)"),
                Term("this module's parameters partitioned before it", sum(part(x) for x in params[:i]) * p,
                     f"{ZINIT} _partition_param (ds_tensor)"),
                Term("this module's parameters not yet freed", sum(params[i:]) * p, f"{ZINIT} free_param (after the copy)"),
                Term("the parameter's new partition", part(n) * p,
                     f"{ZINIT} Init._post_init_method -> _zero_init_param -> _partition_param (ds_tensor)"))))  # fmt: skip
        before += sum(part(n) for n in params) * p
    for params in run.modules:
        applied.append(Moment("init", "zero.Init: a module's parameters gathered for Module.apply", (
            Term("partitions of the whole model", before, f"{ZINIT} _partition_param (ds_tensor)"),
            Term("this module's parameters gathered (padded)", sum(part(n) * nd for n in params) * p,
                 f"{ZINIT} apply_with_gather -> _allgather_params_sequential (flat_tensor)"))))  # fmt: skip
    return tuple(_largest(m) for m in (built, applied) if m)


def init_moments(run: DSRun) -> tuple[Moment, ...]:
    """``deepspeed.initialize``: the 16-bit cast, the flat copy (ZeRO-1/2), the optimizer's partitions; the
    model's build under ``deepspeed.zero.Init`` (``zero_init_moments``) when the settings say so."""
    s, numels = run.settings, run.numels
    p, psi = _pbytes(run), sum(numels)
    out = list(zero_init_moments(run)) if s.builds_partitioned else []
    # engine.py _configure_distributed_model -> _cast_module_mixed_precision: zero.Init built the model in the
    # config's dtype already (is_zero_init_model: no cast), else p.data.to(dtype), tensor by tensor
    if s.dtype != "fp32" and not s.builds_partitioned:
        # nn.Module._apply converts one parameter at a time: the fp32 ones not yet converted plus the 16-bit ones
        done, worst = 0, 0
        for n in numels:
            worst = max(worst, (psi - done) * 4 + (done + n) * p)
            done += n
        out.append(Moment("init", "16-bit cast of the model", (
            Term("fp32 model as built and its 16-bit copies so far", worst,
                 "runtime/engine.py _configure_distributed_model (module.to(dtype)) -> torch nn.Module._apply"),)))  # fmt: skip
    if optimizer_class(s) == "DeepSpeedZeroOptimizer_Stage3":
        st = _states(run, after_step=False)
        if s.dtype != "fp32":  # the 16-bit partition converted to fp32, then cloned: both alive for a moment
            part = stage3_partition_numel(numels, run.nd)
            src = "runtime/zero/stage3.py _create_fp32_partitions (converted = lp.to(fp32); converted.clone())"
            out.append(Moment("init", "fp32 master: converted and cloned", (
                *(t for t in st if t.name in ("16-bit parameter partition", "inf/nan tracker")),
                Term("16-bit partition converted to fp32", part * 4, src),
                Term("fp32 master partition (the clone)", part * 4, src))))  # fmt: skip
        # the built model is partitioned tensor by tensor: the first one's partition is allocated while the
        # whole model is still alive (measured: Llama, N_d = 4, 195,984 B = Ψ·4 + ceil(4,944 / 4)·4); under
        # zero.Init it was partitioned as built (zero_init_moments): _convert_to_zero_parameters skips it
        psrc = "runtime/zero/partition_parameters.py _convert_to_zero_parameters -> _zero_init_param -> _partition_param"
        if not s.builds_partitioned:
            out.append(Moment("init", "the built model partitioned, first tensor", (
                Term("model parameters as built (model dtype)", psi * p, "runtime/engine.py _configure_distributed_model"),
                Term("first parameter's partition", -(-numels[0] // run.nd) * p,
                     f"{psrc} (ds_tensor allocated before param.data is freed)"))))  # fmt: skip
        out.append(Moment("init", "partitioned parameters gathered once", (*st, Term(
            "largest parameter gathered", max(numels) * p,
            "runtime/zero/partition_parameters.py _allgather_params_sequential")) ))  # fmt: skip
        return tuple(out)
    flat = flat_padded_numel(numels, run.nd)
    part = flat // run.nd
    src = "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__"
    out.append(Moment("init", "flatten the 16-bit group", (
        Term("model parameters (before repointing into the flat buffer)", psi * p, "runtime/engine.py _configure_distributed_model"),
        Term("alignment padding", (flat - psi) * p, f"{src} (flatten_dense_tensors_aligned)"),
        Term("16-bit flat parameters", flat * p, f"{src} (bit16_groups_flat)"))))  # fmt: skip
    if optimizer_class(s) == "BF16_Optimizer":
        # no initialize_optimizer_states: the fp32 partition is cloned from the 16-bit one (.clone().float():
        # the clone dies at once), then the full fp32 gradient buffer (zeros_like) completes the states
        bsrc = "runtime/bf16_optimizer.py BF16_Optimizer._setup_for_real_optimizer"
        out.append(Moment("init", "fp32 partition cloned, gradient buffer zeroed", (
            *_states(run, after_step=False),)))  # fmt: skip
        out.append(Moment("init", "fp32 partition from the 16-bit clone", (
            Term("16-bit flat parameters", flat * p, f"{bsrc} (bf16_groups_flat)"),
            Term("16-bit partition clone", part * p, f"{bsrc} (bf16_dp_partitions[rank].clone())"),
            Term("fp32 master partition", part * 4, f"{bsrc} (.float(): fp32_groups_flat_partition)"))))  # fmt: skip
        return tuple(out)
    out.append(Moment("init", "initialize_optimizer_states", (*_states(run, after_step=False), Term(
        "fp32 gradient partition (zeros, dropped at once)", part * 4,
        "runtime/zero/stage_1_and_2.py initialize_optimizer_states (single_grad_partition)"))))  # fmt: skip
    return tuple(out)


def _held_between_micro_steps(run: DSRun, with_bucket: bool = True) -> tuple[Term, ...]:
    """With ``gradient_accumulation_steps`` > 1, what an earlier micro-step leaves for the next one's forward
    and backward (measured at G = 2). ZeRO-1 (and BF16_Optimizer) reduce only at the boundary
    (engine.py ``allreduce_gradients``; stage_1_and_2.py ``reduce_ready_partitions_and_remove_grads`` tests
    ``is_gradient_accumulation_boundary``): autograd's gradients stay in ``param.grad``, and the reduce
    bucket the first hook allocated stays until the boundary's ``_release_ipg_buffers``. ZeRO-2 reduces every
    micro-step into ``grads_in_partition``, kept to the step (the largest rank's). ZeRO-3 accumulates into its
    persistent gradient partition: nothing more."""
    s = run.settings
    if run.grad_accum == 1 or s.stage == 3:
        return ()
    p, numels = _pbytes(run), run.numels
    if s.stage == 1:
        grads = Term("gradients of earlier micro-steps (param.grad)", sum(numels) * p,
                     "torch autograd AccumulateGrad; runtime/engine.py allreduce_gradients (stage 1: at the boundary only)")  # fmt: skip
        bucket = _bucket(run) if with_bucket and optimizer_class(s) != "BF16_Optimizer" else ()
        return (grads, *bucket)
    part = flat_padded_numel(numels, run.nd) // run.nd
    gip = max(sum(numels[i] for i in _partition_params(numels, part, r)) for r in range(run.nd))
    return (Term("grads_in_partition (accumulated over micro-steps)", gip * p,
                 "runtime/zero/stage_1_and_2.py copy_grads_in_partition (kept until the step)"),)  # fmt: skip


def forward_moments(run: DSRun) -> tuple[Moment, ...]:
    """Each block, the LM head and the loss (validate/transformer.py CausalLM.forward, loss), on top of the
    model states after a step (the peak of a phase is the largest over steps).

    A block's moment, with the blocks before it saved: its output (after its MLP output projection, the block's
    last module, is fetched) or, checkpointed, its MLP's no-grad peak (after the input projection is fetched,
    before the output projection: activation_terms.py, the MLP's term of the working set). At ZeRO-3 what is
    gathered then is read off the replayed coordinator at that fetch (``stage3_schedule``; the trace's marks
    ``block j output projection`` / ``block j MLP input``), the open coalesced buffers apart; below stage 3
    only the last block's moment can be the largest. Without checkpointing a block also peaks while its output
    projection is fetched: its saved activations are all made (the projection's input is the last), its
    output and the projection's not yet, and a coalesced buffer whose last parameter is that projection's is
    still open until the fetch's wait."""
    acts, blk, L, sched = run.acts, run.acts.block, run.acts.n_layer, _schedule(run)
    base = (*_states(run), *_held_between_micro_steps(run),
            _act("batch (token ids, targets)", acts.batch, 2), _act("embedding saved (position ids)", acts.embed_saved))  # fmt: skip
    staged = run.settings.stage == 3 and run.trace is not None and f"block {L - 1} output projection" in dict(
        (m, f) for m, f, _ in run.trace.marks)  # fmt: skip

    def block(j: int) -> tuple[Moment, ...]:
        name = "last block" if j == L - 1 else f"block {j}"
        if run.checkpointing != "none":
            held = (_blocks_saved(run, j), _act("checkpointed block's working set (no grad)", blk.ckpt_forward_peak))
            return (Moment("forward", name, (*base, *_gathered(run, sched, f"block {j} MLP input" if staged
                                                                else "last block forward"), *held)),)  # fmt: skip
        done = (_blocks_saved(run, j + 1), _act("block output and last op's output", blk.forward_extra, 2))
        if not staged:
            return (Moment("forward", name, (*base, *_gathered(run, sched, "last block forward"), *done)),)
        mark = f"block {j} output projection"
        before = (_blocks_saved(run, j + 1), _act("block input and residual (not saved)", blk.forward_before_output))
        return (Moment("forward", f"{name}, output projection fetched", (*base, *_gathered(run, sched, mark, during=True), *before)),
                Moment("forward", name, (*base, *_gathered(run, sched, mark), *done)))  # fmt: skip

    head = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved), _act("logits", acts.logits))
    # CausalLM.loss: ``logits = self(tokens).float()``: nothing saves the model-dtype logits, so the fp32 copy
    # replaces them (in fp32 ``.float()`` returns the same tensor)
    loss = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved),
            _act("fp32 logits (loss upcast)", acts.logits_fp32),
            _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax), _act("loss", acts.loss))  # fmt: skip
    # the head a module of its own (transformers' lm_head; stage3_trace ``head_module``): while its fetch runs, a
    # coalesced buffer whose last parameter is the head's is still open (measured: tiny-llama, DeepSpeed's
    # default prefetch, the root's one call held to lm_head's fetch, +12,544 B over the last block's moment)
    fetched = () if sched is None or "LM head fetch" not in dict((m, f) for m, f, _ in run.trace.marks) else (
        Moment("forward", "LM head, its weight fetched", (*base, *_gathered(run, sched, "LM head fetch", during=True),
               _blocks_saved(run, L), _act("final norm saved and output", acts.final_saved))),)  # fmt: skip
    return (
        *(m for j in (range(L) if staged else (L - 1,)) for m in block(j)),
        *fetched,
        Moment("forward", "LM head", (*base, *_gathered(run, sched, "LM head forward"), *head)),
        Moment("forward", "cross-entropy", (*base, *_gathered(run, sched, "forward end"), *loss)),
    )


def _partition_params(numels: tuple[int, ...], part: int, rank: int) -> tuple[int, ...]:
    """Indices of the parameters overlapping ``rank``'s slice of the flat group (stage_1_and_2.py
    ``get_partition_info``: a parameter is in a partition when any of its elements is)."""
    lo, hi, start, out = rank * part, (rank + 1) * part, 0, []
    for i, n in enumerate(numels):
        if start < hi and start + n > lo:
            out.append(i)
        start += n
    return tuple(out)


def _stage1_reduce(run: DSRun) -> tuple[Moment, ...]:
    """ZeRO-1 reduces after backward, in parameter order (``reduce_gradients``): each gradient is copied into
    the bucket (its autograd tensor freed); the first bucket holding one of this rank's parameters
    allocates ``grads_in_partition`` (``copy_grads_in_partition``: every parameter overlapping the
    partition, whole, in the model dtype). The largest over ranks (the validator reports the max)."""
    numels, p = run.numels, _pbytes(run)
    part = flat_padded_numel(numels, run.nd) // run.nd
    buckets = greedy_buckets(numels, run.settings.reduce_bucket_size)
    out = []
    for rank in range(run.nd):
        mine = _partition_params(numels, part, rank)
        if not mine:
            continue
        first_offset, b, start = sum(numels[: mine[0]]), 0, 0
        while start + buckets[b] <= first_offset:  # the bucket that holds this rank's first parameter
            start += buckets[b]
            b += 1
        sent = sum(buckets[: b + 1])
        out.append(Moment("backward", f"reduce_gradients: rank {rank}'s grads_in_partition", (
            *_states(run), *_bucket(run),
            Term("autograd gradients not yet bucketed", (sum(numels) - sent) * p, "torch autograd (param.grad)"),
            Term("grads_in_partition", sum(numels[i] for i in mine) * p,
                 "runtime/zero/stage_1_and_2.py copy_grads_in_partition (torch.empty of the partition's parameters)"),
            _act("batch (token ids, targets)", run.acts.batch, 2))))  # fmt: skip
    return tuple(out)


def _partition_allocations(run: DSRun) -> tuple[tuple[int, int, Term], ...]:
    """ZeRO-2 (and ZeRO-1 with ``overlap_comm``), per rank: (rank, j, its ``grads_in_partition``) where j is the
    last block whose backward starts with that partition alive, or -1 when it comes after every block's.

    Gradients are bucketed in gradient-ready order (taken, as ``_stage2_early_partitions`` does, as the reverse
    of parameter order); a bucket is reduced at the hook of the first gradient that does not fit
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads`` -> ``reduce_ipg_grads``), and a rank's
    ``grads_in_partition`` is allocated by the first reduction of a bucket holding one of its parameters
    (``copy_grads_in_partition``), to live until the step. A reduction at the hook of block b's output projection
    (its first gradients, GPT-2 ``mlp.c_proj``, Llama ``mlp.down_proj``) comes at b's first op; one later in b
    comes before b - 1's; one at the final norm's or the head's before the last block's. Under checkpointing
    every block's backward holds its recomputed activations, so the partition allocated in one block is live
    at the next block's peak nearly as large (measured: gpt-tiny, N_d = 4, rank 2's partition, allocated at the
    last block's c_fc weight gradient, peaks at block 0's c_proj backward)."""
    numels, p, nd = run.numels, _pbytes(run), run.nd
    if not run.param_blocks:
        return ()
    order = tuple(reversed(range(len(numels))))  # gradient-ready order, approximated
    buckets = greedy_buckets(tuple(numels[i] for i in order), run.settings.reduce_bucket_size)
    first_of_bucket, at = [], 0
    for size in buckets:
        first_of_bucket.append(at)
        at_numel = 0
        while at_numel < size:
            at_numel += numels[order[at]]
            at += 1
    bucket_of = {}
    for b, start in enumerate(first_of_bucket):
        end = first_of_bucket[b + 1] if b + 1 < len(first_of_bucket) else len(order)
        for i in order[start:end]:
            bucket_of[i] = b
    last_in_blocks = max((i for i, j in enumerate(run.param_blocks) if j >= 0), default=-1)
    outputs = set(run.output_projections)
    part = flat_padded_numel(numels, nd) // nd
    out = []
    for rank in range(nd):
        mine = _partition_params(numels, part, rank)
        if not mine:
            continue
        first = min(bucket_of[i] for i in mine)
        if first + 1 >= len(buckets):
            continue  # the last bucket: reduced after backward
        hook = order[first_of_bucket[first + 1]]  # the gradient whose hook reduces it
        j = run.param_blocks[hook]
        if j < 0:
            j = run.acts.n_layer - 1 if 0 <= last_in_blocks < hook else -1  # final norm / head, or embeddings
        elif hook not in outputs:
            j -= 1
        if j >= 0:
            out.append((rank, j, Term("grads_in_partition", sum(numels[i] for i in mine) * p,
                                      "runtime/zero/stage_1_and_2.py copy_grads_in_partition")))  # fmt: skip
    return tuple(out)


def _stage1_kept_gradients(run: DSRun) -> dict[int, tuple[Term, ...]]:
    """ZeRO-1 reducing from its hooks (``overlap_comm``), per rank, per block j: the gradients of parameters
    larger than ``reduce_bucket_size`` outside the rank's partition from blocks after j (and the final norm and
    head), alive at j's first backward op. Such a gradient is reduced in place, not copied into the bucket
    (stage_1_and_2.py ``reduce_independent_p_g_buckets_and_remove_grads``: ``extra_large_param_to_reduce``), and
    stage 1 clears no gradient after reducing it (``reduce_ipg_grads``: only stage 2 calls
    ``clear_grad_attribute``), so it lives to the step's ``zero_grad``; smaller ones are views of the reused
    bucket. Measured: gpt-tiny, 5,000-element buckets, N_d = 4, checkpointed: ranks 0, 1, 2 held 41,472,
    41,472 and 20,736 B of c_fc / c_proj weight gradients more than ZeRO-2 in the same world."""
    numels, p, nd, L = run.numels, _pbytes(run), run.nd, run.acts.n_layer
    if not run.param_blocks:
        return {}
    last_in_blocks = max((i for i, j in enumerate(run.param_blocks) if j >= 0), default=-1)
    part = flat_padded_numel(numels, nd) // nd
    out = {}
    # (parameter, its block; L for the final norm and head, reduced before every block) of the gradients larger
    # than the bucket; the embeddings' come after the blocks
    large = [(i, L if b < 0 else b) for i, (n, b) in enumerate(zip(numels, run.param_blocks))
             if n > run.settings.reduce_bucket_size and (b >= 0 or i > last_in_blocks)]  # fmt: skip
    for rank in range(nd):
        mine = set(_partition_params(numels, part, rank))
        out[rank] = tuple(Term("gradients larger than the bucket, outside the partition (kept to the step)",
                               sum(numels[i] for i, b in large if b > j and i not in mine) * p,
                               "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce; stage 1 "
                               "clears no gradient)") for j in range(L))  # fmt: skip
    return out


def _stage2_early_partitions(run: DSRun) -> tuple[tuple[int, Term], ...]:
    """ZeRO-2 reduces bucket by bucket in gradient-ready order (the final norm, then the last block's
    parameters from the last); the first bucket fills during the last block's backward when the model
    needs more than one. A rank owning a parameter of that bucket allocates its ``grads_in_partition``
    there, with the activations alive (stage_1_and_2.py ``reduce_ipg_grads`` -> ``copy_grads_in_partition``)."""
    numels, p = run.numels, _pbytes(run)
    rev = tuple(reversed(numels))
    buckets = greedy_buckets(rev, run.settings.reduce_bucket_size)
    if len(buckets) < 2:  # everything fits one bucket: reduced after backward, activations gone
        return ()
    psi, first = sum(numels), buckets[0]
    part = flat_padded_numel(numels, run.nd) // run.nd
    out = []
    for rank in range(run.nd):
        mine = _partition_params(numels, part, rank)
        # parameter i occupies [sum(numels[:i]), ...); the first bucket holds the last ``first`` elements
        if any(sum(numels[: i + 1]) > psi - first for i in mine):
            out.append((rank, Term("grads_in_partition", sum(numels[i] for i in mine) * p,
                                   "runtime/zero/stage_1_and_2.py copy_grads_in_partition")))  # fmt: skip
    return tuple(out)


def backward_moments(run: DSRun) -> tuple[Moment, ...]:
    """Loss backward, the LM head's, the last block's (with the bucket from the first hook on), each earlier
    block's first op with what a rank still holds from the later blocks (ZeRO-1 reducing after backward: their
    ``param.grad``; ZeRO-2 and ZeRO-1 with ``overlap_comm``: ``_partition_allocations``,
    ``_stage1_kept_gradients``), and at ZeRO-1 the reduction after backward."""
    acts, blk, L, p, s = run.acts, run.acts.block, run.acts.n_layer, _pbytes(run), run.settings
    n_d, sched = acts.embed_out, _schedule(run)
    accumulating = run.grad_accum > 1 and s.stage in (1, 2)
    base = (*_states(run), *_held_between_micro_steps(run),
            _act("batch (token ids, targets)", acts.batch, 2),
            _act("embedding saved (position ids)", acts.embed_saved), _act("loss", acts.loss))  # fmt: skip
    saved_all = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved))
    out = [
        Moment("backward", "cross-entropy backward", (*base, *_gathered(run, sched, "forward end"), *saved_all,
               _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax),
               _act("nll and log-softmax gradients (fp32)", 2 * acts.log_softmax, 2))),
        Moment("backward", "LM head backward", (*base, *_gathered(run, sched, "LM head backward"), *saved_all,
               _act("logits gradient", acts.logits),
               _act("final norm output gradient", n_d),
               Term("head weight gradient", run.head_numel * p, "autograd (mm backward)"))),
    ]  # fmt: skip
    # ZeRO-1 keeps every gradient autograd makes until reduce_gradients; ZeRO-2/3 move each into the
    # bucket at its hook, and so does ZeRO-1 with overlap_comm (stage_1_and_2.py
    # reduce_ready_partitions_and_remove_grads: at the accumulation boundary, from the hooks
    # create_gradient_handling_hooks installs; reduce_gradients then skips its walk). BF16_Optimizer keeps
    # them too (update_hp_grads after backward). A tied head's gradient waits in autograd's input buffer.
    bf16_opt = optimizer_class(s) == "BF16_Optimizer"
    hooks_reduce = s.stage == 2 or (s.stage == 1 and s.overlaps and not bf16_opt)
    keeps = s.stage == 1 and not hooks_reduce and not accumulating  # accumulating: all of them are in base
    held = run.head_numel * (run.tied_head or keeps) + run.final_norm_numel * keeps
    kept_root = Term("root gradients held (head weight, final norm)", held * p,
                     "autograd InputBuffer (tied weight); torch autograd param.grad (ZeRO-1)")  # fmt: skip
    inflight = (_blocks_saved(run, L),)
    if run.checkpointing != "none":
        inflight += (_act("recomputed block's saved activations", blk.recomputed),)
    ws = max(blk.backward_first_op, blk.backward_act_grads + blk.first_weight_grads)
    last = (*base, *_gathered(run, sched, "last block backward"), *inflight, _act("incoming activation gradient", n_d), kept_root,
            _act("block backward working set", ws), *(() if accumulating and s.stage == 1 else _bucket(run)))  # fmt: skip
    if accumulating and s.stage == 2:
        # per rank: its own grads_in_partition, held from the first micro-step; a partition parameter's
        # param.grad is then a view of it (copy_grads_in_partition: grad_reduc.data = new_grad_tensor), so
        # autograd accumulates out of place (grad + new grad, a new tensor until its bucket is reduced): on the
        # ranks owning the first bucket's parameters, as big again as their grads_in_partition at the last
        # block (measured at G = 2: N_d = 2 and 4, -0.05% and -0.07%)
        held_name = "grads_in_partition (accumulated over micro-steps)"
        last = tuple(t for t in last if t.name != held_name)
        early = {r for r, _ in _stage2_early_partitions(run)}
        part = flat_padded_numel(run.numels, run.nd) // run.nd
        src = "runtime/zero/stage_1_and_2.py copy_grads_in_partition"
        for r in range(run.nd):
            gip = sum(run.numels[i] for i in _partition_params(run.numels, part, r)) * p
            out.append(Moment("backward", f"last block backward, rank {r} (accumulating)", (
                *last, Term(held_name, gip, f"{src} (kept until the step)"),
                *((Term("accumulated gradients of the partition's parameters (autograd, out of place)", gip,
                        f"torch autograd AccumulateGrad; {src}"),) if r in early else ()))))  # fmt: skip
    else:
        out.append(Moment("backward", "last block backward", last))
    if keeps and run.param_blocks:
        # ZeRO-1 reducing after backward: autograd's gradients pile up block by block, so block j's first op
        # also holds every later block's (under checkpointing its recomputed activations make it nearly as
        # large as the last block's: measured gpt-tiny, N_d = 4, every rank at block 0)
        for j in range(L - 1):
            later = sum(n for n, b in zip(run.numels, run.param_blocks) if b > j)
            out.append(Moment("backward", f"block {j} backward, the later blocks' gradients held", (
                *(t for t in last if t not in inflight), _blocks_saved(run, j + 1), *inflight[1:],
                Term("gradients of the later blocks (param.grad)", later * p,
                     "torch autograd AccumulateGrad; runtime/zero/stage_1_and_2.py process_gradients (stage 1 "
                     "without overlap_comm reduces in reduce_gradients, after backward)"))))  # fmt: skip
    if hooks_reduce and not accumulating:  # accumulating: every rank's grads_in_partition is in base
        out.extend(Moment("backward", f"last block backward, rank {r}'s grads_in_partition", (*last, gip))
                   for r, gip in _stage2_early_partitions(run))  # fmt: skip
        allocated = {r: (j, gip) for r, j, gip in _partition_allocations(run)}
        kept = _stage1_kept_gradients(run) if s.stage == 1 else {}
        for j in range(L):  # block j's first op, with blocks 0..j held: the rank holding the most there
            best: tuple[Term, ...] = ()
            for r in range(run.nd):
                held_r = (*((allocated[r][1],) if r in allocated and j <= allocated[r][0] else ()),
                          *((kept[r][j],) if r in kept and kept[r][j].bytes else ()))
                if sum(t.bytes for t in held_r) > sum(t.bytes for t in best):
                    best, who = held_r, r
            if best:
                out.append(Moment("backward", f"block {j} backward, rank {who}'s partition and kept gradients",
                                  (*(t for t in last if t not in inflight), _blocks_saved(run, j + 1), *inflight[1:],
                                   *best)))  # fmt: skip
    if s.stage == 1 and not bf16_opt and not hooks_reduce:
        out.extend(_stage1_reduce(run))
    if bf16_opt:
        out.extend(_bf16_after_backward(run))
    return tuple(out)


def _bf16_after_backward(run: DSRun) -> tuple[Moment, ...]:
    """BF16_Optimizer after backward: every 16-bit gradient (param.grad) is added into the fp32 buffer one
    tensor at a time through an fp32 copy, then the engine all-reduces the flat fp32 buffer converted to
    the communication dtype; the 16-bit gradients live on until zero_grad after the step."""
    numels, p, flat = run.numels, _pbytes(run), flat_padded_numel(run.numels, run.nd)
    base = (*_states(run), _act("batch (token ids, targets)", run.acts.batch, 2), _act("loss", run.acts.loss),
            Term("16-bit gradients (param.grad)", sum(numels) * p,
                 "torch autograd; runtime/bf16_optimizer.py update_hp_grads (clear_lp_grads=False)"))  # fmt: skip
    return (
        Moment("backward", "update_hp_grads", (*base, Term(
            "fp32 copy of the largest 16-bit gradient", max(numels) * 4,
            "runtime/bf16_optimizer.py _update_hp_grad (lp.grad.data.to(hp_grad.dtype))")),),  # fmt: skip
        Moment("backward", "all-reduce of the flat gradients", (*base, Term(
            "flat fp32 gradients in the communication dtype", flat * p,
            "runtime/engine.py buffered_allreduce_fallback -> allreduce_bucket (tensor.to(communication_data_type))")),),  # fmt: skip
    )


def optimizer_moments(run: DSRun) -> tuple[Moment, ...]:
    """The inner Adam on the fp32 partition: its fp32 gradient (stage_1_and_2.py ``step``:
    ``single_partition_of_fp32_groups.grad``; stage3.py ``_prepare_fp32_grad_for_sub_group``) and the
    temporaries of torch's Adam (``_single_tensor_adam``: ``v.sqrt()`` and its quotient; foreach: one),
    none for FusedAdam (a fused kernel)."""
    s = run.settings
    part = _partition(s, run.numels, run.nd)
    inner = inner_optimizer_class(s)
    temps = 0 if inner == "FusedAdam" else (1 if run.foreach else 2)
    out = []
    if optimizer_class(s) == "DeepSpeedZeroOptimizer":
        # step() flattens the partition's gradients (views of grads_in_partition, still alive) in the
        # gradient dtype, then converts the flat copy to fp32 (a no-op in fp32)
        p, numels = _pbytes(run), run.numels
        flat_part = flat_padded_numel(numels, run.nd) // run.nd
        gip = max(sum(numels[i] for i in _partition_params(numels, flat_part, r)) for r in range(run.nd))
        src = "runtime/zero/stage_1_and_2.py step -> get_flat_partition (_flatten_dense_tensors), .to(fp32)"
        out.append(Moment("optimizer_step", "flatten the partition's gradients", (*_states(run),
                   Term("grads_in_partition", gip * p, "runtime/zero/stage_1_and_2.py copy_grads_in_partition"),
                   Term("flat partition gradient (gradient dtype)", part * DTYPE_BYTES[s.grad_dtype] * (s.grad_dtype != "fp32"), src),
                   Term("fp32 gradient of the master partition", part * 4, src))))  # fmt: skip
    elif s.grad_dtype != "fp32":  # ZeRO-3: a copy of the 16-bit gradient partition, then its fp32 conversion
        src = "runtime/zero/stage3.py _prepare_fp32_grad_for_sub_group (gradient partition copied, then .to(fp32))"
        out.append(Moment("optimizer_step", "prepare the fp32 gradient", (*_states(run),
                   Term("gradient partition copy (gradient dtype)", part * DTYPE_BYTES[s.grad_dtype], src),
                   Term("fp32 gradient of the master partition", part * 4, src))))  # fmt: skip
    if optimizer_class(s) == "BF16_Optimizer":
        # the inner Adam's gradient is a view of the fp32 gradient buffer (step: param_partition.grad =
        # grad_partition, fp32 already); the 16-bit param.grad live until zero_grad after the step
        bsrc = "runtime/bf16_optimizer.py BF16_Optimizer.step"
        return (Moment("optimizer_step", f"{inner} update", (*_states(run),
                Term("16-bit gradients (param.grad)", sum(run.numels) * _pbytes(run),
                     f"{bsrc}; freed by zero_grad(set_to_none=True) after the step"),
                Term(f"{inner} temporaries", temps * part * 4, "torch/optim/adam.py _single_tensor_adam / _multi_tensor_adam",
                     max(temps, 1)))),)  # fmt: skip
    return (
        *out,
        Moment("optimizer_step", f"{inner} update", (*_states(run),
               Term("fp32 gradient of the master partition", part * 4,
                    "runtime/zero/stage_1_and_2.py step / runtime/zero/stage3.py _prepare_fp32_grad_for_sub_group"),
               Term(f"{inner} temporaries", temps * part * 4, "torch/optim/adam.py _single_tensor_adam / _multi_tensor_adam",
                    max(temps, 1)))),
    )  # fmt: skip


def moments(run: DSRun) -> tuple[Moment, ...]:
    """Every moment of a DeepSpeed training step."""
    return (*init_moments(run), *forward_moments(run), *backward_moments(run), *optimizer_moments(run))


def ds_run(settings: Settings, workload: Workload, nd: int, stat_bytes: Optional[int] = None) -> DSRun:
    """The run of ``workload`` under ``settings``; activations in the model dtype, LayerNorm statistics in
    ``stat_bytes`` (None: 4, as CUDA keeps them; on CPU they take the input dtype)."""
    spec = workload.spec
    if spec is None:
        raise ValueError("the DeepSpeed peak needs an architecture (a model), not bare tensor sizes")
    from zeroplan.architectures.spec import block_prefix

    a = DTYPE_BYTES[settings.dtype]
    acts = model_activations(spec, workload.micro_batch, workload.seq_len, act_bytes=a,
                             stat_bytes=4 if stat_bytes is None else stat_bytes)  # fmt: skip
    numels = tuple(math.prod(shape) for _, shape in workload.shapes)
    prefix = block_prefix(spec)
    # the final norm: the root's norm parameters (GPT-2 ln_f, Llama model.norm)
    final = sum(math.prod(sh) for n, sh in workload.shapes
                if not n.startswith(prefix) and (".ln_f." in n or n.startswith("model.norm.")))  # fmt: skip
    foreach = settings.foreach if settings.foreach is not None else workload.foreach
    owners: dict[str, list[int]] = {}  # insertion order: the order the modules were built
    for name, shape in workload.shapes:
        owners.setdefault(name.rpartition(".")[0], []).append(math.prod(shape))
    blocks = tuple(int(n[len(prefix):].split(".")[0]) if n.startswith(prefix) else -1 for n, _ in workload.shapes)
    output = f".mlp.{_MLP_PROJECTIONS[spec.style][1]}."
    return DSRun(settings, numels, nd, acts, spec.vocab_size * spec.d_model, final,
                 spec.style == "gpt" and spec.tie_word_embeddings, workload.checkpointing, bool(foreach),
                 workload.grad_accum, tuple(tuple(v) for v in owners.values()), *_trace(workload), blocks,
                 tuple(i for i, (n, _) in enumerate(workload.shapes) if blocks[i] >= 0 and output in n))  # fmt: skip


def _trace(workload: Workload) -> tuple[Optional[Stage3Trace]]:
    """(ZeRO-3's module trace of ``workload``,) for ``collectives``: ``stage3_trace`` of its parameter names,
    the validator's causal LM where there is an architecture, the transformers one with ``Workload.transformers``."""
    spec = workload.spec
    style = spec.style if spec is not None else None
    hf = workload.transformers and spec is not None
    # transformers' lm_head is the embedding's weight whenever tied (any style); CausalLM's rule is unchanged
    tied = spec is not None and (spec.style == "gpt" or hf) and spec.tie_word_embeddings
    return (stage3_trace(workload.shapes, style, tied, hf),)


def _collective(c: DSCollective, nd: int) -> Collective:
    phase = "optimizer step" if c.phase == "optimizer_step" else c.phase
    nbytes = DTYPE_BYTES.get(c.dtype, 1)
    return Collective(c.op, phase, c.elements, c.dtype, ring_bytes_per_rank(c.op, c.elements, nd, nbytes))


def estimate(workload: Workload, nd: int, settings: Settings, stat_bytes: Optional[int] = None) -> tuple[EngineEstimate, ...]:
    """DeepSpeed under ``settings`` on N_d = ``nd`` ranks: model states, peak per phase, one step's collectives."""
    numels = tuple(math.prod(shape) for _, shape in workload.shapes)
    peak: Optional[PeakEstimate] = None
    if workload.spec is not None:
        peak = peak_of(moments(ds_run(settings, workload, nd, stat_bytes)))
    return (EngineEstimate(
        engine="deepspeed",
        label=f"ZeRO-{settings.stage} {optimizer_class(settings)} + {inner_optimizer_class(settings)}",
        stage=settings.stage,
        memory=memory_breakdown(settings, numels, nd),
        peak=peak,
        collectives=tuple(_collective(c, nd) for c in collectives(settings, numels, nd, workload.grad_accum,
                                                                  *_trace(workload))),
    ),)  # fmt: skip


# --- planning: the configuration to run, chosen by predicted peak, emitted exactly --------------------------

BUCKET_CHOICES: tuple[int, ...] = (500_000_000, 200_000_000, 50_000_000, 5_000_000)
"""Bucket sizes ``recommend`` tries (elements): DeepSpeed's default, then smaller ones as its docs suggest
for memory-bound runs (``reduce_bucket_size`` / ``allgather_bucket_size``)."""


def to_ds_config(s: Settings, micro_batch: int = 1, grad_accum: int = 1) -> dict:
    """The ds_config.json that ``Settings.from_ds_config`` reads back as ``s``: every key the profile
    reads is written, so the run is the configuration that was predicted."""
    zero: dict = {"stage": s.stage, "reduce_bucket_size": s.reduce_bucket_size,
                  "allgather_bucket_size": s.allgather_bucket_size, "contiguous_gradients": s.contiguous_gradients,
                  "reduce_scatter": s.reduce_scatter, "use_multi_rank_bucket_allreduce": s.use_multi_rank_bucket_allreduce}
    if s.overlap_comm is not None:  # absent: DeepSpeed resolves it by stage (config.py overlap_comm_valid)
        zero["overlap_comm"] = s.overlap_comm  # fmt: skip
    if s.stage == 3:
        zero.update(stage3_prefetch_bucket_size=s.prefetch_bucket_size,
                    stage3_param_persistence_threshold=s.param_persistence_threshold,
                    stage3_max_live_parameters=s.max_live_parameters,
                    stage3_max_reuse_distance=s.max_reuse_distance)  # fmt: skip
    params: dict = {"torch_adam": s.torch_adam, "adam_w_mode": s.adam_w_mode}
    if s.foreach is not None:
        params["foreach"] = s.foreach
    config: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "AdamW" if s.optimizer == "adamw" else "Adam", "params": params},
        "zero_optimization": zero,
    }
    if s.dtype != "fp32":
        config[s.dtype] = {"enabled": True}
    if s.grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": s.grad_accum_dtype}
    return config


def build_snippet(s: Settings, config_path: str = "ds_config.json") -> Optional[str]:
    """How to build the model for ``s`` as the profile predicted it: under ``deepspeed.zero.Init`` with the
    run's ds_config (``Settings.zero_init``; as ``validate/engines/deepspeed.py`` ``build_model`` does), or
    None where the model is built as usual (whole, then partitioned by ``deepspeed.initialize``)."""
    if not s.builds_partitioned:
        return None
    return (
        "import deepspeed\n\n"
        "# ZeRO-3 as predicted: each module is partitioned as it is built (partition_parameters.py Init), so no\n"
        "# rank holds the whole model; initialise weights through model.apply (each module gathered for it).\n"
        "# Hugging Face: HfDeepSpeedConfig(ds_config) before from_pretrained does the same.\n"
        f"with deepspeed.zero.Init(config_dict_or_path={config_path!r}):\n"
        "    model = build_model()  # your model's constructor\n"
        "engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),\n"
        f"                                               config={config_path!r})\n"
    )


@dataclass(frozen=True)
class Recommendation:
    """The configuration ``recommend`` chose, its prediction, and what it tried."""

    settings: Settings
    estimate: EngineEstimate
    ds_config: dict
    tried: tuple[tuple[int, int, int], ...]
    """(stage, bucket elements, predicted peak bytes) of every candidate, in the order tried."""


def candidates(base: Settings) -> tuple[tuple[str, Settings], ...]:
    """What ``recommend`` tries, in its order: ZeRO-1, 2, 3 with each of ``BUCKET_CHOICES``, then ZeRO-3
    without prefetch (``stage3_prefetch_bucket_size`` 0: a module's parameters are released after use unless
    reused within ``stage3_max_reuse_distance``, ``stage3_schedule``; more all-gathers, no overlap)."""
    out = []
    for stage, prefetch in ((1, None), (2, None), (3, None), (3, 0)):
        for bucket in BUCKET_CHOICES:
            update = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
            if prefetch is not None:
                update["prefetch_bucket_size"] = prefetch
            label = f"ZeRO-{stage}, buckets {bucket:.0e}".replace("e+0", "e") + (", no prefetch" if prefetch == 0 else "")
            out.append((label, base.model_copy(update=update)))
    return tuple(out)


def recommend(workload: Workload, nd: int, memory_bytes: int, base: Settings,
              stat_bytes: Optional[int] = None) -> Optional[Recommendation]:
    """The first of ``candidates`` (lowest ZeRO stage: least traffic; then the largest bucket: fewest calls;
    ZeRO-3 without prefetch last) whose predicted peak fits ``memory_bytes``; None when none does. Other
    keys come from ``base``."""
    tried = []
    for _, s in candidates(base):
        (est,) = estimate(workload, nd, s, stat_bytes)
        peak = est.peak.peak_bytes if est.peak is not None else est.model_states_bytes
        tried.append((s.stage, s.reduce_bucket_size, peak))
        if peak <= memory_bytes:
            return Recommendation(s, est, to_ds_config(s, workload.micro_batch, workload.grad_accum), tuple(tried))
    return None


# --- the planner's side (estimate, plan, sweep): options -> Settings, the byte convention, the plan ----------

PLANNER_OPTIONS: tuple[str, ...] = ("ds_config", "stage")
"""The ``PlannerOptions`` fields in DeepSpeed's vocabulary: a ``ds_config.json`` and ``--stage``."""
PLAN_ORDER = ("the lowest ZeRO stage (least traffic), then the largest bucket (fewest calls), ZeRO-3 without "
              "prefetch last (parameters released after use, re-gathered in backward)")


def planner_settings(options: PlannerOptions) -> Settings:
    """DeepSpeed's ``Settings`` from ``--deepspeed-config`` (absent keys: DeepSpeed 0.19.8's defaults) and
    ``--stage`` (fills in a config without a stage; a contradiction is refused)."""
    config = dict(options.ds_config) if options.ds_config is not None else {}
    zero = config.get("zero_optimization")
    if options.stage is None and not (isinstance(zero, dict) and "stage" in zero):
        raise ValueError("--engine deepspeed needs the ZeRO stage: give --stage or zero_optimization.stage in "
                         "--deepspeed-config")  # fmt: skip
    return Settings.from_ds_config(config, options.stage)


def planner_policy(settings: Settings) -> PrecisionPolicy:
    """The byte convention of DeepSpeed's model states: 16-bit (or fp32) parameters, gradients in
    ``grad_accum_dtype``, an fp32 master partition (a clone even in fp32) and fp32 Adam m and v."""
    return PrecisionPolicy(param_dtype=settings.dtype, grad_dtype=settings.grad_dtype, master_weights=True,
                           optimizer=settings.optimizer, optimizer_dtype="fp32")  # fmt: skip


def planner_plan(workload: Workload, nd: int, capacity_bytes: int, options: PlannerOptions) -> EnginePlan:
    """``zeroplan plan --engine deepspeed``: every (stage, bucket) ``recommend`` may try, in its order, each
    with the ds_config of exactly that prediction; the recommendation is ``recommend``'s. The other keys
    come from ``--deepspeed-config`` (the plan chooses the stage: the file's is one of the candidates)."""
    config = dict(options.ds_config) if options.ds_config is not None else {}
    zero = dict(config.get("zero_optimization") or {})
    zero.pop("stage", None)
    base = Settings.from_ds_config({**config, "zero_optimization": zero}, 1)
    chosen = recommend(workload, nd, capacity_bytes, base)
    out, index = [], None
    for label, s in candidates(base):
        (est,) = estimate(workload, nd, s)
        need = est.peak.peak_bytes if est.peak is not None else est.model_states_bytes
        if chosen is not None and s == chosen.settings:
            index = len(out)
        out.append(Candidate(label, est, need <= capacity_bytes, to_ds_config(s, workload.micro_batch, workload.grad_accum),
                             s.reduce_bucket_size, build_snippet(s)))  # fmt: skip
    return EnginePlan(tuple(out), index, "deepspeed", PLAN_ORDER, base)


def planner_block_bytes(settings: Settings) -> int:
    """The allocator block the peak is rounded to: none (``estimate`` sums the terms as allocated)."""
    return 1
