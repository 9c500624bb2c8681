"""Real PyTorch FSDP2 (``fully_shard``) trained under the validator's probes.

The model is wrapped as FSDP2 documents it: ``fully_shard`` on every transformer block, then on the root
(whose remaining parameters, embeddings and final norm, form the root unit), with a
``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` and ``reshard_after_forward`` on the blocks (the root
keeps FSDP2's default, which does not reshard it after forward). Activation checkpointing, when on, wraps
each block in ``checkpoint_wrapper`` before it is sharded (torchtitan's order). ``torch.optim.Adam`` runs
on the sharded DTensor parameters; ``zero_grad(set_to_none=True)`` ends the optimizer phase.

Phases (``PHASES``): ``init`` builds the model (fp32, on the probed device), shards it and creates the
optimizer; each step is ``forward`` (batch copied in, loss), ``backward`` and ``optimizer_step``. The
MemoryProbe keeps the peak of each phase, and live bytes are read after init, after forward, after
backward and at each step boundary. The CommCounter records every c10d call with its phase.

Real ranks: ``torchrun --nproc-per-node N -m validate.engines.fsdp2 --settings JSON --out FILE`` (gloo on
CPU, NCCL on CUDA); rank 0 writes every rank's row. Simulated: ``--simulated --world-size N`` plays rank 0
of a fake process group with ``FakeTensorMode`` (``validate.simulate``). The device mesh is made before
``FakeTensorMode`` is entered: ``DeviceMesh.__init__`` reads its rank map with ``tolist()``, which a fake
tensor refuses (``DataDependentOutputException``), so ``fully_shard`` gets ``mesh=`` explicitly.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from torch import nn

from validate.models import build, make_batch, spec_for
from validate.probes import CommCounter, MemoryProbe
from validate.simulate import fake_tensors, init_fake_world
from zeroplan.files import write_text_atomic

# MemTracker's gradient hook meets DTensor gradients it cannot flatten (FSDP2 sets them after the hook).
warnings.filterwarnings(
    "ignore", message="Expected a tensor or a traceable wrapper-subclass", category=UserWarning
)

PHASES = ("init", "forward", "backward", "optimizer_step")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Fsdp2Settings:
    """One FSDP2 run, in FSDP2's own vocabulary."""

    model: str = "gpt-tiny"  # a validate.models preset
    param_dtype: str = "fp32"  # MixedPrecisionPolicy.param_dtype (fp32: no mixed precision)
    reduce_dtype: str | None = None  # MixedPrecisionPolicy.reduce_dtype (None: the param dtype)
    reshard_after_forward: bool | int = True  # on the blocks; the root keeps FSDP2's default
    checkpointing: bool = False  # checkpoint_wrapper on every block
    foreach: bool | None = None  # torch.optim.Adam(foreach=...); None: torch's default for the device
    steps: int = 2
    batch_per_rank: int = 2
    seq_len: int | None = None  # None: the model's maximum
    lr: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(DTYPES)}")
        if self.steps < 1 or self.batch_per_rank < 1:
            raise ValueError(f"steps={self.steps}, batch_per_rank={self.batch_per_rank}: must be >= 1")

    @classmethod
    def from_json(cls, text: str) -> Fsdp2Settings:
        data = json.loads(text)
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown FSDP2 settings: {', '.join(sorted(unknown))}")
        return cls(**data)


def shard(model: nn.Module, mesh, settings: Fsdp2Settings) -> nn.Module:
    """``fully_shard`` per block, then the root: FSDP2's documented pattern (torchtitan does the same)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[settings.param_dtype],
        reduce_dtype=DTYPES[settings.reduce_dtype] if settings.reduce_dtype else None,
    )
    if settings.checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=settings.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def summarise_calls(calls, steps: int) -> list[dict]:
    """Per step: {"op|phase|dtype": {"calls", "elements": [per call, in order]}}: what was observed at
    dispatch (bytes are not measured here; ``validate.report`` derives them, labelled derived)."""
    out = [defaultdict(lambda: {"calls": 0, "elements": []}) for _ in range(steps)]
    for c in calls:
        if 0 <= c.step < steps:
            row = out[c.step][f"{c.op}|{c.phase}|{c.dtype}"]
            row["calls"] += 1
            row["elements"].append(c.elements)
    return [dict(d) for d in out]


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of each optimizer state key on this rank (local shards of DTensors), read from the optimizer."""
    out: dict[str, int] = defaultdict(int)
    for state in optimizer.state.values():
        for key, t in state.items():
            if isinstance(t, torch.Tensor):
                out[key] += _local(t).numel() * t.element_size()
    return dict(out)


def check_parity(settings: Fsdp2Settings, spec, mesh, local_batch, global_batch, device) -> dict:
    """fp32 only, outside the probes: a fresh sharded model's gradients of one micro-batch, gathered, vs
    one process's gradients of the global batch (the mean of N_d equal micro-batch losses is the global mean
    loss). A reduce-scatter that sums instead of averaging (gloo's AVG before pytorch#162338 was fixed) is
    off by a factor N_d; summation order alone gives ~1e-7 relative."""
    model = shard(build(spec, torch.float32, device), mesh, settings)
    model.loss(tuple(t.to(device) for t in local_batch)).backward()
    reference = build(spec, torch.float32, device)
    reference.loss(tuple(t.to(device) for t in global_batch)).backward()
    ref = {name: p.grad for name, p in reference.named_parameters()}
    scale = max(float(g.abs().max()) for g in ref.values())
    diff = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()  # a collective: every rank calls it, in the same order
        diff = max(diff, float((grad - ref[name.replace("_checkpoint_wrapped_module.", "")]).abs().max()))
    return {"grad_max_abs_diff": diff, "grad_max_abs": scale, "grad_rel_diff": diff / scale}


@contextmanager
def gloo_reduce_scatter_settled(probe: MemoryProbe, enabled: bool):
    """gloo runs a reduce-scatter as an allreduce of a copy of its input on its worker thread, and drops
    that copy a moment after ``wait()`` returns (``validate.probes.MemoryProbe.settled_bytes``). Left
    alone, the copy is seen by the tracker at a later moment on some ranks and not others; here each
    reduce-scatter returns only once the live bytes are steady, so the copy is counted where gloo makes
    it (the ``gloo reduce-scatter copy`` term of ``zeroplan.engines.fsdp2``). Timing only: nothing is
    allocated or freed by this wrapper."""
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
                         "all_gather_into_tensor") if hasattr(dist, n)]  # fmt: skip
    originals = {n: getattr(dist, n) for n in names}

    def settled(original):
        def call(*args, **kwargs):
            work = original(*args, **kwargs)
            if work is None:  # synchronous: the copy may still be held by the worker thread
                last, same, deadline = probe.current_bytes(), 0, time.monotonic() + 0.5
                while same < 3 and time.monotonic() < deadline:
                    time.sleep(0.001)
                    now = probe.current_bytes()
                    same, last = (same + 1 if now == last else 0), now
            return work

        return call

    if enabled:
        for n in names:
            setattr(dist, n, settled(originals[n]))
    try:
        yield
    finally:
        for n in names:
            setattr(dist, n, originals[n])


def measure(settings: Fsdp2Settings, nd: int, rank: int, device: torch.device, fake: bool) -> dict:
    """Build, shard and train under the probes; returns this rank's row."""
    from torch.distributed.device_mesh import init_device_mesh

    spec = spec_for(settings.model, None)
    gen = torch.Generator().manual_seed(1234)
    b = settings.batch_per_rank
    global_batches = [make_batch(spec, nd * b, gen, settings.seq_len) for _ in range(settings.steps)]
    # Slices are cloned before the probes start (a view made under MemTracker would count the whole batch).
    local_batches = [tuple(t[rank * b : (rank + 1) * b].clone() for t in gb) for gb in global_batches]
    mesh = init_device_mesh(device.type, (nd,))  # before FakeTensorMode: see the module docstring
    readings: dict[str, list[int]] = defaultdict(list)
    with fake_tensors(fake):
        if fake:
            local_batches = [tuple(torch.empty(t.shape, dtype=t.dtype) for t in lb) for lb in local_batches]
        counter, probe = CommCounter(), MemoryProbe(device)

        def enter(phase: str | None) -> None:
            probe.phase(phase)
            counter.phase = phase or "between steps"

        gloo = dist.get_backend() == "gloo"
        with probe, counter, gloo_reduce_scatter_settled(probe, gloo):
            enter("init")
            model = shard(build(spec, torch.float32, device), mesh, settings)
            optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr, foreach=settings.foreach)
            enter(None)
            readings["after_init"].append(probe.settled_bytes())
            for step in range(settings.steps):
                counter.step = step
                enter("forward")
                batch = tuple(t.to(device, copy=True) for t in local_batches[step])
                loss = model.loss(batch)
                readings["after_forward"].append(probe.settled_bytes())
                enter("backward")
                loss.backward()
                del loss, batch
                readings["after_backward"].append(probe.settled_bytes())
                enter("optimizer_step")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                enter(None)
                readings["boundary"].append(probe.settled_bytes())
    parity = None
    if not fake and settings.param_dtype == "fp32" and dist.get_backend() != "fake":
        parity = check_parity(settings, spec, mesh, local_batches[0], global_batches[0], device)
    return {
        "rank": rank,
        "parity": parity,
        "settings": asdict(settings),
        "readings_bytes": dict(readings),
        "peak_bytes_by_phase": {p: probe.peaks.get(p, 0) for p in PHASES},
        "comm_by_step": summarise_calls(counter.calls, settings.steps),
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "param_shapes": [(name, list(p.shape)) for name, p in model.named_parameters()],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="{}", help="Fsdp2Settings as JSON")
    parser.add_argument("--simulated", action="store_true", help="rank 0 of a fake group, FakeTensorMode")
    parser.add_argument("--real-tensors", action="store_true", help="simulated, but with real tensors")
    parser.add_argument("--world-size", type=int, default=None, help="N_d when simulated")
    parser.add_argument("--out", required=True, help="JSON file: every rank's row (written by rank 0)")
    args = parser.parse_args(argv)
    settings = Fsdp2Settings.from_json(args.settings)
    device = torch.device("cpu")
    if args.simulated:
        if not args.world_size:
            parser.error("--simulated needs --world-size")
        nd, rank = args.world_size, 0
        init_fake_world(nd, rank)
    else:
        nd, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    fake = args.simulated and not args.real_tensors
    row = measure(settings, nd, rank, device, fake=fake)
    rows = [row]
    if not args.simulated:
        everyone = [None] * nd if rank == 0 else None
        dist.gather_object(row, everyone, dst=0)
        rows = everyone
    if rank == 0:
        backend = dist.get_backend()
        meta = {"world_size": nd, "backend": backend, "device": str(device), "torch": torch.__version__}
        meta["fake_tensors"] = fake
        write_text_atomic(args.out, json.dumps({"meta": meta, "rows": rows}, indent=1))
    if not args.simulated:
        dist.barrier()  # seen once without it: a gloo rank aborting in teardown while rank 0 still wrote
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
