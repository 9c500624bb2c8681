"""FSDP2 with tensor parallelism: torchtitan's llama plan on a mesh (dp_replicate x) dp_shard x tp.

The plan (torchtitan 0.3.0 ``models/common/decoder_sharding.py``, the same placements as its earlier
``apply_tp``; torch 2.13.0 ``torch/distributed/tensor/parallel/style.py``, ``TP_SRC``):

- ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` (torchtitan's wq/wk/wv, w1/w3):
  ``ColwiseParallel``, weight (and bias) ``Shard(0)``;
- ``o_proj`` and ``down_proj`` (wo, w2): ``RowwiseParallel``, weight ``Shard(1)``, bias ``Replicate``;
  output ``Shard(1)`` (a reduce-scatter) with sequence parallelism, else ``Replicate`` (an all-reduce);
- the norms: ``SequenceParallel`` (weight ``Replicate``, activations ``Shard(1)``) with sequence parallelism,
  else left alone (replicated);
- ``embed_tokens``: ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))`` (weight
  ``Shard(0)``: the vocabulary split; output reduce-scattered to the sequence shard; ``Replicate`` without SP);
- ``lm_head``: ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)``,
  the loss parallel option (``loss_parallel()``: cross-entropy on vocabulary-sharded logits); without it
  (torchtitan's ``parallelism.disable_loss_parallel``, ``Settings.loss_parallel`` false)
  ``output_layouts=Replicate(), use_local_output=True``: ``ColwiseParallel._prepare_output_fn`` redistributes
  the N x V/T logits Shard(-1) -> Replicate (an all-gather of the vocabulary, ``Shard._to_replicate_tensor``),
  and the plain cross-entropy runs on the whole N x V logits on every TP rank.

transformers' own plan (``Settings.tp_plan`` transformers: ``from_pretrained(..., tp_plan="auto")``, which
accelerate's TP requires; transformers 5.24 ``distributed/tensor_parallel.py``, ``TRANSFORMERS_SRC``) is this
plan without SP and without loss parallel: the llama, Mistral and Qwen2 configs' ``base_model_tp_plan`` q/k/v and
gate/up ``colwise`` (``ColwiseParallel``: weight and bias ``Shard(0)``, input ``Replicate``, output ``Shard(-1)``
as a local tensor), o/down ``rowwise`` (weight ``Shard(-1)``, the Partial output all-reduced to ``Replicate``),
``model.embed_tokens: embedding_rowwise`` (``distributed/mixin.py`` ``init_parallel_plans``; ``EmbeddingParallel``:
weight ``Shard(0)``, output all-reduced to ``Replicate``), ``lm_head: colwise_gather_output`` (output
``Replicate``: the logits all-gathered, the plain loss), the norms left alone. One difference: each colwise
module makes its own local input a ``Replicate`` DTensor (``ColwiseParallel.transform_inputs_pre_forward``:
``DTensor.from_local``), where torch's plan does it once per attention and MLP (``PrepareModuleInput``), so each
of q/k/v and gate/up all-reduces its input's Partial gradient in backward (``tp_collectives``). Measured:
tests/test_fsdp2_tp.py, the ``-hf`` rows (the validator's model under transformers' ``apply_tensor_parallelism``).

FSDP2 then shards each TP-local tensor (``DTensor._local_tensor``) on its dim 0 over ``dp_shard``
(``_fsdp_param.py:FSDPParam._init_sharded_param``: ``_StridedShard`` when TP also splits dim 0), so the
profile runs unchanged on the TP-local shapes (``local_shapes``) and N_d / T data-parallel ranks: the
dim-0 padding rule is the flat one, applied to the TP-local dim 0.

Rank r of the mesh ``init_device_mesh(dev, (R, S, T), ("dp_replicate", "dp_shard", "tp"))`` (row-major,
``tp`` innermost) is TP rank r mod T of data-parallel rank r // T; with the divisibility ``check_tp`` asks
every TP rank holds the same shapes, so a rank's row is its data-parallel rank's.
"""

from __future__ import annotations

from dataclasses import replace

from zeroplan.engines.fsdp2.collectives import UnitCollective
from zeroplan.engines.fsdp2.tp_loss import whole_logits
from zeroplan.formulas.llama_nograd import llama_nograd_moments

TP_SRC = "torch/distributed/tensor/parallel/style.py"
TRANSFORMERS_SRC = "transformers/distributed/tensor_parallel.py"
TP_FAMILIES = ("llama", "mistral", "qwen2")
"""The llama-like families the plan holds: q/k/v/o, gate/up/down, RMSNorm, untied head (Qwen3's q_norm and
k_norm and Phi-3's fused projections are other plans)."""

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm", "norm")


def check_tp(t: object) -> int | str:
    """``tp``'s check (``EngineOption.check``): a whole number from 1 to 2**16, or ``auto`` (``plan`` only)."""
    if t == "auto":
        return t
    if isinstance(t, str) and t.isdigit():
        t = int(t)
    if not isinstance(t, int) or isinstance(t, bool) or not 1 <= t <= 2**16:
        raise ValueError(f"tp={t!r}: expected a whole number from 1 to 65536, or auto (plan)")
    return t


def check_plan(spec, t: int, nd: int, seq_len: int, sequence_parallel: bool) -> None:
    """ValueError (one line) for what the plan cannot hold at TP degree ``t`` on ``nd`` GPUs."""
    if nd % t:
        raise ValueError(f"tp={t}: must divide the GPUs ({nd})")
    if spec is None:
        raise ValueError(f"tp={t}: tensor parallelism needs an architecture (--model): the plan is by module name")
    if spec.model_type not in TP_FAMILIES or spec.qk_norm or spec.fused_projections or spec.moe is not None:
        raise ValueError(f"tp={t}: model_type {spec.model_type!r}: torchtitan's llama plan holds only "
                         f"{', '.join(TP_FAMILIES)} (q/k/v/o, gate/up/down, RMSNorm)")  # fmt: skip
    if spec.tied:
        raise ValueError(f"tp={t}: tied embeddings are not in torchtitan's llama plan "
                         "(embedding Rowwise, head Colwise)")
    for what, n in (("n_head", spec.n_head), ("n_kv_head", spec.n_kv_head), ("ffn_hidden", spec.ffn),
                    ("vocab_size", spec.vocab_size), *((("seq_len", seq_len),) if sequence_parallel else ())):
        if n % t:
            raise ValueError(f"tp={t}: {what}={n} is not divisible by {t} (uneven DTensor shards are not modelled)")


def colwise_inputs(tp_plan: str) -> int:
    """The input gradients a block all-reduces over ``tp`` in backward without SP (``tp_collectives``): torch's
    plan makes each of attention's and the MLP's inputs a DTensor once (``PrepareModuleInput``), 2; transformers'
    each colwise module its own (``TRANSFORMERS_SRC`` ``ColwiseParallel.transform_inputs_pre_forward``), one per
    ``COLWISE`` module."""
    return len(COLWISE) if tp_plan == "transformers" else 2


def local_shape(name: str, shape: tuple[int, ...], t: int) -> tuple[int, ...]:
    """The TP-local shape of one parameter (the plan in the module docstring); ValueError for a name outside it."""
    module, leaf = (["", *name.split(".")])[-2:]
    if module in COLWISE or module in ("embed_tokens", "lm_head"):
        return (shape[0] // t, *shape[1:])
    if module in ROWWISE:
        return (shape[0], shape[1] // t) if leaf == "weight" else shape  # the bias is Replicate
    if module in NORMS:
        return shape
    raise ValueError(f"parameter {name!r}: not in torchtitan's llama tensor-parallel plan")


def local_shapes(shapes, t: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every parameter's TP-local shape (``local_shape``), names and order kept. ``local_shape`` reads a name's
    last two segments only, so it runs once per (module, leaf, shape): the layers' parameters share one answer
    (a speed-up, no rule: the mesh search builds this for every TP degree; a name outside the plan still raises
    at its first parameter, by its own name)."""
    made: dict = {}
    out = []
    for n, s in shapes:
        head, _, leaf = n.rpartition(".")
        key = (head.rpartition(".")[2], leaf, s := tuple(s))
        got = made.get(key)
        if got is None:
            got = made[key] = local_shape(n, s, t)
        out.append((n, got))
    return tuple(out)


def local_spec(spec, t: int):
    """The architecture one TP rank computes: heads, KV heads, the FFN width and the vocabulary (loss
    parallel: vocabulary-sharded logits) divided by T, head_dim and d_model kept. Its activations are the
    block internals divided by T; the residual stream and the norms stay whole (without SP); without loss
    parallel the logits are whole from the all-gather on (``whole_logits``)."""
    return replace(spec, n_head=spec.n_head // t, n_kv_head=spec.n_kv_head // t, ffn_hidden=spec.ffn // t,
                   vocab_size=spec.vocab_size // t, head_dim=spec.head_dim)  # fmt: skip


def tp_collectives(n_layer: int, tokens: int, d_model: int, dtype: str, t: int, sequence_parallel: bool,
                   checkpointing: bool, vocab: int | None = None,
                   colwise_inputs: int = 2, row=UnitCollective) -> tuple:
    """The TP collectives of one micro-step over the ``tp`` group (T ranks), in issue order per phase; each
    (b, s, d) activation of ``tokens`` = b·s rows is one collective of tokens·d elements (its full size).
    Measured call by call on gloo (tests/data/measured/fsdp2_tp.json, validate/engines/fsdp2_tp.py).

    With sequence parallelism (DTensor redistributions, ``_redistribute.py``; placements as in the module
    docstring): forward, the embedding's Partial -> Shard(1) (reduce-scatter), per block Shard(1) ->
    Replicate before attention and before the MLP (all-gather) and Partial -> Shard(1) after o_proj and
    down_proj (reduce-scatter), then the head's Shard(1) -> Replicate (all-gather). Backward runs each one's
    transpose in reverse (an all-gather's gradient is reduce-scattered and the reverse), ending with the
    embedding's all-gather. Without SP: the Partial -> Replicate of the embedding, o_proj and down_proj
    (all-reduce) in forward, and the Partial gradients at the head's, the MLP's and attention's inputs in
    backward (all-reduce). Either way loss parallel all-reduces three (b·s) tensors in forward: the row
    max, the sum of exponentials (``tensor/parallel/loss.py:_log_softmax``) and the target's logit
    (``_nll_loss_forward``: ``_MaskPartial._reduce_value``); its backward sends nothing. Checkpointing
    recomputes each block's forward collectives in backward but its last (down_proj's reduce-scatter, or
    all-reduce without SP): ``torch.utils.checkpoint``'s non-reentrant recompute stops once the saved tensors
    are back (early stop), and nothing saves that output (measured with and without SP).

    ``vocab`` V given: no loss parallel (``Settings.loss_parallel`` false). The head's output is
    redistributed Shard(-1) -> Replicate (``style.py:ColwiseParallel._prepare_output_fn``,
    ``placement_types.py:Shard._to_replicate_tensor``: ``funcol.all_gather_single``): one all-gather of the
    N·V logits in forward, in the activation dtype, in place of loss parallel's three all-reduces. Its
    backward sends nothing: ``to_local``'s gradient is Replicate and ``Redistribute.backward`` turns it into
    Shard(-1) by a local split (``Shard._replicate_to_shard``).

    ``colwise_inputs``: the input gradients all-reduced per block in backward without SP: 2 (torch's plan, one per
    ``PrepareModuleInput``), 5 with transformers' plan (q, k, v, gate, up: ``TRANSFORMERS_SRC``
    ``ColwiseParallel.transform_inputs_pre_forward``, ``DTensor.from_local`` per module; measured).
    ``row``: what each collective is made as, from ``UnitCollective``'s fields (``tp_estimate._tp_rows``)."""
    n = tokens * d_model
    if sequence_parallel:
        embed, block_fwd, head = ("reduce-scatter",), ("all-gather", "reduce-scatter") * 2, ("all-gather",)
    else:
        embed, block_fwd, head = ("all-reduce",), ("all-reduce",) * 2, ()
    back = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather"}

    def coll(op: str, phase: str, unit: str, elements: int = n) -> UnitCollective:
        return row(op, phase, unit, elements, dtype, t, "tp")

    out = [coll(op, "forward", "root") for op in embed]
    for i in range(1, n_layer + 1):
        out += [coll(op, "forward", f"block {i}") for op in block_fwd]
    out += [coll(op, "forward", "root") for op in head]
    # the loss runs on fp32 logits (``logits.float()``, as transformers' ForCausalLMLoss and CausalLM.loss)
    if vocab is None:
        out += [row("all-reduce", "forward", "root (loss parallel)", tokens, "fp32", t, "tp") for _ in range(3)]
    else:
        out += [coll("all-gather", "forward", "root (logits)", tokens * vocab)]
    if sequence_parallel:
        out += [coll(back[op], "backward", "root") for op in reversed(head)]
    else:
        out += [coll("all-reduce", "backward", "root")]  # the head's input gradient (Partial -> Replicate)
    for i in range(n_layer, 0, -1):
        if checkpointing:
            out += [coll(op, "backward", f"block {i}") for op in block_fwd[:-1]]
        if sequence_parallel:
            out += [coll(back[op], "backward", f"block {i}") for op in reversed(block_fwd)]
        else:  # the gradients at the MLP's and attention's inputs (colwise: Partial -> Replicate)
            out += [coll("all-reduce", "backward", f"block {i}") for _ in range(colwise_inputs)]
    if sequence_parallel:
        out += [coll(back[op], "backward", "root") for op in reversed(embed)]
    return tuple(out)


def norm_grad_collectives(n_layer: int, d_model: int, dtype: str, t: int, sequence_parallel: bool,
                          row=UnitCollective) -> tuple:
    """With SP, the norms' weight gradients are Partial over ``tp`` (a Replicate weight times a Shard(1)
    input); FSDP2 all-reduces each to its Replicate placement when it reduces the unit
    (``_fsdp_param.py:FSDPParam._get_grad_inner_tensor``: ``grad.redistribute``), so once per optimizer step:
    two per block, in the blocks' reduction order, then the final norm's with the root. Measured. ``row``: as
    ``tp_collectives``'."""
    if not sequence_parallel:
        return ()
    blocks = [row("all-reduce", "backward", f"block {i}", d_model, dtype, t, "tp")
              for i in range(n_layer, 0, -1) for _ in range(2)]  # fmt: skip
    return (*blocks, row("all-reduce", "backward", "root", d_model, dtype, t, "tp"))


def sequence_parallel_acts(acts, t: int, tokens: int, d_model: int, a: int, gloo: bool = False):
    """``acts`` of the TP-local architecture (``local_spec``: the block internals divided by T, the residual
    stream and the norms whole, as without SP) with the sequence-parallel regions divided by T.

    With SP the residual stream between blocks is Shard(1) (n/T rows), and each ``SequenceParallel`` RMSNorm
    runs on its n/T rows: its fp32 copy (in fp32: its input itself), its rsqrt and its normalised copy are
    divided by T, while its output is all-gathered to Replicate (n·d·a) and that gathered tensor is what the
    next colwise linears save (the sharded output is the all-gather's input, which nothing saves). So per
    norm (n·d·4 + n·4 + n·d·a)·(1 - 1/T) less is saved, and the block's input, x1 and output, the embedding's
    output and the norms' pending and backward working sets are divided by T; under full checkpointing what
    the recompute adds (``recomputed``) loses the same cut, and in fp32 the held input it excludes is n/T
    rows. At a block's forward peak
    (``forward_extra``) down_proj's Partial output is whole (n·d·a) while it is reduce-scattered into n/T rows,
    and n/T-row tensors are alive beside it: the reduce-scatter's output and the block's output, and in 16 bit
    the block's input and x1 too (in fp32 the norms save those: ``_llama_block``'s ``own_input``); gloo
    copies the whole input of a reduce-scatter (as FSDP2's ``gloo_copy`` term). That moment was read from the
    measurement (gloo, T = 2, fp32 and bf16); the rest is derived from the ops of validate/transformer.py; both
    are measured against FSDP2 + SP on gloo (tests/test_fsdp2_tp.py)."""
    n, d = tokens, d_model

    def shard(x: int) -> int:
        return x // t

    per_norm = n * d * 4 + n * 4 + n * d * a
    cut = per_norm - shard(per_norm)
    b = acts.block
    extra = n * d * a * (1 + gloo) + (2 if a == 4 else 4) * shard(n * d * a)
    own_input = n * d * a - shard(n * d * a) if a == 4 else 0  # fp32: the held input is the norm's copy (/T)
    block = replace(b, saved=b.saved - 2 * cut, forward_extra=extra, recomputed=b.recomputed - 2 * cut + own_input,
                    forward_before_output=shard(b.forward_before_output), ckpt_saved=shard(b.ckpt_saved),
                    held_input_pending=shard(b.held_input_pending), pending_at_last_grad=shard(b.pending_at_last_grad),
                    norm_backward_saved=b.norm_backward_saved - 2 * cut + n * d * a - shard(n * d * a),
                    norm_backward_ws=shard(b.norm_backward_ws))  # fmt: skip
    return replace(acts, block=block, embed_out=shard(acts.embed_out), final_saved=acts.final_saved - cut)


def post_norm_backward(block, spec, a: int):
    """``block`` (a TP rank's ``BlockActivations``) with its post-attention RMSNorm's backward folded into the
    block's backward working set, where that moment is the larger (as ``moe_block.sparse_block`` does).

    At pow's backward in that norm (``norm_backward_ws``: fp32 N·d temporaries) the MLP's saved tensors are
    released and its weight gradients alive (gate, up, down: 3·d·f/T, and the norm's d, in the activation
    dtype); the moment is ``norm_backward_saved`` + ``norm_backward_ws`` + those gradients, i.e. beside the
    block's ``saved`` ``later`` below. TP divides the MLP (f/T) but not the norm without SP (with SP it runs on
    n/T rows), so there the norm's fp32 working set passes the block's first-op and activation-gradient ones:
    measured at gloo 2 x 2, bf16, 2 x 16 tokens, MemTracker's backward peak inside ``PowBackward0`` of block 2's
    post-attention norm with 4 h32 copies saved, 5 fp32 and one 16-bit N·d temporaries, the block's gate/up/down
    gradients and the norm's (tests/test_fsdp2_tp.py: 10,144 B without SP and 992 B with SP, now 0).
    16-bit only: in fp32 the norm's casts are no-ops and the working set the formula holds over-counts by at least
    5,056 B there (the fold would over-predict fp32 without SP by that); the measured fp32 rows are exact without it."""
    if a == 4 or not block.norm_backward_ws:  # fp32, or GPT's LayerNorm (no such moment)
        return block
    mlp_grads = (3 * spec.d_model * spec.ffn + spec.d_model) * a
    later = block.norm_backward_ws + mlp_grads - (block.saved - block.norm_backward_saved)
    return replace(block, backward_act_grads=max(block.backward_act_grads, later - block.first_weight_grads))


def sp_nograd_peak(spec, t: int, n: int, s: int, a: int, gloo: bool) -> int:
    """A llama block's checkpointed forward (no grad) with SP: its input and what it holds beside it at its
    largest moment, ``llama_nograd_moments`` of ``spec`` (the TP-local architecture) re-counted by where each
    tensor lives.

    With SP the block's input, x1 (the residual after attention) and each norm's output are n/T rows (``sh``);
    each ``PrepareModuleInput`` all-gathers the norm's output to n rows for attention or the MLP (the moments'
    "norm out") while the n/T one stays alive as the module's argument; o_proj's and down_proj's Partial
    outputs (n rows) are reduce-scattered to n/T rows through a whole copy (funcol's ``cat`` of the chunks of
    dim 1, the ``gloo`` copy of ``sequence_parallel_acts``). Moments: the first norm on n/T rows; attention's
    (beside the input and the n/T norm output); o_proj's reduce-scatter; the residual sum; the second norm
    (beside x1); the MLP's (x1 and the argument n/T); down_proj's reduce-scatter: the input, x1, the n/T norm
    output and the reduce-scatter's output (4 x n/T), the gathered norm output, down's output and the copy
    (n each), the product act(gate)·up (n·f/T). Traced with MemTracker (gloo 2 x 2, bf16, 2 x 32 tokens,
    validate/engines/fsdp2_tp.py): the forward peak is that last moment, 37,248 B; the unsharded count
    (``ckpt_forward_peak`` without SP: the input whole, beside the MLP's three f-wide tensors) was 768 B over."""
    m = llama_nograd_moments(spec, n, s, a)
    whole = n * spec.d_model * a
    sh, copy = whole // t, whole * gloo
    attention = max(m[k] for k in ("rope_q", "rope_k", "sdpa", "qk_norm", "fused"))
    return max(sh + m["norm"] // t, 2 * sh + attention, 3 * sh + m["o_proj"] + copy, 3 * sh, 2 * sh + m["norm"] // t,
               m["mlp"] - whole + 3 * sh, 4 * sh + 2 * whole + copy + n * spec.ffn * a)  # fmt: skip


def tp_acts(acts, spec, t: int, tokens: int, a: int, sequence_parallel: bool, gloo: bool, seq_len: int | None = None,
            loss_parallel: bool = True):
    """The activations of one TP rank (``spec`` the TP-local architecture, ``local_spec``): with SP the
    sequence-parallel regions divided by T (``sequence_parallel_acts``) and the checkpointed forward's
    peak re-counted (``sp_nograd_peak``; ``seq_len``: the sequence, for SDPA's mask, else ``tokens``), then the
    post-attention norm's backward moment (``post_norm_backward``); without loss parallel the logits whole
    (``whole_logits``)."""
    if not loss_parallel:
        acts = whole_logits(acts, t)
    if sequence_parallel:
        acts = sequence_parallel_acts(acts, t, tokens, spec.d_model, a, gloo)
        if spec.style == "llama":
            nograd = sp_nograd_peak(spec, t, tokens, seq_len or tokens, a, gloo)
            acts = replace(acts, block=replace(acts.block, ckpt_forward_peak=nograd))
    return replace(acts, block=post_norm_backward(acts.block, spec, a))



TP_SIZES = (1, 2, 4, 8)
"""The TP degrees ``plan --tp auto`` tries, smallest first, those within a node that divide the GPUs and that
the plan holds (``check_plan``): TP's collectives run on every micro-step's activations, so it stays on
NVLink (torchtitan: TP inside a node, FSDP across)."""


def tp_sizes(spec, nd: int, gpus_per_node: int, seq_len: int, sequence_parallel: bool = True) -> tuple[int, ...]:
    """``TP_SIZES`` that fit in a node, divide ``nd`` and pass ``check_plan`` (1 always), leaving at least two
    data-parallel ranks (FSDP2's world-size-1 path is not modelled: ``Fsdp2Run``)."""
    out = []
    for t in TP_SIZES:
        try:
            if t > 1 and (t > gpus_per_node or t >= nd):
                continue
            if t == 1 or check_plan(spec, t, nd, seq_len, sequence_parallel) is None:
                out.append(t)
        except ValueError:
            continue
    return tuple(out)


def tp_snippet(t: int, dp_mesh: str, sequence_parallel: bool, loss_parallel: bool = True) -> str:
    """``parallelize_module`` with torchtitan's llama plan in transformers' llama names (``LlamaForCausalLM``:
    ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``), then what ``fully_shard`` takes:
    ``dp_mesh``, the data-parallel sub-mesh. The loss is computed under ``loss_parallel()``; without loss parallel
    the head's output is Replicate (whole logits, a plain tensor) and the loss is the plain one."""
    act = "Shard(1)" if sequence_parallel else "Replicate()"
    if loss_parallel:
        head = "output_layouts=Shard(-1), use_local_output=False),\n"
        loss = "})  # the loss: `with loss_parallel(): loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())`\n"
    else:  # torchtitan's parallelism.disable_loss_parallel
        head = "output_layouts=Replicate(), use_local_output=True),\n"
        loss = ("})  # no loss parallel: every TP rank all-gathers the whole logits; the loss as without TP,\n"
                "# `loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())`\n")
    norms = ('        "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),\n'
             if sequence_parallel else "")  # fmt: skip
    final = '    "model.norm": SequenceParallel(),\n' if sequence_parallel else ""
    return (
        "from torch.distributed.tensor import Replicate, Shard\n"
        "from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,\n"
        "                                               SequenceParallel, "
        + "loss_parallel, " * loss_parallel + "parallelize_module)\n"
        f"# tensor parallelism over the {t} GPUs of mesh[\"tp\"] (torchtitan's llama plan), before fully_shard;\n"
        "# module names as transformers' LlamaForCausalLM (model.model.layers: `model.layers` below)\n"
        "parallelize_module(model, mesh[\"tp\"], {\n"
        f"    \"model.embed_tokens\": RowwiseParallel(input_layouts=Replicate(), output_layouts={act}),\n{final}"
        f"    \"lm_head\": ColwiseParallel(input_layouts={act}, {head}{loss}"
        + ("# transformers with SP: pass position_ids and cache_position = arange(seq_len) to the model (its\n"
           "# embedding output has seq_len / T rows, from which it would derive them)\n" if sequence_parallel else "")
        + "for block in model.model.layers:\n"
        "    parallelize_module(block, mesh[\"tp\"], {\n"
        f"{norms}"
        f"        \"self_attn\": PrepareModuleInput(input_kwarg_layouts={{\"hidden_states\": {act}}},\n"
        "                                        desired_input_kwarg_layouts={\"hidden_states\": Replicate()}),\n"
        "        \"self_attn.q_proj\": ColwiseParallel(), \"self_attn.k_proj\": ColwiseParallel(),\n"
        "        \"self_attn.v_proj\": ColwiseParallel(),\n"
        f"        \"self_attn.o_proj\": RowwiseParallel(output_layouts={act}),\n"
        f"        \"mlp\": PrepareModuleInput(input_layouts=({act},), desired_input_layouts=(Replicate(),)),\n"
        "        \"mlp.gate_proj\": ColwiseParallel(), \"mlp.up_proj\": ColwiseParallel(),\n"
        f"        \"mlp.down_proj\": RowwiseParallel(output_layouts={act}),\n"
        "    })\n"
        f"dp_mesh = {dp_mesh}  # fully_shard shards the TP-local tensors over it\n"
    )


def transformers_tp_snippet(t: int, dp_mesh: str) -> str:
    """transformers' own plan (``Settings.tp_plan`` transformers) as the validator applies it
    (validate/engines/fsdp2_tp_hf.py: transformers 5.24, whose ``from_pretrained(tp_plan="auto", tp_size=T)`` refuses
    a T below the world size), then what ``fully_shard`` takes: ``dp_mesh``."""
    return (
        "from transformers.distributed.tensor_parallel import apply_tensor_parallelism\n"
        f"# tensor parallelism over the {t} GPUs of mesh[\"tp\"]: the model's own tp_plan (transformers; accelerate's\n"
        "# TP), before fully_shard: colwise q/k/v, gate/up, rowwise o/down, embedding_rowwise, lm_head\n"
        "# colwise_gather_output (the logits whole on every TP rank: the loss as without TP)\n"
        "apply_tensor_parallelism(model, mesh[\"tp\"], model._expand_parallel_plan(model.tp_plan))\n"
        f"dp_mesh = {dp_mesh}  # fully_shard shards the TP-local tensors over it\n"
    )
