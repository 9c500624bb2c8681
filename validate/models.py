"""Small real models whose parameters are exactly the shapes ``zeroplan.architectures.spec`` predicts.

Transformers (``zeroplan.architectures.spec.TransformerSpec``, from a preset here, a zeroplan model preset or a
Hugging Face ``config.json``) are built by ``validate/transformer.py`` with transformers' parameter
names; ``MLP`` builds ``mlp_shapes``, in the same ``named_parameters`` order. Both expose ``blocks``: the
sharding units of the runtime (the remaining parameters form the root unit). No buffers: model states
are parameters only.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from validate.transformer import CausalLM, check_buildable
from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import TransformerSpec, gpt_for_params


def _gpt2(name: str, **dims) -> TransformerSpec:
    """A GPT-2 config without dropout and with exact GELU (``activation_function: gelu``): the layout,
    numbers and ops of the GPT class these presets were first written for."""
    config = {"model_type": "gpt2", "activation_function": "gelu", "embd_pdrop": 0.0, "attn_pdrop": 0.0,
              "resid_pdrop": 0.0, **dims}  # fmt: skip
    return spec_from_hf_config(config, f"validate preset {name!r}")


LLAMA_TINY = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 102, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 32, "vocab_size": 130,
              "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False}  # fmt: skip
"""The tensor-parallel runner's llama (validate/engines/fsdp2_tp.py): odd TP-local widths on purpose, ffn
102 / 2 = 51 and vocab 130 / 2 = 65 rows, padded by FSDP2 over 2."""

PRESETS: dict[str, object] = {
    # Odd widths on purpose: at N_d = 4 most tensors need padding, so the padding rule is exercised.
    "gpt-tiny": _gpt2("gpt-tiny", n_layer=2, n_embd=36, n_head=3, vocab_size=101, n_positions=16),
    "mlp-tiny": (33, 70, 70, 9),
    # 1.21B parameters in two wide blocks: a billion-parameter model for the simulated CI run that costs
    # few dispatched ops (time goes with layer count, not width, on fake tensors).
    "gpt-1b-wide": _gpt2("gpt-1b-wide", n_layer=2, n_embd=6144, n_head=48, vocab_size=50304, n_positions=128),
    # the default model of ``validate --tp`` (torchtitan's llama plan needs llama module names)
    "llama-tiny": spec_from_hf_config(LLAMA_TINY, "validate preset 'llama-tiny'"),
}


class MLP(nn.Module):
    """Biased linears with GELU between; ``loss(batch)`` is mean squared error to random targets."""

    def __init__(self, widths: tuple[int, ...], **kw) -> None:
        super().__init__()
        self.widths = tuple(widths)
        self.layers = nn.ModuleList(nn.Linear(a, b, **kw) for a, b in itertools.pairwise(widths))

    @property
    def blocks(self) -> nn.ModuleList:
        """The sharding units: one per linear (zeroplan.architectures.spec.mlp_shapes calls them ``layers``)."""
        return self.layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.blocks):
            x = layer(x) if i == 0 else layer(F.gelu(x))
        return x

    def loss(self, batch, forward=None) -> torch.Tensor:
        """``forward``: what runs the model (None: the module itself; the DeepSpeed runner passes its engine)."""
        x, y = batch
        dtype = self.blocks[0].weight.dtype
        return F.mse_loss((self if forward is None else forward)(x.to(dtype)).float(), y)


def spec_for(model: str | None, params: float | None):
    """The spec of ``model``: a preset here, else a zeroplan model preset or a ``config.json`` path
    (``zeroplan.presets.resolve_model``); or a GPT-style spec of about ``params`` parameters."""
    if params is not None:
        return gpt_for_params(params)
    if model in PRESETS:
        return PRESETS[model]
    from zeroplan.presets import model_presets, resolve_model

    path = model.endswith(".json") or Path(model).exists()
    if not path and model.strip().lower() not in model_presets():
        raise ValueError(
            f"model={model!r}: expected one of {', '.join(PRESETS)}, a model preset "
            f"({', '.join(model_presets())}) or the path of a config.json (or give --params)"
        )
    spec = resolve_model(model)  # a config file's problem is one line naming the file and the key
    check_buildable(spec)
    return spec


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
    """The model of ``spec`` with parameters of ``dtype`` on ``device``, initialised from ``seed``;
    ``checkpointing="full"``: recompute each transformer block in backward (torch.utils.checkpoint)."""
    torch.manual_seed(seed)
    kw = {"dtype": dtype, "device": device}
    if isinstance(spec, TransformerSpec):
        return CausalLM(spec, checkpointing=checkpointing == "full", **kw)
    return MLP(spec, **kw)


def expected_shapes(spec) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What ``zeroplan.architectures.spec`` says the parameters of ``spec`` are."""
    from zeroplan.architectures.spec import mlp_shapes, transformer_shapes

    return transformer_shapes(spec) if isinstance(spec, TransformerSpec) else mlp_shapes(spec)
