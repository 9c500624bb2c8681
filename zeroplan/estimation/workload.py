"""From what the user names (``--model``, a module, a step shape) to the engines' ``Workload``: one home."""

from __future__ import annotations

from typing import Optional

from zeroplan.architectures.spec import TransformerSpec, transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.presets import model_seq_len, resolve_model


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
    ``transformer_shapes`` of it; None for any other module, and for a family whose activation peak is not
    modelled yet (``unmodelled_features``): shapes only, no peak, as for any module."""
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.formulas.activation_terms import unmodelled_features

    config = getattr(module, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        spec = spec_from_hf_config(to_dict(), f"{type(module).__name__}.config")
    except ValueError:
        return None
    if unmodelled_features(spec) or transformer_shapes(spec) != tuple(shapes):
        return None
    return spec
