"""A live model in Python: what ``zeroplan.estimate(model=module, optimizer=opt)`` reads from the objects.

A notebook user has the ``torch.nn.Module`` (on the meta device or not) and the ``torch.optim`` optimizer;
this module reads the run from them instead of asking for a config, and maps it onto each engine's own
vocabulary (docs/python-api.md):

- the parameters' one dtype (mixed dtypes refused, naming two parameters);
- the optimizer: its class (``LIVE_OPTIMIZERS``), ``foreach``/``fused``/``amsgrad`` from its param groups
  (torch 2.13 ``torch/optim/optimizer.py:_default_to_fused_or_foreach``), the dtype of its states (torch
  creates them like the parameter, ``torch.zeros_like(p, memory_format=torch.preserve_format)`` in
  ``adam.py:_init_group``; a stepped optimizer's own states are read), and which parameters it holds.

Only attributes are read (``.dtype``, ``.requires_grad``, ``param_groups``, ``state``), never data, so the
meta device costs nothing; torch is taken from ``sys.modules`` (the objects exist, so it is imported), never
imported here.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from zeroplan.engines.live import LiveRun

TORCH_DTYPES: dict[str, str] = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
"""The parameter dtypes zeroplan's engines train in (``Dtype`` of fsdp2/deepspeed settings), by torch's name."""

LIVE_OPTIMIZERS: dict[str, str] = {"Adam": "adam", "AdamW": "adamw", "SGD": "sgd"}
"""torch.optim classes (exact class, ``torch/optim/{adam,adamw,sgd}.py``) and their ``OPTIMIZERS`` name; SGD
with ``momentum`` > 0 is ``sgd-momentum`` (one ``momentum_buffer``, ``sgd.py:_init_group``)."""

STATE_FOR: dict[str, tuple[str, ...]] = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
                                         "sgd": (), "sgd-momentum": ("momentum_buffer",)}  # fmt: skip
"""The state tensors of parameter size torch keeps (``step``, one scalar per tensor, is not one of them)."""


def is_optimizer(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.optim.Optimizer`` (False without torch imported: then it is none)."""
    torch = sys.modules.get("torch")  # never imported here
    return torch is not None and isinstance(obj, torch.optim.Optimizer)


def _dtype(tensor: Any, what: str) -> str:
    name = str(tensor.dtype)
    if name not in TORCH_DTYPES:
        raise ValueError(f"{what} is {name}: zeroplan models {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def module_parameters(module: Any) -> dict[int, tuple[str, Any]]:
    """Every distinct parameter (by identity, first name), as ``module_shapes`` counts them; a frozen one refused."""
    out: dict[int, tuple[str, Any]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in out:
            if not p.requires_grad:
                raise ValueError(f"parameter {name} is frozen (requires_grad=False): frozen weights are not "
                                 "modelled; give a module whose parameters all train")  # fmt: skip
            out[id(p)] = (name, p)
    return out


def module_dtype(params: dict[int, tuple[str, Any]]) -> str:
    """The parameters' one dtype; mixed dtypes refused in one line naming two parameters."""
    (first, p0), *rest = params.values()
    dtype = _dtype(p0, f"parameter {first}")
    for name, p in rest:
        if str(p.dtype) != str(p0.dtype):
            raise ValueError(f"parameters {first} ({p0.dtype}) and {name} ({p.dtype}) differ in dtype: give a "
                             "module in one dtype (module.to(dtype))")  # fmt: skip
    return dtype


def _group_kind(cls: str, group: dict) -> tuple[str, bool, bool, bool]:
    """(zeroplan optimizer, foreach, amsgrad, fused) of one param group; differentiable refused. A fused group
    is not on the foreach path (torch refuses both)."""
    fused = bool(group.get("fused"))
    if group.get("differentiable"):
        raise ValueError(f"{cls}(differentiable=True): not modelled")
    kind = LIVE_OPTIMIZERS[cls]
    if kind == "sgd" and group.get("momentum", 0):
        kind = "sgd-momentum"
    # foreach=None: _default_to_fused_or_foreach picks foreach for CUDA tensors, the device zeroplan plans for
    return kind, group.get("foreach") is not False and not fused, bool(group.get("amsgrad")), fused


def optimizer_params(optimizer: Any, params: dict[int, tuple[str, Any]]) -> None:
    """Every module parameter is in the optimizer and the optimizer holds no other tensor; else one line."""
    held = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    stranger = next((p for i, p in held.items() if i not in params), None)
    if stranger is not None:
        raise ValueError(f"the optimizer holds a tensor of shape {tuple(stranger.shape)} that is not a parameter "
                         "of the module: give the optimizer of this module")  # fmt: skip
    missing = next((name for i, (name, _) in params.items() if i not in held), None)
    if missing is not None:
        raise ValueError(f"parameter {missing} is not in the optimizer: frozen weights are not modelled; give an "
                         "optimizer over all of module.parameters()")  # fmt: skip


def state_dtype(optimizer: Any, kind: str, params: dict[int, tuple[str, Any]], dtype: str, amsgrad: bool) -> str:
    """The dtype of the optimizer's per-parameter states (``max_exp_avg_sq`` too with amsgrad): read where the
    optimizer has stepped, else the parameters' (``zeros_like(p)``); states of two dtypes refused."""
    seen: Optional[tuple[str, str]] = None
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        for key in STATE_FOR[kind] + (("max_exp_avg_sq",) if amsgrad else ()):
            tensor = optimizer.state.get(p, {}).get(key)
            if tensor is None:
                continue
            got = _dtype(tensor, f"optimizer state {key} of {params[id(p)][0]}")
            if seen is not None and got != seen[0]:
                raise ValueError(f"optimizer states {seen[1]} ({seen[0]}) and {key} of {params[id(p)][0]} "
                                 f"({got}) differ in dtype")  # fmt: skip
            seen = seen or (got, f"{key} of {params[id(p)][0]}")
    return seen[0] if seen else dtype


def read_live(module: Any, optimizer: Any = None) -> LiveRun:
    """The run ``module`` (and ``optimizer``, where given) describe; ValueError in one line for what zeroplan
    does not model."""
    params = module_parameters(module)
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters")
    dtype = module_dtype(params)
    if optimizer is None:
        return LiveRun(dtype)
    cls = type(optimizer)
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or cls.__name__ not in LIVE_OPTIMIZERS:
        raise ValueError(f"optimizer={cls.__module__}.{cls.__name__}: zeroplan reads torch.optim."
                         f"{', torch.optim.'.join(LIVE_OPTIMIZERS)}")  # fmt: skip
    kinds = {_group_kind(cls.__name__, g) for g in optimizer.param_groups}
    if len(kinds) != 1:
        raise ValueError(f"{cls.__name__}: param groups differ in momentum, foreach, amsgrad or fused "
                         f"({sorted(kinds)}): give one kind of step for every group")  # fmt: skip
    ((kind, foreach, amsgrad, fused),) = kinds
    optimizer_params(optimizer, params)
    return LiveRun(dtype, kind, state_dtype(optimizer, kind, params, dtype, amsgrad), foreach, amsgrad, fused)


def live_settings(engine: str, run: LiveRun, options: dict) -> tuple[dict, dict]:
    """(keywords for ``estimate``'s policy and engine options, fields of the engine's ``Settings``) the run
    gives ``engine``: the engine's own reading (``Engine.live_settings``, in its package's ``live.py``); a
    keyword given in ``options`` that contradicts the objects is refused there in one line. Every engine's
    parameters must then be in a 16-bit module's dtype (``check_module_dtype``)."""
    from zeroplan.engines import get_engine

    keywords, settings = get_engine(engine).live_settings(run, {k: v for k, v in options.items() if v is not None})
    if run.amsgrad and not settings.get("amsgrad"):  # an engine that models it says so in its settings
        raise ValueError(f"amsgrad=True under engine={engine}: its third state max_exp_avg_sq is modelled by "
                         "engine=fsdp2, reference and deepspeed only")  # fmt: skip
    if run.fused and not settings.get("fused"):
        raise ValueError(f"fused=True under engine={engine}: the fused kernel's step is modelled by engine=fsdp2 "
                         "only; use foreach")  # fmt: skip
    return keywords, settings


def check_module_dtype(module_dtype: str, engine: str, param_dtype: str) -> None:
    """A 16-bit module trains in its dtype: the engine's parameters (its policy's ``param_dtype``, from its
    settings) must be in it; an fp32 module may be cast down (DeepSpeed's fp16/bf16, autocast)."""
    if module_dtype != "fp32" and param_dtype != module_dtype:
        raise ValueError(f"the module is {module_dtype} but engine {engine} would train {param_dtype} parameters "
                         f"(its options or ds_config): give {module_dtype} there, or an fp32 module")  # fmt: skip
