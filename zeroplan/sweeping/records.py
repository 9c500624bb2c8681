"""The row of a sweep: one configuration, stage and offload. Its fields are the sweep's columns."""

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class SweepRow(BaseModel):
    """One configuration, stage and offload of a sweep (also the CSV columns, in this order).

    The configuration, then the keys of ``estimate --json`` ``stages[]`` with the collectives summarised
    (``zeroplan.sweeping.grid.collectives_summary``), then where offloaded states live and the host
    traffic per step (``zeroplan.formulas.offload``; a one-row engine's own offload: its ``HostMemory``,
    ``zeroplan.sweeping.host``; 0 without offload). With offload, the memory columns
    are what stays in GPU memory. With a reference ``model``, activations per GPU for each micro-batch
    (``zeroplan.formulas.activations``), ``total_bytes`` = GPU model states + activations and
    ``total_fits``; these are empty without a model or where no estimate exists. With ``model``, also the
    peak per GPU of a training step on the engine (``zeroplan.engines``), its phase, ``peak_fits``, the
    rank it is on, and the allocator's reserved bytes (``zeroplan.allocator.reserved``, replayed only where a
    peak is) with ``reserved_fits``: what runs out. Every ``*fits`` compares with (1 - headroom) x GPU memory.
    """

    # defer_build: the validator is built at the first row (``sweep``), not by every command that imports the
    # schemas (``plan --json``); no ``from __future__ import annotations``: pydantic would re-read each string
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    params: int
    gpus: int
    model_parallel: int
    nd: int
    psi: int
    micro_batch: int
    stage: int
    name: str
    offload: str
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    model_states_bytes: int
    reduction_vs_dp: Optional[float] = Field(description="null when nothing stays on the GPU")
    fits: Optional[bool]
    comm_volume_elements: int
    comm_bytes_per_rank: int
    collectives: str
    host_bytes: int
    nvme_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    activation_bytes: Optional[int]
    total_bytes: Optional[int]
    total_fits: Optional[bool]
    peak_bytes: Optional[int] = Field(description="the engine's peak per GPU (docs/peak.md); null without "
                                      "--model, with offload, N_m > 1 or selective checkpointing")  # fmt: skip
    peak_phase: Optional[str] = Field(description="the phase the peak falls in; null where peak_bytes is")
    peak_fits: Optional[bool] = Field(description="peak_bytes <= (1 - headroom) x GPU memory; null without either")
    peak_rank: Optional[int] = Field(description="the rank whose peak peak_bytes is, the largest of ranks whose "
                                     "shards differ (EngineEstimate.peak_rank); null where every rank is alike or "
                                     "there is no peak")  # fmt: skip
    reserved_bytes: Optional[int] = Field(description="the caching allocator's reserved bytes per GPU: the engine's "
                                          "allocation trace replayed under alloc_conf (docs/allocator.md); null "
                                          "where peak_bytes is")  # fmt: skip
    reserved_fits: Optional[bool] = Field(description="reserved_bytes <= (1 - headroom) x GPU memory: fits on what "
                                          "runs out; null without either")  # fmt: skip
