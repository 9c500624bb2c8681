"""What DeepSpeed allocates on each rank for model states and buckets: ``DSTerm`` records, one list per
optimizer wrapper (``zero12_terms``: stage_1_and_2.py ``DeepSpeedZeroOptimizer``; ``bf16_terms``:
bf16_optimizer.py ``BF16_Optimizer``; ``zero3_terms``: stage3.py ``DeepSpeedZeroOptimizer_Stage3``), each
term naming the DeepSpeed file and function it was read from; and the flat group's padding (ZeRO-1/2, BF16)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from functools import cached_property, lru_cache

from zeroplan.engines.deepspeed.settings import DTYPE_BYTES, NCCL_START_ALIGNMENT_FACTOR, Settings, inner_optimizer_class
from zeroplan.formulas.optimizers import optimizer_states
from zeroplan.formulas.peak import Term
from zeroplan.formulas.sharding import ceil_div, flat_shard_numel

@dataclass(frozen=True)
class DSTerm:
    """A buffer DeepSpeed allocates on each rank: ``numel`` elements of ``dtype``, alive per ``live``.

    ``live``: ``persistent`` (from ``deepspeed.initialize`` on, at every step boundary), ``lazy``
    (created by the first ``optimizer_step``, alive from then on), ``backward`` (allocated when backward
    starts, freed before it ends: the ZeRO-1/2 reduce buckets).
    """

    name: str
    live: str
    numel: int
    dtype: str
    source: str
    tensors: int = 1

    @property
    def bytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def term(self) -> Term:
        return Term(self.name, self.bytes, self.source, max(self.tensors, 1))


def aligned_flat_numel(numels: tuple[int, ...], nd: int) -> int:
    """Length of DeepSpeed's flat group (ZeRO-1/2 ``DeepSpeedZeroOptimizer`` and ``BF16_Optimizer``): the group's
    tensors concatenated, then padded once at the end to a multiple of 2·N_d (runtime/utils.py
    ``align_dense_tensors``, called by stage_1_and_2.py ``DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned``
    with ``alignment = nccl_start_alignment_factor * world_size``). Not the per-tensor rule of ZeRO-3 and the
    reference runtime (``formulas.sharding.flat_shard_numel``: ZeRO-3 pads each tensor to N_d,
    partition_parameters.py ``Init._padding_size``)."""
    return ceil_div(sum(numels), NCCL_START_ALIGNMENT_FACTOR * nd) * NCCL_START_ALIGNMENT_FACTOR * nd


PERSISTENT_PARAMS = "persistent parameters (gathered)"
"""ZeRO-3's term of the parameters kept gathered (``persistent_numel``); zero3.py drops it from the step's moments."""


def persistent_numel(s: Settings, numels: tuple[int, ...]) -> int:
    """ZeRO-3 parameters kept gathered (parameter_offload.py ``mark_persistent_parameters``: ds_numel <=
    stage3_param_persistence_threshold); asked by ZeRO-3's terms and collectives (``zero3_terms``,
    collectives.py ``zero3_collectives``)."""
    return _persistent_numel(s.param_persistence_threshold, numels)


_PERSISTENT: list = []  # [(numels, threshold, elements)]: the last layout's (``persistent_numel``)


def _persistent_numel(threshold: int, numels: tuple[int, ...]) -> int:
    """``persistent_numel``'s sum, kept for the last layout (by identity: a plan's candidates share one ``numels``)
    and threshold. A speed-up, no rule: a sum over every parameter at each of a plan's ZeRO-3 terms and collectives."""
    for old, limit, total in _PERSISTENT:
        if old is numels and limit == threshold:
            return total
    total = sum(n for n in numels if n <= threshold)
    _PERSISTENT[:] = [*_PERSISTENT[-3:], (numels, threshold, total)]
    return total


class FlatGroup:
    """ZeRO-1/2 and BF16_Optimizer: the parameters laid out in one flat group (``numels`` in
    ``named_parameters`` order) cut into N_d partitions of ``part`` elements (``aligned_flat_numel``)."""

    def __init__(self, numels: tuple[int, ...], nd: int) -> None:
        self.numels, self.nd = numels, nd
        self.offsets = (0, *itertools.accumulate(numels))
        """where each parameter starts, and where the last ends (prefix sums)."""
        self.part = aligned_flat_numel(numels, nd) // nd

    def range(self, rank: int) -> tuple[int, int]:
        """(first, end) indices of the parameters overlapping ``rank``'s slice [rank·part, (rank + 1)·part):
        those that start before its end and end after its start (offsets ascend, so a range)."""
        return self._ranges[rank]

    @cached_property
    def _ranges(self) -> tuple[tuple[int, int], ...]:
        """``range`` of every rank, found once per layout (the profile asks each rank's many times)."""
        offsets, n, part, out = self.offsets, len(self.numels), self.part, []
        for rank in range(self.nd):
            first = bisect.bisect_right(offsets, rank * part, 1, n + 1) - 1  # the first i with offsets[i + 1] > lo
            end = bisect.bisect_left(offsets, (rank + 1) * part, 0, n)  # the first i with offsets[i] >= hi
            out.append((first, max(first, end)))
        return tuple(out)

    @cached_property
    def _params_numels(self) -> tuple[int, ...]:
        """``params_numel`` of every rank, once per layout."""
        offsets = self.offsets
        return tuple(offsets[end] - offsets[first] for first, end in self._ranges)

    def params(self, rank: int) -> tuple[int, ...]:
        """Indices of the parameters overlapping ``rank``'s slice (stage_1_and_2.py ``get_partition_info``: a
        parameter is in a partition when any of its elements is)."""
        return self._params[rank]

    @cached_property
    def _params(self) -> tuple[tuple[int, ...], ...]:
        """``params`` of every rank, once per layout (the per-rank moments ask each rank's, N_d of them, per run)."""
        return tuple(tuple(range(first, end)) for first, end in self._ranges)

    def distinct_ranks(self) -> tuple[int, ...]:
        """The first rank of each run of ranks whose slices overlap the same parameters (``range``): the
        profile reads a rank only through them, so these ranks' predictions are every rank's."""
        firsts: dict[tuple[int, int], int] = {}
        for rank in range(self.nd):
            firsts.setdefault(self.range(rank), rank)
        return tuple(firsts.values())

    def params_numel(self, rank: int) -> int:
        """Elements of the parameters overlapping ``rank``'s slice, whole (``copy_grads_in_partition``)."""
        return self._params_numels[rank]


@lru_cache(maxsize=8)  # every candidate of a plan (stages 1-2, each bucket size) and each rank's run share it
def flat_group(numels: tuple[int, ...], nd: int) -> FlatGroup:
    """The ``FlatGroup`` of ``numels`` on ``nd`` ranks, laid out once."""
    return FlatGroup(numels, nd)


def _partition_params(numels: tuple[int, ...], part: int, rank: int) -> tuple[int, ...]:
    """Indices of the parameters overlapping ``rank``'s slice of ``part`` elements (``FlatGroup.params``)."""
    lo, hi, start, out = rank * part, (rank + 1) * part, 0, []
    for i, n in enumerate(numels):
        if start < hi and start + n > lo:
            out.append(i)
        start += n
    return tuple(out)


def _fused(s: Settings) -> int:
    """1 with DeepSpeed's FusedAdam (its overflow buffer; no step tensor), 0 with torch's Adam."""
    return 1 if inner_optimizer_class(s) == "FusedAdam" else 0


def _adam_moments(s: Settings, part: int) -> DSTerm:
    """Adam's states of the fp32 partition: m and v, with ``amsgrad`` max v too (``optimizer_states``)."""
    n = len(optimizer_states(s.optimizer, "fp32", s.amsgrad))
    return DSTerm(f"Adam m and v{' + max v' if s.amsgrad else ''} ({inner_optimizer_class(s)})", "lazy", n * part,
                  "fp32", "ops/adam/fused_adam.py FusedAdam.step (zeros_like exp_avg, exp_avg_sq) / torch/optim/adam.py "
                  "_init_group", tensors=n)  # fmt: skip


def _flat_scalars(s: Settings) -> tuple[DSTerm, ...]:
    """ZeRO-1/2 and BF16_Optimizer: FusedAdam's overflow buffer, the norm and torch Adam's step."""
    fused = _fused(s)
    return (DSTerm("overflow buffer", "persistent", fused, "int32",
                   "ops/adam/fused_adam.py FusedAdam.__init__ (_dummy_overflow_buf)"),
            DSTerm("step scalars", "lazy", 2 - fused, "fp32",
                   "the global grad norm kept by the optimizer (measured 4 B) and, with torch Adam, its "
                   "fp32 step tensor (torch/optim/adam.py _init_group)"))  # fmt: skip


@lru_cache(maxsize=16)  # every ZeRO-3 candidate of a plan, its terms and moments, partition the same tensors
def zero3_partition_numel(numels: tuple[int, ...], nd: int) -> int:
    """Elements of one rank's ZeRO-3 partition: each tensor padded to N_d (``flat_shard_numel``)."""
    return flat_shard_numel(numels, nd)


def zero3_terms(s: Settings, numels: tuple[int, ...], nd: int) -> tuple[DSTerm, ...]:
    """``DeepSpeedZeroOptimizer_Stage3``: every tensor partitioned (ceil(n / N_d) each: the one sharding rule,
    ``flat_shard_numel``, as partition_parameters.py ``Init._padding_size``/``_partition_param`` pad it)."""
    p, g, part, fused = s.dtype, s.grad_dtype, zero3_partition_numel(numels, nd), _fused(s)
    return (
        DSTerm("16-bit parameter partition", "persistent", part, p,
               "runtime/zero/stage3.py DeepSpeedZeroOptimizer_Stage3._create_fp16_partitions_with_defragmentation (lp_param_buffer)"),
        DSTerm("fp32 master partition", "persistent", part, "fp32",
               "runtime/zero/stage3.py _create_fp32_partitions (a clone, even when the model is fp32)"),
        DSTerm("gradient partition", "persistent", part, g,
               "runtime/zero/stage3.py _setup_for_real_optimizer (grad_partitions_flat_buffer, grad_accum_dtype)"),
        DSTerm("reduce bucket (IPG)", "persistent", s.reduce_bucket_size if s.contiguous_gradients else 0, g,
               "runtime/zero/stage3.py _setup_for_real_optimizer (ipg bucket, torch.empty(reduce_bucket_size))"),
        # at N_d = 1 nothing is gathered: param.data becomes a view of its partition (partition_parameters.py
        # all_gather_coalesced -> _no_gather_coalesced -> NoGatherHandle: ds_tensor.data.to(device).view(ds_shape))
        DSTerm(PERSISTENT_PARAMS, "lazy", persistent_numel(s, numels) if nd > 1 else 0, p,
               "runtime/zero/parameter_offload.py mark_persistent_parameters; gathered in forward and kept"),
        DSTerm("inf/nan tracker", "persistent", 1, "bool", "runtime/zero/stage3.py __init__ (inf_or_nan_tracker)"),
        DSTerm("overflow buffer", "persistent", fused, "int32",
               "ops/adam/fused_adam.py FusedAdam.__init__ (_dummy_overflow_buf)"),
        DSTerm("grad-norm scalar", "lazy", 1, "fp64", "runtime/zero/stage3.py step (fp64 global norm; measured 8 B)"),
        DSTerm("Adam step tensor", "lazy", 1 - fused, "fp32", "torch/optim/adam.py _init_group (state['step'])"),
        _adam_moments(s, part),
    )  # fmt: skip


def zero12_terms(s: Settings, numels: tuple[int, ...], nd: int) -> tuple[DSTerm, ...]:
    """``DeepSpeedZeroOptimizer`` (ZeRO-1 and 2): the full flat 16-bit group, an fp32 partition, the reduce
    bucket(s) of each backward."""
    flat, g = aligned_flat_numel(numels, nd), s.grad_dtype
    buffers = (2 if s.overlaps else 1) if s.contiguous_gradients else 0
    return (
        DSTerm("16-bit flat parameters (full, padded)", "persistent", flat, s.dtype,
               "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__ (bit16_groups_flat)"),
        DSTerm("fp32 master partition", "persistent", flat // nd, "fp32",
               "runtime/zero/stage_1_and_2.py __init__ (single_partition_of_fp32_groups: .clone(), even in fp32)"),
        DSTerm("reduce bucket (IPG)" + (" x2 (overlap_comm)" if buffers == 2 else ""), "backward",
               buffers * s.reduce_bucket_size, g,
               "runtime/zero/stage_1_and_2.py setup_buckets (torch.empty(reduce_bucket_size) per comm "
               "dtype, a second when overlap_comm), at the first gradient hook", tensors=max(buffers, 1)),
        *_flat_scalars(s),
        _adam_moments(s, flat // nd),
    )  # fmt: skip


def bf16_terms(s: Settings, numels: tuple[int, ...], nd: int) -> tuple[DSTerm, ...]:
    """``BF16_Optimizer`` (ZeRO-1, bf16 model, fp32 gradient accumulation): the full flat 16-bit group, an
    fp32 partition and a full fp32 gradient buffer."""
    flat = aligned_flat_numel(numels, nd)
    return (
        DSTerm("16-bit flat parameters (full, padded)", "persistent", flat, s.dtype,
               "runtime/bf16_optimizer.py BF16_Optimizer._setup_for_real_optimizer (bf16_groups_flat)"),
        DSTerm("fp32 master partition", "persistent", flat // nd, "fp32",
               "runtime/bf16_optimizer.py _setup_for_real_optimizer (fp32_groups_flat_partition)"),
        DSTerm("fp32 gradient accumulation buffer (full, padded)", "persistent", flat, s.grad_dtype,
               "runtime/bf16_optimizer.py _setup_for_real_optimizer (fp32_groups_gradients_flat)"),
        *_flat_scalars(s),
        _adam_moments(s, flat // nd),
    )  # fmt: skip


def model_state_bytes(all_terms: tuple[DSTerm, ...], after_step: bool) -> int:
    """Bytes alive at a step boundary: persistent terms, plus lazy ones once a step has run."""
    lives = ("persistent", "lazy") if after_step else ("persistent",)
    return sum(t.bytes for t in all_terms if t.live in lives)
