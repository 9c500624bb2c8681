"""What every engine profile answers, so the planner and the validator never ask which engine it is.

An engine (the bundled reference runtime, PyTorch FSDP2, DeepSpeed ZeRO) is one module in
``zeroplan/engines/`` that turns a ``Workload`` (what is trained) and its own settings (in the engine's
vocabulary: a ZeRO stage, ``reshard_after_forward``, a ``ds_config.json``) into ``EngineEstimate`` rows:
model states, the peak per phase (``zeroplan.formulas.peak``: moments of named terms, each citing the
engine file and function it comes from) and the collectives of one optimizer step. ``ENGINES`` in
``zeroplan.engines`` maps the ``--engine`` name to that module's ``estimate`` function.

Contract of an engine module ``zeroplan/engines/<name>.py``:

- ``Settings``: a pydantic model of the engine's options (``extra="forbid"``), with the engine's
  defaults (and the engine version they come from).
- ``estimate(workload: Workload, nd: int, settings: Settings) -> tuple[EngineEstimate, ...]``: one row
  per configuration the settings describe (the reference engine: one per requested ZeRO stage; FSDP2
  and DeepSpeed: the one sharding the settings select). Pure: numbers in, frozen records out.

The validator side of an engine lives in ``validate/engines/<name>.py`` (the real engine under the
shared probes); it compares its measurements with this module's ``estimate`` row by row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from zeroplan.architectures.spec import Shape, TransformerSpec
from zeroplan.formulas.collectives import Collective
from zeroplan.formulas.memory import MemoryBreakdown
from zeroplan.formulas.peak import PeakEstimate

Checkpointing = Literal["none", "full"]


@dataclass(frozen=True)
class Workload:
    """What is trained, whatever the engine: the parameters and, with an architecture, one micro-step.

    ``spec`` is None for a bare list of tensors (``--params`` or ``--shapes``): model states and
    collectives are still exact, but activations, and so the peak, need an architecture.
    """

    shapes: tuple[tuple[str, Shape], ...]
    """every parameter as (name, shape), in ``named_parameters()`` order (``transformer_shapes(spec)``)."""
    spec: Optional[TransformerSpec] = None
    seq_len: int = 1
    """tokens per sequence."""
    micro_batch: int = 1
    """sequences per rank per micro-step."""
    checkpointing: Checkpointing = "none"
    """``full``: every decoder layer recomputed in backward (``torch.utils.checkpoint`` per block)."""
    grad_accum: int = 1
    """micro-steps per optimizer step."""
    foreach: bool = False
    """the optimizer's multi-tensor (``foreach``) path; torch's default is True on CUDA, False on CPU."""


@dataclass(frozen=True)
class EngineEstimate:
    """One engine configuration on one rank: model states, the peak per phase, one step's collectives."""

    engine: str
    """the ``--engine`` name: reference, fsdp2, deepspeed."""
    label: str
    """what runs, in the engine's words: ``ZeRO-3``, ``fully_shard reshard_after_forward=True``."""
    stage: Optional[int]
    """the ZeRO stage it corresponds to (0-3; FSDP2 full sharding is 3), for tables and comparisons."""
    memory: MemoryBreakdown
    """model states one rank holds between steps."""
    peak: Optional[PeakEstimate]
    """the peak per phase; None without an architecture (``Workload.spec`` is None)."""
    collectives: tuple[Collective, ...]
    """what one rank issues in one optimizer step, with the engine's sizes, dtypes and phases."""

    @property
    def model_states_bytes(self) -> int:
        return self.memory.model_states_bytes
