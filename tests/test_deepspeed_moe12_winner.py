"""ZeRO-1/2's sparse (mixture-of-experts) hook reductions pick the rank holding the most from integer sums and build
only the winner's terms (``moe12_hooks._rank_holding_most``, ``moe12_winners``; issue 16's plan speed: DeepSeek-V3
on 1,024 GPUs built ~240,000 options). Checked here against the loops they replaced (kept below as the reference:
every rank's option built, summed, ``max``'s first largest kept), moment for moment, on transformers' MoE families
(the measured "wide" models of 5-11M parameters and real sizes), ZeRO-1 with overlap_comm (its kept gradients) and
ZeRO-2, bucket sizes that put experts above and below the bucket, N_d 2-64, every rank at once and one rank named,
with and without offload_optimizer; and the winning rank against the plain loop on ties."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_deepspeed_moe import CONFIGS as WIDE
from tests.test_deepspeed_winners import _last_and_inflight
from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed import Settings, ds_run
import zeroplan.engines.deepspeed.moe12_hooks as MH
from zeroplan.engines.deepspeed.layout_ranks import _hook_buckets
from zeroplan.engines.deepspeed.moe_offload import norm_copy, norms_at_hooks
from zeroplan.engines.deepspeed.offload_settings import OffloadTarget
from zeroplan.engines.deepspeed.reduce import GIP_SRC
from zeroplan.engines.deepspeed.run import _pbytes
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES
from zeroplan.engines.deepspeed.zero12 import _stage1_kept_gradients
from zeroplan.formulas.peak import Moment, Term

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"


def _reference_rank_holding_most(run, kept, copy, firsts, j, b):
    """``_rank_holding_most`` as it was (main at 8d3aa18): every rank's option built, the first largest kept."""
    order, _, first_of_bucket, _ = _hook_buckets(run)
    if norms_at_hooks(run):
        params = order[first_of_bucket[b]:first_of_bucket[b + 1]]
        options = [(max(copy, norm_copy(run, r, params), key=lambda t: t.bytes),) for r in run.ranks]
    else:
        options, p = [(copy,)], _pbytes(run)
        for r, first in firsts.items():
            if first > b:
                continue
            gip = Term("grads_in_partition", run.flat.params_numel(r) * p, GIP_SRC)
            own = (gip, copy) if first < b else (max(gip, copy, key=lambda t: t.bytes),)
            options.append((*MH._stage1_kept(run, kept, r, j, b, order, first_of_bucket), *own))
    return max(options, key=lambda terms: sum(t.bytes for t in terms))


def _reference_gate_up_backward(run, base, kept, firsts):
    """``_gate_up_backward`` as it was (main at 8d3aa18): each held rank's ``_stage1_kept`` built and summed."""
    roles, order, (_, _, first_of_bucket, bucket_of) = MH._roles(run), run.grad_ready_order, _hook_buckets(run)
    p, a, spec, limit = _pbytes(run), DTYPE_BYTES[run.settings.dtype], run.spec, run.settings.reduce_bucket_size
    pos = {i: k for k, i in enumerate(order)}
    s_rows = MH._tokens(run) * spec.moe.top_k
    out = []
    for gu in (i for i, role in roles.items() if role == "gate_up"):
        j, at = run.param_blocks[gu], pos[gu]
        b = bucket_of[order[at - 1]]  # the bucket filling when the gate-up backward runs
        held = [r for r, first in firsts.items()
                if first + 1 < len(first_of_bucket) and first_of_bucket[first + 1] < at]
        if not held:
            continue
        down = sum(run.numels[i] for i in order[first_of_bucket[b]:at]
                   if roles.get(i) == "down" and run.numels[i] > limit)
        r = max(held, key=lambda r: run.flat.params_numel(r) + sum(t.bytes for t in MH._stage1_kept(
            run, kept, r, j, b, order, first_of_bucket)))
        out.append(Moment("backward", f"block {j} gate-up backward, rank {r}'s grads_in_partition held", (
            *MH.B.held_at(run, base, at), MH._blocks_saved(run, j), *MH._at_hook(run, j, "gate_up"),
            MH._act("the gate-up matmul's saved input and its output's gradient",
                    s_rows * spec.d_model * a + s_rows * 2 * spec.moe.expert_ffn * a, 2),
            Term("down_proj's gradient larger than the bucket (waiting)", down * p,
                 f"{MH.SRC} reduce_ipg_grads (extra_large_param_to_reduce)"),
            Term("gate_up_proj's gradient", run.numels[gu] * p, "autograd (grouped_mm backward)"),
            *MH._stage1_kept(run, kept, r, j, b, order, first_of_bucket),
            Term("grads_in_partition", run.flat.params_numel(r) * p, GIP_SRC))))
    return tuple(out)



CASES = [  # (model, stage, bucket, N_d, rank, offload): the measured "wide" models (5-11M parameters) at the
    # measured rows' buckets (tests/test_deepspeed_moe12.py) and more ranks, then real sizes
    ("qwen3-moe-wide", 2, 50_000, 3, None, False), ("qwen3-moe-wide", 1, 150_000, 4, None, False),
    ("qwen3-moe-wide", 1, 100_000, 7, 2, False), ("qwen3-moe-wide", 1, 30_000, 5, None, False),
    ("qwen3-moe-wide", 1, 50_000, 2, None, False), ("qwen2-moe-wide", 2, 100_000, 4, None, False),
    ("qwen2-moe-wide", 1, 300_000, 3, None, False), ("qwen2-moe-wide", 1, 50_000, 16, None, False),
    ("mixtral-wide", 2, 300_000, 4, None, False), ("mixtral-wide", 1, 200_000, 7, None, False),
    ("mixtral-wide", 2, 300_000, 2, None, True), ("deepseek-wide", 2, 50_000, 4, None, False),
    ("deepseek-wide", 1, 100_000, 3, 1, False), ("deepseek-wide", 1, 300_000, 16, None, False),
    ("deepseek-wide", 2, 100_000, 2, None, True),
    ("qwen1.5-moe-a2.7b", 1, 50_000_000, 64, None, False), ("mixtral-8x7b-v0.1", 2, 200_000_000, 32, None, False),
    ("deepseek-v3", 1, 500_000_000, 64, None, False), ("deepseek-v3", 2, 50_000_000, 64, 5, False),
]


def _spec(model):
    return spec_from_hf_config(WIDE[model] if model in WIDE else json.loads((CONFIGS / f"{model}.json").read_text()))


@pytest.mark.parametrize("model, stage, bucket, nd, rank, offload", CASES)
def test_sparse_hook_winners_equal_every_option_built(model, stage, bucket, nd, rank, offload, monkeypatch):
    spec = _spec(model)
    workload = Workload(transformer_shapes(spec), spec, 16, 2, transformers=True)
    settings = Settings(stage=stage, overlap_comm=True, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                        rank=rank, offload_optimizer=OffloadTarget(device="cpu") if offload else OffloadTarget())
    run = ds_run(settings, workload, nd)
    last, inflight = _last_and_inflight(run)
    kept = _stage1_kept_gradients(run) if not settings.partition_gradients else {}
    assert bool(kept) == (stage == 1)
    got = MH.sparse_hook_partitions(run, last, inflight, kept)
    monkeypatch.setattr(MH, "_rank_holding_most", _reference_rank_holding_most)
    monkeypatch.setattr(MH, "_gate_up_backward", _reference_gate_up_backward)
    want = MH.sparse_hook_partitions(run, last, inflight, kept)
    assert want, "a case without sparse hook moments checks nothing"
    assert got == want
    assert [m.name for m in got] == [m.name for m in want]


def test_the_cases_have_ranks_holding_partitions_and_kept_gradients():
    """The cases reach the winner's three shapes: a rank's partition beside the copy (an earlier first bucket),
    the larger of the two (its first), and ZeRO-1's kept gradients larger than the bucket (non-zero)."""
    seen = set()
    for model, stage, bucket, nd, rank, offload in CASES:
        if offload:
            continue
        spec = _spec(model)
        run = ds_run(Settings(stage=stage, overlap_comm=True, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                              rank=rank), Workload(transformer_shapes(spec), spec, 16, 2, transformers=True), nd)
        last, inflight = _last_and_inflight(run)
        kept = _stage1_kept_gradients(run) if stage == 1 else {}
        for m in MH.sparse_hook_partitions(run, last, inflight, kept):
            names = [t.name for t in m.terms]
            if "grads_in_partition" in names:
                seen.add("partition and copy" if any("flattened" in n or "copy" in n for n in names
                                                     if n != "grads_in_partition") else "partition")
            if any(t.name.endswith("reduced before (kept)") and t.bytes for t in m.terms):
                seen.add("kept")
    assert {"partition", "kept"} <= seen, seen


@pytest.mark.parametrize("model, bucket, nd", [("qwen3-moe-wide", 50_000, 7), ("deepseek-wide", 100_000, 16),
                                               ("mixtral-wide", 300_000, 5), ("qwen2-moe-wide", 30_000, 64)])
def test_winner_without_kept_is_the_loops_first_largest_rank(model, bucket, nd):
    """``_winner_without_kept`` names the very rank the plain loop names (the first largest in rank order, the copy
    first of all), for every bucket and copy sizes that tie a partition, the copy, and a partition plus the copy
    with another's (equal partitions give equal terms, so the moments alone cannot tell tied ranks apart)."""
    spec = _spec(model)
    run = ds_run(Settings(stage=2, reduce_bucket_size=bucket, allgather_bucket_size=bucket),
                 Workload(transformer_shapes(spec), spec, 16, 2, transformers=True), nd)
    _, buckets, _, bucket_of = _hook_buckets(run)
    firsts = {r: min(bucket_of[i] for i in run.flat.params(r)) for r in run.ranks if run.flat.params(r)}
    p = _pbytes(run)
    gips = sorted({run.flat.params_numel(r) * p for r in firsts})
    copies = {0, 1, *gips, *(b - a for a in gips for b in gips if b > a)}
    ties = 0
    for b in range(len(buckets) + 1):
        for c in copies:
            best, winner = c, None
            for r, first in firsts.items():
                if first <= b:
                    gip = run.flat.params_numel(r) * p
                    total = gip + c if first < b else max(gip, c)
                    ties += total == best
                    if total > best:
                        best, winner = total, r
            assert MH._winner_without_kept(run, firsts, c, b) == winner, (b, c)
    assert ties, "no tie: the tie rule is not tested"


def _plain_winner(firsts, sizes, c, b):
    best, winner = c, None
    for r, first in firsts.items():
        if first <= b:
            total = sizes[r] + c if first < b else max(sizes[r], c)
            if total > best:
                best, winner = total, r
    return winner


def test_winner_without_kept_on_random_ties():
    """The same on 300 random rank -> (first bucket, partition) draws from few values (ties within a first bucket,
    across buckets, and between a partition plus the copy and another partition), every bucket and copy size."""
    rng = random.Random(16)
    for _ in range(300):
        n, nb = rng.randint(1, 12), rng.randint(1, 5)
        ranks = rng.sample(range(3 * n), n)  # firsts' order is the ranks' order, whatever their numbers
        firsts = {r: rng.randrange(nb) for r in ranks}
        numels = {r: rng.choice((0, 1, 2, 3)) for r in ranks}
        run = SimpleNamespace(memo={}, settings=SimpleNamespace(dtype="fp32"),
                              flat=SimpleNamespace(params_numel=numels.__getitem__, _params_numels=numels))
        sizes4 = {r: 4 * numels[r] for r in ranks}
        for b in range(nb + 1):
            for c in (0, 2, 4, 8, 12, 16):
                assert MH._winner_without_kept(run, firsts, c, b) == _plain_winner(firsts, sizes4, c, b), (firsts, b, c)


@pytest.mark.parametrize("model, stage, bucket, nd, rank, offload", CASES[:6] + CASES[-4:])
def test_sparse_block_start_equals_its_scan(model, stage, bucket, nd, rank, offload):
    """``moe12_ws.sparse_block_start`` reads each block's first ``gate_up_proj`` from a per-run table
    (``_first_gate_up``): the very position the scan over every role found (main at 8d3aa18), every block."""
    import zeroplan.engines.deepspeed.boundary as B
    from zeroplan.engines.deepspeed.moe12_ws import sparse_block_start

    spec = _spec(model)
    run = ds_run(Settings(stage=stage, overlap_comm=True, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                          rank=rank), Workload(transformer_shapes(spec), spec, 16, 2, transformers=True), nd)
    sparse = 0
    for j in range(run.acts.n_layer):
        gate_up = [i for i, role in MH._roles(run).items() if role == "gate_up" and run.param_blocks[i] == j]
        want = B.position(run, gate_up[0]) if gate_up and j in spec.moe.sparse_layers else B.block_start(run, j)
        assert sparse_block_start(run, j) == want, j
        sparse += bool(gate_up)
    assert sparse


@pytest.mark.parametrize("model, stage, bucket, nd, rank, offload", CASES)
def test_sparse_firsts_equal_the_per_rank_min(model, stage, bucket, nd, rank, offload):
    """``moe12_hooks._sparse_firsts`` (each rank's first hook bucket from ``layout_ranks._rank_first_buckets``, every
    rank's dict shared by the runs of a layout and bucket size) is the per-rank ``min`` it replaced (main at 9c9090d),
    key for key in rank order; twice, the second from the shared memo, every rank or the one named."""
    spec = _spec(model)
    for r in (rank, None, nd - 1):
        run = ds_run(Settings(stage=stage, overlap_comm=True, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                              rank=r), Workload(transformer_shapes(spec), spec, 16, 2, transformers=True), nd)
        bucket_of = _hook_buckets(run)[3]
        want = {q: min(bucket_of[i] for i in run.flat.params(q)) for q in run.ranks if run.flat.params(q)}
        for _ in range(2):
            assert list(MH._sparse_firsts(run).items()) == list(want.items())
