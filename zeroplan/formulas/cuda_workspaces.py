"""CUDA library workspaces: bytes the caching allocator serves to cuBLAS and cuBLASLt, outside any tensor.

PyTorch gives each cuBLAS handle a workspace per stream from the caching allocator and keeps it until
the process ends or ``torch._C._cuda_clearCublasWorkspaces()`` (``aten/src/ATen/cuda/CublasHandlePool.cpp``:
``getCurrentCUDABlasHandle``, the ``cublas_handle_stream_to_workspace`` map). Handles are per thread
(``DeviceThreadHandlePool``), and a training step runs GEMMs on two threads: forward on the Python
thread, backward on autograd's device thread. So from the first backward on, every phase of every later
step holds two cuBLAS workspaces, plus one cuBLASLt workspace when the forward runs a Linear with a bias
(``addmm`` with a bias epilogue goes to cuBLASLt: ``at::cuda::blas::gemm_and_bias``).

Sizes are torch's defaults (``CUBLAS_WORKSPACE_CONFIG`` and ``CUBLASLT_WORKSPACE_SIZE`` change them):
``parseChosenWorkspaceSize`` (32 MiB on Hopper and Blackwell, compute capability major 9, 10, 11 or 12 in
current torch; 9.0 only before; else ``:4096:2:16:8``, 8.125 MiB) and ``parseCUDABlasLtWorkspaceSize``
(1024 KiB). The GPU's compute capability comes from its preset (``capability_of``): an A100 (8.0) gets
8.125 MiB workspaces, not an H100's 32 MiB. Measured on an H200 (torch 2.11, CUDA 13;
``python -m validate.cuda_extras``): one ``mm`` keeps 33,554,432 B, one biased ``F.linear`` 34,603,008 B
(the cuBLASLt workspace is separate there, not unified), forward + backward of one ``mm`` 67,108,864 B.
"""

from __future__ import annotations

from zeroplan.formulas.peak import Term

CUBLAS_WORKSPACE_SM90_BYTES = 4096 * 8 * 1024
"""``CublasHandlePool.cpp:parseChosenWorkspaceSize``: the default on Hopper (H100, H200) and Blackwell."""
CUBLAS_WORKSPACE_OTHER_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
"""The same function's default elsewhere (``:4096:2:16:8``)."""
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024
"""``CublasHandlePool.cpp:parseCUDABlasLtWorkspaceSize``: 1024 KiB by default."""
GEMM_THREADS = 2
"""Threads that run a step's GEMMs: the Python thread (forward) and autograd's device thread (backward)."""
SOURCE = "aten/src/ATen/cuda/CublasHandlePool.cpp (getCurrentCUDABlasHandle); measured by validate/cuda_extras.py"


LARGE_WORKSPACE_MAJORS = (9, 10, 11, 12)
"""``parseChosenWorkspaceSize``: ``use32mb = major == 9 || major == 10 || major == 11 || major == 12`` (torch
main, 2026; torch <= 2.7 tested ``major == 9 && minor == 0``: the same for every preset but the B200)."""
CAPABILITY_BY_GPU: dict[str, tuple[int, int]] = {
    "v100-32gb": (7, 0), "a100-40gb": (8, 0), "a100-80gb": (8, 0), "h100-80gb": (9, 0), "h200-141gb": (9, 0),
    "b200": (10, 0),
}  # fmt: skip
"""Compute capability of each NVIDIA preset of ``zeroplan/data/gpus.json`` (NVIDIA, "CUDA GPUs - Compute
Capability", developer.nvidia.com/cuda-gpus). ``mi300x`` is a ROCm GPU: hipBLAS workspaces are not modelled."""


def capability_of(gpu: str) -> tuple[int, int] | None:
    """The compute capability of GPU preset ``gpu``; None for a preset that is not an NVIDIA GPU."""
    return CAPABILITY_BY_GPU.get(gpu)


def cublas_workspace_bytes(capability: tuple[int, int]) -> int:
    """One cuBLAS workspace on a GPU of ``capability`` (major, minor): torch's default size."""
    return CUBLAS_WORKSPACE_SM90_BYTES if capability[0] in LARGE_WORKSPACE_MAJORS else CUBLAS_WORKSPACE_OTHER_BYTES


def library_workspaces(capability: tuple[int, int] = (9, 0), biased_linear: bool = True) -> Term:
    """The workspaces a training step keeps from its first backward on: ``GEMM_THREADS`` cuBLAS ones, and
    a cuBLASLt one when the forward has a biased Linear."""
    cublas = GEMM_THREADS * cublas_workspace_bytes(capability)
    lt = CUBLASLT_WORKSPACE_BYTES if biased_linear else 0
    return Term("CUDA library workspaces (cuBLAS x2, cuBLASLt)" if lt else "CUDA library workspaces (cuBLAS x2)",
                cublas + lt, SOURCE)  # fmt: skip  (one tensor: each size is a multiple of the 512-byte block)
