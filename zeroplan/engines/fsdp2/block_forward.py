"""A decoder layer's forward at its peak, as a moment of one FSDP2 run: the last layer's (``moments.forward_moments``)
and, under torchtitan's layer selective checkpointing (``selective_ac.py``), a checkpointed layer's before it."""

from __future__ import annotations

from zeroplan.engines.fsdp2.terms import Fsdp2Run, _act, _blocks_saved, ag_output, kept_blocks, unsharded
from zeroplan.formulas.peak import Moment, Term


def block_forward(run: Fsdp2Run, j: int, base: tuple[Term, ...], held: str) -> Moment:
    """Block ``j``'s forward at its peak: the blocks before it kept, its saved set and its output (or, checkpointed,
    its no-grad working set beside its input), its all-gather output and unsharded parameters."""
    blk = run.acts.layer_blocks[j - 1] if run.acts.layer_blocks else run.acts.block
    if run.ac_op:  # the per-op policy: its no-grad working set with the outputs it caches (selective_ac.py)
        work = (_blocks_saved(run, j - 1), _act("per-op selective block's working set (cached outputs kept)",
                                                 blk.ckpt_saved + run.op_forward))
    elif not run.checkpointed(j):
        work = (_blocks_saved(run, j), _act("block output and last op's output", blk.forward_extra, 2))
    else:
        work = (_blocks_saved(run, j - 1), _act("checkpointed block's working set (no grad)", blk.ckpt_forward_peak))
    return Moment("forward", f"block {j} forward", (*base, *kept_blocks(run, j - 1), *work, ag_output(run, j, held),
                                                     unsharded(run, j)))  # fmt: skip


def checkpointed_before_last(run: Fsdp2Run, base: tuple[Term, ...]) -> tuple[Moment, ...]:
    """Layer SAC with the last layer L not checkpointed: the forward of each checkpointed layer j of the last k - 1
    (from 2 on), whose no-grad working set may top layer L's saved set (the layers before j grow by the same
    bytes every k layers, so the last k hold the largest); j holds its all-gather output to block j + 1's copy-out
    (``_fsdp_param_group.py:FSDPParamGroup.wait_for_unshard``), as block L holds its own to the post-forward."""
    L = len(run.units) - 1
    if run.checkpointed(L):
        return ()
    return tuple(block_forward(run, j, base, "freed at the next block's copy-out")
                 for j in range(max(2, L - run.ac_every + 1), L) if run.checkpointed(j))  # fmt: skip
