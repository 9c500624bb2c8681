"""The optimizer wrapper DeepSpeed builds, chosen once from the settings (``wrapper_for``), and what asks it:
the run (``ds_run``), its buffers (``terms``, ``memory_breakdown``) and its collectives (``collectives``).

DeepSpeed's engine picks one class per run (runtime/engine.py ``_configure_optimizer``), and so does the
profile: ``run.Wrapper`` is what each one allocates, sends, gathers, the moments only it has and its offload
(``Wrapper.offload``: offload_wrappers.py); ``phases.py`` walks the phases and, like the offload modules, asks the
run's wrapper, never the stage (tests/test_deepspeed_stage_readers.py). This module is the only one that imports
the wrappers, above them; the pieces they share (``run``, ``phases``, ``terms``, ``collectives``)
import none of them.

- ``DeepSpeedZeroOptimizer`` (runtime/zero/stage_1_and_2.py; ZeRO-1 and 2): ``zero12.py``
- ``BF16_Optimizer`` (runtime/bf16_optimizer.py; ZeRO-1, bf16 with fp32 gradients): ``bf16.py``
- ``DeepSpeedZeroOptimizer_Stage3`` (runtime/zero/stage3.py): ``zero3.py``
"""

from __future__ import annotations

from typing import Optional

from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed.bf16 import BF16_OPTIMIZER
from zeroplan.engines.deepspeed.collectives import DSCollective
from zeroplan.engines.deepspeed.offload_terms import offload_collectives, on_gpu
from zeroplan.engines.deepspeed.run import DSRun, Wrapper, _init_gathers, _layout, _trace, head_tied
from zeroplan.engines.deepspeed.settings import DTYPE_BYTES, Settings, optimizer_class
from zeroplan.engines.deepspeed.terms import DSTerm
from zeroplan.engines.deepspeed.trace import Stage3Trace
from zeroplan.engines.deepspeed.zero3 import ZERO3_OPTIMIZER
from zeroplan.engines.deepspeed.zero12 import ZERO12_OPTIMIZER
from zeroplan.formulas.activation_terms import model_activations
from zeroplan.formulas.memory import MemoryBreakdown

WRAPPERS: dict[str, Wrapper] = {w.name: w for w in (ZERO12_OPTIMIZER, BF16_OPTIMIZER, ZERO3_OPTIMIZER)}
"""DeepSpeed's class name -> the wrapper's profile."""


def wrapper_for(s: Settings) -> Wrapper:
    """The wrapper DeepSpeed builds for ``s`` (``optimizer_class``)."""
    return WRAPPERS[optimizer_class(s)]


def ds_run(settings: Settings, workload: Workload, nd: int, stat_bytes: Optional[int] = None) -> DSRun:
    """The run of ``workload`` under ``settings``; activations in the model dtype, LayerNorm statistics in
    ``stat_bytes`` (None: 4, as CUDA keeps them; on CPU they take the input dtype)."""
    spec = workload.spec
    if spec is None:
        raise ValueError("the DeepSpeed peak needs an architecture (a model), not bare tensor sizes")
    a = DTYPE_BYTES[settings.dtype]
    acts = model_activations(spec, workload.micro_batch, workload.seq_len, act_bytes=a,  # cached there
                             stat_bytes=4 if stat_bytes is None else stat_bytes)
    numels, final, modules, blocks, outputs = _layout(workload)
    foreach = settings.foreach if settings.foreach is not None else workload.foreach
    return DSRun(settings, numels, nd, acts, spec.vocab_size * spec.d_model, final,
                 head_tied(workload), wrapper_for(settings), workload.checkpointing,
                 bool(foreach), workload.grad_accum, modules, *_trace(workload), blocks, outputs, spec,
                 workload.transformers, _init_gathers(workload) if workload.transformers and settings.hf_zero3_build
                 else ())  # fmt: skip


def terms(s: Settings, numels: tuple[int, ...], nd: int) -> tuple[DSTerm, ...]:
    """Every buffer of model states and buckets on one rank, for parameters of ``numels`` elements
    (``model.named_parameters()`` order) at N_d = ``nd``: the list of the wrapper DeepSpeed builds, on the GPU
    (offload's host terms: ``offload.host_terms``)."""
    return on_gpu(wrapper_for(s), s, numels, nd)


def ds_estimate_bytes(s: Settings, numels: tuple[int, ...], nd: int) -> int:
    """DeepSpeed's own estimator for this run: the one of the file of its wrapper (``Wrapper.ds_estimate``,
    estimator.py), shown beside the prediction, never used for it."""
    return wrapper_for(s).ds_estimate(s, numels, nd)


def memory_breakdown(s: Settings, numels: tuple[int, ...], nd: int) -> MemoryBreakdown:
    """Model states after a step, as params (16-bit and persistent gathered), grads, optimizer (master, m, v,
    scalars) and the ZeRO-3 bucket counted with the gradients (it holds them)."""
    params = grads = opt = 0
    for t in terms(s, numels, nd):
        if t.live == "backward":
            continue
        if "parameter" in t.name:
            params += t.bytes
        elif "gradient" in t.name or "bucket" in t.name:
            grads += t.bytes
        else:
            opt += t.bytes
    return MemoryBreakdown(params, grads, opt)


def collectives(s: Settings, numels: tuple[int, ...], nd: int, grad_accum: int = 1,
                trace: Optional[Stage3Trace] = None) -> tuple[DSCollective, ...]:
    """One steady-state step's collectives (the second step on: ZeRO-3's first step records its trace).

    ``grad_accum`` micro-steps per step (measured at 2): ZeRO-2 reduces every micro-step, ZeRO-3 gathers
    in every micro-step's forward and reduce-scatters in every backward; ZeRO-1 and BF16_Optimizer reduce at
    the boundary only (engine.py ``allreduce_gradients``).

    ``numels`` in parameter order. Stage 1 reduces after backward in parameter order
    (``reduce_gradients`` walks ``bit16_groups``: calls exact); stage 2 and 3 in gradient-ready order
    (autograd's; the call count is the parameter-order bucket count, a bound, not exact).

    At N_d = 1 DeepSpeed still reduces (every bucket's all-reduce or reduce-scatter, the norm, the overflow
    check) but gathers nothing: runtime/utils.py ``all_gather_dp_groups`` skips a group of one
    (``dp_world_size == 1: continue``), partition_parameters.py ``all_gather_coalesced`` returns
    ``_no_gather_coalesced`` when every ``_partition_world_size`` is 1. Measured (gpt-tiny bf16, world size 1,
    ZeRO-1/2/3, with and without offload_optimizer): exactly the calls at N_d = 2 less the all-gathers.
    """
    w = wrapper_for(s)
    out = offload_collectives(w, s, w.collectives(s, numels, nd, grad_accum, trace))
    return out if nd > 1 else tuple(c for c in out if c.op != "all-gather")
