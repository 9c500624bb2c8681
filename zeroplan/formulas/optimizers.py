"""Optimizer state per parameter, as element counts with dtypes (K of the ZeRO paper, section 3.1).

The paper's K = 12 for mixed-precision Adam is the fp32 master copy (4) + momentum (4) + variance (4).
Here each optimizer lists its per-parameter states; K follows from them and the master-copy choice, so
no "16" is hard-coded anywhere.
"""

from dataclasses import dataclass

from zeroplan.formulas.dtypes import dtype_bytes
from zeroplan.formulas.sharding import ceil_div

BNB_BLOCK_SIZE = 2048
"""bitsandbytes block-wise 8-bit optimizers keep one fp32 absmax per 2048 elements of each state
(Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022, section 2)."""


@dataclass(frozen=True)
class StateTensor:
    """One optimizer state: ``ceil(n / per_elements)`` elements of ``dtype`` for ``n`` parameters."""

    name: str
    dtype: str
    per_elements: int = 1

    def numel(self, n: int) -> int:
        return ceil_div(n, self.per_elements)

    def bytes(self, n: int) -> int:
        return self.numel(n) * dtype_bytes(self.dtype)


OPTIMIZERS: dict[str, str] = {
    "adam": "Adam (Kingma & Ba 2015): momentum m and variance v per parameter",
    "adamw": "AdamW (Loshchilov & Hutter 2019): same states as Adam",
    "sgd": "SGD without momentum: no state",
    "sgd-momentum": "SGD with momentum: one buffer per parameter",
    "lamb": "LAMB (You et al. 2020): m and v per parameter, as Adam",
    "lion": "Lion (Chen et al. 2023): one momentum buffer per parameter",
    "adafactor": "Adafactor (Shazeer & Stern 2018), beta1=None: factored v of O(rows+cols) per matrix, "
    "not counted per parameter",
    "adam8bit": "8-bit Adam (bitsandbytes): int8 m and v plus one fp32 absmax per 2048 elements each",
}


AMSGRAD_OPTIMIZERS: tuple[str, ...] = ("adam", "adamw")
"""Optimizers with torch's ``amsgrad`` option (``torch/optim/adam.py``, ``adamw.py``; Reddi et al., "On the
Convergence of Adam and Beyond", ICLR 2018)."""


def optimizer_states(optimizer: str, state_dtype: str = "fp32", amsgrad: bool = False) -> tuple[StateTensor, ...]:
    """The per-parameter states of an optimizer; ``state_dtype`` applies where the user may choose it.

    ``amsgrad`` (Adam, AdamW): a third state, the running maximum of v, created like v
    (``state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)`` in torch 2.13
    ``torch/optim/adam.py:Adam._init_group``) and updated in place (``torch.maximum(..., out=)`` per tensor,
    ``torch._foreach_maximum_`` on the foreach path), so it adds a state and no temporary."""
    if amsgrad and optimizer not in AMSGRAD_OPTIMIZERS:
        raise ValueError(f"amsgrad=True with optimizer {optimizer!r}: amsgrad is an option of "
                         f"{', '.join(AMSGRAD_OPTIMIZERS)}")  # fmt: skip
    if optimizer in ("adam", "adamw", "lamb"):
        moments = (StateTensor("Adam m", state_dtype), StateTensor("Adam v", state_dtype))
        return (*moments, StateTensor("Adam max v", state_dtype)) if amsgrad else moments
    if optimizer in ("sgd-momentum", "lion"):
        return (StateTensor("momentum", state_dtype),)
    if optimizer in ("sgd", "adafactor"):
        return ()
    if optimizer == "adam8bit":
        return (
            StateTensor("Adam m", "int8"),
            StateTensor("Adam v", "int8"),
            StateTensor("absmax m", "fp32", BNB_BLOCK_SIZE),
            StateTensor("absmax v", "fp32", BNB_BLOCK_SIZE),
        )
    known = ", ".join(OPTIMIZERS)
    raise ValueError(f"unknown optimizer {optimizer!r}: expected one of {known}")


def optimizer_bytes(states: tuple[StateTensor, ...], master_dtype: str | None, n: int) -> int:
    """Bytes of optimizer state (K·n in the paper) for ``n`` parameters, master copy included."""
    master = n * dtype_bytes(master_dtype) if master_dtype else 0
    return master + sum(s.bytes(n) for s in states)
