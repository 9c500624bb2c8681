"""The reference runtime's phases as moments: at each point where live memory can peak, the terms alive
there (``zeroplan.formulas.peak`` sums them). Moments within the block loop are taken at the first block
to run (the last in backward), where the most activations are alive; blocks are identical."""

from __future__ import annotations

from functools import lru_cache

from zeroplan.engines.reference.settings import MASTER_BYTES
from zeroplan.engines.reference.terms import (
    ReferenceRun,
    _act,
    _blocks_saved,
    _full,
    _gathered,
    _kept_grads,
    _psi,
    _shard,
    _states,
    batch,
    gloo_copy,
    grads16,
    master,
    params16,
    unit_shards,
)
from zeroplan.formulas.peak import Moment, PeakEstimate, Term, peak_of
from zeroplan.formulas.sharding import flat_shard_numel
from zeroplan.formulas.stages import get_stage

def init_moments(run: ReferenceRun) -> tuple[Moment, ...]:
    """Building the model, the master (``local_flat`` + ``cat``) and the flat buffers (``setup``)."""
    st, a, s = get_stage(run.stage), run.param_bytes, _shard(run)
    psi = _psi(run)
    model = Term("model parameters as built (before repacking)", psi * a, "validate/models.py:build (CausalLM)")
    parts = Term("master parts (per-unit fp32 shards)", s * MASTER_BYTES, "validate/runtime.py:Runtime.local_flat")
    last_full = _full(run, run.units[-1])
    # stage 0 keeps each unit's full buffer as its part; sharded stages clone the owned slice and keep
    # the loop's last full buffer alive until ``cat`` returns
    spare = Term("last unit's full fp32 buffer (loop variable)", (last_full * MASTER_BYTES) if st.shards_optimizer else 0,
                 "validate/runtime.py:Runtime.local_flat")  # fmt: skip
    out = [Moment("init", "master: torch.cat of the parts", (model, parts, spare, master(run)))]
    if st.shards_optimizer:  # the next unit's full buffer is allocated while the loop variable holds the last
        out.extend(_packing(run, model, MASTER_BYTES, "fp32", ()))
    full_params = sum(_full(run, u) for u in run.units) * a
    if not st.shards_parameters:
        setup = [model, master(run), Term("flat 16-bit parameters", full_params, "validate/stage1.py:Stage1.setup")]
        if not st.shards_gradients:  # stage 0 allocates the gradient buffer before packing
            if not st.shards_optimizer:
                setup.append(Term("flat 16-bit gradients", full_params, "validate/stage0.py:Stage0.setup"))
        out.append(Moment("init", "setup: packing the 16-bit parameters", tuple(setup)))
        out.append(Moment("init", "setup: gradient buffer", (master(run), params16(run), grads16(run))))
    else:
        shard16 = Term("16-bit shard parts", s * a, "validate/runtime.py:Runtime.local_flat")
        spare16 = Term("last unit's full 16-bit buffer", last_full * a, "validate/runtime.py:Runtime.local_flat")
        out.extend(_packing(run, model, a, "16-bit", (master(run),)))
        out.append(Moment("init", "setup: 16-bit shard torch.cat", (model, master(run), shard16, spare16, params16(run))))
        out.append(Moment("init", "setup: first unit's full buffer",
                          (model, master(run), params16(run), *_gathered(run, 0))))  # fmt: skip
    return tuple(out)


def _packing(run: ReferenceRun, model: Term, nbytes: int, what: str, held: tuple[Term, ...]) -> tuple[Moment, ...]:
    """``local_flat`` packing unit u: the previous unit's full buffer is still bound to ``full``."""
    src = "validate/runtime.py:Runtime.local_flat"
    out, shards, done = [], unit_shards(run.units, run.nd), 0
    for u in range(1, len(run.units)):
        done += shards[u - 1]  # the parts of units 0..u-1
        out.append(Moment("init", f"{what} local_flat: packing unit {u}", (
            model, *held, Term(f"{what} parts of the units before", done * nbytes, src),
            Term(f"previous unit's full {what} buffer", _full(run, run.units[u - 1]) * nbytes, src),
            Term(f"this unit's full {what} buffer", _full(run, run.units[u]) * nbytes, src))))  # fmt: skip
    return tuple(out)


def forward_moments(run: ReferenceRun) -> tuple[Moment, ...]:
    """Last block in flight, the head, and the loss (validate/transformer.py:CausalLM.forward, .loss)."""
    acts, blk, L = run.acts, run.acts.block, run.acts.n_layer
    base = (*_states(run), batch(run), _act("embedding saved (position ids; RoPE cos, sin)", acts.embed_saved))
    mask = _act("sliding-window mask (bool)", acts.mask)  # CausalLM.forward's local; checkpoints hold it after
    held = (mask,) if run.checkpointing == "full" else ()
    if run.checkpointing == "none":
        last = (_blocks_saved(run, L), _act("block output and last op's output", blk.forward_extra, 2))
    else:
        last = (_blocks_saved(run, L - 1), _act("checkpointed block's working set (no grad)", blk.ckpt_forward_peak))
    head = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved), _act("logits", acts.logits))
    # CausalLM.loss: ``self(tokens).float()`` frees the 16-bit logits as soon as the fp32 copy exists
    loss = (
        *head[:-1],
        _act("fp32 logits (loss upcast)", acts.logits_fp32),
        _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax),
        _act("loss", acts.loss),
    )
    return (
        Moment("forward", "last block", (*base, mask, *last, *_gathered(run, 0, L))),
        Moment("forward", "LM head", (*base, mask, *head, *_gathered(run, 0))),
        Moment("forward", "cross-entropy", (*base, *held, *loss)),
    )


def backward_moments(run: ReferenceRun) -> tuple[Moment, ...]:
    """Loss backward, the last block's backward, its gradient pack (stages 2-3), the embeddings."""
    acts, blk, L, a = run.acts, run.acts.block, run.acts.n_layer, run.param_bytes
    n_d = acts.embed_out  # one N·d activation (or its gradient)
    base = (*_states(run), batch(run), _act("embedding saved (position ids; RoPE cos, sin)", acts.embed_saved),
            _act("loss", acts.loss), _act("sliding-window mask held by the checkpoints (bool)",
                                          acts.mask if run.checkpointing == "full" else 0))  # fmt: skip
    saved_all = (_blocks_saved(run, L), _act("final norm saved and output", acts.final_saved))
    out = [
        Moment("backward", "cross-entropy backward", (*base, *saved_all,
               _act("log-softmax (fp32, saved by cross-entropy)", acts.log_softmax),
               _act("nll and log-softmax gradients (fp32)", 2 * acts.log_softmax, 2)))  # fmt: skip
    ]
    root, block = sum(run.units[0]), sum(run.units[-1])
    kept = _kept_grads(run)
    # the head's backward (after the fp32 gradients are freed): d(logits) in 16 bits, d(final norm out)
    # and the head weight's gradient (added into the buffer at stages 0-1, kept at 2-3)
    out.append(Moment("backward", "LM head backward", (*base, *saved_all,
                      _act("logits gradient", acts.logits), _act("final norm output gradient", n_d),
                      Term("head weight gradient", run.head_numel * a, "autograd (mm backward)"),
                      *_gathered(run, 0))))  # fmt: skip
    # the root's gradients alive while blocks run backward: at stages 2-3 the head weight's and the
    # final norm's (kept until the root unit is reduced); at stages 0-1 they were added into the buffer
    # a tied head's gradient waits in autograd's input buffer for the embedding's (every stage)
    held = run.head_numel * (run.tied_head or kept) + run.final_norm_numel * kept
    kept_root = Term("root gradients held (head weight, final norm)", held * a,
                     "autograd InputBuffer (tied weight); validate/stage2.py:Stage2.unit_grads_ready")  # fmt: skip
    dy = _act("incoming activation gradient", n_d)
    if run.checkpointing == "none":
        inflight = (_blocks_saved(run, L),)
    else:
        inflight = (_blocks_saved(run, L), _act("recomputed block's saved activations", blk.recomputed))
    first = blk.backward_first_op if run.checkpointing == "none" else blk.backward_first_op_recomputed
    ws = max(first, blk.backward_act_grads + (blk.first_weight_grads if kept else 0))
    out.append(Moment("backward", "last block backward", (*base, *inflight, dy, kept_root,
                      _act("block backward working set", ws), *_gathered(run, 0, L))))  # fmt: skip
    if blk.norm_backward_ws:  # Llama family: the post-attention RMSNorm's backward, MLP done
        held_in = blk.ckpt_saved if run.checkpointing == "full" else 0
        out.append(Moment("backward", "last block's post-attention norm backward", (
            *base, _blocks_saved(run, L - 1), _act("held block input (checkpoint)", held_in),
            _act("last block's saved activations left", blk.norm_backward_saved), dy, kept_root,
            Term("MLP and norm gradients held", run.late_grads_numel * a * kept,
                 "validate/stage2.py:Stage2.unit_grads_ready"),
            _act("RMSNorm backward working set", blk.norm_backward_ws), *_gathered(run, 0, L))))  # fmt: skip
    if run.tied_head:  # torch/csrc/autograd/input_buffer.cpp: the two gradients are summed out of place
        others = (root - run.head_numel) * a if kept else 0
        out.append(Moment("backward", "tied embedding's gradients summed", (
            *base, dy, Term("head weight gradient (input buffer)", run.head_numel * a, "autograd InputBuffer"),
            Term("embedding weight gradient", run.head_numel * a, "aten embedding_dense_backward"),
            Term("their sum", run.head_numel * a, "autograd InputBuffer::add"),
            Term("other root gradients held", others, "validate/stage2.py:Stage2.unit_grads_ready"),
            *_gathered(run, 0))))  # fmt: skip
    if kept:
        out.append(Moment("backward", "last block's gradients packed", (
            *base, _blocks_saved(run, L - 1), dy, kept_root, _pending(run),
            Term("block gradients (autograd)", block * a, "validate/stage2.py:Stage2.unit_grads_ready"),
            Term("block pack buffer", _full(run, run.units[-1]) * a, "validate/stage2.py:Stage2.unit_grads_ready"),
            *_gathered(run, 0, L))))  # fmt: skip
        out.append(Moment("backward", "root gradients packed", (
            *base, Term("root gradients (autograd)", root * a, "validate/stage2.py:Stage2.unit_grads_ready"),
            Term("root pack buffer", _full(run, run.units[0]) * a, "validate/stage2.py:Stage2.unit_grads_ready"),
            *_gathered(run, 0))))  # fmt: skip
    if kept and run.gloo:
        out.extend(_reduce_scatter_moments(run, base, dy, kept_root))
    if kept and run.grad_accum > 1:
        out.extend(_accumulation_moments(run, base, dy, kept_root))
    return tuple(out)


def _pending(run: ReferenceRun) -> Term:
    """The last block's first op's saved tensors, alive while its unit's gradients are reduced."""
    blk = run.acts.block
    return _act("first op's saved tensors still pending",
                blk.pending_at_last_grad + (blk.held_input_pending if run.checkpointing == "full" else 0))


def _reduce_scatter_moments(
    run: ReferenceRun, base: tuple[Term, ...], dy: Term, kept_root: Term
) -> tuple[Moment, ...]:
    """Stages 2-3 on gloo, first micro-step: the unit's gradients are freed after packing, and the pack
    buffer is reduce-scattered into the shard while gloo holds a copy of it
    (validate/stage2.py:Stage2.unit_grads_ready; ``terms.gloo_copy``). Ties the packing moment unless the
    unit is padded."""
    L, a, src = run.acts.n_layer, run.param_bytes, "validate/stage2.py:Stage2.unit_grads_ready"
    return (
        Moment("backward", "last block's reduce-scatter", (
            *base, _blocks_saved(run, L - 1), dy, kept_root, _pending(run),
            Term("block pack buffer", _full(run, run.units[-1]) * a, src), *gloo_copy(run, len(run.units) - 1),
            *_gathered(run, 0, L))),  # fmt: skip
        Moment("backward", "root's reduce-scatter", (
            *base, Term("root pack buffer", _full(run, run.units[0]) * a, src), *gloo_copy(run, 0),
            *_gathered(run, 0))),  # fmt: skip
    )


def _accumulation_moments(
    run: ReferenceRun, base: tuple[Term, ...], dy: Term, kept_root: Term
) -> tuple[Moment, ...]:
    """Stages 2-3, micro-steps after the first: the unit's gradients, packed and freed, are reduce-scattered
    into a temporary of the unit's shard, which is added into the accumulated shard
    (validate/stage2.py:Stage2.unit_grads_ready). The pack buffer and the temporary are alive together,
    with gloo's copy of the pack buffer (``terms.gloo_copy``) while the reduce-scatter runs."""
    L, a = run.acts.n_layer, run.param_bytes
    src = "validate/stage2.py:Stage2.unit_grads_ready"
    temp = "reduce-scatter output to accumulate ({} shard)"
    return (
        Moment("backward", "last block's accumulated reduce-scatter", (
            *base, _blocks_saved(run, L - 1), dy, kept_root, _pending(run),
            Term("block pack buffer", _full(run, run.units[-1]) * a, src),
            Term(temp.format("block"), flat_shard_numel(run.units[-1], run.nd) * a, src),
            *gloo_copy(run, len(run.units) - 1), *_gathered(run, 0, L))),  # fmt: skip
        Moment("backward", "root's accumulated reduce-scatter", (
            *base, Term("root pack buffer", _full(run, run.units[0]) * a, src),
            Term(temp.format("root"), flat_shard_numel(run.units[0], run.nd) * a, src),
            *gloo_copy(run, 0), *_gathered(run, 0))),  # fmt: skip
    )


def optimizer_moments(run: ReferenceRun) -> tuple[Moment, ...]:
    """Adam on the flat master (validate/runtime.py:Runtime.step): fp32 gradient copy plus temporaries.

    ``_multi_tensor_adam`` (foreach) allocates ``sqrt(v)`` once (S·4); ``_single_tensor_adam`` computes
    ``v.sqrt() / bias_correction2_sqrt``, two S·4 tensors alive at once (torch/optim/adam.py). With amsgrad
    the maximum is taken in place (``torch.maximum(max_v, v, out=max_v)``, ``_foreach_maximum_``) and the
    square root is of it instead of v: the same temporaries (the third state is in ``adam_states``).
    """
    s = _shard(run)
    temps = (1 if run.foreach else 2) * s * MASTER_BYTES
    kind = "foreach sqrt(v)" if run.foreach else "per-tensor sqrt(v) and its quotient"
    return (
        Moment("optimizer_step", "Adam update", (*_states(run), batch(run),
               Term("fp32 gradient of the master", s * MASTER_BYTES, "validate/runtime.py:Runtime.step"),
               Term(f"Adam temporaries ({kind})", temps, "torch/optim/adam.py", 1 if run.foreach else 2))),
    )  # fmt: skip


@lru_cache(maxsize=16)  # a plan's peak of each stage and its trace ask for the same run's
def moments(run: ReferenceRun) -> tuple[Moment, ...]:
    """Every moment of a training step of the reference runtime."""
    return (*init_moments(run), *forward_moments(run), *backward_moments(run), *optimizer_moments(run))


def predict_peak(run: ReferenceRun, block_bytes: int = 1, allocator_overhead_bytes: int = 0,
                 resident: tuple[Term, ...] = ()) -> PeakEstimate:  # fmt: skip
    """The peak of ``run`` per phase (``zeroplan.formulas.peak.peak_of`` over ``moments``); ``resident``:
    terms live after init (on CUDA the library workspaces, ``formulas.cuda_workspaces``)."""
    return peak_of(moments(run), block_bytes, allocator_overhead_bytes, resident=resident)
