"""A one-row engine's offload as the sweep's columns: ``offload``, ``host_bytes``, ``nvme_bytes``, ``h2d_bytes``,
``d2h_bytes``, read off the engine's own ``HostMemory`` (``EngineEstimate.host``: DeepSpeed
``offload_optimizer``/``offload_param`` cpu or nvme, FSDP2 ``CPUOffloadPolicy``), the record ``estimate --json``
prints its host keys from (``zeroplan.render.estimate.host_keys``), so a sweep row and ``estimate`` cannot drift:

- ``host_bytes``: ``HostMemory.host_bytes``, estimate's ``host_bytes_per_gpu``: the larger of the training steps'
  peak (the steady bytes and the optimizer step's host temporaries, ``step_terms``: torch Adam's under
  ``torch_adam``) and init's peak (``host_peak_at`` says which);
- ``h2d_bytes``/``d2h_bytes``: one optimizer step's PCIe traffic, ``HostMemory.h2d_bytes``/``d2h_bytes``;
- ``nvme_bytes``: the swap files each step writes back (DeepSpeed ZeRO-3 ``offload_optimizer.device: nvme``: fp32
  master, m, v and the swapped gradient slices, ``zeroplan.engines.deepspeed.nvme.nvme_traffic``;
  ``offload_param.device: nvme`` beyond ``max_in_cpu``: the swapped 16-bit partitions, ``nvme_param.nvme_traffic``),
  estimate's ``nvme_write_bytes_per_step``; 0 without NVMe or where nothing is swapped during training
  (DeepSpeed keeps it on the host then).

A row without offload (``host`` None) has the label ``none`` and zeros, as the reference rows without offload.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from zeroplan.formulas.offload import NO_OFFLOAD, HostMemory
from zeroplan.sweeping.columns import Column, labels


def host_columns(hosts: Sequence[Optional[HostMemory]]) -> dict[str, Column]:
    """The offload columns of rows whose engine offload records are ``hosts`` (None: no offload)."""

    def ints(read) -> np.ndarray:
        return np.array([0 if h is None else read(h) for h in hosts], dtype=np.int64)

    return {
        "offload": labels([(NO_OFFLOAD if h is None else h.offload).label for h in hosts]),
        "host_bytes": ints(lambda h: h.host_bytes),
        "nvme_bytes": ints(lambda h: h.nvme_write_bytes or 0),
        "h2d_bytes": ints(lambda h: h.h2d_bytes),
        "d2h_bytes": ints(lambda h: h.d2h_bytes),
    }
