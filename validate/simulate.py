"""Scale without a cluster: one process plays rank 0 of a world of N_d on a fake process group.

``torch.testing._internal.distributed.fake_pg.FakeStore`` with backend ``"fake"`` accepts every
collective and returns at once, so the runtime follows its real schedule and the probes see every
c10d call with its real sizes; nothing is computed across ranks, so values are meaningless and parity is
not checked. With ``FakeTensorMode`` tensors have shapes, dtypes and storage sizes but no data, so a
model of billions of parameters runs in a few GiB of RSS, and MemTracker still counts its bytes.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch.distributed as dist


def init_fake_world(nd: int, rank: int = 0) -> None:
    """Join a fake process group of ``nd`` ranks as ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=nd)


def fake_tensors(enabled: bool):
    """A ``FakeTensorMode`` context (tensors without data) when ``enabled``, else a no-op context."""
    if not enabled:
        return nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)
