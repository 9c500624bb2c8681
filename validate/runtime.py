"""What every stage of the reference runtime shares: units, flat layouts, the fp32 master shard, Adam.

An optimizer step is G micro-steps (``grad_accum``, default 1) of ``loss = runtime.model.loss(batch)``,
``runtime.backward(loss)``, then ``runtime.step()``. Gradients are cleared by the first micro-step's
backward; every reduction divides by N_d·G (``validate.collectives``), so the reduced gradient is the
mean over the N_d·G micro-batches. Where a stage reduces under accumulation (once, or every micro-step)
is stated in its class docstring and follows ``zeroplan.formulas.commtime.runs_every_micro_step``.
Mixed precision as in the ZeRO paper (section 3.1): 16-bit parameters and gradients, an fp32 master copy
with Adam's m and v on the rank's shard. The master shard is one flat fp32 tensor (every unit's owned
slice end to end), so Adam keeps one ``step`` scalar; ``foreach`` is recorded (``self.foreach``) because
the per-tensor loop and the foreach path allocate different temporaries, which the peak model predicts. Subclasses (``stage0.py`` ... ``stage3.py``) decide where gradients and parameters live
and which collectives move them.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from validate.flat import FlatLayout, slices


def split_units(model: nn.Module) -> list[tuple[nn.Module | None, list[nn.Parameter]]]:
    """(module, params) per sharding unit: the root (parameters outside ``model.blocks``), then each block."""
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    units = [(None, root)] if root else []
    return units + [(block, list(block.parameters())) for block in model.blocks]


class Runtime:
    """Base class; ``stage`` and the hooks below are filled in per stage."""

    stage: int

    def __init__(
        self, model: nn.Module, nd: int, rank: int, lr: float = 1e-3, foreach: bool | None = None,
        grad_accum: int = 1, amsgrad: bool = False,
    ) -> None:
        if grad_accum < 1:
            raise ValueError(f"grad_accum={grad_accum}: must be >= 1")
        self.model, self.nd, self.rank = model, nd, rank
        self.grad_accum, self.micro_step = grad_accum, 0  # micro-steps per optimizer step; this one (0-based)
        self.units = split_units(model)
        first = self.units[0][1][0]
        self.dtype, self.device = first.dtype, first.device
        align = nd if self.stage >= 1 else 1  # stage 0 is DDP: whole, unpadded tensors
        self.layouts = [FlatLayout(tuple(tuple(p.shape) for p in ps), nd, align) for _, ps in self.units]
        sizes = [lay.full_numel if self.stage == 0 else lay.shard_numel for lay in self.layouts]
        self.local_slices = slices(sizes)  # where each unit sits in this rank's flat master/grad shard
        with torch.no_grad():
            self.master = nn.Parameter(self.local_flat([ps for _, ps in self.units], torch.float32))
            self.setup()
        if foreach is None:  # torch's own default for these tensors (foreach on CUDA, per-tensor on CPU)
            from torch.optim.optimizer import _default_to_fused_or_foreach

            foreach = _default_to_fused_or_foreach([self.master], differentiable=False, use_fused=False)[1]
        self.foreach = foreach
        self.optimizer = torch.optim.Adam([self.master], lr=lr, foreach=foreach, amsgrad=amsgrad)
        self._pending: list[int] = []
        for u, (_, ps) in enumerate(self.units):
            for p in ps:
                p.register_post_accumulate_grad_hook(partial(self._accumulated, u))

    # --- per-stage hooks -------------------------------------------------------------------------
    def setup(self) -> None:
        """Allocate the flat buffers and point every parameter (and, if persistent, its grad) into them."""
        raise NotImplementedError

    def zero_grads(self) -> None:
        """Before the first micro-step's backward: clear persistent gradient buffers."""

    def unit_grads_ready(self, u: int) -> None:
        """Every gradient of unit ``u`` is accumulated: reduce it (called from autograd hooks)."""
        raise NotImplementedError

    def reduced_grad(self, u: int) -> torch.Tensor:
        """This rank's reduced 16-bit gradients of unit ``u``, laid out like its master slice."""
        raise NotImplementedError

    def publish(self) -> None:
        """After the optimizer step: refresh the 16-bit parameters from the fp32 master."""
        raise NotImplementedError

    def local_params16(self) -> torch.Tensor:
        """This rank's 16-bit parameters laid out like its master (for the parity check only)."""
        raise NotImplementedError

    # --- shared ------------------------------------------------------------------------------------
    @torch.no_grad()
    def local_flat(self, per_unit: list[list[torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
        """The flat tensor this rank keeps of per-unit tensors: all of them at stage 0, its shard after."""
        parts = []
        for lay, tensors in zip(self.layouts, per_unit):
            full = lay.pack(tensors, torch.empty(lay.full_numel, dtype=dtype, device=self.device))
            parts.append(full if self.stage == 0 else lay.owned(full, self.rank).clone())
        return torch.cat(parts)

    def _accumulated(self, u: int, _param: torch.Tensor) -> None:
        self._pending[u] -= 1
        if self._pending[u] == 0:
            self.unit_grads_ready(u)

    @property
    def last_micro_step(self) -> bool:
        """True during the backward of the optimizer step's last micro-step (the accumulation boundary)."""
        return self.micro_step == self.grad_accum - 1

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-step's backward; the first of an optimizer step clears the gradients."""
        if self.micro_step >= self.grad_accum:
            raise RuntimeError(f"backward: all {self.grad_accum} micro-steps ran; call step() first")
        if self.micro_step == 0:
            self.zero_grads()
        self._pending = [len(ps) for _, ps in self.units]
        loss.backward()
        if any(self._pending):
            raise RuntimeError(f"stage {self.stage}: units {self._pending} did not get all their gradients")
        self.micro_step += 1

    def step(self) -> None:
        """Adam on the fp32 master shard, from the reduced 16-bit gradients, then ``publish``."""
        if self.micro_step != self.grad_accum:
            raise RuntimeError(f"step: {self.micro_step} of {self.grad_accum} micro-steps ran")
        self.micro_step = 0
        grad = torch.empty_like(self.master)
        for u, sl in enumerate(self.local_slices):
            grad[sl].copy_(self.reduced_grad(u))
        self.master.grad = grad
        del grad
        self.optimizer.step()
        self.master.grad = None
        with torch.no_grad():
            self.publish()

    def local_reduced_grads(self) -> torch.Tensor:
        """This rank's reduced gradients as one flat fp32 tensor (for the parity check only)."""
        return torch.cat([self.reduced_grad(u).float() for u in range(len(self.units))])
