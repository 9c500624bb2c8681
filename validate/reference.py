"""The plain single-process reference: the same model, trained on the whole global batch.

Same mixed precision as the runtime (16-bit model, fp32 master and Adam with ``foreach=True``), no
sharding, no communication. The runtime must end with the same parameters, up to the rounding that
differs when a mean of per-rank 16-bit gradients replaces the 16-bit gradient of the global batch.
"""

from __future__ import annotations

import torch

from validate.models import build


def train_reference(
    spec, batches: list, lr: float, device, dtype: torch.dtype, amsgrad: bool = False
) -> tuple[torch.nn.Module, dict, dict]:
    """(model, fp32 master after all ``batches``, 16-bit gradients of the last batch), keyed by ``id``
    of the model's parameters; ``dtype`` is the runtime's 16-bit dtype (``ValidateConfig.param_dtype``),
    ``amsgrad`` the runtime's Adam option (``ValidateConfig.amsgrad``)."""
    model = build(spec, dtype, device)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_() for p in params]
    optimizer = torch.optim.Adam(master, lr=lr, foreach=True, amsgrad=amsgrad)
    grads = []
    for batch in batches:
        for p in params:
            p.grad = None
        model.loss(batch).backward()
        grads = [p.grad.clone() for p in params]
        for m, p in zip(master, params):
            m.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
    return model, dict(zip(map(id, params), master)), dict(zip(map(id, params), grads))
