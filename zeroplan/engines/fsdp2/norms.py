"""The norms running backward, as terms of one FSDP2 run (``terms.Fsdp2Run``): what each saved plus its
working set, derived from the ops (``input_norm_backward``, ``final_norm_backward``)."""

from __future__ import annotations

from zeroplan.engines.fsdp2.memo import memo_term
from zeroplan.formulas.peak import Term


@memo_term
def input_norm_backward(run) -> Term:
    """A block's input norm when it runs backward (the block's last backward op): what it saved plus its
    working set. Derived from the ops (to move into ``activation_terms``, which does not split them out):
    - llama (transformers LlamaRMSNorm): saved h32 = x.to(fp32) (N·d·4), rsqrt (N·4), the normalised
      16-bit h (N·d·a) and its output (N·d·a, saved by q/k/v); the backward of ``h32.pow(2)`` and of
      ``h32 * rsqrt`` holds three fp32 N·d temporaries beside the accumulating fp32 input gradient (4·N·d·4),
      as traced at dispatch (llama-2-7b at N_d = 64: 6·N·d·4 above the rest, 2 KiB under);
    - gpt (nn.LayerNorm): saved input (N·d·a), mean and rstd (2·N·st), its output (N·d·a); the fused
      ``native_layer_norm_backward`` allocates the input gradient (N·d·a).
    """
    acts, a = run.acts, run.p
    nd_elems = acts.embed_out // a  # N·d
    n = acts.batch // 16  # tokens: ids and targets are int64
    if run.style == "llama":
        nbytes = nd_elems * 4 + n * 4 + 2 * nd_elems * a + 4 * nd_elems * 4
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
