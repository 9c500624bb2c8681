"""The batch a ``ds_config.json`` trains, derived as DeepSpeed 0.19.8 derives it (``runtime/config.py``
``DeepSpeedConfig._set_batch_related_parameters``), and how it meets the command line's batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zeroplan.engines.deepspeed.config import parse_ds_config

@dataclass(frozen=True)
class DsBatch:
    """The batch a ds_config trains per rank: ``micro_batch`` sequences per micro-step, ``grad_accum``
    micro-steps per optimizer step (DeepSpeed's ``train_micro_batch_size_per_gpu`` and
    ``gradient_accumulation_steps`` after it has derived the missing ones)."""

    micro_batch: int
    grad_accum: int


def ds_batch(config: object, nd: Optional[int]) -> Optional[DsBatch]:
    """The batch DeepSpeed derives from a ds_config at ``nd`` data-parallel ranks (``runtime/config.py``
    ``DeepSpeedConfig._set_batch_related_parameters`` then ``_batch_assertion``); None when the file has no
    batch key (a fragment: the command line's batch applies). ValueError, one line, where DeepSpeed would
    refuse the file, or where the batch depends on N_d (``train_batch_size``) and ``nd`` is None (a
    command that varies N_d)."""
    ds = parse_ds_config(config)
    tb, mb, ga = ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps
    if tb is None and mb is None:
        if ga is None:
            return None
        raise ValueError("deepspeed config: gradient_accumulation_steps without train_batch_size or "
                         "train_micro_batch_size_per_gpu: DeepSpeed needs one of them")  # fmt: skip
    if tb is not None and nd is None:
        raise ValueError(f"deepspeed config: train_batch_size={tb} fixes the micro-batch for one N_d only, and "
                         "this command varies N_d: give train_micro_batch_size_per_gpu (and "
                         "gradient_accumulation_steps) instead")  # fmt: skip
    if tb is not None and mb is not None and ga is None:
        ga = tb // mb // nd
    elif tb is not None and ga is not None and mb is None:
        mb = tb // nd // ga
    elif tb is not None and mb is None:
        mb, ga = tb // nd, 1
    ga = ga or 1
    if mb < 1 or ga < 1 or (tb is not None and tb != mb * ga * nd):
        raise ValueError(f"deepspeed config: train_batch_size={tb} is not train_micro_batch_size_per_gpu x "
                         f"gradient_accumulation_steps x N_d = {mb} x {ga} x {nd}: DeepSpeed refuses it")  # fmt: skip
    return DsBatch(micro_batch=mb, grad_accum=ga)


def run_batch(config: Optional[dict], nd: Optional[int], micro_batch: Optional[int], grad_accum: Optional[int],
              names: tuple[str, str] = ("micro_batch", "grad_accum")) -> DsBatch:
    """The batch of the run: the ds_config's (``ds_batch``) where it sets one, else ``micro_batch`` and
    ``grad_accum`` (1 where None). A given value must agree with the file, one left None yields to it:
    which one the user meant is not ours to guess. ``names``: how the caller spells the two."""
    batch = ds_batch(config, nd) if config is not None else None
    if batch is None:
        return DsBatch(micro_batch or 1, grad_accum or 1)
    keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for name, key, given, value in zip(names, keys, (micro_batch, grad_accum), (batch.micro_batch, batch.grad_accum)):
        if given is not None and given != value:
            at = f" at N_d = {nd}" if nd is not None else ""
            raise ValueError(f"{name} {given} contradicts the DeepSpeed config, whose {key} is {value}{at}; "
                             "drop one of them")
    return batch


def planner_batch(config: Optional[dict], nd: Optional[int], micro_batch: Optional[int], grad_accum: Optional[int],
                  names: tuple[str, str] = ("micro_batch", "grad_accum")) -> tuple[int, int]:
    """``Engine.batch``: ``run_batch`` as (micro-batch, accumulation)."""
    batch = run_batch(config, nd, micro_batch, grad_accum, names)
    return batch.micro_batch, batch.grad_accum


def sweep_micro_batches(config: Optional[dict], gpus: tuple[int, ...], model_parallel: tuple[int, ...],
                        micro_batches: Optional[tuple[int, ...]], name: str = "micro_batch") -> Optional[tuple[int, ...]]:
    """``sweep``'s micro-batches over the grid's N_d = gpus / model_parallel (pairs that divide): (the file's,)
    where the ds_config sets the batch (``run_batch``; ``train_batch_size`` only when every row has the same
    N_d), None where it does not (``micro_batches`` stand, None: given none). ValueError for several given, a
    contradiction, or a file that accumulates (a sweep row is one micro-step per step)."""
    nds = {g // m for g in gpus for m in model_parallel if g % m == 0}
    nd = next(iter(nds)) if len(nds) == 1 else None
    if config is None or ds_batch(config, nd) is None:
        return None
    if micro_batches is not None and len(micro_batches) > 1:
        raise ValueError(f"{name} lists several values and the DeepSpeed config sets the batch; drop one")
    batch = run_batch(config, nd, micro_batches[0] if micro_batches else None, None, names=(name, ""))
    if batch.grad_accum != 1:
        raise ValueError(f"the DeepSpeed config accumulates {batch.grad_accum} micro-steps per step and a sweep row "
                         "is one: use estimate or plan (grad_accum)")  # fmt: skip
    return (batch.micro_batch,)
