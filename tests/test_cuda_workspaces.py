"""CUDA library workspaces (``zeroplan.formulas.cuda_workspaces``): torch's sizes, checked against what an
H200 measured op by op (``tests/data/gpu/cuda_extras_h200.json``: ``python -m validate.cuda_extras`` on
torch 2.11.0+cu130, copied from the GPU run of 2026-11-30), and how the peak model carries them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroplan import estimate
from zeroplan.engines import fsdp2, reference
from zeroplan.engines.base import Workload
from zeroplan.estimation.workload import model_workload, resolve
from zeroplan.formulas.cuda_workspaces import (
    CUBLAS_WORKSPACE_OTHER_BYTES, CUBLAS_WORKSPACE_SM90_BYTES, cublas_workspace_bytes, library_workspaces,
)  # fmt: skip
from zeroplan.formulas.peak import Moment, Term, peak_of

GPT2 = str(Path(__file__).parent / "data" / "golden" / "inputs" / "gpt2-no-dropout.json")
MEASURED = json.loads((Path(__file__).parent / "data" / "gpu" / "cuda_extras_h200.json").read_text())
CASES = MEASURED["cases"]


def test_the_measurement_is_an_h200():
    assert MEASURED["meta"]["capability"] == [9, 0]
    assert MEASURED["meta"]["gpu"] == "NVIDIA H200"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_one_gemm_keeps_one_cublas_workspace_of_torchs_default_size(dtype):
    assert CASES[f"mm_{dtype}"]["kept"] == CUBLAS_WORKSPACE_SM90_BYTES == 32 * 2**20
    assert cublas_workspace_bytes((9, 0)) == CUBLAS_WORKSPACE_SM90_BYTES
    assert cublas_workspace_bytes((8, 0)) == CUBLAS_WORKSPACE_OTHER_BYTES == 8_519_680


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_step_keeps_two_cublas_and_one_cublaslt_workspace(dtype):
    forward_and_backward = CASES[f"mm_fwd_bwd_{dtype}"]["kept"]  # the Python and the autograd thread
    cublaslt = CASES[f"linear_bias_{dtype}"]["kept"] - CASES[f"mm_{dtype}"]["kept"]
    assert cublaslt == 2**20
    assert library_workspaces((9, 0), biased_linear=True).bytes == forward_and_backward + cublaslt
    assert library_workspaces((9, 0), biased_linear=False).bytes == forward_and_backward


def test_attention_and_the_loss_keep_nothing():
    for dtype in ("bf16", "fp32"):
        assert CASES[f"sdpa_causal_{dtype}"]["kept"] == 0
        assert CASES[f"cross_entropy_{dtype}"]["kept"] < 512


def test_resident_terms_join_every_phase_after_init():
    base = [Moment(p, "m", (Term("x", 1000, "test"),)) for p in ("init", "forward", "backward", "optimizer_step")]
    ws = library_workspaces((9, 0))
    got = peak_of(base, 512, resident=(ws,)).by_phase()
    assert got == {"init": 1024, "forward": 1024 + ws.bytes, "backward": 1024 + ws.bytes,
                   "optimizer_step": 1024 + ws.bytes}  # fmt: skip


def test_the_reference_planner_adds_them_on_cuda_and_not_without_a_gpu():
    spec, seq = resolve(GPT2, None)
    work = model_workload(spec, seq, 1, "none", 1, True)
    (gpu,) = reference.estimate(work, 8, reference.Settings(stages=(3,)))
    (cpu,) = reference.estimate(work, 8, reference.Settings(stages=(3,), cuda_capability=None))
    diff = {p: gpu.peak.by_phase()[p] - cpu.peak.by_phase()[p] for p in gpu.peak.by_phase()}
    assert diff == {"init": 0, "forward": 68_157_440, "backward": 68_157_440, "optimizer_step": 68_157_440}
    assert estimate(model=GPT2, gpus=8, stage=3).stages[0].peak.by_phase() == gpu.peak.by_phase()


def test_fsdp2_adds_them_on_cuda_only():
    spec, _ = resolve("llama2-7b", None)  # no biases: no cuBLASLt workspace
    work = Workload(model_workload(spec, 256, 1, "none", 1, True).shapes, spec, 256, 1)
    (gpu,) = fsdp2.estimate(work, 64, fsdp2.Settings(param_dtype="bf16", device="cuda"))
    (cpu,) = fsdp2.estimate(work, 64, fsdp2.Settings(param_dtype="bf16", device="cpu", backend="gloo"))
    assert gpu.peak.by_phase()["init"] - cpu.peak.by_phase()["init"] < 2**20  # block rounding only
    terms = {t.name for p in gpu.peak.phases if p.phase != "init" for t in p.terms}
    assert "CUDA library workspaces (cuBLAS x2)" in terms
    assert not any("workspace" in t.name for p in cpu.peak.phases for t in p.terms)


@pytest.mark.parametrize(("gpu", "each"), [("a100-80gb", 8_519_680), ("a100-40gb", 8_519_680), ("v100-32gb", 8_519_680),
                                           ("h100-80gb", 32 * 2**20), ("h200-141gb", 32 * 2**20), ("b200", 32 * 2**20)])  # fmt: skip
def test_the_workspace_follows_the_gpu_presets_compute_capability(gpu, each):
    """parseChosenWorkspaceSize: 32 MiB on majors 9-12 (Hopper, Blackwell), :4096:2:16:8 elsewhere: an A100
    plan holds 2 x 8.125 MiB + 1 MiB, not an H100's 2 x 32 MiB + 1 MiB."""
    from zeroplan.formulas.cuda_workspaces import capability_of

    assert cublas_workspace_bytes(capability_of(gpu)) == each
    assert library_workspaces(capability_of(gpu)).bytes == 2 * each + 2**20


def test_every_nvidia_preset_has_a_compute_capability():
    from zeroplan.formulas.cuda_workspaces import CAPABILITY_BY_GPU, capability_of
    from zeroplan.presets import gpu_presets

    names = set(gpu_presets())
    assert names - set(CAPABILITY_BY_GPU) == {"mi300x"}  # ROCm: hipBLAS workspaces are not modelled
    assert capability_of("mi300x") is None
