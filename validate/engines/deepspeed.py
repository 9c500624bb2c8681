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
after every step. DeepSpeed's first use JIT-builds C++ ops into ``~/.cache/torch_extensions``
(``deepspeed_shm_comm`` when the comm backend is created, ``fused_adam`` when the default Adam is
built); a row records how long ``deepspeed.initialize`` took so a cold build is visible.
"""

from __future__ import annotations

import argparse
import gc
import json
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


def measure(model_fn, config: dict, batches: list, rank: int, nd: int) -> dict:
    """One rank: build ``model_fn()`` and ``deepspeed.initialize`` it under the probes, train on ``batches``."""
    import deepspeed
    import torch

    from validate.probes import CommCounter

    counter, probe = CommCounter(), _cpu_probe()
    boundary: dict[str, int] = {}
    with probe, counter:
        probe.phase("init")
        counter.phase, counter.step = "init", -1
        t0 = time.perf_counter()
        model = model_fn()
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        init_s = time.perf_counter() - t0
        del model
        probe.phase(None)
        boundary["init"] = probe.settled_bytes()
        step_s = []
        for step in range(len(batches)):
            # popped, and dropped before the boundary: MemTracker registers an input the first time an
            # op reads it, so a batch kept in the list would count at every later boundary
            batch = batches.pop(0)
            counter.step = step
            t0 = time.perf_counter()
            for phase, work in (
                ("forward", lambda: engine.module.loss(batch)),
                ("backward", lambda: engine.backward(loss)),
                ("optimizer_step", engine.step),
            ):
                probe.phase(phase)
                counter.phase = phase
                result = work()
                if phase == "forward":
                    loss = result
            del loss, batch
            probe.phase(None)
            counter.phase = "between steps"
            step_s.append(round(time.perf_counter() - t0, 3))
            boundary[f"step{step}"] = probe.settled_bytes()
        breakdown = probe.breakdown()
        by_device = probe.by_device()
    inner = getattr(optimizer, "optimizer", None)
    row = {
        "rank": rank,
        "world_size": nd,
        "config": config,
        "optimizer_class": type(optimizer).__name__,
        "inner_optimizer_class": type(inner).__name__ if inner is not None else None,
        "boundary_bytes": boundary,
        "peak_bytes_by_phase": {p: probe.peaks.get(p, 0) for p in PHASES},
        "probe_breakdown": breakdown,
        "live_bytes_by_device": by_device,
        "comm": _summarise(counter.calls),
        "init_s": round(init_s, 3),
        "step_s": step_s,
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
    }
    del engine, optimizer
    gc.collect()
    return row


def _model_and_batches(spec_name: str, nd: int, rank: int, micro_batch: int, steps: int):
    import torch

    from validate.models import build, make_batch, spec_for

    spec = spec_for(spec_name, None)
    gen = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(steps):
        global_batch = make_batch(spec, nd * micro_batch, gen)
        batches.append(tuple(t[rank * micro_batch : (rank + 1) * micro_batch].clone() for t in global_batch))
    return (lambda: build(spec, torch.float32, "cpu")), batches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt-tiny", help="preset of validate.models.PRESETS")
    parser.add_argument("--configs", required=True, help="JSON list of ds_config dicts, run one after another")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--out", required=True, help="directory: rank<r>.json is written there")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # MemTracker's gradient hook meets gradients DeepSpeed has already moved into its buckets.
    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank, nd = dist.get_rank(), dist.get_world_size()
    rows = []
    for config in json.loads(args.configs):
        micro_batch = config["train_micro_batch_size_per_gpu"]
        model_fn, batches = _model_and_batches(args.model, nd, rank, micro_batch, args.steps)
        rows.append(measure(model_fn, config, batches, rank, nd))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_world(configs: list[dict], nd: int, model: str = "gpt-tiny", steps: int = DEFAULT_STEPS,
              timeout_s: float = 900.0) -> list[list[dict]]:
    """Run ``configs`` on ``nd`` gloo CPU ranks under torchrun; returns rows[rank][config]."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="zeroplan-deepspeed-") as tmp:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nd}",
            "-m", "validate.engines.deepspeed", "--model", model, "--configs", json.dumps(configs),
            "--steps", str(steps), "--out", tmp,
        ]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"deepspeed run (N_d={nd}) exited {done.returncode}:\n{done.stderr[-3000:]}")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nd)]


if __name__ == "__main__":
    main()
