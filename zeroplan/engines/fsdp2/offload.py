"""FSDP2's ``CPUOffloadPolicy`` on the engine profile (torch 2.13, ``torch/distributed/fsdp/_fully_shard/``):
what stays on the GPU, what one rank keeps on the host, and a step's PCIe traffic.

``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=...))``: the sharded parameters live on the host
(``_fsdp_param.py FSDPParam._init_sharded_param``: ``padded_sharded_param.pin_memory()`` with ``pin_memory``;
``_fsdp_param_group.py _validate_cpu_offload_params``: the model is materialized on the CPU, so init allocates
nothing on the GPU), and so do the sharded gradients (``_fsdp_collectives.py foreach_reduce``:
``new_sharded_grad.to(torch.device("cpu"), non_blocking=pin_memory)``, into pinned memory when non-blocking) and
the optimizer, which steps on the host tensors (Adam's m, v, step and its temporaries: ``torch/optim/adam.py``).
On the GPU: each all-gather's input, the unit's shards copied up (``FSDPParam.all_gather_inputs``:
``sharded_param_data.to(self.device, non_blocking=True)``), then the copy-in, the gathered unit, activations and
the reduce-scatter buffers, as without offload (``moments.py``).

The all-gather input is counted as the largest unit's shards, beside every forward and backward moment that
gathers (a bound: the unit gathered there is at most the largest). On a CPU-only run ``device="cpu"`` there is
one memory: a measurement sees the sum of the GPU and host predictions.
"""

from __future__ import annotations

from zeroplan.engines.fsdp2.settings import ADAM, SRC
from zeroplan.engines.fsdp2.terms import Fsdp2Run, adam, resharded
from zeroplan.formulas.offload import HostMemory, Offload
from zeroplan.formulas.peak import Moment, Term

ON_HOST = ("sharded parameters (module dtype, padded)", "sharded gradients of", "Adam exp_avg, exp_avg_sq, step",
           "Adam temporaries", "the unpadded shard being re-padded", "unsharded units as built",
           "shards of the units sharded before", "this unit's new shard")  # fmt: skip
"""Terms of ``moments.py`` that ``CPUOffloadPolicy`` puts on the host (init builds on the CPU)."""
GATHERS = ("all-gather copy-in", "all-gather output", "unsharded parameters")
FULL_OFFLOAD = Offload("cpu", "cpu")
"""FSDP2 offloads parameters, gradients and the optimizer step together."""


def offloads(run: Fsdp2Run) -> bool:
    return run.settings.offload_policy == "cpu"


def _fetch(run: Fsdp2Run) -> Term:
    largest = max((run.shard(u) for u in range(len(run.units))), default=0)
    return Term("offloaded shards copied to the GPU for the all-gather (largest unit)", largest * run.m,
                SRC + "_fsdp_param.py:FSDPParam.all_gather_inputs (sharded_param_data.to(device))")  # fmt: skip


def offload_moments(run: Fsdp2Run, moments: tuple[Moment, ...]) -> tuple[Moment, ...]:
    """``moments`` on the GPU under ``CPUOffloadPolicy``: without the host's terms (``ON_HOST``), with the
    all-gather input copied up beside each moment that gathers."""
    if not offloads(run):
        return moments
    fetch, out = _fetch(run), []
    for m in moments:
        terms = tuple(t for t in m.terms if not t.name.startswith(ON_HOST))
        if m.phase in ("forward", "backward") and any(t.name.startswith(GATHERS) for t in terms):
            terms = (*terms, fetch)
        out.append(Moment(m.phase, m.name, terms))
    return tuple(out)


def init_peak(init: tuple[Moment, ...]) -> tuple[Term, ...]:
    """The host's terms (``ON_HOST``) of the init moment ``init`` (``moments.init_moments``) that holds most of them.
    Materialized: the units not yet sharded whole on the CPU beside the shards made so far (4Ψ plus shards at the
    first ``fully_shard``, above the steady 16Ψ/N_d from N_d = 4 on; measured by offload2 on gpt-tiny fp32 gloo,
    N_d = 2: 177,336 B, docs/engines/fsdp2.md); meta: the padded shards and one re-padding copy, below it."""
    held = [tuple(t for t in m.terms if t.name.startswith(ON_HOST)) for m in init]
    return max(held, key=lambda ts: sum(t.bytes for t in ts), default=())


def host_memory(run: Fsdp2Run, step: tuple[Moment, ...], grad_accum: int = 1,
                init: tuple[Moment, ...] = ()) -> HostMemory:
    """One rank's host memory under ``CPUOffloadPolicy`` (Adam's temporaries as the optimizer step's moments
    ``step``, ``optimizer_step.optimizer_moments``, count them, on the host tensors), its init peak (``init_peak`` of the
    init moments ``init``), and one step's PCIe traffic: each unit's shards
    up for its forward all-gather and, resharded, again for backward; the gradient shards down, every
    micro-step (``grad_accum``)."""
    pinned = " (pinned)" if run.settings.pin_memory else ""
    by_name = {t.name: t for m in step for t in m.terms}
    shard_bytes = sum(run.shard(u) for u in range(len(run.units))) * run.m
    temps = max((t for t in by_name.values() if t.name.startswith("Adam temporaries")), key=lambda t: t.bytes,
                default=None)  # fmt: skip
    terms = (Term(f"sharded parameters{pinned}", shard_bytes, SRC + "_fsdp_param.py:FSDPParam._init_sharded_param"),
             Term(f"sharded gradients{pinned}", shard_bytes, SRC + "_fsdp_collectives.py:foreach_reduce (.to(cpu))"),
             adam(run), *((Term(f"{temps.name}, on the host", temps.bytes, f"{ADAM} (CPU tensors)", temps.tensors),)
                          if temps is not None else ()))  # fmt: skip
    g = max(grad_accum, 1)
    lazy = tuple(t.name for t in terms[1:])  # gradients from the first backward, Adam's from the first step
    return HostMemory(FULL_OFFLOAD, terms, shard_bytes * (2 if resharded(run) else 1) * g, shard_bytes * g, lazy,
                      init_peak(init))
