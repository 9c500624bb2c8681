"""fp16 with ``offload_optimizer: cpu`` (ZeRO-1/2/3) and NVMe offload at ZeRO-3 (``offload_optimizer`` /
``offload_param`` through a Python stand-in for ``async_io``) on transformers' mixture-of-experts classes (issue 19):
the recorded real runs (tests/data/measured/deepspeed_moe_fp16_nvme.json, benchmarks/ds_moe_opt_rows.py offload16
and nvme3; gloo, N_d = 2, both ranks, every phase; deepspeed_moe_nd3.json: the same at N_d = 3, fp16 NVMe
(nvme16) and ZeRO-3 offload on Qwen3-MoE, every rank; deepspeed_nvme_llama34m.json: NVMe on a dense Llama of
33.9M) predicted again, and which of them ``moe_limit`` gives a peak
(docs/engines/deepspeed.md "BF16_Optimizer and offload on mixture-of-experts"). Predicted-only: no run here."""

from __future__ import annotations

import json
import math

import pytest

from tests.test_deepspeed_moe_opt import MEASURED, PHASES, TARGET, UNDER, _errors, _moe_limit

DATA = json.loads((MEASURED / "deepspeed_moe_fp16_nvme.json").read_text())
ND3 = json.loads((MEASURED / "deepspeed_moe_nd3.json").read_text())
DENSE = json.loads((MEASURED / "deepspeed_nvme_llama34m.json").read_text())  # a dense model, NVMe at ZeRO-3
ROWS = DATA["rows"] + ND3["rows"] + DENSE["rows"]
FP16 = [r for r in ROWS if "fp16" in r["case"]]
SEVERAL = [r for r in FP16 if r["case"] == "z2-fp16-small"]  # ZeRO-2 from the hooks: moe_offload.py's condition
GIVEN = [r for r in ROWS if r not in SEVERAL]


def _ids(rows: list[dict]) -> list[str]:
    return [f"{r['family']}-{r['case']}" for r in rows]


@pytest.mark.parametrize("row", GIVEN, ids=_ids(GIVEN))
def test_fp16_and_nvme_offload_on_sparse_models_every_phase_both_ranks_and_given_a_peak(row, tmp_path):
    """Every (rank, phase) within the recorded error (``_errors``: 64 B or 0.005 %) and the targets, and the run
    given a peak (refused before: fp16 with offload at ZeRO-1/2, ``moe_offload_limit``; ``offload_param`` at
    ZeRO-3, ``zero3_moe_limit``); the "z2-BUCKET-fp16" rows: ZeRO-2 from the hooks with every bucket at least the
    largest tensor (moe_offload.py ``norms_at_hooks``, measured in fp32 and bf16 by its rows), as bf16. Two rules
    closed a miss (``predicted_before``): ZeRO-3 fp16's overflow check, a
    bool of the host gradient partition after the persistent parameters are freed
    (offload_one_memory.py ``fp16_overflow_check``: Mixtral at 5,000-element buckets 4.76 % under before), and the
    NVMe swapper's first step (nvme.py ``step_terms``: Adam's m and v made beside the pool, the fp32 gradient slices
    below the swap threshold; Mixtral 0.79 % under before)."""
    for rank, errors in enumerate(_errors(row, tmp_path)):
        for phase, err, value in zip(PHASES, errors, row["measured"][rank]):
            assert -TARGET * value <= err <= UNDER * value, (rank, phase, err)
    assert _moe_limit(row) is None


def test_the_two_rules_are_what_closed_the_misses():
    """``predicted_before`` (main before this change) missed the step by the rules' bytes: without them the rows
    fail the targets."""
    worst = {}
    for row in GIVEN:
        for rank, before in enumerate(row["predicted_before"]):
            value, then = row["measured"][rank][3], before[3]
            worst[row["case"]] = max(worst.get(row["case"], 0.0), (value - then) / value)
    assert worst["z3-fp16-small"] > 0.04 and worst["z3-bf16-nvme-opt"] > UNDER, worst


@pytest.mark.parametrize("row", SEVERAL, ids=_ids(SEVERAL))
def test_zero2_fp16_offload_in_several_buckets_refused_or_within_target(row, tmp_path):
    """ZeRO-2 fp16 at 5,000-element buckets (below the largest tensor) reduces from the hooks as bf16 does
    (moe_offload.py's condition on the bucket, not the dtype): refused naming the largest tensor while that
    condition stands (misses as recorded, up to 2.91 % under), within the targets where it is lifted."""
    errors = _errors(row, tmp_path)
    why = _moe_limit(row)
    if why is not None:
        assert "offload_optimizer with reduce_bucket_size 5,000 < the largest tensor" in why and "fp16" not in why
        return
    for rank, errs in enumerate(errors):
        for err, value in zip(errs, row["measured"][rank]):
            assert -TARGET * value <= err <= UNDER * value, (rank, err)


def test_the_standin_locked_the_pools_the_profile_predicts():
    """The stand-in's locked buffers (``new_cpu_locked_tensor``) per rank are the pools the host terms name:
    the optimizer's ``buffer_count`` x ``_io_aligned_numel(partition)`` fp32 (nvme.py ``pool_bytes``), the
    parameters' 5 x ``_io_aligned_numel(buffer_size)`` 16-bit (nvme_param.py)."""
    from zeroplan.engines.deepspeed import nvme
    from zeroplan.formulas.sharding import flat_shard_numel

    nvme_rows = [r for r in ROWS if "nvme" in r]
    assert nvme_rows
    for row in nvme_rows:
        part = flat_shard_numel(tuple(math.prod(s) for _, s in row["shapes"]), row["nd"])
        for stats in row["nvme"]:
            expected = {"nvme-opt": [nvme.io_aligned_numel(part) * 4] * 4, "param-cpu": [],
                        "nvme-param": [5 * 1_100_288 * 2]}[row["case"].split("-", 2)[2]]  # bf16 and fp16 alike
            assert stats["locked"] == expected, (row["family"], row["case"], stats)


def test_the_padded_reduce_scatter_buffer_closed_the_nd3_miss():
    """At N_d = 3, ZeRO-3 reduces an expert gradient held past the bucket through ``reduce_scatter_coalesced``'s
    padded, interleaved copy where 3 does not divide it (moe.py ``_reduction_peak``; a tensor dividing evenly is
    reduced as a view of itself): without it (``predicted_before``) Mixtral's fp16 rows at 5,000-element buckets
    were 3.38 % under on every rank (gate_up_proj, 262,144 elements); Qwen3-MoE's tensors (196,608 and 98,304)
    divide by 3, so its rows were predicted as now."""
    before = {}
    for row in ND3["rows"]:
        for measured, then, now in zip(row["measured"], row["predicted_before"], row["predicted_when_recorded"]):
            before[(row["family"], row["case"], row["nd"])] = (measured[2] - then[2]) / measured[2]
            if row["family"] == "qwen3-moe-wide":
                assert then == now, row["case"]
    assert before[("mixtral-wide", "z3-fp16-small", 3)] > 0.03, before


def test_the_standin_moved_the_nvme_bytes_the_profile_predicts():
    """Per rank, the NVMe bytes the stand-in read and wrote over a run (two steps) are the profile's two steps
    (nvme.py ``nvme_traffic``, the first without m and v to read) plus the build's: stage3.py
    ``_create_fp32_partitions`` writes the fp32 master once (``optimizer_swapper.initialize_parameters``) and
    ``initialize_optimizer_states`` swaps it in and out (``_optimizer_states_and_gradient_swap_in`` / ``_out``): one
    aligned partition read, two written (none where the partition is below the swap threshold). Measured on every
    NVMe optimizer row, and on a dense Llama of 33.9M parameters (17.0M-element partitions, 67.8 MB each way)."""
    from zeroplan.engines.deepspeed import nvme
    from zeroplan.formulas.sharding import flat_shard_numel

    rows = [r for r in ROWS if r["case"].endswith("nvme-opt")]
    assert len(rows) == 9
    for row in rows:
        numels = tuple(math.prod(s) for _, s in row["shapes"])
        part, slices = flat_shard_numel(numels, row["nd"]), tuple(-(-n // row["nd"]) for n in numels)
        first, second = nvme.nvme_traffic(part, slices, first_step=True), nvme.nvme_traffic(part, slices)
        build = nvme.io_aligned_numel(part) * 4 if first != (0, 0) else 0
        for stats in row["nvme"]:
            assert (stats["read"], stats["write"]) == (build + first[0] + second[0], 2 * build + first[1] + second[1])
