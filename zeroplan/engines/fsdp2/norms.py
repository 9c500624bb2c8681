"""The norms running backward, as terms of one FSDP2 run (``terms.Fsdp2Run``): what each saved plus its
working set, derived from the ops (``input_norm_backward``, ``final_norm_backward``)."""

from __future__ import annotations

from zeroplan.engines.fsdp2.memo import memo_term
from zeroplan.formulas.peak import Term


@memo_term
def input_norm_backward(run, checkpointed: bool) -> Term:
    """A block's input norm when it runs backward (the block's last backward op): what it saved plus its
    working set. Derived from the ops (to move into ``activation_terms``, which does not split them out):
    - llama (transformers LlamaRMSNorm): at pow's backward h32 = x.to(fp32) (N·d·4) is left
      (h and its output went with the weight product's and q/k/v's backward); the backward of ``h32.pow(2)``
      and of ``h32 * rsqrt`` holds three fp32 N·d temporaries beside the accumulating fp32 input gradient
      (4·N·d·4), and below fp32 the cast's backward (``hidden_states.to(input_dtype)``) one fp32 N·d more,
      as traced at dispatch (llama-2-7b bf16 at N_d = 64: 6·N·d·4 above the rest, 2 KiB under). In fp32 the
      cast is no op: 5·N·d·4 (MemTracker at the input norm's backward, differential case 0-2, qwen2 fp32 N_d = 4:
      2·N·d·4 = 393,216 B below the former 2·N·d·a of h and its output counted there). N·4 more
      only in fp32 without checkpointing: rsqrt's saved result goes when its node has run, before pow's
      backward (a dispatch trace of LlamaRMSNorm and a projection alone, torch 2.13, fp32, bf16 and checkpointed
      alike), and bf16 and checkpointed blocks measure without it (llama-untied-4-bf16, gloo, every rank of 4;
      blocks 2-3 of qwen2-small-untied-bf16, 1-3 of qwen2-untied+ckpt on the fake group,
      ``benchmarks/fsdp2_backward_trace.py``: 512 B over with it); fp32 unchecked blocks measure it (case 0-2,
      exact), what it is there is not traced yet (``checkpointed``: the block's own mode, selective_ac.py);
    - gpt (nn.LayerNorm): saved input (N·d·a), mean and rstd (2·N·st), its output (N·d·a); the fused
      ``native_layer_norm_backward`` allocates the input gradient (N·d·a).
    """
    acts, a = run.acts, run.p
    nd_elems = acts.embed_out // a  # N·d
    n = acts.batch // 16  # tokens: ids and targets are int64
    if run.style == "llama":
        fp32_row = n * 4 if a == 4 and not checkpointed else 0  # measured, not attributed (above)
        nbytes = nd_elems * 4 + fp32_row + 4 * nd_elems * 4 + (nd_elems * 4 if a < 4 else 0)
    else:
        st = (acts.final_saved - 2 * nd_elems * a) // (2 * n)
        nbytes = 3 * nd_elems * a + 2 * n * st
    return Term("input norm saved and backward working set", nbytes,
                "derived from LlamaRMSNorm / nn.LayerNorm backward (see input_norm_backward)")


@memo_term
def final_norm_backward(run) -> Term:
    """The final norm running backward, after the LM head (its output, saved by the head, and the logits
    gradient are gone): what it saved plus its working set.
    - llama: the fp32 copy h32 and five fp32 N·d temporaries at ``pow``'s backward (the gradient through
      h·rsqrt, through the mean, pow's h^1, its scaled copy, their product), 6·N·d·4; rsqrt, the 16-bit
      normalised copy and the output gradient are released by then (traced at dispatch: tiny-llama with 4
      layers, N_d = 8, bf16 and fp32, reshard_after_forward=2: the backward peak, exact);
    - gpt: the saved input, mean and rstd, the output gradient and ``native_layer_norm_backward``'s input
      gradient: ``final_saved`` (input, stats, output) + N·d·a.
    """
    acts, a = run.acts, run.p
    nd_elems = acts.embed_out // a  # N·d
    nbytes = 6 * nd_elems * 4 if run.style == "llama" else acts.final_saved + nd_elems * a
    return Term("final norm saved and backward working set", nbytes,
                "derived from LlamaRMSNorm / nn.LayerNorm backward (see final_norm_backward)")


def input_projections_backward(run, grads: Term) -> tuple[Term, ...]:
    """A llama-style block at its attention input projections' backward (q's, the last of q, k, v), before its
    input norm runs backward: the norm's saved tensors all alive (h32 = x.to(fp32), N·d·4; rsqrt, N·4; the
    normalised h and its output, saved by the weight product and by q, k, v, 2·N·d·a) and three N·d·a
    gradients of the norm's output in flight (autograd's buffer summing k's and v's, q's, their sum:
    ``InputBuffer::add``); () for GPT's LayerNorm (not traced). Measured (MemTracker's live storages at the
    backward peak, ``benchmarks/fsdp2_backward_trace.py 2``: differential case 0-2, qwen2 fp32, N_d = 4, fake
    group with real tensors): three fp32 N·d activations and four fp32 N·d gradients beside every weight
    gradient of block 1 but its input norm's (61,742,708 B, the phase's peak; the input norm's own backward
    195,072 B lower); block 2's, 57,977,076 B, and its input norm's, 57,782,004 B, as predicted. ``grads``: the
    block's unsharded gradients (``terms.unit_grads``), here less the input norm's weight gradient, not made yet."""
    if run.style != "llama":
        return ()
    a, nd_elems = run.p, run.acts.embed_out // run.p
    n = run.acts.batch // 16  # tokens: ids and targets are int64
    return (Term("input norm saved (h32, rsqrt, h, its output)", nd_elems * 4 + n * 4 + 2 * nd_elems * a,
                 "transformers LlamaRMSNorm forward (pow, mul by rsqrt, the weight product), q/k/v's input"),
            Term("norm output gradients in flight (k's and v's sum, q's, their sum)", 3 * nd_elems * a,
                 "torch autograd InputBuffer::add", 3),
            Term(f"{grads.name} but its input norm's", grads.bytes - run.final_norm_numel * a, grads.source,
                 grads.tensors - 1))


def rope_released(run) -> bool:
    """Whether RoPE's cos and sin (``ModelActivations.embed_saved`` of a llama-style model, made once in the body's
    forward and saved by every layer's rotary products) are freed once the first layer's attention has run
    backward: they are the last to hold them. Not when the first layer is checkpointed (its recompute takes them
    again; selective_ac.py) nor for Gemma (its ``embed_saved`` holds the embedding scale too; not traced). Measured (MemTracker, case 0-2, qwen2
    fp32, N_d = 4): no (1, 64, 64) fp32 tensor alive at block 1's q projection or input norm (32,768 B over before);
    both alive at block 2's, where the profile is exact."""
    return run.style == "llama" and not run.checkpointed(1) and not run.scale_bytes
