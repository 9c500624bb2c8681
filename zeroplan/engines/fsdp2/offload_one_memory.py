"""FSDP2's ``CPUOffloadPolicy`` where the GPU and the host are one memory (a CPU-only run on gloo): what the
validator's MemTracker measures per phase; the same shape as ``engines/deepspeed/offload_one_memory.py``. Its own
module because it reads ``moments.py``, which itself reads ``offload.py`` (no import circle)."""

from __future__ import annotations

from dataclasses import replace

from zeroplan.engines.fsdp2.moments import moments
from zeroplan.engines.fsdp2.terms import Fsdp2Run


def one_memory_by_phase(run: Fsdp2Run) -> dict[str, int]:
    """Each phase's peak where the GPU and the host are one memory (a CPU-only run, ``device="cpu"``): every host
    term of ``CPUOffloadPolicy`` is alive where ``moments.py`` places it without offload (the shards, the gradient
    shards as each unit reduces, Adam's states and temporaries; init builds and shards on the CPU), and the shards
    copied up for an all-gather are the shards themselves (``sharded_param_data.to("cpu")`` returns the tensor): the
    peaks of the moments without offload. Measured (gpt-tiny fp32, N_d = 2, gloo, materialized,
    ``CPUOffloadPolicy(pin_memory=False)``, MemTracker): equal to them on both ranks, every phase, to the byte
    (tests/test_engine_offload.py ``FSDP2_ONE_MEMORY``); and the split adds up: the GPU moments less the copied-up
    shards plus the host's shards and Adam's states at forward and backward, the host's whole at the step."""
    plain = replace(run, settings=run.settings.model_copy(update={"offload_policy": "none"}))
    out: dict[str, int] = {}
    for m in moments(plain):
        out[m.phase] = max(out.get(m.phase, 0), m.total())
    return out
