"""Offload placement and traffic, exact bytes (Ren et al. 2021 sec. 4; Rajbhandari et al. 2021 sec. 5).

Ψ = 1,000 elements on N_d = 4 ranks, bf16 parameters and gradients, fp32 master + Adam m, v (K = 12):
a rank's shard is 250 elements.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroplan.formulas.memory import model_states
from zeroplan.formulas.offload import Offload, offloaded_states
from zeroplan.formulas.optimizers import optimizer_states
from zeroplan.planning.plan import LADDER

ADAM = optimizer_states("adam")


def place(stage, offload, micro_steps=1):
    return offloaded_states((1000,), 4, stage, offload, 2, 2, ADAM, "fp32", micro_steps, flat_layout=False)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_offload_is_the_core_model(stage):
    b = place(stage, Offload())
    assert b.gpu == model_states((1000,), 4, stage, 2, 2, ADAM, "fp32", flat_layout=False)
    assert (b.host_bytes, b.nvme_bytes, b.h2d_bytes, b.d2h_bytes, b.nvme_read_bytes, b.nvme_write_bytes) == (
        0,
    ) * 6


def test_zero_offload_stage2():
    # Ren et al. sec. 4.2: GPU keeps 2Ψ of 16-bit params; CPU holds (12 + 2)Ψ/N_d; PCIe 2Ψ/N_d each way.
    b = place(2, Offload("cpu"))
    assert (b.gpu.params_bytes, b.gpu.grads_bytes, b.gpu.optimizer_bytes) == (2000, 0, 0)
    assert b.host_bytes == 250 * (12 + 2) == 3500
    assert (b.d2h_bytes, b.h2d_bytes) == (500, 500)
    assert b.nvme_bytes == 0


def test_stage2_offload_copies_gradients_every_micro_step():
    b = place(2, Offload("cpu"), micro_steps=4)
    assert (b.d2h_bytes, b.h2d_bytes) == (4 * 500, 500)


def test_stage1_offload_keeps_full_gradients_and_copies_once():
    b = place(1, Offload("cpu"), micro_steps=4)
    assert (b.gpu.params_bytes, b.gpu.grads_bytes, b.gpu.optimizer_bytes) == (2000, 2000, 0)
    assert (b.host_bytes, b.d2h_bytes, b.h2d_bytes) == (3500, 500, 500)


def test_stage3_cpu_offload_of_optimizer_and_params():
    b = place(3, Offload("cpu", "cpu"), micro_steps=2)
    assert b.gpu.model_states_bytes == 0
    assert b.host_bytes == 250 * (12 + 2 + 2) == 4000
    assert b.h2d_bytes == 500 * 2 * 2  # params fetched for forward and backward, every micro-step
    assert b.d2h_bytes == 500 * 2  # gradient partitions, every micro-step


def test_zero_infinity_nvme():
    # Rajbhandari et al. 2021 sec. 5: optimizer states and parameters on NVMe, gradients staged in CPU.
    b = place(3, Offload("nvme", "nvme"))
    assert b.gpu.model_states_bytes == 0
    assert (b.host_bytes, b.nvme_bytes) == (500, 3000 + 500)
    assert b.nvme_read_bytes == 3000 + 2 * 500
    assert b.nvme_write_bytes == 3000 + 500
    assert (b.h2d_bytes, b.d2h_bytes) == (2 * 500, 500)


def test_stage3_optimizer_nvme_only():
    b = place(3, Offload("nvme"))
    assert (b.gpu.params_bytes, b.gpu.grads_bytes, b.gpu.optimizer_bytes) == (500, 0, 0)
    assert (b.host_bytes, b.nvme_bytes, b.nvme_read_bytes, b.nvme_write_bytes) == (500, 3000, 3000, 3000)


def test_padding_applies_to_offloaded_shards():
    b = offloaded_states((1001,), 4, 2, Offload("cpu"), 2, 2, ADAM, "fp32", 1, flat_layout=True)
    assert b.host_bytes == 251 * 14  # ceil(1001 / 4) = 251 elements per rank


@pytest.mark.parametrize(
    ("stage", "offload", "message"),
    [
        (0, Offload("cpu"), "stage 1 or higher"),
        (2, Offload("nvme"), "NVMe needs ZeRO stage 3"),
        (2, Offload("cpu", "cpu"), "parameter offload needs ZeRO stage 3"),
    ],
)
def test_combinations_deepspeed_does_not_have(stage, offload, message):
    with pytest.raises(ValueError, match=message):
        place(stage, offload)


def test_unknown_device():
    with pytest.raises(ValueError, match="expected one of none, cpu, nvme"):
        Offload("disk")


# Offload moves bytes, it does not create them, except at stage 1 where the full gradients stay on the GPU
# and the CPU optimizer reads its own copy of the partition (Ren et al. 2021, sec. 4).


@settings(max_examples=100, deadline=None)
@given(numels=st.lists(st.integers(1, 10**6), min_size=1, max_size=6), nd=st.integers(1, 256),
       option=st.sampled_from(LADDER), micro_steps=st.integers(1, 8))  # fmt: skip
def test_offload_moves_bytes(numels, nd, option, micro_steps):
    stage, offload = option
    base = offloaded_states(tuple(numels), nd, stage, Offload(), 2, 2, ADAM, "fp32", micro_steps)
    moved = offloaded_states(tuple(numels), nd, stage, offload, 2, 2, ADAM, "fp32", micro_steps)
    assert moved.gpu.model_states_bytes <= base.gpu.model_states_bytes
    total = moved.gpu.model_states_bytes + moved.host_bytes + moved.nvme_bytes
    extra = 2 * sum(-(-n // nd) for n in numels) if stage == 1 and offload.any else 0  # host's gradient copy
    assert total == base.gpu.model_states_bytes + extra


def test_zero_offload_single_v100():
    # Ren et al. 2021 (abstract): ZeRO-Offload trains models of over 13B parameters on a single 32 GB V100.
    # Model states alone bound that at 2Ψ <= 32e9 (16B; DDP: 16Ψ <= 32e9, 2B); the measured size sits
    # below the bound by the activations and buffers the paper also had to fit.
    from zeroplan.planning.plan import max_params

    from zeroplan.planning.plan import rank_states

    offload = max_params(32 * 10**9, 2, nd=1, offload=Offload("cpu"))
    ddp = max_params(32 * 10**9, 0, nd=1)
    assert (offload, ddp) == (16 * 10**9, 2 * 10**9)
    # The paper's 13B: 16-bit parameters (2Ψ) stay on the GPU; 16-bit gradients and the fp32 master,
    # momentum and variance (2Ψ + 12Ψ) go to the host (sec. 4.1), and 2Ψ each way per step (sec. 4.2).
    psi = 13 * 10**9
    s = rank_states((psi,), 1, 2, Offload("cpu"), flat_layout=False)
    assert (s.gpu.params_bytes, s.gpu.grads_bytes, s.gpu.optimizer_bytes) == (2 * psi, 0, 0)
    assert (s.host_bytes, s.h2d_bytes, s.d2h_bytes) == (14 * psi, 2 * psi, 2 * psi)


# ---- the peak of an offload option (zeroplan.planning.offload_peak) ----

from zeroplan.engines import reference as R  # noqa: E402
from zeroplan.formulas.cuda_workspaces import library_workspaces  # noqa: E402
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES, Moment, peak_of  # noqa: E402
from zeroplan.planning.offload_peak import moved_names, offload_peak  # noqa: E402
from zeroplan.presets import resolve_model  # noqa: E402

OFFLOADS = [(s, o) for s, o in LADDER if o.any]
LLAMA = resolve_model("llama2-7b")


def _run(stage, checkpointing="none", grad_accum=1):
    return R.reference_run(LLAMA, 8, stage, 2, 512, checkpointing, True, stat_bytes=4, grad_accum=grad_accum)


def _peak(moments):
    resident = (library_workspaces((9, 0), LLAMA.biased_linear),)
    return peak_of(moments, CUDA_BLOCK_BYTES, resident=resident)


@pytest.mark.parametrize("stage, offload", OFFLOADS)
@pytest.mark.parametrize("checkpointing, grad_accum", [("none", 1), ("full", 2)])
def test_offload_peak_is_the_peak_of_the_moments_with_the_terms_moved(stage, offload, checkpointing, grad_accum):
    """Taking the moved terms off each phase's largest moment equals re-taking the peak over every moment
    without them (after init): they are live at every moment there."""
    moments = R.moments(_run(stage, checkpointing, grad_accum))
    names = moved_names(stage, offload)
    kept = [m if m.phase == "init" else Moment(m.phase, m.name, tuple(t for t in m.terms if not t.name.startswith(names)))
            for m in moments]  # fmt: skip
    got = offload_peak(_peak(moments), stage, offload, CUDA_BLOCK_BYTES)
    assert got.by_phase() == _peak(kept).by_phase()
    assert got.peak_bytes == _peak(kept).peak_bytes and got.peak_phase == _peak(kept).peak_phase


@pytest.mark.parametrize("stage, offload", OFFLOADS)
def test_offload_peak_moves_what_offloaded_states_moves(stage, offload):
    """After init the GPU loses exactly the model states ``offloaded_states`` puts on the host (plus Adam's
    4-byte step and the optimizer step's fp32 gradient and temporaries), and every moved name exists."""
    run = _run(stage)
    names = moved_names(stage, offload)
    terms = {t.name for m in R.moments(run) for t in m.terms}
    assert all(any(t.startswith(n) for t in terms) for n in names)
    base = _peak(R.moments(run))
    got = offload_peak(base, stage, offload, CUDA_BLOCK_BYTES)
    numels = tuple(n for u in run.units for n in u)
    policy_states = optimizer_states("adam")
    on_gpu = offloaded_states(numels, 8, stage, Offload(), 2, 2, policy_states, "fp32").gpu.model_states_bytes
    placed = offloaded_states(numels, 8, stage, offload, 2, 2, policy_states, "fp32").gpu.model_states_bytes
    forward = base.by_phase()["forward"] - got.by_phase()["forward"]
    assert 0 <= forward - (on_gpu - placed) <= 4 * CUDA_BLOCK_BYTES + R.ADAM_STEP_BYTES  # rounding, Adam's step
    assert got.by_phase()["init"] == base.by_phase()["init"]  # built as the runtime builds it


def test_no_offload_moves_nothing():
    base = _peak(R.moments(_run(3)))
    assert offload_peak(base, 3, Offload(), CUDA_BLOCK_BYTES) == base
    assert moved_names(1, Offload("cpu")) == ("fp32 master", "Adam m, v, step", "fp32 gradient of the master",
                                              "Adam temporaries")  # stage 1: the full gradients stay  # fmt: skip
    assert "16-bit gradient shard" in moved_names(2, Offload("cpu"))
    assert moved_names(3, Offload("cpu", "cpu"))[-1] == "16-bit parameter shard"
