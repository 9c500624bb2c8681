"""Small real models whose parameters are exactly the shapes ``zeroplan.models`` predicts.

``GPT`` builds ``zeroplan.models.transformer_shapes`` (GPT style: learned positions, biased LayerNorm and
linears, 4x MLP, LM head tied to the token embedding) and ``MLP`` builds ``mlp_shapes``, in the same
``named_parameters`` order. Both expose ``blocks``: the sharding units of the runtime (the remaining
parameters form the root unit). No buffers: model states are parameters only.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from zeroplan.models import TransformerSpec, gpt_for_params

PRESETS: dict[str, object] = {
    # Odd widths on purpose: at N_d = 4 most tensors need padding, so the padding rule is exercised.
    "gpt-tiny": TransformerSpec(n_layer=2, d_model=36, n_head=3, vocab_size=101, max_seq_len=16),
    "mlp-tiny": (33, 70, 70, 9),
    # 1.21B parameters in two wide blocks: a billion-parameter model for the simulated CI run that costs
    # few dispatched ops (time goes with layer count, not width, on fake tensors).
    "gpt-1b-wide": TransformerSpec(n_layer=2, d_model=6144, n_head=48, vocab_size=50304, max_seq_len=128),
}


class Block(nn.Module):
    def __init__(self, spec: TransformerSpec, **kw) -> None:
        super().__init__()
        d, f = spec.d_model, spec.ffn
        self.n_head = spec.n_head
        self.ln_1 = nn.LayerNorm(d, **kw)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(d, d + 2 * spec.kv_dim, **kw)
        self.attn.proj = nn.Linear(d, d, **kw)
        self.ln_2 = nn.LayerNorm(d, **kw)
        self.mlp = nn.Module()
        self.mlp.fc = nn.Linear(d, f, **kw)
        self.mlp.proj = nn.Linear(f, d, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn.proj(y)
        return x + self.mlp.proj(F.gelu(self.mlp.fc(self.ln_2(x))))


class GPT(nn.Module):
    """GPT-2-style decoder; ``loss(batch)`` is next-token cross-entropy on a (tokens, targets) batch."""

    def __init__(self, spec: TransformerSpec, checkpointing: str = "none", **kw) -> None:
        super().__init__()
        self.checkpointing = checkpointing  # "full": each block recomputed in backward (non-reentrant)
        if spec.style != "gpt" or spec.n_kv_head not in (None, spec.n_head):
            raise ValueError("validate.models.GPT builds GPT-style specs with full multi-head attention only")
        self.spec = spec
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model, **kw)
        self.wpe = nn.Embedding(spec.max_seq_len, spec.d_model, **kw)
        self.blocks = nn.ModuleList(Block(spec, **kw) for _ in range(spec.n_layer))
        self.ln_f = nn.LayerNorm(spec.d_model, **kw)
        for emb in (self.wte, self.wpe):  # GPT-2's init; N(0, 1) would make the tied logits huge
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            if self.checkpointing == "full" and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()  # tied LM head

    def loss(self, batch) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class MLP(nn.Module):
    """Biased linears with GELU between; ``loss(batch)`` is mean squared error to random targets."""

    def __init__(self, widths: tuple[int, ...], **kw) -> None:
        super().__init__()
        self.widths = tuple(widths)
        self.layers = nn.ModuleList(nn.Linear(a, b, **kw) for a, b in itertools.pairwise(widths))

    @property
    def blocks(self) -> nn.ModuleList:
        """The sharding units: one per linear (zeroplan.models.mlp_shapes calls them ``layers``)."""
        return self.layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.blocks):
            x = layer(x) if i == 0 else layer(F.gelu(x))
        return x

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        dtype = self.blocks[0].weight.dtype
        return F.mse_loss(self(x.to(dtype)).float(), y)


def spec_for(model: str | None, params: float | None):
    """The spec of a preset name, or a GPT-style spec of about ``params`` parameters."""
    if params is not None:
        return gpt_for_params(params)
    if model not in PRESETS:
        raise ValueError(f"model={model!r}: expected one of {', '.join(PRESETS)} (or give --params)")
    return PRESETS[model]


def make_batch(spec, n: int, generator: torch.Generator, seq_len: int | None = None) -> tuple:
    """A random CPU batch of ``n`` samples for ``loss``: (tokens, next tokens) or (inputs, targets)."""
    if isinstance(spec, TransformerSpec):
        seq_len = seq_len or spec.max_seq_len
        if seq_len > spec.max_seq_len:
            raise ValueError(f"seq_len={seq_len}: the model has only {spec.max_seq_len} positions")
        tokens = torch.randint(0, spec.vocab_size, (n, seq_len), generator=generator)
        return tokens, tokens.roll(-1, dims=1)
    return torch.randn(n, spec[0], generator=generator), torch.randn(n, spec[-1], generator=generator)


def build(spec, dtype: torch.dtype, device, seed: int = 0, checkpointing: str = "none") -> nn.Module:
    """The model of ``spec`` with parameters of ``dtype`` on ``device``, initialised from ``seed``."""
    torch.manual_seed(seed)
    kw = {"dtype": dtype, "device": device}
    return GPT(spec, checkpointing, **kw) if isinstance(spec, TransformerSpec) else MLP(spec, **kw)


def expected_shapes(spec) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What ``zeroplan.models`` says the parameters of ``spec`` are."""
    from zeroplan.models import mlp_shapes, transformer_shapes

    return transformer_shapes(spec) if isinstance(spec, TransformerSpec) else mlp_shapes(spec)
