"""The one sharding rule, shared by the planner and the reference runtime (``validate/``).

Every sharded tensor is padded to a multiple of N_d and split evenly, so rank r owns elements
``[r * shard, (r + 1) * shard)`` of the padded tensor, with ``shard = ceil(numel / nd)``. This is
how FSDP pads a flat parameter and DeepSpeed pads its flat partitions; padding adds fewer than
N_d elements per tensor and never drops one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from functools import lru_cache
from typing import Optional


def ceil_div(n: int, d: int) -> int:
    """ceil(n / d) in exact integer arithmetic (also on numpy integer arrays); the one ceiling division."""
    return -(-n // d)


def shard_numel(numel: int, nd: int) -> int:
    """Elements each of ``nd`` ranks owns of a tensor of ``numel`` elements: ceil(numel / nd).

    Also takes integer numpy arrays (``zeroplan.sweep`` evaluates a whole grid in one call); their values
    are checked where the grid is built, so only scalars are checked here.
    """
    if getattr(numel, "ndim", 0) == 0 and getattr(nd, "ndim", 0) == 0 and (numel < 0 or nd < 1):
        raise ValueError(f"numel={numel}, nd={nd}: need numel >= 0 and nd >= 1")
    return ceil_div(numel, nd)


def padded_numel(numel: int, nd: int) -> int:
    """Length of the tensor once padded to a multiple of ``nd``."""
    return shard_numel(numel, nd) * nd


def flat_shard_numel(numels: Iterable[int], nd: int) -> int:
    """Elements a rank owns of a flat buffer whose tensors are each padded to a multiple of ``nd``.

    A long tuple of scalars (a real model's tensor sizes, asked at many N_d by the planner's searches) is
    summed over its distinct sizes, each counted once (``_size_counts``): the same sum, ~100x fewer calls."""
    if isinstance(numels, tuple) and len(numels) > 16 and isinstance(nd, int) and nd >= 1:
        counts = _size_counts(numels)
        if counts is not None:
            return sum(count * ceil_div(n, nd) for n, count in counts)
    return sum(shard_numel(n, nd) for n in numels)


@lru_cache(maxsize=64)
def _size_counts(numels: tuple) -> Optional[tuple[tuple[int, int], ...]]:
    """(size, how many tensors have it) of ``numels``; None where a size is not a non-negative int (the
    general path then checks and refuses it)."""
    if not all(type(n) is int and n >= 0 for n in numels):
        return None
    return tuple(Counter(numels).items())


def flat_padded_numel(numels: Iterable[int], nd: int) -> int:
    """Length of a flat buffer whose tensors are each padded to a multiple of ``nd``."""
    return flat_shard_numel(numels, nd) * nd
