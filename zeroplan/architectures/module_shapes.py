"""Parameter shapes of a user's ``torch.nn.Module``, for the Python API.

Reads only ``.shape`` of each parameter, so a model built on the meta device (``with
torch.device("meta"): ...``) or under FakeTensorMode costs no memory. A parameter registered under two
names (a tied LM head) is one tensor and counted once, by identity, under the first name
``named_parameters`` gives it. torch is imported inside the function only: importing zeroplan never
imports torch.
"""

from __future__ import annotations

from zeroplan.architectures.spec import Shape


def module_shapes(module: object) -> tuple[tuple[str, Shape], ...]:
    """Every distinct parameter of ``module`` as (name, shape), in ``named_parameters()`` order."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    seen: set[int] = set()
    out: list[tuple[str, Shape]] = []
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in seen:
            seen.add(id(param))
            out.append((name, tuple(int(n) for n in param.shape)))
    if not out:
        raise ValueError(f"{type(module).__name__} has no parameters")
    return tuple(out)
