"""A declared block copied from its template (``allocator.block_template``, FSDP2's ``engines/fsdp2/block_declared``)
makes the trace the walk makes: every event, phase peak and run equal with the copy on and off, on FSDP2's drawn
configurations, on Llama-2-7B and GPT-2 XL, and on transformers configs of uniform and non-uniform blocks; and a
declaration that lies is caught by the builder's check. Pure math."""

from __future__ import annotations

from pathlib import Path

import pytest

import zeroplan.allocator.block_template as block_template
from zeroplan.allocator.runs import alloc_runs
from zeroplan.engines import fsdp2
from zeroplan.engines.fsdp2.alloc_trace import alloc_traces, stream_of
from zeroplan.engines.fsdp2.moments import moments
from zeroplan.engines.fsdp2.mesh import resolve_mesh
from zeroplan.engines.fsdp2.plan import estimate, rank_run
from zeroplan.estimation.workload import model_workload
from zeroplan.allocator.step_trace import step_trace
from zeroplan.formulas.cuda_workspaces import library_workspaces
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES
from zeroplan.presets import resolve_model

from test_step_trace import _draws

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
REAL = (("llama2-7b", 8, {"dp_replicate": 4}, True, "none"), ("llama2-7b", 8, {}, False, "full"),
        ("gpt2-xl", 4, {"dp_replicate": 2}, True, "full"), ("gpt2-xl", 8, {}, 2, "none"),
        (str(CONFIGS / "gemma-3-1b.json"), 8, {"dp_replicate": 2}, True, "none"),
        (str(CONFIGS / "qwen3-30b-a3b.json"), 8, {}, True, "none"),
        (str(CONFIGS / "deepseek-v3.json"), 16, {"dp_replicate": 2}, True, "full"))  # fmt: skip


def _both(monkeypatch, make):
    """The traces ``make()`` builds with the copy, and without; how many blocks were copied."""
    copied, copy = [], block_template.copy_block
    monkeypatch.setattr(block_template, "copy_block", lambda *a: (copied.append(r := copy(*a)), r)[1])
    fast = make()
    with monkeypatch.context() as m:
        m.setattr(block_template, "COPY", False)
        walked = make()
    return fast, walked, sum(r is not None for r in copied)


def _equal(fast, walked) -> None:
    assert [t.events for t in fast] == [t.events for t in walked]
    assert [t.phase_live_bytes for t in fast] == [t.phase_live_bytes for t in walked]
    assert [t.runs for t in fast] == [t.runs for t in walked]
    assert all(t.runs == alloc_runs(list(t.events)) for t in fast)


def test_a_copied_block_makes_the_events_of_the_walk_on_fsdp2s_drawn_configurations(monkeypatch):
    """The drawn configurations of tests/test_step_trace.py (tiny models: few blocks, few copies)."""
    for w, nd, settings in _draws("fsdp2", 8):
        fast, walked, _ = _both(monkeypatch, lambda: alloc_traces(w, nd, settings))
        _equal(fast, walked)


@pytest.mark.parametrize("model,nd,mesh,rsf,ckpt", REAL)
def test_a_copied_block_makes_the_events_of_the_walk_on_real_models(model, nd, mesh, rsf, ckpt, monkeypatch):
    """Llama-2-7B, GPT-2 XL, Gemma 3 (sliding and global layers), Qwen3 MoE, DeepSeek-V3 (dense first layers, MoE
    after): HSDP or not, resharded, kept or k-sharded, checkpointed or not; copies made where blocks are alike."""
    w = model_workload(resolve_model(model), 1024, 1, ckpt)
    settings = fsdp2.Settings(reshard_after_forward=rsf, param_dtype="bf16", **mesh)
    fast, walked, copied = _both(monkeypatch, lambda: alloc_traces(w, nd * mesh.get("dp_replicate", 1), settings))
    _equal(fast, walked)
    if rsf is True and model in ("llama2-7b", "gpt2-xl"):  # uniform blocks: copied
        assert copied, (model, nd, mesh)


def test_a_declaration_that_lies_is_caught_by_the_builders_check(monkeypatch):
    """A block declared against the template with another block's substitution: the terms it names are not the
    moment's, so the builder's term check refuses it and walks the block (the trace the walk makes)."""
    w = model_workload(resolve_model("llama2-7b"), 1024, 1, "none")
    settings = fsdp2.Settings(reshard_after_forward=True, param_dtype="bf16", dp_replicate=4)
    settings = resolve_mesh(settings, 32)
    run = rank_run(w, 32, settings.model_copy(update={"rank": estimate(w, 32, settings)[0].peak_rank or 0}))[0]
    ms = moments(run)
    declared = [m for m in ms if m.block is not None and m.block[2] is not None]
    decls = list({id(m.block[2]): m.block[2] for m in declared}.values())
    liar, other = decls[5], decls[9]
    for m in declared:
        if m.block[2] is liar:
            m.__dict__["block"] = (m.block[0], m.block[1], other)
    resident = (library_workspaces(run.settings.cuda_capability, run.biased_linear),)
    refused, copy = [], block_template.copy_block
    monkeypatch.setattr(block_template, "copy_block",
                        lambda b, t, block, d: (r := copy(b, t, block, d), refused.append(r is None))[0])
    fast = step_trace(ms, CUDA_BLOCK_BYTES, resident, stream_of)
    with monkeypatch.context() as m:
        m.setattr(block_template, "COPY", False)
        walked = step_trace(ms, CUDA_BLOCK_BYTES, resident, stream_of)
    assert fast.events == walked.events and fast.phase_live_bytes == walked.phase_live_bytes
    assert any(refused) and not all(refused), refused
