"""What the parent checks about the host before any rank starts: output path, GPUs, cores, memory.

``ValidateConfig`` checks everything that needs no knowledge of the host; these checks read the host
(``/proc/meminfo``, the CPU affinity, the visible GPUs) and raise ``ValueError`` with one line.
"""

from __future__ import annotations

import os

from validate.config import ValidateConfig

# A chosen limit, not a measurement: ranks run one intra-op thread each (OMP_NUM_THREADS=1), and beyond a
# few ranks per core a step only gets slower (a simulated run shows large N_d without the processes).
RANKS_PER_CORE = 4
# Measured: VmHWM of one rank after importing torch 2.13 (CPU build) and joining a gloo group, 231 MiB,
# rounded up to cover the probes' own structures.
RANK_BASE_BYTES = 256 * 2**20
# The parity reference holds a whole unsharded copy of the model in the runtime's precision: 16-bit
# parameters and gradients (2 + 2 bytes), an fp32 master (4) and Adam's m, v (8) per parameter.
REFERENCE_BYTES_PER_PARAM = 16


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rank_memory_lower_bound(config: ValidateConfig, nd: int) -> int:
    """Bytes one real rank needs at least: the process itself, the model states zeroplan predicts for
    the largest stage run, and the unsharded parity reference."""
    from zeroplan import estimate

    psi = config.psi
    states = max(
        estimate(params=psi, gpus=nd, stage=s, param_dtype=config.param_dtype).stages[0].memory.model_states_bytes
        for s in config.stages
    )
    return RANK_BASE_BYTES + states + REFERENCE_BYTES_PER_PARAM * psi


def check_devices(config: ValidateConfig) -> None:
    """A real NCCL run needs one GPU per rank of this node: say so before starting any process."""
    import torch

    if (
        config.simulated
        or config.device == "cpu"
        or not (config.device == "cuda" or torch.cuda.is_available())
    ):
        return
    gpus = torch.cuda.device_count()
    too_big = [nd for nd in config.world_sizes if nd // config.nnodes > gpus]
    if too_big:
        raise ValueError(
            f"world-size={too_big}: a real NCCL run needs one GPU per rank and {gpus} are visible; "
            "use --world-size <= that, --device cpu (gloo) or --simulated"
        )


def check_host(config: ValidateConfig) -> None:
    """Refuse a real world this host cannot run: ranks per node beyond its cores or its memory."""
    if config.simulated:
        return
    cores, memory = usable_cores(), available_memory_bytes()
    for nd in config.world_sizes:
        local = nd // config.nnodes
        if local > RANKS_PER_CORE * cores:
            raise ValueError(
                f"world-size={nd}: {local} ranks on this node, at most {RANKS_PER_CORE} per usable core "
                f"({cores} cores); use --simulated for large N_d"
            )
        need = local * rank_memory_lower_bound(config, nd)
        if memory is not None and need > memory:
            raise ValueError(
                f"world-size={nd}: {local} ranks of Ψ = {config.psi:,} need at least {need / 2**30:.3g} GiB "
                f"(process, predicted model states, parity reference), {memory / 2**30:.3g} GiB available; "
                "use a smaller model, fewer ranks or --simulated"
            )


def check_before_start(config: ValidateConfig) -> None:
    """Everything about the host, in the parent, before a rank starts."""
    check_devices(config)
    check_host(config)
