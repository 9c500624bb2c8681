"""FSDP2's planner vocabulary, declared once (``Engine.own_options``): each option in ``fully_shard``'s,
``MixedPrecisionPolicy``'s, ``CPUOffloadPolicy``'s and torchtitan's words, with the check of its value (the engine's
settings room; ``plan.py`` turns the checked options into ``Settings``)."""

from __future__ import annotations

from collections.abc import Callable

from zeroplan.engines.base import EngineOption
from zeroplan.engines.fsdp2.mesh import MESH_HELP, check_group, check_shard
from zeroplan.engines.fsdp2.tp import check_tp
from zeroplan.formulas.dtypes import canonical_dtype
from zeroplan.types import show


def check_reshard(v: object) -> bool | int:
    """``reshard_after_forward`` as ``fully_shard`` takes it: True, False or the post-forward group size (an int
    >= 1; that it divides N_d is checked with N_d, ``settings.post_forward_group``)."""
    if isinstance(v, bool) or (isinstance(v, int) and v >= 1):
        return v
    raise ValueError(f"reshard_after_forward={show(v)}: expected true, false or a whole number of ranks >= 1")


def check_selective_ac(v: object) -> int | str:
    """``Settings.selective_ac`` (engines/fsdp2/selective_ac.py): "op", or every k-th decoder layer checkpointed, k >= 1
    (the command line's text "2" is 2, as torchtitan reads ``selective_ac_option``)."""
    v = int(v) if isinstance(v, str) and v.isdigit() else v
    if v != "op" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"selective_ac={show(v)}: expected op or a whole number of layers >= 1")
    return v


def check_dtype(name: str) -> Callable[[object], str]:
    """The check of a ``MixedPrecisionPolicy`` dtype option: any spelling ``canonical_dtype`` knows."""

    def check(v: object) -> str:
        try:
            return canonical_dtype(v)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None

    return check


def _wrap(value: object) -> object:
    """``--fsdp-wrap``: a preset name, the path of a wrapping file (``wrap.read_wrapping``) or a Wrapping."""
    from zeroplan.engines.fsdp2.wrap import PRESETS, Wrapping, parse_wrapping, read_wrapping

    if isinstance(value, Wrapping):
        return value
    if isinstance(value, dict):
        return parse_wrapping(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"fsdp_wrap={value!r}: expected {', '.join(PRESETS)} or a wrapping JSON file")
    return value if value in PRESETS else read_wrapping(value)


def _choice(name: str, allowed: tuple[str, ...]):
    def check(value: object) -> str:
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: expected {' or '.join(allowed)}")
        return value  # type: ignore[return-value]

    return check


def _flag(name: str):
    def check(value: object) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: expected true or false")
        return value

    return check


VOCABULARY: tuple[EngineOption, ...] = (
    EngineOption("reshard_after_forward", check_reshard, None,
                 "fully_shard(reshard_after_forward=...): True (default), False or the post-forward group size"),
    EngineOption("param_dtype", check_dtype("param_dtype"), None, "MixedPrecisionPolicy.param_dtype (default: none)"),
    EngineOption("reduce_dtype", check_dtype("reduce_dtype"), None,
                 "MixedPrecisionPolicy.reduce_dtype (default: the param dtype)"),
    EngineOption("wrap", _wrap, None, "the fully_shard calls: blocks (default), torchtitan or a wrapping JSON file"),
    EngineOption("init", _choice("init", ("meta", "materialized")), None,
                 "meta (default: built on the meta device, sharded, to_empty) or materialized (built whole first)"),
    EngineOption("device", _choice("device", ("cuda", "cpu")), None,
                 "cuda (default, NCCL) or cpu (gloo: no CUDA block rounding or library workspaces)"),
    EngineOption("dp_replicate", check_group("dp_replicate"), None, MESH_HELP["dp_replicate"]),
    EngineOption("dp_shard", check_shard, None, MESH_HELP["dp_shard"]),
    EngineOption("offload_policy", _choice("offload_policy", ("none", "cpu")), None,
                 "fully_shard(offload_policy=...): none (default) or cpu (CPUOffloadPolicy: shards, gradients and "
                 "the optimizer step on the host)"),
    EngineOption("pin_memory", _flag("pin_memory"), None, "CPUOffloadPolicy.pin_memory (default true)"),
    EngineOption("selective_ac", check_selective_ac, None,
                 "with --checkpointing full: torchtitan's selective_ac_option, k (layers k, 2k, ... checkpointed; "
                 "default 1) or op (every layer keeps its matmuls' outputs but every second one)"),
    EngineOption("tp", check_tp, None,
                 "tensor parallelism: ranks T of the mesh's 'tp' dimension (torchtitan's llama plan); plan: auto"),
    EngineOption("sequence_parallel", _flag("sequence_parallel"), None,
                 "with tp: SequenceParallel norms and Shard(1) activations (default true)"),
    EngineOption("loss_parallel", _flag("loss_parallel"), None,
                 "with tp: the head's output Shard(-1), the loss under loss_parallel() (default true); false: "
                 "Replicate, all-gathered logits (torchtitan's disable_loss_parallel)"),
    EngineOption("tp_plan", _choice("tp_plan", ("torchtitan", "transformers")), None,
                 "with tp: torchtitan (default) or transformers (the model's own tp_plan, accelerate's TP: no SP, the "
                 "logits gathered; engines/fsdp2/tp.py)"),
)  # fmt: skip
"""FSDP2's vocabulary, declared once (``Engine.own_options``): ``fully_shard``'s ``reshard_after_forward``,
``MixedPrecisionPolicy``'s dtypes, ``Settings.wrap``, ``init``, ``device``, the HSDP mesh's ``dp_replicate``
and ``dp_shard`` (engines/fsdp2/mesh.py), and ``CPUOffloadPolicy`` (``offload_policy``, ``pin_memory``); None:
the default a GPU user runs."""
