"""Activation memory per GPU of a transformer (Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models", MLSys 2023, arXiv:2205.05198, section 4 and Table 2).

Per layer, with 16-bit activations and 1-byte dropout masks, for sequence length s, micro-batch b,
hidden size h, a attention heads and tensor parallelism t with sequence parallelism:

- no recomputation:        s·b·h·(34/t + 5·a·s/(h·t))      (Table 2, "tensor + sequence parallel")
- selective recomputation: s·b·h·34/t                       (attention core recomputed)
- full recomputation:      s·b·h·2                          (only each layer's input is kept)

times the number of layers L. Under pipeline parallelism the first stage keeps about L layers' worth
(L/p layers for p micro-batches in flight, section 4.2.3), so L is not divided.

The 34 and 5·a·s/h come from GPT's layer (4h GeLU MLP, LayerNorm, dropout); they are not published for
Llama-style layers (SwiGLU, RMSNorm, no dropout, grouped-query attention), so only full recomputation,
which keeps just the layer input, is estimated for those. Left out: the embedding and the output
layer (logits of s·b·vocab elements, large for 128k vocabularies), FlashAttention (which removes the
5·a·s/h term), and the transient working set of the layer being recomputed.
"""

from __future__ import annotations

from typing import Optional

from zeroplan.architectures.spec import TransformerSpec

CHECKPOINTING: tuple[str, ...] = ("none", "selective", "full")


def activation_bytes(
    spec: TransformerSpec, seq_len: int, micro_batch: int, checkpointing: str = "full", tp: int = 1
) -> Optional[int]:
    """Korthikanti et al. 2022, Table 2, times L; None where the paper's constants do not apply."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r}: expected one of {', '.join(CHECKPOINTING)}")
    if seq_len < 1 or micro_batch < 1 or tp < 1:
        raise ValueError(f"seq_len={seq_len}, micro_batch={micro_batch}, tp={tp}: each must be >= 1")
    s, b, h, a, layers = seq_len, micro_batch, spec.d_model, spec.n_head, spec.n_layer
    if checkpointing == "full":
        return 2 * s * b * h * layers
    if spec.style != "gpt" or spec.ffn != 4 * h:
        return None
    per_layer = 34 * s * b * h if checkpointing == "selective" else 34 * s * b * h + 5 * a * s * s * b
    return -(-per_layer * layers // tp)
