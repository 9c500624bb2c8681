"""DeepSpeed: reading a ``ds_config.json`` into planner settings, and writing one for a planned option.

Reading: the keys of a ``ds_config.json`` (https://www.deepspeed.ai/docs/config-json/) that decide
model-state memory: ``zero_optimization.stage``, ``fp16.enabled`` / ``bf16.enabled`` (fp32 when
neither), ``optimizer.type`` (and ``params.momentum`` for SGD), ``data_types.grad_accum_dtype`` and
``communication_data_type`` (the dtype gradients are kept and reduced in). Batch sizes, buckets and
schedulers do not change model states and are ignored. Offload is refused here with a pointer to
``zeroplan plan``, which models it; silently ignoring it would overstate GPU memory.

Writing: keys exactly as the DeepSpeed configuration docs spell them (``zero_optimization``,
``offload_optimizer``, ``offload_param``, ``stage3_*``). Bucket sizes are DeepSpeed's defaults (5e8
elements; ``stage3_prefetch_bucket_size`` 5e7), written out so the plan's latency estimate and the run
use the same buckets. No dependency on DeepSpeed: these functions read and build dicts.
"""

from __future__ import annotations

from pathlib import Path

from zeroplan.files import read_json
from zeroplan.formulas.offload import NO_OFFLOAD, Offload, check_offload
from zeroplan.formulas.stages import get_stage
from zeroplan.policy import BF16_MIXED, PrecisionPolicy

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


def _section(config: dict, key: str) -> dict:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"deepspeed config: {key!r} must be an object")
    return value


def _enabled(config: dict, key: str) -> bool:
    value = _section(config, key).get("enabled", False)
    if value == "auto":
        raise ValueError(f"deepspeed config: {key}.enabled is 'auto' (HF Trainer fills it in); give true or false")
    return bool(value)


def _ds_dtype(value: object, key: str) -> str:
    if str(value).lower() not in _DS_DTYPES:
        raise ValueError(f"deepspeed config: {key}={value!r}: expected one of fp32, fp16, bf16")
    return _DS_DTYPES[str(value).lower()]


def from_deepspeed(config: object) -> dict:
    """Planner settings (``stage`` and ``PrecisionPolicy`` fields) from a parsed DeepSpeed config."""
    if not isinstance(config, dict):
        raise ValueError("deepspeed config: expected a JSON object")
    zero = _section(config, "zero_optimization")
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        device = section.get("device", "none") if isinstance(section, dict) else section
        if device not in ("none", None):
            raise ValueError(
                f"deepspeed config: zero_optimization.{key}.device={device!r}: `zeroplan estimate` models "
                "GPU-resident states; use `zeroplan plan --offload cpu|nvme` for offload"
            )
    stage = get_stage(zero.get("stage", 0), "deepspeed config: zero_optimization.stage").number

    fp16, bf16 = _enabled(config, "fp16"), _enabled(config, "bf16") or _enabled(config, "bfloat16")
    if fp16 and bf16:
        raise ValueError("deepspeed config: fp16.enabled and bf16.enabled are both true")
    param_dtype = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    settings: dict = {"stage": stage, "param_dtype": param_dtype}

    grad_dtype = _section(config, "data_types").get("grad_accum_dtype") or config.get("communication_data_type")
    if grad_dtype is not None:
        settings["grad_dtype"] = _ds_dtype(grad_dtype, "grad_accum_dtype/communication_data_type")

    optimizer = _section(config, "optimizer")
    if optimizer:
        kind = str(optimizer.get("type", "")).lower()
        if kind not in DEEPSPEED_OPTIMIZERS:
            known = ", ".join(sorted(DEEPSPEED_OPTIMIZERS))
            raise ValueError(f"deepspeed config: optimizer.type={optimizer.get('type')!r}: expected one of {known}")
        name = DEEPSPEED_OPTIMIZERS[kind]
        if name == "sgd" and (optimizer.get("params") or {}).get("momentum", 0):
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


def _offload_block(device: str) -> dict:
    block: dict = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = NVME_PATH
    return block


def deepspeed_config(
    stage: int,
    offload: Offload = NO_OFFLOAD,
    micro_batch: int = 1,
    grad_accum: int = 1,
    policy: PrecisionPolicy = BF16_MIXED,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
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
