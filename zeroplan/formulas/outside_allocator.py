"""GPU memory that PyTorch's caching allocator does not count: what ``torch.cuda.max_memory_reserved`` leaves out
but ``cudaMalloc`` still cannot use. Each function returns a named ``Term`` with its source.

- **CUDA context** (driver state, loaded kernel images, per-thread stacks, cuBLAS/cuDNN handle state): no
  formula; a measurement per GPU and torch/CUDA version (``CUDA_CONTEXT_MEASURED``), taken by
  ``validate/gpu_check.sh`` as ``torch.cuda.mem_get_info`` used bytes minus ``memory_reserved`` after one
  training step. None has been recorded yet, so ``cuda_context`` refuses to guess.
- **NCCL communicator buffers**: ``NCCL_BUFFSIZE`` bytes per channel per connected peer for the SIMPLE
  protocol (NCCL docs, Environment Variables, ``NCCL_BUFFSIZE``: "the size of the buffer used by NCCL when
  communicating data between pairs of GPUs", default 4194304), allocated by NCCL with ``cudaMalloc`` /
  ``cuMem*`` outside PyTorch. Channels and peers are chosen by NCCL per topology (``NCCL_DEBUG=INFO``
  prints them; ``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS`` bound them): a ring connects each rank to 2
  peers per channel; the LL and LL128 protocols add their own, smaller buffers (not counted: a lower bound).
- **Not here**: the cuBLAS / cuBLASLt workspaces. torch takes them from the caching allocator (the H200
  measured them in ``memory_allocated``: ``tests/data/gpu/cuda_extras_h200.json``), so they are allocator
  blocks (``zeroplan.formulas.cuda_workspaces``), inside reserved bytes.
"""

from __future__ import annotations

from zeroplan.formulas.peak import Term

NCCL_BUFFSIZE_BYTES = 4 * 1024 * 1024
"""``NCCL_BUFFSIZE`` default: 4194304 bytes (NCCL User Guide, Environment Variables)."""
NCCL_SOURCE = "NCCL User Guide, Environment Variables: NCCL_BUFFSIZE (default 4 MiB per peer and channel)"
RING_PEERS = 2
"""A ring channel connects a rank to its previous and next rank."""

CUDA_CONTEXT_MEASURED: dict[tuple[str, tuple[int, int]], int] = {}
"""(torch version prefix, compute capability) -> bytes the CUDA context holds, measured by
``validate/gpu_check.sh`` (``cuda_context.json``); empty until a GPU run records one."""


def nccl_buffers(channels: int, peers: int = RING_PEERS, buffsize_bytes: int = NCCL_BUFFSIZE_BYTES,
                 communicators: int = 1) -> Term:  # fmt: skip
    """NCCL's SIMPLE-protocol buffers: ``buffsize x channels x peers`` per communicator, for ``communicators``
    process groups that each run collectives (every group NCCL initialises holds its own)."""
    for name, value in (("channels", channels), ("peers", peers), ("buffsize_bytes", buffsize_bytes),
                        ("communicators", communicators)):  # fmt: skip
        if not isinstance(value, int) or value < (0 if name == "peers" else 1):
            raise ValueError(f"{name}={value!r}: must be a whole number >= {0 if name == 'peers' else 1}")
    total = buffsize_bytes * channels * peers * communicators
    return Term(f"NCCL buffers ({communicators} communicator(s) x {channels} channels x {peers} peers x "
                f"{buffsize_bytes:,} B)", total, NCCL_SOURCE)  # fmt: skip


def cuda_context(torch_version: str, capability: tuple[int, int]) -> Term:
    """The CUDA context as measured for this torch version and compute capability; a ValueError when no GPU run
    has measured it (it is not a formula: it depends on the driver, CUDA and the kernels loaded)."""
    for (prefix, cap), measured in CUDA_CONTEXT_MEASURED.items():
        if torch_version.startswith(prefix) and tuple(capability) == cap:
            source = f"measured: validate/gpu_check.sh, torch {prefix}, sm_{cap[0]}{cap[1]}"
            return Term("CUDA context", measured, source)
    raise ValueError(f"CUDA context for torch {torch_version} on compute capability {capability[0]}.{capability[1]}: "
                     "not measured yet (validate/gpu_check.sh records it)")  # fmt: skip


def outside_allocator(terms: tuple[Term, ...]) -> int:
    """Bytes of ``terms`` together: what ``cudaMalloc`` cannot give the allocator beside its reserved bytes."""
    return sum(t.bytes for t in terms)
