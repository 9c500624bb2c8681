"""Dropout: the one input every engine's peak refuses (``Engine.own_peak_limits``), and why."""

from __future__ import annotations

from typing import Optional

from zeroplan.architectures.spec import TransformerSpec

DROPOUT_KEYS: tuple[str, ...] = ("embd_pdrop", "attn_pdrop", "resid_pdrop")
"""The ``TransformerSpec`` dropout probabilities (GPT-2's config keys; Llama's ``attention_dropout`` is read
into ``attn_pdrop``)."""


def dropout_limit(spec: TransformerSpec, engine: str) -> Optional[str]:
    """None when ``spec`` trains without dropout; else the one-line reason ``engine``'s peak refuses it
    (``Engine.own_peak_limits``). The terms above count no dropout: each ``nn.Dropout`` keeps a mask and its
    output, and in transformers 5.24 ``GPT2Attention`` passes ``dropout_p`` to SDPA, whose CPU math path then
    saves three fp32 b·h·s² tensors (the attention weights) and fp32 q, k, v; a CUDA kernel may save only its
    RNG state. Measured (saved-tensor hooks, one GPT2Block, b=2, s=128, d=64, 4 heads, bf16, CPU; beside its
    input and weights): p = 0.1 saves 2,623,488 bytes against 890,880 at p = 0 (docs/peak.md, "Dropout"): no
    one formula covers both devices, so the peak is refused rather than under-predicted."""
    drops = [f"{k}={getattr(spec, k):g}" for k in DROPOUT_KEYS if getattr(spec, k)]
    if not drops:
        return None
    return (f"the {engine} engine's peak counts no dropout masks; the config has {', '.join(drops)} "
            "(set attn_pdrop, embd_pdrop, resid_pdrop (Llama: attention_dropout) to 0 in the config.json)")
