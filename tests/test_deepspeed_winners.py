"""The ZeRO-1/2 and ZeRO-3 in-block moments pick each block's largest from integer sums and build only the
winners' terms (``reduce.py _in_block_partitions``, ``zero3.py _in_block_reductions``; issue 16's plan speed).
Checked here against the per-rank / per-bucket loops they replaced (kept below as the reference: every
candidate's terms built, summed, the first largest kept), moment for moment, on transformers families with
small buckets at N_d 3, 4 and 7 (and Llama 3.2 1B at N_d 64: many ranks reducing at one hook), ZeRO-1 with
overlap_comm (its kept gradients), ZeRO-2, ZeRO-3 with and without offload_optimizer, checkpointed or not,
every rank at once and one rank named."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed import Settings, ds_run
from zeroplan.engines.deepspeed.offload_settings import OffloadTarget
from zeroplan.engines.deepspeed.offload_terms import PARAM_NORMS
from zeroplan.engines.deepspeed.phases import backward_moments
from zeroplan.engines.deepspeed.layout_ranks import _hook_buckets, _hook_layout
from zeroplan.engines.deepspeed.reduce import (GIP_SRC, _hook_activations, _hook_bucket_copy, _in_block_partitions,
                                               _reducing_hooks)
from zeroplan.engines.deepspeed.run import _blocks_saved, _pbytes
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.engines.deepspeed.zero3 import S3, _in_block_reductions
from zeroplan.engines.deepspeed.zero3_epilogue import backward_fetches, final_norm_hook, gathered_at_hook
from zeroplan.engines.deepspeed.zero3_epilogue import bucket_copies
from zeroplan.engines.deepspeed.zero12 import _stage1_kept_gradients
from zeroplan.formulas.peak import Moment, Term

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"


def _reference_partitions(run, last, inflight, kept):
    """``_in_block_partitions`` as it was (every rank's terms built and summed)."""
    if not run.param_blocks or not run.acts.block.mlp_saved:
        return ()
    p, s, outputs = _pbytes(run), run.settings, set(run.output_projections)
    _, buckets, _, bucket_of = _hook_buckets(run)
    base = tuple(t for t in last if t not in inflight and t.name not in ("block backward working set",
                                                                         "incoming activation gradient"))
    large = [i for i, n in enumerate(run.numels) if n > s.reduce_bucket_size]
    large_in_bucket: dict[int, int] = {}
    for i in large:
        large_in_bucket[bucket_of[i]] = large_in_bucket.get(bucket_of[i], 0) + run.numels[i]
    best: dict[int, tuple[int, Moment]] = {}
    for rank, first, hook in _reducing_hooks(run):
        j = run.param_blocks[hook]
        if j < 0 or hook in outputs:
            continue
        at_hook = _hook_activations(run, j, hook)
        if at_hook is None:
            continue
        where, acts, module = at_hook
        lo, hi = run.flat.range(rank)
        own = sum(run.numels[i] for i in large
                  if bucket_of[i] < first and run.param_blocks[i] == j and not lo <= i < hi) if kept else 0
        terms = (*base, _blocks_saved(run, j), *acts,
                 Term(f"{where}'s weight gradients", sum(run.numels[i] for i in module) * p,
                      "autograd (one node makes every input's gradient)", len(module)),
                 Term("gradients larger than the bucket, in the bucket reduced", large_in_bucket.get(first, 0) * p,
                      "runtime/zero/stage_1_and_2.py reduce_ipg_grads (extra_large_param_to_reduce)"),
                 *((Term("gradients larger than the bucket, outside the partition, reduced before (kept)",
                         (own * p + kept[rank][j].bytes), kept[rank][j].source),) if kept else ()),
                 Term("grads_in_partition", run.flat.params_numel(rank) * p, GIP_SRC))
        name = f"block {j} {where} backward, rank {rank}'s grads_in_partition allocated"
        copy = _hook_bucket_copy(run, first) * DTYPE_BYTES[s.grad_dtype]
        if copy > terms[-1].bytes:
            name = f"block {j} {where} backward, rank {rank}'s bucket flattened"
            terms = (*terms[:-1], Term("flattened copy of the bucket's gradients", copy,
                                       "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))"))
        total = sum(t.bytes for t in terms)
        if j not in best or total > best[j][0]:
            best[j] = (total, Moment("backward", name, terms))
    return tuple(m for _, m in best.values())


def _reference_reductions(run, last, inflight):
    """``_in_block_reductions`` as it was (every bucket's terms built and summed), with the gloo bucket copies and the
    parameters gathered at the hook that the differential matrix's 1-24 added (on the CPU only), and the final norm's
    hook (after every block's parameters: every block saved, ``final_norm_hook``) that its seed 5 draw 6 added."""
    if not run.param_blocks or not run.acts.block.mlp_saved:
        return ()
    s, p = run.settings, _pbytes(run)
    order, buckets, first_of_bucket, _ = _hook_layout(run.numels, s.reduce_bucket_size, run.grad_ready_order)
    offload = s.offload_optimizer.on
    base = tuple(t for t in last if t not in inflight and t.name not in ("block backward working set",
                                                                         "incoming activation gradient"))
    numels, limit, rank = run.numels, s.reduce_bucket_size, s.rank or 0
    large_before = (0, *itertools.accumulate(numels[i] if numels[i] > limit else 0 for i in order))
    normed_before = (0, *itertools.accumulate(int(-(-numels[i] // run.nd) * rank < numels[i]) for i in order))
    best: dict[int, tuple[int, str, tuple[Term, ...]]] = {}
    fetched = backward_fetches(run) if s.device == "cpu" else {}
    L, roots = run.acts.n_layer, max(i for i, j in enumerate(run.param_blocks) if j >= 0)
    for b in range(len(buckets) - 1):
        start, end = first_of_bucket[b], first_of_bucket[b + 1]
        hook = order[end]
        large = large_before[end] - large_before[start]
        gloo_copies = s.device == "cpu" and (fetched or run.nd == 1)
        flat, gloo = bucket_copies([numels[i] for i in order[start:end]], run.nd, s.device) if gloo_copies else (0, 0)
        norm = max(-(-numels[i] // run.nd) for i in order[start:end]) * 8 + 8 if offload else 0
        gloo, norm, copies = (gloo, 0, flat + gloo) if gloo * p > norm else (0, norm, flat + gloo)
        j = L if hook > roots and gloo_copies else run.param_blocks[hook]
        at_hook = ((final_norm_hook(run, hook) if j == L else _hook_activations(run, j, hook))
                   if j >= 0 and (large or offload or copies) else None)
        if at_hook is None:
            continue
        where, acts, module = at_hook
        at = f"{where} backward" if j == L else f"block {j} {where} backward"
        terms = (*(gathered_at_hook(base, fetched.get(hook), run, at) if copies else base), _blocks_saved(run, j), *acts,
                 Term(f"{where}'s weight gradients", sum(run.numels[i] for i in module) * p,
                      "autograd (one node makes every input's gradient)", len(module)),
                 Term("gradients larger than the bucket, in the bucket sent", large * p,
                      f"{S3} __add_grad_to_ipg_bucket (copied only if it fits) -> partition_grads (param.grad = None)"),
                 Term("the bucket's flattened copy and gloo's copy of it", (flat + gloo) * p,
                      f"{S3} __avg_scatter_grads -> zero3_epilogue.py bucket_copies", int(flat > 0) + int(gloo > 0)))
        if offload:
            norms = normed_before[start]
            terms += (Term("fp64 copy of a gradient partition for its norm (the largest of the bucket)", norm,
                           f"{S3} partition_grads -> _offload_grad_partition_at_boundary -> _constant_buffered_norm2", 2),
                      Term(f"{PARAM_NORMS}, the buckets sent before", norms * 8, f"{S3} norm_for_param_grads", norms))
        total = sum(t.bytes for t in terms)
        if j not in best or total > best[j][0]:
            best[j] = (total, at, terms)
    return tuple(Moment("backward", f"{at}, a bucket sent", terms) for j, (_, at, terms) in best.items())


def _last_and_inflight(run):
    """The last block's terms and those in flight, as ``backward_moments`` hands them to the wrapper."""
    got = {}
    wrapper = run.wrapper
    original = type(wrapper).backward_after_last_block

    def spy(self, run_, last, inflight):
        got["args"] = (last, inflight)
        return ()

    type(wrapper).backward_after_last_block = spy
    try:
        backward_moments(run)
    finally:
        type(wrapper).backward_after_last_block = original
    return got["args"]


CASES = [  # (model, stage, overlap_comm, bucket, N_d, checkpointing, offload_optimizer, rank)
    ("tiny-gpt2", 2, None, 5_000, 4, "none", False, None),
    ("tiny-gpt2", 1, True, 5_000, 4, "full", False, None),
    ("tiny-gpt2-untied", 2, None, 2_000, 7, "full", False, None),
    ("tiny-llama", 2, None, 5_000, 3, "full", False, None),
    ("tiny-llama", 1, True, 20_000, 7, "none", False, None),
    ("tiny-llama-tied-bias", 2, None, 2_000, 4, "none", False, 1),
    ("tiny-mistral", 2, None, 20_000, 7, "none", False, None),
    ("tiny-qwen2", 1, True, 2_000, 3, "full", False, None),
    ("tiny-qwen3", 2, None, 5_000, 4, "full", False, None),
    ("tiny-gpt2-untied", 1, True, 20_000, 3, "none", False, 2),
    ("llama-3.2-1b", 2, None, 5_000_000, 64, "full", False, None),
    ("llama-3.2-1b", 1, True, 50_000_000, 64, "none", False, None),
    ("llama-3.2-1b", 3, None, 5_000_000, 64, "none", True, None),
    ("tiny-gpt2", 3, None, 5_000, 4, "none", True, None),
    ("tiny-llama", 3, None, 2_000, 3, "full", False, None),
    ("tiny-mistral", 3, None, 5_000, 7, "none", True, 2),
    ("tiny-qwen2", 3, None, 2_000, 4, "full", False, None),
    ("tiny-llama", 3, None, 4_500, 3, "none", False, None),  # the head (4,944) sent at the final norm's hook
    ("tiny-gpt2-untied", 3, None, 3_881, 3, "none", True, 1),  # at a LayerNorm's (the head in the bucket), offload
    # ZeRO-2 every rank, many ranks per first bucket
    ("tiny-llama", 2, None, 1_500, 16, "none", False, None), ("tiny-qwen2", 2, None, 3_000, 9, "full", False, None),
    ("tiny-gpt2-untied", 2, None, 700, 11, "none", False, None), ("llama-3.2-1b", 2, None, 20_000_000, 96, "none", False, None),
]


@pytest.mark.parametrize("model, stage, overlap, bucket, nd, ckpt, offload, rank", CASES)
def test_in_block_winners_equal_every_candidate_built(model, stage, overlap, bucket, nd, ckpt, offload, rank):
    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, 16, 2, checkpointing=ckpt, transformers=True)
    settings = Settings(stage=stage, overlap_comm=overlap, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                        rank=rank, offload_optimizer=OffloadTarget(device="cpu") if offload else OffloadTarget())
    run = ds_run(settings, workload, nd)
    last, inflight = _last_and_inflight(run)
    if stage == 3:
        got, want = _in_block_reductions(run, last, inflight), _reference_reductions(run, last, inflight)
    else:
        kept = _stage1_kept_gradients(run) if not settings.partition_gradients else {}
        got, want = _in_block_partitions(run, last, inflight, kept), _reference_partitions(run, last, inflight, kept)
    assert want, "a case without in-block moments checks nothing"
    assert got == want


@pytest.mark.parametrize("model, bucket, nd, ckpt, offload", [("llama-3.2-1b", 5_000_000, 64, "none", False),
                                                           ("llama-3.2-1b", 2_000_000, 16, "full", True)])
def test_in_block_reductions_shared_across_prefetch_equal_each_built(model, bucket, nd, ckpt, offload):
    """On a GPU ``_in_block_reductions`` makes its moments less ``base`` once per run less its prefetch bucket
    (``zero3._gpu_terms``): each prefetch setting's moments, the later ones from that cache, equal every candidate
    built with its own ``base`` (the gathered parameters differ with the prefetch bucket)."""
    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, 16, 2, checkpointing=ckpt, transformers=True)
    bases = set()
    for prefetch, hpz in ((0, 1), (1_000, 1), (50_000_000, 1 if offload else 8), (50_000_000, 1), (0, 1 if offload else 8),
                          (0, 1)):  # hpZ (not with offload) shares it too
        settings = Settings(stage=3, reduce_bucket_size=bucket, allgather_bucket_size=bucket, prefetch_bucket_size=prefetch,
                            device="cuda", hpz_partition_size=hpz,
                            offload_optimizer=OffloadTarget(device="cpu") if offload else OffloadTarget())
        run = ds_run(settings, workload, nd)
        assert run.settings.device == "cuda"
        last, inflight = _last_and_inflight(run)
        got, want = _in_block_reductions(run, last, inflight), _reference_reductions(run, last, inflight)
        assert want and got == want
        bases.add(tuple(t for t in last if t not in inflight))
    assert len(bases) > 1, "the prefetch settings gather alike: the shared part is not tested"


def _reference_stage1_flattened(run):
    """``late_reductions.stage1_flattened`` as it was (every rank's terms built and summed per bucket)."""
    import bisect

    from zeroplan.engines.deepspeed.collectives import greedy_buckets
    from zeroplan.engines.deepspeed.flat_copy import flattened_copy_numel
    from zeroplan.engines.deepspeed.run import _act, _bucket, _states

    numels, p, offsets = run.numels, _pbytes(run), run.flat.offsets
    g, psi, limit = DTYPE_BYTES[run.settings.grad_dtype], sum(numels), run.settings.reduce_bucket_size
    bucket_ends = tuple(itertools.accumulate(greedy_buckets(numels, limit)))
    large_before = (0, *itertools.accumulate(n if n > limit else 0 for n in numels))
    base = (*_states(run), *_bucket(run), _act("batch (token ids, targets)", run.acts.batch, 2))
    starts = (0, *bucket_ends[:-1])
    firsts = {r: bisect.bisect_right(bucket_ends, offsets[run.flat.range(r)[0]]) for r in run.ranks if run.flat.params(r)}

    def alive(first, hi, end, r=None):
        a, b = run.flat.range(r) if r is not None else (0, 0)
        own = sum(numels[i] for i in range(a, min(b, first)) if numels[i] > limit)
        return Term("autograd gradients not yet bucketed, and the large ones reduced so far (kept)",
                    (psi - hi + large_before[end] - own) * p,
                    "torch autograd (param.grad); stage 1 clears no gradient; copy_grads_in_partition "
                    "repoints the partition's (grad_reduc.data = new_grad_tensor.data)")

    out = []
    for k, (lo, hi) in enumerate(zip(starts, bucket_ends)):
        first, end = bisect.bisect_left(offsets, lo), bisect.bisect_left(offsets, hi)
        copy = Term("flattened copy of the bucket's gradients", flattened_copy_numel(run, range(first, end)) * g,
                    "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))")
        if not copy.bytes:
            continue
        options = [(*base, alive(first, hi, end), copy)]
        for r, f in firsts.items():
            gip = Term("grads_in_partition", run.flat.params_numel(r) * p, GIP_SRC)
            if f < k:
                options.append((*base, alive(first, hi, end, r), gip, copy))
            elif f == k:
                options.append((*base, alive(first, hi, end), max(gip, copy, key=lambda t: t.bytes)))
        out.append(Moment("backward", f"reduce_gradients: bucket {k} flattened",
                          max(options, key=lambda terms: sum(t.bytes for t in terms))))
    return tuple(out)


FLATTENED = [  # (model, bucket, N_d, rank): ZeRO-1 reducing after backward
    ("tiny-gpt2", 5_000, 4, None), ("tiny-gpt2-untied", 2_000, 7, None), ("tiny-llama", 20_000, 3, None),
    ("tiny-llama-tied-bias", 2_000, 4, 1), ("tiny-mistral", 5_000, 7, None), ("tiny-qwen2", 50_000, 2, None),
    ("tiny-qwen3", 3_000, 5, 3), ("tiny-gpt2", 1_000_000, 3, None), ("llama-3.2-1b", 5_000_000, 64, None),
    ("llama-3.2-1b", 50_000_000, 256, None), ("llama-3.2-1b", 300_000_000, 96, None), ("llama-3.2-1b", 2_000_000, 7, 5),
]  # fmt: skip


@pytest.mark.parametrize("model, bucket, nd, rank", FLATTENED)
def test_stage1_flattened_equals_every_rank_built(model, bucket, nd, rank):
    """``stage1_flattened``'s O(log N_d) choice (``_RankFacts``) gives the moments of the per-rank loop it replaced."""
    from zeroplan.engines.deepspeed.late_reductions import stage1_flattened

    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, 16, 2, transformers=True)
    run = ds_run(Settings(stage=1, reduce_bucket_size=bucket, allgather_bucket_size=bucket, rank=rank), workload, nd)
    want = _reference_stage1_flattened(run)
    assert want, "a case without flattened buckets checks nothing"
    assert stage1_flattened(run) == want


@pytest.mark.parametrize("model, bucket, nd", [("tiny-gpt2-untied", 2_000, 7), ("tiny-qwen3", 3_000, 5),
                                               ("tiny-llama", 5_000, 9)])
def test_stage1_flattened_of_each_rank_equals_its_loop(model, bucket, nd):
    """Each rank's own run (``flattened_buckets._one_rank_tails``) gives the moments of the per-rank loop."""
    from zeroplan.engines.deepspeed.late_reductions import stage1_flattened

    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, 16, 2, transformers=True)
    for rank in range(nd):
        run = ds_run(Settings(stage=1, reduce_bucket_size=bucket, allgather_bucket_size=bucket, rank=rank), workload, nd)
        assert stage1_flattened(run) == _reference_stage1_flattened(run)


def test_stage1_flattened_caches_shared_across_runs():
    """``stage1_flattened``'s per-layout caches (``_flattened_buckets``, ``_flattened_tails``: shared by every
    rank's run and every candidate of one bucket size) give each run the per-rank loop's moments, the runs of one
    layout asked in turn (every rank, then single ranks drawn at random, a 16-bit and an fp32 run, two bucket sizes)."""
    import random

    from zeroplan.engines.deepspeed.late_reductions import stage1_flattened

    spec = spec_from_hf_config(json.loads((CONFIGS / "tiny-llama.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, 16, 2, transformers=True)
    rng, checked = random.Random(16), 0
    for bucket, dtype in ((5_000, "bf16"), (5_000, "fp32"), (20_000, "bf16")):
        for rank in (None, *rng.sample(range(7), 3)):
            s = Settings(stage=1, dtype=dtype, reduce_bucket_size=bucket, allgather_bucket_size=bucket, rank=rank)
            run = ds_run(s, workload, 7)
            want = _reference_stage1_flattened(run)
            assert stage1_flattened(run) == want
            checked += len(want)
    assert checked > 20, "too few flattened buckets to check the caches"


@pytest.mark.parametrize("model, stage, bucket, nd", [
    ("tiny-llama", 2, 5_000, 3), ("tiny-gpt2-untied", 2, 2_000, 7), ("tiny-qwen2", 1, 20_000, 4),
    ("llama-3.2-1b", 2, 5_000_000, 64)])
def test_hook_bucket_copies_equal_each_bucket_flattened(model, stage, bucket, nd):
    """``reduce._hook_copies`` (every hook bucket's flattened copy, once per layout) equals ``flattened_copy_numel``
    of each bucket's parameters in gradient-ready order, and ``FlatGroup.params`` (per rank, once per layout) each
    rank's range."""
    from zeroplan.engines.deepspeed.flat_copy import flattened_copy_numel

    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, 16, 2, transformers=True)
    run = ds_run(Settings(stage=stage, overlap_comm=True, reduce_bucket_size=bucket, allgather_bucket_size=bucket),
                 workload, nd)
    order, buckets, first_of_bucket, _ = _hook_buckets(run)
    ends = (*first_of_bucket[1:], len(order))
    want = [flattened_copy_numel(run, order[a:b]) for a, b in zip(first_of_bucket, ends)]
    assert [_hook_bucket_copy(run, b) for b in range(len(buckets))] == want
    assert any(want), "no bucket copied: the case checks nothing"
    assert [run.flat.params(r) for r in range(nd)] == [tuple(range(*run.flat.range(r))) for r in range(nd)]


@pytest.mark.parametrize("model, stage, overlap, nd, ckpt", [("tiny-llama", 3, None, 4, "none"),
                                                           ("tiny-gpt2-untied", 1, None, 3, "full"),
                                                           ("tiny-qwen2", 2, None, 7, "none")])
def test_trace_of_shared_terms_equals_the_moments_own(model, stage, overlap, nd, ckpt):
    """``alloc_trace.shared_terms`` (equal terms made one object before the trace builder diffs moments by object)
    changes no event: the step trace of the profile's own moments, each equal term a new object (the most work for
    the builder), and of the shared ones are equal, on CUDA's 512-byte blocks."""
    from zeroplan.allocator.step_trace import step_trace
    from zeroplan.engines.deepspeed.alloc_trace import chronological, shared_terms
    from zeroplan.engines.deepspeed.phases import moments

    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, 16, 2, checkpointing=ckpt, transformers=True)
    s = Settings(stage=stage, overlap_comm=overlap, reduce_bucket_size=5_000, allgather_bucket_size=5_000)
    ordered = chronological(moments(ds_run(s, workload, nd)))
    fresh = [Moment(m.phase, m.name, tuple(Term(t.name, t.bytes, t.source, t.tensors) for t in m.terms))
             for m in ordered]
    shared = shared_terms(fresh)
    assert len({id(t) for m in shared for t in m.terms}) < len({id(t) for m in fresh for t in m.terms})
    assert step_trace(shared, 512) == step_trace(fresh, 512) == step_trace(ordered, 512)


def _reference_embedding_hook(run):
    """``late_reductions.embedding_hook_reduced`` as it was (every rank's terms built and summed per bucket)."""
    from zeroplan.engines.deepspeed.run import _act, _bucket, _states

    if not run.param_blocks or not any(b >= 0 for b in run.param_blocks):
        return ()
    first_block = min(i for i, b in enumerate(run.param_blocks) if b >= 0)
    order, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    p, g, acts = _pbytes(run), DTYPE_BYTES[run.settings.grad_dtype], run.acts
    held = run.wrapper.held_between_micro_steps(run)
    base = (*_states(run), *held, *(t for t in _bucket(run) if t not in held),
            _act("batch (token ids, targets)", acts.batch, 2), _act("loss", acts.loss))
    firsts = {r: min(bucket_of[i] for i in run.flat.params(r)) for r in run.ranks if run.flat.params(r)}
    out = []
    for b in range(len(buckets) - 1):
        hook = order[first_of_bucket[b + 1]]
        if hook >= first_block or run.param_blocks[hook] >= 0:
            continue
        grad = Term("the embedding's gradient at its hook", run.numels[hook] * p,
                    "autograd (embedding backward) -> runtime/zero/stage_1_and_2.py "
                    "reduce_independent_p_g_buckets_and_remove_grads")
        copy = Term("flattened copy of the bucket's gradients", _hook_bucket_copy(run, b) * g,
                    "runtime/zero/stage_1_and_2.py allreduce_bucket (self.flatten(bucket))")
        options = [(*base, grad, copy)]
        for r, first in firsts.items():
            gip = Term("grads_in_partition", run.flat.params_numel(r) * p, GIP_SRC)
            if first < b:
                options.append((*base, grad, gip, copy))
            elif first == b:
                options.append((*base, grad, max(gip, copy, key=lambda t: t.bytes)))
        best = max(options, key=lambda terms: sum(t.bytes for t in terms))
        out.append(Moment("backward", f"embedding's hook, bucket {b} sent", best))
    return tuple(out)


def test_embedding_hook_winner_equals_every_rank_built():
    """``embedding_hook_reduced``'s choice from integer sums (``_embedding_hook_winner``) gives the moments of the
    per-rank loop it replaced, on 60 configurations drawn at random (seed 16: transformers families, ZeRO-2 or ZeRO-1
    with overlap_comm, buckets of 300 to 60,000 elements, N_d 2 to 80, every rank or one); each kind of winner (no
    rank's partition, one allocated by an earlier bucket, one allocated by this bucket) is among them."""
    import random

    from zeroplan.engines.deepspeed.late_reductions import embedding_hook_reduced

    models = ("tiny-gpt2", "tiny-gpt2-untied", "tiny-llama", "tiny-llama-tied-bias", "tiny-mistral", "tiny-qwen2",
              "tiny-qwen3")
    workloads = {m: Workload(transformer_shapes(spec), spec, 16, 2, transformers=True)
                 for m in models for spec in [spec_from_hf_config(json.loads((CONFIGS / f"{m}.json").read_text()))]}
    rng, kinds = random.Random(16), set()
    for _ in range(60):
        stage, nd = rng.choice((1, 2)), rng.randrange(2, 81)
        bucket = int(300 * 200 ** rng.random())
        rank = rng.choice((None, None, 0, rng.randrange(nd)))  # rank 0 holds the token embedding: its first bucket
        s = Settings(stage=stage, overlap_comm=True if stage == 1 else None, reduce_bucket_size=bucket,
                     allgather_bucket_size=bucket, rank=rank)
        run = ds_run(s, workloads[rng.choice(models)], nd)
        want = _reference_embedding_hook(run)
        assert embedding_hook_reduced(run) == want, (s, nd)
        kinds.update(tuple(t.name for t in m.terms[-2:]) for m in want)
    grad, gip = "the embedding's gradient at its hook", "grads_in_partition"
    copy = "flattened copy of the bucket's gradients"
    assert kinds == {(grad, copy), (gip, copy), (grad, gip)}, kinds
