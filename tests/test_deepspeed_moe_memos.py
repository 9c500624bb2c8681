"""Work the DeepSpeed runs of one plan shared, done once (issue 16's plan speed, Qwen3-30B-A3B on 1,024 GPUs): each a
speed-up, no rule, checked here against the plain computation it replaced (main at 9c9090d) on real and random cases.

- ``moe12_hooks._at_hook``: a sparse hook's activations once per (block, role) for every run of the same activations,
  architecture, parameter sizes, checkpointing and dtype (``_hook_terms`` built anew is the reference);
- ``moe12_hooks._in_layers``: a parameter in a sparse layer by the index after ``.layers.`` (each layer's text
  searched for is the reference);
- ``terms.persistent_numel``: ZeRO-3's parameters kept gathered, kept for the last layouts and thresholds;
- ``moe.expert_gradients_held``: the last sparse block's modules found once per trace."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from tests.test_deepspeed_moe import CONFIGS as WIDE
from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed import Settings, ds_run
import zeroplan.engines.deepspeed.moe as MOE
import zeroplan.engines.deepspeed.moe12_hooks as MH
import zeroplan.engines.deepspeed.run as RUN
from zeroplan.engines.deepspeed.terms import persistent_numel

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"
MODELS = ["qwen3-moe-wide", "qwen2-moe-wide", "mixtral-wide", "deepseek-wide", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b",
          "deepseek-v3", "tiny-qwen2-moe", "tiny-mixtral", "tiny-deepseek-v3"]


def _spec(model):
    return spec_from_hf_config(WIDE[model] if model in WIDE else json.loads((CONFIGS / f"{model}.json").read_text()))


@pytest.mark.parametrize("model", MODELS)
def test_at_hook_memo_equals_each_built(model):
    """Runs in turn of two dtypes, checkpointing or not, two micro-batches (other activations), ZeRO-1 and 2: every
    sparse block's every role through the memo equals ``_hook_terms`` built for that run, term for term."""
    spec = _spec(model)
    roles = ("gate_up", "down", "router", "norm", "attention", *(("shared_down", "shared_up", "shared_gate")
                                                                  if spec.model_type == "qwen2_moe" else ()))
    seen = 0
    for dtype, ckpt, micro, stage in (("bf16", "none", 2, 2), ("fp32", "none", 2, 1), ("bf16", "full", 2, 2),
                                      ("bf16", "none", 1, 1), ("bf16", "none", 2, 1), ("fp32", "full", 1, 2)):
        workload = Workload(transformer_shapes(spec), spec, 16, micro, checkpointing=ckpt, transformers=True)
        run = ds_run(Settings(stage=stage, dtype=dtype, reduce_bucket_size=10**6, allgather_bucket_size=10**6),
                     workload, 4)
        for j in spec.moe.sparse_layers:
            for role in roles:
                got = MH._at_hook(run, j, role)
                assert got == MH._hook_terms(run, j, role), (dtype, ckpt, micro, j, role)
                assert [t.name for t in got] == [t.name for t in MH._hook_terms(run, j, role)]
                seen += 1
    assert seen


def _plain_in_sparse(name, layers):
    return any(s in name for s in {f".layers.{j}." for j in layers})


def test_in_layers_equals_every_layer_searched():
    rng = random.Random(5)
    parts = ("model", "layers", "0", "1", "2", "10", "12", "mlp", "experts", "layers.3", "", "x1")
    for _ in range(3000):
        name = ".".join(rng.choice(parts) for _ in range(rng.randint(1, 8)))
        layers = set(rng.sample(range(14), rng.randint(0, 6)))
        assert MH._in_layers(name, {str(j) for j in layers}) == _plain_in_sparse(name, layers), (name, layers)
    for model in MODELS:  # every real parameter name
        spec = _spec(model)
        for name in MH._names(spec):
            assert MH._in_layers(name, {str(j) for j in spec.moe.sparse_layers}) == _plain_in_sparse(
                name, spec.moe.sparse_layers), name


def test_persistent_numel_equals_the_sum():
    rng = random.Random(7)
    layouts = [tuple(rng.randint(0, 10**6) for _ in range(rng.randint(0, 50))) for _ in range(8)]
    for _ in range(2000):  # layouts and thresholds in turn, again and again (the memo's hits and misses)
        numels, limit = rng.choice(layouts), rng.choice((0, 1, 10**4, 10**5, 5 * 10**5, 10**6, 10**7))
        s = Settings(stage=3, param_persistence_threshold=limit)
        assert persistent_numel(s, numels) == sum(n for n in numels if n <= limit)
        copy = tuple(list(numels))  # an equal tuple, another object
        assert persistent_numel(s, copy) == sum(n for n in numels if n <= limit)


@pytest.mark.parametrize("model", MODELS)
def test_expert_gradients_held_equal_with_the_memo_cleared(model):
    spec = _spec(model)
    for hf in (True, False):
        run = ds_run(Settings(stage=3, reduce_bucket_size=10**6, allgather_bucket_size=10**6),
                     Workload(transformer_shapes(spec), spec, 16, 2, transformers=hf), 4)
        sched = RUN._schedule(run)
        got = MOE.expert_gradients_held(run, sched)
        RUN._SHARED.clear()
        assert got == MOE.expert_gradients_held(run, sched)


def _plain_sparse_hook_partitions(run, last, inflight, kept):
    """``moe12_hooks.sparse_hook_partitions`` as it was (main at 9c9090d): each bucket's facts found in the run."""
    import zeroplan.engines.deepspeed.boundary as B
    from zeroplan.engines.deepspeed.layout_ranks import _hook_buckets
    from zeroplan.engines.deepspeed.moe_offload import norms_at_hooks
    from zeroplan.engines.deepspeed.reduce import hook_copy_term
    from zeroplan.engines.deepspeed.run import _act, _blocks_saved, _pbytes
    from zeroplan.formulas.peak import Moment, Term

    if run.spec is None or run.spec.moe is None or not run.param_blocks:
        return ()
    roles, p = MH._roles(run), _pbytes(run)
    order, buckets, first_of_bucket, bucket_of = _hook_buckets(run)
    limit = run.settings.reduce_bucket_size
    base = tuple(t for t in last if t not in inflight and t.name not in ("block backward working set",
                                                                         "incoming activation gradient"))
    firsts = {r: min(bucket_of[i] for i in run.flat.params(r)) for r in run.ranks if run.flat.params(r)}
    out, large_name = [], "gradients larger than the bucket, in the bucket reduced"
    for b in range(len(buckets) - 1):
        hook = order[first_of_bucket[b + 1]]
        role, j = roles.get(hook), run.param_blocks[hook]
        if role not in ("gate_up", "router", "norm", "shared_down", "shared_up", "shared_gate", "down", "attention") or (
                role in ("down", "attention") and not norms_at_hooks(run) and (
                    role == "attention" or run.spec.model_type == "deepseek_v3")):
            continue
        large = sum(run.numels[i] for i in order[first_of_bucket[b]:first_of_bucket[b + 1]] if run.numels[i] > limit)
        common = (*B.held_at(run, base, B.position(run, hook) + 1), _blocks_saved(run, j), *MH._hook_terms(run, j, role),
                  Term(large_name, large * p, f"{MH.SRC} reduce_ipg_grads (extra_large_param_to_reduce)"),
                  Term("the hooked parameter's gradient (waiting)", run.numels[hook] * p,
                       f"{MH.SRC} reduce_independent_p_g_buckets_and_remove_grads (the bucket first)"))
        copy = hook_copy_term(run, b)
        best = MH._rank_holding_most(run, kept, copy, firsts, j, b)
        out.append(Moment("backward", f"block {j} sparse MLP {role} hook, bucket {b} reduced", (*common, *best)))
        if role == "gate_up" and run.numels[hook] > limit:
            name = f"block {j} gathered rows' backward after the gate-up hook, bucket {b} gone"
            out.append(Moment("backward", name, (
                *(t for t in common if t.name != large_name), *(t for t in best if t is not copy),
                _act("the gathered rows' gradient scattered back (IndexBackward: zeros, index_put)",
                     2 * run.acts.embed_out, 2))))
    return (*out, *MH._gate_up_backward(run, base, kept, firsts))


@pytest.mark.parametrize("model", ["qwen3-moe-wide", "qwen2-moe-wide", "mixtral-wide", "deepseek-wide",
                                   "qwen1.5-moe-a2.7b", "deepseek-v3"])
def test_sparse_hooks_shared_equal_each_run_built(model):
    """``moe12_hook_facts.sparse_hooks`` (each sparse hook bucket's facts once for the runs of a layout, bucket size,
    dtypes and offload): runs in turn (every rank, a rank named, ZeRO-1 with overlap_comm and ZeRO-2, two buckets,
    two dtypes, offload's norms (``norms_at_hooks``: buckets of the largest tensor, no overlap_comm), two N_d) list the
    very moments the per-run loop lists, name for name (offload's norms left out of the memo's key fails it)."""
    from tests.test_deepspeed_winners import _last_and_inflight
    from zeroplan.engines.deepspeed.offload_settings import OffloadTarget
    from zeroplan.engines.deepspeed.zero12 import _stage1_kept_gradients

    spec = _spec(model)
    workload = Workload(transformer_shapes(spec), spec, 16, 2, transformers=True)
    big, largest = model in ("qwen1.5-moe-a2.7b", "deepseek-v3"), max(math.prod(sh) for _, sh in workload.shapes)
    seen = norms = 0
    for stage, bucket, nd, rank, dtype, offload, overlap in (
            (2, 50_000, 4, None, "bf16", False, True), (2, 50_000, 4, 0, "bf16", False, True),
            (1, 50_000, 4, None, "bf16", False, True), (2, 50_000, 4, 2, "fp32", False, True),
            (2, 100_000, 8, None, "bf16", False, True), (2, 100_000, 8, 5, "bf16", True, True),
            (2, None, 4, None, "bf16", False, False), (2, None, 4, None, "bf16", True, False),  # offload's norms: only
            (2, None, 4, 1, "bf16", True, False), (2, None, 4, 1, "bf16", False, False),  # what differs between each two
            (1, 50_000, 4, 1, "bf16", False, True)):
        bucket = largest if bucket is None else bucket * 1000 if big else bucket
        settings = Settings(stage=stage, overlap_comm=overlap, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                            rank=rank, dtype=dtype, offload_optimizer=OffloadTarget(device="cpu") if offload else OffloadTarget())
        run = ds_run(settings, workload, nd * (8 if big else 1))
        last, inflight = _last_and_inflight(run)
        kept = _stage1_kept_gradients(run) if stage == 1 else {}
        got = MH.sparse_hook_partitions(run, last, inflight, kept)
        want = _plain_sparse_hook_partitions(run, last, inflight, kept)
        assert got == want and [m.name for m in got] == [m.name for m in want]
        seen += len(want)
        norms += MH.norms_at_hooks(run)
    assert seen and norms == 2


@pytest.mark.parametrize("model", ["qwen3-moe-wide", "qwen2-moe-wide", "mixtral-wide", "deepseek-wide", "tiny-deepseek-v3"])
def test_sparse_forward_moments_shared_equal_each_run_built(model):
    """``moe.sparse_forward_moments`` takes its moments' terms after ``base`` once for the runs of one schedule,
    trace, activations, architecture, checkpointing, model, dtype, qwZ and N_d (``shared_memo``): ZeRO-3 runs in turn
    (buckets, prefetch on and off, bf16 and fp32, checkpointed or not, hpZ, two N_d, the validator's model and
    transformers') list the very moments built for each run alone (``_sparse_forward_tails``, main's loop)."""
    from zeroplan.formulas.peak import Moment

    spec = _spec(model)
    seen = 0
    for hf, ckpt, dtype, prefetch, bucket, nd, hpz in (
            (True, "none", "bf16", 50_000_000, 10**6, 4, 1), (True, "none", "bf16", 0, 10**6, 4, 1),
            (True, "none", "fp32", 0, 10**6, 4, 1), (True, "full", "bf16", 0, 10**6, 4, 1),
            (True, "none", "bf16", 50_000_000, 10**5, 4, 1), (True, "none", "bf16", 50_000_000, 10**6, 16, 8),
            (True, "none", "bf16", 50_000_000, 10**6, 16, 1), (False, "none", "bf16", 50_000_000, 10**6, 4, 1)):
        workload = Workload(transformer_shapes(spec), spec, 16, 2, checkpointing=ckpt, transformers=hf)
        run = ds_run(Settings(stage=3, dtype=dtype, prefetch_bucket_size=prefetch, reduce_bucket_size=bucket,
                              allgather_bucket_size=bucket, hpz_partition_size=hpz), workload, nd)
        sched = RUN._schedule(run)
        base = (MH._act("a base term", 7),)
        got = MOE.sparse_forward_moments(run, sched, base)
        want = tuple(Moment("forward", name, (*base, *tail)) for name, tail in MOE._sparse_forward_tails(run, sched))
        assert got == want and [m.name for m in got] == [m.name for m in want]
        seen += len(want)
    assert seen
