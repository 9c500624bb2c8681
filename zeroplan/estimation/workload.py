"""From what the user names (``--model``, a module, a step shape) to the engines' ``Workload``: one home."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from zeroplan.architectures.spec import TransformerSpec, transformer_shapes
from zeroplan.engines.base import PEAK_CHECKPOINTING, EngineEstimate, EngineOptions, Workload
from zeroplan.formulas.collectives import Collective, step_collectives
from zeroplan.formulas.stages import get_stage
from zeroplan.presets import model_seq_len, resolve_model

if TYPE_CHECKING:
    from zeroplan.engines import Engine


def check_seq_len(spec: TransformerSpec, seq_len: int) -> None:
    """ValueError when ``seq_len`` exceeds the positions the config gives (n_positions / max_position_embeddings)."""
    if seq_len > spec.max_seq_len:
        raise ValueError(f"seq_len={seq_len}: above the model's maximum positions ({spec.max_seq_len})")


def default_foreach(device: Optional[str]) -> bool:
    """torch's ``Adam``/``AdamW`` default (``foreach=None``, the planner's when ``--foreach/--no-foreach`` is not
    given) on the run's device: ``torch/optim/optimizer.py _default_to_fused_or_foreach`` takes the multi-tensor path
    only when every parameter is a supported type (DTensor included: ``torch/distributed/tensor/__init__.py``) on a
    device of ``torch/utils/_foreach_utils.py _get_foreach_kernels_supported_devices`` (cuda, xpu, mtia, the
    privateuse1 backend; no cpu in torch 2.11 nor 2.13), else ``_single_tensor_adam``. ``device`` is the engine's own
    ``--device`` (None: not given, the GPU every planner predicts)."""
    return device != "cpu"


def device_foreach(data: object) -> object:
    """A config's input with ``foreach`` from the run's device (``default_foreach`` of ``engine_options``'
    ``device``) where it is not given (absent or None): the planner configs' one rule, as torch's ``foreach=None``."""
    if isinstance(data, dict) and data.get("foreach") is None:
        options = data.get("engine_options")
        device = options.value("device") if isinstance(options, EngineOptions) else (options or {}).get("device")
        return {**data, "foreach": default_foreach(device)}
    return data


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
    ZeRO-3's hook order; measured, docs/engines/deepspeed-history.md "Hugging Face models"). The validator's own
    ``CausalLM`` runs are predicted with ``validate.engines.deepspeed.workload_for`` instead."""
    check_seq_len(spec, seq_len)
    if checkpointing not in PEAK_CHECKPOINTING:
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
    modelled yet (``activation_limit``, the family part of ``Engine.peak_limits``): shapes only, no peak, as for
    any module."""
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.formulas.activation_terms import activation_limit

    config = getattr(module, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        spec = spec_from_hf_config(to_dict(), f"{type(module).__name__}.config")
    except ValueError:
        return None
    if activation_limit(spec) is not None or transformer_shapes(spec) != tuple(shapes):
        return None
    return spec


def layered_zero3(engine: Engine, workload: Workload, row: EngineEstimate, nd: int) -> tuple[Collective, ...]:
    """The collectives to print for ``row``: the engine's own, except ZeRO-3 of a workload without a module
    tree (a bare Ψ, a list of tensor sizes: ``Workload.spec`` is None) on an engine that reads ZeRO-3's
    traffic off the module tree (one row per configuration, ``Engine.one_row``), which is modelled as layers.

    The one rule for estimate, plan and sweep (plan and sweep refuse those engines without --model). An
    engine's ZeRO-3 traffic depends on the tree: FSDP2 never reshards the root unit after forward, and
    DeepSpeed keeps a module's parameters gathered when they are reused soon (``stage3_max_reuse_distance``),
    so one bare tensor would be gathered once (2Ψ), which is no real model's count. As layers, every
    parameter is gathered for forward and again for backward and its gradient reduce-scattered once (ZeRO
    sec. 7.2: 3Ψ, ``formulas.collectives.step_collectives``), in the dtypes of the engine's own all-gather
    and reduce-scatter; the engine's per-unit calls, post-forward groups and scalars are not kept."""
    if workload.spec is not None or not engine.one_row or row.stage is None:
        return row.collectives
    if not get_stage(row.stage).shards_parameters:
        return row.collectives
    if nd == 1:
        return ()  # nothing is communicated (step_collectives)
    dtype = {c.op: c.dtype for c in reversed(row.collectives)}  # the first of each kind
    numels = tuple(math.prod(s) for _, s in workload.shapes)
    return step_collectives(row.stage, numels, nd, dtype["all-gather"], dtype["reduce-scatter"], False)
