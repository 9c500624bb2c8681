"""``plan --deepspeed-config F`` on a sparse model whose file's own stage and buckets are a run DeepSpeed's MoE
profile refuses (issue 19): ``plan`` chooses the stage and buckets itself, so its config check asks the engine's
limits as the plan uses them (``Engine.plan_options``), answers with the rows it models and names the others;
``estimate`` on the same file keeps refusing in one line. Predicted-only, CPU seconds."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import zeroplan
from clicheck import assert_one_line_error, run, run_json
from tests.test_deepspeed_moe12 import PLAN_MODELS
from tests.test_registry import TINY, toy  # noqa: F401  (toy: the fixture)

HF_CONFIGS = Path(__file__).parent / "data" / "hf_configs"
ARGS = ("--gpus", "2", "--gpu", "h100-80gb", "--seq-len", "64", "--micro-batch", "1")


def _files(tmp_path, model: dict | Path, ds: dict) -> tuple[str, ...]:
    if isinstance(model, dict):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(model))
        model = path
    file = tmp_path / "ds.json"
    file.write_text(json.dumps(ds))
    return ("--engine", "deepspeed", "--deepspeed-config", str(file), "--model", str(model), *ARGS)


def test_plan_on_an_fp16_mixtral_file_answers_less_the_rows_it_cannot_model(tmp_path):
    """Ψ = 19,530,496 (PLAN_MODELS): the file's ZeRO-2 with 5e6 buckets in fp16 reduces from the hooks in fp16, not
    modelled. Before: ``plan`` refused whole with that reason; now it answers with every other row (15 of 16) and
    names the one left out; ``estimate`` of the file itself still refuses in one line."""
    cfg, psi, _ = PLAN_MODELS["mixtral"]
    args = _files(tmp_path, cfg, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5_000_000},
                                  "fp16": {"enabled": True}})  # fmt: skip
    why = f"ZeRO-2 in fp16 with reduce_bucket_size 5,000,000 < Ψ = {psi:,}"
    assert_one_line_error(run("estimate", *args), why)
    d = run_json("plan", *args)
    labels = [s["label"] for s in d["stages"]]
    assert len(labels) == 15 and "ZeRO-2, buckets 5e6" not in labels
    assert {"ZeRO-1, buckets 5e6", "ZeRO-2, buckets 5e7", "ZeRO-3, buckets 5e6"} <= set(labels)
    assert f"left out (moe_limit, docs/engines/deepspeed.md): ZeRO-2, buckets 5e6: {why}" in d["reason"]
    assert d["recommendation"]["deepspeed"]["fp16"] == {"enabled": True}  # the file's precision kept


def test_plan_on_a_qwen2_moe_file_reducing_at_the_shared_experts_hooks_answers(tmp_path):
    """tiny-qwen2-moe: Ψ = 81,360, gate_up_proj 11,520 elements; the file's ZeRO-2 bucket of 50,000 lies between
    (``_hook_order_limit``): ``estimate`` refuses, ``plan`` (buckets 5e6 to 5e8, all >= Ψ) drops nothing."""
    args = _files(tmp_path, HF_CONFIGS / "tiny-qwen2-moe.json",
                  {"zero_optimization": {"stage": 2, "reduce_bucket_size": 50000}})  # fmt: skip
    assert_one_line_error(run("estimate", *args), "qwen2_moe reducing from the hooks with reduce_bucket_size 50,000")
    d = run_json("plan", *args)
    assert {s["stage"] for s in d["stages"]} == {1, 2, 3} and len(d["stages"]) == 16
    assert "Ψ = 81,360 elements" in d["reason"] and d["reason"].endswith(": none)")


def test_a_file_that_leaves_no_row_modelled_refuses_the_plan_in_one_line(tmp_path):
    """Ψ = 816,864,256 > every bucket plan tries: fp16 with overlap_comm reduces from the hooks at ZeRO-1 and 2 in
    every row, and a ``leaf_module`` takes every ZeRO-3 row out (``zero3_moe_limit``): no row left, so the plan
    refuses with the rows' reasons (not an empty table that reads "no configuration fits")."""
    big = {**PLAN_MODELS["mixtral"][0], "hidden_size": 1024, "intermediate_size": 8192, "num_attention_heads": 8,
           "num_hidden_layers": 4}  # fmt: skip
    args = _files(tmp_path, big, {"zero_optimization": {"stage": 1, "overlap_comm": True, "leaf_module": {
        "classes": ["MixtralSparseMoeBlock"]}}, "fp16": {"enabled": True}})  # fmt: skip
    result = run("plan", *args)
    assert_one_line_error(result, "no configuration plan searches has a modelled peak: ZeRO-1, buckets 5e8: ZeRO-1 "
                          "with overlap_comm in fp16 with reduce_bucket_size 500,000,000 < Ψ = 816,864,256")
    assert "ZeRO-3, buckets 5e8, ZeRO-3, buckets 2e8, " in result.stderr
    assert "leaf_module / stage3_module_granularity_threshold not modelled" in result.stderr


def test_a_bad_file_stage_still_refuses_the_plan_in_one_line(tmp_path):
    args = _files(tmp_path, HF_CONFIGS / "tiny-mixtral.json", {"zero_optimization": {"stage": 4}})
    assert_one_line_error(run("plan", *args), "zero_optimization.stage")


def test_an_engines_plan_options_are_what_plans_limits_are_asked_with(toy, tmp_path):  # noqa: F811
    """Through the registry only: the toy's plan chooses ``copies`` itself (1 to 3), so a toy whose
    ``plan_options`` drops the option answers ``plan`` at copies=4, which its peak limit refuses to ``estimate``."""
    from zeroplan.engines import REGISTRY
    from zeroplan.engines.base import PeakLimit

    def limits(options, spec):
        return PeakLimit("copies", "the toy's peak models up to 3 copies") if options.own["copies"] > 3 else None

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    REGISTRY["toy"] = replace(toy, own_peak_limits=limits)
    with pytest.raises(ValueError, match="the toy.s peak models up to 3 copies"):
        zeroplan.plan(str(cfg), gpu_memory_bytes=10**9, gpus=2, engine="toy", copies=4)
    REGISTRY["toy"] = replace(toy, own_peak_limits=limits, plan_options=lambda o: replace(o, own={"copies": 1}))
    plan = zeroplan.plan(str(cfg), gpu_memory_bytes=10**9, gpus=2, engine="toy", copies=4)
    assert [o.label for o in plan.options] == ["copies=1", "copies=2", "copies=3"]
    with pytest.raises(ValueError, match="the toy.s peak models up to 3 copies"):
        zeroplan.estimate(model=str(cfg), gpus=2, engine="toy", seq_len=16, copies=4)
