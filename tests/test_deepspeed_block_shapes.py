"""A block's activations at a gradient hook are memoised across blocks of the same shape
(``hook_activations._hook_activations`` / ``_block_shape``; issue 16's plan speed, a speed-up, no rule): every
hook of every block, asked through the memo in the order the plan asks them (block after block, so that the later
blocks' come from the first's), equals ``_block_hook_activations`` computed afresh, on every architecture of
tests/data/hf_configs (the validator's causal LM and transformers'), ZeRO-2 and ZeRO-3 (whose wrapper holds an input
gradient more at the attention's hooks), checkpointed or not, two dtypes. And a memo filled by one wrapper's runs
never answers another's (the memo's facts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zeroplan.engines.deepspeed.hook_activations as H
from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed import Settings, ds_run

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"
MODELS = sorted(p.stem for p in CONFIGS.glob("*.json"))


def _run(model, stage, ckpt, dtype, hf):
    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, 16, 2, checkpointing=ckpt, transformers=hf)
    return ds_run(Settings(stage=stage, dtype=dtype, reduce_bucket_size=5_000, allgather_bucket_size=5_000),
                  workload, 4)


def _every_hook(run):
    return [(j, hook) for hook, j in enumerate(run.param_blocks) if j >= 0]


@pytest.mark.parametrize("model", MODELS)
def test_every_hook_through_the_block_memo_equals_a_fresh_one(model, monkeypatch):
    computed = []
    fresh = H._block_hook_activations
    monkeypatch.setattr(H, "_block_hook_activations", lambda run, j, hook: computed.append(j) or fresh(run, j, hook))
    shared, modelled = 0, set()
    for stage, ckpt, dtype, hf in ((2, "none", "bf16", True), (3, "full", "bf16", True), (2, "full", "fp32", False),
                                   (3, "none", "fp16", False)):
        run = _run(model, stage, ckpt, dtype, hf)
        H._HOOK_MEMO.clear()
        computed.clear()
        hooks = _every_hook(run)
        for j, hook in hooks:
            want = fresh(run, j, hook)
            assert H._hook_activations(run, j, hook) == want, (stage, ckpt, dtype, hf, j, hook)
            assert H._hook_bytes(run, j, hook, H._hook_memo(run)) == _bytes(run, want)
            if want is not None:
                modelled.add(j)
        shared += len(hooks) - len(computed)
    if len(modelled) > 1:  # blocks with a modelled hook (a sparse layer has none)
        assert shared, "no hook came from another block: the memo across blocks is not tested"


def _bytes(run, at_hook):
    if at_hook is None:
        return None
    return sum(t.bytes for t in at_hook[1]) + sum(run.numels[i] for i in at_hook[2]) * H._pbytes(run)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama", "qwen3-8b"])
def test_a_memo_filled_by_zero2_never_answers_zero3(model):
    """ZeRO-3 wraps each module's inputs (an input gradient more at the attention's hooks: attention_hooks.py): with
    the same layout and activations, its hooks are its own, not ZeRO-2's."""
    H._HOOK_MEMO.clear()
    runs = [_run(model, stage, "none", "bf16", True) for stage in (2, 3)]
    assert runs[0].grad_ready_order is runs[1].grad_ready_order  # the same layout: one memo per facts
    differ = 0
    for run in runs:
        for j, hook in _every_hook(run):
            got = H._hook_activations(run, j, hook)
            assert got == H._block_hook_activations(run, j, hook)
    for j, hook in _every_hook(runs[0]):
        differ += H._hook_activations(runs[0], j, hook) != H._hook_activations(runs[1], j, hook)
    if model == "tiny-qwen3":
        assert differ, "ZeRO-2 and ZeRO-3 alike at every hook: the facts are not tested"
