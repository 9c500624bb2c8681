"""Where model states live under ZeRO-Offload and ZeRO-Infinity, and the PCIe traffic that costs.

Sources:
- ZeRO-Offload: Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC 2021,
  section 4. The GPU keeps the 16-bit parameters and runs forward and backward; the fp32 master copy,
  Adam m and v (K·Ψ) and the 16-bit gradients live in CPU memory, where the optimizer step runs. Per
  step, gradients go GPU->CPU (2Ψ) and updated 16-bit parameters CPU->GPU (2Ψ). With ZeRO-2 on N_d GPUs
  each GPU offloads only its partition, so every per-GPU figure is divided by N_d (section 4.2).
- ZeRO-Infinity: Rajbhandari et al., "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep
  Learning", SC21, sections 5-6: optimizer states (and at stage 3 parameters) on NVMe, read into CPU
  memory and written back each step.
- Which combinations exist follows DeepSpeed's ``zero_optimization`` docs: optimizer offload to CPU from
  stage 1 on, to NVMe only at stage 3; parameter offload only at stage 3.

Assumptions, stated once here and in the README:
- Gradients on the host are held in the gradient dtype (the paper's 16-bit gradients); DeepSpeed 0.19
  allocates its host gradient partition in fp32 (``stage_1_and_2.py``), which adds 2 bytes per element,
  and with gradient accumulation copies host-accumulated gradients back to the GPU each micro-step
  (``async_accumulate_grad_in_cpu_via_gpu``); neither is counted.
- Transient GPU buffers (reduce buckets, the parameters of the layer being gathered at stage 3, NVMe
  staging buffers and pinned bounce buffers in host memory) are not model states: they come out of the
  plan's headroom and are not counted here.
- Gradients that stage 2-3 reduce-scatter are copied to the host every micro-step (DeepSpeed accumulates
  them there); at stage 1 the full gradients accumulate on the GPU and one partition is copied per step.
- Offloaded parameters are fetched to the GPU before each of the two all-gathers of every micro-step
  (forward and backward).

The engines' own offload (DeepSpeed's buffers as 0.19.8 allocates them, fp32 host gradients included; FSDP2's
``CPUOffloadPolicy``) is ``HostMemory``, built by ``zeroplan/engines/*/offload.py``.
"""

from dataclasses import dataclass

from zeroplan.formulas.memory import MemoryBreakdown, buffer_numels, model_states
from zeroplan.formulas.optimizers import StateTensor
from zeroplan.formulas.peak import Term
from zeroplan.formulas.stages import get_stage

DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Offload:
    """Where the optimizer states and the parameters of one rank go: "none" (GPU), "cpu" or "nvme"."""

    optimizer: str = "none"
    params: str = "none"

    def __post_init__(self) -> None:
        for field, value in (("optimizer", self.optimizer), ("params", self.params)):
            if value not in DEVICES:
                raise ValueError(f"offload {field}={value!r}: expected one of {', '.join(DEVICES)}")

    @property
    def label(self) -> str:
        """'none', 'optimizer->cpu', 'optimizer->nvme, params->cpu', ..."""
        pairs = (("optimizer", self.optimizer), ("params", self.params))
        return ", ".join(f"{what}->{where}" for what, where in pairs if where != "none") or "none"

    @property
    def any(self) -> bool:
        return self.optimizer != "none" or self.params != "none"


NO_OFFLOAD = Offload()


@dataclass(frozen=True)
class HostMemory:
    """An engine's offload on one rank (``EngineEstimate.host``): what it keeps in host memory, term by term
    with its source (pinned buffers named so), and one optimizer step's PCIe traffic. A node holds one of
    these per GPU on it."""

    offload: Offload
    terms: tuple[Term, ...]
    h2d_bytes: int
    """host -> GPU per optimizer step."""
    d2h_bytes: int
    """GPU -> host per optimizer step."""
    lazy: tuple[str, ...] = ()
    """names of the terms created by the first optimizer step (Adam's m and v), not yet there after init."""
    init_peak: tuple[Term, ...] = ()
    """the host's terms at its init peak, transient ones included (FSDP2's materialized build: the whole model on
    the CPU; DeepSpeed ZeRO-3's ``initialize_optimizer_states``); (): init holds no more than ``init_bytes``."""
    nvme_read_bytes: int | None = None
    """NVMe -> host per steady optimizer step (DeepSpeed ``offload_optimizer.device: nvme``: the fp32 master, m and v
    and the swapped gradient slices; ``nvme.nvme_traffic``); the first step reads less: the master only of the three
    (m and v are made by it). None: no NVMe offload; 0: a partition too small to swap."""
    nvme_write_bytes: int | None = None
    """host -> NVMe per optimizer step (the first as the steady ones); None: no NVMe offload."""
    nvme_note: str = ""
    """what the NVMe bytes are, with their source (printed after them under ``estimate``'s table)."""
    step_terms: tuple[Term, ...] = ()
    """host temporaries alive during the optimizer step only, on top of ``terms`` (DeepSpeed ``torch_adam`` with
    ``offload_optimizer`` cpu: torch Adam's update on the host partition); not there after the step, so not in the
    steady bytes a measurement of the model states reads beside them."""

    @property
    def init_bytes(self) -> int:
        """Host bytes alive after init, before the first step."""
        return sum(t.bytes for t in self.terms if t.name not in self.lazy)

    @property
    def steady_bytes(self) -> int:
        """Host bytes of the training steps between optimizer steps: every term (``step_terms`` not)."""
        return sum(t.bytes for t in self.terms)

    @property
    def step_peak_bytes(self) -> int:
        """Host bytes at the optimizer step's peak: the steady bytes and the step's temporaries (``step_terms``)."""
        return self.steady_bytes + sum(t.bytes for t in self.step_terms)

    @property
    def init_peak_bytes(self) -> int:
        """Host bytes at init's peak (``init_peak``; ``init_bytes`` without one)."""
        return sum(t.bytes for t in self.init_peak) if self.init_peak else self.init_bytes

    @property
    def host_bytes(self) -> int:
        """The host memory a rank needs: the larger of the training steps' peak (``step_peak_bytes``: the steady bytes
        and the step's temporaries) and init's peak (``peak_at`` names which)."""
        return max(self.step_peak_bytes, self.init_peak_bytes)

    @property
    def peak_at(self) -> str:
        """"init" where init's peak exceeds the training steps' peak (``step_peak_bytes``), else "steady"."""
        return "init" if self.init_peak_bytes > self.step_peak_bytes else "steady"

    @property
    def pinned_bytes(self) -> int:
        """The page-locked part (terms named "(pinned)"): memory the OS cannot page out."""
        return sum(t.bytes for t in self.terms if "(pinned)" in t.name)


def check_offload(stage: int, offload: Offload) -> None:
    """ValueError if DeepSpeed has no such combination (its ``zero_optimization`` documentation)."""
    row = get_stage(stage)
    if offload.optimizer != "none" and not row.shards_optimizer:
        raise ValueError(f"stage {stage}: optimizer offload needs ZeRO stage 1 or higher")
    if offload.optimizer == "nvme" and not row.shards_parameters:
        raise ValueError(f"stage {stage}: optimizer offload to NVMe needs ZeRO stage 3")
    if offload.params != "none" and not row.shards_parameters:
        raise ValueError(f"stage {stage}: parameter offload needs ZeRO stage 3")


@dataclass(frozen=True)
class OffloadBreakdown:
    """Per-GPU placement of model states and per-optimizer-step PCIe/NVMe traffic of one rank."""

    gpu: MemoryBreakdown  # model states resident in GPU memory
    host_bytes: int  # this rank's share of CPU memory (pinned)
    nvme_bytes: int  # this rank's share of NVMe
    h2d_bytes: int  # host -> GPU per optimizer step
    d2h_bytes: int  # GPU -> host per optimizer step
    nvme_read_bytes: int  # NVMe -> host per optimizer step
    nvme_write_bytes: int  # host -> NVMe per optimizer step


def offloaded_states(
    numels: tuple[int, ...],
    nd: int,
    stage: int,
    offload: Offload,
    param_bytes: int,
    grad_bytes: int,
    states: tuple[StateTensor, ...],
    master_dtype: str | None,
    micro_steps: int = 1,
    flat_layout: bool = True,
) -> OffloadBreakdown:
    """Ren et al. 2021 sec. 4 (CPU) and Rajbhandari et al. 2021 sec. 5 (NVMe), per GPU, with padding.

    With ``Offload()`` the GPU part equals ``zeroplan.formulas.memory.model_states`` and all traffic is 0.
    Offloaded states are always this rank's shard (``ceil(Ψ/N_d)`` per tensor): optimizer offload needs
    stage >= 1 and parameter offload stage 3 (``check_offload``).
    """
    check_offload(stage, offload)
    if micro_steps < 1:
        raise ValueError(f"micro_steps={micro_steps}: must be >= 1")
    row = get_stage(stage)
    resident = model_states(numels, nd, stage, param_bytes, grad_bytes, states, master_dtype, flat_layout)
    if not offload.any:  # the searches' common case: skip the shard's pass over every tensor
        return OffloadBreakdown(resident, 0, 0, 0, 0, 0, 0)
    _, shard = buffer_numels(numels, nd, stage, flat_layout)
    gpu_params, gpu_grads, gpu_opt = resident.params_bytes, resident.grads_bytes, resident.optimizer_bytes
    host = nvme = h2d = d2h = nvme_read = nvme_write = 0
    grad_copies = micro_steps if row.shards_gradients else 1

    if offload.optimizer != "none":
        # Optimizer states leave the GPU; the CPU optimizer reads this rank's gradient partition.
        opt_shard = gpu_opt
        gpu_opt = 0
        if row.shards_gradients:
            gpu_grads = 0  # partitions stream to the host as they are reduced (Ren et al. sec. 4.2)
        host += shard * grad_bytes
        d2h += shard * grad_bytes * grad_copies
        if offload.optimizer == "cpu":
            host += opt_shard
        else:  # ZeRO-Infinity: read into CPU memory for the step and written back
            nvme += opt_shard
            nvme_read += opt_shard
            nvme_write += opt_shard
        if offload.params == "none":
            h2d += shard * param_bytes  # updated 16-bit parameters back to the GPU

    if offload.params != "none":
        gpu_params = 0
        fetched = shard * param_bytes * 2 * micro_steps  # before the forward and backward all-gathers
        h2d += fetched
        if offload.optimizer == "none":
            d2h += shard * param_bytes  # parameters the GPU optimizer updated, written back
        if offload.params == "cpu":
            host += shard * param_bytes
        else:
            nvme += shard * param_bytes
            nvme_read += fetched
            nvme_write += shard * param_bytes

    return OffloadBreakdown(
        gpu=MemoryBreakdown(gpu_params, gpu_grads, gpu_opt),
        host_bytes=host,
        nvme_bytes=nvme,
        h2d_bytes=h2d,
        d2h_bytes=d2h,
        nvme_read_bytes=nvme_read,
        nvme_write_bytes=nvme_write,
    )
