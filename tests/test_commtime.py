"""Alpha-beta communication time against hand-computed cases (nccl-tests bus-bandwidth factors)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroplan.formulas.collectives import step_collectives
from zeroplan.formulas.commtime import (alpha_beta_time_s, engine_step_time, exposed_comm_s, latency_steps, ring_link,
                                        step_time)
from zeroplan.presets import LinkSpec

NVLINK = LinkSpec(name="nv", scope="intra", bandwidth_gbps=100, alpha_s=5e-6)
NIC = LinkSpec(name="nic", scope="inter", bandwidth_gbps=25, alpha_s=10e-6)


def test_ring_all_reduce_by_hand():
    # 1 GB over 8 ranks at 100 GB/s: 2·7/8·1e9/1e11 = 17.5 ms, plus 2·7 steps of 5 us = 70 us.
    assert alpha_beta_time_s("all-reduce", 1e9, 8, 1e11, 5e-6) == pytest.approx(0.0175 + 70e-6)


def test_reduce_scatter_and_all_gather_by_hand():
    # (n-1)/n·S/B + (n-1)α = 7/8·1e9/1e11 + 7·5e-6.
    for op in ("reduce-scatter", "all-gather"):
        assert alpha_beta_time_s(op, 1e9, 8, 1e11, 5e-6) == pytest.approx(0.00875 + 35e-6)


def test_tree_all_reduce_latency_is_logarithmic():
    assert latency_steps("all-reduce", 8, "tree") == 6  # 2·ceil(log2 8)
    assert latency_steps("all-reduce", 8, "ring") == 14
    assert latency_steps("reduce-scatter", 8, "tree") == 7  # NCCL trees only do all-reduce
    assert alpha_beta_time_s("all-reduce", 1e9, 8, 1e11, 5e-6, "tree") == pytest.approx(0.0175 + 30e-6)


def test_one_rank_costs_nothing():
    assert alpha_beta_time_s("all-reduce", 1e9, 1, 1e11, 5e-6) == 0.0


def test_ring_link_crosses_nodes():
    assert ring_link(8, 1, 8, NVLINK, NIC) is NVLINK
    crossing = ring_link(16, 1, 8, NVLINK, NIC)
    assert (crossing.bandwidth_gbps, crossing.alpha_s) == (25, 10e-6)
    assert ring_link(2, 8, 8, NVLINK, NIC).bandwidth_gbps == 25  # MP fills the node, DP peers are remote
    assert ring_link(2, 4, 8, NVLINK, NIC) is NVLINK  # two DP ranks of a 4-way MP model share a node


def collectives(stage, elements=8_000, nd=8):
    return step_collectives(stage, (elements,), nd, "bf16", "bf16")


def test_step_time_matches_the_formula():
    # Stage 3, Ψ = 8,000 bf16 elements on 8 ranks at 100 GB/s: each all-gather and the reduce-scatter
    # send 7 x 1,000 x 2 bytes; each call pays 7 steps of 5 us.
    t = step_time(3, collectives(3), 8, NVLINK)
    per_call = 14_000 / 1e11 + 7 * 5e-6
    assert [c.seconds_per_call for c in t.collectives] == pytest.approx([per_call] * 3)
    assert t.comm_s == pytest.approx(3 * per_call)
    assert t.comm_s == pytest.approx(3 * alpha_beta_time_s("all-gather", 16_000, 8, 1e11, 5e-6))


@pytest.mark.parametrize(
    ("stage", "calls"),
    [(0, [1]), (1, [1, 1]), (2, [4, 1]), (3, [4, 4, 4])],  # op order as in zeroplan.formulas.collectives.step_collectives
)
def test_gradient_accumulation_counts(stage, calls):
    # Stage 0/1 reduce once per optimizer step (DDP no_sync, DeepSpeed stage 1); stage 2 reduce-scatters
    # every micro-step; stage 3 also all-gathers every micro-step (DeepSpeed ZeRO-2/3).
    t = step_time(stage, collectives(stage), 8, NVLINK, grad_accum=4)
    assert [c.calls_per_step for c in t.collectives] == calls


def test_buckets_pay_latency_each():
    one = step_time(0, collectives(0), 8, NVLINK, bucket_numel=None)
    four = step_time(0, collectives(0), 8, NVLINK, bucket_numel=2_000)
    assert four.comm_s - one.comm_s == pytest.approx(3 * 14 * 5e-6)


def test_overlap_hides_backward_collectives_behind_backward_compute():
    t = step_time(0, collectives(0, elements=8 * 10**9), 8, NVLINK, compute_s=3.0)
    ar = t.collectives[0].seconds_per_call  # ≈ 0.28 s, under the 2 s of backward
    assert t.exposed_comm_s == 0.0
    slow = step_time(0, collectives(0, elements=8 * 10**9), 8, NVLINK, compute_s=0.3)
    assert slow.exposed_comm_s == pytest.approx(ar - 0.2)
    assert slow.step_s == pytest.approx(0.3 + ar - 0.2)


def test_optimizer_step_all_gather_is_never_hidden():
    t = step_time(2, collectives(2), 8, NVLINK, compute_s=100.0)
    gather = [c for c in t.collectives if c.collective.phase == "optimizer step"][0]
    assert t.exposed_comm_s == pytest.approx(gather.seconds)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_rows_per_optimizer_step_time_as_the_papers_rows(stage):
    # an engine's row counts one optimizer step (micro_steps calls summed): timed without multiplying again,
    # it gives the paper's per-micro-step rows' time and exposure (each micro-step's share behind its phase)
    G = 3
    paper = step_time(stage, collectives(stage), 8, NVLINK, G, bucket_numel=2_000, compute_s=0.01)
    engine_rows = tuple(
        type(t.collective)(t.collective.op, t.collective.phase, t.calls_per_step * t.collective.elements,
                           t.collective.dtype, t.calls_per_step * t.collective.bytes_per_rank, t.calls_per_step)
        for t in paper.collectives)  # fmt: skip
    engine = engine_step_time(engine_rows, 8, NVLINK, G, bucket_numel=2_000, compute_s=0.01)
    assert [t.calls_per_step for t in engine.collectives] == [t.calls_per_step for t in paper.collectives]
    assert engine.comm_s == pytest.approx(paper.comm_s) and engine.exposed_comm_s == pytest.approx(paper.exposed_comm_s)
    with pytest.raises(ValueError, match="runs in 2 micro-steps"):
        engine_step_time((type(engine_rows[0])("all-gather", "forward", 2, "fp32", 8, 2),), 8, NVLINK, G)

def test_exposed_with_accumulation_by_hand():
    # Stage 3, 2 micro-steps, compute 3 s per step: per micro-step forward 0.5 s, backward 1 s.
    t = step_time(3, collectives(3), 8, NVLINK, grad_accum=2)
    timed = tuple(t.collectives)
    per_call = timed[0].seconds_per_call
    assert exposed_comm_s(timed, 3.0, 2) == 0.0
    # With 0.3 s of compute: forward 0.05 s, backward 0.1 s per micro-step.
    expected = 2 * (max(0, per_call - 0.05) + max(0, 2 * per_call - 0.1))
    assert exposed_comm_s(timed, 0.3, 2) == pytest.approx(expected)


def test_bad_inputs():
    with pytest.raises(ValueError, match="grad_accum=0"):
        step_time(0, collectives(0), 8, NVLINK, grad_accum=0)
    with pytest.raises(ValueError, match="algorithm='mesh'"):
        latency_steps("all-reduce", 8, "mesh")


@settings(max_examples=100, deadline=None)
@given(stage=st.integers(0, 3), elements=st.integers(1, 10**10), nd=st.integers(2, 1024),
       grad_accum=st.integers(1, 16), gbps=st.floats(1, 1000))  # fmt: skip
def test_time_grows_with_accumulation_and_shrinks_with_bandwidth(stage, elements, nd, grad_accum, gbps):
    link = LinkSpec(name="l", scope="intra", bandwidth_gbps=gbps, alpha_s=5e-6)
    faster = LinkSpec(name="f", scope="intra", bandwidth_gbps=2 * gbps, alpha_s=5e-6)
    cs = collectives(stage, elements, nd)
    t = step_time(stage, cs, nd, link, grad_accum)
    assert step_time(stage, cs, nd, link, grad_accum + 1).comm_s >= t.comm_s
    assert step_time(stage, cs, nd, faster, grad_accum).comm_s < t.comm_s
    # Overlap never makes communication negative nor larger than running it back to back.
    exposed = exposed_comm_s(t.collectives, 1.0, grad_accum)
    assert 0 <= exposed <= t.comm_s + 1e-12


def _row_by_row(rows, nd, links, grad_accum, bucket_numel, compute_s):
    """``engine_step_time`` as it was before ``distinct_rows``: every row placed and timed on its own."""
    from zeroplan.formulas.collectives import on_mesh
    from zeroplan.formulas.commtime import TimedCollective, _call_seconds, _step_time
    from zeroplan.formulas.sharding import ceil_div

    placed = [(c, links.of(c.link)) for c in on_mesh(rows, nd, links.nm, links.gpus_per_node)]
    timed = tuple(TimedCollective(c, c.micro_steps > 1, c.micro_steps, _call_seconds(
        c.op, ceil_div(c.elements, c.micro_steps), c.bytes_per_rank / c.micro_steps, c.group_size or nd, on, "ring",
        bucket_numel)) for c, on in placed)  # fmt: skip
    slowest = min((on for _, on in placed), key=lambda on: on.bandwidth_gbps, default=links.intra)
    return _step_time(slowest, "ring", timed, compute_s, grad_accum)


def test_equal_rows_are_timed_once_and_the_step_is_the_row_by_row_one():
    """``engine_step_time`` times each distinct row once (``collectives.distinct_rows``: by object, then by value)
    and gives equal rows one ``TimedCollective``: the step (every row, its seconds, the sums over them in order, the
    limiting link) is the row-by-row one to the bit; rows that differ in one field (the group, the micro-steps, the
    dimension, the bytes) stay apart; ``counted_rows``' integer sums are the sums over every row."""
    from zeroplan.formulas.collectives import Collective, counted_rows, distinct_rows
    from zeroplan.formulas.commtime import Links

    ag = Collective("all-gather", "forward", 10_000_019, "bf16", 17_500_033, 4, group_size=64)
    rows = (ag, ag, Collective("all-gather", "forward", 10_000_019, "bf16", 17_500_033, 4, group_size=64),  # equal
            Collective("all-gather", "forward", 10_000_019, "bf16", 17_500_033, 4, group_size=8),  # another group
            Collective("all-gather", "forward", 10_000_019, "bf16", 17_500_033, 1, group_size=64),  # once
            Collective("all-gather", "backward", 10_000_019, "bf16", 17_500_035, 4, group_size=64),
            Collective("all-reduce", "backward", 312_500, "fp32", 2_460_937, 1, "dp_replicate", 16),
            Collective("all-reduce", "forward", 7_340_033, "bf16", 25_690_115, 4, "tp", 8),
            *(Collective("reduce-scatter", "backward", 10_000_019, "fp32", 35_000_067, 1, group_size=64)
              for _ in range(300)),
            ag)  # fmt: skip
    kinds, index = distinct_rows(rows)
    assert len(kinds) == 7 and [kinds[i] for i in index] == list(rows)
    counted = counted_rows(rows)
    assert sum(n for _, n in counted) == len(rows)
    assert sum(c.bytes_per_rank * n for c, n in counted) == sum(c.bytes_per_rank for c in rows)
    links = Links(NVLINK, NIC, 8)
    for nd, bucket, compute in ((8192, None, 3.0), (8192, 1_000_003, 0.25), (1024, None, None)):
        got = engine_step_time(rows, nd, links, 4, "ring", bucket, compute)
        want = _row_by_row(rows, nd, links, 4, bucket, compute)
        assert got == want and got.comm_s == want.comm_s and got.exposed_comm_s == want.exposed_comm_s
        assert len({id(t) for t in got.collectives}) == 7  # one TimedCollective per distinct row
