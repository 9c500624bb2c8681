"""Engine configurations in the engines' own vocabulary, turned into planner settings.

DeepSpeed: the keys of a ``ds_config.json`` (https://www.deepspeed.ai/docs/config-json/) that decide
model-state memory: ``zero_optimization.stage``, ``fp16.enabled`` / ``bf16.enabled`` (fp32 when
neither), ``optimizer.type`` (and ``params.momentum`` for SGD), ``data_types.grad_accum_dtype`` and
``communication_data_type`` (the dtype gradients are kept and reduced in). Batch sizes, buckets and
schedulers do not change model states and are ignored. Offload is refused here with a pointer to
``zeroplan plan``, which models it; silently ignoring it would overstate GPU memory.
"""

from __future__ import annotations

from pathlib import Path

from zeroplan.jsonfile import read_json

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
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"deepspeed config: zero_optimization.stage={stage!r}: must be 0, 1, 2 or 3")

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
