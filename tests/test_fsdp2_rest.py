"""The f2rest speed-ups (the FSDP2 plan's work outside the allocator model) change no number: each against the plain
computation it replaced, kept here, on tiny odd-sized models and on a real preset (llama2-70b, 80 blocks)."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.fsdp2 import Settings, fsdp2_run, moments
from zeroplan.engines.fsdp2.leaders import sampled_blocks
from zeroplan.engines.fsdp2.mesh import REDUCED, allreduce_held, holds_allreduce, with_allreduce_held
from zeroplan.engines.fsdp2.moments import (NOT_BUILT, Term, _act, _blocks_saved, ag_output, backward_moments,
                                            gather_input, gloo_copy, grad_cast, grads, input_norm_backward,
                                            input_projections_backward, kept_blocks, last_grad_held, prefetched,
                                            reduce_scatter_moments, resharded, rope_released, rs_input, rs_output,
                                            unit_grads, unsharded)
from zeroplan.engines.fsdp2.terms import Fsdp2Run
from zeroplan.estimation.workload import model_workload
from zeroplan.formulas.peak import Moment
from zeroplan.presets import resolve_model

GPT = {"model_type": "gpt2", "activation_function": "gelu", "n_layer": 7, "n_embd": 35, "n_head": 5,
       "vocab_size": 101, "n_positions": 16}  # fmt: skip
LLAMA = {"model_type": "llama", "hidden_size": 35, "intermediate_size": 67, "max_position_embeddings": 16,
         "num_attention_heads": 5, "num_hidden_layers": 7, "num_key_value_heads": 1, "vocab_size": 103}  # fmt: skip
UPDATES = [{}, {"reshard_after_forward": False}, {"reshard_after_forward": 2, "param_dtype": "bf16"},
           {"param_dtype": "bf16", "reduce_dtype": "fp32"}, {"param_dtype": "bf16"},
           {"wrap": "torchtitan", "param_dtype": "bf16"}, {"device": "cpu", "backend": "gloo"}]  # fmt: skip


def _runs():
    """Runs of every kind the plan meets: flat and HSDP (held buffers or none), resharded or kept, checkpointed
    or not, tiny odd models (both trees) and llama2-70b as the plan sizes it."""
    out = []
    for config, hf in ((GPT, False), (LLAMA, True)):
        spec = spec_from_hf_config(config, "test")
        for ckpt in ("none", "full"):
            w = Workload(transformer_shapes(spec), spec, 16, 2, ckpt, transformers=hf)
            for k, update in enumerate(UPDATES):
                if update.get("wrap") == "torchtitan" and not hf:  # GPT's head is tied: torchtitan refuses it
                    continue
                run = fsdp2_run(w, 4 + k % 3, Settings(**update))
                out += [run, replace(run, replicate=2 + k % 2)]
    w = model_workload(resolve_model("llama2-70b"), 4096, 1, "full")
    for update in ({"param_dtype": "bf16"}, {"param_dtype": "bf16", "reshard_after_forward": False}):
        run = fsdp2_run(w, 16, Settings(**update))
        out += [run, replace(run, replicate=16)]
    return out


RUNS = _runs()
moments_module = importlib.import_module("zeroplan.engines.fsdp2.moments")


def _values(ms) -> list:
    return [(m.phase, m.name, tuple((t.name, t.bytes, t.source, t.tensors) for t in m.terms)) for m in ms]


def _plain_with_allreduce_held(run, backward, dropped=None):
    """``mesh.with_allreduce_held`` as it was: every term's name read in Python, the held term appended by unpacking."""
    if not holds_allreduce(run):
        return backward
    reduced: dict[str, int] = {}
    out, held, total, stale = [], (), 0, False
    for m in backward:
        name = m.name
        if dropped is None or dropped not in name:
            if stale:
                held, stale = allreduce_held(len(reduced), total), False
            out.append(Moment(m.phase, name, (*m.terms, *held)) if held else m)
        if name.endswith(REDUCED):
            for t in m.terms:
                if t.name.startswith("reduce-scatter output"):
                    total += t.bytes - reduced.get(t.name, 0)
                    reduced[t.name] = t.bytes
            stale = bool(reduced)
    return tuple(out)


@pytest.mark.parametrize("k", range(len(RUNS)))
def test_with_allreduce_held_equals_the_plain_loop(k):
    """Full and sampled profiles (the blocks not built dropped): the same moments, terms and values, in order."""
    run = RUNS[k]
    assert run.acts is not None
    blocks = sampled_blocks(run)
    for chosen, dropped in ((None, None), *(((blocks, NOT_BUILT),) if blocks else ())):
        backward = backward_moments(run, chosen)
        got = with_allreduce_held(run, backward, dropped)
        assert _values(got) == _values(_plain_with_allreduce_held(run, backward, dropped))
    assert any(holds_allreduce(r) for r in RUNS) and any(not holds_allreduce(r) for r in RUNS)


def _plain_block_backward_moments(run: Fsdp2Run, i: int, base: tuple[Term, ...], root_held: Term) -> tuple[Moment, ...]:
    """Block ``i`` in backward: its copy-out and the next block's prefetch (resharded), its backward, its
    gradients complete, its reduce-scatter; the blocks after it are reduced (``done``), the previous
    block's reduce-scatter input is held until this post_backward."""
    blk, L, n_d = run.acts.block, len(run.units) - 1, run.acts.embed_out
    ws = max(blk.backward_first_op, blk.backward_act_grads + blk.first_weight_grads)
    done = grads(run, range(i + 1, L + 1))
    held = (rs_input(run, i + 1, "held until the next post_backward"),) if i < L else ()
    out = []
    if resharded(run):  # pre_backward: the prefetched all-gather output is copied out, then freed (with
        # the block's k-sharded data: FSDPParam.to_unsharded), then the next block is prefetched
        out.append(Moment("backward", f"block {i} copy-out", (
            *base, *kept_blocks(run, i), _blocks_saved(run, i), _act("incoming activation gradient", n_d),
            root_held, ag_output(run, i, "prefetched, freed after copy-out"), unsharded(run, i), *held, done)))  # fmt: skip
        if i > 1:
            out.append(Moment("backward", f"block {i - 1} backward all-gather (prefetch)", (
                *base, *kept_blocks(run, i - 1), _blocks_saved(run, i), _act("incoming activation gradient", n_d),
                root_held, unsharded(run, i), gather_input(run, i - 1), *prefetched(run, i - 1), *held, done)))  # fmt: skip
    # the per-op policy: the recompute has popped the layer's cached outputs (kept or freed by then: selective_ac)
    inflight = (_blocks_saved(run, i - 1), _act("checkpointed block input", blk.ckpt_saved)) if run.ac_op else \
        (_blocks_saved(run, i),)
    if run.checkpointed(i):
        inflight += (_act("recomputed block's saved activations", blk.recomputed),)
    out.append(Moment("backward", f"block {i} backward", (
        *base, *kept_blocks(run, i - 1), *inflight, _act("incoming activation gradient", n_d), root_held,
        _act("block backward working set", ws), unsharded(run, i), *prefetched(run, i - 1), *held, done)))  # fmt: skip
    if i == 1 and rope_released(run):  # the first layer's rotary products have run backward: cos and sin go
        base = tuple(t for t in base if t.name != "embedding saved (position ids)")
    if projections := input_projections_backward(run, unit_grads(run, i)):  # q's: every weight gradient but the norm's
        out.append(Moment("backward", f"block {i} attention input projections' backward", (
            *base, *kept_blocks(run, i - 1), _blocks_saved(run, i - 1), _act("incoming activation gradient", n_d),
            *projections, root_held, unsharded(run, i), *prefetched(run, i - 1), *held, done)))  # fmt: skip
    # the block's first op (its input norm) runs backward last: every weight gradient of the block exists
    out.append(Moment("backward", f"block {i} gradients complete", (
        *base, *kept_blocks(run, i - 1), _blocks_saved(run, i - 1), _act("incoming activation gradient", n_d),
        input_norm_backward(run, run.checkpointed(i)), root_held, unsharded(run, i), unit_grads(run, i),
        *prefetched(run, i - 1), *held, done)))  # fmt: skip
    common = (*base, *kept_blocks(run, i - 1), _blocks_saved(run, i - 1),
              _act("block input gradient", n_d), root_held, *prefetched(run, i - 1), done)  # fmt: skip
    out.append(Moment("backward", f"block {i} reduce-scatter copy-in",
                      (*common, unit_grads(run, i), rs_input(run, i, "this unit"))))  # fmt: skip
    last = last_grad_held(run, run.units[i].shapes[-1], f"block {i}")
    out.extend(reduce_scatter_moments(f"block {i}", (*common, *last), rs_input(run, i, "this unit"), rs_output(run, i),
                                      grad_cast(run, i), gloo_copy(run, i)))  # fmt: skip
    return tuple(out)


@pytest.mark.parametrize("k", range(len(RUNS)))
def test_block_backward_moments_equal_the_plain_builder(k, monkeypatch):
    """``moments.block_backward_moments`` (each term asked once per block) against the builder that asked the
    memoised terms at every moment: every moment of the full profile and of the sampled one, by value."""
    run = RUNS[k]
    fast = _values(moments(run))
    fast_sampled = _values(moments(run, sampled_blocks(run)))
    monkeypatch.setattr(moments_module, "block_backward_moments", _plain_block_backward_moments)
    run = replace(run)  # a fresh memo: nothing built by the fast path reused
    run.memo.clear()
    assert fast == _values(moments(run))
    assert fast_sampled == _values(moments(run, sampled_blocks(run)))
