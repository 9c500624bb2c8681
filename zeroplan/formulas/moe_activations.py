"""Activations of the routed experts of one sparse layer, as transformers 5.24 computes them.

Routing (``*TopKRouter``/``DeepseekV3TopkRouter``): every token goes to exactly k distinct experts; there
is no capacity factor and no token is dropped, so one layer's experts process S = N·k (token, expert)
rows in all (N = b·s tokens), however the router splits them; one expert gets between 0 and N rows.

What the experts module saves for backward depends on S only, not on the split. Per row, with ``a`` the
activation bytes, ``w`` the routing weights' bytes, d the width and f the expert's width
(``experts.down_proj`` is (E, d, f)); derivatives.yaml per op:

- ``grouped_mm`` (the default: ``PreTrainedModel.get_correct_experts_implementation``;
  ``integrations/moe.py: grouped_mm_experts_forward``): the gathered rows (d, saved by the first
  grouped matmul), its output (2f: SiLU saves the gate half, the product the up half: one storage),
  SiLU's output and the product (f each, the product saved by the second grouped matmul), that
  matmul's output (d) and the sorted routing weight (w) saved by the weighting product, and three
  int64 index tensors (perm // k for the gather, perm for the weights, the inverse permutation):
  a·(2d + 4f) + w + 24 per row, plus the E int32 group offsets.
- ``eager`` (``experts_implementation="eager"``: the loop over experts in ``modeling_mixtral.py`` and
  its kin): the same tensors per expert, plus ``index_add_``'s source (d: the weighted output in the
  activation dtype), and two int64 index tensors from ``torch.where`` instead of three:
  a·(3d + 4f) + w + 16 per row.

The routing weights are fp32 for Mixtral (``softmax(router_logits.float())``) and DeepSeek-V3 (an fp32
router), the activation dtype for Qwen2-MoE and Qwen3-MoE (``.to(router_logits.dtype)``). Measured
exactly with saved-tensor hooks on transformers' own experts modules (tests/test_moe_activations.py).
The router's own saved tensors, the shared experts and the working sets: ``moe_block.py``.
"""

from dataclasses import dataclass
from typing import Optional

from zeroplan.architectures.moe import MoeSpec

#: bytes of a routing weight per family; None: the activation dtype (see the module docstring)
ROUTING_WEIGHT_BYTES: dict[str, Optional[int]] = {
    "mixtral": 4, "deepseek_v3": 4, "qwen2_moe": None, "qwen3_moe": None,
}  # fmt: skip
#: transformers' experts implementations modelled here, the default first
EXPERTS_IMPLEMENTATIONS: tuple[str, ...] = ("grouped_mm", "eager")
INDEX_BYTES = 8  # int64 indices (sort's permutation, torch.where's)
OFFSET_BYTES = 4  # grouped_mm's int32 offsets, one per expert


@dataclass(frozen=True)
class ExpertActivations:
    """The routed experts of one sparse layer, one micro-batch of N tokens."""

    dispatched_rows: int
    """S = N·k: the (token, expert) rows the experts process, whatever the split."""
    rows_per_expert_max: int
    """N: one expert may receive every token (no capacity factor); the mean is S / E."""
    saved_bytes: int
    """what the experts module saves for backward, its input, routing weights and parameters excluded."""


def expert_activations(
    moe: MoeSpec, model_type: str, d_model: int, n_tokens: int, act_bytes: int = 2,
    implementation: str = "grouped_mm",
) -> ExpertActivations:  # fmt: skip
    """Saved bytes of one sparse layer's experts (module docstring); ValueError for what is not modelled."""
    if model_type not in ROUTING_WEIGHT_BYTES:
        raise ValueError(f"model_type={model_type!r}: expected one of {', '.join(ROUTING_WEIGHT_BYTES)}")
    if implementation not in EXPERTS_IMPLEMENTATIONS:
        known = ", ".join(EXPERTS_IMPLEMENTATIONS)
        raise ValueError(f"implementation={implementation!r}: expected one of {known}")
    if n_tokens < 1 or act_bytes < 1:
        raise ValueError(f"n_tokens={n_tokens}, act_bytes={act_bytes}: each must be >= 1")
    a, d, f = act_bytes, d_model, moe.expert_ffn
    w = ROUTING_WEIGHT_BYTES[model_type] or a
    rows = n_tokens * moe.top_k
    if implementation == "grouped_mm":
        saved = rows * (a * (2 * d + 4 * f) + w + 3 * INDEX_BYTES) + moe.n_experts * OFFSET_BYTES
    else:
        saved = rows * (a * (3 * d + 4 * f) + w + 2 * INDEX_BYTES)
    return ExpertActivations(rows, n_tokens, saved)
