"""torchtitan's layer selective activation checkpointing as data: which decoder layers are checkpointed.

torchtitan 0.2.2 (github:pytorch/torchtitan tag v0.2.2, ``torchtitan/distributed/activation_checkpoint.py``
``_apply_layer_sac``; the TOML ``[activation_checkpoint] mode = "selective"``, ``selective_ac_option = "k"``) wraps
the layers in order, counting them from 1 with a module-level counter (``_layer_sac_count += 1``), and puts a
layer in ``ptd_checkpoint_wrapper`` (torch ``distributed/algorithms/_checkpoint/checkpoint_wrapper.py``,
non-reentrant ``torch.utils.checkpoint``) when ``_layer_sac_count % k == 0``: layers k, 2k, 3k, ... (1-based) are
checkpointed, the others run as they are. k = 1 is full checkpointing. The FSDP2 engine's setting is
``Settings.selective_ac`` (k) with ``Workload.checkpointing`` "full"; its blocks are numbered 1..L as here.

A checkpointed layer keeps its input (``BlockActivations.ckpt_saved``) to its backward, runs its forward without
saving (``ckpt_forward_peak``) and recomputes its saved set in its backward (``recomputed``); a layer not wrapped
keeps its whole saved set (``saved``) and runs forward and backward as without checkpointing: each term of a block
is the one of its own mode (``zeroplan/formulas/activation_terms.py``).

torchtitan's op policy (``selective_ac_option = "op"``: the outputs of the ops of ``_save_list`` / 0.3.0's
``_get_default_save_ops()`` cached, every second ``aten.mm`` recomputed) is not modelled: ``--torchtitan-config``
refuses it (``zeroplan/integrations/fsdp2_run.py:OP_REFUSAL``).
"""

from __future__ import annotations

SRC = "torchtitan 0.2.2 distributed/activation_checkpoint.py:_apply_layer_sac"



def checkpointed(checkpointing: str, every: int, block: int) -> bool:
    """Whether decoder layer ``block`` (1-based) runs under ``checkpoint_wrapper`` (``_apply_layer_sac``)."""
    return checkpointing != "none" and block % every == 0


def checkpointed_blocks(checkpointing: str, every: int, n: int) -> int:
    """How many of layers 1..n are checkpointed."""
    return 0 if checkpointing == "none" else max(n, 0) // every


def saved_through(acts, checkpointing: str, every: int, n: int) -> int:
    """What layers 1..n keep to their backward: a checkpointed layer its input, the others their saved set
    (``ModelActivations.saved_through`` per mode, each layer its own block's)."""
    if every == 1 or checkpointing == "none":
        return acts.saved_through(n, checkpointing)
    blocks = acts.layer_blocks[:n] if acts.layer_blocks else (acts.block,) * max(n, 0)
    return sum(b.ckpt_saved if checkpointed(checkpointing, every, i) else b.saved for i, b in enumerate(blocks, 1))


def label(checkpointing: str, every: int) -> str:
    """The mode in the engine's words: ``none``, ``full`` or ``every 2nd layer (torchtitan layer SAC)``."""
    if checkpointing == "none" or every == 1:
        return checkpointing
    nth = {2: "2nd", 3: "3rd"}.get(every, f"{every}th")
    return f"every {nth} layer (torchtitan selective_ac_option={every})"
