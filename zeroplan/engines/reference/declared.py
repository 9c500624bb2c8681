"""The reference runtime's declarations beside its functions (``ENGINE``): how its collectives count, and the
validator run's own options (``zeroplan validate``, the bundled runtime; checked by
``validate/engines/reference_run.py``). It has no launcher: its plan is the ZeRO ladder, no engine's
configuration is printed."""

from __future__ import annotations

from zeroplan.engines.declared import RunOption
from zeroplan.types import whole_up_to

COMM_COUNT = ("as the paper counts them (sec. 7: 2Ψ DP/P_os/P_os+g, 3Ψ P_os+g+p)",
              "the paper's count per micro-step (sec. 7: 2Ψ DP/P_os/P_os+g, 3Ψ P_os+g+p) with what runs every "
              "micro-step (ZeRO-2/3 gradient reductions, ZeRO-3 all-gathers) counted {accum} times")
"""How its collective rows count (``Engine.comm_count``): the ZeRO paper's volumes, per step and over G micro-steps."""

MAX_GRAD_ACCUM = 64
"""Micro-steps per optimizer step of a validator run: every micro-batch of every step is made up front."""

RUN_OPTIONS: tuple[RunOption, ...] = (
    RunOption("grad_accum", whole_up_to(MAX_GRAD_ACCUM), 1, shown="grad-accum={value}",
              help=f"micro-steps per optimizer step, 1-{MAX_GRAD_ACCUM}: each runs forward and backward on its own "
              "micro-batch, then one optimizer step"),
    RunOption("amsgrad", bool, False, shown="--amsgrad",
              help="Adam(amsgrad=True), a third fp32 state max_exp_avg_sq (the runtime's and the parity reference's "
              "Adam)"),
)  # fmt: skip
"""``ValidateConfig``'s options of a reference run (the shared fields are every engine's)."""
