"""Mixture-of-experts blocks and multi-head latent attention: their records and parameter shapes.

Pure: ``(name, shape)`` pairs in the order transformers 5.24 registers them. The experts of a layer are
two 3D parameters (``experts.gate_up_proj`` (E, 2·f_e, d) and ``experts.down_proj`` (E, d, f_e): the
``*Experts`` classes of ``modeling_mixtral.py``, ``modeling_qwen2_moe.py``, ``modeling_qwen3_moe.py``,
``modeling_deepseek_v3.py``), so FSDP2 and DeepSpeed, without expert parallelism, shard them as two
ordinary tensors. The router is ``gate.weight`` (E, d). Each family registers the pieces in its own order:

- ``mixtral``   (MixtralSparseMoeBlock):   gate, experts
- ``qwen2_moe`` (Qwen2MoeSparseMoeBlock):  gate, experts, shared_expert (a SwiGLU MLP),
  shared_expert_gate (1, d)
- ``qwen3_moe`` (Qwen3MoeSparseMoeBlock):  experts, gate
- ``deepseek_v3`` (DeepseekV3MoE):         experts, gate, shared_experts (a SwiGLU MLP of
  n_shared_experts · moe_intermediate_size); the router also has the buffer ``e_score_correction_bias``
  (E,) in fp32, which is not a parameter (neither sharded nor trained).

Multi-head latent attention (DeepseekV3Attention, DeepSeek-V3 report arXiv:2412.19437 section 2.1.1):
queries through a low-rank ``q_a_proj`` (r_q, d) → ``q_a_layernorm`` (r_q) → ``q_b_proj`` (h·(n + r), r_q),
or one ``q_proj`` (h·(n + r), d) when ``q_lora_rank`` is null; keys and values through
``kv_a_proj_with_mqa`` (r_kv + r, d) → ``kv_a_layernorm`` (r_kv) → ``kv_b_proj`` (h·(n + v), r_kv);
``o_proj`` (d, h·v). n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim.
"""

from dataclasses import dataclass
from typing import Optional

Shape = tuple[int, ...]
Shapes = list[tuple[str, Shape]]

#: model_type -> the order its sparse block registers its pieces (see the module docstring).
MOE_ORDER: dict[str, tuple[str, ...]] = {
    "mixtral": ("gate", "experts"),
    "qwen2_moe": ("gate", "experts", "shared_expert", "shared_expert_gate"),
    "qwen3_moe": ("experts", "gate"),
    "deepseek_v3": ("experts", "gate", "shared_experts"),
}


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MLP of a mixture-of-experts model. Widths are elements.

    ``sparse_layers``: the decoder layers that hold it (the others have a dense MLP of the spec's
    ``ffn_hidden``); ``shared_ffn``: the width of the shared-expert MLP every token also runs (0: none).
    """

    n_experts: int
    """E: routed experts per sparse layer (``num_local_experts``, ``num_experts``, ``n_routed_experts``)."""
    top_k: int
    """k: experts each token is dispatched to (``num_experts_per_tok``)."""
    expert_ffn: int
    """f_e: one expert's SwiGLU width (Mixtral ``intermediate_size``, else ``moe_intermediate_size``)."""
    sparse_layers: tuple[int, ...]
    shared_ffn: int = 0
    norm_topk_prob: bool = False
    """whether the k routing weights are renormalised to sum to 1 (no memory effect)."""
    router_logits_loss: bool = False
    """``output_router_logits``: the training forward adds the load-balancing loss (every layer's router logits
    kept to the end of the forward); the peak does not model it (``formulas.moe_block.sparse_block_limits``)."""
    router_jitter: float = 0.0
    """Mixtral's ``router_jitter_noise``: the router's input multiplied by uniform noise in training (not modelled)."""
    n_group: int = 1
    """DeepSeek-V3's group-limited routing (``n_group``): the E experts in groups of E / n_group, each group scored
    by its two best experts; 1 for the families without groups."""
    topk_group: int = 1
    """DeepSeek-V3's ``topk_group``: the groups a token's k experts are chosen from. Neither sets a shape: a config
    transformers builds but cannot route (groups not dividing E, ...) keeps its shapes; its peak is refused
    (``formulas.deepseek_activations.routing_limit``)."""

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "expert_ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k}: more experts per token than the {self.n_experts} there are")
        if self.shared_ffn < 0:
            raise ValueError(f"shared_ffn={self.shared_ffn}: must be >= 0")


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention's low-rank widths (elements); see the module docstring."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank={self.q_lora_rank}: must be >= 1 (or null)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def linear(name: str, n_out: int, n_in: int, bias: bool = False) -> Shapes:
    """``nn.Linear(n_in, n_out)``: weight (out, in), then its bias."""
    return [(name + ".weight", (n_out, n_in))] + ([(name + ".bias", (n_out,))] if bias else [])


def swiglu(prefix: str, d: int, f: int) -> Shapes:
    """gate_proj, up_proj, down_proj without biases (the MLP of every family here)."""
    out = linear(prefix + "gate_proj", f, d) + linear(prefix + "up_proj", f, d)
    return out + linear(prefix + "down_proj", d, f)


def moe_shapes(moe: MoeSpec, model_type: str, d: int, prefix: str) -> Shapes:
    """The sparse block under ``prefix`` (``model.layers.{i}.mlp.``), in ``model_type``'s order."""
    e, fe = moe.n_experts, moe.expert_ffn
    pieces = {
        "gate": [(prefix + "gate.weight", (e, d))],
        "experts": [(prefix + "experts.gate_up_proj", (e, 2 * fe, d)),
                    (prefix + "experts.down_proj", (e, d, fe))],
        "shared_expert": swiglu(prefix + "shared_expert.", d, moe.shared_ffn),
        "shared_experts": swiglu(prefix + "shared_experts.", d, moe.shared_ffn),
        "shared_expert_gate": [(prefix + "shared_expert_gate.weight", (1, d))],
    }
    return [shape for piece in MOE_ORDER[model_type] for shape in pieces[piece]]


def mla_shapes(mla: MlaSpec, n_head: int, d: int, prefix: str, bias: bool) -> Shapes:
    """DeepseekV3Attention under ``prefix`` (``model.layers.{i}.self_attn.``); ``bias``: attention_bias
    (on q_a_proj, kv_a_proj_with_mqa and o_proj)."""
    qk, r_kv = mla.qk_head_dim, mla.kv_lora_rank
    if mla.q_lora_rank is None:
        out = linear(prefix + "q_proj", n_head * qk, d)
    else:
        r_q = mla.q_lora_rank
        out = linear(prefix + "q_a_proj", r_q, d, bias) + [(prefix + "q_a_layernorm.weight", (r_q,))]
        out += linear(prefix + "q_b_proj", n_head * qk, r_q)
    out += linear(prefix + "kv_a_proj_with_mqa", r_kv + mla.qk_rope_head_dim, d, bias)
    out += [(prefix + "kv_a_layernorm.weight", (r_kv,))]
    out += linear(prefix + "kv_b_proj", n_head * (mla.qk_nope_head_dim + mla.v_head_dim), r_kv)
    return out + linear(prefix + "o_proj", d, n_head * mla.v_head_dim, bias)
