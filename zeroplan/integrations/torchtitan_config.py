"""``--torchtitan-config FILE``: torchtitan's TOML job config (``--job.config_file``), as the run sees it.

Read from torchtitan **0.2.2** (github:pytorch/torchtitan tag v0.2.2, commit 73a0e69), the last release with
TOML job configs: 0.3.0 (installed here) replaced them by Python config registries (PR #2386, "Config
System Refactor: TOML to Python Dataclass Registry"), keeping the ``training`` and ``parallelism`` fields read
here with the same names and defaults (``torchtitan/config/configs.py``; tests/test_integrations_torchtitan.py
checks them against the installed dataclasses). Sources, in v0.2.2's tree:

- ``config/job_config.py``: the sections and defaults (``Training``, ``Parallelism``, ``ActivationCheckpoint``
  (mode "selective", ``selective_ac_option`` "2": every 2nd block), ``Model``, ``Optimizer``);
- ``distributed/parallel_dims.py`` ``ParallelDims._validate``: ``data_parallel_shard_degree = -1`` takes the
  ranks left (world_size / (replicate x cp x tp x pp)), and the product must be the world size;
  FSDP is applied when the shard degree (or cp) is above 1 (``fsdp_enabled``);
- ``train.py`` ``Trainer.__init__``: the model built on the meta device in ``training.dtype``, then
  parallelized, ``to_empty`` and ``init_weights`` (zeroplan's meta init); gradient accumulation =
  global_batch_size / (local_batch_size x data-parallel degree) (global -1: one micro-step);
- ``models/llama3/infra/parallelize.py`` ``apply_fsdp``: ``MixedPrecisionPolicy(mixed_precision_param,
  mixed_precision_reduce)`` and the wrapping (``TORCHTITAN_WRAPPING``): ``tok_embeddings``, each block of
  ``layers``, ``[norm, output]`` with ``reshard_after_forward`` only under the policy "always", then the root;
  ``fsdp_reshard_after_forward`` "default" is ``not pp_enabled`` (True here: no pipeline).

HSDP (replicate degree R above 1 with sharding) is ``apply_fsdp`` on the 2-D mesh ``("dp_replicate",
"dp_shard_cp")``, the FSDP2 engine's ``dp_replicate`` (engines/fsdp2/mesh.py); the batch degree is R x shard.
Refused in one line: tensor, pipeline, context and expert parallelism, and replication without sharding (DDP).
Returned as data for the caller to accept or refuse (the FSDP2 engine may not express them yet): the
activation-checkpointing mode (selective, per op or every k-th layer: the engine's ``selective_ac``,
integrations/fsdp2_run.py), the wrapping, ``compile.enable``, ``model.converters`` (float8, ...) and CPU offload.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from zeroplan.files import read_text
from zeroplan.integrations.accelerate_config import WrapUnit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TORCHTITAN_VERSION = "0.2.2"
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # config/__init__.py TORCH_DTYPE_MAP
TRAINING_DEFAULTS = {"local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048, "dtype": "float32",
                     "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32",
                     "enable_cpu_offload": False}  # fmt: skip
PARALLELISM_DEFAULTS = {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                        "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1,
                        "pipeline_parallel_degree": 1, "context_parallel_degree": 1, "expert_parallel_degree": 1}  # fmt: skip
AC_DEFAULTS = {"mode": "selective", "selective_ac_option": "2"}
"""v0.2.2 ``config/job_config.py`` ``ActivationCheckpoint`` (0.3.0 moved activation checkpointing into
``distributed/activation_checkpoint.py`` configs)."""


@dataclass(frozen=True)
class TorchtitanRun:
    """A torchtitan FSDP run (module docstring); dtypes in zeroplan's names."""

    model: str
    flavor: str
    nd: int
    """data-parallel ranks (torchtitan's batch degree): replicate x the resolved ``data_parallel_shard_degree``."""
    local_batch_size: int
    grad_accum: int
    seq_len: int
    module_dtype: str
    """``training.dtype``: the dtype the model is built in (the shards keep it)."""
    param_dtype: Optional[str]
    reduce_dtype: Optional[str]
    """``mixed_precision_param`` / ``_reduce`` through ``MixedPrecisionPolicy``; None where FSDP is not applied."""
    reshard_after_forward: bool
    checkpointing: Literal["none", "full", "selective"]
    selective_ac_option: Optional[str]
    """mode "selective": "op" (per-op policy) or an int k (every k-th block checkpointed); else None."""
    cpu_offload: bool
    compile: bool
    converters: tuple[str, ...]
    init: Literal["meta"]
    wrapping: tuple[WrapUnit, ...]
    dp_replicate: int = 1
    """``data_parallel_replicate_degree``: above 1, HSDP on the (replicate, shard) mesh."""


def torchtitan_wrapping(reshard_after_forward: bool, policy: str) -> tuple[WrapUnit, ...]:
    """``apply_fsdp``'s ``fully_shard`` calls, in order (module docstring)."""
    return (
        WrapUnit("tok_embeddings", reshard_after_forward),
        WrapUnit("each block of layers", reshard_after_forward),
        WrapUnit("[norm, output]", policy == "always"),
        WrapUnit("the root (every parameter not in a unit above)", None),
    )


def _toml(path: str | Path) -> dict:
    text = read_text(path, "torchtitan config")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"torchtitan config {str(path)!r}: not valid TOML ({exc})") from None


def _section(data: dict, name: str, defaults: dict) -> dict:
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise ValueError(f"torchtitan config: [{name}] must be a table")
    return defaults | {k: v for k, v in section.items() if k in defaults or name == "activation_checkpoint"}


def _whole(value: object, key: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"torchtitan config: {key}={value!r}: expected a whole number >= {low}")
    return value


def _dtype(value: object, key: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"torchtitan config: {key}={value!r}: torchtitan {TORCHTITAN_VERSION} takes {', '.join(allowed)}")
    return DTYPES[value]


def _degrees(par: dict, world_size: Optional[int]) -> tuple[int, int]:
    """(shard degree, replicate degree) as ``ParallelDims._validate`` resolves them."""
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree"):
        if _whole(par[key], f"parallelism.{key}", 1) > 1:
            raise ValueError(f"torchtitan config: parallelism.{key}={par[key]}: zeroplan models one data-parallel "
                             "dimension (FSDP) only")  # fmt: skip
    replicate = _whole(par["data_parallel_replicate_degree"], "parallelism.data_parallel_replicate_degree", 1)
    shard = par["data_parallel_shard_degree"]
    if shard == -1:
        if world_size is None:
            raise ValueError("torchtitan config: data_parallel_shard_degree=-1 takes the ranks left over: give the "
                             "number of GPUs (--gpus)")  # fmt: skip
        shard = world_size // replicate
    shard = _whole(shard, "parallelism.data_parallel_shard_degree", 1)
    if world_size is not None and shard * replicate != world_size:
        raise ValueError(f"torchtitan config: data_parallel_shard_degree {shard} x replicate {replicate} != "
                         f"{world_size} GPUs: torchtitan refuses it (ParallelDims._validate)")  # fmt: skip
    if shard == 1:
        raise ValueError("torchtitan config: data_parallel_shard_degree=1: no FSDP (DDP or one GPU), which the "
                         "FSDP2 engine does not describe")  # fmt: skip
    return shard, replicate


def _checkpointing(ac: dict) -> tuple[str, Optional[str]]:
    mode = ac.get("mode", AC_DEFAULTS["mode"])
    if mode not in ("none", "full", "selective"):
        raise ValueError(f"torchtitan config: activation_checkpoint.mode={mode!r}: zeroplan reads none, full and "
                         "selective (not memory_budget, which the compiler decides)")  # fmt: skip
    option = str(ac.get("selective_ac_option", AC_DEFAULTS["selective_ac_option"]))
    if mode == "selective" and option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ValueError(f"torchtitan config: activation_checkpoint.selective_ac_option={option!r}: expected 'op' or "
                         "a whole number >= 1")  # fmt: skip
    return mode, option if mode == "selective" else None


def read_torchtitan_config(path: str | Path, world_size: Optional[int] = None) -> TorchtitanRun:
    """``path`` as torchtitan 0.2.2 reads it, at ``world_size`` GPUs (needed when the shard degree is -1);
    ValueError, one line, for what torchtitan refuses and what zeroplan does not model."""
    data = _toml(path)
    train = _section(data, "training", TRAINING_DEFAULTS)
    par = _section(data, "parallelism", PARALLELISM_DEFAULTS)
    shard, replicate = _degrees(par, world_size)
    dp = shard * replicate  # trainer.py: batch_degree = dp_replicate x dp_shard
    local = _whole(train["local_batch_size"], "training.local_batch_size", 1)
    global_batch = train["global_batch_size"]
    if global_batch != -1 and (_whole(global_batch, "training.global_batch_size", 1) % (local * dp)):
        raise ValueError(f"torchtitan config: global_batch_size {global_batch} is not a multiple of local_batch_size "
                         f"{local} x data-parallel degree {dp}: torchtitan refuses it")  # fmt: skip
    policy = par["fsdp_reshard_after_forward"]
    if policy not in ("default", "always", "never"):
        raise ValueError(f"torchtitan config: parallelism.fsdp_reshard_after_forward={policy!r}: expected default, "
                         "always or never")  # fmt: skip
    reshard = policy != "never"  # "default": not pp_enabled, and pipeline parallelism is refused above
    mode, option = _checkpointing(data.get("activation_checkpoint") or {})
    model = data.get("model") or {}
    converters = model.get("converters", [])
    converters = tuple(converters.split(",") if isinstance(converters, str) else converters)
    return TorchtitanRun(
        model=str(model.get("name", "llama3")), flavor=str(model.get("flavor", "debugmodel")), nd=dp,
        local_batch_size=local, grad_accum=1 if global_batch == -1 else global_batch // (local * dp),
        seq_len=_whole(train["seq_len"], "training.seq_len", 1),
        module_dtype=_dtype(train["dtype"], "training.dtype", ("bfloat16", "float32")),
        param_dtype=_dtype(train["mixed_precision_param"], "training.mixed_precision_param", ("bfloat16", "float32")),
        reduce_dtype=_dtype(train["mixed_precision_reduce"], "training.mixed_precision_reduce", ("float32",)),
        reshard_after_forward=reshard, checkpointing=mode, selective_ac_option=option,  # type: ignore[arg-type]
        cpu_offload=bool(train["enable_cpu_offload"]), compile=bool((data.get("compile") or {}).get("enable", False)),
        converters=converters, init="meta", wrapping=torchtitan_wrapping(reshard, policy), dp_replicate=replicate,
    )  # fmt: skip
