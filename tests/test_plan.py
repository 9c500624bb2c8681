"""zeroplan.plan: fit, minimum GPUs, maximum model size and the recommendation."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import zeroplan
from zeroplan.formulas.offload import Offload
from zeroplan.planning.plan import MAX_GPUS, fits, max_params, min_gpus, rank_states

GB = 10**9
stages = st.integers(min_value=0, max_value=3)
numel_lists = st.lists(st.integers(min_value=1, max_value=10**6), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(stage=stages, nd=st.integers(1, 512), budget=st.integers(10**3, 10**12))
def test_max_params_grows_with_gpus_and_memory(stage, nd, budget):
    m = max_params(budget, stage, nd)
    assert max_params(budget, stage, nd + 1) >= m
    assert max_params(2 * budget, stage, nd) >= m
    assert fits(rank_states((m,), nd, stage, flat_layout=False), budget) or m == 0
    assert not fits(rank_states((m + 1,), nd, stage, flat_layout=False), budget)


@settings(max_examples=60, deadline=None)
@given(numels=numel_lists, stage=stages, budget=st.integers(10**4, 10**8), nm=st.sampled_from([1, 2, 4]))
@example(numels=[1, 1, 1, 485, 1741, 14953], stage=2, budget=10_000, nm=4)  # padding keeps every N_d over
def test_min_gpus_is_the_smallest_that_fits(numels, stage, budget, nm):
    got = min_gpus(tuple(numels), budget, stage, nm)
    local = tuple(-(-n // nm) for n in numels)

    def ok(nd, flat_layout=True):
        return fits(rank_states(local, nd, stage, flat_layout=flat_layout), budget)

    if got is None:
        # None when no N_d fits: either not even the most GPUs searched without padding (the least memory),
        # or padding, which at stages 0-2 grows with N_d (full buffers padded to a multiple of N_d), keeps
        # every N_d over the budget (hypothesis found numels=[1, 1, 1, 485, 1741, 14953], stage 2, budget
        # 10,000 B, N_m = 4: N_d >= 45 fits without padding, no N_d up to 20,000 with it)
        assert not any(ok(nd) for nd in range(1, min(MAX_GPUS // nm, 300) + 1))
        return
    assert min_gpus(tuple(numels), 2 * budget, stage, nm) <= got  # what fits a budget fits a larger one

    assert got % nm == 0 and ok(got // nm)
    assert not any(ok(nd) for nd in range(1, min(got // nm, 300)))


def test_stage0_and_1_can_never_fit():
    # 16 bytes/param replicated at stage 0; 4 bytes/param (params + grads) replicated at stage 1.
    assert min_gpus((10**9,), 15 * GB, 0) is None
    assert min_gpus((10**9,), 3 * GB, 1) is None
    assert min_gpus((10**9,), 16 * GB, 0) == 1
    assert min_gpus((10**9,), 16 * GB, 3) == 1
    assert min_gpus((10**9,), 1 * GB, 3) == 16


def test_llama2_70b_on_h100():
    # selective recomputation has no peak model: fits on model states within the headroom, as the paper
    p = zeroplan.plan("llama2-70b", gpu="h100-80gb", gpus=64, checkpointing="selective", headroom=0.1)
    assert "fits on model states" in p.fit_basis and p.cut_first is None
    assert p.params == 68_976_648_192
    assert [o.fits for o in p.stages] == [False, False, False, True]
    assert [o.min_gpus for o in p.stages[:3]] == [
        None,
        None,
        None,
    ]  # 2Ψ params alone exceed 72 GiB at stage 2
    s3 = p.option(3)
    assert p.recommendation is s3
    # 16 bytes x ceil(n / 64) per tensor must stay under 0.9 x 80 GiB: 16 x 69.0e9 / 72 GiB -> 15 GPUs.
    assert s3.min_gpus == 15
    assert s3.states.gpu.model_states_bytes <= p.budget_bytes


def test_recommendation_respects_the_offload_allowed():
    p = zeroplan.plan("llama2-70b", gpu="h100-80gb", gpus=8, checkpointing="selective", headroom=0.1)
    assert p.recommendation is None
    assert "fewest GPUs that fit: 15 with stage 3" in p.reason
    cpu = zeroplan.plan("llama2-70b", gpu="h100-80gb", gpus=8, offload="cpu", checkpointing="selective")
    assert (cpu.recommendation.stage, cpu.recommendation.offload) == (3, Offload("cpu"))


def test_lowest_stage_that_fits_wins():
    # Llama 3 8B on 8 x A100 80GB: stage 0 needs 128 GB; stage 1 4Ψ + 12Ψ/8 ≈ 44 GB fits 72 GiB.
    p = zeroplan.plan("llama3-8b", gpu="a100-80gb", gpus=8)
    assert p.recommendation.stage == 1 and not p.recommendation.offload.any


def test_host_memory_limits_offload():
    big = zeroplan.plan("llama2-7b", gpu="a100-40gb", gpus=4, offload="cpu")
    small_host = zeroplan.plan("llama2-7b", gpu="a100-40gb", gpus=4, offload="cpu", host_memory_bytes=10**9)
    assert big.recommendation.label == "1 + optimizer->cpu" and small_host.recommendation is None


def test_never_recommends_what_its_own_peak_contradicts():
    """Issue 16: 70B on 64 H100s with CPU offload was "stage 3 + optimizer->cpu: fits" beside a 140 GiB
    stage-3 peak. Offload rows carry their stage's peak with the offloaded states on the host; the reference
    runtime builds the whole 16-bit model on every rank (128 GiB at init), so nothing fits."""
    p = zeroplan.plan("llama2-70b", gpu="h100-80gb", gpus=64, offload="cpu")
    assert p.recommendation is None and all(o.peak is not None for o in p.options)
    for o in p.offload_options:
        assert o.fits == (o.peak.peak_bytes <= p.budget_bytes and o.states.gpu.model_states_bytes <= p.budget_bytes)
        assert o.peak.peak_bytes <= p.option(o.stage).peak.peak_bytes
    s3, s3cpu = p.option(3), p.option(3, Offload("cpu"))
    assert s3cpu.peak.by_phase()["init"] == s3.peak.by_phase()["init"] == s3cpu.peak.peak_bytes
    assert s3cpu.peak.by_phase()["forward"] < s3.peak.by_phase()["forward"]
    for kw in (dict(gpu="a100-40gb", gpus=4), dict(gpu="h100-80gb", gpus=1), dict(gpu="h100-80gb", gpus=64)):
        rec = zeroplan.plan("llama2-7b", offload="nvme", **kw).recommendation
        assert rec is not None and rec.peak.peak_bytes <= zeroplan.plan("llama2-7b", **kw).budget_bytes


def test_host_bytes_per_node_scale_with_gpus_per_node_not_total():
    a = zeroplan.plan(params=8e9, gpu="h100-80gb", gpus=64, gpus_per_node=8)
    b = zeroplan.plan(params=8e9, gpu="h100-80gb", gpus=64, gpus_per_node=4)
    ha = a.option(2, Offload("cpu")).states.host_bytes
    assert ha == b.option(2, Offload("cpu")).states.host_bytes == 125_000_000 * 14  # 14 bytes x Ψ/64 per GPU


def test_compute_estimate_and_comm_per_step():
    p = zeroplan.plan(params=1e9, gpu="h100-80gb", gpus=8, micro_batch=2, seq_len=1024, grad_accum=4)
    assert p.tokens_per_step == 2 * 1024 * 4
    s0 = p.option(0)
    assert s0.time.compute_s == pytest.approx(6 * 1e9 * 8192 / (989.4e12 * 0.4))
    assert s0.comm_volume_elements == 2 * 10**9  # paper's 2Ψ per step, once per optimizer step
    assert p.option(2).comm_volume_elements == 4 * 10**9 + 10**9  # reduce-scatter x 4 + one all-gather


def test_integral_float_bytes_are_accepted():
    assert zeroplan.plan(gpu_memory_bytes=32e9, gpus=64).option(3).max_params == 128 * 10**9


def test_no_model_reports_only_sizes():
    p = zeroplan.plan(gpu="h100-80gb", gpus=8)
    assert p.recommendation is None and p.option(3).fits is None
    assert p.option(0).max_params == 80 * 2**30 // 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(gpu="h100-80gb", headroom=1.0), r"headroom=1.0: must be a fraction in \[0, 1\)"),
        (dict(gpu="h100-80gb", headroom=-0.1), r"headroom=-0.1"),
        (dict(gpu="h100-80gb", bw_gbps=-5), "bw_gbps=-5: must be a positive finite number"),
        (dict(gpu="h100-80gb", inter_bw_gbps=0), "inter_bw_gbps=0: must be a positive"),
        (dict(gpu="tpu-v5"), "known gpus are v100-32gb"),
        (dict(gpu="h100-80gb", interconnect="ib-ndr"), "expected an intra-node link"),
        (dict(gpu="h100-80gb", inter_interconnect="nvlink4"), "expected an inter-node link"),
        (dict(), "give a GPU preset"),
        (dict(gpu="h100-80gb", gpus=12, model_parallel=8), "does not divide gpus=12"),
        (dict(gpu="h100-80gb", gpus=0), "gpus=0: must be >= 1"),
        (dict(gpu="h100-80gb", mfu=0), r"mfu=0"),
        (dict(gpu="h100-80gb", offload="disk"), "offload"),
        (dict(gpu="h100-80gb", grad_accum=2.5), "grad_accum=2.5: must be a whole number"),
        (dict(gpu="h100-80gb", params=1e9, model="llama2-7b"), "at most one of model and params"),
        (dict(gpu="h100-80gb", model="llama9"), "known models are"),
    ],
)
def test_bad_inputs(kwargs, message):
    with pytest.raises((ValidationError, ValueError), match=message):
        zeroplan.plan(**kwargs)
