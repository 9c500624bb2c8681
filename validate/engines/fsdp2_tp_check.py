"""What torchtitan's llama plan holds, asked for ``zeroplan validate --engine fsdp2 --tp T`` before any rank
starts (``validate.config.ValidateConfig``): the plan's own refusals (``zeroplan.engines.fsdp2.tp.check_plan``:
heads, KV heads, FFN, vocabulary or, with SP, the sequence not divisible by T; a family it does not hold)."""

from __future__ import annotations


def check_tp_plan(model: str, tp: int, world_sizes: tuple[int, ...], seq_len: int | None,
                  sequence_parallel: bool) -> None:
    """ValueError (one line) when the plan cannot hold ``model`` at TP degree ``tp`` on any of ``world_sizes``."""
    from validate.models import spec_for
    from zeroplan.engines.fsdp2.tp import check_plan

    spec = spec_for(model, None)
    for n in world_sizes:
        check_plan(spec, tp, n, seq_len or spec.max_seq_len, sequence_parallel)
