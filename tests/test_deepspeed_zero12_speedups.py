"""Issue 16's plan speed, ZeRO-1/2 and offload (2026-12-03, z12first): each speed-up against the plain computation it
replaced (kept here as the reference), on transformers' families at several N_d, bucket sizes and dtypes, with and
without offload_optimizer, every rank at once and each rank named, on cuda (512-B blocks) and cpu. Speed-ups, no rule:
every moment, peak and named term must be the plain one's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import zeroplan.engines.deepspeed.late_reductions as LR
import zeroplan.engines.deepspeed.run as run_module
from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines import deepspeed as D
from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed.offload_settings import OffloadTarget
from zeroplan.engines.deepspeed.offload_terms import HOST_TEMPORARIES, on_device
from zeroplan.formulas.peak import peak_of

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"


def _workload(model: str, grad_accum: int = 1) -> Workload:
    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    return Workload(transformer_shapes(spec), spec, 16, 2, grad_accum=grad_accum, transformers=True)


def _settings(stage: int, bucket: int, dtype: str = "bf16", device: str = "cuda", offload: bool = False,
              rank: int | None = None, overlap: bool | None = None) -> D.Settings:
    return D.Settings(stage=stage, reduce_bucket_size=bucket, allgather_bucket_size=bucket, dtype=dtype, device=device,
                      rank=rank, overlap_comm=overlap,
                      **({"offload_optimizer": OffloadTarget(device="cpu")} if offload else {}))  # fmt: skip


def _draws(seed: int, count: int):
    """(model, N_d, settings) drawn at random: ZeRO-1 (after backward, and from its hooks), ZeRO-2 and ZeRO-3 with and
    without offload_optimizer, buckets from 1,000 to 200,000 elements, three dtypes, cuda and cpu, a rank named or not."""
    rng = random.Random(seed)
    models = ("tiny-llama", "tiny-gpt2", "tiny-gpt2-untied", "tiny-mistral", "tiny-qwen2", "tiny-qwen3")
    for _ in range(count):
        nd = rng.choice((2, 3, 4, 5, 7, 8, 16, 33))
        stage = rng.choice((1, 1, 1, 2, 3))
        s = _settings(stage, rng.choice((1_000, 2_000, 5_000, 20_000, 200_000)), rng.choice(("bf16", "fp16", "fp32")),
                      rng.choice(("cuda", "cpu")), rng.random() < 0.5, rng.choice((None, None, rng.randrange(nd))),
                      rng.choice((None, True)) if stage == 1 else None)  # fmt: skip
        yield rng.choice(models), nd, s


def _plain_on_device(terms):
    """offload.py ``offload_moments``' filter as it was: every term's name tested against ``HOST_TEMPORARIES``."""
    return tuple(t for t in terms if not (t.name.startswith(HOST_TEMPORARIES) or t.name.endswith(" temporaries")))


@pytest.mark.parametrize("seed", range(3))
def test_on_device_equals_the_per_term_filter(seed):
    """``offload_terms.on_device`` (each name tested once) leaves out the terms the per-term filter left out, and returns
    the very tuple where it leaves none out, on every moment of random runs (their terms before offload's filter)."""
    from zeroplan.engines.deepspeed.phases import backward_moments, forward_moments, init_moments, optimizer_moments

    dropped = checked = 0
    for model, nd, s in _draws(seed, 30):
        run = D.ds_run(s, _workload(model), nd)
        for m in (*init_moments(run), *forward_moments(run), *backward_moments(run), *optimizer_moments(run)):
            want, got = _plain_on_device(m.terms), on_device(m.terms)
            assert got == want
            assert (got is m.terms) == (len(want) == len(m.terms))
            dropped += len(want) < len(m.terms)
            checked += 1
    assert dropped and checked > 400, "no term left out: the filter is not tested"


FAMILIES = (("reduce_gradients: bucket", "flattened_buckets.stage1_flattened_listed", "stage1_flattened"),
            ("later blocks' gradients held", "phases.later_blocks_held", None))
"""ZeRO-1's every-rank families listed first largest only: (a name part of their moments, the function, the plain
listing's name in ``late_reductions``; None: ``later_blocks_held`` without ``bound``)."""


@pytest.mark.parametrize("seed", range(4))
def test_every_rank_families_listed_first_largest_keep_the_peak(monkeypatch, seed):
    """ZeRO-1 reducing after backward, every rank described: ``stage1_flattened_listed`` lists the first largest
    bucket moment and ``later_blocks_held(bound=True)`` the first largest block's (by bytes and by the peak's block,
    offload's host terms left out); every phase's peak, its moment and terms, at 1 B and at the run's block, equal
    those of every moment listed (``stage1_flattened``, ``later_blocks_held``), and each family's own first largest
    (which need not make the phase's peak here) is listed."""
    import zeroplan.engines.deepspeed.phases as phases
    import zeroplan.engines.deepspeed.zero12 as zero12

    rng, checked = random.Random(seed), set()
    for model, buckets in (("tiny-llama", (1_000, 2_000, 5_000, 20_000)), ("tiny-gpt2-untied", (1_000, 5_000)),
                           ("tiny-qwen3", (2_000, 20_000)), ("llama-3.2-1b", (2_000_000, 20_000_000, 80_000_000))):
        nd, bucket = rng.choice((7, 16, 33)), rng.choice(buckets)
        s = _settings(1, bucket, rng.choice(("bf16", "fp16", "fp32")), rng.choice(("cuda", "cpu")), rng.random() < 0.5)
        w = _workload(model, 1 if model == "llama-3.2-1b" else rng.choice((1, 2)))  # accumulating: no later blocks'
        monkeypatch.setattr(run_module, "_SHARED", {})
        fast = D.moments(D.ds_run(s, w, nd))
        with monkeypatch.context() as m:
            m.setattr(LR, "stage1_flattened_listed", LR.stage1_flattened)
            m.setattr(zero12, "later_blocks_held", lambda run, last, inflight, bound=False: phases.later_blocks_held(
                run, last, inflight))
            plain = D.moments(D.ds_run(s, w, nd))
        for part, _, _ in FAMILIES:
            every = [m for m in plain if part in m.name]
            listed = [m for m in fast if part in m.name]
            assert len(listed) <= 2 and all(m in every for m in listed)
            if len(every) > 2:
                checked.add(part)
            for block in (1, s.block_bytes):  # the family's own first largest
                assert not every or max(every, key=lambda m: m.total(block)) in listed, (model, nd, bucket, block)
        for block in (1, s.block_bytes, 512):
            assert peak_of(fast, block) == peak_of(plain, block), (model, nd, bucket, block)
    assert len(checked) == len(FAMILIES), "a family of one or two moments: its listing is not tested"


def test_a_named_rank_lists_every_flattened_bucket():
    """A rank named, ``stage1_flattened_listed`` is ``stage1_flattened`` (the allocation trace walks every moment)."""
    run = D.ds_run(_settings(1, 2_000, rank=2), _workload("tiny-llama"), 7)
    assert len(LR.stage1_flattened_listed(run)) > 2
    assert LR.stage1_flattened_listed(run) == LR.stage1_flattened(run)


def _plain_in_block(run, last, inflight, kept):
    """``reduce._in_block_partitions`` as a plain loop: every reducing rank's moment built (``_partition_moment``, the
    boundary's held gradients included), summed, the first largest of each block kept."""
    from zeroplan.engines.deepspeed.hook_activations import _hook_activations, _hook_memo
    from zeroplan.engines.deepspeed.layout_ranks import _hook_buckets
    from zeroplan.engines.deepspeed.reduce import _partition_moment, _reducing_hooks

    import zeroplan.engines.deepspeed.boundary as B

    if not run.param_blocks or not run.acts.block.mlp_saved:
        return ()
    limit, bucket_of = run.settings.reduce_bucket_size, _hook_buckets(run)[3]
    base = tuple(t for t in last if t not in inflight and t.name not in ("block backward working set",
                                                                         "incoming activation gradient", B.HELD))
    large = [i for i, n in enumerate(run.numels) if n > limit]
    large_in_bucket: dict[int, int] = {}
    for i in large:
        large_in_bucket[bucket_of[i]] = large_in_bucket.get(bucket_of[i], 0) + run.numels[i]
    best, memo = {}, _hook_memo(run)
    for rank, first, hook in _reducing_hooks(run):
        j = run.param_blocks[hook]
        if j < 0 or hook in run.output_projections or _hook_activations(run, j, hook, memo) is None:
            continue
        m = _partition_moment(run, base, kept, large, large_in_bucket, memo, rank, first, hook)
        total = sum(t.bytes for t in m.terms)
        if j not in best or total > best[j][0]:
            best[j] = (total, m)
    return tuple(m for _, m in best.values())


IN_BLOCK = [  # (model, stage, overlap_comm, bucket, N_d, grad accumulation, checkpointing, rank)
    ("tiny-gpt2", 1, True, 5_000, 4, 2, "full", None), ("tiny-gpt2", 1, True, 2_000, 7, 2, "none", None),
    ("tiny-gpt2-untied", 1, True, 3_000, 5, 3, "full", 2), ("tiny-gpt2", 2, None, 2_000, 9, 2, "none", None),
    ("tiny-gpt2-untied", 2, None, 1_000, 16, 1, "full", None), ("tiny-llama", 1, True, 1_500, 6, 2, "none", None),
    ("tiny-llama", 2, None, 1_500, 16, 1, "full", None), ("tiny-qwen2", 1, True, 2_000, 3, 2, "full", None),
    ("tiny-mistral", 2, None, 5_000, 7, 2, "none", 3), ("tiny-qwen3", 1, True, 5_000, 4, 2, "none", None),
    ("tiny-gpt2-untied", 1, True, 1_000, 16, 2, "none", None),  # the boundary's held gradients change a block's rank
    ("tiny-gpt2-untied", 1, True, 2_000, 16, 2, "full", None),
]  # fmt: skip


@pytest.mark.parametrize("model, stage, overlap, bucket, nd, accum, ckpt, rank", IN_BLOCK)
def test_in_block_partitions_equal_every_rank_built(model, stage, overlap, bucket, nd, accum, ckpt, rank):
    """``_in_block_partitions`` (the boundary's held gradients asked only at ZeRO-1's boundary, each block's saved
    bytes once) equals every rank's moment built and summed, ZeRO-1 with overlap_comm accumulating (the boundary)
    and ZeRO-2, every rank and one named."""
    from test_deepspeed_winners import _last_and_inflight

    from zeroplan.engines.deepspeed.reduce import _in_block_partitions
    from zeroplan.engines.deepspeed.zero12 import _stage1_kept_gradients

    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    w = Workload(transformer_shapes(spec), spec, 16, 2, checkpointing=ckpt, grad_accum=accum, transformers=True)
    run = D.ds_run(_settings(stage, bucket, rank=rank, overlap=overlap), w, nd)
    last, inflight = _last_and_inflight(run)
    kept = _stage1_kept_gradients(run) if stage == 1 else {}
    want = _plain_in_block(run, last, inflight, kept)
    assert want, "a case without in-block moments checks nothing"
    assert _in_block_partitions(run, last, inflight, kept) == want


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-qwen2-moe", "tiny-llama",
                                   "tiny-gemma2"])
def test_mark_names_and_sparse_blocks_once_per_trace_equal_the_plain_sets(monkeypatch, model):
    """``moe.mark_names`` and ``moe.sparse_blocks`` (once per trace and depth, ``shared_memo``) equal the set made of
    the trace's marks and the layers tested against it, for ZeRO-3 runs of dense and sparse models, asked with the
    memo warm by a second run of another bucket size (its own trace where the bucket changes the marks)."""
    from zeroplan.engines.deepspeed.moe import mark_names, sparse_blocks

    monkeypatch.setattr(run_module, "_SHARED", {})
    w, sparse_seen = _workload(model), False
    for bucket in (5_000, 20_000, 5_000):
        run = D.ds_run(_settings(3, bucket), w, 4)
        plain = {m for m, _, _ in run.trace.marks}
        assert mark_names(run) == plain
        want = tuple(j for j in range(run.acts.n_layer) if f"block {j} after experts" in plain)
        assert sparse_blocks(run) == want
        sparse_seen |= bool(want)
    assert sparse_seen == (model not in ("tiny-llama", "tiny-gemma2"))


def test_flattened_buckets_skip_only_buckets_that_copy_nothing():
    """``late_reductions._FlattenedBuckets`` skips a bucket within one partition before cutting it: its copied buckets
    equal, bucket for bucket, ``copy_numel`` of every greedy bucket's parameters (those copying nothing left out), on
    1,500 random layouts (zero-sized parameters, buckets below and above the parameters, N_d 1 to 300)."""
    import bisect
    import itertools

    from zeroplan.engines.deepspeed.collectives import greedy_buckets
    from zeroplan.engines.deepspeed.flat_copy import copy_numel
    from zeroplan.engines.deepspeed.late_reductions import _FlattenedBuckets
    from zeroplan.engines.deepspeed.terms import FlatGroup

    rng, skipped = random.Random(12), 0
    for _ in range(1_500):
        numels = tuple(rng.choice((0, 1, 2, 7, 64, 1000, rng.randrange(1, 5000))) for _ in range(rng.randrange(1, 40)))
        if not sum(numels):
            continue
        flat, limit = FlatGroup(numels, rng.choice((1, 2, 3, 4, 8, 64, 300))), rng.choice((1, 10, 500, 10**4, 3000))
        ends = tuple(itertools.accumulate(greedy_buckets(numels, limit)))
        want = []
        for k, (lo, hi) in enumerate(zip((0, *ends[:-1]), ends)):
            first, end = bisect.bisect_left(flat.offsets, lo), bisect.bisect_left(flat.offsets, hi)
            n = copy_numel(flat, limit, range(first, end))
            skipped += hi > lo and lo // flat.part == (hi - 1) // flat.part and first < end
            if n:
                want.append((k, hi, first, end, n))
        assert _FlattenedBuckets(flat, limit).copied == tuple(want)
    assert skipped > 1_000


def test_large_gradients_once_per_layout_equal_each_run_own(monkeypatch):
    """``reduce._large_gradients`` (once per layout and bucket size, ``shared_memo``) equals each run's own pass over
    its parameters (those larger than the bucket, and their elements per hook bucket), the runs of two models at
    several bucket sizes, stages and N_d asked in turn with the memo warm."""
    from zeroplan.engines.deepspeed.layout_ranks import _hook_buckets
    from zeroplan.engines.deepspeed.reduce import _large_gradients

    monkeypatch.setattr(run_module, "_SHARED", {})
    rng, seen = random.Random(5), set()
    for _ in range(24):
        model, nd = rng.choice(("tiny-llama", "tiny-gpt2-untied")), rng.choice((2, 3, 7))
        s = _settings(rng.choice((1, 2)), rng.choice((500, 2_000, 5_000, 20_000)), rank=rng.choice((None, 1)),
                      overlap=True)
        run = D.ds_run(s, _workload(model), nd)
        bucket_of, limit = _hook_buckets(run)[3], s.reduce_bucket_size
        large = [i for i, n in enumerate(run.numels) if n > limit]
        in_bucket: dict[int, int] = {}
        for i in large:
            in_bucket[bucket_of[i]] = in_bucket.get(bucket_of[i], 0) + run.numels[i]
        assert _large_gradients(run) == (large, in_bucket)
        seen.add(len(large))
    assert len(seen) > 3


def test_activation_terms_one_object_per_value_equal_a_fresh_term():
    """``run._act`` keeps one term per (name, bytes, tensors), typed (an int and a float of one value are two keys):
    each equals the term made afresh, and the moments of a run are equal with the cache cleared before each."""
    from zeroplan.engines.deepspeed.run import ACT_SRC, _act
    from zeroplan.formulas.peak import Term

    rng = random.Random(3)
    for _ in range(300):
        name, nbytes, tensors = rng.choice(("a", "b", "loss")), rng.randrange(10**9), rng.choice((1, 2, 7))
        assert _act(name, nbytes, tensors) == Term(name, nbytes, ACT_SRC, tensors)
        assert _act(name, nbytes, tensors) is _act(name, nbytes, tensors)
    assert type(_act("x", 2.0).bytes) is float and type(_act("x", 2).bytes) is int
    run = D.ds_run(_settings(2, 2_000), _workload("tiny-llama"), 4)
    warm = D.moments(run)
    _act.cache_clear()
    assert D.moments(run) == warm


def test_shared_terms_equal_fresh_terms_and_moments_unchanged_with_the_cache_cleared():
    """``reduce.shared_term`` (one ``Term`` per value, typed) equals a fresh ``Term``; the in-block and flattened moments
    that take their terms from it (``_partition_moment``, ``_RankFacts.gip``, ``_flattened_tails``' alive) are equal
    listed with the cache warm and cleared, every rank and each rank named."""
    from zeroplan.engines.deepspeed.reduce import shared_term
    from zeroplan.formulas.peak import Term

    rng = random.Random(9)
    for _ in range(300):
        args = (rng.choice(("grads_in_partition", "x")), rng.randrange(10**6), rng.choice(("s", "t")), rng.randrange(1, 4))
        assert shared_term(*args) == Term(*args) and shared_term(*args) is shared_term(*args)
    assert type(shared_term("x", 2.0, "s").bytes) is float and type(shared_term("x", 2, "s").bytes) is int
    for stage, rank, overlap in ((2, None, None), (1, None, None), (1, 3, None), (2, 2, None), (1, None, True)):
        run = D.ds_run(_settings(stage, 2_000, rank=rank, overlap=overlap), _workload("tiny-gpt2-untied"), 7)
        warm = D.moments(run)
        shared_term.cache_clear()
        assert D.moments(run) == warm


@pytest.mark.parametrize("seed", range(3))
def test_offload_walk_partition_bounds_by_bisection_equal_the_walk_rank_by_rank(seed):
    """``offload_walk.walk_peaks`` finds a partition's first and last parameters by bisection (not a pass over them):
    equal to the rank-by-rank walk (tests/test_deepspeed_offload_walk.py's reference) on layouts dense in empty
    parameters (leading, trailing, at partition boundaries), partitions of padding after Ψ and one parameter over
    many partitions."""
    from test_deepspeed_offload_walk import _plain_walk

    from zeroplan.engines.deepspeed.offload_walk import walk_peaks

    rng, compared = random.Random(100 + seed), 0
    for _ in range(300):
        numels = [rng.choice((0, 0, 0, rng.randint(1, 30), rng.randint(1, 900))) for _ in range(rng.randint(1, 25))]
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        nd = rng.randint(1, 16)
        part = max(1, -(-offsets[-1] // nd) + rng.choice((0, 0, 1, rng.randint(0, 200))))
        bucket, g = rng.randint(1, 1200), rng.choice((2, 4))
        got = walk_peaks(numels, offsets, part, bucket, g, range(nd))
        for rank in range(nd):
            assert got[rank] == _plain_walk(numels, offsets, part, bucket, g, rank), (numels, part, bucket, rank)
            compared += 1
    assert compared > 1_500


def _plain_range_copy(part: int, limit: int, lo: int, hi: int) -> int:
    """flat_copy.py ``range_copy_numel``'s walk over the partitions' pieces, as it was (every piece fed in turn)."""
    copy = count = numel = 0
    while lo < hi:
        end = min(hi, (lo // part + 1) * part)
        count, numel, lo = count + 1, numel + end - lo, end
        if numel > limit:
            copy, count, numel = max(copy, numel if count > 1 else 0), 0, 0
    return max(copy, numel if count > 1 else 0)


def test_range_copy_with_partitions_larger_than_the_bucket_equals_the_walk():
    """``range_copy_numel`` in closed form where a partition holds more than a bucket (only the first piece, if it
    fits, is copied with the next) equals the walk over every piece: 20,000 random ranges (empty ones, ranges starting
    or ending on a boundary, over one to a hundred partitions), and the walk's own cases (a partition within a bucket)."""
    from zeroplan.engines.deepspeed.flat_copy import range_copy_numel

    rng, fast = random.Random(21), 0
    for _ in range(20_000):
        part, limit = rng.choice((1, 2, 7, 100, 1000, rng.randrange(1, 5000))), rng.choice((1, 5, 99, 100, 101, 4000))
        lo = rng.choice((0, part, 3 * part, rng.randrange(0, 50 * part + 1), rng.randrange(0, 50 * part + 1) // part * part))
        hi = lo + rng.choice((0, 1, part - lo % part, part, rng.randrange(0, 100 * part + 1), rng.randrange(0, 3 * part)))
        assert range_copy_numel(part, limit, lo, hi) == _plain_range_copy(part, limit, lo, hi), (part, limit, lo, hi)
        fast += part > limit
    assert fast > 5_000


def test_hook_copies_of_one_parameter_buckets_equal_copy_numel():
    """``reduce._hook_copies`` takes a one-parameter bucket's copy from ``range_copy_numel``: equal, bucket for bucket,
    to ``copy_numel`` of every hook bucket's parameters, on 1,000 random layouts and gradient-ready orders (reversed,
    shuffled), empty parameters and buckets below and above the parameters included."""
    from zeroplan.engines.deepspeed.flat_copy import copy_numel
    from zeroplan.engines.deepspeed.layout_ranks import _hook_layout
    from zeroplan.engines.deepspeed.reduce import _hook_copies
    from zeroplan.engines.deepspeed.terms import FlatGroup

    rng, single = random.Random(8), 0
    for _ in range(1_000):
        numels = tuple(rng.choice((0, 1, 7, 300, 1000, rng.randrange(1, 6000))) for _ in range(rng.randrange(1, 30)))
        if not sum(numels):
            continue
        flat, limit = FlatGroup(numels, rng.choice((1, 2, 3, 5, 16, 64))), rng.choice((1, 50, 500, 2000, 10**5))
        order = list(range(len(numels)))[::-1]
        if rng.random() < 0.3:
            rng.shuffle(order)
        order = tuple(order)
        _, _, firsts, _ = _hook_layout(numels, limit, order)
        ends = (*firsts[1:], len(order))
        want = tuple(copy_numel(flat, limit, order[a:b]) for a, b in zip(firsts, ends))
        assert _hook_copies(flat, limit, order) == want, (numels, flat.nd, limit, order)
        single += sum(b - a == 1 for a, b in zip(firsts, ends))
    assert single > 2_000


@pytest.mark.parametrize("model, stage, overlap, bucket, nd", [
    ("tiny-gpt2-untied", 2, None, 1_000, 7), ("tiny-gpt2-untied", 1, True, 2_000, 5), ("tiny-llama", 2, None, 500, 9),
    ("tiny-llama", 1, True, 1_000, 16), ("tiny-mistral", 2, None, 2_000, 33), ("tiny-qwen2", 1, True, 500, 6),
    ("llama-3.2-1b", 2, None, 5_000_000, 64), ("llama-3.2-1b", 1, True, 50_000_000, 96)])  # fmt: skip
def test_epilogue_large_gradient_every_rank_equals_the_largest_named_rank(monkeypatch, model, stage, overlap, bucket, nd):
    """``late_reductions.epilogue_large_gradient`` where every rank is described (each rank's bytes in one pass) lists
    the moment of the first rank whose own run's moment holds the most (every rank's run listed and summed)."""
    from zeroplan.engines.deepspeed.late_reductions import epilogue_large_gradient

    monkeypatch.setattr(run_module, "_SHARED", {})
    w, asked = _workload(model), []
    original = run_module.DSRun.first_largest

    def spy(self, extra, ranks=None):  # every rank's bytes as the every-rank run weighs them
        asked.append([extra(r) for r in (self.ranks if ranks is None else ranks)])
        return original(self, extra, ranks)

    with monkeypatch.context() as m:
        m.setattr(run_module.DSRun, "first_largest", spy)
        got = epilogue_large_gradient(D.ds_run(_settings(stage, bucket, overlap=overlap), w, nd))
    each = [epilogue_large_gradient(D.ds_run(_settings(stage, bucket, rank=r, overlap=overlap), w, nd))
            for r in range(nd)]
    assert all(len(m) == 1 for m in each), "the last bucket is not one large gradient: nothing is checked"
    totals = [sum(t.bytes for t in m[0].terms) for m in each]
    assert got == max(each, key=lambda m: sum(t.bytes for t in m[0].terms))
    assert len(asked) == 1 and len({t - a for t, a in zip(totals, asked[0])}) == 1  # each rank's own bytes, exact
    assert len(set(totals)) > 1  # the ranks differ


@pytest.mark.parametrize("model, stage, overlap, bucket, nd, accum", [
    ("tiny-gpt2-untied", 1, None, 1_000, 7, 1), ("tiny-llama", 1, None, 2_000, 16, 2), ("tiny-mistral", 1, None, 500, 33, 1),
    ("tiny-gpt2-untied", 2, None, 1_000, 7, 1), ("tiny-llama", 1, True, 1_000, 16, 2), ("tiny-qwen2", 2, None, 2_000, 9, 1),
    ("llama-3.2-1b", 1, None, 5_000_000, 64, 1), ("llama-3.2-1b", 2, None, 50_000_000, 96, 1)])  # fmt: skip
def test_stage1_and_epilogue_reduce_every_rank_weigh_each_rank_as_its_loop(monkeypatch, model, stage, overlap, bucket,
                                                                             nd, accum):
    """``reduce._stage1_reduce`` (ZeRO-1 after backward) and ``reduce._epilogue_reduce`` (from the hooks) where every
    rank is described weigh each rank in one pass: the bytes ``DSRun.first_largest`` is handed equal, rank for rank,
    the per-rank functions they replaced (kept here), over the same ranks, and the moment listed is that rank's."""
    import zeroplan.engines.deepspeed.boundary as B
    from zeroplan.engines.deepspeed.layout_ranks import _rank_first_buckets, _stage1_held
    from zeroplan.engines.deepspeed.reduce import _epilogue_reduce, _hook_buckets, _stage1_reduce
    from zeroplan.engines.deepspeed.run import _pbytes

    after = stage == 1 and not overlap
    monkeypatch.setattr(run_module, "_SHARED", {})
    run, asked = D.ds_run(_settings(stage, bucket, overlap=overlap), _workload(model, accum), nd), []
    original = run_module.DSRun.first_largest

    def spy(self, extra, ranks=None):
        ranks = self.ranks if ranks is None else ranks
        asked.append((tuple(ranks), list(map(extra, ranks))))
        return original(self, extra, ranks)

    with monkeypatch.context() as m:
        m.setattr(run_module.DSRun, "first_largest", spy)
        got = (_stage1_reduce if after else _epilogue_reduce)(run)
    p, flat = _pbytes(run), run.flat
    if after:  # the per-rank functions as they were
        held, psi = _stage1_held(flat, bucket), sum(run.numels)
        ranks = tuple(r for r in run.ranks if flat.params(r))
        want = [(psi - held[r][0] + held[r][1] + flat.params_numel(r)) * p for r in ranks]
    else:
        firsts, last = _rank_first_buckets(run), len(_hook_buckets(run)[1]) - 1
        ranks = tuple(run.ranks)
        want = [flat.params_numel(r) if 0 <= firsts[r] < last and (run.grad_accum == 1 or B.at_boundary(run)) else 0
                for r in ranks]
    assert asked == [(ranks, want)] and len(set(want)) > 1
    winner = max(ranks, key=dict(zip(ranks, want)).__getitem__)
    assert len(got) == 1 and (got[0].name.endswith(f"rank {winner}") or f"rank {winner}'s" in got[0].name)
