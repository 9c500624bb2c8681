"""ZeRO-1's walk after backward under ``cpu_offload``, every rank at once (``stage1_offload_walk``; dense and MoE).

The walk (stage_1_and_2.py ``reduce_gradients``: every parameter in order ->
``reduce_independent_p_g_buckets_and_remove_grads``) is the same on every rank except for which parameters overlap
the rank's partition. A gradient larger than the bucket is first cloned (``_offload_gradient_safety_enabled``: the
original and the clone alive together) and reduced alone at the next call (``extra_large_param_to_reduce``); a
smaller one is copied into the bucket. At each reduction (``reduce_ipg_grads`` -> ``copy_grads_in_partition``)
every parameter of the bucket overlapping the rank's partition has its slice copied to fp64 for its norm
(``set_norm_for_param_grad_in_gpu``) and its gradient cleared (``clear_grad_attribute``); a larger-than-bucket
gradient outside the partition is kept (stage 1 clears none).

A moment is (gradient elements alive, fp64 norm copy elements, parameter, 1 at a clone else 0); a rank's peak is
the first largest of its moments in walk order, weighed as ``alive·g + 8·norm``. Replayed rank by rank the walk
costs O(parameters) per rank (5.4 s for the 1,024 ranks of a llama3-405b plan); here the rank-independent events
are built once and each rank reads: the clone moments before its partition (a prefix maximum), its own
partition's events in order, and the clone moments after it (a suffix maximum, less the larger-than-bucket
gradients its partition cleared). Equal to the rank-by-rank walk on random layouts
(tests/test_deepspeed_offload_walk.py, which keeps that walk as the reference)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from functools import lru_cache

from zeroplan.engines.deepspeed.run import DSRun, _act, _bucket, _states
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES, Settings
from zeroplan.formulas.peak import Moment as PeakMoment, Term

SRC = "runtime/zero/stage_1_and_2.py"

WalkMoment = tuple[int, int, int, int]
NONE: WalkMoment = (0, 0, -1, 0)


def _slice(offsets: Sequence[int], part: int, i: int, rank: int) -> int:
    """Elements of parameter ``i`` in ``rank``'s slice of the flat group (``grad_position``'s ``num_elements``)."""
    return max(0, min(offsets[i + 1], (rank + 1) * part) - max(offsets[i], rank * part))


def _walk_events(numels: Sequence[int], bucket: int) -> tuple[list[tuple], dict[int, int], dict[int, int], list[int]]:
    """The rank-independent events, in walk order: ("clone", k, alive without kept) and ("flush", group,
    remaining); each parameter's clone event and its group's flush event (indices); per event the
    larger-than-bucket gradients of groups flushed before it."""
    events: list[tuple] = []
    clone_at: dict[int, int] = {}  # parameter -> its clone event's index
    flush_of: dict[int, int] = {}  # parameter -> its group's flush event's index
    large_before: list[int] = []  # per event: larger-than-bucket gradients of groups flushed before it
    remaining, elements, flushed_large = sum(numels), 0, 0
    pending: list[int] = []

    def flush() -> None:
        nonlocal flushed_large
        events.append(("flush", tuple(pending), remaining))
        large_before.append(flushed_large)
        for q in pending:
            flush_of[q] = len(events) - 1
            if numels[q] > bucket:
                flushed_large += numels[q]
        pending.clear()

    for k, n in enumerate(numels):
        if n == 0:
            continue
        if elements + n > bucket:
            flush()
            elements = 0
        remaining -= n
        if n > bucket:
            clone_at[k] = len(events)
            events.append(("clone", k, remaining + 2 * n))
            large_before.append(flushed_large)
        pending.append(k)
        elements += n
    flush()
    return events, clone_at, flush_of, large_before


def _clone_maxima(events: list[tuple], large_before: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The clone events (indices), each one's alive with nothing of it cleared, and the first maximum of those
    up to each (prefix) and from each on (suffix), as indices into the clone events."""
    clones = [i for i, e in enumerate(events) if e[0] == "clone"]
    values = [events[i][2] + large_before[i] for i in clones]  # a clone moment's alive with nothing of it cleared
    prefix: list[int] = []  # index into clones of the first maximum of clones[:j+1]
    for j, v in enumerate(values):
        prefix.append(j if not prefix or v > values[prefix[-1]] else prefix[-1])
    suffix = [0] * len(values)  # index of the first maximum of clones[j:]
    for j in range(len(values) - 1, -1, -1):
        suffix[j] = j if j == len(values) - 1 or values[j] >= values[suffix[j + 1]] else suffix[j + 1]
    return clones, values, prefix, suffix


@lru_cache(maxsize=8)  # read only: a candidate's every-rank run and its named ranks' walk the same events
def _walk_facts(numels: tuple[int, ...], bucket: int) -> tuple:
    """``_walk_events`` and their ``_clone_maxima``, once per parameter sizes and bucket."""
    events, clone_at, flush_of, large_before = _walk_events(numels, bucket)
    # per flush event, its group's larger-than-bucket gradients (the clones alive at its first reduction)
    group_large = [sum(numels[q] for q in e[1] if numels[q] > bucket) if e[0] == "flush" else 0 for e in events]
    return events, clone_at, flush_of, large_before, _clone_maxima(events, large_before), group_large


def walk_peaks(numels: Sequence[int], offsets: Sequence[int], part: int, bucket: int, g: int,
               ranks: Iterable[int]) -> dict[int, WalkMoment]:
    """Each rank's largest moment of the walk (module docstring); ``NONE`` where it has none. A moment ``m`` weighs
    ``m[0]·g + 8·m[1]``; the best's weight is kept beside it and each slice computed inline (a speed-up, no rule)."""
    events, clone_at, flush_of, large_before, (clones, values, prefix, suffix), group_large = _walk_facts(
        tuple(numels), bucket)
    out: dict[int, WalkMoment] = {}
    n, psi, last_nonzero = len(numels), offsets[-1], None
    for rank in ranks:
        lo_off, hi_off = rank * part, (rank + 1) * part
        best, best_w = NONE, 0  # NONE weighs 0
        if lo_off >= psi:  # a partition of padding only: every clone moment with nothing of it cleared
            if clones and values[prefix[-1]] * g > 0:
                best = (values[prefix[-1]], 0, events[clones[prefix[-1]]][1], 1)
            out[rank] = best
            continue
        # the first and last parameters whose ``_slice`` is not empty: the one holding lo_off (offsets[a] <= lo_off <
        # offsets[a + 1]) and the one holding hi_off - 1 (the last non-empty where the partition passes Ψ), found by
        # bisection rather than a pass over the partition's parameters (a speed-up, no rule)
        a, b = bisect_right(offsets, lo_off) - 1, bisect_left(offsets, hi_off) - 1
        if b >= n:  # past Ψ (the last rank's): the last non-empty parameter, found once
            if last_nonzero is None:
                last_nonzero = max((i for i in range(n) if numels[i]), default=-1)
            b = last_nonzero
        lo = clone_at[a] if a in clone_at else flush_of[a]
        hi = flush_of[b]
        before = bisect_left(clones, lo)  # clone moments before the partition's first event
        if before:
            j = prefix[before - 1]
            if values[j] * g > best_w:
                best, best_w = (values[j], 0, events[clones[j]][1], 1), values[j] * g
        cleared = 0  # larger-than-bucket gradients of the partition reduced (cleared) so far
        for i in range(lo, hi + 1):
            e = events[i]
            kept = large_before[i] - cleared
            if e[0] == "clone":
                if (e[2] + kept) * g > best_w:
                    best, best_w = (e[2] + kept, 0, e[1], 1), (e[2] + kept) * g
                continue
            group, rem, clone = e[1], e[2], group_large[i]
            for q in group:
                q_lo, q_hi = offsets[q], offsets[q + 1]  # ``_slice(offsets, part, q, rank)``, without builtins' calls
                s = (q_hi if q_hi < hi_off else hi_off) - (q_lo if q_lo > lo_off else lo_off)
                if s > 0:
                    w = (rem + clone + kept) * g + 8 * s
                    if w > best_w:
                        best, best_w = (rem + clone + kept, s, q, 0), w
                    if numels[q] > bucket:
                        clone -= numels[q]
                        cleared += numels[q]
                elif numels[q] > bucket:
                    kept += numels[q]
                    clone -= numels[q]
        after = bisect_right(clones, hi)  # clone moments after the partition's last event
        if after < len(clones):
            j = suffix[after]
            if (values[j] - cleared) * g > best_w:
                best = (values[j] - cleared, 0, events[clones[j]][1], 1)
        out[rank] = best
    return out


WALK = "reduce_gradients with offload_optimizer"
"""The moments of ``stage1_offload_walk`` (their names start with it)."""


def offload_walk_applies(s: Settings, psi: int) -> bool:
    """Whether ``stage1_offload_walk`` gives the rank's copies to the host, asked of ``DeepSpeedZeroOptimizer``'s
    settings (its callers: the ZeRO-1/2 wrapper's offload, offload_wrappers.py, and moe_offload.py's ZeRO-1/2 limit):
    ZeRO-1 (no ``partition_gradients``), ``offload_optimizer``, no ``overlap_comm`` (the walk after backward
    reduces), ``contiguous_gradients`` and more than one bucket."""
    return (not s.partition_gradients and s.offload_optimizer.on and not s.overlaps and s.contiguous_gradients
            and s.reduce_bucket_size < psi)


def stage1_offload_walk(run: DSRun) -> tuple[PeakMoment, ...]:
    """ZeRO-1 with ``offload_optimizer`` and gradients in more than one bucket (``reduce_bucket_size`` < Ψ, no
    ``overlap_comm``): each described rank's largest moment of the walk after backward
    (``walk_peaks``) beside the model states, the buckets and the micro-batch. Measured: moe_offload.py's
    docstring."""
    s = run.settings
    if not offload_walk_applies(s, sum(run.numels)):
        return ()
    g, block = DTYPE_BYTES[s.dtype], s.block_bytes  # the peak's block (``profile.device_terms``)
    out = []
    peaks = walk_peaks(run.numels, run.flat.offsets, run.flat.part, s.reduce_bucket_size, g, run.ranks)

    # each rank's two terms rounded as ``peak_of`` rounds them (the rest is alike), every rank in one pass
    own_blocks = {r: -(held * g // -block) + -(8 * norm // -block) for r, (held, norm, _, _) in peaks.items()}
    # every rank described: only the first whose moment holds the most (``DSRun.first_largest``; a speed-up, no rule)
    for rank in run.first_largest(own_blocks.__getitem__, tuple([r for r in run.ranks if peaks[r][2] >= 0])):
        held, norm, k, clone = peaks[rank]
        what = "cloned (larger than the bucket)" if clone else "its slice's fp64 norm copy"
        out.append(PeakMoment("backward", f"{WALK}: rank {rank}, parameter {k} {what}", (
            *_states(run), *_bucket(run),
            Term("gradients alive in the walk (not yet reduced, the clone, those kept outside the partition)",
                 held * g, f"torch autograd (param.grad); {SRC} reduce_independent_p_g_buckets_and_remove_grads "
                 "(clone under _offload_gradient_safety_enabled), clear_grad_attribute"),
            *((Term("fp64 norm copy of the rank's slice", 8 * norm,
                    f"{SRC} set_norm_for_param_grad_in_gpu (.to(get_norm_dtype()))"),) if norm else ()),
            _act("batch (token ids, targets)", run.acts.batch, 2))))  # fmt: skip
    return tuple(out)
