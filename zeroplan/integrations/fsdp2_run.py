"""An accelerate FSDP2 config or a torchtitan job config as the FSDP2 engine's options: the wrapping each
launcher makes (``WrapUnit``, in its own words) as data (the JSON form ``--fsdp-wrap FILE`` reads,
docs/engines/fsdp2.md, in the module names of ``--model``, which the caller gives as ``Names``), the policy,
the init and the batch the file sets. Plain data: the fsdp2 engine checks the wrapping (its own option).

torchtitan's selective activation checkpointing (``selective_ac_option`` k or "op") is the engine's ``selective_ac``
with checkpointing full (engines/fsdp2/selective_ac.py). What the engine cannot express is refused in one line
naming the setting: ``torch.compile``, model converters (float8), CPU offload, a module dtype other than fp32,
accelerate's size-based wrapping and a layer class that is not the model's decoder layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zeroplan.integrations.accelerate_config import AccelerateFsdp
from zeroplan.integrations.torchtitan_config import TorchtitanRun

DECODER_LAYER_SUFFIXES = ("DecoderLayer", "Block")
"""transformers' decoder layer classes (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ``GPT2Block``: each model's
``_no_split_modules``): a class named otherwise is not one unit per decoder layer."""


@dataclass(frozen=True)
class Fsdp2Run:
    """What the file sets for the FSDP2 engine: its own options (``EngineOptions`` keywords), the wrapping in
    full, N_d, and the step's batch and checkpointing (None: the file leaves it to the command line)."""

    options: dict
    wrapping: dict
    gpus: Optional[int]
    micro_batch: Optional[int]
    grad_accum: Optional[int]
    seq_len: Optional[int]
    checkpointing: Optional[str]


@dataclass(frozen=True)
class Names:
    """The model's modules a launcher wraps, by their names in ``named_modules()``."""

    embed: str
    """the token embedding (``model.embed_tokens``, ``transformer.wte``)."""
    layers: str
    """the decoder layers as a pattern (``model.layers.*``)."""
    norm: str
    """the final norm (``model.norm``, ``transformer.ln_f``)."""
    tied: bool
    """``lm_head`` is the token embedding's weight."""


def _unit(modules: tuple[str, ...], reshard: Optional[bool], group: bool = False) -> dict:
    return {"modules": list(modules), "group": group, "reshard_after_forward": reshard}


def label(wrapping: dict) -> str:
    """The calls in one line: ``model.layers.* reshard=False; [model.norm, lm_head] reshard=False; ""``."""
    return "; ".join(("[" + ", ".join(u["modules"]) + "]" if u["group"] else ", ".join(u["modules"]) or '""')
                     + ("" if u["reshard_after_forward"] is None else f" reshard={u['reshard_after_forward']}")
                     for u in wrapping["units"])  # fmt: skip


def torchtitan_wrapping(run: TorchtitanRun, names: Names) -> dict:
    """``apply_fsdp``'s calls (``run.wrapping``): embeddings and blocks at the run's reshard value, ``[norm,
    output]`` at its own (True only under the policy "always"), the root at FSDP2's default."""
    if names.tied:
        raise ValueError("--torchtitan-config: torchtitan wraps the token embeddings and the output apart; a tied "
                         "model would read a resharded weight (torchtitan's models are untied)")  # fmt: skip
    values = [u.reshard_after_forward for u in run.wrapping]
    return {"units": [_unit((names.embed,), values[0]), _unit((names.layers,), values[1]),
                      _unit((names.norm, "lm_head"), values[2], group=True), _unit(("",), None)]}  # fmt: skip


def accelerate_wrapping(run: AccelerateFsdp, names: Names) -> dict:
    """``fsdp2_prepare_model``'s calls (accelerate 1.15.0, ``run.wrapping``): each decoder layer (transformer-based
    wrap), the input embeddings unless tied, ``[final norm, output embeddings]`` (with the input embeddings when
    tied: torch 2.13 refuses a weight in two units) kept gathered, then the root at FSDP2's default."""
    units = []
    if run.auto_wrap_policy == "size_based_wrap" and run.min_num_params > 0:
        raise ValueError("--accelerate-config: fsdp_auto_wrap_policy SIZE_BASED_WRAP: its units are not mapped to "
                         "module names yet; use TRANSFORMER_BASED_WRAP")  # fmt: skip
    if run.auto_wrap_policy == "transformer_based_wrap":
        odd = [c for c in run.transformer_layer_cls_to_wrap or () if not c.strip().endswith(DECODER_LAYER_SUFFIXES)]
        if odd:
            raise ValueError(f"--accelerate-config: fsdp_transformer_layer_cls_to_wrap={odd[0]}: zeroplan models one "
                             "unit per decoder layer (a *DecoderLayer or GPT2Block class)")  # fmt: skip
        units.append(_unit((names.layers,), run.reshard_after_forward))
    if not names.tied:
        units += [_unit((names.embed,), run.reshard_after_forward),
                  _unit((names.norm, "lm_head"), False, group=True)]  # fmt: skip
    else:
        units.append(_unit((names.norm, names.embed, "lm_head"), False, group=True))
    return {"units": [*units, _unit(("",), None)]}


def _refuse(flag: str, what: dict) -> None:
    said = [k for k, v in what.items() if v]
    if said:
        raise ValueError(f"{flag}: {said[0]}: not expressible in the FSDP2 engine (docs/integrations.md)")


def from_torchtitan(run: TorchtitanRun, names: Optional[Names]) -> Fsdp2Run:
    """The FSDP2 engine's run of a torchtitan job config (``read_torchtitan_config``)."""
    _refuse("--torchtitan-config", {
        "compile.enable=true": run.compile, f"model.converters={list(run.converters)}": bool(run.converters),
        "training.enable_cpu_offload=true": run.cpu_offload,
        f"training.dtype={run.module_dtype} (the shards' dtype)": run.module_dtype != "fp32",
    })  # fmt: skip
    if names is None:
        raise ValueError("--torchtitan-config: give --model (the wrapping is in its module names)")
    wrap = torchtitan_wrapping(run, names)
    named = run.wrapping[2].reshard_after_forward is False  # --fsdp-wrap torchtitan, by its name
    options = {"reshard_after_forward": run.reshard_after_forward, "param_dtype": run.param_dtype,
               "reduce_dtype": run.reduce_dtype, "wrap": "torchtitan" if named else wrap, "init": run.init,
               "dp_replicate": run.dp_replicate}  # the file's mesh, 1: flat (pinned: plan searches no other)
    checkpointing = run.checkpointing
    if checkpointing == "selective":  # every k-th layer checkpointed, or the per-op policy (engines/fsdp2/selective_ac.py)
        option = run.selective_ac_option or "1"
        checkpointing, sac = "full", option if option == "op" else int(option)
        options.update({"selective_ac": sac} if sac != 1 else {})
    return Fsdp2Run(options, wrap, run.nd, run.local_batch_size, run.grad_accum, run.seq_len, checkpointing)


def from_accelerate(run: AccelerateFsdp, names: Optional[Names]) -> Fsdp2Run:
    """The FSDP2 engine's run of an accelerate FSDP2 config (``read_fsdp``): RAM-efficient loading is the meta
    init (the model moved to meta, ``fully_shard``, rank 0's state dict broadcast into the shards). With a TP size
    the model is transformers' own TP (``tp_plan`` transformers: no SP, the logits gathered); without RAM-efficient
    loading ``from_pretrained(..., tp_plan="auto")`` has put each rank's TP-local model on its device (transformers
    ``distributed/utils.py`` ``initialize_tensor_parallelism``: ``device_map`` the local rank's device) before
    ``fully_shard``: the engine's materialized init (the TP-local model whole on the device), not the CPU load."""
    tp = {"tp": run.tp, "sequence_parallel": False, "loss_parallel": False, "tp_plan": "transformers"}
    _refuse("--accelerate-config", {
        "fsdp_offload_params=true": run.offload_params,
        "fsdp_activation_checkpointing_offload=true": run.activation_checkpointing_offload,
        f"mixed_precision={run.mixed_precision}": run.param_dtype == "fp16",
        "fsdp_cpu_ram_efficient_loading=false (each rank loads the whole model on CPU, fully_shard moves each "
        "unit to the GPU before sharding it)": run.init == "cpu" and run.tp == 1,
    })  # fmt: skip
    if names is None:
        raise ValueError("--accelerate-config: give --model (the wrapping is in its module names)")
    wrap = accelerate_wrapping(run, names)
    options = {"wrap": wrap, "init": "meta" if run.init == "meta" else "materialized",
               **({"param_dtype": run.param_dtype, "reduce_dtype": run.reduce_dtype} if run.param_dtype else {}),
               "dp_replicate": run.dp_replicate,  # the file's mesh, 1: flat (pinned: plan searches no other)
               **(tp if run.tp > 1 else {})}  # fmt: skip
    return Fsdp2Run(options, wrap, run.num_processes, None, None, None, "full" if run.activation_checkpointing else None)
