"""The validator's reserved bytes (issue 21): on CUDA the probe reads ``max_memory_reserved`` per phase (reset per
phase, cached segments returned at the row's start) into its breakdown, rows carry it as
``measured_reserved_bytes_by_phase`` beside ``predicted_reserved_bytes_by_phase`` (FSDP2: the engine's allocation
trace through the allocator model, under the ranks' ``PYTORCH_CUDA_ALLOC_CONF``); CPU rows leave both null.
The CUDA readings themselves run in validate/gpu_check.sh (reserved_vs_model.txt)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from validate.compare import RESERVED_PREFIX, reserved_by_phase  # noqa: E402
from validate.engines.fsdp2_compare import Fsdp2Settings, _workload, predict, predicted_reserved  # noqa: E402
from validate.probes import MemoryProbe  # noqa: E402
from zeroplan.allocator.reserved import reserved_of  # noqa: E402
from zeroplan.engines.fsdp2.alloc_trace import alloc_traces  # noqa: E402


def test_the_breakdown_keys_become_the_rows_reserved_bytes_by_phase():
    breakdown = {"reserved_bytes.all.peak": 9, f"{RESERVED_PREFIX}init": 4, f"{RESERVED_PREFIX}optimizer step": 8}
    assert reserved_by_phase(breakdown) == {"init": 4, "optimizer_step": 8}  # the reference runner's phase name
    assert reserved_by_phase({"reserved_bytes.all.peak": 9}) is None


def test_a_cpu_probe_reads_no_reserved_bytes():
    probe = MemoryProbe(torch.device("cpu"))
    with probe:
        probe.phase("init")
        kept = torch.ones(1024)
        probe.phase(None)
    assert probe.peaks["init"] >= kept.numel() * 4 and probe.reserved_peaks == {}
    assert reserved_by_phase(probe.breakdown()) is None


CONFIG = SimpleNamespace(model_name="gpt-tiny", params=None, param_dtype="bf16", reduce_dtype=None,
                         reshard_after_forward=None, checkpointing="none", foreach=None, steps=2, batch_per_rank=2,
                         seq_len=None, lr=1e-3, fsdp2_init=None)  # fmt: skip


def test_fsdp2_rows_predict_reserved_bytes_on_cuda_only_under_the_ranks_alloc_conf(monkeypatch):
    cpu = {"device": "cpu", "backend": "gloo", "world_size": 2}
    assert predicted_reserved(CONFIG, cpu) is None
    cuda = {"device": "cuda:0", "backend": "fake", "world_size": 8, "cuda_capability": [8, 0]}
    settings = Fsdp2Settings.from_validate(CONFIG)
    (trace,) = alloc_traces(_workload(settings, cuda), 8, predict(settings, cuda)[1])
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    default = predicted_reserved(CONFIG, cuda)
    assert default == reserved_of(trace).reserved_phases and set(default) == {"init", "forward", "backward",
                                                                              "optimizer_step"}  # fmt: skip
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert predicted_reserved(CONFIG, cuda) == reserved_of(trace, "expandable_segments:True").reserved_phases
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # not modelled: not predicted
    assert predicted_reserved(CONFIG, cuda) is None
