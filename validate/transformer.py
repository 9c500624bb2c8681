"""The decoder-only transformers of ``zeroplan.architectures.spec.TransformerSpec`` in plain torch.

Each model has the parameter names, shapes and order of the transformers 5.24 causal LM of the same
config (``zeroplan.architectures.spec.transformer_shapes`` says which), so a transformers ``state_dict`` loads into
it, and computes what that model computes with ``attn_implementation="sdpa"``:

- GPT-2 (transformers/models/gpt2/modeling_gpt2.py: GPT2LMHeadModel): learned positions, LayerNorm,
  ``Conv1D`` projections (``addmm`` on (in, out) weights), the configured GELU, LM head tied by default.
- Llama, Mistral, Qwen2 (modeling_llama.py: LlamaForCausalLM and the copies in modeling_mistral.py,
  modeling_qwen2.py): RMSNorm upcast to fp32 (LlamaRMSNorm), rotary embeddings (LlamaRotaryEmbedding,
  ``default`` rope type only), SwiGLU MLP, grouped-query attention through SDPA's ``enable_gqa`` (or
  ``repeat_kv`` when a mask is needed: integrations/sdpa_attention.py), Mistral's sliding window as
  masking_utils.sliding_window_overlay (query i sees keys j with i - window < j <= i).
- Attention: ``F.scaled_dot_product_attention(is_causal=True)`` with scale 1/sqrt(head_dim).
- Dropout where transformers puts it (GPT-2: embeddings, attention probabilities, after each output
  projection; Llama family: attention probabilities only), in training mode only; a probability of 0
  (what training configs say today) runs no dropout op at all, so no mask is ever allocated.
- ``loss(batch)``: transformers/loss/loss_utils.py: ForCausalLMLoss — logits upcast to fp32
  (``logits.float()``), mean cross-entropy over targets, ignore_index -100.

Every model exposes ``blocks`` (the decoder layers: the reference runtime's sharding units; the
embeddings, final norm and an untied head form the root unit) and ``checkpointing``: when True each
block runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, keeping only its
input for backward. No buffers: RoPE's cos/sin are computed in forward, so model states are the
parameters only. Not reproduced: ``padding_idx`` (transformers stops the gradient of the pad token's
embedding row when a config names ``pad_token_id``; the validator trains on random tokens).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroplan.architectures.spec import TransformerSpec, layout_features

#: transformers' initializer_range default (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config): 0.02,
#: the std of every weight matrix and embedding at initialisation (PreTrainedModel._init_weights).
INIT_STD = 0.02


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers/activations.py: NewGELUActivation, op for op (the ops decide what backward saves)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


#: transformers' ACT2FN entries for the names zeroplan.architectures.spec.ACTIVATIONS admits.
ACT = {
    "gelu_new": gelu_new,
    "gelu": F.gelu,  # GELUActivation: nn.functional.gelu
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GELUTanh
    "relu": F.relu,
    "silu": F.silu,  # SiLUActivation
    "swish": F.silu,  # nn.SiLU
}


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, True) if training and p > 0 else x


class Conv1D(nn.Module):
    """transformers/pytorch_utils.py: Conv1D — a linear layer whose weight is stored (in, out)."""

    def __init__(self, n_out: int, n_in: int, **kw) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out, **kw))
        self.bias = nn.Parameter(torch.empty(n_out, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class RMSNorm(nn.Module):
    """transformers/models/llama/modeling_llama.py: LlamaRMSNorm (statistics in fp32)."""

    def __init__(self, d: int, eps: float, **kw) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d, **kw))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _attend(q, k, v, spec: TransformerSpec, mask: torch.Tensor | None, training: bool) -> torch.Tensor:
    """(b, heads, t, head_dim) q and (b, kv_heads, t, head_dim) k, v -> (b, t, heads * head_dim), as
    integrations/sdpa_attention.py: sdpa_attention_forward does it."""
    groups = spec.n_head // spec.n_kv_head
    kwargs = {}
    if groups > 1:
        if mask is None and spec.head_dim <= 256:  # use_gqa_in_sdpa
            kwargs["enable_gqa"] = True
        else:  # repeat_kv: expand, then reshape (a view with one kv head, a copy with more: llama_nograd.kv_copied)
            k, v = (z[:, :, None].expand(z.shape[0], z.shape[1], groups, *z.shape[2:]).reshape(
                z.shape[0], z.shape[1] * groups, *z.shape[2:]) for z in (k, v))
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=spec.attn_pdrop if training else 0.0,
        is_causal=mask is None, scale=spec.head_dim**-0.5, **kwargs,
    )  # fmt: skip
    return y.transpose(1, 2).contiguous().reshape(q.shape[0], q.shape[2], -1)


class GPT2Attention(nn.Module):
    def __init__(self, spec: TransformerSpec, **kw) -> None:
        super().__init__()
        self.spec = spec
        self.c_attn = Conv1D(3 * spec.d_model, spec.d_model, **kw)
        self.c_proj = Conv1D(spec.d_model, spec.d_model, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, -1, self.spec.head_dim).transpose(1, 2)
                   for z in self.c_attn(x).split(d, dim=2))  # fmt: skip
        y = self.c_proj(_attend(q, k, v, self.spec, None, self.training))
        return _dropout(y, self.spec.resid_pdrop, self.training)


class GPT2MLP(nn.Module):
    def __init__(self, spec: TransformerSpec, **kw) -> None:
        super().__init__()
        self.spec = spec
        self.c_fc = Conv1D(spec.ffn, spec.d_model, **kw)
        self.c_proj = Conv1D(spec.d_model, spec.ffn, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c_proj(ACT[self.spec.hidden_act](self.c_fc(x)))
        return _dropout(y, self.spec.resid_pdrop, self.training)


class GPT2Block(nn.Module):
    """GPT2Block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, spec: TransformerSpec, **kw) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.d_model, eps=spec.norm_eps, **kw)
        self.attn = GPT2Attention(spec, **kw)
        self.ln_2 = nn.LayerNorm(spec.d_model, eps=spec.norm_eps, **kw)
        self.mlp = GPT2MLP(spec, **kw)

    def forward(self, x: torch.Tensor, rope=None, mask=None) -> torch.Tensor:
        x = self.attn(self.ln_1(x)) + x
        return x + self.mlp(self.ln_2(x))


def _linear(n_in: int, n_out: int, bias: bool, **kw) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, **kw)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, spec: TransformerSpec, **kw) -> None:
        super().__init__()
        self.spec = spec
        d, q, kv = spec.d_model, spec.q_dim, spec.kv_dim
        self.q_proj = _linear(d, q, spec.qkv_bias, **kw)
        self.k_proj = _linear(d, kv, spec.qkv_bias, **kw)
        self.v_proj = _linear(d, kv, spec.qkv_bias, **kw)
        self.o_proj = _linear(q, d, spec.o_bias, **kw)

    def forward(self, x: torch.Tensor, rope: tuple, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.spec.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        cos, sin = (z.unsqueeze(1) for z in rope)  # apply_rotary_pos_emb
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return self.o_proj(_attend(q, k, v, self.spec, mask, self.training))


class LlamaMLP(nn.Module):
    def __init__(self, spec: TransformerSpec, **kw) -> None:
        super().__init__()
        self.act = ACT[spec.hidden_act]
        self.gate_proj = _linear(spec.d_model, spec.ffn, spec.mlp_bias, **kw)
        self.up_proj = _linear(spec.d_model, spec.ffn, spec.mlp_bias, **kw)
        self.down_proj = _linear(spec.ffn, spec.d_model, spec.mlp_bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """LlamaDecoderLayer: x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x))."""

    def __init__(self, spec: TransformerSpec, **kw) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, **kw)
        self.mlp = LlamaMLP(spec, **kw)
        self.input_layernorm = RMSNorm(spec.d_model, spec.norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(spec.d_model, spec.norm_eps, **kw)

    def forward(self, x: torch.Tensor, rope: tuple, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def check_buildable(spec: TransformerSpec) -> None:
    """ValueError (one line) for a spec this module cannot compute as transformers does."""
    if spec.style == "llama" and spec.rope_type != "default":
        raise ValueError(f"rope_type={spec.rope_type!r}: the reference runtime builds only 'default' RoPE")


def check_runtime_features(spec: TransformerSpec) -> None:
    """ValueError (one line) for a family feature ``CausalLM`` does not build (transformers' own class, ``--hf``,
    trains those): without it the runtime would train another model than the config's."""
    if missing := layout_features(spec):
        raise ValueError(f"model_type {spec.model_type!r}: the reference runtime builds no {', '.join(missing)} "
                         "(transformers' own class trains under --engine fsdp2 --hf)")


class _Body(nn.Module):
    """A named container (``transformer`` / ``model``) so parameter names match transformers'."""


def _init_module(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, Conv1D, nn.Embedding)):
        nn.init.normal_(module.weight, std=INIT_STD)
    if isinstance(module, (nn.Linear, Conv1D, nn.LayerNorm)) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, (nn.LayerNorm, RMSNorm)):
        nn.init.ones_(module.weight)


class CausalLM(nn.Module):
    """The causal LM of ``spec``; ``loss(batch)`` on a (tokens, targets) batch."""

    def __init__(self, spec: TransformerSpec, checkpointing: bool = False, **kw) -> None:
        super().__init__()
        check_buildable(spec)
        check_runtime_features(spec)
        self.spec, self.checkpointing = spec, checkpointing
        d, v = spec.d_model, spec.vocab_size
        body = _Body()
        if spec.style == "gpt":
            self.transformer = body
            body.wte = nn.Embedding(v, d, **kw)
            body.wpe = nn.Embedding(spec.max_seq_len, d, **kw)
            body.h = nn.ModuleList(GPT2Block(spec, **kw) for _ in range(spec.n_layer))
            body.ln_f = nn.LayerNorm(d, eps=spec.norm_eps, **kw)
        else:
            self.model = body
            body.embed_tokens = nn.Embedding(v, d, **kw)
            body.layers = nn.ModuleList(LlamaDecoderLayer(spec, **kw) for _ in range(spec.n_layer))
            body.norm = RMSNorm(d, spec.norm_eps, **kw)
        if not spec.tied:
            self.lm_head = nn.Linear(d, v, bias=False, **kw)
        self._init_weights()

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers, in order: the runtime's sharding units."""
        return self.transformer.h if self.spec.style == "gpt" else self.model.layers

    @property
    def embed(self) -> nn.Embedding:
        """The token embedding (also the LM head when tied)."""
        return self.transformer.wte if self.spec.style == "gpt" else self.model.embed_tokens

    @property
    def head_weight(self) -> nn.Parameter:
        return self.embed.weight if self.spec.tied else self.lm_head.weight

    @torch.no_grad()
    def _init_weights(self) -> None:
        """PreTrainedModel._init_weights as GPT-2 and Llama do it (without GPT-2's 1/sqrt(2L) scaling of
        output projections, which changes no shape or memory): N(0, 0.02) matrices and embeddings, zero
        biases, unit norms. Through ``Module.apply``, as ``PreTrainedModel.post_init`` does: under
        ``deepspeed.zero.Init`` (partition_parameters.py ``apply_with_gather``) each module's parameters,
        partitioned by then, are gathered for it; the leaves are visited in the same order as
        ``modules()``, so the same values are drawn."""
        self.apply(_init_module)

    def _positions(self, x: torch.Tensor) -> tuple:
        """(rope, mask) for the llama layout: LlamaRotaryEmbedding's cos and sin (fp32, then the
        activations' dtype) and the sliding-window mask from a sequence as long as the window on."""
        s, t = self.spec, x.shape[1]
        pos = torch.arange(t, device=x.device)
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float, device=x.device)
                                           / s.head_dim))  # fmt: skip
        freqs = pos[None, :, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        rope = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        mask = None
        if s.sliding_window is not None and t >= s.sliding_window:  # masking_utils: kv_length < window skips it
            diff = pos[:, None] - pos[None, :]
            mask = ((diff >= 0) & (diff < s.sliding_window)).expand(x.shape[0], 1, t, t)  # (b, 1, t, t), as sdpa_mask
        return rope, mask

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (b, t, vocab) in the parameters' dtype."""
        if tokens.shape[1] > self.spec.max_seq_len and self.spec.style == "gpt":
            raise ValueError(f"seq_len={tokens.shape[1]}: the model has {self.spec.max_seq_len} positions")
        x = self.embed(tokens)
        if self.spec.style == "gpt":
            x = x + self.transformer.wpe(torch.arange(tokens.shape[1], device=tokens.device))[None]
            x = _dropout(x, self.spec.embd_pdrop, self.training)
            rope, mask = None, None
        else:
            rope, mask = self._positions(x)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, mask, use_reentrant=False)
            else:
                x = block(x, rope, mask)
        x = self.transformer.ln_f(x) if self.spec.style == "gpt" else self.model.norm(x)
        return F.linear(x, self.head_weight)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor], forward=None) -> torch.Tensor:
        """ForCausalLMLoss on ``targets`` already shifted: fp32 logits, mean over targets != -100; ``forward``:
        what runs the model (None: the module itself; the DeepSpeed runner passes its engine, whose forward
        returns these logits)."""
        tokens, targets = batch
        logits = (self if forward is None else forward)(tokens).float()
        return F.cross_entropy(logits.view(-1, self.spec.vocab_size), targets.reshape(-1), ignore_index=-100)
