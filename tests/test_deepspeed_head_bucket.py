"""DeepSpeed ZeRO-2 and ZeRO-1 with ``overlap_comm`` on dense transformers classes (untied head) with a
``reduce_bucket_size`` between the largest block tensor and the head's V·h (issue 17): the head's gradient is not
copied into the bucket but reduced at the next hook, the final norm weight's (stage_1_and_2.py
``reduce_independent_p_g_buckets_and_remove_grads``: ``extra_large_param_to_reduce``), so the final RMSNorm's
backward runs with the owning rank's ``grads_in_partition`` (and, at stage 1, the other rank's kept head gradient)
alive (engines/deepspeed/reduce.py ``_final_norm_after_first_bucket``). Predicted-only: no run here."""

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
}  # fmt: skip

#: DeepSpeed 0.19.8, recorded 2026-12-02 on this project's CPU machine (torch 2.13, transformers 5.24):
#: validate.engines.deepspeed_compare.run_world([ds_config(stage, micro_batch=1, zero={"reduce_bucket_size": B,
#: "allgather_bucket_size": B} (+ "overlap_comm": True at stage 1), optimizer_params={"torch_adam": True}), ...], 2,
#: model=<tiny-llama with 64 positions>, steps=2, seq_len=64, runs=[{"model": CONFIG_JSON, "hf": True}, ...]), fp32,
#: gloo, N_d = 2, DS_ACCELERATOR=cpu: (name, stage, B) -> peak bytes [init, forward, backward, optimizer_step] of
#: rank 0 and rank 1. Backward measured - predicted before the final-norm moments (reduce.py
#: ``_final_norm_after_first_bucket``), rank 1 (owning the head) ZeRO-2 / ZeRO-1: llama +15,912 B (+1.49 / +1.47 %),
#: mistral +3,624 B (+0.50 / +0.49 %), qwen2-untied +17,960 B (+2.33 / +2.29 %); llama ZeRO-1 rank 0 +12,808 B
#: (+1.27 %, the kept head gradient). Now every backward -472 B (llama-wide -440 / -184 B, unchanged: the
#: cross-entropy's moment): the 504-B token ids less the rotary buffers, as the other transformers rows.
RECORDED = {
    ("llama", 2, 4500): [[382112, 969424, 995800, 764720], [382112, 969424, 1066920, 764720]],
    ("llama", 1, 4500): [[382112, 969424, 1009080, 764720], [382112, 969424, 1084920, 764720]],
    ("mistral", 2, 2600): [[207648, 682736, 706040, 415792], [207648, 682736, 722840, 415792]],
    ("mistral", 1, 2600): [[207648, 682736, 706040, 415792], [207648, 682736, 733240, 415792]],
    ("qwen2-untied", 2, 3500): [[255328, 716224, 743624, 511152], [255328, 716224, 769816, 511152]],
    ("qwen2-untied", 1, 3500): [[255328, 716224, 743624, 511152], [255328, 716224, 783816, 511152]],
    ("llama-wide", 2, 20000): [[1641024, 3193808, 3455960, 3282512], [1641024, 3193808, 3455960, 3282512]],
    ("llama-wide", 1, 20000): [[1641024, 3193808, 3455960, 3282512], [1641024, 3193808, 3485912, 3282512]],
}  # fmt: skip
#: the largest measured error: 552 B of 415,792 (0.133 %, mistral's optimizer step, every row's +552 B);
#: the misses it catches are 0.49-2.33 %
MARGIN = 0.0015


def _predicted(name: str, stage: int, bucket: int, rank: int, tmp_path) -> dict[str, int]:
    from validate.engines.deepspeed_compare import ds_config, workload_for
    from zeroplan.engines import deepspeed as D

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    zero = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    zero |= {"overlap_comm": True} if stage == 1 else {}
    config = ds_config(stage, micro_batch=1, zero=zero, optimizer_params={"torch_adam": True})
    settings = D.Settings.from_ds_config(config).model_copy(update={"rank": rank})
    (est,) = D.estimate(workload_for(str(path), 1, 64, 1, "none", hf=True), 2, settings, stat_bytes=4)
    return est.peak.by_phase()


@pytest.mark.parametrize(("name", "stage", "bucket"), sorted(RECORDED))
def test_dense_head_larger_than_bucket_both_ranks_every_phase(name, stage, bucket, tmp_path):
    """Every phase of both ranks within MARGIN of the recorded run."""
    from zeroplan.formulas.peak import PHASES

    for rank, measured in enumerate(RECORDED[(name, stage, bucket)]):
        predicted = _predicted(name, stage, bucket, rank, tmp_path)
        for phase, value in zip(PHASES, measured):
            assert abs(value - predicted[phase]) / value <= MARGIN, (name, stage, bucket, rank, phase, predicted[phase])


def test_the_final_norm_moment_is_the_backward_peak_of_the_rank_holding_the_head(tmp_path):
    """llama ZeRO-2 rank 1 (owning the head): the backward peak is the final norm's with its partition, 472 B over
    the run (15,912 B under at the last block's moment without it)."""
    predicted = _predicted("llama", 2, 4500, 1, tmp_path)
    assert predicted["backward"] - RECORDED[("llama", 2, 4500)][1][2] == 472
