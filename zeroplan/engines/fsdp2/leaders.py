"""Which FSDP2 moment of each phase ``peak_of`` picks, found without summing every moment of every rank (a
speed-up, no rule: ``predict_peak`` equals ``peak_of(moments(run))`` for every run, tests/test_fsdp2_memo.py).

Three shortcuts, each exact:

- ``phase_leaders``: each distinct term object rounded once, each moment summed in C;
- ``sampled_blocks``: with identical decoder layers, block i's backward moments grow or shrink by the same
  bytes from one block to the next (every term that depends on i is i or L - i copies of one block's term), so
  over the blocks away from the edges the largest of each kind is at the first or the last of them;
- ``rank_leaders``: the ranks of one run differ only in Adam's states, a term every forward and backward
  moment holds once (``Fsdp2Run.for_rank``), so those two phases' leaders are shared.

And ``step_moments`` takes the init, forward and optimizer-step moments a run has built already (``fit_floor``
reads them before the backward's) rather than building them again.
"""

from __future__ import annotations

import operator
from itertools import repeat

from zeroplan.engines.fsdp2.mesh import holds_allreduce, with_allreduce_held
from zeroplan.engines.fsdp2.moments import NOT_BUILT, backward_moments, forward_moments, init_moments, moments
from zeroplan.engines.fsdp2.optimizer_step import optimizer_moments
from zeroplan.engines.fsdp2.side import head_units
from zeroplan.engines.fsdp2.terms import Fsdp2Run, adam
from zeroplan.formulas.cuda_workspaces import library_workspaces
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES, Moment, PeakEstimate, peak_of, rounded_total

STEP_PHASES = ("forward", "backward")
STEP_LEADERS = "step_leaders"
"""``run.memo`` key of the forward and backward leaders and the Adam term they hold (``rank_leaders``)."""
OUTSIDE_BACKWARD = "outside_backward"
"""``run.memo`` key of a run's init, forward or optimizer-step moments (``outside_backward``; in ``memo.RANKED``:
each holds the rank's Adam states)."""
SECTIONS = {"init": init_moments, "forward": forward_moments, "optimizer_step": optimizer_moments}
EDGE = 3
"""Blocks 1..EDGE-1 and L are edges: block 1 holds no prefetch and its moments (and block 2's prefetch of
block 1, named "block 1 ...") take the embeddings' regather (``moments.backward_moments``); block L holds no
previous reduce-scatter input. The interior, EDGE..L-1, changes by the same bytes per block."""


def sampled_blocks(run: Fsdp2Run) -> tuple[int, ...] | None:
    """The blocks whose backward moments hold each phase's first largest total, last first (the order of
    ``backward_moments``): the edges and the interior's two ends. None (every block) unless the decoder layers
    are identical. HSDP's held all-reduce buffers (``mesh.with_allreduce_held``) are one term of every unit
    reduced so far (``moments`` walks the blocks not built for them), its tensors rounded alike only when they
    are all blocks': None with units reduced before the blocks (``side.head_units``)."""
    L = len(run.units) - 1
    shapes = run.units[1].shapes if L >= 1 else ()
    if L <= EDGE + 1 or (holds_allreduce(run) and head_units(run)) or any(u.shapes != shapes for u in run.units[2:]):
        return None
    # layer SAC (selective_ac.py): a block's moments depend on i mod k too; over each residue class they still change
    # by the same bytes per k blocks, so the interior's first and last k blocks hold its largest
    k = run.ac_every if run.checkpointing != "none" else 1
    ends = {*range(EDGE, min(EDGE + k, L)), *range(max(L - k, EDGE), L)}
    return tuple(sorted({L, *ends, *range(EDGE, 0, -1)}, reverse=True))


def phase_leaders(moments: tuple[Moment, ...], block_bytes: int) -> tuple[Moment, ...]:
    """The moments ``peak_of`` can choose, in order: of each phase the first with the largest total (its
    choice; terms it adds to every moment of a phase change no order). Each moment's total is ``rounded_total`` of
    its terms: at 1 B and at CUDA's 512 B blocks a sum in C of a value each term holds (``Term``'s bytes, its
    ``CUDA_BLOCK_BYTES`` blocks), so no term is rounded in Python here (a speed-up, no rule)."""
    best: dict[str, tuple[int, Moment]] = {}
    for m in moments:
        total = rounded_total(m.terms, block_bytes)
        if m.phase not in best or total > best[m.phase][0]:
            best[m.phase] = (total, m)
    keep = {id(m) for _, m in best.values()}
    return tuple(m for m in moments if id(m) in keep)


def rank_leaders(run: Fsdp2Run, block_bytes: int) -> tuple[Moment, ...]:
    """``phase_leaders(moments(run), block_bytes)``. A run made by ``for_rank`` (which keeps ``STEP_LEADERS`` in
    its memo) takes the first rank's forward and backward leaders with its own Adam term in their place and
    builds only its init and optimizer moments; a profile where some moment lacks Adam (or holds it twice)
    shares nothing."""
    shared = run.memo.get((STEP_LEADERS, block_bytes))
    if shared is not None:
        first_adam, step = shared
        own = adam(run)
        step = tuple(Moment(m.phase, m.name, tuple(own if t is first_adam else t for t in m.terms)) for m in step)
        return phase_leaders((*init_moments(run), *step, *optimizer_moments(run)), block_bytes)
    some = step_moments(run, sampled_blocks(run))
    leaders = phase_leaders(some, block_bytes)
    held = adam(run)
    if all(sum(map(operator.is_, m.terms, repeat(held))) == 1 for m in some if m.phase in STEP_PHASES):
        run.memo[STEP_LEADERS, block_bytes] = (held, tuple(m for m in leaders if m.phase in STEP_PHASES))
    return leaders


def outside_backward(run: Fsdp2Run, phase: str) -> tuple[Moment, ...]:
    """``run``'s moments of ``phase`` (init, forward or optimizer_step: ``SECTIONS``), built once per run (a
    speed-up, no rule: the same moments; ``fit_floor`` reads them first)."""
    got = run.memo.get((OUTSIDE_BACKWARD, phase))
    if got is None:
        got = run.memo[OUTSIDE_BACKWARD, phase] = SECTIONS[phase](run)
    return got


def step_moments(run: Fsdp2Run, blocks: tuple[int, ...] | None) -> tuple[Moment, ...]:
    """``moments(run, blocks)`` as ``moments.moments`` composes them, with the init, forward and optimizer-step
    moments of ``outside_backward`` (a speed-up, no rule, tests/test_fsdp2_fit_floor.py; ``moments`` itself under
    ``CPUOffloadPolicy``, which rewrites every moment)."""
    if run.settings.offload_policy != "none" or run.acts is None:
        return moments(run, blocks)
    backward = with_allreduce_held(run, backward_moments(run, blocks), NOT_BUILT if blocks is not None else None)
    return (*outside_backward(run, "init"), *outside_backward(run, "forward"), *backward,
            *outside_backward(run, "optimizer_step"))  # fmt: skip


def peak_rounding(run: Fsdp2Run) -> tuple[int, tuple]:
    """(the block every term is rounded to, the terms resident in every phase after init) of ``run``'s peak: CUDA
    rounds every block to 512 bytes (``peak.CUDA_BLOCK_BYTES``) and keeps the cuBLAS / cuBLASLt workspaces from
    the first backward on (``formulas.cuda_workspaces``); on CPU neither."""
    if run.settings.device != "cuda":
        return 1, ()
    return CUDA_BLOCK_BYTES, (library_workspaces(run.settings.cuda_capability, run.biased_linear),)


def predict_peak(run: Fsdp2Run) -> PeakEstimate:
    """The peak of ``run`` per phase, rounded as ``peak_rounding`` says."""
    block, resident = peak_rounding(run)
    return peak_of(rank_leaders(run, block), block, resident=resident)
