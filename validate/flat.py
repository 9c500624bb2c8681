"""Flat buffers with per-parameter views, laid out by the planner's own padding rule.

Each unit's tensors sit end to end in one flat buffer; from stage 1 on every tensor is padded to a
multiple of N_d with ``zeroplan.formulas.sharding.padded_numel``, so the unit's length is
``zeroplan.formulas.sharding.flat_padded_numel`` and each rank owns ``flat_shard_numel`` elements of it. Because
every tensor is padded, the per-unit shards add up to exactly the planner's per-rank shard of the whole
model, whatever the grouping into units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zeroplan.formulas.sharding import flat_padded_numel, flat_shard_numel, padded_numel


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a unit lives in its flat buffer. ``align`` = N_d (sharded) or 1 (stage 0)."""

    shapes: tuple[tuple[int, ...], ...]
    nd: int
    align: int

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += padded_numel(n, self.align)
        return tuple(out)

    @property
    def full_numel(self) -> int:
        """Length of the flat buffer: ``flat_padded_numel`` when sharded, the bare sum at stage 0."""
        return flat_padded_numel(self.numels, self.align)

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns; only meaningful when ``align == nd``."""
        return flat_shard_numel(self.numels, self.nd)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per tensor, shaped like the parameter, into ``flat`` (no copy)."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def owned(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """The slice of a full flat buffer that ``rank`` owns."""
        return flat[rank * self.shard_numel : (rank + 1) * self.shard_numel]

    def pack(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy ``tensors`` into ``out`` at their offsets; padding is zeroed."""
        out.zero_()
        for view, t in zip(self.views(out), tensors):
            view.copy_(t)
        return out


def slices(sizes: list[int]) -> list[slice]:
    """Consecutive slices of the given lengths: how unit shards sit in one per-rank flat buffer."""
    out, at = [], 0
    for n in sizes:
        out.append(slice(at, at + n))
        at += n
    return out
