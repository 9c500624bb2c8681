"""What the DeepSpeed runner changes in the DeepSpeed it measures, each change in one place.

Every report row lists the changes made for it (``runner_changes``, ``ReportRow.runner_changes``):
- ``GlooSettled``: DeepSpeed's collectives made synchronous (gloo lets go of the tensors, and of its own buffers,
  first); a run with ``"settle": false`` leaves DeepSpeed's own asynchronous handles (measured against it:
  docs/engines). ``OffThreadFrees``: each row counts the frees MemTracker saw run off the rank's thread.
- ``fp16_on_cpu``: DeepSpeed's fp16 capability question answered yes on a CPU without oneDNN fp16.
- ``run_state_kept``, around ``validate.engines.deepspeed.measure``: the cyclic garbage collector off while
  measuring, ``torch.nn.functional.linear`` restored after a ``zero.Init`` run (``build_model``), hpZ's process
  group forgotten after every run (DeepSpeed keeps it in a module global, and a later ZeRO-3 config of the
  same world would take it, secondary partitions and all, whatever its own ``zero_hpz_partition_size``; a later
  ``zero.Init`` with hpZ asserts); in ``validate.engines.deepspeed``: the inference-only
  ``deepspeed_shm_comm`` op never built (``main``); one intra-op thread per rank (``validate.harness``).
"""

from __future__ import annotations

import contextlib
import gc
import time

from validate.engines.gloo_holds import python_refs, use_counts

SETTLED_OPS = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced",
               "all_to_all_single", "all_to_all", "gather", "scatter")  # fmt: skip


class _Completed:
    """The handle an asynchronous DeepSpeed collective gets back once ``GlooSettled`` has finished it."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class GlooSettled:
    """Every collective DeepSpeed issues (``deepspeed/comm/comm.py``: all through its backend object ``cdb``,
    ``comm/torch.py TorchBackend``) returns only once gloo has let go of its tensors.

    gloo's worker thread keeps the finished work, and with it every tensor of the call, a moment after
    ``wait()`` returns (``ProcessGroupGloo::runLoop`` resets ``workInProgress_`` after marking the future
    done). A buffer DeepSpeed frees right after (ZeRO-1/2 ``allreduce_bucket``'s flattened copy, a ZeRO-3
    parameter released after its gather) then stays alive on some ranks of some runs and not others. Here a
    call waits for its work (asynchronous ones too: the caller gets a finished handle), drops it, and spins
    until the use counts of every tensor it was given, of the tensor itself (``Tensor._use_count``: gloo's
    all-reduce keeps the tensor) and of its storage (``torch._C._storage_Use_Count``: the all-gather keeps
    chunks of it), are back to what they were before the call, and so is each tensor's Python reference count
    (``gloo_holds.python_refs``: torch's gloo path keeps a Python reference to the tensor object a moment longer and
    drops it on gloo's thread; a rank dropping its own in that moment left the object, and a view's base with it,
    to be freed there: ZeRO-1's 20,000 B bucket buffer read in one rank's optimizer step, +5,656 B at N_d = 4,
    docs/benchmarks.md 2026-12-02): the only other holder is gloo, so that is the moment gloo is done:
    deterministic, no timing guess. Nothing is allocated by this wrapper; ops stay the same
    (the dispatch-level ``CommCounter`` sees them unchanged). Async calls become synchronous: on CPU gloo
    overlaps nothing with compute that changes a buffer's life (DeepSpeed allocates before it issues).
    A buffer gloo makes itself is settled the same way (``_Returned``): gloo's reduce-scatter reduces into a
    buffer of its own, which its work keeps, and ``wait()`` copies this rank's chunk out of it (``aten.split``
    and ``aten.copy_`` on the waiting thread); freed when the last of the caller's handle and gloo's worker
    thread lets go, the memory probe counted its free on gloo's thread, at whatever moment gloo let go (seen
    at ZeRO-3: 576 to 10,368 B buffers, 2026-12-02). Here the call holds every tensor its ops read or made
    that shares no storage with the caller's until the call alone holds it, then drops it, on the rank's
    own thread, at the end of the call.
    ``stats``: calls, calls that found gloo still holding a tensor, the longest wait, and calls that gave
    up after ``deadline_s`` (counted, never hidden: a row reports them).
    """

    def __init__(self, backend, deadline_s: float = 5.0) -> None:
        self.backend, self.deadline_s = backend, deadline_s
        self.stats = {"calls": 0, "held": 0, "max_wait_s": 0.0, "unsettled": 0}
        self._originals: dict = {}

    @staticmethod
    def _tensors(args, kwargs) -> list:
        import torch

        out = []
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    out.append(t)
        return out

    def _wrap(self, original):
        count = use_counts  # gloo_holds: the tensor's and its storage's use counts

        def call(*args, **kwargs):
            tensors = self._tensors(args, kwargs)
            before = [count(t) for t in tensors]
            refs = python_refs(tensors)  # gloo's thread keeps a Python reference a moment longer (gloo_holds)
            with _Returned() as returned:
                works = original(*args, **kwargs)
                asked_async = works is not None
                works = list(works) if isinstance(works, (list, tuple)) else [works]
                while works:  # each handle dropped once finished: it holds the call's tensors too
                    work = works.pop()
                    if work is not None and hasattr(work, "wait"):
                        work.wait()
                    del work
            own = returned.own_storages(tensors)  # gloo's own buffers: the call's alone once gloo is done
            t0 = time.monotonic()
            held = False
            while (any(c > b for t, pair in zip(tensors, before) for c, b in zip(count(t), pair))
                   or any(storage_use_count(st._cdata) > 1 for st in own)
                   or any(now > was for now, was in zip(python_refs(tensors), refs))):  # fmt: skip
                held = True
                if time.monotonic() - t0 > self.deadline_s:
                    self.stats["unsettled"] += 1
                    break
                time.sleep(0.0002)
            del own  # gloo's own buffers freed here, on this thread
            self.stats["calls"] += 1
            self.stats["held"] += held
            self.stats["max_wait_s"] = max(self.stats["max_wait_s"], round(time.monotonic() - t0, 4))
            return _Completed() if asked_async else None

        return call

    def __enter__(self) -> GlooSettled:  # noqa: PYI034 - typing.Self needs Python 3.11
        for name in SETTLED_OPS:
            if hasattr(self.backend, name):
                self._originals[name] = getattr(self.backend, name)
                setattr(self.backend, name, self._wrap(self._originals[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(self.backend, name, original)


def _returned_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Returned(TorchDispatchMode):
        """Every tensor an op of one collective (its ``c10d`` op, and what ``wait()`` runs) read or made."""

        def __init__(self) -> None:
            super().__init__()
            self.tensors: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch
            from torch.utils._pytree import tree_flatten

            res = func(*args, **(kwargs or {}))
            for t in tree_flatten((args, kwargs, res))[0]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.tensors.append(t)
            return res

        def own_storages(self, given: list) -> list:
            """The storages of the tensors seen that share none with the caller's: gloo's own buffers. The
            tensors are let go of; each storage is then held by the call (one use) and by gloo while it runs."""
            mine = {t.untyped_storage()._cdata for t in given}
            out = {}
            for t in self.tensors:
                st = t.untyped_storage()
                if st._cdata not in mine:
                    out.setdefault(st._cdata, st)
            self.tensors.clear()
            return list(out.values())

    return Returned


def _Returned():  # noqa: N802 - a context manager class, built on first use (torch imported lazily)
    global _Returned
    _Returned = _returned_mode()
    return _Returned()


def storage_use_count(cdata: int) -> int:
    import torch

    return torch._C._storage_Use_Count(cdata)


class OffThreadFrees:
    """How many tracked storages MemTracker saw freed on a thread other than the rank's own (its weakref callback,
    ``mem_tracker.py _delete_callback``, runs on whatever thread drops the storage's last reference): a free at
    no fixed moment of the rank's program. Seen on gloo's worker (thread "pt_gloo_runloop") on loaded machines,
    2026-12-02, N_d = 4: gloo's reduce-scatter buffers at ZeRO-3 (576-10,368 B) before ``GlooSettled`` held
    them; still, now and then, a ZeRO-3 parameter's 144 B while ``zero.Init`` broadcasts the next one
    (``partition_parameters.py _zero_init_param``), and once ZeRO-1's backward bucket buffer (``stage_1_and_2.py
    setup_buckets``, 20,000 B) during the optimizer step (1 rank of 37 worlds), both after the call's use counts
    were back. The bucket's: ZeRO-1 hands gloo a temporary (the last bucket's ``flatten`` of one gradient, a view of
    the buffer) whose Python object gloo keeps a moment longer, which ``GlooSettled`` waits for since
    (``gloo_holds.python_refs``; it was the +5,656 B step reading). ``zero.Init`` hands gloo a temporary too
    (``dist.broadcast(param.data.view(torch.uint8))``): the same pattern, not traced. Every row says how many
    (``gloo_settle.freed_off_thread``; None: no MemTracker, CUDA's allocator)."""

    def __init__(self, tracker) -> None:
        import threading

        self.count, main = 0, threading.main_thread()
        if tracker is None:  # the CUDA probe: the allocator's counters, no MemTracker
            self.count = None
            return
        delete = tracker._delete_callback

        def counted(winfo, ref) -> None:
            if threading.current_thread() is not main:
                self.count += 1
            delete(winfo, ref)

        tracker._delete_callback = counted  # each storage's weakref callback, bound when it is first tracked

    @property
    def stats(self) -> dict:
        return {"freed_off_thread": self.count}


@contextlib.contextmanager
def fp16_on_cpu(config: dict):
    """Run an fp16 ``config`` on the CPU accelerator: yields whether DeepSpeed's capability check was overridden.

    DeepSpeed refuses fp16 on a CPU whose oneDNN has no fp16 kernels (``accelerator/cpu_accelerator.py``
    ``is_fp16_supported``: AVX512-FP16 or AMX-FP16; ``runtime/engine.py _do_sanity_check`` raises "Type fp16 is
    not supported on your device."), though torch's own CPU kernels run fp16. For an fp16 config this answers
    that one question yes for the run, so DeepSpeed's fp16 path runs as written (its optimizer, loss scaler
    and overflow checks: the allocations and collectives measured); only the kernels are torch's CPU ones."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    wanted = bool(config.get("fp16", {}).get("enabled")) and accelerator.device_name() == "cpu"
    if not wanted or accelerator.is_fp16_supported():
        yield False
        return
    accelerator.is_fp16_supported = lambda: True
    try:
        yield True
    finally:
        del accelerator.is_fp16_supported


@contextlib.contextmanager
def quantizer_on_cpu(config: dict, local_size: int | None = None):
    """ZeRO++ qwZ/qgZ on the CPU accelerator: DeepSpeed's CUDA quantizer op replaced by the Python stand-in
    (``validate.engines.deepspeed_quantizer``: the binding's output shapes and dtypes, allocated once); with
    ``local_size``, the CPU accelerator's ``device_count`` (``accelerator/cpu_accelerator.py``: ``LOCAL_SIZE``,
    else the NUMA nodes with cores: 1 here) for the run, which sets qgZ's ranks per node
    (``utils/groups.py _get_local_all_to_all_group``, ``all_to_all_quant_reduce``). Yields that ``device_count``
    (each row's ``device_count``: ``compare_row`` predicts with it); qgZ's groups are forgotten after the run."""
    import os

    from validate.engines import deepspeed_quantizer

    backend, original = None, None
    if deepspeed_quantizer.uses_quantizer(config):
        deepspeed_quantizer.install()
        if config.get("zero_optimization", {}).get("zero_quantized_weights"):
            import deepspeed.comm.comm as ds_comm

            backend, original = ds_comm.cdb, ds_comm.cdb.all_gather_into_tensor
            backend.all_gather_into_tensor = _flat_input(original)
    was = os.environ.get("LOCAL_SIZE")
    if local_size:
        os.environ["LOCAL_SIZE"] = str(local_size)
    try:
        from deepspeed.accelerator import get_accelerator

        yield get_accelerator().device_count()
    finally:
        import deepspeed.utils.groups as ds_groups

        ds_groups._ALL_TO_ALL_GROUP.clear()  # qgZ's groups, made for this run's device_count
        if backend is not None:
            backend.all_gather_into_tensor = original
        if local_size:
            os.environ.pop("LOCAL_SIZE") if was is None else os.environ.update(LOCAL_SIZE=was)


def _flat_input(all_gather_into_tensor):
    """qwZ's scales are [G, 1] (pt_binding.cpp ``quantize_kernel``) and DeepSpeed gathers them into a flat [G·N]
    buffer (partition_parameters.py ``_all_gather_sequential``: ``quant_scale_buffer``); NCCL takes any input of
    the chunk's element count, gloo's ``_allgather_base`` asks for the chunk's shape ("invalid tensor size ...
    expected (1, 1), got (1)"). The input is passed as a flat view of itself: nothing allocated or copied."""

    def call(output_tensor, input_tensor, *args, **kwargs):
        if input_tensor.dim() != output_tensor.dim() and input_tensor.is_contiguous():
            input_tensor = input_tensor.view(-1)
        return all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs)

    return call


@contextlib.contextmanager
def run_state_kept():
    """Around one rank's run (``validate.engines.deepspeed.measure``): Python's cyclic garbage collector off
    (``measure`` collects between phases) and what existed before frozen; after it, torch's ``F.linear`` put
    back (a ``zero.Init`` run's ``zero3_linear_wrap``: ``build_model``) and DeepSpeed's hpZ group forgotten."""
    import torch.nn.functional as F

    linear = F.linear
    gc.collect()
    # what exists before the run (torch, DeepSpeed: ~200k objects) cannot be the run's garbage; frozen, a full
    # collection scans only the run's own objects (0.02 ms instead of 130 ms, measured)
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        F.linear = linear  # zero.Init's zero3_linear_wrap, if any, ends with its run
        # hpZ's secondary group lives in a module global that stage3.py hands to every later ZeRO-3 engine of the
        # process (secondary partitions at any zero_hpz_partition_size): each run makes its own (deepspeed_changes)
        import deepspeed.utils.groups as ds_groups

        ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
        gc.unfreeze()
        if was_enabled:
            gc.enable()

def runner_changes(row: dict) -> list[str]:
    """What this runner changed in the DeepSpeed it measured for ``row`` (``ReportRow.runner_changes``)."""
    out = ["one intra-op thread per rank (OMP_NUM_THREADS=1, validate.harness)"]
    if row["gloo_settle"] is not None:
        out.append("collectives made synchronous: each one through deepspeed.comm's backend waits for its work "
                   "and for gloo to let go of its tensors and of the buffers it made itself (its reduce-scatter's, "
                   "then freed on the rank's own thread), and an asynchronous caller gets a finished handle "
                   "(GlooSettled)")  # fmt: skip
    else:
        out.append("collectives left asynchronous: DeepSpeed's own handles (no GlooSettled)")
    out.append("Python's cyclic garbage collector off while measuring, gc.collect() at every phase boundary, "
               "objects from before the run frozen (measure)")  # fmt: skip
    if row.get("fp16_capability_overridden"):
        out.append("fp16 capability answered yes on CPU (accelerator is_fp16_supported; fp16_on_cpu)")
    if row.get("zero_init"):
        out.append("torch.nn.functional.linear restored after the run (zero.Init's zero3_linear_wrap; build_model)")
    out.append("deepspeed_shm_comm (TorchBackend.inference_all_reduce only) marked incompatible: never built")
    if any(row["config"].get("zero_optimization", {}).get(k) for k in ("zero_quantized_weights",
                                                                        "zero_quantized_gradients")):
        out.append("ZeRO++'s CUDA quantizer op (QuantizerBuilder) replaced by a Python stand-in with its outputs' "
                   "shapes and dtypes (validate/engines/deepspeed_quantizer.py; quantizer_on_cpu); qwZ: the [G, 1] "
                   "scales all-gathered as a flat view (gloo asks for the chunk's shape; _flat_input)")  # fmt: skip
    out.append("ZeRO++ hpZ's process group forgotten after the run (utils/groups.py _ZERO_PARAM_INTRA_PARALLEL_GROUP; "
               "measure): each config of a world makes its own, as a job does")  # fmt: skip
    return out
