"""Engine profile of the bundled reference runtime (``validate/``): what it allocates, phase by phase.

Data for ``zeroplan.formulas.peak``: ``moments(run)`` lists, per phase, the points where live memory
can peak and the terms live there; each term names the ``validate/<file>.py:<function>`` that
allocates it. Stages are read from ``zeroplan.formulas.stages`` (what is sharded), not tested by number.

Conventions of the runtime (``validate/runtime.py``): sharding units are the root (parameters outside
the decoder layers, ``architectures.spec.block_prefix``: embeddings, final norm, an untied head) and one
unit per decoder layer; 16-bit parameters and gradients (``a`` bytes), an fp32
master shard with Adam's m and v (``S`` elements per rank: every tensor padded to a multiple of N_d,
``zeroplan.formulas.sharding.flat_shard_numel``; at stage 0 the whole unpadded model). Forward and backward
phases of every step after the first hold m and v, so a phase's peak (the largest over steps)
includes them. Moments within the block loop are taken at the first block to run (the last in
backward), where the most activations are alive; blocks are identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeroplan.architectures.spec import TransformerSpec, block_prefix, transformer_shapes
from zeroplan.formulas.activation_terms import ModelActivations, model_activations
from zeroplan.formulas.peak import Moment, PeakEstimate, Term, peak_of
from zeroplan.formulas.sharding import flat_padded_numel, flat_shard_numel
from zeroplan.formulas.stages import get_stage

MASTER_BYTES = 4  # fp32 master, m, v (validate/runtime.py:Runtime.__init__)
ADAM_STEP_BYTES = 4  # Adam's fp32 ``step`` tensor (torch/optim/adam.py:_init_group)
#: the final norm's parameter names (transformers' GPT2Model.ln_f, LlamaModel.norm)
FINAL_NORM_PREFIX = {"gpt": "transformer.ln_f.", "llama": "model.norm."}


@dataclass(frozen=True)
class ReferenceRun:
    """One rank of the reference runtime training a transformer.

    ``units``: element counts of each unit's tensors, root first then one tuple per block (in
    ``validate/runtime.py:split_units`` order); ``head_numel`` and ``final_norm_numel``: the LM head
    weight (V·d, tied or not) and the final norm's parameters, whose gradients come first in backward.
    """

    units: tuple[tuple[int, ...], ...]
    head_numel: int
    final_norm_numel: int
    nd: int
    stage: int
    acts: ModelActivations
    checkpointing: str = "none"
    foreach: bool = False
    param_bytes: int = 2
    tied_head: bool = True  # the head is the token embedding (GPT): its two gradients meet in backward
    late_grads_numel: int = 0  # a block's parameters whose gradients come before its post-attention norm's input's
    grad_accum: int = 1  # micro-steps per optimizer step (validate/runtime.py:Runtime.grad_accum)

    def __post_init__(self) -> None:
        get_stage(self.stage)
        if self.nd < 1 or len(self.units) < 2:
            raise ValueError(f"nd={self.nd}, units={len(self.units)}: need nd >= 1 and a root plus blocks")
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum={self.grad_accum}: must be >= 1")
        if self.checkpointing not in ("none", "full"):
            raise ValueError(f"checkpointing={self.checkpointing!r}: expected none or full")


def _psi(run: ReferenceRun) -> int:
    return sum(sum(u) for u in run.units)


def _align(run: ReferenceRun) -> int:
    """Stage 0 keeps whole unpadded tensors (DDP); sharded stages pad every tensor to N_d (flat.py)."""
    return run.nd if get_stage(run.stage).shards_optimizer else 1


def _shard(run: ReferenceRun) -> int:
    """Elements of this rank's master shard (validate/runtime.py:Runtime.__init__, local_slices)."""
    if not get_stage(run.stage).shards_optimizer:
        return _psi(run)
    return sum(flat_shard_numel(u, run.nd) for u in run.units)


def _full(run: ReferenceRun, unit: tuple[int, ...]) -> int:
    """Elements of a unit's full flat buffer (validate/flat.py:FlatLayout.full_numel)."""
    return flat_padded_numel(unit, _align(run))


def params16(run: ReferenceRun) -> Term:
    """16-bit parameters kept between steps: full (stages 0-2, padded from 1) or the shard (3)."""
    st, a = get_stage(run.stage), run.param_bytes
    if st.shards_parameters:
        return Term("16-bit parameter shard", _shard(run) * a, "validate/stage3.py:Stage3.setup")
    src = "validate/stage1.py:Stage1.setup" if st.shards_optimizer else "validate/stage0.py:Stage0.setup"
    return Term("16-bit parameters", sum(_full(run, u) for u in run.units) * a, src)


def grads16(run: ReferenceRun) -> Term:
    """Persistent 16-bit gradients: the full flat buffer (stages 0-1) or the reduced shard (2-3)."""
    st, a = get_stage(run.stage), run.param_bytes
    if st.shards_gradients:
        return Term("16-bit gradient shard", _shard(run) * a, "validate/stage2.py:Stage2.setup_grads")
    src = "validate/stage1.py:Stage1.setup_grads" if st.shards_optimizer else "validate/stage0.py:Stage0.setup"
    return Term("16-bit gradient buffer", sum(_full(run, u) for u in run.units) * a, src)


def master(run: ReferenceRun) -> Term:
    """fp32 master copy of this rank's shard (validate/runtime.py:Runtime.__init__)."""
    return Term("fp32 master", _shard(run) * MASTER_BYTES, "validate/runtime.py:Runtime.__init__")


def adam_states(run: ReferenceRun) -> Term:
    """Adam's m and v (fp32, like the master) and its step scalar, created lazily at the first step."""
    return Term("Adam m, v, step", 2 * _shard(run) * MASTER_BYTES + ADAM_STEP_BYTES,
                "torch/optim/adam.py:Adam._init_group via validate/runtime.py:Runtime.step", tensors=3)  # fmt: skip


def batch(run: ReferenceRun) -> Term:
    """The micro-batch's int64 tokens and targets, copied to the device (validate/worker.py:measure_stage)."""
    return Term("batch (token ids, targets)", run.acts.batch, "validate/worker.py:measure_stage", tensors=2)


def _states(run: ReferenceRun) -> tuple[Term, ...]:
    return (params16(run), grads16(run), master(run), adam_states(run))


def _gathered(run: ReferenceRun, *units: int) -> tuple[Term, ...]:
    """Stage 3: units whose full 16-bit parameters are gathered (validate/stage3.py:Stage3._gather)."""
    if not get_stage(run.stage).shards_parameters:
        return ()
    names = {0: "gathered root unit"}
    return tuple(
        Term(names.get(u, "gathered block unit"), _full(run, run.units[u]) * run.param_bytes,
             "validate/stage3.py:Stage3._gather")  # fmt: skip
        for u in units
    )


def _kept_grads(run: ReferenceRun) -> bool:
    """Stages 2-3 let autograd allocate each gradient and keep it until its unit is reduced
    (validate/stage2.py:Stage2.unit_grads_ready); stages 0-1 accumulate into the persistent buffer."""
    return get_stage(run.stage).shards_gradients


def _act(name: str, nbytes: int, tensors: int = 1) -> Term:
    return Term(name, nbytes, "zeroplan/formulas/activation_terms.py", tensors)


def _blocks_saved(run: ReferenceRun, n: int) -> Term:
    """Saved activations of ``n`` blocks (their inputs only under full checkpointing)."""
    per = run.acts.block.saved if run.checkpointing == "none" else run.acts.block.ckpt_saved
    what = "saved activations" if run.checkpointing == "none" else "checkpointed block inputs"
    return _act(f"{what} of {n} blocks", n * per, n)


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
    out = []
    for u in range(1, len(run.units)):
        done = sum(flat_shard_numel(x, run.nd) for x in run.units[:u])
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
            *base, _blocks_saved(run, L - 1), dy, kept_root,
            _act("first op's saved tensors still pending", blk.pending_at_last_grad
                 + (blk.held_input_pending if run.checkpointing == "full" else 0)),
            Term("block gradients (autograd)", block * a, "validate/stage2.py:Stage2.unit_grads_ready"),
            Term("block pack buffer", _full(run, run.units[-1]) * a, "validate/stage2.py:Stage2.unit_grads_ready"),
            *_gathered(run, 0, L))))  # fmt: skip
        out.append(Moment("backward", "root gradients packed", (
            *base, Term("root gradients (autograd)", root * a, "validate/stage2.py:Stage2.unit_grads_ready"),
            Term("root pack buffer", _full(run, run.units[0]) * a, "validate/stage2.py:Stage2.unit_grads_ready"),
            *_gathered(run, 0))))  # fmt: skip
    if kept and run.grad_accum > 1:
        out.extend(_accumulation_moments(run, base, dy, kept_root))
    return tuple(out)


def _accumulation_moments(
    run: ReferenceRun, base: tuple[Term, ...], dy: Term, kept_root: Term
) -> tuple[Moment, ...]:
    """Stages 2-3, micro-steps after the first: the unit's gradients, packed and freed, are reduce-scattered
    into a temporary of the unit's shard, which is added into the accumulated shard
    (validate/stage2.py:Stage2.unit_grads_ready). The pack buffer and the temporary are alive together."""
    blk, L, a = run.acts.block, run.acts.n_layer, run.param_bytes
    src = "validate/stage2.py:Stage2.unit_grads_ready"
    temp = "reduce-scatter output to accumulate ({} shard)"
    return (
        Moment("backward", "last block's accumulated reduce-scatter", (
            *base, _blocks_saved(run, L - 1), dy, kept_root,
            _act("first op's saved tensors still pending", blk.pending_at_last_grad
                 + (blk.held_input_pending if run.checkpointing == "full" else 0)),
            Term("block pack buffer", _full(run, run.units[-1]) * a, src),
            Term(temp.format("block"), flat_shard_numel(run.units[-1], run.nd) * a, src),
            *_gathered(run, 0, L))),  # fmt: skip
        Moment("backward", "root's accumulated reduce-scatter", (
            *base, Term("root pack buffer", _full(run, run.units[0]) * a, src),
            Term(temp.format("root"), flat_shard_numel(run.units[0], run.nd) * a, src),
            *_gathered(run, 0))),  # fmt: skip
    )


def optimizer_moments(run: ReferenceRun) -> tuple[Moment, ...]:
    """Adam on the flat master (validate/runtime.py:Runtime.step): fp32 gradient copy plus temporaries.

    ``_multi_tensor_adam`` (foreach) allocates ``sqrt(v)`` once (S·4); ``_single_tensor_adam`` computes
    ``v.sqrt() / bias_correction2_sqrt``, two S·4 tensors alive at once (torch/optim/adam.py).
    """
    s = _shard(run)
    temps = (1 if run.foreach else 2) * s * MASTER_BYTES
    kind = "foreach sqrt(v)" if run.foreach else "per-tensor sqrt(v) and its quotient"
    return (
        Moment("optimizer_step", "Adam update", (*_states(run), batch(run),
               Term("fp32 gradient of the master", s * MASTER_BYTES, "validate/runtime.py:Runtime.step"),
               Term(f"Adam temporaries ({kind})", temps, "torch/optim/adam.py", 1 if run.foreach else 2))),
    )  # fmt: skip


def moments(run: ReferenceRun) -> tuple[Moment, ...]:
    """Every moment of a training step of the reference runtime."""
    return (*init_moments(run), *forward_moments(run), *backward_moments(run), *optimizer_moments(run))


def reference_run(
    spec: TransformerSpec,
    nd: int,
    stage: int,
    micro_batch: int,
    seq_len: int,
    checkpointing: str = "none",
    foreach: bool = False,
    stat_bytes: int = 2,
    grad_accum: int = 1,
) -> ReferenceRun:
    """The run of ``spec`` as ``validate/transformer.py:CausalLM`` builds it: units (root, then each decoder
    layer by ``block_prefix``) and sizes from ``transformer_shapes``."""
    shapes, prefix = transformer_shapes(spec), block_prefix(spec)
    root = tuple(math.prod(s) for n, s in shapes if not n.startswith(prefix))
    blocks = tuple(
        tuple(math.prod(s) for n, s in shapes if n.startswith(f"{prefix}{i}.")) for i in range(spec.n_layer)
    )
    final_norm = sum(math.prod(s) for n, s in shapes if n.startswith(FINAL_NORM_PREFIX[spec.style]))
    last = f"{prefix}{spec.n_layer - 1}."
    late = sum(math.prod(s) for n, s in shapes
               if n.startswith(last) and (".mlp." in n or "post_attention_layernorm" in n))  # fmt: skip
    acts = model_activations(spec, micro_batch, seq_len, stat_bytes=stat_bytes)
    return ReferenceRun((root, *blocks), spec.vocab_size * spec.d_model, final_norm, nd, stage, acts,
                        checkpointing, foreach, tied_head=spec.tied, late_grads_numel=late,
                        grad_accum=grad_accum)  # fmt: skip


def predict_peak(run: ReferenceRun, block_bytes: int = 1, allocator_overhead_bytes: int = 0,
                 resident: tuple[Term, ...] = ()) -> PeakEstimate:  # fmt: skip
    """The peak of ``run`` per phase (``zeroplan.formulas.peak.peak_of`` over ``moments``); ``resident``:
    terms live after init (on CUDA the library workspaces, ``formulas.cuda_workspaces``)."""
    return peak_of(moments(run), block_bytes, allocator_overhead_bytes, resident=resident)


# --- The engine contract (zeroplan/engines/base.py): Settings and estimate --------------------------
# Imported here, not at the top, so this section only adds to the module (the profile above is edited
# on its own).
from typing import Annotated, Literal, Optional  # noqa: E402

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator  # noqa: E402

from zeroplan.engines.base import EngineEstimate, PlannerOptions, Workload  # noqa: E402
from zeroplan.formulas.cuda_workspaces import library_workspaces  # noqa: E402
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES  # noqa: E402
from zeroplan.policy import PrecisionPolicy  # noqa: E402
from zeroplan.types import StageNumber  # noqa: E402

CUDA_STAT_BYTES = 4
"""Bytes of LayerNorm's saved mean/rstd on CUDA, which keeps them in fp32 (``activation_terms`` docstring)."""
PEAK_OPTIMIZERS: tuple[str, ...] = ("adam", "adamw")
"""Optimizers whose step the reference profile models (``torch.optim.Adam``/``AdamW``: fp32 m, v, step)."""


class Settings(BaseModel):
    """The reference runtime's options (``validate/runtime.py``): which ZeRO stages, which dtypes, which device.

    The peak model is the runtime as built: 16-bit parameters and gradients, an fp32 master and fp32
    Adam states (``validate/runtime.py:Runtime.__init__``); another policy still gets model states and
    collectives, but asking for a peak with it is refused rather than answered for a different run.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: tuple[StageNumber, ...] = Field((0, 1, 2, 3), min_length=1)
    """ZeRO stages to estimate, one row each, in this order."""
    policy: PrecisionPolicy = PrecisionPolicy()
    """dtypes of model states and the optimizer (model states and collectives)."""
    flat_layout: bool = True
    """the shapes are the model's real tensors (padded per tensor as the runtime pads); False for a bare Ψ."""
    block_bytes: Annotated[int, Field(ge=1)] = CUDA_BLOCK_BYTES
    """allocator block size every tensor rounds up to: 512 on CUDA (the planner's target), 1 for none."""
    allocator_overhead_bytes: Annotated[int, Field(ge=0)] = 0
    """reserved - allocated, a separate term of every phase; 0 until measured on a GPU."""
    stat_bytes: Literal[2, 4] = CUDA_STAT_BYTES
    """bytes of LayerNorm's saved statistics: 4 on CUDA (fp32), 2 on CPU (the input dtype)."""
    cuda_capability: Optional[tuple[StrictInt, StrictInt]] = (9, 0)
    """the GPU's compute capability, which sizes the cuBLAS workspaces every phase after init holds
    (``formulas.cuda_workspaces``); (9, 0) is H100/H200; None: no GPU (CPU runs)."""

    @field_validator("stages")
    @classmethod
    def _distinct(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(v)) != len(v):
            raise ValueError(f"stages={list(v)}: give each stage once")
        return v


def check_peak_policy(policy: PrecisionPolicy) -> None:
    """ValueError (one line) unless ``policy`` is the run the reference profile describes."""
    ok = (
        policy.param_bytes == 2 and policy.grad_bytes == 2 and policy.master_dtype == "fp32"
        and policy.optimizer in PEAK_OPTIMIZERS and policy.optimizer_dtype == "fp32"
    )  # fmt: skip
    if not ok:
        p = policy.resolved()
        raise ValueError(
            "the reference engine's peak models 16-bit params and grads, an fp32 master and fp32 Adam "
            f"(validate/runtime.py); got params {p['param_dtype']}, grads {p['grad_dtype']}, master "
            f"{p['master_dtype']}, optimizer {p['optimizer']} ({p['optimizer_dtype']})"
        )


def check_peak_spec(spec: TransformerSpec) -> None:
    """ValueError (one line) for an architecture whose activations the profile does not count: dropout
    keeps a mask per dropout op (``activation_terms`` counts none; validate/transformer.py runs no dropout
    op at p = 0)."""
    drops = [f"{k}={getattr(spec, k):g}" for k in ("embd_pdrop", "attn_pdrop", "resid_pdrop") if getattr(spec, k)]
    if drops:
        raise ValueError(
            f"the reference engine's peak counts no dropout masks; the config has {', '.join(drops)} "
            "(set them to 0 in the config.json to plan a run without dropout)"
        )


def estimate(workload: Workload, nd: int, settings: Settings) -> tuple[EngineEstimate, ...]:
    """One row per requested ZeRO stage: model states and collectives from ``zeroplan.estimation``
    (the paper's formulas with the runtime's padding), the peak per phase from ``predict_peak`` when
    ``workload.spec`` is set (else None).

    With ``grad_accum`` = G > 1 every buffer the runtime keeps across micro-steps (the gradient buffer
    or shard, master, Adam states) exists at G = 1 already, so forward and backward of later micro-steps
    see nothing new alive, and stages 0-1 reduce once at the last micro-step exactly as at G = 1; what
    G adds is, at stages 2-3, the in-flight reduction of later micro-steps: a reduce-scatter into a
    temporary of the unit's shard next to its pack buffer (``_accumulation_moments``), which is a phase's
    peak only where it outgrows the unit's autograd gradients it replaces (N_d = 1 at most ties).
    Collectives per optimizer step: ``zeroplan.formulas.commtime.calls_per_optimizer_step``.
    """
    from zeroplan.estimation.estimate import stage_estimates  # the one home of model states

    if nd < 1:
        raise ValueError(f"nd={nd}: must be >= 1")
    numels = tuple(math.prod(s) for _, s in workload.shapes)
    if workload.spec is not None:
        check_peak_policy(settings.policy)
        check_peak_spec(workload.spec)
    rows = stage_estimates(numels, nd, settings.policy, settings.stages, None, settings.flat_layout)
    out = []
    for row in rows:
        peak = None
        if workload.spec is not None:
            run = reference_run(
                workload.spec, nd, row.stage, workload.micro_batch, workload.seq_len,
                workload.checkpointing, workload.foreach, stat_bytes=settings.stat_bytes,
                grad_accum=workload.grad_accum,
            )  # fmt: skip
            cap = settings.cuda_capability
            resident = () if cap is None else (library_workspaces(cap, workload.spec.biased_linear),)
            peak = predict_peak(run, block_bytes=settings.block_bytes,
                                allocator_overhead_bytes=settings.allocator_overhead_bytes, resident=resident)  # fmt: skip
        out.append(EngineEstimate("reference", f"ZeRO-{row.stage}", row.stage, row.memory, peak, row.collectives))
    return tuple(out)


# ---- the planner's side: options -> Settings and the byte convention ----

PLANNER_OPTIONS: tuple[str, ...] = ("stages", "policy")
"""The ``PlannerOptions`` fields in the reference runtime's vocabulary (the paper's: stages, a policy)."""


def planner_settings(options: PlannerOptions) -> Settings:
    """The reference runtime's ``Settings``: the requested stages and policy, the planner's CUDA target."""
    return Settings(stages=options.stages, policy=options.policy, flat_layout=options.flat_layout)


def planner_policy(settings: Settings) -> PrecisionPolicy:
    """The byte convention of the model states: the policy as given."""
    return settings.policy


def planner_block_bytes(settings: Settings) -> int:
    """The allocator block every peak term is rounded to."""
    return settings.block_bytes
