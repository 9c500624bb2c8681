"""Stage 3, P_os+g+p: parameters, gradients and optimizer states all sharded (FSDP FULL_SHARD)."""

from __future__ import annotations

import torch

from validate.collectives import all_gather
from validate.stage2 import Stage2


class Stage3(Stage2):
    """Only shards persist; each unit's full 16-bit parameters exist only while the unit computes.

    Schedule per step:
    - forward: before a unit runs (the root before the model, each block before itself) its parameters
      are all-gathered into the unit's full flat buffer; after it runs the buffer's storage is resized to
      zero. Parameters are views of that buffer, so tensors saved for backward point at the same storage;
    - backward: a hook on the unit's forward output all-gathers the parameters again before the unit's
      backward; gradients are packed, reduce-scattered into the persistent gradient shard and freed as in
      stage 2, and then the full parameters are freed;
    - optimizer step: Adam on the shard, copied into the 16-bit parameter shard; nothing sent.
    Gradient accumulation (G micro-steps): every micro-step gathers in forward and backward and
    reduce-scatters into the shard as stage 2 does (DeepSpeed ZeRO-3): 3G passes per optimizer step.
    Under activation checkpointing a block's recompute (in backward) finds the unit gathered already and
    leaves it gathered. The root (embeddings, final norm, tied LM head) stays gathered through the whole backward, since the
    token embedding gets its gradient last; FSDP's root unit behaves the same way.
    """

    stage = 3

    def setup(self) -> None:
        self.param_shard = self.local_flat([ps for _, ps in self.units], self.dtype)
        self.unit_full = []
        for lay, (module, ps) in zip(self.layouts, self.units):
            full = torch.empty(lay.full_numel, dtype=self.dtype, device=self.device)
            for p, view in zip(ps, lay.views(full)):
                p.data = view
            self.unit_full.append(full)
        for u in range(len(self.units)):
            self._free(u)
        self.setup_grads([])
        for u, (module, _) in enumerate(self.units):
            target = self.model if module is None else module
            target.register_forward_pre_hook(lambda *_, u=u: self._gather(u))
            target.register_forward_hook(lambda _m, _i, out, u=u: self._after_forward(u, out))

    def _gather(self, u: int) -> None:
        full = self.unit_full[u]
        if full.untyped_storage().nbytes():  # already gathered: a checkpointed block recomputing
            return
        full.untyped_storage().resize_(full.numel() * full.element_size())
        # The all-gather writes in place into storage that autograd saved; it restores exactly the
        # values saved, so the version counter is kept (FSDP2 does the same).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
            all_gather(full, self.param_shard[self.local_slices[u]], self.nd)

    def _free(self, u: int) -> None:
        self.unit_full[u].untyped_storage().resize_(0)

    def _after_forward(self, u: int, out: torch.Tensor) -> None:
        if torch._C._current_graph_task_id() != -1:  # a checkpointed block's recompute, inside backward:
            return  # the unit stays gathered for its backward and is freed once its gradients are reduced
        self._free(u)
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda _grad: self._gather(u))

    def unit_grads_ready(self, u: int) -> None:
        super().unit_grads_ready(u)
        self._free(u)

    def publish(self) -> None:
        self.param_shard.copy_(self.master)

    def local_params16(self) -> torch.Tensor:
        return self.param_shard
