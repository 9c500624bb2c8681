"""The ``ds_config.json`` schema, DeepSpeed **0.19.8**'s: ONE reader and ONE home for the writers.

Reading (``parse_ds_config``; ``from_deepspeed``/``load_deepspeed``/``merge_deepspeed`` for ``zeroplan
estimate``): the keys that decide model-state memory (``zero_optimization.stage``, ``fp16``/``bf16``,
``optimizer``, ``data_types.grad_accum_dtype``, ``communication_data_type``), strictly typed, with
DeepSpeed's defaults; offload is refused with a pointer to ``zeroplan plan``. The engine profile reads the
same parsed sections (``Settings.from_ds_config``).

Writing: ``to_ds_config`` (the profile's, beside ``Settings`` in ``settings.py``, which reads this schema:
every key ``Settings.from_ds_config`` reads, so the run is the configuration predicted) and ``deepspeed_config`` (the paper planner's launcher: stage, offload, precision,
buckets). Both spell the batch and precision keys through the same two helpers (``_batch_keys``,
``_precision_keys``), keys exactly as the DeepSpeed configuration docs spell them. No dependency on
DeepSpeed: these functions read and build dicts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

from pydantic import (BaseModel, BeforeValidator, ConfigDict, ValidationError, ValidationInfo, model_validator,
                      validate_call)

from zeroplan.files import read_json
from zeroplan.formulas.collectives import DEFAULT_BUCKET_NUMEL  # its home: DeepSpeed's default, 5e8
from zeroplan.formulas.offload import NO_OFFLOAD, Offload, check_offload
from zeroplan.formulas.stages import get_stage
from zeroplan.policy import BF16_MIXED, PrecisionPolicy
from zeroplan.types import MAX_BATCH, MAX_GPUS, BatchCount, Numel, StageNumber

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


def _fraction(v: object, info: ValidationInfo) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
        raise ValueError("must be a number from 0 to 1")
    return float(v)


Fraction = Annotated[float, BeforeValidator(_fraction)]


class _OffloadSection(_Section):
    """``zero_optimization.offload_optimizer`` / ``offload_param``: DeepSpeed 0.19.8's keys and defaults
    (runtime/zero/offload_config.py ``DeepSpeedZeroOffloadOptimizerConfig``, ``DeepSpeedZeroOffloadParamConfig``;
    ``buffer_count`` 4 for the optimizer, 5 for parameters: None here, the engine profile fills it in)."""

    device: Optional[Text] = "none"
    nvme_path: Optional[Text] = None
    pin_memory: Flag = True
    buffer_count: Optional[Elements] = None
    buffer_size: Elements = 100_000_000
    """parameters on NVMe: elements per swap buffer (``pp_int(1e8)``)."""
    max_in_cpu: Elements = 1_000_000_000
    ratio: Fraction = 1.0
    """optimizer: the fraction of the optimizer states on the host (ZeRO-3's partial offload)."""
    super_offload: Flag = False


DEPRECATED_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
"""DeepSpeed 0.19.8's deprecated offload flags and the sections they become (runtime/zero/config.py ``new_param_fn``:
true is ``{"device": "cpu"}``; config_utils.py ``_process_deprecated_field`` refuses both given together)."""
_REMOVED = "was removed from DeepSpeed 0.19.8, which refuses the key (runtime/config.py _REMOVED_ZERO_CONFIG_KEYS)"
REMOVED_ZERO_KEYS = {"mics_shard_size": f"MiCS {_REMOVED}; there is no runtime/zero/mics.py",
                     "mics_hierarchical_params_gather": f"MiCS {_REMOVED}", "zeropp_loco_param": f"LoCo-ZeRO++ {_REMOVED}"}
"""``zero_optimization`` keys DeepSpeed 0.19.8 refuses (``runtime/config.py _reject_removed_config_keys``), each with
the reason: a run with them never starts, so no prediction is made for it."""


class _Zero(_Section):
    stage: object = 0
    """checked by the stage table (``get_stage``), whose message names the key."""

    @model_validator(mode="before")
    @classmethod
    def _deprecated_offload(cls, data: object) -> object:
        """``cpu_offload`` / ``cpu_offload_param`` read as DeepSpeed reads them (``DEPRECATED_OFFLOAD``)."""
        if not isinstance(data, dict) or not any(k in data for k in DEPRECATED_OFFLOAD):
            return data
        data = dict(data)
        for old, new in DEPRECATED_OFFLOAD.items():
            if old not in data or data[old] is None:
                continue
            if not isinstance(data[old], bool):
                raise ValueError(f"{old}={data[old]!r}: must be true or false")
            if new in data:
                raise ValueError(f"{old} (deprecated) and {new} together: DeepSpeed 0.19.8 refuses both "
                                 "(config_utils.py _process_deprecated_field)")  # fmt: skip
            if data[old]:
                data[new] = {"device": "cpu"}
        return data
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
    # ZeRO++ (runtime/zero/config.py defaults 1, false, false); read and checked by the profile (zeropp.py)
    zero_hpz_partition_size: Optional[Elements] = None
    zero_quantized_weights: Optional[Flag] = None
    zero_quantized_gradients: Optional[Flag] = None

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: object) -> object:
        """MiCS and LoCo are gone from DeepSpeed 0.19.8, which refuses their keys (``REMOVED_ZERO_KEYS``)."""
        if isinstance(data, dict):
            for k, why in REMOVED_ZERO_KEYS.items():
                if k in data:
                    raise ValueError(f"{k}: {why}")
        return data


class _DataTypes(_Section):
    grad_accum_dtype: Optional[Text] = None


class _OptimizerParams(_Section):
    momentum: Number = 0
    """SGD momentum; 0 (DeepSpeed's and torch's default) keeps no momentum buffer."""
    torch_adam: Optional[Flag] = None
    adam_w_mode: Optional[Flag] = None
    foreach: Optional[Flag] = None
    amsgrad: Optional[Flag] = None
    """torch's ``Adam(amsgrad=...)``: with ``torch_adam`` DeepSpeed hands the params on to torch's Adam."""
    weight_decay: Optional[Number] = None  # Adam's; absent: torch's default 0 (engine.py passes the params on)


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
    naming the key) for anything else than a JSON object of the documented types.

    The file is read once at the edge (the CLI, ``zeroplan.cli_options.read_settings_file``) and its dict
    handed down; the batch rule, ``Settings`` and the policy reader each ask for it, so a validated config
    is kept per content (``repr``: a tuple is not a list, 1 is not True) and validated once per process."""
    if not isinstance(config, dict):
        raise ValueError("deepspeed config: expected a JSON object")
    key = repr(config)
    if key in _PARSED:
        return _PARSED[key]
    try:
        parsed = DeepSpeedConfig.model_validate(config)
    except ValidationError as exc:
        raise _ds_error(exc) from None
    if len(_PARSED) >= 64:  # a sweep of many files: keep the newest
        _PARSED.pop(next(iter(_PARSED)))
    _PARSED[key] = parsed  # frozen sections: safe to share
    return parsed


_PARSED: dict[str, "DeepSpeedConfig"] = {}
"""``parse_ds_config``'s validated configs by ``repr`` of the dict (at most 64)."""


def from_deepspeed(config: object, offload: bool = False) -> dict:
    """Planner settings (``stage`` and ``PrecisionPolicy`` fields) from a parsed DeepSpeed config.
    ``offload``: whether the caller reads the offload sections (the DeepSpeed engine profile,
    ``Settings.from_ds_config``); the paper planner refuses them with a pointer to the commands that plan offload."""
    ds = parse_ds_config(config)
    zero = ds.zero_optimization
    for key in () if offload else ("offload_optimizer", "offload_param"):
        section = getattr(zero, key)
        device = section.device if section is not None else None
        if device not in ("none", None):
            raise ValueError(
                f"deepspeed config: zero_optimization.{key}.device={device!r}: the paper's model states are "
                "GPU-resident here; for DeepSpeed's offload use --engine deepspeed (with --model), or `zeroplan plan "
                "--engine reference --offload cpu|nvme` (without --deepspeed-config)"
            )
    stage = get_stage(zero.stage, "deepspeed config: zero_optimization.stage").number

    # DeepSpeed 0.19.8 runtime/precision_config.py get_bfloat16_config: the "bf16" section whenever the key is
    # there and not null (enabled or not); the older "bfloat16" only without it
    fp16 = ds.fp16.enabled
    bf16 = ds.bf16.enabled if config.get("bf16") is not None else ds.bfloat16.enabled
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
    return merge_ds_config(read_json(path, "deepspeed config"), given)


def merge_ds_config(config: object, given: dict) -> dict:
    """``merge_deepspeed`` of a parsed ds_config (the CLI reads the file once, at the edge)."""
    from_file = from_deepspeed(config)
    clash = sorted(k for k in from_file if k in given and given[k] != from_file[k])
    if clash:
        raise ValueError(f"--{clash[0].replace('_', '-')} contradicts the DeepSpeed config; drop one of them")
    return given | from_file


def _offload_block(device: str) -> dict:
    return {"device": device, "pin_memory": True, **({"nvme_path": NVME_PATH} if device == "nvme" else {})}


def _batch_keys(micro_batch: int, grad_accum: int) -> dict:
    """The batch as DeepSpeed's config docs spell it (``train_batch_size`` left to DeepSpeed to derive)."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum}


def _precision_keys(dtype: str) -> dict:
    """``{"bf16": {"enabled": true}}`` or fp16's; nothing for fp32 (DeepSpeed's default)."""
    return {dtype: {"enabled": True}} if dtype in ("bf16", "fp16") else {}


@validate_call(config=ConfigDict(arbitrary_types_allowed=True))
def deepspeed_config(
    stage: StageNumber,
    offload: Offload = NO_OFFLOAD,
    micro_batch: BatchCount = 1,
    grad_accum: BatchCount = 1,
    policy: PrecisionPolicy = BF16_MIXED,
    bucket_numel: Numel = DEFAULT_BUCKET_NUMEL,
) -> dict:
    """A DeepSpeed config dict for ``stage`` and ``offload`` (dump it with ``json.dumps``): the paper
    planner's launcher (``zeroplan.planning.plan``), stages 0-3 and offload, DeepSpeed's recommended keys."""
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
    return {**_batch_keys(micro_batch, grad_accum), **_precision_keys(policy.param_dtype), "zero_optimization": zero}
