"""Stage 1, P_os: optimizer states sharded; parameters and gradients replicated (DeepSpeed stage 1)."""

from __future__ import annotations

import torch

from validate.collectives import all_gather, reduce_scatter_mean
from validate.flat import slices
from validate.runtime import Runtime


class Stage1(Runtime):
    """Full padded 16-bit parameters and gradients on every rank; fp32 master and Adam m, v on the shard.

    Schedule per step:
    - forward: nothing communicated;
    - backward: gradients accumulate straight into the persistent full flat gradient buffer; as soon as a
      unit's gradients are all in, the unit is reduce-scattered and the mean lands in this rank's slice;
    - optimizer step: Adam updates the master shard, which is written into this rank's slice of the 16-bit
      parameters, and each unit is all-gathered in place.
    Gradient accumulation (G micro-steps): gradients add into the full buffer and only the last
    micro-step's backward reduce-scatters it (DeepSpeed stage 1 reduces at the accumulation boundary), so
    one reduce-scatter and one all-gather per optimizer step whatever G.
    """

    stage = 1

    def setup(self) -> None:
        fulls = slices([lay.full_numel for lay in self.layouts])
        total = fulls[-1].stop
        self.flat_param = torch.empty(total, dtype=self.dtype, device=self.device)
        self.unit_params = [self.flat_param[sl] for sl in fulls]
        for lay, flat, (_, ps) in zip(self.layouts, self.unit_params, self.units):
            lay.pack(ps, flat)
            for p, view in zip(ps, lay.views(flat)):
                p.data = view
        self.setup_grads(fulls)

    def setup_grads(self, fulls: list[slice]) -> None:
        self.flat_grad = torch.zeros(fulls[-1].stop, dtype=self.dtype, device=self.device)
        self.unit_grads = [self.flat_grad[sl] for sl in fulls]
        for lay, flat, (_, ps) in zip(self.layouts, self.unit_grads, self.units):
            for p, view in zip(ps, lay.views(flat)):
                p.grad = view

    def zero_grads(self) -> None:
        self.flat_grad.zero_()

    def unit_grads_ready(self, u: int) -> None:
        if not self.last_micro_step:  # accumulating: the buffer is reduced at the boundary only
            return
        lay = self.layouts[u]
        mean = torch.empty(lay.shard_numel, dtype=self.dtype, device=self.device)
        reduce_scatter_mean(mean, self.unit_grads[u], self.nd, self.grad_accum)
        lay.owned(self.unit_grads[u], self.rank).copy_(mean)

    def reduced_grad(self, u: int) -> torch.Tensor:
        return self.layouts[u].owned(self.unit_grads[u], self.rank)

    def local_params16(self) -> torch.Tensor:
        return torch.cat([lay.owned(flat, self.rank) for lay, flat in zip(self.layouts, self.unit_params)])

    def publish(self) -> None:
        for lay, flat, sl in zip(self.layouts, self.unit_params, self.local_slices):
            mine = lay.owned(flat, self.rank)
            mine.copy_(self.master[sl])
            all_gather(flat, mine, self.nd)
