"""What a DeepSpeed run derives from its layout alone is kept once per layout and shared by every run of a plan
(``run.shared_memo``: hook positions, block starts, ZeRO-1/2's every-rank winners; issue 16's plan speed, a
speed-up, no rule). Each candidate's moments, listed after every earlier candidate of the plan's order with the
memo warm, equal the same candidate's listed from an empty memo: ZeRO-1 (after backward and with overlap_comm),
ZeRO-2, ZeRO-3, with offload_optimizer, at several bucket sizes and dtypes, every rank at once and each rank named,
accumulating or not, on transformers' families and the validator's causal LM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zeroplan.engines.deepspeed.run as run_module
from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines import deepspeed as D
from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed.offload_settings import OffloadTarget

CONFIGS = Path(__file__).resolve().parent / "data" / "hf_configs"


def _candidates(nd: int):
    """The plan's order (engines/deepspeed/plan.py ``candidates``) at small buckets, then named ranks."""
    out = []
    for stage, overlap in ((1, None), (1, True), (2, None), (3, None)):
        for bucket, dtype in ((50_000, "bf16"), (20_000, "fp32"), (5_000, "bf16"), (2_000, "fp16"), (5_000, "fp32")):
            out.append(dict(stage=stage, overlap_comm=overlap, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
                            dtype=dtype))
    for stage, rank in ((1, None), (2, None), (1, 1), (2, 2), (2, None)):
        out.append(dict(stage=stage, reduce_bucket_size=50_000, allgather_bucket_size=50_000, rank=rank,
                        offload_optimizer=OffloadTarget(device="cpu")))
    for rank in range(nd):
        out.append(dict(stage=1 + rank % 2, reduce_bucket_size=5_000, allgather_bucket_size=5_000, rank=rank))
    return out


@pytest.mark.parametrize("model, nd, grad_accum, hf", [("tiny-llama", 7, 1, True), ("tiny-qwen2", 4, 2, True),
                                                       ("tiny-gpt2-untied", 3, 1, False),
                                                       ("tiny-mistral", 16, 1, True)])
def test_every_candidate_with_the_memo_warm_equals_it_listed_afresh(monkeypatch, model, nd, grad_accum, hf):
    spec = spec_from_hf_config(json.loads((CONFIGS / f"{model}.json").read_text()))
    workload = Workload(transformer_shapes(spec), spec, 16, 2, grad_accum=grad_accum, transformers=hf)
    monkeypatch.setattr(run_module, "_SHARED", {})
    warm = []
    for update in _candidates(nd):
        warm.append(D.moments(D.ds_run(D.Settings(**update), workload, nd)))
    assert len(run_module._SHARED) > 0, "nothing shared: the memo is not tested"
    for update, got in zip(_candidates(nd), warm):
        monkeypatch.setattr(run_module, "_SHARED", {})
        assert got == D.moments(D.ds_run(D.Settings(**update), workload, nd)), update


def test_a_key_object_replaced_by_an_equal_one_is_computed_again(monkeypatch):
    """The memo keys its objects by identity and keeps them alive: an equal but distinct tuple is another key."""
    monkeypatch.setattr(run_module, "_SHARED", {})
    calls = []
    a, b = tuple(range(5)), tuple(range(5))
    assert a is not b
    for obj in (a, a, b):
        run_module.shared_memo("test", (obj,), (1,), lambda: calls.append(1) or len(calls))
    assert len(calls) == 2
