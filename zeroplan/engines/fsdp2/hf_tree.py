"""transformers' own module tree under FSDP2 (``Workload.transformers``): what it holds that the validator's
``CausalLM`` does not, as terms, each with the file and function it was read from and the row it was
measured on (``tests/test_fsdp2_hf_recorded.py``, ``tests/test_fsdp2_hf.py``; real gloo, MemTracker's categories at each phase's peak).

- ``forward(labels=...)`` computes the loss inside the root's forward (``loss_utils.py:ForCausalLMLoss``,
  called from ``LlamaForCausalLM.forward`` / ``GPT2LMHeadModel.forward``), so:
  the last block's all-gather output, freed only by the root's post-forward (``_fsdp_state.py:
  FSDPState._post_forward``, ``iter_forward_root``: ``comm_ctx.all_gather_state = None``), is alive
  through the head and the loss; the forward keeps its 16-bit ``logits`` (returned in the output) while
  ``ForCausalLMLoss`` makes the fp32 copy and the cross-entropy runs; and the root's pre-backward hook,
  registered on every output tensor (``FSDPState._register_pre_backward_hook``: the loss is one), fires
  when backward starts, before the cross-entropy backward: the last block's backward all-gather
  (``_fsdp_param_group.py:FSDPParamGroup._backward_prefetch``) runs beside the saved log-softmax.
- An untied ``lm_head`` (an ``nn.Linear`` the root calls): its weight gradient outlives the root's
  ``post_backward`` (``.grad = None``, ``unsharded_grads.clear()``) until the root's reduce-scatter has
  returned: it is the root's last parameter, and ``foreach_reduce``'s loop variable keeps the last gradient of
  every unit (``terms.last_grad_held``; found here first, as "no Python referrer", then named on the 5.4M GPT).
- Rotary embeddings (Llama, Mistral, Qwen2) keep ``inv_freq`` and ``original_inv_freq`` as buffers
  (``modeling_llama.py:LlamaRotaryEmbedding.__init__``), fp32, head_dim/2 each; the forward keeps the
  int64 position ids (``cache_position``, s·8 B) beside cos and sin.
- The llama-style body (``modeling_qwen2.py:Qwen2Model.forward``; Llama, Mistral, Qwen3, Phi-3 alike) binds
  ``inputs_embeds`` as a local and runs its layer loop on ``hidden_states = inputs_embeds``: the embedding's
  output stays alive until the body returns. In fp32 that costs nothing more: the first block's input norm
  (``Qwen2RMSNorm.forward``: ``hidden_states.to(torch.float32)`` returns the tensor itself, ``pow`` saves it)
  keeps that very storage among the saved activations. In 16-bit the norm saves its fp32 copy, and the body's
  local is the only reference left: N·d·a from block 2's all-gather to the body's return.
- A tied model built whole (materialized) makes its ``lm_head`` weight before ``post_init`` ties it
  to the embedding (``modeling_utils.py:PreTrainedModel.post_init`` -> ``tie_weights``): the build holds
  the model plus V·d.
"""

from __future__ import annotations

import math

from zeroplan.engines.fsdp2.memo import memo_term
from zeroplan.engines.fsdp2.param import local_shard_numel, padded_shard_numel
from zeroplan.engines.fsdp2.terms import Fsdp2Run, ag_output
from zeroplan.formulas.peak import Term

TF = "transformers/"


@memo_term  # every moment of a run holds them: one object each (phase_leaders rounds each object once; a speed-up)
def rotary_buffers(run: Fsdp2Run) -> tuple[Term, ...]:
    """The rotary embedding's fp32 buffers of head_dim/2 (``Fsdp2Run.buffer_bytes``, two per table), Gemma's
    ``embed_scale`` (``Fsdp2Run.scale_bytes``) and DeepSeek-V3's router bias (``Fsdp2Run.router_bytes``), from the
    build on."""
    out = ()
    if run.buffer_bytes:
        out += (Term("rotary inv_freq, original_inv_freq (fp32 buffers)", run.buffer_bytes,
                     TF + "models/llama/modeling_llama.py:LlamaRotaryEmbedding.__init__", 2),)  # fmt: skip
    if run.scale_bytes:
        out += (Term("embed_scale (fp32 buffer)", run.scale_bytes,
                     TF + "models/gemma2/modeling_gemma2.py:Gemma2TextScaledWordEmbedding.__init__"),)  # fmt: skip
    if run.router_bytes:
        out += (Term("router e_score_correction_bias (fp32 buffers)", run.router_bytes,
                     TF + "models/deepseek_v3/modeling_deepseek_v3.py:DeepseekV3TopkRouter.__init__"),)  # fmt: skip
    return out


def position_ids(run: Fsdp2Run) -> tuple[Term, ...]:
    """transformers' llama-style forward: the int64 position ids (``Fsdp2Run.position_bytes``, s·8) beside
    cos and sin (gpt2's are its ``embed_saved``), until the root's forward returns."""
    if not run.position_bytes:
        return ()
    return (Term("position ids (cache_position, int64)", run.position_bytes,
                 TF + "models/llama/modeling_llama.py:LlamaModel.forward"),)  # fmt: skip


CKPT_POSITION_IDS = "position ids (kept by the checkpointed layers' recompute, int64)"


def checkpointed_position_ids(run: Fsdp2Run) -> tuple[Term, ...]:
    """With each decoder layer in ``checkpoint_wrapper`` (non-reentrant), the layer's call arguments are kept for its
    recompute (``torch/utils/checkpoint.py:_checkpoint_without_reentrant_generator``: ``recompute_fn`` closes over
    ``*args, **kwargs``, held by the layer's saved-tensor holders until its backward): the llama-style body passes
    ``position_ids`` to every layer, so the s·8 B outlive the body's return, to the first layer's backward.
    Measured: DeepSeek-V3 fp32 checkpointed on gloo N_d = 2 (tests/test_deepseek.py ``deepseek-wide-ckpt``), 512 B
    (s = 64) under at block 2's backward without it; with transformers' own gradient checkpointing too (the same
    512 B alive after the forward, tests/test_deepseek.py)."""
    if not run.any_checkpointed or not run.transformers:
        return ()
    return tuple(Term(CKPT_POSITION_IDS, t.bytes, "torch/utils/checkpoint.py:_checkpoint_without_reentrant_generator")
                 for t in position_ids(run))  # fmt: skip


def inputs_embeds_held(run: Fsdp2Run) -> tuple[Term, ...]:
    """The llama-style body's ``inputs_embeds`` (N·d·a, 16-bit), alive past block 1 until the body returns;
    in fp32 it is block 1's saved norm input, already counted (module docstring). With them, the body's own masks
    where it makes some that no node keeps (``body_masks``: Gemma 2's two additive masks, ``causal_mask_mapping``
    in ``modeling_gemma2.py:Gemma2Model.forward``; measured: t-gemma2-scores, forward 65,536 B short without)."""
    if not run.transformers or not run.position_bytes:
        return ()
    masks = (Term("the body's attention masks (causal_mask_mapping, activation dtype)", run.acts.body_masks,
                  TF + "models/gemma2/modeling_gemma2.py:Gemma2Model.forward"),) if run.acts.body_masks else ()  # fmt: skip
    if run.p == 4:
        return masks
    return masks + (Term("inputs_embeds (the body's local, 16-bit; fp32 saves it in block 1's norm)", run.acts.embed_out,
                 TF + "models/qwen2/modeling_qwen2.py:Qwen2Model.forward (hidden_states = inputs_embeds)"),)  # fmt: skip


def gpt2_body_embeds(run: Fsdp2Run) -> tuple[Term, ...]:
    """GPT-2's body (``modeling_gpt2.py:GPT2Model.forward``) binds ``inputs_embeds`` (N·d) and
    ``position_embeds`` (s·d) as locals and adds them: neither is saved by an op, both live until the body
    returns. Counted in every forward moment inside the body: the blocks' and a unit after the layers copied out
    there (``[ln_f, lm_head]``; differential draw 1-5 of generator 2, forward 147,456 B short without; the blocks'
    moments: draws 1-5, 2-4, 2-9 of generator 1 and the recorded gpt2 rows without labels, 147,456 to 393,216 B
    short at the last block's forward). N = the batch's token ids and targets over 16 B, s = the position ids
    (``embed_saved``, int64) over 8 B."""
    if not run.transformers or run.style != "gpt" or not run.acts.batch:
        return ()
    tokens, seq = run.acts.batch // 16, run.acts.embed_saved // 8
    return (Term("inputs_embeds and position_embeds (the body's locals)", run.acts.embed_out + run.acts.embed_out
                 * seq // tokens, TF + "models/gpt2/modeling_gpt2.py:GPT2Model.forward", 2),)  # fmt: skip


def last_block_in_loss(run: Fsdp2Run) -> tuple[Term, ...]:
    """With the loss inside the root's forward, the last block's all-gather output is alive through the
    head and the loss (freed by the root's post-forward)."""
    if not run.loss_in_forward:
        return ()
    return (ag_output(run, len(run.units) - 1, "kept until the root's post-forward, after the loss"),)


def logits_in_loss(run: Fsdp2Run) -> tuple[Term, ...]:
    """With the loss inside the root's forward, the 16-bit logits stay alive while the loss runs (the
    forward returns them); in fp32 ``logits.float()`` is the logits themselves."""
    if not run.loss_in_forward or run.p == 4:
        return ()
    return (Term("16-bit logits (kept by the forward while its loss runs)", run.acts.logits,
                 TF + "loss/loss_utils.py:ForCausalLMLoss (logits.float())"),)  # fmt: skip


def tied_head_build(run: Fsdp2Run) -> tuple[Term, ...]:
    """A tied model built whole: its own lm_head weight exists until ``post_init`` ties it."""
    if not run.transformers or not run.tied_head or run.settings.init != "materialized":
        return ()
    return (Term("lm_head weight before tie_weights", run.head_numel * run.m,
                 TF + "modeling_utils.py:PreTrainedModel.post_init (tie_weights)"),)  # fmt: skip


def tied_head_to_empty(run: Fsdp2Run) -> tuple[Term, ...]:
    """Meta init of a tied transformers model: ``nn.Module.to_empty`` works through ``Module._apply``
    (torch/nn/modules/module.py), which visits a parameter once for every module that holds it (``embed_tokens``
    first, ``lm_head`` last) and swaps in ``empty_like`` of it: the rank's local (unpadded) shard. FSDP2 re-pads it
    when an FSDP module's ``_apply`` returns (_fully_shard.py:FSDPModule._apply, _fsdp_param.py:
    FSDPParam.reset_sharded_param: a short shard is copied into a new padded tensor, then held as
    ``_sharded_param_data``). If the unit owning the tied weight returns between the two visits (a unit holding
    ``embed_tokens`` or its parent, not the root), the first shard is padded and held while ``lm_head``'s visit
    allocates a second local shard and re-pads it: one padded shard more, and on a short rank (V % N_d != 0) its
    unpadded local shard too. If the root owns it, nothing is re-padded between the visits: the first local shard
    is freed by the swap, and the peak is the second local shard beside its padding (the last rank holds the
    unpadded shard, not a padded one, more). Measured: draws 1-9 and 1-17 (generator 3, the group [norm,
    embed_tokens, lm_head]) exact on every rank, the last (a short shard) 4,703,360 and 9,447,424 B over the
    padded shard alone; 1-51 (blocks: the root owns it) exact on every rank. The validator's own model applies
    its head with ``F.linear`` and registers the weight once: no second allocation."""
    if not run.transformers or not run.tied_head or run.settings.init != "meta":
        return ()
    shapes = run.param_order or tuple(s for u in run.units for s in u.shapes)
    embed = next((s for s in shapes if math.prod(s) == run.head_numel), None)
    if embed is None:
        return ()
    src = "torch/nn/modules/module.py:Module._apply"
    padded, local = padded_shard_numel(embed, run.nd), local_shard_numel(embed, run.nd, run.settings.described_rank)
    if not _repadded_between_visits(run):
        return (Term("the tied weight's second local shard (to_empty visits it twice)", local * run.m, src),)
    second = Term("the tied weight's second shard (to_empty visits it twice)", padded * run.m, src)
    if local == padded:
        return (second,)
    return (second, Term("its unpadded local shard, being re-padded", local * run.m,
                         "_fsdp_param.py:FSDPParam.reset_sharded_param"))  # fmt: skip


def _repadded_between_visits(run: Fsdp2Run) -> bool:
    """Whether the unit owning the tied weight is a non-root unit with a module other than ``lm_head`` (its
    ``_apply`` returns, re-padding the weight, after ``embed_tokens``'s visit and before ``lm_head``'s)."""
    owner = next((u for u in run.shard_units if any(math.prod(s) == run.head_numel for _, s in u.params)), None)
    return owner is not None and not owner.root and any(m not in ("", "lm_head") for m in owner.modules)


EMBED_SAVED = "embedding saved (position ids)"


def root_backward_released(run: Fsdp2Run, base: tuple[Term, ...]) -> tuple[tuple[Term, ...], bool]:
    """The terms of the backward ``base`` still alive when the root runs backward, and whether the incoming
    activation gradient is. Released: transformers' rotary cos and sin (llama-style) or the position ids (gpt2),
    saved by the blocks' attention or the position embedding (measured: every transformers row's embedding and
    root reduce-scatter moments, rank 0 and 1, exact without them); this project's GPT's position ids too, saved
    by ``wpe``'s EmbeddingBackward, which runs before ``wte``'s (made later in forward: a higher sequence number,
    ``torch/csrc/autograd/engine.cpp``'s ready queue) and releases them. A tied head's summed gradient is made
    after the embedding's own backward has returned and freed its incoming gradient
    (``torch/csrc/autograd/input_buffer.cpp``: the sum runs when the second gradient arrives), while ``wpe``'s
    and the final norm's gradients sit on their unsharded parameters until the root's post_backward (its
    inputs need no gradient, so ``_fsdp_param_group.py:FSDPParamGroup._register_post_backward_hook`` adds no
    hook: ``_fsdp_state.py:FSDPState._root_post_backward_final_callback`` runs it). Checked on
    ``validate/transformer.py``'s GPT (tests/test_fsdp2_root_grads.py): at ``wte.weight``'s leaf hook the
    ``wpe`` and ``ln_f`` gradients exist, the incoming gradient and the position ids do not; recorded row
    ``fsdp2-real-4-gpt-5m-fp32-k2-ckpt-nd4``'s backward exact on every rank (it was 131,584 B over). The
    validator's Llama-style CausalLM too: its rotary cos and sin, saved by the blocks' attention, are gone at its
    root's reduce-scatter (live storages at the peak of tests/test_fsdp2_wrap.py's ``llama-causallm-file``: 6,144 B
    over before)."""
    return tuple(t for t in base if t.name not in (EMBED_SAVED, CKPT_POSITION_IDS)), not run.tied_head
