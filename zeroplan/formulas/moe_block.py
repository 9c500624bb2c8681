"""The sparse MLP of a mixture-of-experts decoder layer, as transformers 5.24 trains it: what autograd saves
and the working sets beside it, per layer and micro-batch (bytes). The routed experts' own terms are
``moe_activations.expert_activations``; this module adds the router and the shared expert, and the moments
of the block's forward and backward that the engines' peaks take.

Symbols: N = b·s tokens, k = experts per token, S = N·k dispatched rows, E = routed experts, d = width,
f = one expert's width, f_s = the shared expert's width, ``a`` = activation bytes, ``w`` = the routing
weights' bytes (``moe_activations.ROUTING_WEIGHT_BYTES``).

Saved for backward (saved-tensor hooks on transformers' classes, tests/test_moe_peaks.py; derivatives.yaml
per op), beside the post-attention norm's output, which the router's linear saves (the dense MLP's gate and
up linears save that same storage, counted with the norm):

- the router (``MixtralTopKRouter.forward``, ``Qwen2MoeTopKRouter.forward``, ``Qwen3MoeTopKRouter.forward``):
  ``softmax(logits, fp32)`` saves its fp32 output (N·E·4; Mixtral's ``router_logits.float()`` copy is not
  saved), ``topk`` its int64 indices (N·k·8: the storage the experts receive as ``top_k_index``); where the
  top-k weights are renormalised (``router_top_value /= sum``: always for Mixtral, ``norm_topk_prob`` for the
  Qwen MoEs) the in-place division saves the fp32 sum (N·4) and a clone of its fp32 input (N·k·4);
- the routed experts: ``expert_activations`` (grouped_mm, the default; the gathered rows, the gate-up output,
  SiLU's output and the product, the down output, the sorted weights, three int64 indices, E int32 offsets);
- Qwen2-MoE's shared expert (``Qwen2MoeSparseMoeBlock.forward``): a SwiGLU MLP (gate and up outputs, SiLU's
  output, the product: 4·N·f_s·a), ``sigmoid(shared_expert_gate(x))`` (N·a, saved by sigmoid and the
  product) and the shared expert's output (N·d·a, saved by that product).

No load-balancing loss: ``output_router_logits`` is false by default in every family here (MixtralConfig,
Qwen2MoeConfig, Qwen3MoeConfig), and the model adds ``aux_loss`` only when it is set.
"""

from __future__ import annotations

from zeroplan.architectures.moe import MoeSpec
from zeroplan.formulas.moe_activations import INDEX_BYTES, expert_activations

FP32 = 4  # the router's softmax output and the renormalised top-k weights (``dtype=torch.float``)
#: the families whose sparse block's terms are derived here and measured (tests/test_moe_peaks.py)
SPARSE_BLOCK_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")


def renormalised(moe: MoeSpec, model_type: str) -> bool:
    """Whether the router divides its top-k weights by their sum in place (Mixtral always; the Qwen MoEs when
    ``norm_topk_prob``)."""
    return model_type == "mixtral" or moe.norm_topk_prob


def router_saved(moe: MoeSpec, model_type: str, n_tokens: int) -> int:
    """The router's saved tensors beside its input (module docstring)."""
    n, e, k = n_tokens, moe.n_experts, moe.top_k
    norm = n * FP32 + n * k * FP32 if renormalised(moe, model_type) else 0
    return n * e * FP32 + n * k * INDEX_BYTES + norm


def shared_expert_saved(moe: MoeSpec, model_type: str, n_tokens: int, d_model: int, act_bytes: int) -> int:
    """Qwen2-MoE's shared expert and its sigmoid gate (module docstring); 0 for the families without one."""
    if model_type != "qwen2_moe" or not moe.shared_ffn:
        return 0
    n, a = n_tokens, act_bytes
    return 4 * n * moe.shared_ffn * a + n * a + n * d_model * a


def sparse_mlp_saved(moe: MoeSpec, model_type: str, n_tokens: int, d_model: int, act_bytes: int) -> int:
    """Everything one sparse MLP saves beside its input: router, routed experts, shared expert."""
    experts = expert_activations(moe, model_type, d_model, n_tokens, act_bytes).saved_bytes
    return (router_saved(moe, model_type, n_tokens) + experts
            + shared_expert_saved(moe, model_type, n_tokens, d_model, act_bytes))  # fmt: skip


def sparse_block_limits(spec) -> tuple[str, ...]:
    """What in a sparse-block family's ``spec`` (a ``TransformerSpec``) the terms do not derive (empty: the peak
    is modelled). The engines' walks take one block record for every layer, so a model whose layers are not
    all sparse (Qwen-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``, DeepSeek-V3's dense first layers)
    is refused rather than given the sparse block's number for its dense layers; the experts' SiLU is the one
    measured."""
    out = []
    if spec.moe is not None and len(spec.moe.sparse_layers) != spec.n_layer:
        out.append(f"dense and sparse layers mixed: {len(spec.moe.sparse_layers)} of {spec.n_layer} sparse")
    if spec.hidden_act not in ("silu", "swish"):
        out.append(f"experts with hidden_act {spec.hidden_act!r}")
    return tuple(out)
