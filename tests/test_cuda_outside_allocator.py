"""Memory outside PyTorch's caching allocator (``zeroplan.formulas.outside_allocator``): NCCL buffers by
``NCCL_BUFFSIZE``, the CUDA context only from a measurement."""

from __future__ import annotations

import pytest

from zeroplan.formulas.outside_allocator import NCCL_BUFFSIZE_BYTES, cuda_context, nccl_buffers, outside_allocator


def test_nccl_buffers_are_buffsize_per_channel_per_peer():
    assert NCCL_BUFFSIZE_BYTES == 4_194_304  # NCCL's documented default
    ring = nccl_buffers(channels=16)  # 16 channels, ring: 2 peers each
    assert ring.bytes == 16 * 2 * 4_194_304 == 128 * 2**20
    assert nccl_buffers(channels=16, communicators=2).bytes == 2 * ring.bytes  # e.g. FSDP2's and a TP group
    assert nccl_buffers(channels=8, peers=2, buffsize_bytes=2**20).bytes == 16 * 2**20  # NCCL_BUFFSIZE=1048576
    assert "NCCL_BUFFSIZE" in ring.source


@pytest.mark.parametrize(("kwargs", "message"), [({"channels": 0}, "channels=0"), ({"channels": 4, "peers": -1}, "peers=-1"),
                                                 ({"channels": 2.5}, "channels=2.5")])  # fmt: skip
def test_nccl_inputs_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        nccl_buffers(**kwargs)


def test_the_cuda_context_is_not_guessed():
    with pytest.raises(ValueError, match="not measured yet"):
        cuda_context("2.11.0+cu130", (9, 0))


def test_outside_bytes_add_up():
    assert outside_allocator((nccl_buffers(channels=2), nccl_buffers(channels=1))) == 3 * 2 * 4_194_304
