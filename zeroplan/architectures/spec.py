"""Parameter shapes of model families, so Ψ and per-tensor padding come from an architecture.

Pure: returns ``(name, shape)`` pairs in the order ``torch.nn.Module.named_parameters`` yields them for
the reference models in ``validate/models.py``, which build exactly these tensors.

Conventions (the GPT-2 / nanoGPT and Llama layouts):
- GPT style: learned position embeddings, LayerNorm with bias, biased linears, 4x MLP, tied LM head.
- Llama style: RMSNorm (weight only), no biases, SwiGLU MLP (gate, up, down), grouped-query attention
  (``n_kv_head`` key/value heads), untied LM head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Shape = tuple[int, ...]


@dataclass(frozen=True)
class TransformerSpec:
    """A decoder-only transformer. Dimensions are elements; ``ffn_hidden`` defaults to 4·d_model."""

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    max_seq_len: int = 1024
    ffn_hidden: int | None = None
    n_kv_head: int | None = None
    style: str = "gpt"  # "gpt" | "llama"

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.style not in ("gpt", "llama"):
            raise ValueError(f"style={self.style!r}: expected 'gpt' or 'llama'")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def kv_dim(self) -> int:
        return (self.n_kv_head or self.n_head) * (self.d_model // self.n_head)


def transformer_shapes(spec: TransformerSpec) -> tuple[tuple[str, Shape], ...]:
    """Every parameter of ``spec`` as (name, shape), in module registration order."""
    d, f, kv = spec.d_model, spec.ffn, spec.kv_dim
    out: list[tuple[str, Shape]] = [("wte.weight", (spec.vocab_size, d))]
    if spec.style == "gpt":
        out.append(("wpe.weight", (spec.max_seq_len, d)))
    for i in range(spec.n_layer):
        p = f"blocks.{i}."
        if spec.style == "gpt":
            out += [
                (p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                (p + "attn.qkv.weight", (d + 2 * kv, d)), (p + "attn.qkv.bias", (d + 2 * kv,)),
                (p + "attn.proj.weight", (d, d)), (p + "attn.proj.bias", (d,)),
                (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                (p + "mlp.fc.weight", (f, d)), (p + "mlp.fc.bias", (f,)),
                (p + "mlp.proj.weight", (d, f)), (p + "mlp.proj.bias", (d,)),
            ]  # fmt: skip
        else:
            out += [
                (p + "ln_1.weight", (d,)),
                (p + "attn.qkv.weight", (d + 2 * kv, d)),
                (p + "attn.proj.weight", (d, d)),
                (p + "ln_2.weight", (d,)),
                (p + "mlp.gate.weight", (f, d)), (p + "mlp.up.weight", (f, d)),
                (p + "mlp.down.weight", (d, f)),
            ]  # fmt: skip
    out.append(("ln_f.weight", (d,)))
    if spec.style == "gpt":
        out.append(("ln_f.bias", (d,)))
    else:
        out.append(("lm_head.weight", (spec.vocab_size, d)))
    return tuple(out)


def mlp_shapes(widths: tuple[int, ...]) -> tuple[tuple[str, Shape], ...]:
    """A stack of biased linears ``widths[0] -> widths[1] -> ...`` as (name, shape)."""
    if len(widths) < 2 or any(w < 1 for w in widths):
        raise ValueError(f"widths={widths}: need at least two positive widths")
    out: list[tuple[str, Shape]] = []
    for i, (w_in, w_out) in enumerate(zip(widths, widths[1:])):
        out += [(f"layers.{i}.weight", (w_out, w_in)), (f"layers.{i}.bias", (w_out,))]
    return tuple(out)


def numels(shapes: tuple[tuple[str, Shape], ...]) -> tuple[int, ...]:
    """Element count of each tensor."""
    return tuple(math.prod(s) for _, s in shapes)


def gpt_for_params(psi: float, vocab_size: int = 50304) -> TransformerSpec:
    """A GPT-style spec with about ``psi`` parameters, for simulating a model given only Ψ.

    Blocks hold 12·d² + 13·d parameters. The width follows GPT-3's aspect ratio n_layer ≈ d_model / 128
    (175B: 96 layers of 12288), so Ψ ≈ 12·d³/128, rounded to a multiple of 128 with 128-wide heads.
    """
    d_model = max(128, round((psi * 128 / 12) ** (1 / 3) / 128) * 128)
    per_layer = 12 * d_model * d_model + 13 * d_model
    embed = (vocab_size + 1024) * d_model + 2 * d_model
    n_layer = max(1, round((psi - embed) / per_layer))
    return TransformerSpec(n_layer, d_model, d_model // 128, vocab_size)
