"""DeepSpeed's CPU offload on the engine profile (DeepSpeed 0.19.8): what stays on the GPU, what one rank
keeps in host memory, and the PCIe traffic of a step, read from the optimizer wrappers' code.

``offload_optimizer`` (ZeRO-1/2: stage_1_and_2.py ``DeepSpeedZeroOptimizer`` with ``cpu_offload``; ZeRO-3:
stage3.py ``DeepSpeedZeroOptimizer_Stage3`` with ``offload_optimizer``): the fp32 master partition, its fp32
gradient, Adam's m and v and the step live on the host, where ``DeepSpeedCPUAdam`` updates them
(engine.py ``zero_use_cpu_optimizer``). ZeRO-1/2 keep the full 16-bit flat group on the GPU and copy each
reduced gradient slice of the rank's partition straight into the pinned fp32 gradient
(``async_inplace_copy_grad_to_fp32_buffer_from_gpu``: no ``grads_in_partition`` on the GPU), through a GPU
buffer of the largest parameter (``temp_grad_buffer_for_gpu_offload``); after the step the updated 16-bit
partition comes back through a pinned 16-bit buffer (``param_buffer_of_bit16_for_cpu_offload_groups``) into the
flat group, which is all-gathered in place. ZeRO-3 keeps its gradient partition on the host
(``grad_partitions_flat_buffer`` on ``self.device``, the CPU) and copies the 16-bit partition back after the
step (``_reassign_or_swap_out_partitioned_parameters``; a CPU-to-GPU ``copy_`` converts the dtype on the host).

``offload_param`` (ZeRO-3): the 16-bit partitions live in one pinned host buffer per group
(``_create_param_groups_fp16_flat_cpu_memory``); each all-gather first copies its parameters' partitions to
the GPU (partition_parameters.py ``all_gather_coalesced``: ``ds_tensor.to(device)``), then gathers them.

Not counted: the fp32 copy of a gradient slice made on the GPU before its copy to the host (at most the
largest parameter's slice in fp32, freed at once). NVMe at ZeRO-3: the optimizer's ``nvme.py`` (its NVMe traffic
``nvme.nvme_traffic``), the parameters' ``nvme_param.py`` (the swapper's pool and, with a sub-group beyond
``max_in_cpu``, the reads of every forward and backward); both run with a stand-in for ``async_io``. On a CPU-only run
("device" and "host" are one memory) a measurement sees the sum of the GPU and host predictions.
"""

from __future__ import annotations

from zeroplan.engines.deepspeed.moe_offload import norms_at_hooks
from zeroplan.engines.deepspeed.offload_walk import offload_walk_applies
from zeroplan.engines.deepspeed.nvme import POOL, nvme_traffic, pool_bytes, pool_source, swappable
from zeroplan.engines.deepspeed.nvme_param import PARAM_POOL, SWAP_OUT_BUFFER, ParamSwap, param_swap
from zeroplan.engines.deepspeed.nvme_param import host_terms as param_host_terms
from zeroplan.engines.deepspeed.nvme_param import nvme_traffic as param_nvme_traffic
from zeroplan.engines.deepspeed.offload_settings import OPTIMIZER_BUFFER_COUNT
from zeroplan.engines.deepspeed.offload_terms import (PARAM_NORMS, S12, offloads, on_device, param_norm_count,
                                                      torch_adam_step_temporaries)
from zeroplan.engines.deepspeed.run import DSRun, shared_memo
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES, Settings
from zeroplan.engines.deepspeed.terms import PERSISTENT_PARAMS, aligned_flat_numel
from zeroplan.formulas.offload import HostMemory, Offload
from zeroplan.formulas.peak import Moment, Term
from zeroplan.formulas.sharding import flat_shard_numel

S3 = "runtime/zero/stage3.py"
ADAM_HOST = "Adam m and v (DeepSpeedCPUAdam)"
"""created by the first step (lazy), as on the GPU."""
CPU_ADAM = "ops/adam/cpu_adam.py DeepSpeedCPUAdam.step (exp_avg, exp_avg_sq: torch.zeros_like on the host partition)"
ADAM_HOST_TORCH = "Adam m and v (torch's Adam, torch_adam)"
"""with ``optimizer.params.torch_adam``: torch's Adam/AdamW steps the host partitions (engine.py
``get_optimizer_configuration``); its states as DeepSpeedCPUAdam's, its step temporaries ``HostMemory.step_terms``
(offload_terms.py ``torch_adam_step_temporaries``)."""
TORCH_ADAM = "torch/optim/adam.py _init_group (exp_avg, exp_avg_sq: torch.zeros_like on the host partition)"


ACCUMULATED = "accumulated gradients of the partition's parameters"
"""ZeRO-2 with ``offload_optimizer`` and G > 1: the host buffers ``async_accumulate_grad_in_cpu_via_gpu`` makes at a
hook of the first micro-step (lazy: none after init) and keeps. ZeRO-1 makes none: the engine reduces only at the
boundary (engine.py ``allreduce_gradients``), the micro-steps' gradients stay in ``param.grad``. Measured (Mixtral
bf16, 5e8 buckets, G = 2, N_d = 2, both ranks; tests/test_deepspeed_moe_opt.py): init 14.5-16.1 % and ZeRO-1's
step 9.5-10.6 % over with it at init and at ZeRO-1, now as at G = 1."""


def _adam_host(run: DSRun, part: int) -> Term:
    """Adam's m and v of the host partition: DeepSpeedCPUAdam's, or torch's with ``torch_adam``."""
    if run.settings.torch_adam:
        return Term(ADAM_HOST_TORCH, 2 * part * 4, TORCH_ADAM, 2)
    return Term(ADAM_HOST, 2 * part * 4, CPU_ADAM, 2)

def _pin(t, name: str) -> str:
    return f"{name} (pinned)" if t.pin_memory else name


def host_terms(run: DSRun) -> tuple[Term, ...]:
    """One rank's host memory under offload, each term naming the DeepSpeed function that allocates it: the run's
    wrapper's (``WrapperOffload.host_terms``: ``zero3_host_terms``, ``flat_host_terms``)."""
    return run.wrapper.offload.host_terms(run)


def zero3_host_terms(run: DSRun) -> tuple[Term, ...]:
    """``DeepSpeedZeroOptimizer_Stage3`` (stage3.py): the optimizer's partitions (``offload_optimizer``; nvme:
    ``nvme_host_terms``) and the 16-bit parameter partition (``offload_param``; nvme: nvme_param.py)."""
    s, part = run.settings, flat_shard_numel(run.numels, run.nd)
    p, g = DTYPE_BYTES[s.dtype], DTYPE_BYTES[s.grad_dtype]
    o = s.offload_optimizer
    out: list[Term] = []
    if o.device == "nvme":
        out += nvme_host_terms(run, part)
    elif o.on:
        out += [Term("fp32 master partition", part * 4, f"{S3} _create_fp32_partitions (.to(cpu), clone)"),
                Term(_pin(o, "gradient partition"), part * g,
                     f"{S3} _setup_for_real_optimizer (grad_partitions_flat_buffer on the CPU)"),
                Term(_pin(o, "fp32 gradient of the master partition"), part * 4,
                     f"{S3} initialize_optimizer_states (subgroup_gradient_buffer)"),
                _adam_host(run, part)]  # fmt: skip
    if s.offload_param.device == "nvme":  # the swapper's pool and what stays on the host (nvme_param.py)
        out += param_host_terms(_param_swap(run), s.offload_param.pin_memory)
    elif s.offload_param.on:  # pinned whatever pin_memory says (get_accelerator().pin_memory, unconditional)
        out.append(Term("16-bit parameter partition (pinned)", part * p,
                        f"{S3} _create_param_groups_fp16_flat_cpu_memory (param_groups_fp16_flat_cpu_memory)"))
    return tuple(out)


def flat_host_terms(run: DSRun) -> tuple[Term, ...]:
    """``DeepSpeedZeroOptimizer`` with ``cpu_offload`` (stage_1_and_2.py, ZeRO-1/2): the fp32 partition, its
    gradient, the 16-bit partition buffer, the staging buffer of the largest tensor, Adam's states; ZeRO-2
    accumulating, the partition's gradients between micro-steps (``ACCUMULATED``)."""
    s, numels, nd = run.settings, run.numels, run.nd
    p, o = DTYPE_BYTES[s.dtype], s.offload_optimizer
    if not o.on:
        return ()
    part = aligned_flat_numel(numels, nd) // nd
    out = [Term(_pin(o, "fp32 master partition"), part * 4, f"{S12} __init__ (single_partition_of_fp32_groups)"),
           Term(_pin(o, "fp32 gradient partition"), part * 4,
                f"{S12} initialize_optimizer_states (single_grad_partition, kept as the master's .grad)"),
           Term(_pin(o, "16-bit partition buffer"), part * p,
                f"{S12} __init__ (param_buffer_of_bit16_for_cpu_offload_groups)"),
           Term(_pin(o, "gradient buffer of the largest tensor"), max(numels) * p,
                f"{S12} __init__ (temp_grad_buffer_for_cpu_offload)"),
           _adam_host(run, part)]  # fmt: skip
    if run.grad_accum > 1 and s.partition_gradients:  # each partition parameter's gradient, whole, between micro-steps
        held = max(run.flat.params_numel(r) for r in run.ranks)  # (ZeRO-1 reduces at the boundary only: none)
        out.append(Term(_pin(o, ACCUMULATED), held * p,
                        f"{S12} async_accumulate_grad_in_cpu_via_gpu (accumulated_grads_in_cpu, made at the first "
                        "micro-step's hooks, kept)"))
    return tuple(out)


def _param_swap(run: DSRun) -> ParamSwap:
    s = run.settings
    if s.device == "cpu" and s.dtype == "fp32":  # read in partition_parameters.py; refused rather than predicted
        raise ValueError("deepspeed config: zero_optimization.offload_param.device='nvme' with an fp32 model on the CPU "
                         "accelerator: DeepSpeed's swapper is bf16 there (partition_parameters.py Init._set_dtype: "
                         "'dtype or torch.float16 if is_fp16_supported() else torch.bfloat16'); not modelled")  # fmt: skip
    return param_swap(s.offload_param, run.numels, run.nd, DTYPE_BYTES[s.dtype], s.param_persistence_threshold)


def nvme_host_terms(run: DSRun, part: int) -> list[Term]:
    """ZeRO-3 ``offload_optimizer.device: nvme`` (nvme.py): the pinned swap pool, the gradient partition; a
    sub-group too small to swap keeps the cpu terms beside the pool (``swappable``)."""
    s = run.settings
    o, g = s.offload_optimizer, DTYPE_BYTES[s.grad_dtype]
    count = OPTIMIZER_BUFFER_COUNT if o.buffer_count is None else o.buffer_count
    out = [Term(f"{POOL} (from source, unmeasured) (pinned)", pool_bytes(part, count),
                pool_source(), count),
           Term(_pin(o, "gradient partition"), part * g,
                f"{S3} _setup_for_real_optimizer (grad_partitions_flat_buffer on the CPU)")]  # fmt: skip
    if not swappable(part):
        out += [Term("fp32 master partition", part * 4, f"{S3} _create_fp32_partitions (.to(cpu), clone)"),
                Term(_pin(o, "fp32 gradient of the master partition"), part * 4,
                     f"{S3} initialize_optimizer_states (subgroup_gradient_buffer)"),
                _adam_host(run, part)]  # fmt: skip
    return out


FETCHED = "offloaded partitions copied to the GPU"


def _fetch_term(run: DSRun) -> Term:
    """``offload_param``: the largest module's partitions copied to the GPU before its all-gather."""
    largest = max((sum(-(-n // run.nd) for n in m) for m in run.modules), default=0)
    return Term(f"{FETCHED} for the all-gather (largest module)",
                largest * DTYPE_BYTES[run.settings.dtype],
                "runtime/zero/partition_parameters.py all_gather_coalesced (ds_tensor.to(device))")  # fmt: skip


def offload_moments(run: DSRun, moments: tuple[Moment, ...]) -> tuple[Moment, ...]:
    """``moments`` (the wrapper's, GPU model states already ``on_gpu``) without what offload makes on the host
    (``HOST_TEMPORARIES``) and, with ``offload_param``, with the fetched partitions beside gathered parameters;
    then the wrapper's own (``WrapperOffload.moments``: ZeRO-3's ``_zero3_offload_moments``, ZeRO-1/2's hook upcast
    ``hook_upcasts`` and ``offload_walk.stage1_offload_walk``)."""
    s = run.settings
    if not offloads(s):
        return moments
    fetch = _fetch_term(run) if s.offload_param.on else None
    out = []
    for m in moments:
        terms = m.terms
        if s.offload_optimizer.on:
            terms = on_device(terms)  # offload_terms.py ``HOST_TEMPORARIES``
        if fetch is not None and m.phase in ("forward", "backward") and any(t.name.startswith("gathered") for t in terms):
            terms = (*terms, fetch)
        out.append(m if terms is m.terms else Moment(m.phase, m.name, terms, m.rank))
    return run.wrapper.offload.moments(run, tuple(out))


ZERO3_STATES_INIT = "initialize_optimizer_states (offload_optimizer)"
"""ZeRO-3's init moment whose host buffers ``host_at_states_init`` lists (``offload_one_memory.py``)."""
POST_STEP = "_post_step: persistent parameters gathered again"
STEP_ENTRY = "step entry: persistent parameters still gathered, the parameters' norms kept"
FP64_NORM = "global-norm temporaries (fp64)"


def _zero3_offload_moments(run: DSRun, moments: list[Moment]) -> list[Moment]:
    """ZeRO-3 with ``offload_optimizer`` (stage3.py): the norm's temporaries in fp32
    (``complete_grad_norm_calculation_for_cpu_offload``: ``WrapperOffload.fp32_norm``, offload_terms.py); a moment at
    ``initialize_optimizer_states`` (the GPU holds the 16-bit partition, the host ``host_at_states_init``); and
    one at the end of ``step``: ``_post_step`` gathers the persistent parameters again (``_partition_all_parameters``
    freed them at the step's start) while the norm scalars and the micro-batch are still alive. Without offload
    the update's fp32 temporaries on the GPU are larger; with it they are on the host, and this moment is the
    step's GPU peak. Measured (gpt-tiny bf16, N_d = 2, persistence threshold 100, a storage tracer beside
    MemTracker at the step's peak): the 14 persistent tensors' 1,008 B and four 4-B fp32 norm scalars alive there.
    Each parameter's fp64 gradient norm (``PARAM_NORMS``, offload_terms.py ``param_norm_count``) is kept from its
    bucket's reduction in backward until ``_post_step -> reset_cpu_buffers``, which runs before the persistent
    re-gather; and before ``step`` frees the persistent parameters (``_partition_all_parameters``) both are alive
    (``STEP_ENTRY``). Measured (dsres, 2026-12-02, MemTracker's live bytes at entry and exit of ``step``,
    ``_get_norm_groups``, ``unscale_and_clip_grads``, ``_post_step``, ``reset_cpu_buffers``; same row): N_d = 2, the
    step's peak 374,989 B at ``step``'s entry, 1,008 B freed by ``_partition_all_parameters``, 224 B (28 norms) by
    ``reset_cpu_buffers``: exact (212 B under before); N_d = 1 (nothing persistent gathered), the update with the
    norms, 16 B under (a scalar of ``unscale_and_clip_grads``; 240 B before)."""
    persistent = next((t for m in moments for t in m.terms if t.name == PERSISTENT_PARAMS), None)
    count = param_norm_count(run.numels, run.nd, run.settings.rank)  # once (a speed-up, no rule)
    norms = Term(PARAM_NORMS, 8 * count, f"{S3} partition_grads -> _offload_grad_partition_at_boundary "
                 "(norm_for_param_grads); freed by _post_step -> reset_cpu_buffers", count)  # fmt: skip
    out: list[Moment] = []
    for m in moments:
        if m.phase == "init" and m.name == "partitioned parameters gathered once":
            kept = tuple(t for t in m.terms if t.name in ("16-bit parameter partition", "inf/nan tracker"))
            out.append(Moment("init", ZERO3_STATES_INIT, kept))
        if m.phase == "optimizer_step":
            if not any(o.phase == "optimizer_step" for o in out):  # what backward left, before step() frees anything
                out.append(Moment("optimizer_step", STEP_ENTRY, (
                    *(t for t in m.terms if t.name != FP64_NORM), *((persistent,) if persistent else ()), norms)))
            m = Moment(m.phase, m.name, (*(
                Term("global-norm temporaries (fp32 with offload_optimizer)", 3 * 4, t.source, 3)
                if t.name == FP64_NORM else t for t in m.terms), norms))  # fmt: skip
        out.append(m)
    steps = [m for m in out if m.phase == "optimizer_step" and m.name != STEP_ENTRY]
    if steps and persistent is not None:
        out.insert(out.index(steps[-1]) + 1, Moment("optimizer_step", POST_STEP, (*(
            t for t in steps[-1].terms if t.name != PARAM_NORMS), Term(
            persistent.name, persistent.bytes, f"{S3} _post_step -> parameter_offload.py persistent parameters "
            "all-gathered (step -> _partition_all_parameters freed them)", persistent.tensors))))  # fmt: skip
    return out


UNUSED_GRADIENT_BUFFER = "fp32 gradient buffer of the largest sub-group (unused under offload, freed at once)"


def host_at_states_init(run: DSRun) -> tuple[Term, ...]:
    """ZeRO-3 (its ``WrapperOffload.host_at_states_init``) with ``offload_optimizer``: the host at
    ``initialize_optimizer_states`` (stage3.py), its init peak. The fp32 master, the 16-bit partition (``offload_param``), the master's fp32 gradient
    (``subgroup_gradient_buffer``) and ``gradient_buffer``: ``torch.zeros(largest_numel, fp32, device=self.device)``,
    made before the loop for the sub-groups that are not offloaded, unused under offload (``self.device`` is the
    CPU) and freed on return; the gradient partition (``grad_partitions_flat_buffer``) comes after. One sub-group
    (DeepSpeed's default ``sub_group_size`` 1e9 elements; the profile does not read it): ``largest_numel`` is the
    partition. Measured (gpt-tiny bf16, N_d = 2, rank 0, a storage tracer beside MemTracker): 3 x 72,648 B of fp32
    partitions and the 36,324-B 16-bit partition at the init peak, 254,269 B with the inf/nan tracker. With
    ``device: nvme`` the swap pool (nvme.py) is there too; a swapped partition has no fp32 master or gradient on the
    host (from source, not measured at this moment)."""
    if not run.settings.offload_optimizer.on:
        return ()
    part = flat_shard_numel(run.numels, run.nd)
    keep = ("fp32 master partition", "fp32 gradient of the master partition", "16-bit parameter partition",
            POOL, PARAM_POOL, SWAP_OUT_BUFFER, "16-bit partitions too small to swap")
    return (*(t for t in host_terms(run) if t.name.startswith(keep)),
            Term(UNUSED_GRADIENT_BUFFER, part * 4, f"{S3} initialize_optimizer_states (gradient_buffer)"))


def _slice_numel(run: DSRun, i: int) -> int:
    """Elements of parameter ``i`` in the described rank's slice of the flat group; every rank described
    (``settings.rank`` None): the parameter or a whole slice, whichever is smaller (a bound on any rank's piece)."""
    lo, hi = run.flat.offsets[i], run.flat.offsets[i + 1]
    part, rank = run.flat.part, run.settings.rank
    if rank is None:
        return min(hi - lo, part)
    return max(0, min(hi, (rank + 1) * part) - max(lo, rank * part))


def _upcast_by_block(run: DSRun) -> dict[int | None, int]:
    """Block -> the largest fp32 upcast (bytes) a hook of that block's parameters makes on the ranks described;
    None: any parameter (the moments after the blocks, and those not tied to one block)."""
    out: dict[int | None, int] = {}
    blocks = run.param_blocks or (-1,) * len(run.numels)
    for i, b in enumerate(blocks):
        n = _slice_numel(run, i) * 4
        out[b] = max(out.get(b, 0), n)
        out[None] = max(out.get(None, 0), n)
    return out


def hook_upcasts(run: DSRun, moments: tuple[Moment, ...]) -> tuple[Moment, ...]:
    """ZeRO-1/2 (its ``WrapperOffload.moments``) with ``offload_optimizer``: each moment with the fp32 copy of a
    gradient slice its hooks make (``_hook_upcast``)."""
    s = run.settings  # none without offload or in fp32; none where the norm's fp64 copies are counted at the reductions
    # (the walk's moments, a sparse model's hooks: moe_offload.py); the run's tests once, not per moment
    if not s.offload_optimizer.on or s.grad_dtype == "fp32" or offload_walk_applies(s, sum(run.numels)) or norms_at_hooks(run):
        return tuple(moments)
    by_block = shared_memo("upcast by block", (run.flat, run.param_blocks), (s.rank,), lambda: _upcast_by_block(run))
    out = []
    for m in moments:
        upcast = _hook_upcast(run, m, by_block) if by_block else None
        out.append(m if upcast is None else Moment(m.phase, m.name, (*m.terms, upcast)))
    return tuple(out)


def _hook_upcast(run: DSRun, moment: Moment, by_block: dict[int | None, int]) -> Term | None:
    """ZeRO-1/2 with ``offload_optimizer`` and 16-bit gradients: each hook copies the rank's slice of a gradient
    to fp32 on the GPU, three times in turn (``set_norm_for_param_grad_in_gpu``: ``.to(norm dtype)``;
    ``_has_inf_or_nan``: ``.float()``; ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``: ``.to(fp32)``), one
    alive at a time: the largest slice of the parameters whose hooks fire in that moment's block (the last
    block's at the last block; none before the first hook, at the loss and the LM head; any elsewhere). Measured:
    gpt-tiny bf16 at N_d = 2, rank 1 (the last block's parameters) holds it at its backward peak, rank 0 (the
    first half of the flat group) does not. Not on a sparse model reducing from the hooks (moe_offload.py
    ``norms_at_hooks``): there the fp64 norm copy is counted at each reduction, none elsewhere (bf16, N_d = 2, 300,000-
    and 1,000,000-element buckets: up to 1,048,952 B (4.9 %) over with the upcast)."""
    s = run.settings  # the run's own tests (no offload, fp32 gradients, the walk's or a sparse model's reductions):
    if moment.phase != "backward":  # ``hook_upcasts``', once per run
        return None
    L = run.acts.n_layer
    if moment.name.startswith(("cross-entropy backward", "LM head backward")):
        return None
    in_block = moment.name.startswith("last block backward") or (moment.name.startswith("block ")
                                                                  and moment.name.split()[1].isdigit())
    if in_block and not s.partition_gradients:  # ZeRO-1 copies to the host after backward, not in the blocks
        return None  # (measured: gpt-tiny bf16 at N_d = 2, both ranks' backward peak without it, at the loss)
    if moment.name.startswith("last block backward"):
        numel = by_block.get(L - 1, 0)
    elif moment.name.startswith("block ") and moment.name.split()[1].isdigit():
        numel = by_block.get(int(moment.name.split()[1]), 0)
    else:
        numel = by_block.get(None, 0)
    return Term("fp32 copy of a gradient slice (norm, overflow check, copy to the host)", numel,
                f"{S12} set_norm_for_param_grad_in_gpu, async_inplace_copy_grad_to_fp32_buffer_from_gpu") if numel else None


def host_memory(run: DSRun) -> HostMemory:
    """One rank's offload record: its host terms and one optimizer step's PCIe traffic.

    The PCIe bytes (``WrapperOffload.traffic``): ZeRO-1/2: each reduced gradient slice of the partition goes to
    the host in fp32 at the boundary (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``), the 16-bit partition
    comes back after the step. ZeRO-3: the gradient partition goes down every micro-step in the gradient dtype, the
    16-bit partition comes back after the step; ``offload_param``: every micro-step's forward and backward fetch
    every partition (``ds_tensor.to(device)``), and without ``offload_optimizer`` the updated partition goes back
    down. The host's init peak: ZeRO-3 ``offload_optimizer``'s ``host_at_states_init`` (below the steady bytes: 12P
    against 16P + gP). ``device: nvme`` (ZeRO-3): the NVMe bytes of a steady step (``nvme_step_bytes``; None without
    NVMe) and the swapper's first step (nvme.py ``step_terms``)."""
    s, w = run.settings, run.wrapper
    o, prm = s.offload_optimizer.on, s.offload_param.on
    h2d, d2h = w.offload.traffic(run)
    offload = Offload(s.offload_optimizer.device if o else "none", s.offload_param.device if prm else "none")
    read, write = w.offload.nvme_step_bytes(run)
    step = (torch_adam_step_temporaries(s, w.partition_numel(s, run.numels, run.nd)), *w.offload.nvme_step_terms(run))
    lazy = (ADAM_HOST, ADAM_HOST_TORCH, ACCUMULATED, _pin(s.offload_optimizer, ACCUMULATED))
    return HostMemory(offload, host_terms(run), h2d, d2h, lazy=lazy,
                      init_peak=w.offload.host_at_states_init(run), nvme_read_bytes=read, nvme_write_bytes=write,
                      nvme_note=_nvme_note(s),
                      step_terms=tuple(t for t in step if t is not None))  # fmt: skip


def nvme_step_bytes(run: DSRun) -> tuple[int | None, int | None]:
    """(read, write) NVMe bytes of one steady optimizer step at ZeRO-3 (its ``WrapperOffload.nvme_step_bytes``; the
    settings refuse nvme below ZeRO-3, ``nvme.check_nvme``), (None, None) without NVMe: the optimizer's
    (``offload_optimizer.device: nvme``, ``nvme.nvme_traffic``: the partition and each parameter's partition slice,
    ``ceil(n / N_d)`` elements, ZeRO-3 pads every parameter to a multiple of N_d; (0, 0) when the partition is too
    small to swap) and the parameters' (``offload_param.device: nvme``, ``nvme_param.nvme_traffic``)."""
    s = run.settings
    opt, prm = s.offload_optimizer.device == "nvme", s.offload_param.device == "nvme"
    if not (opt or prm):
        return None, None
    slices = tuple(-(-n // run.nd) for n in run.numels)
    read, write = nvme_traffic(flat_shard_numel(run.numels, run.nd), slices) if opt else (0, 0)
    if prm:
        r, w = param_nvme_traffic(_param_swap(run), run.grad_accum, s.max_reuse_distance)
        read, write = read + r, write + w
    return read, write


def _nvme_note(s: Settings) -> str:
    """What ``nvme_step_bytes`` counts, for the line under ``estimate``'s table ("" without NVMe)."""
    what = [w for w, on in (("fp32 master, Adam m and v, the swapped fp32 gradient slices; DeepSpeed's source, "
                             "nvme.nvme_traffic", s.offload_optimizer.device == "nvme"),
                            ("the swapped 16-bit partitions beyond max_in_cpu, read in forward, written by the step; "
                             "nvme_param.nvme_traffic", s.offload_param.device == "nvme")) if on]  # fmt: skip
    first = "; the first step reads the master only of the three." if s.offload_optimizer.device == "nvme" else "."
    return f"({'; and '.join(what)}){first}" if what else ""


def offload_label(s: Settings) -> str:
    """``offload optimizer->cpu``, ``offload optimizer->cpu, params->cpu`` ("offload none" without offload)."""
    return "offload " + Offload(s.offload_optimizer.device, s.offload_param.device).label


def label_suffix(s: Settings) -> str:
    """``, offload optimizer->cpu`` for the row's label ("" without offload)."""
    return f", {offload_label(s)}" if offloads(s) else ""
