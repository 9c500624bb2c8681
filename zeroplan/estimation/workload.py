"""From what the user names (``--model``, a module, a step shape) to the engines' ``Workload``: one home."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from zeroplan.architectures.spec import TransformerSpec, transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.formulas.stages import get_stage
from zeroplan.presets import model_seq_len, resolve_model

if TYPE_CHECKING:
    from zeroplan.engines import Engine


def check_seq_len(spec: TransformerSpec, seq_len: int) -> None:
    """ValueError when ``seq_len`` exceeds the positions the config gives (n_positions / max_position_embeddings)."""
    if seq_len > spec.max_seq_len:
        raise ValueError(f"seq_len={seq_len}: above the model's maximum positions ({spec.max_seq_len})")


def model_workload(
    spec: TransformerSpec,
    seq_len: int,
    micro_batch: int = 1,
    checkpointing: str = "none",
    grad_accum: int = 1,
    foreach: bool = True,
) -> Workload:
    """The ``Workload`` of one micro-step of ``spec`` (exact shapes from ``transformer_shapes``), as users run
    it: the ``transformers`` model of the architecture (``Workload.transformers``: its module tree decides
    ZeRO-3's hook order; measured, docs/engines/deepspeed.md "Hugging Face models"). The validator's own
    ``CausalLM`` runs are predicted with ``validate.engines.deepspeed.workload_for`` instead."""
    check_seq_len(spec, seq_len)
    if checkpointing not in ("none", "full"):
        raise ValueError(f"checkpointing={checkpointing!r}: the peak model knows none and full")
    shapes = transformer_shapes(spec)
    return Workload(shapes, spec, seq_len, micro_batch, checkpointing, grad_accum, foreach,  # type: ignore[arg-type]
                    transformers=True)


def resolve(name_or_path: str, seq_len: Optional[int]) -> tuple[TransformerSpec, int]:
    """(architecture, sequence length) of ``--model``: ``seq_len`` or the model's default (``presets``)."""
    spec = resolve_model(name_or_path)
    return spec, seq_len if seq_len is not None else model_seq_len(name_or_path, spec)


def module_architecture(module: object, shapes: tuple) -> Optional[TransformerSpec]:
    """The architecture of a ``transformers`` model (its ``config``), when its parameters are exactly
    ``transformer_shapes`` of it; None for any other module (shapes only, no peak)."""
    from zeroplan.architectures.hf_config import spec_from_hf_config

    config = getattr(module, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        spec = spec_from_hf_config(to_dict(), f"{type(module).__name__}.config")
    except ValueError:
        return None
    return spec if transformer_shapes(spec) == tuple(shapes) else None


def check_zero3_traffic(engine: Engine, workload: Workload, stage: Optional[int]) -> None:
    """ValueError (one line) for ZeRO-3 traffic the workload cannot give: the one rule for estimate, plan
    and sweep. Without a module tree (a bare Ψ, a list of tensor sizes: ``Workload.spec`` is None) the
    paper's count (an engine answering one row per ZeRO stage, ``not Engine.one_row``: every parameter gathered before forward and again before backward,
    3Ψ, ZeRO sec. 7.2) still holds, but an engine that reads ZeRO-3's collectives off the module tree
    cannot: FSDP2 never reshards the root unit after forward, DeepSpeed keeps a module's parameters
    gathered when they are reused soon (``stage3_max_reuse_distance``), so one bare tensor would be
    gathered once (2Ψ), which is neither the paper's count nor any real model's."""
    paper_count = not engine.one_row
    if workload.spec is None and not paper_count and stage is not None and get_stage(stage).shards_parameters:
        raise ValueError(
            f"ZeRO-3 traffic of engine {engine.name!r} follows the model's module tree (which units are "
            "gathered again for backward), and a bare parameter count or list of tensor sizes has none: give "
            "--model (a preset or a config.json), a sharding without ZeRO-3 (deepspeed --stage 1|2, fsdp2 "
            "--reshard-after-forward false), or the reference engine (the paper's 3Ψ)"
        )
