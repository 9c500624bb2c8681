"""Train a model through real DeepSpeed ZeRO 1-3 under the validator's independent probes.

One process per rank, started by ``torchrun`` (``run_world`` does it), because DeepSpeed needs what
torchrun sets: ``deepspeed.initialize`` asserts ``LOCAL_RANK`` is in the environment
(``runtime/engine.py`` ``DeepSpeedEngine._do_args_sanity_check``), and ``deepspeed.init_distributed``
reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (``comm/comm.py`` ``init_distributed``).
On CPU: ``DS_ACCELERATOR=cpu`` and the gloo backend (the CPU accelerator's own backend name is
``ccl``, oneCCL, not installed here).

Each rank builds the model (fp32, as users do; DeepSpeed casts it to bf16/fp16 itself), calls
``deepspeed.initialize`` and trains ``steps`` steps, with four phases measured by ``MemoryProbe``
(MemTracker on CPU: every live tensor byte) and every ``c10d`` op recorded by ``CommCounter``:
``init`` (model construction + ``deepspeed.initialize``), ``forward``, ``backward``
(``engine.backward``), ``optimizer_step`` (``engine.step``). Live bytes are read after ``init`` and
after every step. DeepSpeed's first use JIT-builds C++ ops into ``~/.cache/torch_extensions``:
``fused_adam`` when the default Adam is built (``torch_adam: true`` avoids it); ``deepspeed_shm_comm``
(an inference-only all-reduce) is marked incompatible here so it is never built. A row records how long
``deepspeed.initialize`` took so a cold build is visible.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

PHASES = ("init", "forward", "backward", "optimizer_step")
DEFAULT_STEPS = 2


def ds_config(
    stage: int,
    dtype: str = "fp32",
    micro_batch: int = 2,
    lr: float = 1e-3,
    zero: dict | None = None,
    optimizer_params: dict | None = None,
    grad_accum_dtype: str | None = None,
) -> dict:
    """A ds_config dict: ZeRO ``stage``, ``dtype`` in fp32/bf16/fp16, Adam at ``lr``, extra ZeRO keys."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype={dtype!r}: expected fp32, bf16 or fp16")
    config: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": lr, **(optimizer_params or {})}},
        "zero_optimization": {"stage": stage, **(zero or {})},
        "steps_per_print": 10**9,
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return config


def _summarise(calls) -> dict:
    """{"op|phase|dtype": {"calls", "elements"}} per step, from the counter's records (all steps)."""
    out: dict = defaultdict(lambda: {"calls": 0, "elements": 0, "sizes": []})
    for c in calls:
        row = out[f"{c.step}|{c.op}|{c.phase}|{c.dtype}"]
        row["calls"] += 1
        row["elements"] += c.elements
        row["sizes"].append(c.elements)
    return dict(out)


def _cpu_probe():
    """``MemoryProbe`` counting the CPU device only.

    MemTracker keeps a snapshot per device and ``MemoryProbe`` sums them all; DeepSpeed's ZeRO-1/2
    optimizer keeps a meta-device twin of every parameter (``stage_1_and_2.py``
    ``DeepSpeedZeroOptimizer.__init__``: ``round_robin_bit16_meta``, ``torch.zeros_like(p, device="meta")``)
    that MemTracker records as Ψ elements of storage although it holds no memory.
    """
    import torch

    from validate.probes import MemoryProbe

    class CpuMemoryProbe(MemoryProbe):
        def _device_total(self, kind: str) -> int:
            snaps = self.tracker.get_tracker_snapshot(kind)
            return sum(s["Total"] for dev, s in snaps.items() if torch.device(dev).type == "cpu")

        def current_bytes(self) -> int:
            return self._device_total("current")

        def _peak_bytes(self) -> int:
            return self._device_total("peak")

        def by_device(self) -> dict[str, int]:
            return {str(d): s["Total"] for d, s in self.tracker.get_tracker_snapshot("current").items()}

    return CpuMemoryProbe(torch.device("cpu"))


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
    chunks of it), are back to what they were before the call: the only other holder is gloo's work, so
    that is the moment gloo is done: deterministic, no timing guess. Nothing is allocated or freed by this wrapper; ops stay the same
    (the dispatch-level ``CommCounter`` sees them unchanged). Async calls become synchronous: on CPU gloo
    overlaps nothing with compute that changes a buffer's life (DeepSpeed allocates before it issues).
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
        import torch

        def count(t) -> tuple[int, int]:
            # gloo keeps either the tensor itself (all-reduce: the TensorImpl's count) or views of it (all-gather
            # chunks: the storage's count); both are back to their value before the call once it is done
            return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)

        def call(*args, **kwargs):
            tensors = self._tensors(args, kwargs)
            before = [count(t) for t in tensors]
            works = original(*args, **kwargs)
            asked_async = works is not None
            works = list(works) if isinstance(works, (list, tuple)) else [works]
            while works:  # each handle dropped once finished: it holds the call's tensors too
                work = works.pop()
                if work is not None and hasattr(work, "wait"):
                    work.wait()
                del work
            t0 = time.monotonic()
            held = False
            while any(c > b for t, pair in zip(tensors, before) for c, b in zip(count(t), pair)):
                held = True
                if time.monotonic() - t0 > self.deadline_s:
                    self.stats["unsettled"] += 1
                    break
                time.sleep(0.0002)
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


def build_model(model_fn, config: dict, zero_init: bool):
    """``model_fn()`` as built: whole (``zero_init`` false), or under ``deepspeed.zero.Init`` with the run's
    ds_config (ZeRO-3's way for a model larger than one device: runtime/zero/partition_parameters.py ``Init``
    creates each floating-point tensor in the config's dtype and partitions a module's parameters right
    after its ``__init__``, so no rank holds the whole model).

    ``Init`` replaces ``torch.nn.functional.linear`` with ``zero3_linear_wrap`` for good
    (``_enable_mem_efficient_linear``: "persists unless manually reset"): the caller restores it after the
    run (``measure`` puts torch's back), so a later run of the same world trains with torch's."""
    if not zero_init:
        return model_fn()
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=config):
        return model_fn()


def measure(model_fn, config: dict, batches: list, rank: int, nd: int, zero_init: bool = False) -> dict:
    """One rank: build ``model_fn()`` (under ``deepspeed.zero.Init`` when ``zero_init``) and
    ``deepspeed.initialize`` it under the probes, train on ``batches``."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import torch
    import torch.nn.functional as F

    from validate.probes import CommCounter

    counter, probe = CommCounter(), _cpu_probe()
    boundary: dict[str, int] = {}
    linear = F.linear

    def enter(phase: str | None, step: int | None = None) -> None:
        # Python's cyclic garbage collector runs when allocation counts say so: at a different moment on
        # each rank. The probes' own hooks make cycles that hold autograd nodes (MemTracker's ModTracker
        # multi-grad hooks; seen holding a Ψ·4 B tensor at ZeRO-1 and 20 kB at ZeRO-2 until collected), so
        # automatic collection is off while measuring and garbage is collected here, between phases:
        # what a phase makes lives to its end, the same on every rank and every run.
        gc.collect()
        probe.phase(phase)
        counter.phase = phase or "between steps"
        if step is not None:
            counter.step = step

    gc.collect()
    # what exists before the run (torch, DeepSpeed: ~200k objects) cannot be the run's garbage; frozen, a full
    # collection scans only the run's own objects (0.02 ms instead of 130 ms, measured)
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with probe, counter, GlooSettled(ds_comm.cdb) as settled:
            enter("init", -1)
            # the build's own peak is kept apart ("build_peak_bytes") and stays in init's
            probe.phase("build")
            t0 = time.perf_counter()
            model = build_model(model_fn, config, zero_init)
            probe.phase("init")
            engine, optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
            init_s = time.perf_counter() - t0
            del model
            enter(None)
            probe.peaks["init"] = max(probe.peaks["init"], probe.peaks["build"])
            boundary["init"] = probe.settled_bytes()
            accum = config.get("gradient_accumulation_steps", 1)
            step_s = []
            for step in range(len(batches)):
                t0 = time.perf_counter()
                for micro in range(accum):
                    # popped, and dropped before the boundary: MemTracker registers an input the first time
                    # an op reads it, so a batch kept in the list would count at every later boundary
                    batch = batches[step].pop(0)
                    enter("forward", step)
                    loss = engine.module.loss(batch)
                    enter("backward")
                    engine.backward(loss)
                    del loss
                    if micro < accum - 1:  # DeepSpeed's step() only counts the micro-step off the boundary
                        enter(None)
                        engine.step()
                        del batch
                enter("optimizer_step")
                engine.step()
                del batch
                enter(None)
                step_s.append(round(time.perf_counter() - t0, 3))
                boundary[f"step{step}"] = probe.settled_bytes()
            breakdown = probe.breakdown()
            by_device = probe.by_device()
    finally:
        F.linear = linear  # zero.Init's zero3_linear_wrap, if any, ends with its run
        gc.unfreeze()
        if was_enabled:
            gc.enable()
    inner = getattr(optimizer, "optimizer", None)
    row = {
        "rank": rank,
        "world_size": nd,
        "config": config,
        "zero_init": zero_init,
        "optimizer_class": type(optimizer).__name__,
        "inner_optimizer_class": type(inner).__name__ if inner is not None else None,
        "boundary_bytes": boundary,
        "peak_bytes_by_phase": {p: probe.peaks.get(p, 0) for p in PHASES},
        "build_peak_bytes": probe.peaks["build"],  # the model's construction, within init's peak
        "probe_breakdown": breakdown,
        "live_bytes_by_device": by_device,
        "comm": _summarise(counter.calls),
        # every call in order as [op, phase, dtype, elements]: those of init first, then one list per step
        "calls_by_step": [
            [[c.op, c.phase, c.dtype, c.elements] for c in counter.calls if c.step == k]
            for k in range(-1, len(step_s))
        ],
        "gloo_settle": settled.stats,
        "init_s": round(init_s, 3),
        "step_s": step_s,
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
    }
    del engine, optimizer
    gc.collect()
    return row


def hf_builder(config_path: str, checkpointing: str = "none"):
    """A builder of the Hugging Face ``transformers`` causal LM of a ``config.json`` (never downloaded: the
    file's keys through ``AutoConfig.for_model``), random init, fp32, with ``loss(batch)`` as the runner calls it.

    ``attn_implementation="sdpa"``: the attention ``validate/transformer.py`` mirrors and
    ``zeroplan.formulas.activation_terms`` models (eager would keep the t x t probabilities). The loss is
    the model's own (``forward(labels=..., shift_labels=...)`` -> ``loss/loss_utils.py ForCausalLMLoss``:
    logits upcast, mean cross-entropy) on the validator's targets (``shift_labels``: already shifted, so
    the same targets as ``CausalLM.loss``); ``use_cache=False``: a training step keeps no KV cache."""
    if checkpointing != "none":
        raise ValueError("hf runs: checkpointing not supported (transformers' gradient_checkpointing_enable)")
    import torch
    import transformers

    keys = json.loads(Path(config_path).read_text())

    def build():
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(**keys)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=torch.float32)  # fmt: skip
        model.train()

        def loss(batch):
            tokens, targets = batch
            return model(input_ids=tokens, labels=targets, shift_labels=targets, use_cache=False).loss

        model.loss = loss
        return model

    return build


def _model_and_batches(
    spec_name: str, nd: int, rank: int, micro_batch: int, steps: int, seq_len=None, accum: int = 1,
    checkpointing: str = "none", hf: bool = False,
):  # fmt: skip
    """The model builder and, per step, ``accum`` micro-batches of this rank (slices of one global batch);
    ``hf``: the ``transformers`` model of the config file ``spec_name`` (``hf_builder``), the same batches."""
    import torch

    from validate.models import build, make_batch, spec_for

    spec = spec_for(spec_name, None)
    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            global_batch = make_batch(spec, nd * micro_batch, gen, seq_len)
            micro.append(
                tuple(t[rank * micro_batch : (rank + 1) * micro_batch].clone() for t in global_batch)
            )
        batches.append(micro)
    if hf:
        return hf_builder(spec_name, checkpointing), batches
    return (lambda: build(spec, torch.float32, "cpu", checkpointing=checkpointing)), batches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt-tiny", help="preset of validate.models.PRESETS")
    parser.add_argument(
        "--configs", required=True, help="JSON list of ds_config dicts, run one after another"
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sample (default: all positions)"
    )
    parser.add_argument(
        "--checkpointing", choices=("none", "full"), default="none",
        help="full: every block recomputed in backward (torch.utils.checkpoint, as the reference runtime)",
    )  # fmt: skip
    parser.add_argument(
        "--runs", default=None,
        help="JSON list parallel to --configs: per config, {\"model\": ..., \"checkpointing\": ..., \"zero_init\": "
        "...} overriding --model, --checkpointing and --zero-init; \"hf\": true builds the transformers model "
        "of the model's config.json (hf_builder)",
    )  # fmt: skip
    parser.add_argument(
        "--zero-init", action="store_true",
        help="build the model under deepspeed.zero.Init(config_dict_or_path=<the run's ds_config>) (ZeRO-3 only)",
    )  # fmt: skip
    parser.add_argument("--out", required=True, help="directory: rank<r>.json is written there")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # MemTracker's gradient hook meets gradients DeepSpeed has already moved into its buckets.
    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    # deepspeed_shm_comm serves only TorchBackend.inference_all_reduce (comm/torch.py); training
    # collectives are torch.distributed's. Marked incompatible, build_shm_op returns None and its ~45 s JIT build is skipped
    # (ops/__init__.py keeps this dict once probed, "so edits to it persist").
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, nd = dist.get_rank(), dist.get_world_size()
    rows = []
    configs = json.loads(args.configs)
    runs = json.loads(args.runs) if args.runs else [{}] * len(configs)
    for config, run in zip(configs, runs):
        micro_batch = config["train_micro_batch_size_per_gpu"]
        model_fn, batches = _model_and_batches(
            run.get("model", args.model),
            nd,
            rank,
            micro_batch,
            args.steps,
            args.seq_len,
            config.get("gradient_accumulation_steps", 1),
            run.get("checkpointing", args.checkpointing),
            bool(run.get("hf", False)),
        )
        with fp16_on_cpu(config) as overridden:
            row = measure(model_fn, config, batches, rank, nd, bool(run.get("zero_init", args.zero_init)))
        rows.append({**row, "fp16_capability_overridden": overridden})
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_world(
    configs: list[dict],
    nd: int,
    model: str = "gpt-tiny",
    steps: int = DEFAULT_STEPS,
    timeout_s: float = 900.0,
    seq_len: int | None = None,
    checkpointing: str = "none",
    runs: list[dict] | None = None,
    zero_init: bool = False,
) -> list[list[dict]]:
    """Run ``configs`` on ``nd`` gloo CPU ranks under torchrun (through ``validate.launch``, which names the
    first failed rank); returns rows[rank][config]. ``runs``: per config, a ``model`` and ``checkpointing``
    other than the world's (one world's ~30 s of setup shared by several models) and ``zero_init``: build
    under ``deepspeed.zero.Init`` (``build_model``); ``hf``: true builds the ``transformers`` model of the
    ``model`` config.json instead of the validator's (``hf_builder``)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="zeroplan-deepspeed-") as tmp:
        cmd = [
            sys.executable, "-m", "validate.launch", str(Path(tmp, "failures.json")), "--",
            "--standalone", f"--nproc-per-node={nd}", "--max-restarts", "0",
            "-m", "validate.engines.deepspeed", "--model", model, "--configs", json.dumps(configs),
            "--steps", str(steps), "--out", tmp, "--checkpointing", checkpointing,
            *(["--runs", json.dumps(runs)] if runs else []), *(["--zero-init"] if zero_init else []), *(["--seq-len", str(seq_len)] if seq_len else []),
        ]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            failed = Path(tmp, "failures.json")
            who = json.loads(failed.read_text()) if failed.exists() else None
            rank = (
                f"rank {who['rank']} exited with code {who['exitcode']}"
                if who
                else f"exited {done.returncode}"
            )
            raise RuntimeError(f"deepspeed run (N_d={nd}): {rank}; its log ends:\n{done.stderr[-3000:]}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nd)]


# --- the comparison with zeroplan.engines.deepspeed (no torch: the parent process) ------------------------

RING_OPS = ("all-reduce", "reduce-scatter", "all-gather")
_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}


def builtin_configs(stages: tuple[int, ...], dtype: str, micro_batch: int, lr: float) -> list[dict]:
    """One ds_config per stage at DeepSpeed's defaults, except ``torch_adam: true`` (torch's AdamW: no
    ``fused_adam`` JIT build, ~3 min on a fresh machine; the profile models both)."""
    return [ds_config(s, dtype, micro_batch, lr, optimizer_params={"torch_adam": True}) for s in stages]


def workload_for(
    model: str, micro_batch: int, seq_len: int | None, grad_accum: int = 1, checkpointing: str = "none",
    hf: bool = False,
):  # fmt: skip
    """The ``Workload`` the ranks train: the model's shapes (``named_parameters`` order), ``grad_accum``
    micro-steps of ``micro_batch`` sequences per optimizer step; ``hf``: the transformers model's module tree
    (a run with ``"hf": true``)."""
    from validate.models import expected_shapes, spec_for
    from zeroplan.engines.base import Workload

    spec = spec_for(model, None)
    return Workload(tuple(expected_shapes(spec)), spec, seq_len or spec.max_seq_len, micro_batch,
                    checkpointing=checkpointing, grad_accum=grad_accum, transformers=hf)  # fmt: skip


def _ring_elements(calls: list[list]) -> dict[str, int]:
    from validate.report import _key

    out: dict[str, int] = {}
    for op, phase, dtype, elements in calls:
        if op in RING_OPS:
            out[_key(op, phase, dtype)] = out.get(_key(op, phase, dtype), 0) + elements
    return out


def compare_row(
    ds: dict,
    nd: int,
    rank_rows: list[dict],
    workload,
    model_label: str,
    tolerance: float,
    peak_tolerance: float,
    seq_len: int | None = None,
) -> dict:
    """One ``ReportRow`` (validate/schema.py): ``zeroplan.engines.deepspeed.estimate`` for ``ds`` next to what
    every rank measured; DeepSpeed's own estimator beside it."""
    import statistics

    from validate.report import _key, observed_collectives
    from validate.schema import ReportRow
    from zeroplan.engines import deepspeed as D
    from zeroplan.formulas.peak import PHASES as PEAK_PHASES

    # how the ranks built the model, passed explicitly (the profile's default is zero.Init at stage 3)
    settings = D.Settings.from_ds_config(ds, zero_init=bool(rank_rows[0].get("zero_init", False)))
    # MemTracker on CPU: LayerNorm's mean and rstd come in the input dtype (4 bytes only in fp32)
    (est,) = D.estimate(workload, nd, settings, stat_bytes=D.DTYPE_BYTES[settings.dtype])
    numels = tuple(n for n in (math.prod(sh) for _, sh in workload.shapes))
    pred_states = est.model_states_bytes
    boundaries = [[b for k, b in r["boundary_bytes"].items() if k != "init"] for r in rank_rows]
    measured_states = max(b[-1] for b in boundaries)
    states_err = (measured_states - pred_states) / pred_states
    measured_peaks = {p: max(r["peak_bytes_by_phase"][p] for r in rank_rows) for p in PEAK_PHASES}
    predicted_peaks = est.peak.by_phase()
    peak_errors = {p: (measured_peaks[p] - predicted_peaks[p]) / measured_peaks[p] for p in PEAK_PHASES}
    peak_err = max(peak_errors.values(), key=abs)

    pred_coll = {}
    for c in D.collectives(settings, numels, nd, workload.grad_accum, *D._trace(workload)):
        key = _key(c.op, c.phase, _TORCH_DTYPE.get(c.dtype, c.dtype))
        nbytes = D.DTYPE_BYTES.get(c.dtype, 1)
        from zeroplan.formulas.collectives import ring_bytes_per_rank

        pred_coll[key] = {
            "elements": c.elements,
            "bytes_per_rank": ring_bytes_per_rank(c.op, c.elements, nd, nbytes),
        }
    # steady state: ZeRO-3's first step records its trace (and gathers again in backward)
    steps = [r["calls_by_step"][k] for r in rank_rows for k in range(2, len(r["calls_by_step"]))]
    want = {k: v["elements"] for k, v in pred_coll.items()}
    collectives_match = all(_ring_elements(calls) == want for calls in steps)
    last = rank_rows[0]["calls_by_step"][-1]
    measured_coll = observed_collectives(last, nd)
    ring = {k: v for k, v in measured_coll.items() if k.split("|")[0] in RING_OPS}
    pred_elements = sum(want.values())
    measured_elements = sum(v["elements"] for v in ring.values())
    derived = sum(v["derived_bytes_per_rank"] or 0 for v in ring.values())
    pred_comm = sum(v["bytes_per_rank"] for v in pred_coll.values())
    ds_est = D.ds_estimate_bytes(settings, numels, nd)
    peak = max(measured_peaks.values())
    checks = {
        "model_states_within_tolerance": abs(states_err) <= tolerance,
        "model_states_steady": all(len(set(b)) == 1 for b in boundaries),
        "collectives_match": collectives_match,
        "peak_within_tolerance": abs(peak_err) <= peak_tolerance,
        "parity": None,
    }
    step_s = [t for r in rank_rows for t in r["step_s"][1:]] or [t for r in rank_rows for t in r["step_s"]]
    return ReportRow.model_validate({
        "stage": settings.stage, "world_size": nd, "mode": "real", "backend": "gloo", "device": "cpu",
        "model": model_label, "psi": sum(numels),
        "predicted_model_states_bytes": pred_states, "measured_model_states_bytes": measured_states,
        "model_states_rel_error": states_err, "model_states_extra_bytes": measured_states - pred_states,
        "adam_step_bytes": 0,  # a profile term (``step scalars``), not an excess
        "predicted_breakdown_bytes": {"params": est.memory.params_bytes, "grads": est.memory.grads_bytes,
                                      "optimizer": est.memory.optimizer_bytes},
        "probe_breakdown": rank_rows[0]["probe_breakdown"],
        "predicted_collective_elements": pred_elements, "measured_collective_elements": measured_elements,
        "collective_elements_rel_error": (measured_elements - pred_elements) / pred_elements if pred_elements else 0.0,
        "predicted_comm_bytes_per_rank": pred_comm, "derived_comm_bytes_per_rank": derived,
        "derived_comm_rel_error": (derived - pred_comm) / pred_comm if pred_comm else 0.0,
        "predicted_collectives": pred_coll, "measured_collectives": measured_coll,
        "measured_setup_collectives": observed_collectives(rank_rows[0]["calls_by_step"][0], nd),
        "observed_calls_last_step": last,
        "measured_peak_bytes": peak, "measured_peak_bytes_by_phase": measured_peaks,
        "predicted_peak_bytes_by_phase": predicted_peaks, "peak_rel_error_by_phase": peak_errors,
        "peak_rel_error": peak_err, "predicted_peak_phase": est.peak.peak_phase,
        "predicted_peak_terms": [{"name": t.name, "bytes": t.bytes, "source": t.source} for t in est.peak.peak_terms],
        "checkpointing": workload.checkpointing, "seq_len": seq_len, "micro_batch": workload.micro_batch,
        "foreach": settings.foreach, "parity": None,
        "seconds": max(sum(r["step_s"]) for r in rank_rows),
        "step_time_s": {"probed": statistics.median(step_s), "unprobed": 0.0, "unprobed_steps": 0},
        "wire_bytes_per_rank": None, "profiler_comms": None, "wire_to_derived": None,
        "checks": checks, "ok": all(v is not False for v in checks.values()),
        "engine": "deepspeed", "engine_label": est.label,
        "deepspeed_estimator_bytes": ds_est, "deepspeed_estimator_rel_error": (peak - ds_est) / peak,
    }).model_dump()  # fmt: skip


def run_configs(config, nd: int) -> list[dict]:
    """The ds_configs ``zeroplan validate --engine deepspeed`` trains at ``nd`` ranks: the user's, its batch
    written out as DeepSpeed derives it (``zeroplan.engines.deepspeed.ds_batch``; ``--micro-batch`` where
    the file has no batch key), else the built-in ones."""
    from zeroplan.engines.deepspeed import ds_batch

    if config.deepspeed_config is None:
        return builtin_configs(config.stages, config.param_dtype, config.batch_per_rank, config.lr)
    batch = ds_batch(config.deepspeed_config, nd)
    fixed = ({"train_micro_batch_size_per_gpu": batch.micro_batch, "gradient_accumulation_steps": batch.grad_accum}
             if batch else {"train_micro_batch_size_per_gpu": config.batch_per_rank})  # fmt: skip
    return [{"steps_per_print": 10**9, **config.deepspeed_config, **fixed}]


def run_validation(config) -> dict:
    """``zeroplan validate --engine deepspeed``: every world size of ``config`` through real DeepSpeed."""
    from validate.schema import SCHEMA, ValidationReport

    model = config.model_name
    rows, overridden = [], False
    for nd in config.world_sizes:
        configs = run_configs(config, nd)
        ranks = run_world(
            configs, nd, model, config.steps, config.timeout_s, config.seq_len, config.checkpointing,
            zero_init=config.zero_init,
        )
        overridden = overridden or any(r.get("fp16_capability_overridden") for r in ranks[0])
        for i, ds in enumerate(configs):
            workload = workload_for(model, ds["train_micro_batch_size_per_gpu"], config.seq_len,
                                    ds.get("gradient_accumulation_steps", 1), config.checkpointing)  # fmt: skip
            rows.append(compare_row(ds, nd, [r[i] for r in ranks], workload, config.model_label, config.tolerance,
                                    config.peak_tolerance, config.seq_len))  # fmt: skip
    fp16_note = ("fp16 on a CPU without oneDNN fp16: the runner answered DeepSpeed's capability check "
                 "(accelerator/cpu_accelerator.py is_fp16_supported) yes, so DeepSpeed's fp16 path ran as "
                 "written with torch's CPU kernels (validate/engines/deepspeed.py fp16_on_cpu)")  # fmt: skip
    notes = [
        "engine deepspeed: predictions from zeroplan.engines.deepspeed (DeepSpeed 0.19.8 profile); "
        "deepspeed_estimator_bytes is DeepSpeed's own estimate_zero2/3_model_states_mem_needs for the run; "
        "collectives compared per step from the second (ZeRO-3 records its trace in the first), "
        "ring ops only.",
        *([fp16_note] if overridden else []),
    ]
    return ValidationReport(schema_id=SCHEMA, config=config.model_dump(), torch=ranks[0][0]["torch"], rows=rows,
                            notes=notes, ok=all(r["ok"] for r in rows)).model_dump(by_alias=True)  # fmt: skip


if __name__ == "__main__":
    main()
