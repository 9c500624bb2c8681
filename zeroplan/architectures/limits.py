"""The bounds of a model's size: every architecture dimension and the parameter count, checked before any
shape is built (docs/limits.md). Below ``zeroplan.types`` (which re-exports them) so that the architecture
readers can check their input without importing the command-line types."""

from __future__ import annotations

MAX_PARAMS = 10**15
"""Largest Ψ (parameters of the whole model, or elements of one tensor): 1e15, some thousand times the
largest model trained so far. It keeps every byte count below 2**63 (at most 64 bytes per parameter:
20 of model states, 2 x 4 sent by an fp32 all-reduce, ...), so numpy int64 sweeps stay exact."""
MAX_LAYERS = 256
"""Most decoder layers of an architecture (``num_hidden_layers``, ``n_layer``). Real models have fewer
than 200 (GPT-3 96, Llama 3.1 405B 126); the bound keeps the worst case of every command bounded: the
engines' step walks are about quadratic in the layer count (docs/limits.md quotes the seconds)."""
MAX_WIDTH = 2**20
"""Widest dimension of an architecture (hidden, MLP/intermediate, head_dim, low-rank and expert widths):
1,048,576, some fifty times the widest model trained (18,432)."""
MAX_HEADS = 2**14
"""Most attention (or key/value) heads: 16,384 (models use at most a few hundred)."""
MAX_VOCAB = 2**24
"""Largest vocabulary: 16,777,216 tokens (real ones are at most about 256k)."""
MAX_EXPERTS = 2**12
"""Most experts of a mixture-of-experts layer, routed or shared, and experts per token: 4096 (real: <= 384)."""
DIMENSION_LIMITS: dict[str, int] = {
    **dict.fromkeys(("n_layer", "num_hidden_layers", "max_window_layers", "first_k_dense_replace",
                     "decoder_sparse_step"), MAX_LAYERS),
    **dict.fromkeys(("n_head", "num_attention_heads", "n_kv_head", "num_key_value_heads"), MAX_HEADS),
    **dict.fromkeys(("vocab_size",), MAX_VOCAB),
    **dict.fromkeys(("max_seq_len", "n_positions", "max_position_embeddings", "sliding_window",
                     "original_max_position_embeddings"), 2**24),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts",
                     "num_experts_per_tok", "n_group", "topk_group"), MAX_EXPERTS),
}  # fmt: skip
"""Bound of each architecture dimension by its name (Hugging Face key or ``TransformerSpec`` field); any
other whole-number dimension (hidden, intermediate, head_dim, ...) is bounded by ``MAX_WIDTH``. One
table for the config reader (``zeroplan.architectures.hf_config``) and ``TransformerSpec``, checked before
any shape is built."""


def dimension_limit(name: str) -> int:
    """The largest value the architecture dimension ``name`` may take (``DIMENSION_LIMITS``)."""
    return DIMENSION_LIMITS.get(name, MAX_WIDTH)


def check_dimensions(values: dict[str, object], source: str = "") -> None:
    """ValueError (one line, naming the dimension, its value and its bound) for a whole-number dimension
    above ``dimension_limit``; None and non-integers are left to the caller's own checks."""
    for name, v in values.items():
        if isinstance(v, int) and not isinstance(v, bool) and v > dimension_limit(name):
            prefix = f"{source}: " if source else ""
            raise ValueError(f"{prefix}{name}={show(v)}: above the limit of {dimension_limit(name):,} "
                             "(docs/limits.md)")


def _is_bool(v: object) -> bool:
    return isinstance(v, bool) or type(v).__name__ == "bool_"  # numpy's bool is no int subclass


def show(v: object) -> str:
    """``v`` for a message, short: a 400-digit integer is shown by its first digits and its length."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**24:
        if v.bit_length() > 14_000:  # about 4200 digits: str() refuses ints of more than 4300
            return f"{'-' if v < 0 else ''}2**{v.bit_length() - 1}..."
        digits = str(abs(v))
        return f"{'-' if v < 0 else ''}{digits[:6]}...({len(digits)} digits)"
    text = str(v)
    return text if len(text) <= 40 else f"{text[:37]}..."


def check_total(numels: tuple[int, ...], what: str = "tensor_numels") -> None:
    """ValueError when the tensors together exceed ``MAX_PARAMS`` elements."""
    total = sum(numels)
    if total > MAX_PARAMS:
        raise ValueError(f"{what}: {show(total)} elements in all, above {MAX_PARAMS:.0e}")
