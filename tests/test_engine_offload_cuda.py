"""The DeepSpeed profile on a GPU (issue 21, "Memory outside PyTorch's allocator"): ``Settings.device`` cuda (the
planner's default) rounds every tensor to the caching allocator's 512-byte blocks and holds the cuBLAS / cuBLASLt
workspaces from the first backward on (``formulas.cuda_workspaces``, FSDP2's rule), in the peak and in the
allocation trace; cpu (the validator's gloo rows) neither. gpt-tiny (validate/models.py): Ψ = 36,324, biased Linears.
"""

from __future__ import annotations

import pytest

from tests.clicheck import assert_one_line_error, run, run_json
from zeroplan.engines import deepspeed as D
from zeroplan.formulas.cuda_workspaces import CUBLAS_WORKSPACE_OTHER_BYTES, CUBLASLT_WORKSPACE_BYTES

H100_WORKSPACES = 2 * 32 * 2**20 + 2**20  # two 32-MiB cuBLAS workspaces (Hopper) and cuBLASLt's 1 MiB
A100_WORKSPACES = 2 * CUBLAS_WORKSPACE_OTHER_BYTES + CUBLASLT_WORKSPACE_BYTES  # 2 x 8.125 MiB + 1 MiB


def _workload():
    from validate.engines.deepspeed_compare import workload_for

    return workload_for("gpt-tiny", 2, None)


def _by_hand(moments, phase: str, resident: int) -> int:
    """Each tensor of each moment rounded up to 512 B, the largest moment of ``phase``, plus the workspaces."""
    return max(sum(t.tensors * -(-(-(-t.bytes // t.tensors)) // 512) * 512 for t in m.terms if t.bytes)
               for m in moments if m.phase == phase) + resident  # fmt: skip


@pytest.mark.parametrize("config", [
    {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5000}},
    {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5000}, "bf16": {"enabled": True}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True}},
])  # fmt: skip
def test_cuda_rounds_every_tensor_and_holds_the_workspaces_after_init(config):
    w = _workload()
    cpu = D.Settings.from_ds_config(config, zero_init=False)
    assert (cpu.device, cpu.cuda_capability) == ("cpu", (9, 0))  # built directly: bytes as allocated
    cuda = cpu.model_copy(update={"device": "cuda"})
    (on_gpu,), (on_cpu,) = D.estimate(w, 2, cuda), D.estimate(w, 2, cpu)
    moments = D.moments(D.ds_run(cpu.model_copy(update={"rank": on_cpu.peak_rank}), w, 2))
    phases = on_cpu.peak.by_phase()
    assert phases == {p: max(m.total() for m in moments if m.phase == p) for p in phases}  # cpu: as allocated
    gpu_moments = D.moments(D.ds_run(cuda.model_copy(update={"rank": on_gpu.peak_rank}), w, 2))
    for phase, got in on_gpu.peak.by_phase().items():
        assert got == _by_hand(gpu_moments, phase, 0 if phase == "init" else H100_WORKSPACES), phase
    assert on_gpu.peak.by_phase()["backward"] - on_cpu.peak.by_phase()["backward"] >= H100_WORKSPACES
    a100 = D.estimate(w, 2, cuda.model_copy(update={"cuda_capability": (8, 0)}))[0].peak.by_phase()
    assert {p: on_gpu.peak.by_phase()[p] - a100[p] for p in a100} == {
        "init": 0, **{p: H100_WORKSPACES - A100_WORKSPACES for p in ("forward", "backward", "optimizer_step")}}


def test_the_allocation_trace_holds_the_workspaces_on_cuda_only():
    """The allocator model sees what the peak counts: the trace's live bytes per phase are the estimate's, on both
    devices (``AllocTrace.phase_live_bytes``), the workspaces allocated once after init on CUDA."""
    w = _workload()
    cuda = D.Settings(stage=2, reduce_bucket_size=5000, allgather_bucket_size=5000, device="cuda")
    cpu = cuda.model_copy(update={"device": "cpu"})
    for s in (cuda, cpu):
        (trace,), (est,) = D.alloc_traces(w, 2, s), D.estimate(w, 2, s)
        assert trace.phase_live_bytes == est.peak.by_phase() and trace.block_bytes == (512 if s is cuda else 1)
    gpu_live, cpu_live = (D.alloc_traces(w, 2, s)[0].phase_live_bytes for s in (cuda, cpu))
    assert gpu_live["backward"] - cpu_live["backward"] >= H100_WORKSPACES > gpu_live["init"] - cpu_live["init"]


def test_device_is_deepspeeds_own_option_on_estimate():
    """A planner predicts the GPU (``plan.on_device``: cuda unless ``--device cpu``), and the ``--gpu`` preset's compute
    capability reaches DeepSpeed's Settings: an A100 (8.0) holds 8.125-MiB cuBLAS workspaces, an H100 32-MiB ones; a
    bad device is one line."""
    from zeroplan.engines.base import PlannerOptions

    assert D.planner_settings(PlannerOptions(stage=2)).device == "cuda"
    assert D.planner_settings(PlannerOptions(stage=2, device="cpu")).device == "cpu"
    args = ("estimate", "--engine", "deepspeed", "--model", "llama2-7b", "--gpus", "8", "--stage", "3")
    (gpu,), (cpu,) = run_json(*args)["stages"], run_json(*args, "--device", "cpu")["stages"]
    (a100,) = run_json(*args, "--gpu", "a100-80gb")["stages"]
    assert gpu["peak_bytes"] - a100["peak_bytes"] == H100_WORKSPACES - A100_WORKSPACES
    # forward: Llama's Linears have no bias (no cuBLASLt); the backward on the CPU holds gloo's reduce-scatter copies
    # (zero3.py _epilogue_reduce_scatter, _in_block_reductions: none with NCCL), here more than the workspaces
    assert gpu["phases"]["forward"] - cpu["phases"]["forward"] >= 2 * 32 * 2**20
    assert_one_line_error(run(*args, "--device", "tpu"), "device='tpu': expected cuda or cpu")
