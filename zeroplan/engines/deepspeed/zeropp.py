"""ZeRO++ at ZeRO-3, DeepSpeed 0.19.8: hpZ's secondary partition and qwZ's quantized all-gathers (qgZ's quantized
gradient reduce: ``zeropp_qgz.py``).

**hpZ** (``zero_hpz_partition_size`` = H > 1; ``zeropp_settings.hpz_group``). Each parameter of n elements is
also partitioned over a secondary group of H consecutive ranks (utils/groups.py
``_create_zero_param_parallel_group``: ranks [iH, (i+1)H)), ``ceil(n / N_d)·N_d / H`` elements in the model
dtype per rank (partition_parameters.py ``_partition_param_sec``: ``tensor_size // num_ranks_in_param_group``).
Its life, one step:

- created whenever a gathered parameter is partitioned and has none (``_partition`` calls
  ``_partition_param_sec`` before ``_partition_param``): at ``deepspeed.initialize`` for every parameter
  (``_convert_to_zero_parameters``); in a step, at the coordinator's release of each parameter
  (``release_sub_module`` -> ``__release_param`` -> ``partition``), and for every parameter still gathered
  at the optimizer step (``stage3.py step -> _partition_all_parameters``: the persistent ones);
- used by every all-gather of a parameter that has one (``all_gather_coalesced``: ``use_secondary_tensor``,
  the group ``zero_param_process_group`` of H ranks), so a parameter released in forward is gathered again in
  backward inside the secondary group; the coordinator splits each fetch into the parameters with a secondary
  and those without, one call each (partitioned_param_coordinator.py ``__all_gather_params_``);
- freed after the step (``stage3.py _post_step -> invalidate_secondary_tensor``); the persistent parameters are
  re-gathered there over all N_d (``all_gather`` -> ``_allgather_params_coalesced``, the primary partition).

With ``gradient_accumulation_steps`` G > 1 the secondaries made in one micro-step's backward are still there
in the next one's forward (invalidated only at the boundary): micro-steps 2..G gather in the secondary group
in forward too (``hpz_schedule(..., warm=True)``).

**qwZ** (``zero_quantized_weights``): every coordinator all-gather quantizes the rank's partition (the
concatenated partitions of the call) to int8 with one fp32 scale per group (``CUDAQuantizer.quantize``:
groups from ``target_group_size`` 8000, ``qwz_groups``) and gathers the int8 partitions and the scales
(``_all_gather_coalesced`` with ``quantize``: two ``all_gather_into_tensor`` calls); ``wait`` dequantizes the
int8 buffer to fp16 and converts it to the model dtype (``AllGatherCoalescedHandle.wait``). The quantizer is a CUDA
op (``QuantizerBuilder``; DeepSpeed's CPU accelerator has none): measured on gloo with a Python stand-in of its
outputs' shapes (validate/engines/deepspeed_quantizer.py; tests/test_deepspeed_zeropp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import ceil

from zeroplan.engines.deepspeed.coordinator import (AVAILABLE, NOT_AVAILABLE, Coordinator, Stage3Gather, Stage3Schedule,
                                                    _recorded, stage3_schedule)
from zeroplan.engines.deepspeed.trace import Stage3Trace
from zeroplan.engines.deepspeed.zero3_hpz_replay import hpz_fused_replay
from zeroplan.engines.deepspeed.zeropp_settings import hpz_group
from zeroplan.formulas.dtypes import BYTES_PER_ELEMENT
from zeroplan.formulas.peak import Term

SECONDARY_SRC = ("runtime/zero/partition_parameters.py _partition -> _partition_param_sec (ds_secondary_tensor, "
                 "ceil(n / N_d)·N_d / zero_hpz_partition_size elements); freed by stage3.py _post_step -> "
                 "invalidate_secondary_tensor")  # fmt: skip
QWZ_TARGET_GROUP = 8000
"""partition_parameters.py ``CUDAQuantizer.target_group_size``: elements per quantization group aimed at."""


def secondary_numel(n: int, nd: int, hpz: int) -> int:
    """One rank's secondary partition of a parameter of ``n`` elements (``_partition_param_sec``)."""
    return ceil(n / nd) * nd // hpz


@dataclass(frozen=True)
class HpzSchedule(Stage3Schedule):
    """``Stage3Schedule`` with hpZ: ``secondary[i]``: secondary-partition elements alive after event ``i``;
    ``groups[k]``: the group size of all-gather call ``k`` (``gathers[k]``): H in the secondary group, N_d outside."""

    secondary: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()


class HpzCoordinator(Coordinator):
    """The coordinator replay (``coordinator.py``) with each parameter's secondary partition: made at its
    release, gathering it again in the secondary group, each fetch split in two calls (module docstring). The
    reference ``zero3_hpz_replay.hpz_fused_replay`` is checked against (tests/test_deepspeed_hpz_replay.py)."""

    def __init__(self, trace: Stage3Trace, numels: tuple[int, ...], nd: int, hpz: int, *args,
                 secondary: frozenset = frozenset()) -> None:  # fmt: skip
        super().__init__(trace, numels, nd, *args)
        self.nd, self.hpz = nd, hpz
        self.sec = set(secondary)
        self.sec_numel = [secondary_numel(n, nd, hpz) for n in numels]
        self.sec_mem = sum(self.sec_numel[p] for p in self.sec)
        self.group_of: list[int] = []
        self.secondary: list[int] = []  # secondary elements after each event

    def fetch(self, m: int, forward: bool) -> None:
        super().fetch(m, forward)
        self.secondary.append(self.sec_mem)

    def release(self, m: int) -> None:
        super().release(m)
        self.secondary.append(self.sec_mem)

    def all_gather(self, params, forward: bool) -> None:
        """``__all_gather_params_``: the parameters with a secondary first, in the secondary group."""
        todo = [p for p in params if self.status[p] == NOT_AVAILABLE]
        with_secondary = [p for p in todo if p in self.sec]
        for part, group in ((with_secondary, self.hpz), ([p for p in todo if p not in self.sec], self.nd)):
            calls = len(self.issued)
            super().all_gather(part, forward)
            self.group_of += [group] * (len(self.issued) - calls)

    def free(self, p: int) -> None:
        """``__release_param`` -> ``partition``: the secondary is made before the gathered tensor is freed."""
        if p not in self.sec and self.status[p] == AVAILABLE and not self.active[p] and not self.persist[p]:
            self.sec.add(p)
            self.sec_mem += self.sec_numel[p]
        super().free(p)


def hpz_schedule(trace: Stage3Trace, numels: tuple[int, ...], nd: int, hpz: int, threshold: int, bucket: int,
                 max_live: int, max_reuse: int, warm: bool = False) -> HpzSchedule:
    """The coordinator replayed with hpZ over one micro-step; ``warm``: a later micro-step of the same optimizer
    step, starting with the secondaries the first one left."""
    args = (trace, numels, nd, hpz, threshold, bucket, max_live, max_reuse)
    cold, left = _hpz_replay(*args, frozenset())
    return _hpz_replay(*args, left)[0] if warm else cold


@lru_cache(maxsize=64)  # one key however it is called (``warm`` by keyword or not); the warm replay starts where
# the cold one ended (the cold replay once, not again for the warm one)
def _hpz_replay(trace: Stage3Trace, numels: tuple[int, ...], nd: int, hpz: int, threshold: int, bucket: int,
                max_live: int, max_reuse: int, start: frozenset) -> tuple[HpzSchedule, frozenset]:
    """(``hpz_schedule`` starting with the secondaries of ``start``, the secondaries it leaves): ``HpzCoordinator``'s
    replay in one loop (``zero3_hpz_replay``; a speed-up, no rule: the very same schedule)."""
    sec_numel = [secondary_numel(n, nd, hpz) for n in numels]
    fields, secondary, groups, left = hpz_fused_replay(trace.steps, _recorded(trace, numels, nd, threshold), numels,
                                                       nd, hpz, sec_numel, start, bucket, max_live, max_reuse,
                                                       Stage3Gather)  # fmt: skip
    return HpzSchedule(*fields, secondary=secondary, groups=groups), left


@lru_cache(maxsize=8)  # every hpZ run of a plan asks (a speed-up, no rule)
def all_secondaries_numel(numels: tuple[int, ...], nd: int, hpz: int) -> int:
    """Every parameter's secondary partition: alive from ``deepspeed.initialize`` to the first step's end, and in
    each optimizer step (``_partition_all_parameters`` makes the persistent ones' too) until ``_post_step``."""
    return sum(secondary_numel(n, nd, hpz) for n in numels)


def qwz_groups(numel: int) -> int:
    """Quantization groups of one quantized tensor of ``numel`` elements (partition_parameters.py
    ``CUDAQuantizer.quantize``: at least numel / 8000, a multiple of 8 elements each, doubled while over 8000)."""
    groups = ceil(numel / QWZ_TARGET_GROUP)
    while groups < numel and numel % (8 * groups):
        groups += 1
    while numel % (16 * groups) == 0 and numel / groups > QWZ_TARGET_GROUP:
        groups *= 2
    if numel % (8 * groups) or numel / groups >= 16000 or numel <= groups:
        raise ValueError(f"{numel} elements: qwZ's quantizer finds no group size (CUDAQuantizer.quantize asserts a "
                         "multiple of 8 elements per group, under 16k)")  # fmt: skip
    return groups


def secondary_terms(sched: Stage3Schedule, event: int, pbytes: int) -> tuple[Term, ...]:
    """The secondary partitions alive after ``event`` of an hpZ replay (``HpzSchedule``); () otherwise."""
    if not isinstance(sched, HpzSchedule) or not sched.secondary[event]:
        return ()
    return (Term("hpZ secondary partitions (parameters released so far)", sched.secondary[event] * pbytes,
                 SECONDARY_SRC),)  # fmt: skip


def all_secondaries(run) -> tuple[Term, ...]:
    """Every parameter's secondary partition (``all_secondaries_numel``) in ``run``'s dtype; () without hpZ."""
    s = run.settings
    hpz = hpz_group(s.hpz_partition_size, run.nd)
    if not hpz:
        return ()
    return (Term("hpZ secondary partitions (every parameter)", all_secondaries_numel(run.numels, run.nd, hpz)
                 * BYTES_PER_ELEMENT[s.dtype], SECONDARY_SRC),)  # fmt: skip


GATHER_SRC = ("runtime/zero/partitioned_param_coordinator.py __all_gather_params_ (the parameters with a secondary "
              "partition, then those without: one all_gather_coalesced call each) -> partition_parameters.py "
              "all_gather_coalesced (use_secondary_tensor: zero_param_process_group)")  # fmt: skip
QWZ_SRC = ("runtime/zero/partition_parameters.py _all_gather_coalesced / _all_gather_sequential with quantize "
           "(CUDAQuantizer.quantize: int8 partitions, then their fp32 scales)")  # fmt: skip


def zeropp_gathers(s, trace: Stage3Trace, numels: tuple[int, ...], nd: int, hpz: int,
                   grad_accum: int) -> tuple[tuple[str, int, str, int, int, str], ...]:
    """The coordinator's all-gathers of one optimizer step with ZeRO++, summed per (phase, group, dtype): rows
    ``(phase, group size, dtype, calls, elements, source)``. hpZ: each call over its group (``HpzSchedule.groups``),
    the first micro-step cold, the G - 1 others warm (module docstring); qwZ: each call in int8 and a second
    call of its fp32 scales (``qwz_groups`` of the rank's partition of the call, times the group)."""
    args = (s.param_persistence_threshold, s.prefetch_bucket_size, s.max_live_parameters, s.max_reuse_distance)
    return _gather_rows(trace, numels, nd, hpz, grad_accum, s.dtype, s.quantized_weights, args)


@lru_cache(maxsize=32)  # the candidates of one prefetch setting, whatever their reduce bucket (a speed-up, no rule)
def _gather_rows(trace: Stage3Trace, numels: tuple[int, ...], nd: int, hpz: int, grad_accum: int, dtype: str,
                 quantized: bool, args: tuple) -> tuple[tuple[str, int, str, int, int, str], ...]:
    """``zeropp_gathers``' rows; the warm hpZ replay only where a later micro-step is counted (G > 1)."""
    if hpz:
        later = ((hpz_schedule(trace, numels, nd, hpz, *args, warm=True), grad_accum - 1),) if grad_accum > 1 else ()
        scheds = ((hpz_schedule(trace, numels, nd, hpz, *args), 1), *later)
    else:
        scheds = ((stage3_schedule(trace, numels, nd, *args), grad_accum),)
    rows: dict[tuple[str, int, str], list] = {}
    for sched, times in scheds:
        groups = sched.groups if isinstance(sched, HpzSchedule) else (nd,) * len(sched.gathers)
        for g, group in zip(sched.gathers, groups):
            phase = "backward" if trace.events[g.issued].backward_phase else "forward"
            calls = [(dtype, g.elements, GATHER_SRC)]
            if quantized:
                calls = [("int8", g.elements, QWZ_SRC), ("fp32", qwz_groups(g.elements // group) * group, QWZ_SRC)]
            for dtype, elements, src in calls:
                row = rows.setdefault((phase, group, dtype), [0, 0, src])
                row[0] += times
                row[1] += times * elements
    return tuple((phase, group, dtype, calls, elements, src)
                 for (phase, group, dtype), (calls, elements, src) in rows.items())


def qwz_buffer_terms(buffer_numel: int) -> tuple[Term, ...]:
    """qwZ: an open coalesced all-gather holds its int8 flat buffer (``quant_info.quantized_param``) and the
    fp16 tensor it was dequantized to (``AllGatherCoalescedHandle.wait``: ``dequantize`` returns fp16,
    ``self.partitions`` are views of it) until the coordinator pops the call's last parameter; the fp32 scales
    (1 per ``qwz_groups`` group: under 0.05% of it) are not counted. Not seen at a measured peak (module docstring)."""
    return (Term("qwZ all-gather buffers awaiting their last module (int8 and its fp16 dequantization)",
                 buffer_numel * (BYTES_PER_ELEMENT["int8"] + BYTES_PER_ELEMENT["fp16"]), QWZ_SRC),)  # fmt: skip
