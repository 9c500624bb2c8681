"""The CUDA DeepSpeed runner (validate/engines/deepspeed_cuda.py) where no GPU is needed: which runs go to CUDA, the
ds_configs it trains (torch's Adam: no DeepSpeed op built on the GPU machine), one GPU per rank, and the parent's
comparison of a CUDA row: the profile's GPU peak with CUDA's fp32 normalisation statistics, no host terms beside
the states (the allocator counts the GPU alone), the allocator model's reserved bytes per phase beside the measured
ones. The rank side itself runs on the GPU machine (validate/gpu_check.sh, docs/allocator.md "GPU check")."""

from __future__ import annotations

import json

import pytest

from validate.engines.deepspeed_compare import PHASE_OF, compare_row, workload_for
from validate.engines.deepspeed_compare import predicted_reserved
from validate.engines.deepspeed_cuda import check_gpus, on_cuda, torch_adam_configs
from zeroplan.engines import deepspeed as D

ZERO2_CPU = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
             "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}  # fmt: skip


def test_which_runs_go_to_cuda():
    assert not on_cuda(json.dumps({"device": "cpu"}), cuda_available=True)
    assert on_cuda(json.dumps({"device": "auto"}), cuda_available=True)
    assert not on_cuda(json.dumps({"device": "auto"}), cuda_available=False)
    with pytest.raises(ValueError, match="^--device cuda: no CUDA GPU visible"):
        on_cuda(json.dumps({"device": "cuda"}), cuda_available=False)
    check_gpus(1, 1)
    with pytest.raises(ValueError, match="world size 2 needs 2 GPUs, 1 visible"):
        check_gpus(2, 1)


def test_every_config_trains_with_torchs_adam_and_keeps_its_offload():
    plain = {"zero_optimization": {"stage": 1}}
    (a, b) = torch_adam_configs([plain, ZERO2_CPU])
    assert a["optimizer"] == {"type": "Adam", "params": {"torch_adam": True}}
    assert b["optimizer"]["params"] == {"lr": 1e-3, "torch_adam": True}
    assert b["zero_optimization"] == ZERO2_CPU["zero_optimization"] and "torch_adam" not in ZERO2_CPU["optimizer"]["params"]
    assert D.inner_optimizer_class(D.Settings.from_ds_config(b)) != "DeepSpeedCPUAdam"  # no cpu_adam op to build
    with pytest.raises(ValueError, match="optimizer.type='Lamb'"):
        torch_adam_configs([{"optimizer": {"type": "Lamb"}}])


def _rank_row(ds: dict, workload, reserved: dict, stat_bytes) -> dict:
    """What a rank of the CUDA runner reports when it measures exactly the profile's prediction (on CUDA)."""
    settings = D.Settings.from_ds_config(ds).model_copy(update={"device": "cuda"})
    (est,) = D.estimate(workload, 1, settings, stat_bytes=stat_bytes)
    calls = [[c.op, PHASE_OF.get(c.phase, c.phase), c.dtype, c.elements] for c in est.collectives]
    states = est.model_states_bytes
    return {"rank": 0, "zero_init": False, "device": "cuda", "boundary_bytes": {"init": states, "step0": states,
            "step1": states, "step2": states}, "peak_bytes_by_phase": est.peak.by_phase(),
            "calls_by_step": [[], calls, calls, calls], "call_groups_by_step": [[], [1] * len(calls)],
            "probe_breakdown": {f"reserved_bytes.peak.{p}": b for p, b in reserved.items()},
            "step_s": [0.1, 0.1, 0.1], "runner_changes": []}  # fmt: skip


def test_a_cuda_row_is_the_gpu_peak_with_reserved_bytes_beside():
    """ZeRO-2 offload_optimizer cpu, bf16, gpt-tiny at world size 1: the CUDA row's prediction is the profile's
    with fp32 LayerNorm statistics (the CPU runner's bf16 ones predict less) and no host terms beside the states;
    reserved predicted per phase by the allocator model, measured from the probe's counters."""
    ds = torch_adam_configs([ZERO2_CPU])[0]
    w = workload_for("gpt-tiny", 2, None)
    settings = D.Settings.from_ds_config(ds).model_copy(update={"device": "cuda"})  # 512-B blocks, workspaces
    want = predicted_reserved(w, 1, settings)
    assert set(want) == {"init", "forward", "backward", "optimizer_step"}
    measured = {p: b + 2**21 for p, b in want.items()}  # one more 2 MiB segment than predicted, every phase
    row = compare_row(ds, 1, [_rank_row(ds, w, measured, None)], w, "gpt-tiny", 0.01, 0.03)
    assert (row["device"], row["backend"], row["ok"]) == ("cuda", "nccl", True)
    assert row["predicted_reserved_bytes_by_phase"] == want and row["measured_reserved_bytes_by_phase"] == measured
    assert all(want[p] >= row["predicted_peak_bytes_by_phase"][p] > 0 for p in want)
    (cuda,) = D.estimate(w, 1, settings)
    (cpu,) = D.estimate(w, 1, settings.model_copy(update={"device": "cpu"}), stat_bytes=2)  # the CPU runner's
    assert row["predicted_peak_bytes_by_phase"] == cuda.peak.by_phase() != cpu.peak.by_phase()
    assert row["predicted_beside_states_terms"] is None and cuda.host is not None  # offloaded, not on the GPU
    assert row["predicted_model_states_bytes"] == cuda.model_states_bytes


def test_the_rank_readings_keep_init_whole_and_leave_the_workspaces_out():
    from validate.engines.deepspeed_cuda import _fold_build, without_workspaces

    row = {"probe_breakdown": {"reserved_bytes.peak.build": 5 * 2**21, "reserved_bytes.peak.init": 3 * 2**21,
                               "reserved_bytes.peak.forward": 7 * 2**21},
           "boundary_bytes": {"init": 1000, "step0": 1000 + 2**25, "step1": 1000 + 2**25}}  # fmt: skip
    folded = without_workspaces(_fold_build(row), 2**25)  # Hopper's 32 MiB cuBLAS workspace, say
    assert folded["probe_breakdown"] == {"reserved_bytes.peak.init": 5 * 2**21, "reserved_bytes.peak.forward": 7 * 2**21}
    assert folded["boundary_bytes"] == {"init": 1000, "step0": 1000, "step1": 1000}
    assert folded["library_workspace_bytes"] == 2**25 and row["boundary_bytes"]["step0"] == 1000 + 2**25
