"""ZeRO-1/2's sparse (mixture-of-experts) hook reductions: which rank holds the most (moe12_hooks.py
``_rank_holding_most``, ``_gate_up_backward``), from integer sums, so that only the winner's terms are built. Each a
speed-up, no rule (issue 16's plan speed: DeepSeek-V3 on 1,024 GPUs built ~240,000 options per plan); checked against
the loops they replaced in tests/test_deepspeed_moe12_winner.py."""

from __future__ import annotations

from typing import Optional

from zeroplan.engines.deepspeed.run import DSRun, _pbytes, memo_of
from zeroplan.formulas.peak import Term


def _winner_without_kept(run: DSRun, firsts: dict[int, int], c: int, b: int) -> Optional[int]:
    """``_rank_holding_most``'s rank without ZeRO-1's kept gradients (None: the copy alone holds the most): of the
    ranks whose first bucket went earlier the one with the largest partition (its option: the partition + the copy),
    of those whose first bucket is b the largest partition if larger than the copy (the larger of the two), the
    first in rank order on a tie, the copy first of all. Each first bucket's largest partition and their running
    best once per run, so a bucket asks two entries, not every rank. A speed-up, no rule
    (tests/test_deepspeed_moe12_winner.py)."""
    groups, before = _partitions_by_first(run, firsts)
    best, pos, winner = c, -1, None
    lt, eq = before[min(b, len(before) - 1)], groups.get(b)
    for option, total in ((lt, lt and lt[0] + c), (eq, eq and max(eq[0], c))):
        if option and (total > best or (total == best and option[1] < pos)):
            best, pos, winner = total, option[1], option[2]
    return winner


def _partitions_by_first(run: DSRun, firsts: dict[int, int]) -> tuple[dict, list]:
    """``_by_first_bucket`` once per run (``firsts`` is the run's own: ``sparse_hook_partitions``)."""
    return memo_of(run, "sparse hook partitions by first bucket", lambda r: _by_first_bucket(r, firsts))  # type: ignore


def _by_first_bucket(run: DSRun, firsts: dict[int, int]) -> tuple[dict, list]:
    """First bucket -> (partition bytes, position, rank) of its ranks' largest partition (the first on a tie), and
    for each bucket b that of the ranks whose first bucket is before b (``_winner_without_kept``)."""
    p, numels, groups = _pbytes(run), run.flat._params_numels, {}  # every rank's ``params_numel``, the layout's tuple
    for pos, (r, first) in enumerate(firsts.items()):
        gip, g = numels[r] * p, groups.get(first)
        if g is None or gip > g[0]:
            groups[first] = (gip, pos, r)
    before = [None]
    for v in range(max(groups, default=-1) + 1):
        g, best = groups.get(v), before[-1]
        before.append(best if g is None or (best is not None and (best[0], -best[1]) >= (g[0], -g[1])) else g)
    return groups, before


def _kept_bytes_of(run: DSRun, kept: dict[int, tuple[Term, ...]], j: int, b: int, order: tuple[int, ...],
                   first_of_bucket: list[int]):
    """``rank`` -> the bytes of ``_stage1_kept``'s one term (0 where ``kept`` is empty), block j's gradients larger
    than the bucket listed once for every rank. A speed-up, no rule."""
    if not kept:
        return lambda rank: 0
    limit, blocks, numels = run.settings.reduce_bucket_size, run.param_blocks, run.numels
    large = [(i, numels[i]) for i in order[:first_of_bucket[b]] if blocks[i] == j and numels[i] > limit]
    total, p, ranges = sum(n for _, n in large), _pbytes(run), run.flat.range
    if not large:
        return lambda rank: kept[rank][j].bytes

    def kept_bytes(rank: int) -> int:
        lo, hi = ranges(rank)
        return (total - sum(n for i, n in large if lo <= i < hi)) * p + kept[rank][j].bytes
    return kept_bytes
