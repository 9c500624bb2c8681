"""How far the runtime may drift from the single-process reference: derived, not fixed.

The runtime and the reference compute the same mathematics in a 16-bit dtype with unit roundoff
``u`` (half the gap between 1 and the next number: bf16 2^-8, fp16 2^-11; Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., section 2.1). They differ only in where they round:

Gradients. Rank r computes its local gradient g_r in 16 bits (one rounding), divides it by N_d (one
more) and the collective sums N_d such terms in 16 bits, in some order (N_d - 1 roundings). Higham's
bound for a recursive sum (eq. 4.4) gives |error| <= gamma_n * sum_r |g_r| / N_d with
gamma_n = n u / (1 - n u) and n = N_d + 1 roundings per term; the reference rounds its own global
gradient once more: n = N_d + 2 in all. In the 2-norm, sum_r |g_r| / N_d exceeds the mean gradient by
at most sqrt(N_d) when the ranks' gradients are independent (their mean shrinks as 1/sqrt(N_d) while
each term does not), so

    ||g_runtime - g_ref|| <= grad_rtol * ||g_ref||,   grad_rtol = gamma_{N_d + 2} * sqrt(N_d) * C_path.

C_path covers what the sum bound does not: the backward pass of a batch of b samples rounds its
intermediate 16-bit activations differently from a batch of N_d b samples, and after k steps the
gradient is taken at parameters that have drifted apart as below. ``PATH_FACTOR`` = 2 is set from
measurements (torch 2.13, CPU, bf16): the largest ratio ||error|| / (gamma * sqrt(N_d) * ||g||) seen
was 0.48 (gpt-tiny, N_d = 2, 63 steps), 0.29 for a 13.9M-parameter GPT (``--params 2e6``, N_d = 2, 3
steps), so the allowance has 4x headroom. A wrong shard, a missing reduction or a gradient not divided
by N_d is off by O(||g||), 1 / grad_rtol (>= 5 for N_d <= 4) times more.

Parameters. Adam moves a parameter by at most A lr per step, A = (1 - beta1) / sqrt(1 - beta2) when
that exceeds 1 (Kingma & Ba 2015, section 2.1; 3.16 for torch's defaults), so two runs whose updates
point in opposite directions at every step (a near-zero gradient whose sign flips under rounding) end
at most 2 A lr k apart after k steps: ``param_max_atol``. On average an update of size ~lr changes by
the relative error of the gradient that drives it, so the mean difference grows at most linearly in
the step count: ``param_mean_atol`` = lr k grad_rtol (measured: 0.0017 lr k at 63 steps against
0.045 lr k allowed). A skipped or doubled update moves the mean by about lr per step, 1 / grad_rtol
times more than this allowance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}  # 2^-(mantissa bits + 1)
ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults, which the runtime and the reference use
PATH_FACTOR = 2.0  # measured headroom for the batch-size-dependent rounding of the backward pass


@dataclass(frozen=True)
class ParityTolerance:
    """Allowances of the parity check (gradients relative, norm-wise; parameters absolute)."""

    u: float
    gamma: float
    grad_rtol: float
    adam_max_step_lr: float
    param_mean_atol: float
    param_max_atol: float


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n roundings (section 3.1)."""
    return n * u / (1 - n * u)


def parity_tolerance(dtype: str, nd: int, steps: int, lr: float) -> ParityTolerance:
    """The allowances for ``steps`` Adam steps at learning rate ``lr`` over ``nd`` ranks in ``dtype``."""
    u = UNIT_ROUNDOFF[dtype]
    g = gamma(nd + 2, u)
    grad_rtol = g * math.sqrt(nd) * PATH_FACTOR
    b1, b2 = ADAM_BETAS
    a = max(1.0, (1 - b1) / math.sqrt(1 - b2))
    return ParityTolerance(
        u=u,
        gamma=g,
        grad_rtol=grad_rtol,
        adam_max_step_lr=a,
        param_mean_atol=lr * steps * grad_rtol,
        param_max_atol=2 * a * lr * steps,
    )
