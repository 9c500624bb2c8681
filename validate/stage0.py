"""Stage 0, plain data parallelism (DDP): every rank holds every model state."""

from __future__ import annotations

import torch

from validate.collectives import all_reduce_mean
from validate.runtime import Runtime


class Stage0(Runtime):
    """Replicated parameters, gradients and optimizer states; gradients all-reduced during backward.

    Schedule per step:
    - forward: nothing communicated;
    - backward: gradients accumulate straight into one flat unpadded buffer (DDP's
      ``gradient_as_bucket_view``); when the units from ``u`` to the last are done, unit ``u``'s slice
      (its bucket) is all-reduced. The buckets together cover the buffer exactly once, so the elements
      all-reduced per step are Ψ, as ``zeroplan.formulas.collectives`` predicts (the validator compares elements);
    - optimizer step: Adam on the full fp32 master, copied into the 16-bit parameters; nothing sent.
    Gradient accumulation (G micro-steps): every micro-step's gradients add into the buffer, and only the
    last micro-step's backward all-reduces it (DDP's ``no_sync`` on the others), so Ψ elements per
    optimizer step whatever G.
    """

    stage = 0

    def setup(self) -> None:
        total = sum(lay.full_numel for lay in self.layouts)
        self.flat_param = torch.empty(total, dtype=self.dtype, device=self.device)
        self.flat_grad = torch.zeros(total, dtype=self.dtype, device=self.device)
        for sl, lay, (_, ps) in zip(self.local_slices, self.layouts, self.units):
            lay.pack(ps, self.flat_param[sl])
            for p, pv, gv in zip(ps, lay.views(self.flat_param[sl]), lay.views(self.flat_grad[sl])):
                p.data = pv
                p.grad = gv
        self.buckets = list(self.local_slices)
        self._next_bucket = len(self.buckets) - 1
        self._done = [False] * len(self.units)

    def zero_grads(self) -> None:
        self.flat_grad.zero_()
        self._done = [False] * len(self.units)
        self._next_bucket = len(self.buckets) - 1

    def unit_grads_ready(self, u: int) -> None:
        if not self.last_micro_step:  # accumulating: the buffer is reduced at the boundary only
            return
        self._done[u] = True
        while self._next_bucket >= 0 and self._done[self._next_bucket]:
            bucket = self.buckets[self._next_bucket]
            if bucket.stop > bucket.start:
                all_reduce_mean(self.flat_grad[bucket], self.nd, self.grad_accum)
            self._next_bucket -= 1

    def reduced_grad(self, u: int) -> torch.Tensor:
        return self.flat_grad[self.local_slices[u]]

    def publish(self) -> None:
        self.flat_param.copy_(self.master)

    def local_params16(self) -> torch.Tensor:
        return self.flat_param
