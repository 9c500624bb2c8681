"""DeepSpeed's NVMe parameter offload (ZeRO-Infinity, ``offload_param.device: nvme``) at ZeRO-3, DeepSpeed 0.19.8,
read from its source and measured with a Python stand-in for the ``async_io`` op (tests/test_engine_offload_nvme.py
``STANDIN_PARAM``); the optimizer's NVMe side is nvme.py.

``Init`` (partition_parameters.py, also what ``deepspeed.initialize`` runs on a whole model: parameter_offload.py
``_convert_to_zero_parameters``) builds an ``AsyncPartitionedParameterSwapper`` (swap_tensor/
partitioned_param_swapper.py ``_configure_aio``): one locked pool of ``buffer_count`` x ``_io_aligned_numel(buffer_size)``
elements of the parameters' dtype, for the run. ``_partition_param`` puts a partition whose bytes reach
``max(MIN_AIO_BYTES, block_size)`` (``swappable_tensor``) into a pool buffer (``get_buffer``: DeepSpeed asserts the
partition fits ``buffer_size``), writes it to the NVMe at its aligned length (``swap_out_and_release``) and frees the
buffer; a smaller one is a host tensor (pinned with ``pin_memory``).

stage3.py ``_create_param_groups_fp16_flat_cpu_memory`` then allocates the pinned 16-bit flat buffer with at most
``max_in_cpu`` elements (one element when that is 0), and ``_create_fp16_partitions_with_defragmentation`` moves
each sub-group that fits into it (``_move_to_flat_buffer``: a swapped partition is read back "permanently to CPU",
``swap_into_buffer``). A sub-group that does not fit has no flat buffer (None): its swapped parameters stay on the
NVMe, each forward and backward reads them into pool buffers (partition_parameters.py ``_ensure_availability_of_partitioned_params``:
``swap_in``) and releases them after use (``remove_partition_and_release_buffers``: nothing written, the copy on the
NVMe is current); the step writes the updated partitions back (``_partitioned_params_swap_out`` ->
``swap_out_partitioned_params``) through ``partitioned_swap_buffer``, a locked buffer reserved for the largest such
sub-group (``reserve_partitioned_swap_space``: the sum of its parameters' aligned *whole* numels, ``t.ds_numel``, as
the source reads). The profile assumes one sub-group per group (``sub_group_size`` 1e9 elements), as nvme.py.

The GPU sees what ``offload_param`` cpu shows it: each all-gather first copies the partitions up
(``ds_tensor.to(device)``), whether they sit in the flat buffer or in a pool buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.engines.deepspeed.nvme import AIO_ALIGNED_BYTES, AIO_BLOCK_SIZE, AIO_INTRA_OP_PARALLELISM, MIN_AIO_BYTES
from zeroplan.engines.deepspeed.offload_settings import PARAM_BUFFER_COUNT, PARAM_BUFFER_SIZE, PARAM_MAX_IN_CPU, OffloadTarget
from zeroplan.formulas.peak import Term

SWAPPER = "runtime/swap_tensor/partitioned_param_swapper.py"
S3 = "runtime/zero/stage3.py"
PP = "runtime/zero/partition_parameters.py"
PARAM_POOL = "parameter NVMe swap buffers"
SWAP_OUT_BUFFER = "16-bit swap-out buffer of the swapped sub-group"


def aligned(numel: int, element_size: int) -> int:
    """``_io_aligned_numel``: ``numel`` rounded up to ``AIO_ALIGNED_BYTES · intra_op_parallelism // element_size``."""
    align = AIO_ALIGNED_BYTES * AIO_INTRA_OP_PARALLELISM // element_size
    return -(-numel // align) * align


@dataclass(frozen=True)
class ParamSwap:
    """One rank's parameter swapping: the swapper's sizes and which partitions go to the NVMe."""

    buffer_count: int
    buffer_size: int
    max_in_cpu: int
    element_size: int
    slices: tuple[int, ...]
    """each parameter's partition on the rank, ``ceil(n / N_d)`` elements (ZeRO-3 pads every parameter to N_d)."""
    numels: tuple[int, ...]
    swapped: tuple[bool, ...]
    """the partitions ``Init`` writes to the NVMe (``swappable_tensor``; persistent parameters stay on the GPU)."""

    @property
    def partition(self) -> int:
        return sum(self.slices)

    @property
    def on_nvme(self) -> bool:
        """The sub-group has no flat host buffer: its swapped partitions live on the NVMe during training."""
        return self.partition > self.max_in_cpu

    @property
    def swapped_bytes(self) -> int:
        """What ``Init`` writes, and an on-NVMe sub-group's read or write moves: the swapped partitions, aligned."""
        return sum(aligned(n, self.element_size) for n, s in zip(self.slices, self.swapped) if s) * self.element_size


def param_swap(t: OffloadTarget, numels: tuple[int, ...], nd: int, element_size: int, persistence: int) -> ParamSwap:
    """The swapper of ``offload_param`` ``t`` (nvme) for parameters of ``numels`` over ``nd`` ranks; a parameter of at
    most ``persistence`` elements is persistent (``stage3_param_persistence_threshold``: on the GPU, never swapped)."""
    count = PARAM_BUFFER_COUNT if t.buffer_count is None else t.buffer_count
    size = PARAM_BUFFER_SIZE if t.buffer_size is None else t.buffer_size
    slices = tuple(-(-n // nd) for n in numels)
    threshold = max(MIN_AIO_BYTES, AIO_BLOCK_SIZE)
    swapped = tuple(s * element_size >= threshold and n > persistence for n, s in zip(numels, slices))
    too_big = [s for s, w in zip(slices, swapped) if w and s > size]
    if too_big:
        raise ValueError(f"deepspeed config: zero_optimization.offload_param.buffer_size={size}: a swapped partition "
                         f"of {max(too_big)} elements does not fit one buffer ({SWAPPER} get_buffer asserts)")  # fmt: skip
    if count < 1:
        raise ValueError("deepspeed config: zero_optimization.offload_param.buffer_count=0: every swapped partition "
                         f"passes through a pool buffer ({SWAPPER} get_buffer asserts)")  # fmt: skip
    return ParamSwap(count, size, PARAM_MAX_IN_CPU if t.max_in_cpu is None else t.max_in_cpu, element_size,
                     slices, tuple(numels), swapped)  # fmt: skip


def host_terms(w: ParamSwap, pin_memory: bool) -> tuple[Term, ...]:
    """The host side of parameter swapping: the pool, the flat 16-bit buffer and, for a sub-group left on the NVMe,
    the partitions too small to swap and the swap-out buffer."""
    e = w.element_size
    flat = min(w.partition, w.max_in_cpu) or 1  # torch.empty(1) when max_in_cpu leaves nothing
    out = [Term(f"{PARAM_POOL} (pinned)", w.buffer_count * aligned(w.buffer_size, e) * e,
                f"{SWAPPER} _configure_aio (buffer_count x _io_aligned_numel(buffer_size), new_cpu_locked_tensor)",
                w.buffer_count),
           Term("16-bit parameter partition (pinned)", flat * e,
                f"{S3} _create_param_groups_fp16_flat_cpu_memory (min(partition, max_in_cpu) elements)")]  # fmt: skip
    if not w.on_nvme:
        return tuple(out)
    small = sum(s for s, x in zip(w.slices, w.swapped) if not x)
    pin = " (pinned)" if pin_memory else ""
    out += [Term(f"16-bit partitions too small to swap{pin}", small * e,
                 f"{PP} _partition_param (torch.empty(partition_size) on the CPU; no flat buffer: _move_to_flat_buffer)",
                 sum(1 for x in w.swapped if not x)),
            Term(f"{SWAP_OUT_BUFFER} (pinned)", sum(aligned(n, e) for n in w.numels) * e,
                 f"{S3} _create_fp16_partitions_with_defragmentation -> {SWAPPER} reserve_partitioned_swap_space "
                 "(the sub-group's aligned ds_numel)")]  # fmt: skip
    return tuple(out)


def nvme_traffic(w: ParamSwap, grad_accum: int, max_reuse_distance: int) -> tuple[int, int]:
    """(read, write) NVMe bytes of one steady optimizer step (the trace recorded: the second step on), (0, 0) when
    the flat buffer holds the sub-group (``max_in_cpu``: read once at init, never again).

    A sub-group left on the NVMe is read by each micro-step's forward (the coordinator's ``__prefetch_nvme_param_partitions``
    and ``fetch_sub_module``) and written once by the step (``_partitioned_params_swap_out``). Backward reads it again
    unless the forward's partitions are still in their pool buffers: the coordinator keeps a parameter whose next use
    comes within ``stage3_max_reuse_distance`` elements of the trace (``__params_to_release``), which holds for every
    parameter when the whole trace (forward and backward, 2Ψ) is within it; otherwise backward is counted as reading
    everything again (an upper bound: the parameters used last in forward and first in backward stay). Measured
    (``STANDIN_PARAM``, Ψ = 3.7M, the default distance 1e9): step 2 read the swapped partitions once, in forward, and
    wrote them once; step 1 (the trace being recorded) read them in forward, the tied embedding twice, and in backward."""
    if not w.on_nvme:
        return 0, 0
    kept = 2 * sum(w.numels) <= max_reuse_distance
    return (1 if kept else 2) * grad_accum * w.swapped_bytes, w.swapped_bytes
