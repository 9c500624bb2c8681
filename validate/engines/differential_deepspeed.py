"""Generator 4 of the randomized differential matrix (validate/engines/differential.py): DeepSpeed's own
settings the first three generators leave alone, drawn from a fourth stream of the same seed so that generator
3's draw (the model, the step, the world, the ds_config) is unchanged.

- activation checkpointing on about half the draws: transformers' own (``gradient_checkpointing_enable()``,
  every decoder layer a ``GradientCheckpointingLayer``, torch.utils.checkpoint non-reentrant;
  ``validate.engines.deepspeed.hf_builder(checkpointing="full")``), predicted as the engine's
  ``checkpointing="full"``;
- bf16 (``{"bf16": {"enabled": true}}``) on more draws where it is cheap: a draw of at most ``BF16_CHEAP_PSI``
  parameters that generator 1 left in fp32 turns bf16 with probability ``BF16_CHEAP_SHARE``, so about a third
  of the small draws are bf16 (0.1 + 0.9 x 0.25 = 0.325); larger draws keep generator 1's 10% (bf16 is about
  20x slower than fp32 on CPU).
"""

from __future__ import annotations

import random
from dataclasses import replace

CHECKPOINTING_SHARE = 0.5
"""the share of DeepSpeed draws trained with transformers' gradient checkpointing."""
BF16_CHEAP_PSI = 12_000_000
"""parameters at most of a draw on which bf16 is cheap enough to draw more often."""
BF16_CHEAP_SHARE = 0.25
"""the probability that such a draw, fp32 by generator 1, turns bf16."""


def generator_4(d):
    """``d`` (a ``differential.Draw``) with generator 4's DeepSpeed settings; an FSDP2 draw is unchanged."""
    if d.engine != "deepspeed":
        return d
    rng = random.Random(f"zeroplan-differential-{d.seed}-{d.index}-generator-4")
    checkpointing = rng.random() < CHECKPOINTING_SHARE
    bf16 = rng.random() < BF16_CHEAP_SHARE and d.psi <= BF16_CHEAP_PSI  # both drawn always: a stable stream
    ds = d.ds_config if not bf16 or "bf16" in d.ds_config else {**d.ds_config, "bf16": {"enabled": True}}
    return replace(d, ds_config=ds, checkpointing="full" if checkpointing else "none")
