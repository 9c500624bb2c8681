"""One rank of a validation run: train each stage for a few steps under the probes, check parity.

Started by torchrun (``validate.harness`` launches it through ``validate.launch``; or yourself:
``torchrun -m validate.worker``), or as one process playing rank 0 of a fake group. Prints nothing on
success; rank 0 writes the result.
"""

from __future__ import annotations

from validate.lifeline import die_with_parent, leave_world

die_with_parent()  # first, before torch's import takes seconds: a rank never outlives its launcher
# ruff: noqa: E402 - the imports below come after that call on purpose

import argparse
import gc
import json
import os
import signal
import statistics
import time
import warnings
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroplan.architectures.module_shapes import module_shapes
from zeroplan.files import write_text_atomic

from validate.config import ValidateConfig
from validate.models import build, make_batch, spec_for
from validate.probes import PHASES, CommCounter, MemoryProbe, ProfiledComms, loopback_tx_bytes
from validate.reference import train_reference
from validate.runtime import split_units
from validate.simulate import fake_tensors, init_fake_world
from validate.tolerances import parity_tolerance
from validate.stage0 import Stage0
from validate.stage1 import Stage1
from validate.stage2 import Stage2
from validate.stage3 import Stage3

# MemTracker's gradient hook meets parameters whose gradient was already handed to a reduce-scatter.
warnings.filterwarnings(
    "ignore", message="Expected a tensor or a traceable wrapper-subclass", category=UserWarning
)

RUNTIMES = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}
UNPROBED_STEPS = 2  # extra steps timed without probes, after the measured ones


def unprobed_steps(fake: bool) -> int:
    """How many steps to time without probes: ``UNPROBED_STEPS``, none under fake tensors, where a step does
    no arithmetic and its time says nothing about the probes' cost (a 7B-class fake step: seconds of CPU;
    ``step_time_s`` then reports 0 steps and 0.0 s, as the DeepSpeed runner does)."""
    return 0 if fake else UNPROBED_STEPS
FAULT_ENV = "ZEROPLAN_VALIDATE_FAULT"  # test hook: "crash:RANK" or "hang:RANK"

def calls_by_step(calls, steps: int) -> list[list[list]]:
    """Every observed call in order as ``[op, phase, dtype, elements]``: first those issued while the
    runtime was built (step -1), then one list per step. No bytes here: see ``validate.report``."""
    out: list[list[list]] = [[] for _ in range(steps + 1)]
    for c in calls:
        out[c.step + 1].append([c.op, c.phase, c.dtype, c.elements])
    return out


def time_step(runtime, micro_batches, device) -> float:
    """Seconds of one optimizer step (its micro-steps and the update) without probes."""
    t = time.perf_counter()
    for local_batch in micro_batches:
        batch = tuple(x.to(device, copy=True) for x in local_batch)
        loss = runtime.model.loss(batch)
        runtime.backward(loss)
        del loss
    runtime.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def enter(phase: str | None, probe: MemoryProbe, counter: CommCounter) -> None:
    """Start a phase in both probes (None: between steps)."""
    probe.phase(phase)
    counter.phase = phase or "between steps"


def _train(config: ValidateConfig, runtime, local_batches: list, device, probe: MemoryProbe, counter: CommCounter,
           fake: bool) -> tuple[list[int], list[float], ProfiledComms | None]:
    """The measured steps under the probes, ``config.grad_accum`` micro-steps each: the live bytes at each step's
    boundary, each step's seconds, and the last step's profiler record of its collectives (a second source)."""
    boundary, step_s, profiled = [], [], None
    for step in range(config.steps):
        t_step = time.perf_counter()
        micro_batches = local_batches.pop(0)
        batch = tuple(t.to(device, copy=True) for t in micro_batches.pop(0))
        counter.step = step
        last = step == config.steps - 1 and not fake
        with ProfiledComms() if last else nullcontext() as profiled:  # second source, last step
            for m in range(config.grad_accum):
                if m:  # the next micro-batch replaces this one between phases; the last stays
                    enter(None, probe, counter)  # alive through the optimizer step, as at G = 1
                    del batch
                    batch = tuple(t.to(device, copy=True) for t in micro_batches.pop(0))
                enter("forward", probe, counter)
                loss = runtime.model.loss(batch)
                enter("backward", probe, counter)
                runtime.backward(loss)
                del loss
                # gloo drops the last reduce-scatter's buffer a moment after wait(): let it go
                # first, so the next phase's peak does not count it by chance (settled_bytes)
                probe.settled_bytes()
            enter("optimizer step", probe, counter)
            runtime.step()
            enter(None, probe, counter)
        del batch
        boundary.append(probe.settled_bytes())
        step_s.append(time.perf_counter() - t_step)
    return boundary, step_s, profiled


def measure_stage(config: ValidateConfig, stage: int, nd: int, rank: int, device, fake: bool) -> dict:
    """Build a fresh model and runtime under the probes, train ``config.steps`` steps, return the rank's row."""
    spec = spec_for(config.model_name, config.params)
    gen = torch.Generator().manual_seed(1234)
    fake_mode = fake_tensors(fake)
    b, g = config.batch_per_rank, config.grad_accum
    # one global batch per optimizer step: N_d x G micro-batches of b, micro-step m of rank r at (m N_d + r) b
    global_batches = [make_batch(spec, nd * b * g, gen, config.seq_len) for _ in range(config.steps)]
    with fake_mode:
        if fake:  # only shapes matter: the same batches as fake tensors
            global_batches = [tuple(torch.empty(t.shape, dtype=t.dtype) for t in gb) for gb in global_batches]
        # Slices are taken here, before the probes start: a view made under MemTracker would register
        # the whole global batch's storage, which the list below keeps alive past every step boundary.
        # Each step copies its slice onto the device inside the probes, and frees it before the boundary.
        local_batches = [
            [tuple(t[(m * nd + rank) * b : (m * nd + rank + 1) * b].clone() for t in gb) for m in range(g)]
            for gb in global_batches
        ]
        # replayed after the check, without probes
        unprobed_batches = [list(mb) for mb in local_batches[len(local_batches) - unprobed_steps(fake):]]
        if config.wire:  # every rank reads the same namespace-wide counter; a barrier lines them up
            dist.barrier()
            wire_start = loopback_tx_bytes()
        counter, probe = CommCounter(), MemoryProbe(device)
        t0 = time.perf_counter()
        with probe, counter:  # everything the runtime allocates, from its first tensor on
            enter("init", probe, counter)  # building the model, the master and the flat buffers
            model = build(spec, config.torch_dtype, device, checkpointing=config.checkpointing)
            param_shapes = module_shapes(model)  # what the prediction is made for (reads .shape only)
            runtime = RUNTIMES[stage](model, nd, rank, config.lr, config.foreach, config.grad_accum,
                                      amsgrad=config.amsgrad)
            del model
            enter(None, probe, counter)
            boundary, step_s, profiled = _train(config, runtime, local_batches, device, probe, counter, fake)
            workspaces = probe.release_workspaces()  # CUDA: kept from the first backward on; 0 on CPU
            boundary = [b - workspaces for b in boundary]
            breakdown = probe.breakdown()
        seconds = time.perf_counter() - t0
        wire = None
        if config.wire:
            dist.barrier()
            # all ranks' traffic over all steps (plus two barriers and TCP/IP headers and ACKs)
            wire = (loopback_tx_bytes() - wire_start) / (nd * config.steps)
        row = {
            "stage": stage,
            "rank": rank,
            "param_shapes": [[name, list(shape)] for name, shape in param_shapes],
            "boundary_bytes": boundary,
            "library_workspace_bytes": workspaces,
            "probe_breakdown": breakdown,
            "peak_bytes_by_phase": {p: probe.peaks.get(p, 0) for p in PHASES},
            "calls_by_step": calls_by_step(counter.calls, config.steps),
            "foreach": runtime.foreach,
            "adam_step_bytes": sum(
                t.numel() * t.element_size()
                for s in runtime.optimizer.state.values()
                for k, t in s.items()
                if k == "step"
            ),
            "seconds": round(seconds, 3),
            "wire_bytes_per_rank": wire,
            "profiler_comms": profiled.summary if profiled is not None else None,
            "parity": None
            if fake or config.simulated
            else check_parity(config, spec, runtime, global_batches, device),
        }
        # The same step without any probe (after the parity check, which they would change), for the
        # probes' cost: the first probed step is left out (Adam creates its states there).
        unprobed_s = [time_step(runtime, batch, device) for batch in unprobed_batches]
        row["step_time_s"] = {
            "probed": statistics.median(step_s[1:]),
            "unprobed": statistics.median(unprobed_s or [0.0]),
            "unprobed_steps": len(unprobed_s),
        }
    del runtime, global_batches
    gc.collect()
    return row


def check_parity(config: ValidateConfig, spec, runtime, global_batches, device) -> dict:
    """Compare this rank's fp32 master shard and reduced gradients with the single-process reference,
    within the allowances ``validate.tolerances`` derives from the dtype, N_d and the step count."""
    batches = [tuple(t.to(device) for t in gb) for gb in global_batches]
    model, master, grads = train_reference(spec, batches, config.lr, device, config.torch_dtype,
                                           config.amsgrad)  # fmt: skip
    units = [ps for _, ps in split_units(model)]
    ref_master = runtime.local_flat([[master[id(p)] for p in ps] for ps in units], torch.float32)
    ref_grad = runtime.local_flat([[grads[id(p)].float() for p in ps] for ps in units], torch.float32)
    got_master, got_grad = runtime.master.detach(), runtime.local_reduced_grads()
    # N_d x G 16-bit gradients are summed per element (G micro-steps on each of N_d ranks)
    tol = parity_tolerance(config.param_dtype, runtime.nd * config.grad_accum, config.steps, config.lr)
    diff = (got_master - ref_master).abs()
    # the 16-bit parameters are the master rounded, exactly, on this rank's slice ...
    published = torch.equal(runtime.local_params16(), got_master.to(runtime.dtype))
    # ... and where they are replicated (stages 0-2), every rank's slice arrived (the all-gather)
    replicated = None
    if runtime.stage < 3:
        pairs = zip(runtime.model.parameters(), model.parameters())
        with torch.no_grad():
            replicated = float(torch.cat([(a.float() - b.float()).abs().flatten() for a, b in pairs]).mean())
    ref_norm = float(ref_grad.norm())
    grad_rel = float((got_grad - ref_grad).norm()) / ref_norm if ref_norm else float(got_grad.norm() != 0)
    return {
        "param_mean_abs_diff": float(diff.mean()),
        "param_mean_atol": tol.param_mean_atol,
        "param_max_abs_diff": float(diff.max()),
        "param_max_atol": tol.param_max_atol,
        "grad_rel_diff": grad_rel,
        "grad_rtol": tol.grad_rtol,
        "grad_max_abs_diff": float((got_grad - ref_grad).abs().max()),
        "unit_roundoff": tol.u,
        "params16_equal_rounded_master": published,
        "replicated_params16_mean_abs_diff": replicated,
        "ok": bool(
            diff.mean() <= tol.param_mean_atol
            and diff.max() <= tol.param_max_atol
            and grad_rel <= tol.grad_rtol
            and published
            and (replicated is None or replicated <= tol.param_mean_atol)
        ),
    }


def inject_fault(rank: int) -> None:
    """Test hook: crash or hang this rank when ``ZEROPLAN_VALIDATE_FAULT`` names it."""
    kind, _, who = os.environ.get(FAULT_ENV, "").partition(":")
    if who and int(who) == rank:
        if kind == "crash":
            os._exit(3)
        if kind == "hang":
            signal.pause()


def run(config: ValidateConfig, nd: int, rank: int, device: torch.device, simulated: bool) -> list[dict]:
    fake = simulated and (config.fake_tensors if config.fake_tensors is not None else device.type == "cpu")
    inject_fault(rank)
    return [measure_stage(config, stage, nd, rank, device, fake) for stage in config.stages]


def pick_device(config: ValidateConfig, local_rank: int) -> torch.device:
    want_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch.cuda.is_available() is False")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def init_group(config: ValidateConfig, nd: int, rank: int, init: str | None, simulated: bool, device) -> str:
    """Join the process group; returns the backend name."""
    # Longer than the harness timeout, so a hung rank is reported by the harness as a hang, not by a peer
    # as a collective timeout.
    timeout = timedelta(seconds=config.timeout_s + 60)
    if simulated:
        init_fake_world(nd, rank)
        return "fake"
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"init_method": init, "rank": rank, "world_size": nd} if init else {}
    dist.init_process_group(backend, timeout=timeout, **kwargs)
    return backend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="{}", help="ValidateConfig as JSON")
    parser.add_argument(
        "--world-size", type=int, default=None, help="N_d (default: WORLD_SIZE from torchrun)"
    )
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--init", default=None, help="init_method URL (default: env:// as torchrun sets)")
    parser.add_argument("--simulated", action="store_true")
    parser.add_argument("--out", required=True, help="JSON file written by rank 0: the report (or --raw rows)")
    parser.add_argument(
        "--raw", action="store_true", help="write every rank's rows and meta, for validate.harness"
    )
    args = parser.parse_args(argv)
    config = ValidateConfig.model_validate_json(args.config)
    torchrun = args.rank is None
    rank = int(os.environ.get("RANK", "0")) if torchrun else args.rank
    nd = int(os.environ.get("WORLD_SIZE", "1")) if args.world_size is None else args.world_size
    device = pick_device(config, int(os.environ.get("LOCAL_RANK", str(rank))))
    backend = init_group(config, nd, rank, args.init, args.simulated, device)
    rows = run(config, nd, rank, device, args.simulated)
    meta = {"world_size": nd, "backend": backend, "device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        meta["cuda_capability"] = list(torch.cuda.get_device_capability(device))
    everyone = [rows]
    if torchrun:  # one file for the whole world, from rank 0
        everyone = [None] * nd if rank == 0 else None
        dist.gather_object(rows, everyone, dst=0)
    if rank == 0 and args.raw:
        write_text_atomic(args.out, json.dumps({"meta": meta, "ranks": everyone}))
    elif rank == 0:
        from validate.report import build_report

        config = config.model_copy(update={"world_sizes": (nd,)})
        write_text_atomic(args.out, json.dumps(build_report(config, [(meta, everyone)]), indent=2))
    leave_world()


if __name__ == "__main__":
    main()
