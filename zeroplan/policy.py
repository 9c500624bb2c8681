"""The precision policy and the byte convention (bytes per parameter and the paper's K): one home.

Formulas count elements; this policy says which dtype each model state has, and so how many bytes
an element of it takes (``zeroplan.formulas.dtypes``). K (ZeRO paper, section 3.1) is the optimizer's
share: the master copy and the optimizer states, never re-derived by position elsewhere.
"""

from typing import Optional

from pydantic import BaseModel, ConfigDict, field_validator

from zeroplan.formulas.dtypes import dtype_bytes
from zeroplan.formulas.optimizers import OPTIMIZERS, StateTensor, optimizer_states
from zeroplan.types import DType, Flag

ByteRows = tuple[tuple[str, float], ...]
"""(label, bytes per parameter) rows, e.g. (("fp16 params", 2), ("fp16 grads", 2), ("fp32 master", 4))."""


class PrecisionPolicy(BaseModel):
    """Dtypes of the model states and the optimizer; K of the ZeRO paper follows from these.

    The defaults are the paper's mixed-precision Adam: fp16 parameters and gradients, an fp32 master
    copy and fp32 Adam momentum and variance (2 + 2 + 12 bytes per parameter). bf16 costs the same bytes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    param_dtype: DType = "fp16"
    """dtype of the working parameters that forward and backward use."""
    grad_dtype: Optional[DType] = None
    """dtype of gradients and of their reduction; defaults to ``param_dtype``."""
    master_weights: Optional[Flag] = None
    """keep an fp32 master copy in the optimizer; defaults to on when ``param_dtype`` is not fp32."""
    optimizer: str = "adam"
    """one of ``zeroplan.formulas.optimizers.OPTIMIZERS``."""
    optimizer_dtype: DType = "fp32"
    """dtype of optimizer states that have a choice (Adam m and v, SGD momentum)."""

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: str) -> str:
        key = str(v).strip().lower()
        if key not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {v!r}: expected one of {', '.join(OPTIMIZERS)}")
        return key

    @property
    def resolved_grad_dtype(self) -> str:
        return self.grad_dtype or self.param_dtype

    @property
    def master_dtype(self) -> Optional[str]:
        """'fp32' when an fp32 master copy is kept, else None."""
        keep = self.master_weights if self.master_weights is not None else self.param_dtype != "fp32"
        return "fp32" if keep else None

    @property
    def param_bytes(self) -> int:
        return dtype_bytes(self.param_dtype)

    @property
    def grad_bytes(self) -> int:
        return dtype_bytes(self.resolved_grad_dtype)

    @property
    def states(self) -> tuple[StateTensor, ...]:
        """The optimizer's per-parameter states (``zeroplan.formulas.optimizers``)."""
        return optimizer_states(self.optimizer, self.optimizer_dtype)

    def optimizer_rows(self, amsgrad: bool = False) -> ByteRows:
        """The optimizer's rows of the convention: master copy, then each state; ``amsgrad``: an engine's
        ``Settings.amsgrad``, Adam's third state ``max_exp_avg_sq`` (``optimizer_states``)."""
        rows: list[tuple[str, float]] = []
        if self.master_dtype:
            rows.append((f"{self.master_dtype} master", dtype_bytes(self.master_dtype)))
        for s in optimizer_states(self.optimizer, self.optimizer_dtype, amsgrad):
            rows.append((f"{s.dtype} {s.name}", dtype_bytes(s.dtype) / s.per_elements))
        return tuple(rows)

    @property
    def optimizer_bytes_per_param(self) -> ByteRows:
        return self.optimizer_rows()

    def byte_rows(self, amsgrad: bool = False) -> ByteRows:
        """The byte convention, one (label, bytes per parameter) per model state, for printing."""
        return (
            (f"{self.param_dtype} params", self.param_bytes),
            (f"{self.resolved_grad_dtype} grads", self.grad_bytes),
            *self.optimizer_rows(amsgrad),
        )

    @property
    def bytes_per_param(self) -> ByteRows:
        return self.byte_rows()

    def k_of(self, amsgrad: bool = False) -> float:
        """The paper's K: optimizer-state bytes per parameter, master copy included (12 for Adam, 16 with
        amsgrad's third fp32 state)."""
        return sum(b for _, b in self.optimizer_rows(amsgrad))

    @property
    def k(self) -> float:
        return self.k_of()

    def resolved(self) -> dict:
        """The policy with defaults filled in, as JSON outputs report it."""
        return {
            "param_dtype": self.param_dtype,
            "grad_dtype": self.resolved_grad_dtype,
            "master_dtype": self.master_dtype,
            "optimizer": self.optimizer,
            "optimizer_dtype": self.optimizer_dtype,
        }


BF16_MIXED = PrecisionPolicy(param_dtype="bf16")
"""bf16 parameters and gradients, fp32 master copy and Adam states: 16 bytes/param, the paper's K = 12.
The default of ``zeroplan plan`` and of the launcher configs it emits."""
