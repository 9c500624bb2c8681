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
from dataclasses import dataclass
from typing import Any, Optional

from zeroplan.types import show

TORCH_DTYPES: dict[str, str] = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
"""The parameter dtypes zeroplan's engines train in (``Dtype`` of fsdp2/deepspeed settings), by torch's name."""

LIVE_OPTIMIZERS: dict[str, str] = {"Adam": "adam", "AdamW": "adamw", "SGD": "sgd"}
"""torch.optim classes (exact class, ``torch/optim/{adam,adamw,sgd}.py``) and their ``OPTIMIZERS`` name; SGD
with ``momentum`` > 0 is ``sgd-momentum`` (one ``momentum_buffer``, ``sgd.py:_init_group``)."""

STATE_FOR: dict[str, tuple[str, ...]] = {"adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq"),
                                         "sgd": (), "sgd-momentum": ("momentum_buffer",)}  # fmt: skip
"""The state tensors of parameter size torch keeps (``step``, one scalar per tensor, is not one of them)."""


@dataclass(frozen=True)
class LiveRun:
    """What the objects say: the parameters' dtype and, with an optimizer, its zeroplan name, the dtype of its
    states and its multi-tensor path (``foreach``)."""

    dtype: str
    optimizer: Optional[str] = None
    state_dtype: Optional[str] = None
    foreach: Optional[bool] = None


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


def _group_kind(cls: str, group: dict) -> tuple[str, bool]:
    """(zeroplan optimizer, foreach) of one param group; fused, amsgrad and differentiable refused."""
    if group.get("fused"):
        raise ValueError(f"{cls}(fused=True): the fused kernel's temporaries are not modelled; use foreach")
    if group.get("amsgrad"):
        raise ValueError(f"{cls}(amsgrad=True): the third state max_exp_avg_sq is not modelled")
    if group.get("differentiable"):
        raise ValueError(f"{cls}(differentiable=True): not modelled")
    kind = LIVE_OPTIMIZERS[cls]
    if kind == "sgd" and group.get("momentum", 0):
        kind = "sgd-momentum"
    # foreach=None: _default_to_fused_or_foreach picks foreach for CUDA tensors, the device zeroplan plans for
    return kind, group.get("foreach") is not False


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


def state_dtype(optimizer: Any, kind: str, params: dict[int, tuple[str, Any]], dtype: str) -> str:
    """The dtype of the optimizer's per-parameter states: read where the optimizer has stepped, else the
    parameters' (``zeros_like(p)``); states of two dtypes refused."""
    seen: Optional[tuple[str, str]] = None
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        for key in STATE_FOR[kind]:
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
        raise ValueError(f"{cls.__name__}: param groups differ in momentum or foreach ({sorted(kinds)}): give one "
                         "kind of step for every group")  # fmt: skip
    ((kind, foreach),) = kinds
    optimizer_params(optimizer, params)
    return LiveRun(dtype, kind, state_dtype(optimizer, kind, params, dtype), foreach)


def live_settings(engine: str, run: LiveRun, options: dict) -> tuple[dict, dict]:
    """(keywords for ``estimate``'s policy and engine options, fields of the engine's ``Settings``) the run
    gives ``engine``; a keyword given in ``options`` that contradicts the objects is refused in one line.
    Every engine's parameters must then be in a 16-bit module's dtype (``check_module_dtype``).

    - reference (the paper's mixed precision, as its runtime runs it): a 16-bit module's dtype is
      ``param_dtype``; with an optimizer, an fp32 module's too (a plain fp32 run), and the class is
      ``optimizer``. The optimizer steps the fp32 master copy (on for a 16-bit module), so its states are fp32
      whatever the object's; without a master copy (an fp32 module, or ``master_weights=False``: a plain torch
      run) they are the states' dtype read. An fp32 module alone keeps the policy given (a module does not
      say how it is trained: autocast or a mixed-precision wrapper may cast it).
    - fsdp2: ``Settings.module_dtype`` is the module's (the shards keep it); Adam/AdamW only (its states).
    - deepspeed: the ds_config's dtype wins (DeepSpeed 0.19.8 casts an fp32 module to its fp16/bf16,
      ``engine.py:_configure_distributed_model``); Adam/AdamW only, the class agreeing with the config's
      ``optimizer.type`` where it names one."""
    given = {k: v for k, v in options.items() if v is not None}
    if engine == "reference":
        if run.optimizer is None:
            return ({"param_dtype": run.dtype} if run.dtype != "fp32" and "param_dtype" not in given else {}), {}
        master = given.get("master_weights")
        plain = master is False or (master is None and run.dtype == "fp32")  # PrecisionPolicy.master_dtype
        read = {"param_dtype": run.dtype, "optimizer": run.optimizer,
                "optimizer_dtype": run.state_dtype if plain else "fp32"}  # fmt: skip
        _agree(given, read)
        return read, {}
    if run.optimizer is not None and run.optimizer not in ("adam", "adamw"):
        raise ValueError(f"engine={engine}: the optimizer is {run.optimizer}; the {engine} profile models Adam "
                         "and AdamW states")  # fmt: skip
    if engine == "fsdp2":
        if run.state_dtype not in (None, run.dtype):
            raise ValueError(f"optimizer states in {run.state_dtype}, parameters in {run.dtype}: FSDP2's Adam "
                             "states are modelled in the module's dtype")  # fmt: skip
        return {}, {"module_dtype": run.dtype}
    if engine == "deepspeed" and run.optimizer is not None:
        return {}, _deepspeed_optimizer(run.optimizer, given.get("ds_config") or {})
    return {}, {}


def check_module_dtype(module_dtype: str, engine: str, param_dtype: str) -> None:
    """A 16-bit module trains in its dtype: the engine's parameters (its policy's ``param_dtype``, from its
    settings) must be in it; an fp32 module may be cast down (DeepSpeed's fp16/bf16, autocast)."""
    if module_dtype != "fp32" and param_dtype != module_dtype:
        raise ValueError(f"the module is {module_dtype} but engine {engine} would train {param_dtype} parameters "
                         f"(its options or ds_config): give {module_dtype} there, or an fp32 module")  # fmt: skip


def _agree(given: dict, read: dict) -> None:
    """Each keyword given that the objects also say must say the same (any spelling of a dtype)."""
    from zeroplan.formulas.dtypes import canonical_dtype

    for key, value in read.items():
        if key not in given:
            continue
        try:
            mine = canonical_dtype(given[key])
        except (TypeError, ValueError):
            mine = given[key]  # not a dtype (or a bad one: the policy refuses it by name)
        if isinstance(mine, str) and mine.strip().lower() != value:
            raise ValueError(f"{key}={show(given[key])} contradicts the objects, which say {value}: leave it out")


def _deepspeed_optimizer(optimizer: str, config: dict) -> dict:
    """DeepSpeed's ``Settings.optimizer`` from the optimizer object (``deepspeed.initialize(optimizer=...)``
    uses the client's, engine.py ``_configure_optimizer``); a config naming the other class is refused, and so
    is ZeRO-Offload of the optimizer, which DeepSpeed refuses for a client optimizer unless told not to."""
    zero = config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    if isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme") and \
            config.get("zero_force_ds_cpu_optimizer", True) is not False:
        raise ValueError(f"ds_config offload_optimizer device {offload['device']} with a torch optimizer object: "
                         "DeepSpeed 0.19.8 refuses a client optimizer under ZeRO-Offload (engine.py "
                         "_configure_optimizer, zero_force_ds_cpu_optimizer); name it in the ds_config instead")
    section = config.get("optimizer")
    named = section.get("type") if isinstance(section, dict) else None
    if isinstance(named, str) and named.lower() != optimizer:
        raise ValueError(f"ds_config optimizer.type={named!r} contradicts the optimizer object "
                         f"({optimizer}): give one")  # fmt: skip
    return {"optimizer": optimizer}
