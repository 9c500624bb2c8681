"""Stage 2, P_os+g: optimizer states and gradients sharded; parameters replicated."""

from __future__ import annotations

import torch

from validate.collectives import reduce_scatter_mean
from validate.stage1 import Stage1


class Stage2(Stage1):
    """Full padded 16-bit parameters; 16-bit gradient shard, fp32 master and Adam m, v on the shard.

    Schedule per step:
    - forward: nothing communicated;
    - backward: autograd allocates each parameter's gradient; when a unit's gradients are all in they are
      packed into one temporary padded flat buffer, reduce-scattered into this rank's persistent gradient
      shard and freed, so at most about one unit of full gradients is alive at a time (ZeRO section 5.2);
    - optimizer step: as stage 1: Adam on the shard, then each unit all-gathered in place.
    Gradient accumulation (G micro-steps): every micro-step reduce-scatters as above (DeepSpeed ZeRO-2
    reduces each micro-batch's gradients as backward produces them; the full gradient never persists).
    The first micro-step writes the shard; each later one reduce-scatters into a temporary of the unit's
    shard size and adds it into the shard. Per optimizer step: G reduce-scatters, one all-gather.
    """

    stage = 2

    def setup_grads(self, fulls: list[slice]) -> None:
        self.grad_shard = torch.zeros(self.local_slices[-1].stop, dtype=self.dtype, device=self.device)

    def zero_grads(self) -> None:
        """Nothing to clear: every reduce-scatter overwrites its whole slice of the shard."""

    def unit_grads_ready(self, u: int) -> None:
        lay, ps = self.layouts[u], self.units[u][1]
        full = lay.pack(
            [p.grad for p in ps], torch.empty(lay.full_numel, dtype=self.dtype, device=self.device)
        )
        for p in ps:
            p.grad = None
        shard = self.grad_shard[self.local_slices[u]]
        if self.micro_step == 0:
            reduce_scatter_mean(shard, full, self.nd, self.grad_accum)
            return
        mean = torch.empty(lay.shard_numel, dtype=self.dtype, device=self.device)
        reduce_scatter_mean(mean, full, self.nd, self.grad_accum)
        del full  # the pack buffer goes before the sum, as at the first micro-step
        shard.add_(mean)

    def reduced_grad(self, u: int) -> torch.Tensor:
        return self.grad_shard[self.local_slices[u]]
