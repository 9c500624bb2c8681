"""ZeRO-1's reduction after backward (runtime/zero/stage_1_and_2.py ``reduce_gradients``, DeepSpeed 0.19.8), each
bucket ``allreduce_bucket`` flattens (``flat_copy.flattened_copy_numel``): the moments ``stage1_flattened`` lists, per
layout and bucket size (``_FlattenedBuckets``), the rank holding the most at each bucket (``_RankFacts``), and where
every rank is described the first largest of them alone (``stage1_flattened_listed``). Split from
``late_reductions.py``, which re-exports its names."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from functools import lru_cache

from zeroplan.engines.deepspeed.collectives import greedy_buckets
from zeroplan.engines.deepspeed.flat_copy import range_copy_numel
from zeroplan.engines.deepspeed.offload_terms import on_device
from zeroplan.engines.deepspeed.reduce import GIP_SRC, shared_term
from zeroplan.engines.deepspeed.run import DSRun, _act, _bucket, _pbytes, _states, shared_memo
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.engines.deepspeed.terms import FlatGroup
from zeroplan.formulas.peak import Moment, Term, rounded_total


def stage1_flattened(run: DSRun) -> tuple[Moment, ...]:
    """ZeRO-1 reducing after backward, each bucket whose ``allreduce_bucket`` copies (``flattened_copy_numel``):
    the gradients not yet bucketed, the large ones reduced so far (kept) and the bucket's own (alive until sent)
    beside the copy, and a rank's ``grads_in_partition`` once an earlier bucket allocated it (its own first
    bucket's: after the copy is freed, the larger of the two). The rank holding the most, one moment per bucket.
    Found by the differential matrix (seed 3 draw 8, generator 4: Llama 21.8M untied, ZeRO-1, 5.4e6-element
    buckets, accumulation 2, N_d = 4; MemTracker at rank 2's backward peak, in ``allreduce_bucket``: the head's
    8,274,432-element gradient over partitions 2 and 3 copied, the embedding's gradient kept and rank 2's
    grads_in_partition: -3.13% before)."""
    layout = _flattened_buckets(run.flat, run.settings.reduce_bucket_size)
    ranks = None if run.settings.rank is None else (run.settings.rank,)
    base = (*_states(run), *_bucket(run), _act("batch (token ids, targets)", run.acts.batch, 2))
    tails = _flattened_tails(layout, _pbytes(run), DTYPE_BYTES[run.settings.grad_dtype], ranks)
    return tuple([Moment("backward", name, (*base, *tail), rank) for name, tail, rank in tails])


def stage1_flattened_listed(run: DSRun) -> tuple[Moment, ...]:
    """``stage1_flattened`` as the run lists it. Every rank described, its moments (one per copied bucket, ~1,137 in a
    405B run) hold the same ``base`` and differ by their tails: only the first whose tail holds the most is listed
    (``DSRun.first_largest`` over the buckets), by the tails' bytes and again rounded to the peak's block
    (``Settings.block_bytes``), less what ``offload_optimizer`` makes on the host (``on_device``, as
    offload.py ``offload_moments`` leaves it out). ``peak_of`` takes a phase's first largest moment and the
    later additions (``hook_upcasts``' upcast, the resident workspaces) are every such moment's alike, so the peak
    and its moment are those of every bucket's listing (a speed-up, no rule; tests/test_deepspeed_zero12_speedups.py).
    A rank named: every bucket's moment (its allocation trace walks them)."""
    if run.settings.rank is not None:
        return stage1_flattened(run)
    s = run.settings
    layout = _flattened_buckets(run.flat, s.reduce_bucket_size)
    tails = _flattened_tails(layout, _pbytes(run), DTYPE_BYTES[s.grad_dtype], None)
    if not tails:
        return ()
    listed = shared_memo("flattened listed", (tails,), (s.block_bytes, s.offload_optimizer.on), lambda: _first_tails(
        run, tails, s.block_bytes, s.offload_optimizer.on))
    base = (*_states(run), *_bucket(run), _act("batch (token ids, targets)", run.acts.batch, 2))
    return tuple(Moment("backward", tails[k][0], (*base, *tails[k][1]), tails[k][2])  # type: ignore[union-attr]
                 for k in listed)


def _first_tails(run: DSRun, tails: tuple[tuple[str, tuple[Term, ...], int | None], ...], block: int,
                 offloaded: bool) -> tuple[int, ...]:
    """The indices of ``tails`` whose moments ``stage1_flattened_listed`` lists: the first largest at 1 B and at
    ``block`` (``run.first_largest``: every index where a test lists every rank's moment)."""
    kept = [on_device(t) if offloaded else t for _, t, _ in tails]
    ks = tuple(range(len(tails)))
    return tuple(sorted({*run.first_largest(lambda k: rounded_total(kept[k], 1), ks),
                         *run.first_largest(lambda k: rounded_total(kept[k], block), ks)}))


ALIVE_SRC = ("torch autograd (param.grad); stage 1 clears no gradient; copy_grads_in_partition repoints the "
             "partition's (grad_reduc.data = new_grad_tensor.data)")


@lru_cache(maxsize=64)  # every rank's run and each rank's of a candidate, and the candidates of one bucket size
def _flattened_tails(layout: _FlattenedBuckets, p: int, g: int,
                     ranks: tuple[int, ...] | None) -> tuple[tuple[str, tuple[Term, ...], int | None], ...]:
    """``stage1_flattened``'s moments less what every moment of the run holds (states, buckets, the batch): each
    copied bucket's name, its own terms and, every rank described (``ranks`` None), the rank whose terms they are
    (``Moment.rank``; None: every rank holds at least the bucket's copy, and no rank more), for parameters of ``p``
    bytes and gradients of ``g``, of ``ranks`` (None: every rank)."""
    psi, large_before = layout.psi, layout.large_before

    def alive(hi: int, end: int, own: int = 0) -> Term:
        """Before bucket [lo, hi) (parameters first..end) is sent; ``own``: the large gradients of a rank's
        partition reduced before, views of its grads_in_partition, not counted again."""
        return shared_term("autograd gradients not yet bucketed, and the large ones reduced so far (kept)",
                           (psi - hi + large_before[end] - own) * p, ALIVE_SRC)

    facts = _rank_facts(layout, p, ranks)
    if len(facts.ranks) == 1:
        return _one_rank_tails(layout, facts, _bucket_terms(layout, p, g), alive)
    out = []
    for (k, hi, first, end, _), (name, copy, before) in zip(layout.copied, _bucket_terms(layout, p, g)):
        i, own = facts.largest(k, first, copy.bytes)
        if i is None:
            tail = (before, copy)
        elif own is None:  # its first bucket: grads_in_partition allocated once the copy is freed
            tail = (before, facts.gip(i))
        else:
            tail = (alive(hi, end, own) if own else before, facts.gip(i), copy)
        out.append((name, tail, None if i is None or ranks is not None else facts.ranks[i]))
    return tuple(out)


def _one_rank_tails(layout: _FlattenedBuckets, facts: _RankFacts, terms: tuple[tuple[str, Term, Term], ...],
                    alive: Callable[[int, int, int], Term]) -> tuple[tuple[str, tuple[Term, ...], None], ...]:
    """``_flattened_tails`` of one rank's run: ``_RankFacts.largest``'s comparisons for one rank inline, no call per
    bucket (a speed-up, no rule; tests/test_deepspeed_winners.py checks every rank against the per-rank loop)."""
    f, gip_bytes, (a, b), p, large_before = facts.firsts[0], facts.gips[0], facts.ranges[0], facts.p, layout.large_before
    gip, out = facts.gip(0), []
    for (k, hi, first, end, _), (name, copy, before) in zip(layout.copied, terms):
        if k < f or (k == f and gip_bytes <= copy.bytes):  # no partition yet, or the copy the larger
            out.append((name, (before, copy), None))
        elif k == f:  # its first bucket: grads_in_partition allocated once the copy is freed
            out.append((name, (before, gip), None))
        else:
            own = large_before[min(b, first)] - large_before[a] if min(b, first) > a else 0
            out.append((name, (alive(hi, end, own) if own else before, gip, copy) if gip_bytes - own * p > 0
                        else (before, copy), None))  # fmt: skip
    return tuple(out)


@lru_cache(maxsize=16)  # every rank's run of a candidate (``_flattened_tails`` per rank): the same terms
def _bucket_terms(layout: _FlattenedBuckets, p: int, g: int) -> tuple[tuple[str, Term, Term], ...]:
    """Per copied bucket of ``layout`` (``_FlattenedBuckets.copied``): its moment's name, its flattened copy and
    the gradients alive before it is sent (no rank's own large gradients left out), what every rank's tail has."""
    psi, large_before = layout.psi, layout.large_before
    return tuple((f"reduce_gradients: bucket {k} flattened",
                  Term("flattened copy of the bucket's gradients", copy_numel * g,
                       "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))"),
                  Term("autograd gradients not yet bucketed, and the large ones reduced so far (kept)",
                       (psi - hi + large_before[end]) * p, ALIVE_SRC))
                 for k, hi, _, end, copy_numel in layout.copied)  # fmt: skip


class _FlattenedBuckets:
    """``stage1_flattened``'s view of a flat group reducing after backward in buckets of ``limit`` elements, the
    same for every rank and every ZeRO-1 candidate of that bucket size (``_flattened_buckets``): Ψ, the large
    gradients before each parameter (``large_before``), each rank's first bucket (``firsts``, ranks holding a
    parameter) and the buckets ``allreduce_bucket`` copies (``copied``: (k, end offset, first and end parameter,
    elements copied), those copying nothing left out)."""

    def __init__(self, flat: FlatGroup, limit: int) -> None:
        numels, offsets = flat.numels, flat.offsets
        self.flat, self.psi = flat, offsets[-1]
        bucket_ends = tuple(itertools.accumulate(greedy_buckets(numels, limit)))  # parameter order (_stage1_reduce)
        self.large_before = (0, *itertools.accumulate(n if n > limit else 0 for n in numels))
        self.firsts = {r: bisect.bisect_right(bucket_ends, offsets[a])  # the bucket of its first parameter
                       for r, (a, b) in enumerate(flat._ranges) if b > a}  # fmt: skip
        copied, part = [], flat.part
        for k, (lo, hi) in enumerate(zip((0, *bucket_ends[:-1]), bucket_ends)):
            if lo // part == (hi - 1) // part:  # within one partition: one slice, flattened as a view, no copy (a
                continue  # speed-up, no rule: ``range_copy_numel`` is 0 there; most of a 405B layout's small buckets)
            first, end = bisect.bisect_left(offsets, lo), bisect.bisect_left(offsets, hi)
            n = range_copy_numel(part, limit, offsets[first], offsets[end])  # ``copy_numel`` of range(first, end)
            if n:
                copied.append((k, hi, first, end, n))
        self.copied = tuple(copied)


@lru_cache(maxsize=16)  # per layout (``terms.flat_group``, hashed by identity) and bucket size
def _flattened_buckets(flat: FlatGroup, limit: int) -> _FlattenedBuckets:
    return _FlattenedBuckets(flat, limit)


@lru_cache(maxsize=16)  # every rank at once: per layout, bucket size and parameter bytes (one rank: cheap)
def _rank_facts(layout: _FlattenedBuckets, p: int, ranks: tuple[int, ...] | None) -> _RankFacts:
    firsts = layout.firsts if ranks is None else {r: layout.firsts[r] for r in ranks if r in layout.firsts}
    return _RankFacts(layout.flat, firsts, layout.large_before, p)


class _RankFacts:
    """``stage1_flattened``'s choice of the rank holding the most at bucket k, in O(log N_d) a bucket (it was every
    rank's terms built and summed: 12 of 14 s of a 1,024-GPU DeepSpeed plan). The candidates, in the order the
    first largest is kept: no rank's partition; each rank whose first bucket came earlier (its grads_in_partition
    beside the copy, less its own large gradients reduced before, ``own``); each whose first bucket it is (the larger
    of its grads_in_partition and the copy). Ranks are in partition order, so their first buckets and the ends of
    their parameter ranges never decrease: those earlier ranks whose range ends by the bucket's first parameter
    hold all their large gradients (a prefix, its first largest kept in ``_prefix``), the few whose range reaches
    past it are summed one by one. tests/test_deepspeed_winners.py checks it against every candidate built."""

    def __init__(self, flat: FlatGroup, firsts: dict[int, int], large_before: tuple[int, ...], p: int):
        self.p, self.large_before = p, large_before
        # the per-rank lists built in C (map; a speed-up, no rule), the prefix maximum in one pass
        self.ranks, self.firsts = list(firsts), list(firsts.values())
        self.ranges = list(map(flat._ranges.__getitem__, self.ranks))  # ``flat.range`` of each
        self.ends = [b for _, b in self.ranges]
        self.gips = [n * p for n in map(flat._params_numels.__getitem__, self.ranks)]
        assert self.firsts == sorted(self.firsts) and self.ends == sorted(self.ends), "ranks in partition order"
        self._prefix: list[tuple[int, int]] = []  # (value, index) of the first largest of ranks[:i + 1]
        prefix, top = self._prefix, None
        for i, ((a, b), gip) in enumerate(zip(self.ranges, self.gips)):
            value = gip - (large_before[b] - large_before[a]) * p
            if top is None or value > top[0]:
                top = (value, i)
            prefix.append(top)

    def own(self, i: int, first: int) -> int:
        a, b = self.ranges[i]
        return self.large_before[min(b, first)] - self.large_before[a] if min(b, first) > a else 0

    def gip(self, i: int) -> Term:
        """Rank i's ``grads_in_partition``, one term per bytes (``shared_term``; a speed-up, no rule: one per bucket)."""
        return shared_term("grads_in_partition", self.gips[i], GIP_SRC)

    def largest(self, k: int, first: int, copy: int) -> tuple[int | None, int | None]:
        """(index, own) of the option holding the most at bucket k, the first largest in the candidates' order:
        (None, None) no rank's; (i, own) an earlier first bucket; (i, None) its first bucket."""
        n1, n2 = bisect.bisect_left(self.firsts, k), bisect.bisect_right(self.firsts, k)
        best, choice = copy, (None, None)  # the totals less what every option has (states, buckets, alive)
        m = min(n1, bisect.bisect_right(self.ends, first))
        if m:
            value, i = self._prefix[m - 1]
            if value + copy > best:
                best, choice = value + copy, (i, self.own(i, first))
        for i in range(m, n1):
            own = self.own(i, first)
            if self.gips[i] - own * self.p + copy > best:
                best, choice = self.gips[i] - own * self.p + copy, (i, own)
        for i in range(n1, n2):
            if max(self.gips[i], copy) > best:
                best, choice = max(self.gips[i], copy), (i, None)
        return choice
