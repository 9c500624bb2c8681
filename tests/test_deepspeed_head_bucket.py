"""DeepSpeed ZeRO-2 and ZeRO-1 with ``overlap_comm`` on dense transformers classes (untied head) with a
``reduce_bucket_size`` between the largest block tensor and the head's V·h (issue 17): the head's gradient is not
copied into the bucket but reduced at the next hook, the final norm weight's (stage_1_and_2.py
``reduce_independent_p_g_buckets_and_remove_grads``: ``extra_large_param_to_reduce``), so the final RMSNorm's
backward runs with the owning rank's ``grads_in_partition`` (and, at stage 1, the other rank's kept head gradient)
alive (engines/deepspeed/reduce.py ``_first_bucket_reduced``, phases.py ``final_norm_per_rank``); GPT-2's LayerNorm
leaves its input gradient and weight gradients at that hook (``final_norm_at_its_hook``). fp32 and bf16, N_d 2 and 3.
Predicted-only: no run here (the rows: ``benchmarks/ds_head_bucket_rows.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"


def _config(name: str, **changes) -> dict:
    return {**json.loads((HF_CONFIGS / f"{name}.json").read_text()), **changes}


CONFIGS = {
    "llama": _config("tiny-llama", max_position_embeddings=64),  # V·h 4,944; largest block tensor 4,224
    "mistral": _config("tiny-mistral"),  # V·h 2,912; 2,304
    "qwen2-untied": _config("tiny-qwen2", tie_word_embeddings=False),  # V·h 4,280; 2,560
    # V·h 65,536; 8,192: the cross-entropy's moment is larger (the row shows the new moment does not overshoot)
    "llama-wide": _config("tiny-llama", vocab_size=1024, hidden_size=64, intermediate_size=128,
                          max_position_embeddings=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # LayerNorm final norm (GPT2LMHeadModel untied): V·h 8,440; largest block tensor (c_attn) 4,800
    "gpt2-untied": _config("tiny-gpt2-untied", vocab_size=211, max_position_embeddings=64),
}  # fmt: skip
#: each config's reduce_bucket_size (elements): between its largest block tensor and V·h
BUCKETS = {"llama": 4500, "mistral": 2600, "qwen2-untied": 3500, "llama-wide": 20000, "gpt2-untied": 6000}

#: DeepSpeed 0.19.8, recorded 2026-12-02 on this project's CPU machine (torch 2.13, transformers 5.24):
#: validate.engines.deepspeed_compare.run_world([ds_config(stage, dtype, micro_batch=1, zero={"reduce_bucket_size": B,
#: "allgather_bucket_size": B} (+ "overlap_comm": True at stage 1), optimizer_params={"torch_adam": True}), ...], N_d,
#: model=<tiny-llama with 64 positions>, steps=2, seq_len=64, runs=[{"model": CONFIG_JSON, "hf": True}, ...]), gloo,
#: DS_ACCELERATOR=cpu, B = BUCKETS[name] (the later rows: ``benchmarks/ds_head_bucket_rows.py rows``): (name, stage,
#: dtype, N_d) -> peak bytes [init, forward, backward, optimizer_step] of each rank. Backward measured - predicted
#: before the final-norm moments (reduce.py ``_first_bucket_reduced``), rank 1 (owning the head) ZeRO-2 / ZeRO-1:
#: llama +15,912 B (+1.49 / +1.47 %), mistral +3,624 B (+0.50 / +0.49 %), qwen2-untied +17,960 B (+2.33 / +2.29 %);
#: llama ZeRO-1 rank 0 +12,808 B (+1.27 %, the kept head gradient). Now every backward -472 B (llama-wide -440 / -184 B,
#: unchanged: the cross-entropy's moment): the 504-B token ids less the rotary buffers, as the other transformers rows.
#: The later rows (GPT-2's LayerNorm, bf16, N_d = 3), before ``phases.final_norm_at_its_hook`` and the final RMSNorm's
#: fp32 working set below fp32 (``phases.final_norm_backward``): gpt2-untied fp32 rank 1 at N_d = 2 -20,664 B (-1.85 /
#: -1.81 %), rank 2 at N_d = 3 ZeRO-1 -14,072 B (-1.40 %); llama bf16 rank 1 at N_d = 2 +5,672 B (+0.77 / +0.76 %),
#: rank 2 at N_d = 3 +5,672 B (+0.90 %); now +8 B (GPT-2) and -472 B (Llama), as every other rank of the row.
RECORDED = {
    ("llama", 2, "fp32", 2): [[382112, 969424, 995800, 764720], [382112, 969424, 1066920, 764720]],
    ("llama", 1, "fp32", 2): [[382112, 969424, 1009080, 764720], [382112, 969424, 1084920, 764720]],
    ("mistral", 2, "fp32", 2): [[207648, 682736, 706040, 415792], [207648, 682736, 722840, 415792]],
    ("mistral", 1, "fp32", 2): [[207648, 682736, 706040, 415792], [207648, 682736, 733240, 415792]],
    ("qwen2-untied", 2, "fp32", 2): [[255328, 716224, 743624, 511152], [255328, 716224, 769816, 511152]],
    ("qwen2-untied", 1, "fp32", 2): [[255328, 716224, 743624, 511152], [255328, 716224, 783816, 511152]],
    ("llama-wide", 2, "fp32", 2): [[1641024, 3193808, 3455960, 3282512], [1641024, 3193808, 3455960, 3282512]],
    ("llama-wide", 1, "fp32", 2): [[1641024, 3193808, 3455960, 3282512], [1641024, 3193808, 3485912, 3282512]],
    ("gpt2-untied", 2, "fp32", 2): [[458368, 1066032, 1120056, 917776], [458368, 1066032, 1120152, 917776]],
    ("gpt2-untied", 1, "fp32", 2): [[458368, 1066032, 1120056, 917776], [458368, 1066032, 1144152, 917776]],
    ("llama", 2, "bf16", 2): [[286592, 700720, 713912, 669200], [286592, 700720, 740512, 669200]],
    ("llama", 1, "bf16", 2): [[286592, 700720, 713912, 669200], [286592, 700720, 749512, 669200]],
    ("gpt2-untied", 2, "bf16", 2): [[343776, 788240, 815256, 803184], [343776, 788240, 815256, 803184]],
    ("qwen2-untied", 2, "bf16", 2): [[191504, 522736, 536440, 447328], [191504, 522736, 536440, 447328]],
    ("llama", 2, "fp32", 3): [[382112, 873904, 900280, 573680], [382112, 873904, 900280, 573680],
                              [382112, 873904, 946824, 573680]],
    ("llama", 1, "fp32", 3): [[382112, 873904, 913560, 573680], [382112, 873904, 913560, 573680],
                              [382112, 873904, 964824, 573680]],
    ("gpt2-untied", 2, "fp32", 3): [[458400, 951472, 1005496, 688640], [458400, 951472, 1005496, 688640],
                                    [458400, 951472, 1005496, 688640]],
    ("gpt2-untied", 1, "fp32", 3): [[458400, 951472, 1005496, 688640], [458400, 951472, 1005496, 688640],
                                    [458400, 951472, 1005496, 688640]],
    ("qwen2-untied", 2, "fp32", 3): [[255344, 652416, 679816, 383528], [255344, 652416, 679816, 383528],
                                     [255344, 652416, 690424, 383528]],
    ("mistral", 2, "fp32", 3): [[207680, 630864, 654168, 312032], [207680, 630864, 654168, 312032],
                                [207680, 630864, 658680, 312032]],
    ("llama", 2, "bf16", 3): [[222912, 605200, 618392, 478160], [222912, 605200, 618392, 478160],
                              [222912, 605200, 632704, 478160]],
}  # fmt: skip
#: the largest measured error: 1,792 B of 788,240 (0.227 %, gpt2-untied bf16's forward, both ranks, over: not this
#: file's moments); the misses it catches are 0.49-2.33 %
MARGIN = 0.0025


def _predicted(name: str, stage: int, dtype: str, nd: int, rank: int, tmp_path) -> dict[str, int]:
    from validate.engines.deepspeed_compare import ds_config, workload_for
    from zeroplan.engines import deepspeed as D

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    zero = {"reduce_bucket_size": BUCKETS[name], "allgather_bucket_size": BUCKETS[name]}
    zero |= {"overlap_comm": True} if stage == 1 else {}
    config = ds_config(stage, dtype, micro_batch=1, zero=zero, optimizer_params={"torch_adam": True})
    settings = D.Settings.from_ds_config(config).model_copy(update={"rank": rank})
    (est,) = D.estimate(workload_for(str(path), 1, 64, 1, "none", hf=True), nd, settings, stat_bytes=4)
    return est.peak.by_phase()


@pytest.mark.parametrize(("name", "stage", "dtype", "nd"), sorted(RECORDED))
def test_dense_head_larger_than_bucket_every_rank_every_phase(name, stage, dtype, nd, tmp_path):
    """Every phase of every rank within MARGIN of the recorded run."""
    from zeroplan.formulas.peak import PHASES

    for rank, measured in enumerate(RECORDED[(name, stage, dtype, nd)]):
        predicted = _predicted(name, stage, dtype, nd, rank, tmp_path)
        for phase, value in zip(PHASES, measured):
            error = abs(value - predicted[phase]) / value
            assert error <= MARGIN, (name, stage, dtype, nd, rank, phase, predicted[phase])


def test_the_final_norm_moment_is_the_backward_peak_of_the_rank_holding_the_head(tmp_path):
    """llama ZeRO-2 rank 1 (owning the head): the backward peak is the final norm's with its partition, 472 B over
    the run (15,912 B under at the last block's moment without it)."""
    predicted = _predicted("llama", 2, "fp32", 2, 1, tmp_path)
    assert predicted["backward"] - RECORDED[("llama", 2, "fp32", 2)][1][2] == 472


@pytest.mark.parametrize(("name", "stage", "dtype", "nd", "rank", "error"), [
    ("gpt2-untied", 2, "fp32", 2, 1, 8),  # LayerNorm: its input gradient and two weight gradients (-20,664 B before)
    ("gpt2-untied", 1, "fp32", 3, 2, 8),  # (-14,072 B before)
    ("llama", 2, "bf16", 2, 1, -472),  # bf16 RMSNorm: five fp32 N·d at pow's backward (+5,672 B before)
    ("llama", 2, "bf16", 3, 2, -472),
])  # fmt: skip
def test_the_head_owners_backward_is_its_rows_common_error(name, stage, dtype, nd, rank, error, tmp_path):
    """The rank owning the head, whose backward peaks at the final norm's hook (``phases.final_norm_at_its_hook``)
    or at its pow's backward (``phases.final_norm_backward``), is off by what every other rank of the row is: +8 B
    (GPT-2: as rank 0's cross-entropy) and -472 B (Llama: the token ids less the rotary buffers)."""
    measured = RECORDED[(name, stage, dtype, nd)][rank][2]
    assert measured - _predicted(name, stage, dtype, nd, rank, tmp_path)["backward"] == error


#: ZeRO-3 (issue 17: differential seed 5 draw 6, Qwen3 16.3M, -4.58 % before), its smallest reproduction recorded in
#: tests/data/measured/deepspeed.json by benchmarks/record_measured.py (``HEAD_BUCKET_LLAMA``: a 2-block Llama, V·h =
#: 131,072 > the 81,920-element bucket, N_d = 3), once as the draw ran it (overlap_comm, G = 2, zero.Init), once without
#: those: both read the same bytes. The last bucket's moment predicted every rank's backward 361,108 B (-4.56 %) under.
ZERO3_ROWS = ("deepspeed-z3-llama-head-bucket-nd3", "deepspeed-z3-llama-head-bucket-overlap-accum2-zero-init-nd3")


@pytest.mark.parametrize("name", ZERO3_ROWS)
def test_zero3_head_bucket_sent_at_the_final_norm_hook(name):
    """ZeRO-3 sends the bucket holding the untied head's gradient (larger than the bucket, not copied into it) at the
    final norm weight's hook (zero3_epilogue.py ``final_norm_hook``): that moment is every rank's backward peak, with
    the head's gradient, ``reduce_scatter_coalesced``'s cat and gloo's copy (the head padded to a multiple of 3), and
    every phase of every rank is within +1 % / -0.5 % of the measurement."""
    from tests.test_measured_rows import RECORDS, estimate_of
    from zeroplan.formulas.peak import PHASES

    (record,) = [r for r in RECORDS if r["name"] == name]
    for r in record["ranks"]:
        est = estimate_of(record, r["rank"])
        for phase in PHASES:
            measured = r["measured_peak_bytes_by_phase"][phase]
            assert -0.005 <= (est.peak.by_phase()[phase] - measured) / measured <= 0.01, (r["rank"], phase)
        backward = next(p for p in est.peak.phases if p.phase == "backward")
        assert backward.moment == "final norm backward, a bucket sent"
        terms = {t.name: t.bytes for t in backward.terms}
        assert terms["gradients larger than the bucket, in the bucket sent"] == 1024 * 128 * 4
        assert terms["the bucket's flattened copy and gloo's copy of it"] == 2 * 131_073 * 4  # padded to 3 x 43,691
