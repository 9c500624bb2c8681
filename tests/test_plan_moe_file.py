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


LEAF = {"classes": ["MixtralSparseMoeBlock"]}  # ZeRO-3 leaves of the file's own: not modelled (zero3_moe_limit)


def test_plan_on_an_fp16_mixtral_file_answers_less_the_rows_it_cannot_model(tmp_path):
    """Ψ = 19,530,496 (PLAN_MODELS): the file's ZeRO-3 with a ``leaf_module`` of its own is not modelled, and plan's
    ZeRO-3 rows keep the file's key. ``estimate`` of the file refuses in one line; ``plan`` answers with every ZeRO-1/2
    row (fp16 from the hooks too: modelled since issue 19, left out before) and names the ZeRO-3 rows left out."""
    cfg, psi, _ = PLAN_MODELS["mixtral"]
    args = _files(tmp_path, cfg, {"zero_optimization": {"stage": 3, "leaf_module": LEAF}, "fp16": {"enabled": True}})
    why = "leaf_module / stage3_module_granularity_threshold not modelled"
    assert_one_line_error(run("estimate", *args), why)
    d = run_json("plan", *args)
    labels = [s["label"] for s in d["stages"]]
    assert {s["stage"] for s in d["stages"]} == {1, 2} and len(labels) == 8 and "ZeRO-2, buckets 5e6" in labels
    assert f"Ψ = {psi:,} elements" in d["reason"] and f"ZeRO-3, buckets 5e6, no prefetch: {why}" in d["reason"]
    assert d["recommendation"]["deepspeed"]["fp16"] == {"enabled": True}  # the file's precision kept


def test_plan_and_estimate_on_a_qwen2_moe_file_reducing_at_the_shared_experts_hooks_answer(tmp_path):
    """tiny-qwen2-moe: Ψ = 81,360, gate_up_proj 11,520 elements; the file's ZeRO-2 bucket of 50,000 lies between:
    buckets reduced at the shared expert's hooks, modelled since issue 19 (moe12_hooks._at_shared_hook; refused
    before): ``estimate`` answers, ``plan`` (buckets 5e6 to 5e8, all >= Ψ) drops nothing."""
    args = _files(tmp_path, HF_CONFIGS / "tiny-qwen2-moe.json",
                  {"zero_optimization": {"stage": 2, "reduce_bucket_size": 50000}})  # fmt: skip
    assert run("estimate", *args).exit_code == 0
    d = run_json("plan", *args)
    assert {s["stage"] for s in d["stages"]} == {1, 2, 3} and len(d["stages"]) == 16
    assert "Ψ = 81,360 elements" in d["reason"] and d["reason"].endswith(": none)")


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
