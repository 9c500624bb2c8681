"""`--alloc-conf` and `--headroom` on the planner commands (issue 21): the reserved bytes follow the
`PYTORCH_CUDA_ALLOC_CONF` given, a bad one is one line and exit 2, and `plan` names what to change when
fragmentation (reserved minus allocated) is what does not fit. Pure math, small models."""

from __future__ import annotations

from pathlib import Path

import pytest
from clicheck import assert_one_line_error, run, run_json

import zeroplan
from zeroplan.allocator.reserved import reserved_of
from zeroplan.engines import get_engine
from zeroplan.engines.fsdp2.alloc_trace import alloc_traces
from zeroplan.estimation.config import EstimateConfig

GPT2 = str(Path(__file__).parent / "data" / "golden" / "inputs" / "gpt2-no-dropout.json")  # 124M


def test_estimate_replays_the_trace_under_the_alloc_conf_given():
    config = EstimateConfig(model=GPT2, gpus=4, engine="fsdp2", seq_len=256, micro_batch=2)
    (trace,) = alloc_traces(config.workload, 4, get_engine("fsdp2").planner_settings(config.planner_options))
    for conf in ("", "expandable_segments:True", "max_split_size_mb:64,roundup_power2_divisions:4"):
        d = run_json("estimate", "--model", GPT2, "--gpus", "4", "--engine", "fsdp2", "--seq-len", "256",
                     "--micro-batch", "2", *(["--alloc-conf", conf] if conf else []))  # fmt: skip
        (row,) = d["stages"]
        expected = reserved_of(trace, conf)
        assert (row["reserved_bytes"], row["reserved_phases"]) == (expected.reserved_bytes, expected.reserved_phases)
        assert row["reserved_bytes"] >= row["peak_bytes"] and d["inputs"]["step"]["alloc_conf"] == conf
    # one growing segment per stream and pool instead of cached ones: less reserved for the same trace
    assert reserved_of(trace, "expandable_segments:True").reserved_bytes < reserved_of(trace).reserved_bytes


@pytest.mark.parametrize(("args", "message"), [
    (["estimate", "--model", GPT2, "--alloc-conf", "max_split_size_mb:10"], "max_split_size_mb:10: too small"),
    (["estimate", "--model", GPT2, "--alloc-conf", "backend:cudaMallocAsync"], "only the native allocator"),
    (["estimate", "--params", "7e9", "--alloc-conf", "expandable_segments:True"], "needs an architecture"),
    (["plan", "--model", GPT2, "--gpu", "h100-80gb", "--alloc-conf", "expandable_segments:yes"], "True or False"),
    (["plan", "--model", GPT2, "--gpu", "h100-80gb", "--headroom", "1"], "headroom"),
])  # fmt: skip
def test_bad_alloc_conf_and_headroom_are_one_line(args, message):
    assert_one_line_error(run(*args), message)


def test_plan_fits_on_reserved_and_names_expandable_segments_when_fragmentation_does_not_fit():
    ask = dict(gpus=8, seq_len=2048, checkpointing="none")
    base = zeroplan.plan("llama2-7b", gpu_memory_bytes=2**40, **ask)
    s1 = base.option(1)
    # a card between stage 1's live bytes and its reserved bytes: only fragmentation does not fit
    memory = (s1.peak.peak_bytes + s1.reserved.reserved_bytes) // 2
    p = zeroplan.plan("llama2-7b", gpu_memory_bytes=memory, **ask)
    assert not p.option(1).fits and p.option(1).peak.peak_bytes <= memory < p.option(1).reserved.reserved_bytes
    assert p.fragmentation.startswith("ZeRO stage 1: its live bytes fit")
    assert "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (--alloc-conf)" in p.fragmentation
    # ... and with it, stage 1 fits and is the recommendation
    q = zeroplan.plan("llama2-7b", gpu_memory_bytes=memory, alloc_conf="expandable_segments:True", **ask)
    assert q.option(1).fits and q.recommendation is q.option(1) and q.fragmentation is None
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in q.fit_basis
    # a headroom is taken off the card before the reserved bytes are compared ...
    r = zeroplan.plan("llama2-7b", gpu_memory_bytes=memory, alloc_conf="expandable_segments:True", headroom=0.01, **ask)
    o = r.option(1)
    assert r.budget_bytes == int(memory * 0.99) >= o.peak.peak_bytes
    assert o.fits == (o.reserved.reserved_bytes <= r.budget_bytes)
    # ... and where the live peak alone exceeds what is left, the trace is not replayed (reserved >= live: it
    # cannot fit; planning/reserved_fit.py live_over)
    r = zeroplan.plan("llama2-7b", gpu_memory_bytes=memory, alloc_conf="expandable_segments:True", headroom=0.2, **ask)
    o = r.option(1)
    assert r.budget_bytes == int(memory * 0.8) < o.peak.peak_bytes
    assert not o.fits and o.reserved is None and o.not_replayed
