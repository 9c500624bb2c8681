"""DeepSpeed's NVMe optimizer offload (ZeRO-Infinity, ``offload_optimizer.device: nvme``) at ZeRO-3, DeepSpeed
0.19.8, read from its source: ``async_io`` cannot be built here (no libaio headers,
``AsyncIOBuilder().is_compatible()`` is false); the pool and the bytes a step moves were run with a Python stand-in
for the op (tests/test_engine_offload_nvme.py ``STANDIN``). Parameters on the NVMe: nvme_param.py.

stage3.py ``_configure_tensor_swapping`` builds a ``PartitionedOptimizerSwapper`` (``PipelinedOptimizerSwapper``
with ``pipeline_read``/``pipeline_write``; with one sub-group there is no next sub-group to overlap, the same
buffers) whose ``OptimizerSwapper.__init__`` (swap_tensor/optimizer_utils.py) allocates the pool:
``SwapBufferManager(num_elems=_io_aligned_numel(largest sub-group), count=buffer_count, fp32)``
(swap_tensor/utils.py: ``new_cpu_locked_tensor``, pinned whatever ``pin_memory`` says), alive for the run.
A sub-group is swapped only if its fp32 bytes reach ``max(MIN_AIO_BYTES, aio.block_size)`` (1 MiB:
``is_swappable_tensor``); a smaller one stays as with ``device: cpu`` and the pool is allocated all the same.
A swapped sub-group's fp32 master is an empty tensor (``_create_fp32_partitions``: ``torch.empty(0)``), its
master, fp32 gradient and Adam's m, v live on the NVMe and, during the step, in four pool buffers
(``swap_in_optimizer_state``: ``num_tensors() + 1`` buffers); no ``subgroup_gradient_buffer``
(``initialize_optimizer_states``: only for sub-groups not swapped). The profile assumes one sub-group
(DeepSpeed's ``sub_group_size`` 1e9 elements), as for cpu offload (``offload.py host_at_states_init``).
"""

from __future__ import annotations

from zeroplan.formulas.peak import Term

S3 = "runtime/zero/stage3.py"
UTILS = "runtime/swap_tensor/utils.py"
OPT_UTILS = "runtime/swap_tensor/optimizer_utils.py"
SWAPPER = "runtime/swap_tensor/partitioned_optimizer_swapper.py"

AIO_BLOCK_SIZE = 1_048_576
"""swap_tensor/constants.py ``AIO_BLOCK_SIZE_DEFAULT``; the profile does not read the ``aio`` section."""
AIO_INTRA_OP_PARALLELISM = 1
"""swap_tensor/constants.py ``AIO_INTRA_OP_PARALLELISM_DEFAULT``."""
MIN_AIO_BYTES = 1024**2
"""swap_tensor/utils.py ``MIN_AIO_BYTES``."""
AIO_ALIGNED_BYTES = 1024
"""swap_tensor/utils.py ``AIO_ALIGNED_BYTES``."""
SWAP_BUFFERS_NEEDED = 4
"""Adam's swap-in: the fp32 master, m, v and the gradient (``swap_in_optimizer_state``:
``swap_info.num_tensors() + 1``); fewer pool buffers and ``allocate`` returns None (an assert in DeepSpeed)."""
POOL = "optimizer NVMe swap buffers"
FP32 = 4


def io_aligned_numel(numel: int, element_size: int = FP32) -> int:
    """optimizer_utils.py ``_io_aligned_numel``: ``numel`` rounded up to ``numel_alignment`` =
    ``AIO_ALIGNED_BYTES · intra_op_parallelism // element_size`` (256 fp32 elements by default)."""
    align = AIO_ALIGNED_BYTES * AIO_INTRA_OP_PARALLELISM // element_size
    return -(-numel // align) * align


def swappable(part: int) -> bool:
    """stage3.py ``_swappable_optimizer_subgroup`` -> optimizer_utils.py ``is_swappable_tensor``: the sub-group's
    fp32 bytes reach ``max(MIN_AIO_BYTES, block_size)``."""
    return part * FP32 >= max(MIN_AIO_BYTES, AIO_BLOCK_SIZE)


def pool_bytes(part: int, buffer_count: int) -> int:
    """The pinned pool: ``buffer_count`` x ``_io_aligned_numel(largest sub-group)`` fp32 elements."""
    return buffer_count * io_aligned_numel(part) * FP32


def pool_source() -> str:
    return (f"{S3} _configure_tensor_swapping -> {OPT_UTILS} OptimizerSwapper.__init__ "
            "(SwapBufferManager: buffer_count x _io_aligned_numel(largest_numel) x fp32, "
            f"{UTILS} new_cpu_locked_tensor)")


def gradient_swap_bytes(slices: tuple[int, ...]) -> int:
    """The fp32 gradient bytes that go to the NVMe at the boundary and come back for the step: each parameter's
    partition slice whose fp32 bytes reach the swap threshold, cut down to the alignment (optimizer_utils.py
    ``_swap_out_gradients``: ``_adjust_for_misaligned_lengths`` splits off the remainder; a slice or remainder
    below 1 MiB stays on the host, ``unswapped_gradients``)."""
    align = AIO_ALIGNED_BYTES * AIO_INTRA_OP_PARALLELISM // FP32
    return sum(n // align * align * FP32 for n in slices if swappable(n))


def nvme_traffic(part: int, slices: tuple[int, ...], first_step: bool = False) -> tuple[int, int]:
    """(read, write) NVMe bytes of one optimizer step for a swapped sub-group of ``part`` elements whose
    parameters' partition slices are ``slices``; (0, 0) when the sub-group is not swapped.

    The gradient goes out at the boundary (stage3.py ``_swap_out_offload_fp32_gradients``) and comes back in
    ``_swap_in_gradients`` (``gradient_swap_bytes``). The step reads the master, m and v at the aligned length
    (``_swap_in_parameter``: ``swap_lengths = _io_aligned_numel``) and writes them back (``swap_out_optimizer_state``).
    The first step reads the master only: Adam's m and v are made by that step. Read 3·4·A + G, write the same
    (A the aligned numel, G ``gradient_swap_bytes``); measured with a Python stand-in for the async_io op."""
    if not swappable(part):
        return 0, 0
    states, grads = 3 * io_aligned_numel(part) * FP32, gradient_swap_bytes(slices)
    read = (io_aligned_numel(part) * FP32 if first_step else states) + grads
    return read, states + grads


def step_terms(part: int, slices: tuple[int, ...], grad_fp32: bool) -> tuple[Term, ...]:
    """The host bytes a swapped sub-group of ``part`` elements (parameters' partition slices ``slices``) holds beside
    the pool during the first optimizer step (``HostMemory.step_terms``); () when it is not swapped.

    - Adam's m and v made by the first step: the swap-in read the master only (``swap_in_optimizer_state``:
      ``num_tensors()`` 1 before any state), DeepSpeedCPUAdam makes its state beside it (cpu_adam.py
      ``torch.zeros_like(p.data)``, 2 x 4 B an element), written out through the pool at the swap-out
      (``_swap_out_optimizer_state -> _swap_out_unpinned_tensors``); from the second step they are read into pool
      buffers.
    - The gradient slices kept on the host: at the boundary each slice is copied to fp32
      (stage3.py ``_offload_grad_partition_at_boundary``: ``grad_buffer.to(master dtype)``, the buffer itself when
      the gradients are fp32: ``grad_fp32``), and a slice or remainder below the swap threshold is kept
      (``_swap_out_gradients``: ``unswapped_gradients``) until ``swap_out_optimizer_state ->
      release_unswapped_gradients``: 4 B an element of the slices less ``gradient_swap_bytes``.
    Measured (moefp16, 2026-12-02, Mixtral bf16, N_d = 2, the stand-in; every slice below the threshold): the
    step's peak 8,094,344 B (0.79 %) under without them, 124 B under with them
    (tests/data/measured/deepspeed_moe_fp16_nvme.json, benchmarks/ds_moe_opt_rows.py nvme3)."""
    if not swappable(part):
        return ()
    src = f"{SWAPPER} swap_in_optimizer_state / {OPT_UTILS} _swap_out_gradients"
    kept = 0 if grad_fp32 else sum(slices) * FP32 - gradient_swap_bytes(slices)
    return (Term("Adam m and v made by the first step (before their swap-out)", 2 * part * FP32,
                 f"{src}; ops/adam/cpu_adam.py step (state zeros_like)", 2),
            *((Term("fp32 gradient slices below the swap threshold (unswapped_gradients)", kept,
                    f"{src}; {S3} _offload_grad_partition_at_boundary"),) if kept else ()))  # fmt: skip


def check_nvme(stage: int, key: str, buffer_count: int | None) -> None:
    """ValueError (one line naming the key) for the NVMe offload the profile does not model: nvme below ZeRO-3, an
    optimizer pool below Adam's ``SWAP_BUFFERS_NEEDED`` (``offload_param`` nvme: nvme_param.py ``param_swap``)."""
    where = f"deepspeed config: zero_optimization.{key}"
    if stage != 3:
        raise ValueError(f"{where}.device='nvme' at ZeRO-{stage}: not modelled (stage_1_and_2.py has no NVMe "
                         "swapper: it treats the device as the CPU); nvme is modelled at ZeRO-3")  # fmt: skip
    if key == "offload_optimizer" and buffer_count is not None and buffer_count < SWAP_BUFFERS_NEEDED:
        raise ValueError(f"{where}.buffer_count={buffer_count}: Adam's swap-in needs {SWAP_BUFFERS_NEEDED} pool "
                         "buffers (partitioned_optimizer_swapper.py swap_in_optimizer_state asserts)")  # fmt: skip


def check_aio(config: object) -> None:
    """ValueError (one line) for an ``aio`` section whose ``block_size`` or ``intra_op_parallelism`` differs from the
    defaults the NVMe terms use (``AIO_BLOCK_SIZE``, ``AIO_INTRA_OP_PARALLELISM``; runtime/swap_tensor/aio_config.py):
    the section is not read yet, and predicting with the defaults would silently give another run's numbers."""
    aio = config.get("aio") if isinstance(config, dict) else None
    if aio is None:
        return
    if not isinstance(aio, dict):
        raise ValueError(f"deepspeed config: aio={aio!r}: expected an object")
    for key, default in (("block_size", AIO_BLOCK_SIZE), ("intra_op_parallelism", AIO_INTRA_OP_PARALLELISM)):
        if key in aio and aio[key] != default:
            raise ValueError(f"deepspeed config: aio.{key}={aio[key]!r}: the NVMe terms are modelled at DeepSpeed's "
                             f"default {default} only")  # fmt: skip
