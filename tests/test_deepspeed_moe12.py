"""DeepSpeed ZeRO-1 and ZeRO-2 on transformers' mixture-of-experts classes (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3): real runs against the profile, every phase of both ranks; which runs ``moe_limit`` refuses
(engines/deepspeed/moe12.py) and the measured misses that make it; and ``plan --engine deepspeed`` on sparse
models (docs/engines/deepspeed.md "ZeRO-1/2 and mixture-of-experts"). Predicted-only: no run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clicheck import assert_one_line_error, run, run_json
from tests.hf_saved import DS_SMALL
from tests.test_deepspeed_moe import CONFIGS

HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"
#: 300,000-element buckets: above the largest expert tensor of every config here (Mixtral's gate_up_proj 262,144)
DS_ABOVE = {"reduce_bucket_size": 300000, "allgather_bucket_size": 300000}
#: 200,000-element buckets: between Mixtral's expert tensors (down_proj 131,072, gate_up_proj 262,144)
DS_MID = {"reduce_bucket_size": 200000, "allgather_bucket_size": 200000}
ZERO = {"default": {}, "small": DS_SMALL, "above": DS_ABOVE, "mid": DS_MID, "default-overlap": {"overlap_comm": True},
        "small-overlap": {**DS_SMALL, "overlap_comm": True}, "above-overlap": {**DS_ABOVE, "overlap_comm": True},
        "mid-overlap": {**DS_MID, "overlap_comm": True},
        "mid50k": {"reduce_bucket_size": 50000, "allgather_bucket_size": 50000},
        "mid150k": {"reduce_bucket_size": 150000, "allgather_bucket_size": 150000},
        "mid100k": {"reduce_bucket_size": 100000, "allgather_bucket_size": 100000}}  # fmt: skip

#: DeepSpeed 0.19.8 on transformers' classes, recorded 2026-12-02 on this project's CPU machine (torch 2.13,
#: transformers 5.24): validate.engines.deepspeed_compare.run_world([ds_config(stage, micro_batch=1, zero=ZERO[key],
#: optimizer_params={"torch_adam": True}), ...], 2, model=<tiny-llama with 64 positions>, steps=2, seq_len=64,
#: runs=[{"model": CONFIG_JSON, "hf": True}, ...]), fp32, gloo, N_d = 2, DS_ACCELERATOR=cpu: peak bytes [init,
#: forward, backward, optimizer_step] of rank 0 and rank 1 (benchmarks/ds_moe12_rows.py prints them again).
RECORDED = {
    ("mixtral-wide", 1, "default"): [[11469952, 17535936, 2020376232, 22940304]] * 2,
    ("mixtral-wide", 1, "small"): [[11469952, 17535936, 23304628, 22940304], [11469952, 17535936, 23593908, 22940304]],
    ("qwen3-moe-wide", 1, "default"): [[9314944, 15000408, 2016688688, 18630288]] * 2,
    ("qwen3-moe-wide", 1, "small"): [[9314944, 15000408, 18943028, 18630288], [9314944, 15000408, 19139380, 18630288]],
    ("qwen2-moe-wide", 1, "default"): [[11477632, 18428736, 2020287768, 22955664]] * 2,
    ("qwen2-moe-wide", 1, "small"): [[11477632, 18428736, 23057972, 22955664], [11477632, 18428736, 23082804, 22955664]],
    ("deepseek-wide", 1, "default"): [[4389440, 8015856, 2008342776, 8779344]] * 2,
    ("deepseek-wide", 1, "small"): [[4389440, 8015856, 8813044, 8779344], [4389440, 8015856, 8956148, 8779344]],
    # from the hooks, every gradient in one bucket (Ψ <= 5e8): nothing reduced in backward; with overlap_comm two
    # buckets (the double buffer)
    ("mixtral-wide", 2, "default"): [[11469952, 17535936, 2020072852, 22940304]] * 2,
    ("mixtral-wide", 1, "default-overlap"): [[11469952, 17535936, 4020072852, 22940304]] * 2,
    ("qwen3-moe-wide", 2, "default"): [[9314944, 15000408, 2016301588, 18630288]] * 2,
    ("qwen3-moe-wide", 1, "default-overlap"): [[9314944, 15000408, 4016301588, 18630288]] * 2,
    ("qwen2-moe-wide", 2, "default"): [[11477632, 18428736, 2020086292, 22955664]] * 2,
    ("qwen2-moe-wide", 1, "default-overlap"): [[11477632, 18428736, 4020086292, 22955664]] * 2,
    ("deepseek-wide", 2, "default"): [[4389440, 8015856, 2008015864, 8779344]] * 2,
    ("deepseek-wide", 1, "default-overlap"): [[4389440, 8015856, 4008015864, 8779344]] * 2,
}  # fmt: skip
#: The same runs reducing from the hooks in more than one bucket (ZeRO-2, ZeRO-1 with overlap_comm): 5,000-element
#: buckets ("small", below every expert tensor: each reduced on its own at the next hook), 200,000 ("mid": Mixtral's
#: down_proj, 131,072, fits, its gate_up_proj, 262,144, does not: Mixtral-8x7B at DeepSpeed's 5e8) and 300,000
#: ("above": every expert tensor fits). Rows as RECORDED; then per rank the backward's measured - predicted bytes,
#: asserted within MARGIN of it (every other phase within MARGIN). The moments: engines/deepspeed/moe12_hooks.py
#: (a bucket reduced at a sparse MLP's gate_up_proj, router or post-attention norm hook; the last block's working set
#: without the weight gradients gone at the hooks; the head's hook allocating the bucket). "mid50k" / "mid150k":
#: buckets between DeepSeek-V3's expert tensors (32,768 and 65,536) / Qwen3-MoE's (98,304 and 196,608); "mid100k"
#: between Qwen2-MoE's (65,536 and 131,072). Before them (the partition placed at a block's first op, every
#: MLP weight gradient held): Mixtral small +53,896 / -376 B, Qwen3-MoE +237,448 / -376, Qwen2-MoE +811,928 /
#: -227,688, DeepSeek-V3 -440 / -98,744; above: Mixtral -262,024 / +89,480, DeepSeek-V3 -69,304 / +238,120
#: (its rank 0 at the head's hook: DeepSpeed's setup_buckets beside the head gradient, live storages);
#: ZeRO-1 overlap_comm small: Mixtral +53,896 / -376, DeepSeek-V3 +317,000 / -98,744 (refused then).
FROM_HOOKS = {
    ("mixtral-wide", 2, "small"): ([[11469952, 17535936, 19924680, 22940304], [11469952, 17535936, 22114024, 22940304]],
                                   (136, -376)),
    ("qwen3-moe-wide", 2, "small"): ([[9314944, 15000408, 16548688, 18630288], [9314944, 15000408, 18500992, 18630288]],
                                     (392, -376)),  # rank 0 2,952 B before its router's hook came after the experts'
    ("qwen2-moe-wide", 2, "small"): ([[11477632, 18428736, 20331080, 22955664], [11477632, 18428736, 21861480, 22955664]],
                                     (2184, -888)),
    ("deepseek-wide", 2, "small"): ([[4389440, 8015856, 8177400, 8779344], [4389440, 8015856, 9352216, 8779344]],
                                    (-440, -440)),
    ("mixtral-wide", 1, "small-overlap"): ([[11469952, 17535936, 22430440, 22940304],
                                            [11469952, 17535936, 22134024, 22940304]], (136, -376)),
    ("deepseek-wide", 1, "small-overlap"): ([[4389440, 8015856, 9091352, 8779344], [4389440, 8015856, 9372216, 8779344]],
                                            (-440, -440)),
    ("mixtral-wide", 2, "mid"): ([[11469952, 17535936, 20704680, 22940304], [11469952, 17535936, 22113192, 22940304]],
                                 (136, 136)),
    ("mixtral-wide", 1, "mid-overlap"): ([[11469952, 17535936, 22553256, 22940304],
                                          [11469952, 17535936, 22913192, 22940304]], (136, 136)),
    ("mixtral-wide", 2, "above"): ([[11469952, 17535936, 20788760, 22940304], [11469952, 17535936, 22442040, 22940304]],
                                   (2184, 2184)),
    ("mixtral-wide", 1, "above-overlap"): ([[11469952, 17535936, 21988760, 22940304],
                                            [11469952, 17535936, 23642040, 22940304]], (2184, 2184)),
    ("deepseek-wide", 2, "above"): ([[4389440, 8015856, 9215864, 8779344], [4389440, 8015856, 9523288, 8779344]],
                                    (-440, 2120)),
    ("qwen3-moe-wide", 2, "above"): ([[9314944, 15000408, 17393304, 18630288], [9314944, 15000408, 18992840, 18630288]],
                                     (3720, 3464)),  # rank 0 648 B before (its router's hook placed first)
    # refused until the router's hook came after the experts' (run.grad_ready_order: 2,952 / 298,400 B
    # under) and the gate-up backward with the partition a down_proj hook allocated (moe12_hooks._gate_up_backward)
    ("qwen3-moe-wide", 2, "mid150k"): ([[9314944, 15000408, 17128688, 18630288],
                                        [9314944, 15000408, 18687776, 18630288]], (392, 3488)),
    # refused until the hooks came in autograd's order (66,696 / 198,808 B under) and the gathered rows'
    # backward after a gate-up hook whose gradient waits became a moment (moe12_hooks.sparse_hook_partitions)
    ("qwen2-moe-wide", 2, "mid100k"): ([[11477632, 18428736, 20513448, 22955664],
                                        [11477632, 18428736, 21979336, 22955664]], (1160, 2200)),
    # rank 0's peak in the final norm's weight-product backward, the head's 64,384-element gradient (over the
    # bucket) waiting for the next hook (moe12_hooks.head_hook_bucket): 61,800 B (0.75 %) under before
    ("deepseek-wide", 2, "mid50k"): ([[4389440, 8015856, 8281912, 8779344], [4389440, 8015856, 9529400, 8779344]],
                                     (-440, 72)),
    # refused until a bucket reduced at a hook of Qwen2-MoE's shared SwiGLU (run backward last) became a moment
    # (moe12_hooks._at_shared_hook): rank 1's partition allocated at layer 2's shared down_proj hook, 674,184 B
    # (3.0 %) under before; the bucket range from gate_up_proj to Ψ: MEASURED["qwen2"]
    ("qwen2-moe-wide", 2, "above"): ([[11477632, 18428736, 20965272, 22955664],
                                      [11477632, 18428736, 22218168, 22955664]], (2184, 136)),
}  # fmt: skip
#: the largest measured error of RECORDED: 648 B of 8.8 MB (0.0074 %, DeepSeek-V3's optimizer step); DeepSeek-V3's
#: one-bucket backward 440 B over (69,304 B over before its head's hook moment, moe12_hooks.head_hook_bucket)
MARGIN = 0.0001


def _estimate(name: str, stage: int, zero: str, rank: int, tmp_path):
    from validate.engines.deepspeed_compare import ds_config, workload_for
    from zeroplan.engines import deepspeed as D

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    config = ds_config(stage, micro_batch=1, zero=ZERO[zero], optimizer_params={"torch_adam": True})
    settings = D.Settings.from_ds_config(config).model_copy(update={"rank": rank})
    (est,) = D.estimate(workload_for(str(path), 1, 64, 1, "none", hf=True), 2, settings, stat_bytes=4)
    return est.peak.by_phase(), config


@pytest.mark.parametrize(("name", "stage", "zero"), sorted(RECORDED))
def test_zero12_peaks_of_transformers_moe_classes_both_ranks_every_phase(name, stage, zero, tmp_path):
    """Every phase of both ranks within MARGIN, and the run not refused (``moe_limit``)."""
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.engines.base import PlannerOptions
    from zeroplan.engines.deepspeed.plan import moe_limit
    from zeroplan.formulas.peak import PHASES

    for rank, measured in enumerate(RECORDED[(name, stage, zero)]):
        predicted, config = _estimate(name, stage, zero, rank, tmp_path)
        for phase, value in zip(PHASES, measured):
            assert abs(value - predicted[phase]) / value <= MARGIN, (name, stage, zero, rank, phase, predicted[phase])
    assert moe_limit(PlannerOptions(ds_config=config), spec_from_hf_config(CONFIGS[name])) is None


@pytest.mark.parametrize(("name", "stage", "zero"), sorted(FROM_HOOKS))
def test_zero12_reducing_at_hooks_in_several_buckets_within_the_recorded_residuals(name, stage, zero, tmp_path):
    """Every phase of both ranks within MARGIN, the backward after its recorded residual, and the run not refused."""
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.engines.base import PlannerOptions
    from zeroplan.engines.deepspeed.plan import moe_limit
    from zeroplan.formulas.peak import PHASES

    rows, residuals = FROM_HOOKS[(name, stage, zero)]
    for rank, measured in enumerate(rows):
        predicted, config = _estimate(name, stage, zero, rank, tmp_path)
        for phase, value in zip(PHASES, measured):
            expected = residuals[rank] / value if phase == "backward" else 0.0
            assert abs((value - predicted[phase]) / value - expected) <= MARGIN, (name, rank, phase, predicted[phase])
    assert moe_limit(PlannerOptions(ds_config=config), spec_from_hf_config(CONFIGS[name])) is None


#: Rows measured by ``benchmarks/ds_moe12_rows.py buckets`` (each file's ``sources``), per row ``predicted`` (this code,
#: when recorded) and ``predicted_before`` (main before; refused then). "qwen2": Qwen2-MoE reducing from the hooks with
#: buckets from its gate_up_proj (E·2f·d = 131,072) to Ψ (1,434,688), fp32 and bf16, N_d 2 and 3, ZeRO-2 and ZeRO-1
#: with overlap_comm (before the shared SwiGLU's and the experts' down_proj hooks became moments: up to 5.2 % under);
#: "fp16": the four families reducing from the hooks in fp16 (not measured before); "accum": ZeRO-1 with overlap_comm
#: accumulating (G = 2, 3; N_d = 2, 3), the boundary micro-step reducing from the hooks (boundary.py, moe12_ws.py).
MEASURED = {k: json.loads((Path(__file__).parent / "data" / "measured" / f"deepspeed_moe12_{k}.json").read_text())
            for k in ("qwen2", "fp16", "accum")}  # fmt: skip


@pytest.mark.parametrize(("key", "i"), [(k, i) for k, d in MEASURED.items() for i in range(len(d["rows"]))])
def test_recorded_hook_rows_within_target_and_given_a_peak(key, i, tmp_path):
    """Every phase of every rank within issue 17's target (|error| <= 1 %, under <= 0.5 %) and at the recorded
    prediction (64 B), and ``moe_limit`` gives the run a peak (before: refused in one line)."""
    from validate.engines.deepspeed_compare import workload_for
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.engines import deepspeed as D
    from zeroplan.engines.base import PlannerOptions
    from zeroplan.engines.deepspeed.plan import moe_limit
    from zeroplan.formulas.peak import PHASES

    row = MEASURED[key]["rows"][i]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(row["hf_config"]))
    g = row["ds_config"].get("gradient_accumulation_steps", 1)
    workload = workload_for(str(path), row["micro_batch"], row["seq_len"], g, "none", hf=True)
    for rank, (measured, recorded) in enumerate(zip(row["measured"], row["predicted"])):
        settings = D.Settings.from_ds_config(row["ds_config"]).model_copy(update={"rank": rank})
        (est,) = D.estimate(workload, row["n_d"], settings, stat_bytes=4)
        predicted = est.peak.by_phase()
        for phase, value, then in zip(PHASES, measured, recorded):
            assert -0.01 <= (value - predicted[phase]) / value <= 0.005, (rank, phase, value, predicted[phase])
            assert abs(predicted[phase] - then) <= 64, (rank, phase, predicted[phase], then)
    assert moe_limit(PlannerOptions(ds_config=row["ds_config"], grad_accum=g),
                     spec_from_hf_config(row["hf_config"])) is None


def test_accumulating_rows_missed_before_the_boundary_rules():
    """``predicted_before`` (main before the boundary's sparse moments held only the gradients not yet hooked, and
    the working set per block): every row's backward beyond 1 % over on some rank (up to 17.8 %; the G = 1 row
    1.27 %, the last block's working set on block 1) but DeepSeek-V3's at 300,000 (its peak the LM head's); now the
    worst rank 0.77 % over (Qwen2-MoE, N_d = 3, G = 3, 5,000)."""
    worst = {}
    for row in MEASURED["accum"]["rows"]:
        key = (row["model"], row["ds_config"]["zero_optimization"]["reduce_bucket_size"], row["n_d"],
               row["ds_config"]["gradient_accumulation_steps"])
        worst[key] = min((m[2] - b[2]) / m[2] for m, b in zip(row["measured"], row["predicted_before"]))
    missed = {k for k, w in worst.items() if w < -0.01}
    assert missed == set(worst) - {("deepseek-wide", 300000, 2, 2)}, worst


#: bf16 (ds_config(stage, "bf16", ...): DeepSpeedZeroOptimizer, gradients in bf16), recorded as RECORDED: both ranks
#: alike. The forward was under at every stage (+0.48 %, +1.09 %) until transformers' bf16 logits beside their fp32
#: upcast became a term (phases.forward_moments); asserted: {phase: (measured - predicted) / measured} beyond MARGIN,
#: and the runs are given a peak (``zero12_moe_limit``). DeepSeek's forward was 3,648 B under (its ZeRO-1 small
#: backward 3,656 B) until the routers' fp32 weight copies and bias buffers became terms (``run.router_copies``,
#: ``run._fp32_buffers``: 4,128 B); now 480 B over, as Mixtral's 384 B: with the rotary buffers (not modelled: 32 B,
#: 128 B) ZeRO-1/2's bf16 forward holds 512 B more than measured, on both families.
BF16 = {
    ("mixtral-wide", 1, "default"): ([8602496, 13389376, 1014525864, 20072848], {}),
    ("mixtral-wide", 1, "small"): ([8602496, 13389376, 16098468, 20072848], {}),
    ("mixtral-wide", 2, "default"): ([8602496, 13389376, 1014337940, 20072848], {}),
    ("deepseek-wide", 1, "default"): ([3292096, 6233328, 1006235768, 7682000], {"forward": -480 / 6233328}),
    ("deepseek-wide", 1, "small"): ([3292096, 6233328, 6297720, 7682000],
                                    {"forward": -480 / 6233328, "backward": -472 / 6297720}),
    ("deepseek-wide", 2, "default"): ([3292096, 6233328, 1006057592, 7682000],
                                      {"forward": -480 / 6233328, "backward": -49624 / 1006057592}),
}  # fmt: skip


#: bf16 reducing from the hooks in more than one bucket (ds_config(2, "bf16", ...)), recorded as FROM_HOOKS: both
#: ranks, then the backward's measured - predicted bytes per rank; the forward 384 B (Mixtral) / 480 B (DeepSeek-V3)
#: over and the step 648 / 552 B under, as BF16's.
BF16_FROM_HOOKS = {
    ("mixtral-wide", 2, "small"): ([[8602496, 13389376, 14334392, 20072848], [8602496, 13389376, 15468248, 20072848]],
                                   (136, -376)),
    ("mixtral-wide", 2, "mid"): ([[8602496, 13389376, 14724392, 20072848], [8602496, 13389376, 15463992, 20072848]],
                                 (136, 1160)),  # rank 1 33,928 B before the gathered rows' backward moment
    ("deepseek-wide", 2, "small"): ([[3292096, 6233328, 6297720, 7682000], [3292096, 6233328, 6756872, 7682000]],
                                    (-472, 15912)),
    ("deepseek-wide", 2, "mid50k"): ([[3292096, 6233328, 6297720, 7682000], [3292096, 6233328, 6830488, 7682000]],
                                     (-472, -472)),
}  # fmt: skip


@pytest.mark.parametrize(("name", "stage", "zero"), sorted(BF16_FROM_HOOKS))
def test_bf16_reducing_at_hooks_within_the_recorded_residuals(name, stage, zero, tmp_path):
    from validate.engines.deepspeed_compare import ds_config, workload_for
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.engines import deepspeed as D
    from zeroplan.engines.base import PlannerOptions
    from zeroplan.engines.deepspeed.plan import moe_limit
    from zeroplan.formulas.peak import PHASES

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    config = ds_config(stage, "bf16", micro_batch=1, zero=ZERO[zero], optimizer_params={"torch_adam": True})
    rows, residuals = BF16_FROM_HOOKS[(name, stage, zero)]
    for rank, measured in enumerate(rows):
        settings = D.Settings.from_ds_config(config).model_copy(update={"rank": rank})
        (est,) = D.estimate(workload_for(str(path), 1, 64, 1, "none", hf=True), 2, settings, stat_bytes=4)
        predicted = est.peak.by_phase()
        for phase, value in zip(PHASES, measured):
            expected = residuals[rank] / value if phase == "backward" else 0.0
            assert abs((value - predicted[phase]) / value - expected) <= MARGIN, (name, rank, phase, predicted[phase])
    assert moe_limit(PlannerOptions(ds_config=config), spec_from_hf_config(CONFIGS[name])) is None


@pytest.mark.parametrize(("name", "stage", "zero"), sorted(BF16))
def test_bf16_sparse_runs_within_the_recorded_residuals_and_given_a_peak(name, stage, zero, tmp_path):
    from validate.engines.deepspeed_compare import ds_config, workload_for
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.engines import deepspeed as D
    from zeroplan.engines.base import PlannerOptions
    from zeroplan.engines.deepspeed.plan import moe_limit
    from zeroplan.formulas.peak import PHASES

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    config = ds_config(stage, "bf16", micro_batch=1, zero=ZERO[zero], optimizer_params={"torch_adam": True})
    measured, residual = BF16[(name, stage, zero)]
    settings = D.Settings.from_ds_config(config).model_copy(update={"rank": 1})  # the larger rank (small buckets)
    (est,) = D.estimate(workload_for(str(path), 1, 64, 1, "none", hf=True), 2, settings, stat_bytes=4)
    predicted = est.peak.by_phase()
    for phase, value in zip(PHASES, measured):
        assert abs((value - predicted[phase]) / value - residual.get(phase, 0.0)) <= MARGIN, (phase, predicted[phase])
    why = moe_limit(PlannerOptions(ds_config=config), spec_from_hf_config(CONFIGS[name]))
    assert why is None


@pytest.mark.parametrize(("zero", "refused"), [
    ({"stage": 1}, None),
    ({"stage": 1, "reduce_bucket_size": 5000}, None),  # reduced after backward: the dense rule, measured
    ({"stage": 2, "reduce_bucket_size": 57924}, None),  # tiny-mixtral's Ψ: one bucket, reduced after backward
    ({"stage": 2, "reduce_bucket_size": 57923}, None),  # from the hooks in two buckets, fp32: measured (FROM_HOOKS)
    ({"stage": 2, "reduce_bucket_size": 14400}, None),  # = gate_up_proj
    ({"stage": 1, "reduce_bucket_size": 5000, "overlap_comm": True}, None),
    ({"stage": 2, "reduce_bucket_size": 57923, "bf16": {"enabled": True}}, None),  # BF16_FROM_HOOKS
    ({"stage": 2, "reduce_bucket_size": 57923, "fp16": {"enabled": True}}, None),  # MEASURED["fp16"] (refused before)
    ({"stage": 1, "reduce_bucket_size": 5000, "overlap_comm": True, "fp16": {"enabled": True}}, None),
    ({"stage": 2, "reduce_bucket_size": 57924, "bf16": {"enabled": True}}, None),  # one bucket: BF16 above
    ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, None),  # one bucket: test_deepspeed_moe_opt.py
    ({"stage": 2, "reduce_bucket_size": 57923, "offload_optimizer": {"device": "cpu"}}, None),  # test_deepspeed_moe_opt
    ({"stage": 2, "reduce_bucket_size": 14399, "offload_optimizer": {"device": "cpu"}},
     "offload_optimizer with reduce_bucket_size 14,399 < the largest tensor (14,400)"),  # moe_offload.py: 4.38 % under
    ({"stage": 2, "reduce_bucket_size": 57923, "overlap_comm": True, "offload_optimizer": {"device": "cpu"}},
     "offload_optimizer with reduce_bucket_size 57,923 < Ψ = 57,924 at ZeRO-2 with overlap_comm"),  # not measured
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "fp16": {"enabled": True}}, None),  # test_deepspeed_moe_fp16_nvme
    ({"stage": 2, "reduce_bucket_size": 14399, "offload_optimizer": {"device": "cpu"}, "fp16": {"enabled": True}},
     "offload_optimizer with reduce_bucket_size 14,399 < the largest tensor (14,400)"),  # the bucket's, not the dtype's
    ({"stage": 1, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}, None),  # test_deepspeed_moe_opt
    ({"stage": 1, "overlap_comm": True, "reduce_bucket_size": 5000, "bf16": {"enabled": True},
      "data_types": {"grad_accum_dtype": "fp32"}}, None),  # BF16_Optimizer: no hook reduces, whatever overlap_comm
    ({"stage": 3, "offload_param": {"device": "cpu"}}, None),  # measured: test_deepspeed_moe_fp16_nvme
])  # fmt: skip
def test_moe_limit_refuses_only_what_is_not_measured(zero, refused):
    from zeroplan.architectures.hf_config import read_hf_config
    from zeroplan.engines.base import PlannerOptions
    from zeroplan.engines.deepspeed.plan import moe_limit

    zero = dict(zero)
    top = {k: zero.pop(k) for k in ("bf16", "fp16", "data_types") if k in zero}  # ds_config's own sections
    why = moe_limit(PlannerOptions(ds_config={"zero_optimization": zero, **top}),
                    read_hf_config(HF_CONFIGS / "tiny-mixtral.json"))  # fmt: skip
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why and "\n" not in why


#: sparse models whose Ψ lies between plan's bucket choices 5e6 and 5e7 (``BUCKET_CHOICES``): the ZeRO-2 row at 5e6
#: reduces from the hooks in more than one bucket, modelled in fp32, bf16 and fp16 (FROM_HOOKS, MEASURED["fp16"]; left
#: out in fp16 before); every row stays (the expert tensor, E·2f·d, above 5e6 too: ZeRO-1's 5e6 row reduces it on its
#: own, after backward)
PLAN_MODELS = {
    "mixtral": ({"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 1536, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 503, "max_position_embeddings": 64,
                 "num_local_experts": 8, "num_experts_per_tok": 2}, 19530496, 8 * 2 * 1536 * 256),
    "deepseek_v3": ({**CONFIGS["deepseek-wide"], "moe_intermediate_size": 10000}, 38702912, 4 * 2 * 10000 * 128),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(PLAN_MODELS))
def test_plan_answers_for_sparse_models_and_its_ds_configs_read_back(family, tmp_path):
    """``plan --engine deepspeed`` on a sparse model answers with rows of ZeRO-1, 2 and 3 (before: refused, its search
    includes ZeRO-1), in fp32 every one (the ZeRO-2 row whose bucket is below Ψ too, before: left out), in fp16 every
    one too (before: less that row, named in the reason); the recommendation's ds_config and a ZeRO-1 and a ZeRO-2 row's
    (``to_ds_config``), read back by ``estimate --deepspeed-config``, give the plan's peaks."""
    from zeroplan.engines import deepspeed as D

    cfg, psi, expert = PLAN_MODELS[family]
    assert 5_000_000 < expert < psi < 50_000_000
    model = tmp_path / "config.json"
    model.write_text(json.dumps(cfg))
    args = ("--model", str(model), "--gpus", "2", "--gpu", "h100-80gb", "--seq-len", "64", "--micro-batch", "1")
    d = run_json("plan", "--engine", "deepspeed", *args)
    rows = {s["label"]: s for s in d["stages"]}
    assert {s["stage"] for s in d["stages"]} == {1, 2, 3}
    assert {"ZeRO-2, buckets 5e6", "ZeRO-1, buckets 5e6", "ZeRO-2, buckets 5e7"} <= rows.keys()
    assert f"Ψ = {psi:,} elements" in d["reason"] and d["reason"].endswith(": none)")
    fp16 = tmp_path / "fp16.json"
    fp16.write_text(json.dumps({"fp16": {"enabled": True}}))
    b = run_json("plan", "--engine", "deepspeed", "--deepspeed-config", str(fp16), *args)
    assert [s["label"] for s in b["stages"]] and {s["label"] for s in b["stages"]} == rows.keys()
    assert b["reason"].endswith(": none)") and b["recommendation"]["deepspeed"]["fp16"] == {"enabled": True}
    chosen = {d["recommendation"]["label"]: d["recommendation"]["deepspeed"]}
    for label, stage, bucket in (("ZeRO-1, buckets 5e6", 1, 5_000_000), ("ZeRO-2, buckets 5e7", 2, 50_000_000)):
        s = D.Settings.from_ds_config({"zero_optimization": {"stage": stage, "reduce_bucket_size": bucket,
                                                             "allgather_bucket_size": bucket}})  # fmt: skip
        chosen[label] = D.to_ds_config(s)
    for label, ds in chosen.items():
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        e = run_json("estimate", "--engine", "deepspeed", "--deepspeed-config", str(path), *args,
                     "--checkpointing", "full")  # plan's default checkpointing  # fmt: skip
        (row,) = e["stages"]
        assert row["peak_bytes"] == rows[label]["peak_bytes"], label


#: a ZeRO-3 file keeping the sparse MLP whole (``leaf_module``): refused at ZeRO-3 (``moe.zero3_moe_limit``), its keys
#: unread at ZeRO-1/2
LEAF = {"zero_optimization": {"reduce_bucket_size": 5000, "leaf_module": {"classes": ["MixtralSparseMoeBlock"]}},
        "fp16": {"enabled": True}}  # fmt: skip
LEAF_WHY = "leaf_module / stage3_module_granularity_threshold not modelled"


def test_estimate_refuses_a_refused_sparse_run_in_one_line(tmp_path):
    path = tmp_path / "ds.json"
    args = ("estimate", "--engine", "deepspeed", "--deepspeed-config", str(path), "--model",
            str(HF_CONFIGS / "tiny-mixtral.json"), "--gpus", "2", "--gpu", "h100-80gb")  # fmt: skip
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5000}}))
    assert run(*args).exit_code == 0  # fp32: modelled (FROM_HOOKS)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5000},
                                "fp16": {"enabled": True}}))
    assert run(*args).exit_code == 0  # fp16 from the hooks: modelled (MEASURED["fp16"]; refused before)
    path.write_text(json.dumps({**LEAF, "zero_optimization": {**LEAF["zero_optimization"], "stage": 3}}))
    assert_one_line_error(run(*args), LEAF_WHY)


def test_sweep_refuses_a_sparse_run_at_any_stage_it_sweeps(tmp_path):
    """``sweep`` asks the limit of every stage it sweeps (sweeping/config.py): with ``leaf_module`` ZeRO-1 and 2 are
    modelled (fp16 from the hooks too), ZeRO-3 is not, so ``--stage 1,3`` is refused in one line (before: only the
    first stage asked)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(LEAF))
    args = ("sweep", "--engine", "deepspeed", "--deepspeed-config", str(path), "--model",
            str(HF_CONFIGS / "tiny-mixtral.json"), "--gpus", "2", "--gpu", "h100-80gb")  # fmt: skip
    assert run(*args, "--stage", "1,2").exit_code == 0
    assert_one_line_error(run(*args, "--stage", "1,3"), LEAF_WHY)
