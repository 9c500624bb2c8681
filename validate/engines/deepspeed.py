"""Train a model through real DeepSpeed ZeRO 1-3 under the validator's independent probes.

One process per rank, started by ``torchrun`` through ``validate.harness`` (``run_world`` in
``validate.engines.deepspeed_compare``, re-exported here, does it), because DeepSpeed needs what
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
``deepspeed.initialize`` took so a cold build is visible. What the runner changes in DeepSpeed is listed
in ``validate.engines.deepspeed_changes`` and in every report row (``runner_changes``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time
import warnings
from collections import defaultdict
from pathlib import Path

from validate.engines.deepspeed_changes import (GlooSettled, OffThreadFrees, fp16_on_cpu, quantizer_on_cpu,
                                               run_state_kept, runner_changes)  # fmt: skip

PHASES = ("init", "forward", "backward", "optimizer_step")


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


def build_model(model_fn, config: dict, zero_init: bool):
    """``model_fn()`` as built: whole (``zero_init`` false), or under ``deepspeed.zero.Init`` with the run's
    ds_config (ZeRO-3's way for a model larger than one device: runtime/zero/partition_parameters.py ``Init``
    creates each floating-point tensor in the config's dtype and partitions a module's parameters right
    after its ``__init__``, so no rank holds the whole model).

    ``Init`` replaces ``torch.nn.functional.linear`` with ``zero3_linear_wrap`` for good
    (``_enable_mem_efficient_linear``: "persists unless manually reset"): the caller restores it after the
    run (``measure``'s ``run_state_kept`` puts torch's back), so a later run of the same world trains with
    torch's."""
    if not zero_init:
        return model_fn()
    if getattr(model_fn, "transformers", False):
        return hf_zero3_build(model_fn, config)
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=config):
        return model_fn()


def hf_zero3_build(model_fn, config: dict):
    """A ``transformers`` model (``hf_builder``) built under ZeRO-3 as its users build it: an ``HfDeepSpeedConfig``
    of the ds_config alive, ``from_config`` opens ``zero.Init`` itself (modeling_utils.py ``_from_config``) and
    initialises the weights module by module, gathered (integrations/deepspeed.py ``initialize_weights_zero3``).
    Under a ``zero.Init`` of the runner's own, ``_init_weights`` met 0-element partitions (only torch's own
    ``reset_parameters`` had run): DeepSeek-V3's ``torch.empty`` experts kept whatever memory they got
    (docs/engines/deepspeed.md "What the validator changes"). Unset after the build (only the build reads it):
    a later run builds without ZeRO-3."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(config)  # held through the build: transformers keeps only a weak reference
    try:
        return model_fn()
    finally:
        unset_hf_deepspeed_config()
        del hf_config


def measure(model_fn, config: dict, batches: list, rank: int, nd: int, zero_init: bool = False,
            settle: bool = True, probe=None) -> dict:  # fmt: skip
    """One rank: build ``model_fn()`` (under ``deepspeed.zero.Init`` when ``zero_init``) and
    ``deepspeed.initialize`` it under the probes, train on ``batches``; ``settle`` false: DeepSpeed's
    collectives keep their own asynchronous handles (no ``GlooSettled``); ``probe``: the memory probe (None: the
    CPU one; validate/engines/deepspeed_cuda.py passes the CUDA allocator's)."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import torch

    from validate.probes import CommCounter

    counter, probe = CommCounter(), probe or _cpu_probe()
    boundary: dict[str, int] = {}

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

    settling = GlooSettled(ds_comm.cdb) if settle else contextlib.nullcontext()
    with run_state_kept(), probe, counter, settling as settled:
        frees = OffThreadFrees(getattr(probe, "tracker", None))  # MemTracker's frees run off this thread, counted
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
        step_s, applied = _train(engine, batches, accum, enter, probe, boundary)
        breakdown = probe.breakdown()
        by_device = probe.by_device()
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
        **_comm_fields(counter.calls, len(step_s)),
        "gloo_settle": {**settled.stats, **frees.stats} if settle else None,  # None: DeepSpeed's async handles
        "init_s": round(init_s, 3),
        "step_s": step_s,
        # per optimizer step, whether DeepSpeed applied it (engine.was_step_applied()); a skipped step is refused
        # by the parent (deepspeed_compare.refuse_skipped_steps): its phases are not a measurement of the step
        "steps_applied": applied,
        "skipped_steps": engine.skipped_steps,
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
    }
    del engine, optimizer
    gc.collect()
    return row


def _train(engine, batches: list, accum: int, enter, probe, boundary: dict[str, int]) -> tuple[list, list]:
    """The measured steps, ``accum`` micro-steps each, through the DeepSpeed engine: each step's seconds and
    whether DeepSpeed applied it; the live bytes after each step into ``boundary``."""
    step_s, applied = [], []
    for step in range(len(batches)):
        t0 = time.perf_counter()
        for micro in range(accum):
            # popped, and dropped before the boundary: MemTracker registers an input the first time
            # an op reads it, so a batch kept in the list would count at every later boundary
            batch = batches[step].pop(0)
            enter("forward", step)
            # through the engine's forward, as users train (DeepSpeedEngine.forward: the ZeRO optimizer's
            # clear_backward_seen_flag, the output's backward hooks); the loss is the model's own
            loss = engine.module.loss(batch, forward=engine)
            enter("backward")
            engine.backward(loss)
            del loss
            if micro < accum - 1:  # DeepSpeed's step() only counts the micro-step off the boundary
                enter(None)
                engine.step()
                del batch
        enter("optimizer_step")
        engine.step()
        # False: DeepSpeed skipped the update (its optimizer's ``overflow``: fp16's loss-scale overflow or a
        # non-finite gradient norm; runtime/engine.py ``_take_model_step``: ``_step_applied = not overflow``)
        applied.append(engine.was_step_applied())
        del batch
        enter(None)
        step_s.append(round(time.perf_counter() - t0, 3))
        boundary[f"step{step}"] = probe.settled_bytes()
    return step_s, applied


def _comm_fields(calls, steps: int) -> dict:
    """The row's collectives: per step and op, every call in order, and each call's process-group size."""
    return {
        "comm": _summarise(calls),
        # every call in order as [op, phase, dtype, elements]: those of init first, then one list per step
        "calls_by_step": [
            [[c.op, c.phase, c.dtype, c.elements] for c in calls if c.step == k]
            for k in range(-1, steps)
        ],
        # the process-group size of each of those calls (CommCall.group_size): ZeRO++ hpZ gathers in its
        # secondary group (zeroplan/engines/deepspeed/zeropp.py), the rest over all N_d ranks
        "call_groups_by_step": [[c.group_size for c in calls if c.step == k] for k in range(-1, steps)],
    }


def hf_attention(keys: dict) -> str:
    """The attention transformers builds the family with: "sdpa", except Gemma 2, which has no SDPA path
    (tests/test_families.py::test_gemma2_has_no_sdpa_in_transformers) and is modelled eager
    (``formulas.gemma_activations``)."""
    return "eager" if keys.get("model_type") == "gemma2" else "sdpa"


def hf_builder(config_path: str, checkpointing: str = "none"):
    """A builder of the Hugging Face ``transformers`` causal LM of a ``config.json`` (never downloaded: the
    file's keys through ``AutoConfig.for_model``), random init, fp32, with ``loss(batch)`` as the runner calls it.

    ``attn_implementation="sdpa"`` (Gemma 2: eager, ``hf_attention``): the attention ``validate/transformer.py``
    mirrors and ``zeroplan.formulas.activation_terms`` models (eager keeps the t x t probabilities). The loss is
    the model's own (``forward(labels=..., shift_labels=...)`` -> ``loss/loss_utils.py ForCausalLMLoss``:
    logits upcast, mean cross-entropy) on the validator's targets (``shift_labels``: already shifted, so
    the same targets as ``CausalLM.loss``); ``use_cache=False``: a training step keeps no KV cache.
    ``checkpointing="full"``: transformers' own gradient checkpointing, as the HF Trainer turns it on
    (``gradient_checkpointing_enable()``: every decoder layer a ``GradientCheckpointingLayer``, torch.utils.checkpoint
    non-reentrant); predicted as the engine's ``checkpointing="full"`` (tests/test_deepspeed_moe.py)."""
    if checkpointing not in ("none", "full"):
        raise ValueError(f"hf runs: checkpointing {checkpointing!r}: none or full (transformers' own)")
    import torch
    import transformers

    keys = json.loads(Path(config_path).read_text())

    def build():
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(**keys)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf_attention(keys),
                                                              dtype=torch.float32)  # fmt: skip
        model.train()
        if checkpointing == "full":
            model.gradient_checkpointing_enable()

        def loss(batch, forward=model):
            tokens, targets = batch
            return forward(input_ids=tokens, labels=targets, shift_labels=targets, use_cache=False).loss

        model.loss = loss
        return model

    build.transformers = True  # built under ZeRO-3 by transformers itself (build_model, hf_zero3_build)
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


def case_model_and_batches(config, ds: dict, run: dict, nd: int, rank: int):
    """``_model_and_batches`` of one case: ``run``'s model, checkpointing and ``hf`` over the world's ``config``
    (a ``ValidateConfig``), ``ds``'s micro-batch and accumulation; the CPU and the CUDA runner's cases alike."""
    return _model_and_batches(
        run.get("model", config.model_name), nd, rank, ds["train_micro_batch_size_per_gpu"], config.steps,
        config.seq_len, ds.get("gradient_accumulation_steps", 1), run.get("checkpointing", config.checkpointing),
        bool(run.get("hf", False)),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """One rank, started by ``validate.harness`` (torchrun): every ds_config of ``--configs`` (default: the
    ``zeroplan validate`` run's, ``run_configs``), rank 0 writing every rank's rows to ``--out``."""
    from validate.lifeline import die_with_parent

    die_with_parent()  # first, before DeepSpeed's import takes seconds: a rank never outlives its launcher
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="ValidateConfig as JSON: model, steps, seq_len, checkpointing")
    parser.add_argument("--configs", default=None, help="JSON list of ds_config dicts, run one after another")
    parser.add_argument(
        "--runs", default=None,
        help="JSON list parallel to --configs: per config, {\"model\": ..., \"checkpointing\": ..., \"zero_init\": "
        "...} overriding the config's; \"hf\": true builds the transformers model of the model's config.json "
        "(hf_builder); \"settle\": false leaves the collectives asynchronous (no GlooSettled); \"local_size\": n: "
        "LOCAL_SIZE=n, the CPU accelerator's device_count (ZeRO++ qgZ's devices per node)",
    )  # fmt: skip
    parser.add_argument("--out", required=True, help="JSON file: every rank's rows, written by rank 0")
    parser.add_argument("--raw", action="store_true", help="accepted for validate.harness (rows are always raw)")
    args = parser.parse_args(argv)
    from validate.engines.deepspeed_cuda import on_cuda, rank_main

    if on_cuda(args.config):  # --device cuda, or auto with a GPU: NCCL and the allocator's counters
        return rank_main(args, case_model_and_batches, measure)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # MemTracker's gradient hook meets gradients DeepSpeed has already moved into its buckets.
    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from validate.config import ValidateConfig
    from validate.engines.deepspeed_compare import run_configs
    from zeroplan.files import write_text_atomic

    config = ValidateConfig.model_validate_json(args.config)
    # deepspeed_shm_comm serves only TorchBackend.inference_all_reduce (comm/torch.py); training
    # collectives are torch.distributed's. Marked incompatible, build_shm_op returns None and its ~45 s JIT build is skipped
    # (ops/__init__.py keeps this dict once probed, "so edits to it persist").
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, nd = dist.get_rank(), dist.get_world_size()
    rows = []
    configs = json.loads(args.configs) if args.configs else run_configs(config, nd)
    runs = json.loads(args.runs) if args.runs else [{}] * len(configs)
    for ds, run in zip(configs, runs):
        model_fn, batches = case_model_and_batches(config, ds, run, nd, rank)
        with fp16_on_cpu(ds) as overridden, quantizer_on_cpu(ds, run.get("local_size")) as devices:
            row = measure(model_fn, ds, batches, rank, nd, bool(run.get("zero_init", config.zero_init)),
                          settle=bool(run.get("settle", True)))  # fmt: skip
        row.update(fp16_capability_overridden=overridden, device_count=devices)  # device_count: compare_row's
        rows.append({**row, "runner_changes": runner_changes(row)})
    everyone = [None] * nd if rank == 0 else None
    dist.gather_object(rows, everyone, dst=0)
    if rank == 0:
        meta = {"world_size": nd, "backend": "gloo", "device": "cpu", "torch": torch.__version__}
        write_text_atomic(args.out, json.dumps({"meta": meta, "ranks": everyone}))
    dist.barrier()
    dist.destroy_process_group()


# the parent's side, importable from here as before (tests, benchmarks, docs)
from validate.engines.deepspeed_compare import (  # noqa: E402, F401
    builtin_configs,
    compare_row,
    ds_config,
    run_configs,
    run_validation,
    run_world,
    workload_for,
)

if __name__ == "__main__":
    main()
