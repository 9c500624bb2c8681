"""DeepSpeed's ``BF16_Optimizer`` (bf16 with ``data_types.grad_accum_dtype`` fp32 at ZeRO-1) and optimizer offload
(``offload_optimizer: cpu``) on transformers' mixture-of-experts classes (issue 19): the recorded real runs
(tests/data/measured/deepspeed_moe_{bf16opt,offload}.json, benchmarks/ds_moe_opt_rows.py; gloo, N_d = 2, both
ranks, every phase) predicted again, and which of them ``moe_limit`` gives a peak (docs/engines/deepspeed.md
"BF16_Optimizer and offload on mixture-of-experts"). Predicted-only: no run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

MEASURED = Path(__file__).parent / "data" / "measured"
PHASES = ("init", "forward", "backward", "optimizer_step")
#: issue 17's targets: |measured - predicted| <= 1 % of measured, at most 0.5 % under-predicted
TARGET, UNDER = 0.01, 0.005
#: beyond the error recorded with each row: 64 B (the rotary buffers' order of size) or 0.005 %
SLACK_BYTES, SLACK = 64, 0.00005


def _rows(kind: str) -> list[dict]:
    return json.loads((MEASURED / f"deepspeed_moe_{kind}.json").read_text())["rows"]


BF16OPT = _rows("bf16opt")


def _predict(row: dict, rank: int, tmp_path: Path) -> dict[str, int]:
    """What a CPU run measures, as the validator predicts it (``deepspeed_compare.one_memory``: GPU moments plus
    the host bytes alive at each)."""
    from validate.engines.deepspeed_compare import one_memory, workload_for
    from zeroplan.engines import deepspeed as D

    path = tmp_path / f"{row['family']}.json"
    path.write_text(json.dumps(row["hf_config"]))
    workload = workload_for(str(path), 1, 64, row["ds_config"].get("gradient_accumulation_steps", 1), "none", hf=True)
    assert [[n, list(s)] for n, s in workload.shapes] == row["shapes"]  # the model recorded is the one predicted
    settings = D.Settings.from_ds_config(row["ds_config"]).model_copy(update={"rank": rank})
    return one_memory(workload, row["nd"], settings, 4)


def _moe_limit(row: dict):
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.engines.base import PlannerOptions
    from zeroplan.engines.deepspeed.plan import moe_limit

    g = row["ds_config"].get("gradient_accumulation_steps", 1)  # the run's G, as the CLI resolves it from the file
    options = PlannerOptions(ds_config=row["ds_config"], grad_accum=g)
    return moe_limit(options, spec_from_hf_config(row["hf_config"]))


@pytest.mark.parametrize("row", BF16OPT, ids=[f"{r['family']}-{r['case']}" for r in BF16OPT])
def test_bf16_optimizer_on_sparse_models_every_phase_both_ranks_and_given_a_peak(row, tmp_path):
    """``BF16_Optimizer`` reduces nothing at the hooks (bf16_optimizer.py ``immediate_grad_update`` false by default,
    precision_config.py): the dense schedule (engines/deepspeed/bf16.py) on the sparse layers' 3-D expert tensors,
    whose largest gradient is the one ``_update_hp_grad`` copies to fp32. Every (rank, phase) within the recorded
    error and the targets, and the run given a peak (refused before: ``zero12_moe_limit``)."""
    from zeroplan.engines.deepspeed.settings import Settings, optimizer_class

    assert optimizer_class(Settings.from_ds_config(row["ds_config"])) == "BF16_Optimizer"
    for rank, measured in enumerate(row["measured"]):
        got = _predict(row, rank, tmp_path)
        for phase, value, then in zip(PHASES, measured, row["predicted_when_recorded"][rank]):
            err = value - got[phase]
            assert abs(err - (value - then)) <= max(SLACK_BYTES, SLACK * value), (rank, phase, value, got[phase], then)
            assert -TARGET * value <= err <= UNDER * value, (rank, phase, value, got[phase])
    assert _moe_limit(row) is None


OFFLOAD = _rows("offload")
ZERO3 = [r for r in OFFLOAD if r["case"].startswith("z3")]
SEVERAL = [r for r in OFFLOAD if "-small" in r["case"] and r["case"].startswith("z2")]
WALK = [r for r in OFFLOAD if "-small" in r["case"] and r["case"].startswith("z1")]
ONE_BUCKET = [r for r in OFFLOAD if r not in ZERO3 and r not in SEVERAL and r not in WALK]  # 5e8 > Ψ; "-ga2": G = 2


def _errors(row: dict, tmp_path: Path) -> list[list[int]]:
    """measured - predicted, per rank and phase, each within the recorded error (a changed prediction shows here)."""
    out = []
    for rank, measured in enumerate(row["measured"]):
        got = _predict(row, rank, tmp_path)
        out.append([value - got[p] for p, value in zip(PHASES, measured)])
        for phase, value, then in zip(PHASES, measured, row["predicted_when_recorded"][rank]):
            assert abs(value - got[phase] - (value - then)) <= max(SLACK_BYTES, SLACK * value), (rank, phase, got[phase])
    return out


@pytest.mark.parametrize("row", ONE_BUCKET, ids=[f"{r['family']}-{r['case']}" for r in ONE_BUCKET])
def test_offload_in_one_bucket_on_sparse_models_every_phase_both_ranks_and_given_a_peak(row, tmp_path):
    """``offload_optimizer: cpu`` at ZeRO-1/2 with every gradient in one bucket (DeepSpeed's 5e8 > Ψ): the dense
    offload profile, every (rank, phase) within the targets (fp32 within 440 B; bf16 up to 0.103 % over), and the run
    given a peak (refused before: ``zero12_moe_limit``, "offload_optimizer to cpu not measured on routed experts").
    At G = 2 ("-ga2") the init was 14.5-16.1 % over and ZeRO-1's step 9.5-10.6 % (``predicted_before``) until the
    host's accumulated gradients were made lazy and ZeRO-2's only (offload.py ``ACCUMULATED``)."""
    for rank, errors in enumerate(_errors(row, tmp_path)):
        for phase, err, value in zip(PHASES, errors, row["measured"][rank]):
            assert -TARGET * value <= err <= UNDER * value, (rank, phase, err)
    assert _moe_limit(row) is None


@pytest.mark.parametrize("row", WALK, ids=[f"{r['family']}-{r['case']}" for r in WALK])
def test_zero1_offload_in_several_buckets_every_phase_both_ranks_and_given_a_peak(row, tmp_path):
    """ZeRO-1 at 5,000-element buckets (below every expert tensor): the walk after backward replayed
    (offload_walk.py ``stage1_offload_walk``: each gradient larger than the bucket cloned, each reduced slice of the
    partition copied to fp64 for its norm, the partition's gradients cleared): the backward within 0.01 % on both
    ranks (the other phases within 1,000 B, as before), and the run given a peak. Before: the backward up to 4.63 %
    under (Mixtral fp32, rank 0: 1,370,028 B, the fp64 copy of a 262,144-element ``gate_up_proj`` slice beside its
    clone) and DeepSeek-V3 bf16 1.53-1.58 % over (an fp32 upcast at the final norm's hook, which ZeRO-1 without
    ``overlap_comm`` never runs; ``predicted_before``), and the run refused."""
    for rank, errors in enumerate(_errors(row, tmp_path)):
        for phase, err, value in zip(PHASES, errors, row["measured"][rank]):
            assert abs(err) <= (0.0001 * value if phase == "backward" else 1000), (rank, phase, err)
            before = value - row["predicted_before"][rank][PHASES.index(phase)]
            if phase == "backward" and (row["family"], row["case"]) != ("deepseek-wide", "z1-fp32-small"):
                assert abs(before) > 10 * abs(err), (rank, before, err)  # the walk is what closed it
    assert _moe_limit(row) is None


@pytest.mark.parametrize("row", SEVERAL, ids=[f"{r['family']}-{r['case']}" for r in SEVERAL])
def test_zero2_offload_in_several_buckets_misses_as_recorded_and_is_refused(row, tmp_path):
    """ZeRO-2 at 5,000-element buckets: reduced from the hooks inside a sparse MLP's backward, where the clone and
    the fp64 norm copy are not modelled (moe12_hooks.py), the backward misses (up to 4.38 % under, Mixtral fp32;
    Qwen3-MoE bf16 2.75 % over), so ``moe_offload.moe_offload_limit`` refuses the run in one line; the other phases
    within 1,000 B. A model of those moments fails here first: then lift the limit."""
    worst = 0.0
    for rank, errors in enumerate(_errors(row, tmp_path)):
        for phase, err, value in zip(PHASES, errors, row["measured"][rank]):
            if phase != "backward":
                assert abs(err) <= 1000, (rank, phase, err)
            worst = max(worst, err / value, -err / value / 2)  # scaled so that 1 % over weighs as 0.5 % under
    why = _moe_limit(row)
    assert why is not None and "offload_optimizer with reduce_bucket_size 5,000 < the largest tensor (" in why
    assert " at ZeRO-2: " in why and "\n" not in why and "or ZeRO-1 without overlap_comm" in why
    assert worst > UNDER, worst


def test_offload_from_the_hooks_with_overlap_comm_is_refused():
    """ZeRO-1 and ZeRO-2 with ``overlap_comm`` reduce from the hooks through two buckets (not measured with offload):
    refused; at Ψ <= the bucket, given."""
    row = WALK[0]
    zero = row["ds_config"]["zero_optimization"]
    for stage, bucket in ((1, 5000), (2, 300_000)):
        over = {**zero, "stage": stage, "overlap_comm": True, "reduce_bucket_size": bucket}
        why = _moe_limit({**row, "ds_config": {**row["ds_config"], "zero_optimization": over}})
        want = f"reduce_bucket_size {bucket:,} < Ψ = 1,433,728 at ZeRO-{stage} with overlap_comm: "
        assert why is not None and want in why, why
    big = {**zero, "overlap_comm": True, "reduce_bucket_size": 500_000_000}
    assert _moe_limit({**row, "ds_config": {**row["ds_config"], "zero_optimization": big}}) is None


HOOKS = _rows("offload_hooks")


@pytest.mark.parametrize("row", HOOKS, ids=[f"{r['family']}-{r['case']}-nd{r['nd']}" for r in HOOKS])
def test_zero2_offload_from_the_hooks_every_phase_every_rank_and_given_a_peak(row, tmp_path):
    """ZeRO-2 with ``offload_optimizer: cpu``, buckets between the largest (expert) tensor and Ψ, N_d 2 and 3, fp32 and
    bf16 (issue 19): no ``grads_in_partition``; each bucket reduced at a hook holds ``allreduce_bucket``'s flat copy,
    then the fp64 copy of the rank's largest slice in the bucket for its norm (moe_offload.py ``norm_copy``), the
    larger, at the sparse MLP's hooks, its attention's (bounded at ``o_proj``'s, the first) and DeepSeek-V3's routed
    ``down_proj`` (moe12_hooks.py); the per-block fp32 upcast not counted (offload.py ``_hook_upcast``). Every (rank,
    phase) within the targets and its recorded error, and the run given a peak (refused before: up to 3.1 % under
    and 6.1 % over, ``predicted_before``)."""
    for rank, errors in enumerate(_errors(row, tmp_path)):
        for phase, err, value in zip(PHASES, errors, row["measured"][rank]):
            assert -TARGET * value <= err <= UNDER * value, (rank, phase, err)
    assert _moe_limit(row) is None


def test_zero2_offload_from_the_hooks_missed_before():
    """The rows above were outside the targets before (``predicted_before``: no norm copy at the hooks, the
    per-block upcast counted): fp32 under (a rank's slice copied to fp64 where it held no partition), bf16 over."""
    misses = [(m - b) / m for r in HOOKS for meas, before in zip(r["measured"], r["predicted_before"])
              for m, b in zip(meas, before)]  # fmt: skip
    assert max(misses) > 0.03 and min(misses) < -0.06, (max(misses), min(misses))


@pytest.mark.parametrize("row", ZERO3, ids=[f"{r['family']}-{r['case']}" for r in ZERO3])
def test_zero3_offload_on_sparse_models_every_phase_both_ranks(row, tmp_path):
    """ZeRO-3 with ``offload_optimizer: cpu`` (given a peak before too, never measured on a sparse model): every
    (rank, phase) within the targets. The bf16 rows at 5,000-element buckets (tests/hf_saved.py DS_SMALL) were
    1.32-2.60 % under (``predicted_before``): the expert gradient held past the bucket has its partition's norm taken
    on an fp64 copy (stage3.py ``_offload_grad_partition_at_boundary -> _constant_buffered_norm2``, 8 B an element of
    the partition) after gloo's reduce-scatter copy (g B an element of the whole tensor) is freed, the larger of the
    two (moe.py ``_reduction_peak``'s ``norm_copy``); in fp32 at N_d = 2 both are the same size."""
    assert row["ds_config"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    for rank, errors in enumerate(_errors(row, tmp_path)):
        for phase, err, value in zip(PHASES, errors, row["measured"][rank]):
            assert -TARGET * value <= err <= UNDER * value, (rank, phase, err)
            assert abs(err) <= 50_000, (rank, phase, err)  # the bf16 forward at 5e8 buckets: 49,536 B, 0.0049 %
    assert _moe_limit(row) is None


HOOKS_G2 = _rows("offload_hooks_g2")


@pytest.mark.parametrize("row", HOOKS_G2, ids=[f"{r['family']}-{r['case']}-nd{r['nd']}" for r in HOOKS_G2])
def test_zero2_offload_from_the_hooks_at_g2_misses_as_recorded_and_is_refused(row, tmp_path):
    """The rows above' region (ZeRO-2, ``offload_optimizer: cpu``, the largest tensor <= the bucket < Ψ) at G = 2
    (issue 19): the backward outside the targets on some rank (Mixtral fp32 rank 0 1.73 % over, DeepSeek-V3 bf16
    rank 1 2.94 % under: ``moe_offload.MEASURED_FROM_HOOKS_G2``), every other phase within 1,000 B; so
    ``moe_offload_limit`` refuses it in one line naming G, and the same run at G = 1 is given a peak. A model of the
    accumulation fails here first: then lift the limit."""
    outside = []
    for rank, errors in enumerate(_errors(row, tmp_path)):
        for phase, err, value in zip(PHASES, errors, row["measured"][rank]):
            if phase != "backward":
                assert abs(err) <= 1000, (rank, phase, err)
            elif not -TARGET * value <= err <= UNDER * value:
                outside.append((rank, err))
    assert outside, "every rank's backward within the targets at G = 2: lift the refusal"
    why = _moe_limit(row)
    assert why is not None and "\n" not in why, why
    assert " at ZeRO-2 and gradient_accumulation_steps 2: " in why and "use gradient_accumulation_steps 1" in why
    assert _moe_limit({**row, "ds_config": {**row["ds_config"], "gradient_accumulation_steps": 1}}) is None


def test_estimate_refuses_zero2_offload_from_the_hooks_at_g2_in_one_line(tmp_path):
    """``zeroplan estimate`` with the file's G = 2 (or ``--grad-accum 2``) in that region: one line on stderr, exit 2;
    at G = 1 the same file is answered."""
    from tests.clicheck import assert_one_line_error, run, run_json

    row = HOOKS_G2[0]
    model, ds = tmp_path / "moe.json", tmp_path / "ds.json"
    model.write_text(json.dumps(row["hf_config"]))
    ds.write_text(json.dumps(row["ds_config"]))
    args = ["estimate", "--engine", "deepspeed", "--model", str(model), "--gpus", "2", "--seq-len", "64"]
    assert_one_line_error(run(*args, "--deepspeed-config", str(ds)), "gradient_accumulation_steps 2: reduced from")
    ds.write_text(json.dumps({**row["ds_config"], "gradient_accumulation_steps": 1}))
    assert_one_line_error(run(*args, "--deepspeed-config", str(ds), "--grad-accum", "2"), "contradicts")
    batch = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")  # a fragment: the command line's batch
    ds.write_text(json.dumps({k: v for k, v in row["ds_config"].items() if k not in batch}))
    assert_one_line_error(run(*args, "--deepspeed-config", str(ds), "--grad-accum", "2"),
                          "gradient_accumulation_steps 2: reduced from")
    assert run_json(*args, "--deepspeed-config", str(ds))["stages"][0]["peak_bytes"] > 0  # G = 1: answered


def test_plan_leaves_out_the_offload_row_from_the_hooks_at_g2():
    """``plan``'s rows of a sparse model (``moe_candidates``) at the workload's G: the ZeRO-2 offload row whose bucket
    lies between the largest tensor and Ψ kept at G = 1, left out at G = 2 with the reason."""
    from zeroplan.architectures.hf_config import read_hf_config
    from zeroplan.engines.deepspeed import Settings
    from zeroplan.engines.deepspeed.plan import moe_candidates

    spec = read_hf_config(Path(__file__).parent / "data" / "hf_configs" / "tiny-mixtral.json")  # Ψ 57,924
    row = ("z2 offload", Settings.from_ds_config({"zero_optimization": {
        "stage": 2, "reduce_bucket_size": 57923, "offload_optimizer": {"device": "cpu"}}}))  # fmt: skip
    assert moe_candidates((row,), spec, {}, grad_accum=1) == (row,)
    dropped: dict[str, str] = {}
    assert moe_candidates((row,), spec, {}, dropped, grad_accum=2) == ()
    assert "gradient_accumulation_steps 2: reduced from the hooks" in dropped["z2 offload"]
