"""``accelerate launch --config_file FILE``: the YAML ``accelerate config`` writes, as the run sees it.

Read from accelerate **1.15.0** (paths relative to the installed ``accelerate/``): the file is parsed as
``commands/config/config_args.py`` ``load_config_from_file`` parses it (``yaml.safe_load``; unknown top-level
keys refused), ``commands/launch.py`` ``_validate_launch_command`` copies ``fsdp_config`` /
``deepspeed_config`` into launch arguments (their defaults: ``launch_command_parser``),
``utils/launch.py`` ``prepare_multi_gpu_env`` / ``prepare_deepspeed_cmd_env`` turn them into ``FSDP_*`` /
``ACCELERATE_*`` variables, and ``utils/dataclasses.py`` ``FullyShardedDataParallelPlugin`` /
``DeepSpeedPlugin`` read those (their defaults where unset). Each default below is the launcher's where
it has one (``cpu_ram_efficient_loading``: true), else the plugin's.

- ``distributed_type: FSDP`` -> ``AccelerateFsdp``: FSDP2 settings (``fsdp_version: 2``; FSDP1 is refused)
  and the wrapping ``utils/fsdp_utils.py`` ``fsdp2_prepare_model`` applies (``fsdp2_wrapping``);
- ``distributed_type: DEEPSPEED`` -> ``AccelerateDeepSpeed``: the ds_config the DeepSpeed engine receives
  (from ``deepspeed_config_file``, or the dict ``DeepSpeedPlugin`` builds from ``deepspeed_config``'s fields),
  ``"auto"`` filled as far as accelerate fills it before ``prepare`` (``accelerate_deepspeed.py``).
Other distributed types (NO, MULTI_GPU, MEGATRON_LM, XLA, ...) are refused in one line.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from zeroplan.files import read_json, read_text
from zeroplan.integrations.accelerate_deepspeed import (_PREPARE, ACCELERATE_VERSION, MixedPrecision, PluginFields,
                                                        mixed_precision_fill, plugin_fill, prepare_fill)
from zeroplan.integrations.ds_auto import AutoFill, AutoResolution, Filled, auto_keys, finish

_TOP_KEYS = frozenset({  # config_args.py ClusterConfig + BaseConfig fields (unknown keys are refused there)
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes", "machine_rank",
    "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend", "same_network",
    "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config",
    "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone",
    "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env", "dynamo_config",
    "fp16", "dynamo_backend",  # older spellings process_config converts
})  # fmt: skip
_DS_FROM_FILE_IGNORED = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                         "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                         "zero3_save_16bit_model", "mixed_precision")  # DeepSpeedPlugin._deepspeed_config_checks
WrapPolicy = Literal["transformer_based_wrap", "size_based_wrap", "no_wrap"]


@dataclass(frozen=True)
class WrapUnit:
    """One ``fully_shard`` call of ``fsdp2_prepare_model``, in call order: which modules, and its
    ``reshard_after_forward`` (None: FSDP2's default, which leaves the root unsharded after forward)."""

    modules: str
    reshard_after_forward: Optional[bool]


@dataclass(frozen=True)
class AccelerateFsdp:
    """An accelerate FSDP2 run: module docstring. Dtypes are zeroplan's names (fp32, bf16, fp16)."""

    num_processes: int
    reshard_after_forward: bool
    mixed_precision: MixedPrecision
    param_dtype: Optional[str]
    """``MixedPrecisionPolicy.param_dtype`` (``set_mixed_precision``: the mixed precision's dtype); None: no policy."""
    reduce_dtype: Optional[str]
    """``reduce_dtype``: the same dtype as ``param_dtype`` under accelerate (not fp32)."""
    module_dtype: Optional[str]
    """fp32 under mixed precision (``fsdp2_prepare_model`` upcasts trainable parameters); None: as the script
    builds the model (``mixed_precision: no``)."""
    activation_checkpointing: bool
    activation_checkpointing_offload: bool
    init: Literal["meta", "cpu"]
    """meta: ``cpu_ram_efficient_loading`` (the model moved to meta, ``fully_shard``, rank 0's state dict
    broadcast into the shards, one parameter at a time: ``fsdp2_load_full_state_dict``); cpu: every rank
    loads the whole model on CPU and ``fully_shard`` moves each unit to the GPU as it shards it."""
    offload_params: bool
    auto_wrap_policy: WrapPolicy
    transformer_layer_cls_to_wrap: Optional[tuple[str, ...]]
    """None: the model's ``_no_split_modules`` (``fsdp2_prepare_auto_wrap_policy``)."""
    min_num_params: int
    wrapping: tuple[WrapUnit, ...]
    dp_replicate: int = 1
    """``parallelism_config_dp_replicate_size``: above 1, HSDP on the (replicate, shard) mesh."""
    tp: int = 1
    """``parallelism_config_tp_size``: above 1, the model's own transformers ``tp_plan`` on the mesh's innermost
    ``tp`` dimension (``ParallelismConfig._get_mesh``: dp_replicate, dp_shard, cp, sp, tp), which accelerate
    requires of the model (``Accelerator.prepare_model``: ``get_model_tp_size(model)`` equals ``tp_size``,
    ``from_pretrained(..., tp_plan="auto", device_mesh=...)``); ``fully_shard`` then shards over the rest."""


@dataclass(frozen=True)
class AccelerateDeepSpeed:
    """An accelerate DeepSpeed run: ``ds_config`` as ``DeepSpeedPlugin`` and ``set_mixed_precision`` leave it,
    ``filled`` (each key that was ``"auto"`` or was added), ``unresolved`` (keys ``Accelerator.prepare`` fills
    from the script: the dataloader's batch, the model's hidden size, the optimizer and scheduler)."""

    num_processes: int
    mixed_precision: MixedPrecision
    zero3_init: bool
    config_file: Optional[str]
    ds_config: dict
    filled: tuple[Filled, ...]
    unresolved: tuple[str, ...]


def _yaml(path: str | Path) -> dict:
    import yaml  # only here: the planner's other paths never need it

    text = read_text(path, "accelerate config")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"accelerate config {str(path)!r}: not valid YAML ({getattr(exc, 'problem', exc)}{where})") from None
    if not isinstance(data, dict):
        raise ValueError(f"accelerate config {str(path)!r}: expected a mapping of keys (as `accelerate config` writes)")
    unknown = sorted(str(k) for k in data if k not in _TOP_KEYS)
    if unknown:
        raise ValueError(f"accelerate config: unknown key {unknown[0]!r}: accelerate {ACCELERATE_VERSION} refuses it")
    return data


def _section(data: dict, key: str) -> dict:
    section = data.get(key) or {}
    if not isinstance(section, dict):
        raise ValueError(f"accelerate config: {key} must be a mapping")
    return section


def _bool(value: object, key: str) -> bool:
    """accelerate's ``str_to_bool`` of the string the launcher writes (``str(value).lower()``)."""
    text = str(value).lower()
    if text in ("y", "yes", "t", "true", "on", "1"):
        return True
    if text in ("n", "no", "f", "false", "off", "0"):
        return False
    raise ValueError(f"accelerate config: {key}={value!r}: expected true or false")


def _int(value: object, key: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"accelerate config: {key}={value!r}: expected a whole number >= {low}")
    return value


def _mixed_precision(data: dict) -> MixedPrecision:
    mp = str(data.get("mixed_precision") or "no").lower()  # _validate_launch_command: None -> "no"
    if mp not in ("no", "fp16", "bf16"):
        raise ValueError(f"accelerate config: mixed_precision={mp!r}: zeroplan models no, fp16 and bf16 (not fp8)")
    return mp  # type: ignore[return-value]


def _num_processes(data: dict) -> int:
    n = data.get("num_processes", -1)
    if n == -1:  # _validate_launch_command: "You need to manually pass in `--num_processes`"
        raise ValueError("accelerate config: no num_processes: accelerate launch needs it (give it in the file)")
    return _int(n, "num_processes")


def _fsdp_key(fsdp: dict, name: str, default: object) -> object:
    """``fsdp_config.<name>``; ``_validate_launch_command`` prefixes ``fsdp_`` to a key without it."""
    short = name.removeprefix("fsdp_")
    return fsdp.get(name, fsdp.get(short, default))


def fsdp2_wrapping(policy: WrapPolicy, classes: Optional[tuple[str, ...]], min_num_params: int,
                   reshard_after_forward: bool) -> tuple[WrapUnit, ...]:
    """The ``fully_shard`` calls of ``utils/fsdp_utils.py`` ``fsdp2_prepare_model``, in order."""
    units = []
    if policy == "transformer_based_wrap":
        which = ", ".join(classes) if classes else "the model's _no_split_modules classes"
        units.append(WrapUnit(f"each {which} module, bottom-up", reshard_after_forward))
    elif policy == "size_based_wrap" and min_num_params > 0:  # set_auto_wrap_policy: 0 means no policy
        units.append(WrapUnit(f"each module of more than {min_num_params} parameters, bottom-up", reshard_after_forward))
    units += [
        WrapUnit("the input embeddings (get_input_embeddings), unless tied to the output embeddings", reshard_after_forward),
        WrapUnit("[final norm, output embeddings] (with the input embeddings when tied)", False),
        WrapUnit("the root (every parameter not in a unit above)", None),
    ]
    return tuple(units)


def read_fsdp(data: dict) -> AccelerateFsdp:
    """``distributed_type: FSDP``: module docstring."""
    fsdp = _section(data, "fsdp_config")
    version = _fsdp_key(fsdp, "fsdp_version", 1)
    if str(version) != "2":
        raise ValueError(f"accelerate config: fsdp_version={version!r} (FSDP1, FullyShardedDataParallel): zeroplan "
                         "models FSDP2; set fsdp_version: 2 (`accelerate to-fsdp2` converts the file)")  # fmt: skip
    replicate, tp = _mesh_sizes(_section(data, "parallelism_config"), _num_processes(data))
    if _fsdp_key(fsdp, "fsdp_ignored_modules", None) is not None:
        raise ValueError("accelerate config: fsdp_ignored_modules: modules left out of FSDP are not modelled")
    ram = _fsdp_key(fsdp, "fsdp_cpu_ram_efficient_loading", "true")
    if ram and not _fsdp_key(fsdp, "fsdp_sync_module_states", "true"):  # prepare_multi_gpu_env
        raise ValueError("accelerate config: fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true "
                         "(accelerate launch refuses the pair)")  # fmt: skip
    policy = str(_fsdp_key(fsdp, "fsdp_auto_wrap_policy", "NO_WRAP")).lower()
    if policy not in ("transformer_based_wrap", "size_based_wrap", "no_wrap"):
        raise ValueError(f"accelerate config: fsdp_auto_wrap_policy={policy.upper()!r}: expected TRANSFORMER_BASED_WRAP, "
                         "SIZE_BASED_WRAP or NO_WRAP")  # fmt: skip
    classes = _fsdp_key(fsdp, "fsdp_transformer_layer_cls_to_wrap", None)
    classes = tuple(str(classes).split(",")) if classes is not None and policy == "transformer_based_wrap" else None
    min_num_params = _int(int(_fsdp_key(fsdp, "fsdp_min_num_params", 10**8)), "fsdp_min_num_params", 0)
    reshard = _bool(_fsdp_key(fsdp, "fsdp_reshard_after_forward", "true"), "fsdp_reshard_after_forward")
    ac = _bool(_fsdp_key(fsdp, "fsdp_activation_checkpointing", "false"), "fsdp_activation_checkpointing")
    ac_offload = _bool(_fsdp_key(fsdp, "fsdp_activation_checkpointing_offload", "false"), "fsdp_activation_checkpointing_offload")
    if ac_offload and not ac:
        raise ValueError("accelerate config: fsdp_activation_checkpointing_offload needs fsdp_activation_checkpointing")
    if ac and policy == "no_wrap":
        raise ValueError("accelerate config: fsdp_activation_checkpointing with NO_WRAP: accelerate checkpoints the "
                         "modules its auto-wrap policy selects, and there are none")  # fmt: skip
    mp = _mixed_precision(data)
    dtype = None if mp == "no" else mp
    return AccelerateFsdp(
        num_processes=_num_processes(data), reshard_after_forward=reshard, mixed_precision=mp, param_dtype=dtype,
        reduce_dtype=dtype, module_dtype="fp32" if dtype else None, activation_checkpointing=ac,
        activation_checkpointing_offload=ac_offload, init="meta" if _bool(ram, "fsdp_cpu_ram_efficient_loading") else "cpu",
        offload_params=_bool(_fsdp_key(fsdp, "fsdp_offload_params", "false"), "fsdp_offload_params"),
        auto_wrap_policy=policy,  # type: ignore[arg-type]
        transformer_layer_cls_to_wrap=classes, min_num_params=min_num_params,
        wrapping=fsdp2_wrapping(policy, classes, min_num_params, reshard),  # type: ignore[arg-type]
        dp_replicate=replicate, tp=tp,
    )  # fmt: skip


def _mesh_sizes(parallel: dict, processes: int) -> tuple[int, int]:
    """``parallelism_config``'s replicas R and TP size T (``ParallelismConfig``: absent sizes are 1). R > 1 with
    dp_shard S > 1 is HSDP: ``fsdp2_prepare_model`` shards on the mesh ``("dp_replicate", "dp_shard_cp")``
    (``fsdp_dim_names``), the FSDP2 engine's 2-D mesh; T > 1 is the model's own TP plan on the innermost ``tp``
    dimension (``AccelerateFsdp.tp``). Given, the section needs S > 1 and R x S x T = the processes, as
    accelerate's ``_validate_accelerator`` does for FSDP2 (``total_size``). Context and sequence parallelism are
    refused."""
    sizes = {k.removeprefix("parallelism_config_"): v for k, v in parallel.items() if k.endswith("_size")}
    for key in ("cp_size", "sp_size"):
        if sizes.get(key) not in (None, 1):
            raise ValueError(f"accelerate config: parallelism_config_{key}={sizes[key]}: zeroplan models data "
                             "and tensor parallelism (FSDP, HSDP, tp_size) only")  # fmt: skip
    replicate = _int(sizes.get("dp_replicate_size") or 1, "parallelism_config_dp_replicate_size")
    shard = _int(sizes.get("dp_shard_size") or 1, "parallelism_config_dp_shard_size")
    tp = _int(sizes.get("tp_size") or 1, "parallelism_config_tp_size")
    if parallel and (shard == 1 or replicate * shard * tp != processes):  # ParallelismConfig._validate_accelerator
        raise ValueError(f"accelerate config: parallelism_config dp_replicate_size {replicate} x dp_shard_size "
                         f"{shard} x tp_size {tp}: accelerate's FSDP2 needs dp_shard_size > 1 and the product = "
                         f"num_processes ({processes})")  # fmt: skip
    return replicate, tp


def _plugin_fields(ds: dict) -> PluginFields:
    """``DeepSpeedPlugin.__post_init__``'s fields from the launcher's variables (``prepare_deepspeed_cmd_env``)."""
    fields: dict = {}
    if ds.get("zero_stage") is not None:
        fields["zero_stage"] = _int(int(str(ds["zero_stage"])), "deepspeed_config.zero_stage", 0)
    if ds.get("gradient_accumulation_steps") is not None:
        text = str(ds["gradient_accumulation_steps"])
        fields["gradient_accumulation_steps"] = int(text) if text.isdigit() else text
    if ds.get("gradient_clipping") is not None:
        text = str(ds["gradient_clipping"]).lower()
        fields["gradient_clipping"] = text if text == "auto" else float(text)
    for key in ("offload_optimizer_device", "offload_param_device"):
        if ds.get(key) is not None:
            fields[key] = str(ds[key]).lower()
            if fields[key] not in ("none", "cpu", "nvme"):
                raise ValueError(f"accelerate config: deepspeed_config.{key}={ds[key]!r}: expected none, cpu or nvme")
    for key in ("offload_optimizer_nvme_path", "offload_param_nvme_path"):
        if ds.get(key) is not None:
            fields[key] = str(ds[key])
    if ds.get("zero3_save_16bit_model") is not None:
        fields["zero3_save_16bit_model"] = _bool(ds["zero3_save_16bit_model"], "deepspeed_config.zero3_save_16bit_model")
    return PluginFields(**fields)


def _built_ds_config(p: PluginFields) -> dict:
    """The ds_config ``DeepSpeedPlugin.__post_init__`` builds when no file is given."""
    config: dict = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": p.gradient_accumulation_steps,
        "zero_optimization": {
            "stage": p.zero_stage,
            "offload_optimizer": {"device": p.offload_optimizer_device,
                                  "nvme_path": p.offload_optimizer_nvme_path if p.offload_optimizer_device == "nvme" else None},
            "offload_param": {"device": p.offload_param_device,
                              "nvme_path": p.offload_param_nvme_path if p.offload_param_device == "nvme" else None},
            "stage3_gather_16bit_weights_on_model_save": p.zero3_save_16bit_model,
        },
    }  # fmt: skip
    if p.gradient_clipping:
        config["gradient_clipping"] = p.gradient_clipping
    return config


def read_deepspeed(data: dict) -> AccelerateDeepSpeed:
    """``distributed_type: DEEPSPEED``: module docstring. A relative ``deepspeed_config_file`` is opened from the
    current directory, as accelerate opens it."""
    ds = _section(data, "deepspeed_config")
    mp = _mixed_precision(data)
    path = ds.get("deepspeed_config_file")
    if path is not None:
        clash = [k for k in _DS_FROM_FILE_IGNORED if k in ds or (k == "mixed_precision" and data.get(k) is not None)]
        if clash:
            raise ValueError(f"accelerate config: {clash[0]} with deepspeed_config_file: accelerate refuses it "
                             "(DeepSpeedPlugin._deepspeed_config_checks); set it in the ds_config")  # fmt: skip
        fill = AutoFill.of(read_json(path, "deepspeed config"))
        plugin_fill(fill, PluginFields())
    else:
        fields = _plugin_fields(ds)
        fill = AutoFill.of(_built_ds_config(fields))
    mixed_precision_fill(fill, mp)
    stage = fill.get("zero_optimization.stage", -1)
    init = ds.get("zero3_init_flag")
    zero3_init = (stage == 3) if init is None else _bool(init, "deepspeed_config.zero3_init_flag") and stage == 3
    return AccelerateDeepSpeed(
        num_processes=_num_processes(data), mixed_precision=mp, zero3_init=zero3_init,
        config_file=None if path is None else str(path), ds_config=fill.config, filled=tuple(fill.filled),
        unresolved=auto_keys(fill.config),
    )  # fmt: skip


def read_accelerate_config(path: str | Path) -> AccelerateFsdp | AccelerateDeepSpeed:
    """``accelerate launch --config_file path``: ``AccelerateFsdp`` or ``AccelerateDeepSpeed``; ValueError
    (one line) for what accelerate refuses and for what zeroplan does not model."""
    data = _yaml(path)
    kind = str(data.get("distributed_type", "")).upper()
    if str(data.get("compute_environment", "LOCAL_MACHINE")).upper() != "LOCAL_MACHINE":
        raise ValueError(f"accelerate config: compute_environment={data['compute_environment']!r}: zeroplan reads "
                         "LOCAL_MACHINE configs")  # fmt: skip
    if kind == "FSDP":
        return read_fsdp(data)
    if kind == "DEEPSPEED":
        return read_deepspeed(data)
    raise ValueError(f"accelerate config: distributed_type={kind or None!r}: zeroplan reads FSDP (version 2) and "
                     "DEEPSPEED configs")  # fmt: skip


def prepare_deepspeed(run: AccelerateDeepSpeed, micro_batch: int, grad_accum: int = 1,
                      hidden_size: Optional[int] = None) -> AutoResolution:
    """The ds_config ``Accelerator.prepare`` hands DeepSpeed (``accelerator.py`` ``_prepare_deepspeed``) for a
    script whose dataloader yields ``micro_batch`` sequences per rank, built with
    ``Accelerator(gradient_accumulation_steps=grad_accum)`` and, where the file names an optimizer or scheduler,
    ``DummyOptim``/``DummyScheduler`` with their defaults (lr 0.001, weight decay 0, no warmup: no memory effect).
    ValueError (one line) where accelerate refuses a key still ``"auto"`` ("not found in kwargs")."""
    fill = AutoFill(config=copy.deepcopy(run.ds_config), filled=list(run.filled))
    fill.fill("gradient_accumulation_steps", grad_accum, f"{_PREPARE} (Accelerator.gradient_accumulation_steps)")
    ga = fill.get("gradient_accumulation_steps")
    fill.fill("train_micro_batch_size_per_gpu", micro_batch, f"{_PREPARE} (the dataloader's batch_size)")
    fill.fill("train_batch_size", micro_batch * ga * run.num_processes, f"{_PREPARE} (batch x accumulation x processes)")
    prepare_fill(fill, hidden_size)
    if "optimizer" in fill.config:
        fill.fill("optimizer.params.lr", 0.001, f"{_PREPARE} (DummyOptim lr default)")
        fill.fill("optimizer.params.weight_decay", 0, f"{_PREPARE} (DummyOptim weight_decay default)")
    if "scheduler" in fill.config:
        fill.fill("scheduler.params.warmup_min_lr", 0, _PREPARE)
        fill.fill("scheduler.params.warmup_max_lr", fill.get("optimizer.params.lr", 0.001), _PREPARE)
        fill.fill("scheduler.params.warmup_num_steps", 1, f"{_PREPARE} (max(1, DummyScheduler warmup_num_steps=0))")
    return finish(fill, "accelerate's Accelerator.prepare refuses it (\"not found in kwargs\")")
