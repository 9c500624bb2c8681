"""The engine registry is the only door (issue 16): a toy engine added through the public registry API
answers ``estimate``, ``plan`` and ``sweep``; and the rules the hardening helper left, each with one home."""

from __future__ import annotations

import json

import pytest

import zeroplan
from zeroplan.engines import get_engine

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 128}  # fmt: skip


# ---------------------------------------------------------------- the hardening helper's leftovers


@pytest.mark.parametrize("name", [{"a": 1}, ["reference"], 3, None])
def test_get_engine_refuses_a_non_string_in_one_line(name):
    with pytest.raises(ValueError, match=r"^unknown engine .*: known engines are reference, deepspeed, fsdp2$"):
        get_engine(name)


@pytest.mark.parametrize("stage", [4, 0, "3"])
def test_the_deepspeed_plan_reads_the_files_stage_before_searching(tmp_path, stage):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        zeroplan.plan(str(cfg), gpu="h100-80gb", gpus=8, engine="deepspeed",
                      ds_config={"zero_optimization": {"stage": stage}})  # fmt: skip
    plan = zeroplan.plan(str(cfg), gpu="h100-80gb", gpus=8, engine="deepspeed",
                         ds_config={"zero_optimization": {"stage": 2}})  # fmt: skip
    assert {o.stage for o in plan.options} == {1, 2, 3}  # the file's stage is one candidate, not the answer


@pytest.mark.parametrize("name", ["a" * 5000, "x\x00y", ("b" * 300 + "/") * 20])
def test_a_model_name_no_file_system_can_hold_is_a_preset_question(name):
    from zeroplan.presets import is_config_path

    assert is_config_path(name) is False
    with pytest.raises(ValueError, match="unknown model"):
        zeroplan.estimate(model=name, gpus=8)


def test_an_empty_baseline_is_refused_where_baselines_are_read(tmp_path):
    from validate.baseline import read_baseline

    path = tmp_path / "b.json"
    path.write_text(json.dumps({"schema": "zeroplan.validate/2", "config": {}, "torch": None, "rows": [],
                                "notes": [], "ok": True}))  # fmt: skip
    with pytest.raises(ValueError, match=r"^--baseline .*: has no rows, so nothing could be compared"):
        read_baseline(str(path))
