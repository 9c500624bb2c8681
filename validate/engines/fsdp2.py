"""Real PyTorch FSDP2 (``fully_shard``) trained under the validator's probes.

The model is wrapped as FSDP2 documents it: ``fully_shard`` on every transformer block, then on the root
(whose remaining parameters, embeddings and final norm, form the root unit), with a
``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` and ``reshard_after_forward`` on the blocks (the root
keeps FSDP2's default, which does not reshard it after forward). Activation checkpointing, when on, wraps
each block in ``checkpoint_wrapper`` before it is sharded (torchtitan's order); ``selective_ac`` k > 1 wraps only
layers k, 2k, ... counted from 1, as torchtitan 0.2.2 ``distributed/activation_checkpoint.py:_apply_layer_sac``
does (``_layer_sac_count % k == 0``, ``ptd_checkpoint_wrapper(module, preserve_rng_state=False)``; an exact copy
of its rule: torchtitan 0.3.0, installed, has no layer SAC left to import). ``torch.optim.Adam`` runs
on the sharded DTensor parameters; ``zero_grad(set_to_none=True)`` ends the optimizer phase.

Meta init (``init="meta"``): the model is built on the meta device (transformers' with ``hf``: under
``torch.device("meta")``), sharded, given memory by ``to_empty`` and initialised in place (``init_hf_weights``).

Phases (``PHASES``): ``init`` builds the model (fp32, on the probed device), shards it and creates the
optimizer; each step is ``forward`` (batch copied in, loss), ``backward`` and ``optimizer_step``. The
MemoryProbe keeps the peak of each phase, and live bytes are read after init, after forward, after
backward and at each step boundary. The CommCounter records every c10d call with its phase. On gloo each
synchronous collective returns only once gloo's worker thread has let its tensors go and their frees are counted
(``released_on_gloo``: events, not time; ``validate.engines.fsdp2_gloo_release``), so a tensor gloo frees late
cannot sit in a later phase's peak on a loaded machine; the ops and their allocations are unchanged.

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
import statistics
import time
import warnings
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from torch import nn

from validate.engines.fsdp2_gloo_release import dist_collectives_released
from validate.engines.fsdp2_hf import build_model, decoder_layers, peak_breakdown
from validate.models import build, make_batch, spec_for
from validate import cuda_snapshot
from validate.probes import CommCounter, MemoryProbe
from validate.simulate import fake_tensors, init_fake_world
from validate.worker import calls_by_step, inject_fault, pick_device, unprobed_steps
from validate.engines.fsdp2_compare import Fsdp2Settings
from zeroplan.files import write_text_atomic

# MemTracker's gradient hook meets DTensor gradients it cannot flatten (FSDP2 sets them after the hook).
warnings.filterwarnings(
    "ignore", message="Expected a tensor or a traceable wrapper-subclass", category=UserWarning
)

PHASES = ("init", "forward", "backward", "optimizer_step")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_sharded(spec, mesh, settings: Fsdp2Settings, device: torch.device) -> nn.Module:
    """The model in fp32, sharded: built whole on ``device`` then ``fully_shard`` (materialized), or built
    on the meta device, sharded, given device memory shard by shard (``nn.Module.to_empty``, which FSDP2's
    ``FSDPModule._apply`` follows with ``FSDPParam.reset_sharded_param``) and initialised in place (meta)."""
    if settings.init == "materialized":
        return shard(build_model(spec, settings, device), mesh, settings, spec)
    if not settings.hf:
        model = shard(build(spec, torch.float32, "meta"), mesh, settings, spec)
        model.to_empty(device=device)
        model._init_weights()
        return model
    with torch.device("meta"):  # torchtitan's order: every parameter and buffer on meta, sharded, then device
        model = shard(build_model(spec, settings, "meta"), mesh, settings, spec)
    model.to_empty(device=device)
    init_hf_weights(model)
    return model


def init_hf_weights(model: nn.Module) -> None:
    """transformers' own initialisation of a model given memory by ``to_empty`` (shard by shard, in place):
    ``from_config`` under the meta device initialised nothing and marked nothing (``init_weights`` skips
    the meta device), so ``init_weights`` now fills the parameters' shards, recomputes the rotary tables
    (``_init_weights``: ``inv_freq``, ``original_inv_freq``, non-persistent buffers that ``to_empty`` leaves
    uninitialised) and ties the head again (the same DTensor: tied before sharding)."""
    model.init_weights()


def shard(model: nn.Module, mesh, settings: Fsdp2Settings, spec=None) -> nn.Module:
    """``fully_shard`` as ``settings.wrap`` says, call by call (``runner_calls``); activation checkpointing
    wraps each decoder layer first (torchtitan's order; the layers keep their names)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[settings.param_dtype],
        reduce_dtype=DTYPES[settings.reduce_dtype] if settings.reduce_dtype else None,
    )
    calls = runner_calls(model, settings, spec)
    if settings.checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        blocks = decoder_layers(model, spec)
        for i, block in enumerate(blocks):
            if settings.selective_ac == 1:
                blocks[i] = checkpoint_wrapper(block)
            elif settings.selective_ac == "op":  # torchtitan's own SelectiveAC (0.3.0), as its apply() wraps a block
                blocks[i] = op_sac_block(block, f"layers.{i}")
            elif (i + 1) % settings.selective_ac == 0:  # torchtitan's layer SAC, copied (0.3.0 has it no more)
                blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    for modules, rsf in calls:
        found = [model.get_submodule(m) if m else model for m in modules]
        given = {} if rsf is None else {"reshard_after_forward": rsf}  # None: FSDP2's own default
        fully_shard(found if len(found) > 1 else found[0], mesh=mesh, mp_policy=policy, **given)
    return model


def op_sac_block(block: nn.Module, fqn: str) -> nn.Module:
    """``block`` under torchtitan's per-op selective checkpointing, with torchtitan's own code (0.3.0,
    ``distributed/activation_checkpoint.py:SelectiveAC._wrap_block`` at its defaults, as ``SelectiveAC.apply`` wraps
    each of ``model.layers``)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    return SelectiveAC(SelectiveAC.Config())._wrap_block(block, base_fqn=fqn)


def runner_calls(model: nn.Module, settings: Fsdp2Settings, spec) -> list[tuple[tuple[str, ...], object]]:
    """The ``fully_shard`` calls of ``settings.wrap`` on this model, resolved by the profile's own rule
    (``zeroplan.engines.fsdp2.wrap.resolve`` on the model's ``named_parameters``), so the run is exactly the
    wrapping predicted. The validator's ``CausalLM`` applies its head with ``F.linear`` outside any module
    hook, so its head (``lm_head``, or a tied token embedding) must stay in the root."""
    from zeroplan.engines.fsdp2.wrap import Wrapping, preset, resolve

    named = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
    first = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
    tied = tuple((n.rsplit(".", 1)[0], first[id(p)]) for n, p in model.named_parameters(remove_duplicate=False)
                 if first[id(p)] != n)  # a tied lm_head: its module, and the parameter it shares  # fmt: skip
    wrap = settings.wrapping()
    if not isinstance(wrap, Wrapping):
        wrap = preset(wrap, spec.style, settings.reshard_after_forward, spec.tied)
    units = resolve(wrap, named, tied)
    if not settings.hf:
        head = "lm_head.weight" if not spec.tied else named[0][0]  # the token embedding comes first
        if any(not u.root and any(n == head for n, _ in u.params) for u in units):
            raise ValueError("wrapping: validate/transformer.py's CausalLM applies its head with F.linear, outside "
                             "any fully_shard hook; keep the head in the root or validate with --hf")  # fmt: skip
    return [(u.modules, u.reshard_after_forward) for u in units]


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
    model = shard(build_model(spec, settings, device), mesh, settings, spec)
    model.loss(tuple(t.to(device) for t in local_batch)).backward()
    reference = build_model(spec, settings, device)
    reference.loss(tuple(t.to(device) for t in global_batch)).backward()
    ref = {name: p.grad for name, p in reference.named_parameters()}
    scale = max(float(g.abs().max()) for g in ref.values())
    diff = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()  # a collective: every rank calls it, in the same order
        diff = max(diff, float((grad - ref[name.replace("_checkpoint_wrapped_module.", "")]).abs().max()))
    return {"grad_max_abs_diff": diff, "grad_max_abs": scale, "grad_rel_diff": diff / scale}


def released_on_gloo(probe: MemoryProbe, gloo: bool):
    """gloo: each synchronous collective returns once gloo's worker thread has let its tensors go and their frees
    are counted (``validate.engines.fsdp2_gloo_release.dist_collectives_released``: events, not time), so the copy
    gloo makes of a reduce-scatter's input is counted where gloo makes it (the ``gloo reduce-scatter copy`` term of
    ``zeroplan.engines.fsdp2``) and freed before the rank's next op. Called inside the probe (its tracker: ``with
    probe, ..., released_on_gloo(probe, gloo)``); NCCL and the fake group: nothing."""
    return dist_collectives_released(probe.tracker) if gloo and probe.tracker is not None else nullcontext()


def time_step(model: nn.Module, optimizer, local_batch, device) -> float:
    """Seconds of one training step without probes."""
    t = time.perf_counter()
    batch = tuple(x.to(device, copy=True) for x in local_batch)
    model.loss(batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _batches(settings: Fsdp2Settings, spec, nd: int, rank: int) -> tuple[list, list]:
    """The run's global batches (seeded: the same on every rank) and this rank's slices of them."""
    gen = torch.Generator().manual_seed(1234)
    b = settings.batch_per_rank
    global_batches = [make_batch(spec, nd * b, gen, settings.seq_len) for _ in range(settings.steps)]
    # Slices are cloned before the probes start (a view made under MemTracker would count the whole batch).
    local_batches = [tuple(t[rank * b : (rank + 1) * b].clone() for t in gb) for gb in global_batches]
    return global_batches, local_batches


def _train(settings: Fsdp2Settings, model: nn.Module, optimizer, local_batches: list, device: torch.device,
           counter: CommCounter, enter, read) -> list[float]:
    """The measured steps under the probes, each phase entered (``enter``) and read after (``read``; the last
    step's with a CUDA snapshot): each step's seconds."""
    step_s = []
    for step in range(settings.steps):
        t_step = time.perf_counter()
        counter.step = step
        last = step == settings.steps - 1
        enter("forward")
        batch = tuple(t.to(device, copy=True) for t in local_batches[step])
        loss = model.loss(batch)
        read("after_forward", last)
        enter("backward")
        loss.backward()
        del loss, batch
        read("after_backward", last)
        enter("optimizer_step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        enter(None)
        read("boundary", last)
        step_s.append(time.perf_counter() - t_step)
    return step_s


def measure(settings: Fsdp2Settings, nd: int, rank: int, device: torch.device, fake: bool) -> dict:
    """Build, shard and train under the probes; returns this rank's row."""
    from torch.distributed.device_mesh import init_device_mesh

    spec = spec_for(settings.model, settings.params)
    global_batches, local_batches = _batches(settings, spec, nd, rank)
    shape, names = settings.mesh_dims(nd)  # (N_d,), or HSDP's (R, S) (engines/fsdp2/mesh.py)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)  # before FakeTensorMode: module docstring
    readings: dict[str, list[int]] = defaultdict(list)
    mode = fake_tensors(fake)  # entered again for the unprobed steps: one fake mode for all tensors
    with mode:
        if fake:
            local_batches = [tuple(torch.empty(t.shape, dtype=t.dtype) for t in lb) for lb in local_batches]
        counter, probe = CommCounter(), MemoryProbe(device)

        peak_split: dict[str, dict[str, int]] = {}  # the largest over steps, as probe.peaks
        open_phase: list[str | None] = [None]

        def enter(phase: str | None) -> None:
            if open_phase[0] is not None and probe.tracker is not None:  # CPU: MemTracker's categories at the peak
                split = peak_breakdown(probe.tracker)
                if split.get("Total", 0) >= peak_split.get(open_phase[0], {}).get("Total", -1):
                    peak_split[open_phase[0]] = split
            open_phase[0] = phase
            probe.phase(phase)
            counter.phase = phase or "between steps"

        gloo = dist.get_backend() == "gloo"
        with probe, counter, released_on_gloo(probe, gloo):
            enter("init")
            model = build_sharded(spec, mesh, settings, device)
            optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr, foreach=settings.foreach,
                                         amsgrad=settings.amsgrad, fused=settings.fused)

            def read(name: str, last: bool = True) -> None:
                readings[name].append(probe.settled_bytes())
                if probe.recording and last:  # ZEROPLAN_CUDA_SNAPSHOT: what is live, by allocation site
                    cuda_snapshot.dump(f"nd{nd}_rank{rank}_{name}")

            enter(None)
            read("after_init")
            t0 = time.perf_counter()
            step_s = _train(settings, model, optimizer, local_batches, device, counter, enter, read)
            seconds = time.perf_counter() - t0
            workspaces = probe.release_workspaces()  # CUDA: kept from the first backward on; 0 on CPU
            for key in ("after_backward", "boundary"):  # both hold them at every step
                readings[key] = [b - workspaces for b in readings[key]]
            breakdown = probe.breakdown()
    parity = None
    if not fake and settings.param_dtype == "fp32" and dist.get_backend() != "fake":
        parity = check_parity(settings, spec, mesh, local_batches[0], global_batches[0], device)
    with mode:  # the same step without any probe, for the probes' cost; none under fake tensors (unprobed_steps)
        unprobed_s = [time_step(model, optimizer, local_batches[-1], device) for _ in range(unprobed_steps(fake))]
    return {
        "rank": rank,
        "parity": parity,
        "settings": asdict(settings),
        "readings_bytes": dict(readings),
        "library_workspace_bytes": workspaces,
        "peak_bytes_by_phase": {p: probe.peaks.get(p, 0) for p in PHASES},
        "comm_by_step": summarise_calls(counter.calls, settings.steps),
        "calls_by_step": calls_by_step(counter.calls, settings.steps),
        # the process group each call ran on, in the same order (reshard_after_forward=k: k-rank all-gathers)
        "group_sizes_by_step": [[c.group_size for c in counter.calls if c.step == s] for s in range(-1, settings.steps)],
        "probe_breakdown": breakdown,
        "peak_breakdown_by_phase": peak_split,  # MemTracker's categories at each phase's peak (CPU)
        # torch.optim.Adam's default (_default_to_fused_or_foreach): foreach on CUDA tensors, not on CPU
        "foreach": settings.foreach if settings.foreach is not None else device.type == "cuda",
        "seconds": round(seconds, 3),
        "step_time_s": {"probed": statistics.median(step_s[1:]), "unprobed": statistics.median(unprobed_s or [0.0]),
                        "unprobed_steps": len(unprobed_s)},
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "param_shapes": [(name, list(p.shape)) for name, p in model.named_parameters()],
    }


def main(argv: list[str] | None = None) -> None:
    from validate.lifeline import die_with_parent, leave_world

    die_with_parent()  # a rank never outlives its launcher (validate.harness), even one killed by SIGKILL
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="{}", help="Fsdp2Settings as JSON")
    parser.add_argument("--config", default=None, help="instead: a ValidateConfig as JSON (zeroplan validate)")
    parser.add_argument("--simulated", action="store_true", help="rank 0 of a fake group, FakeTensorMode")
    parser.add_argument("--real-tensors", action="store_true", help="simulated, but with real tensors")
    parser.add_argument("--world-size", type=int, default=None, help="N_d when simulated")
    parser.add_argument("--rank", type=int, default=None, help="the simulated rank (0)")
    parser.add_argument("--raw", action="store_true", help="accepted for validate.harness (rows are always raw)")
    parser.add_argument("--out", required=True, help="JSON file: every rank's row (written by rank 0)")
    args = parser.parse_args(argv)
    config = None
    if args.config is not None:
        from validate.config import ValidateConfig

        config = ValidateConfig.model_validate_json(args.config)
        settings = Fsdp2Settings.from_validate(config)
    else:
        settings = Fsdp2Settings.from_json(args.settings)
    device = torch.device("cpu")
    if args.simulated:
        if not args.world_size:
            parser.error("--simulated needs --world-size")
        nd, rank = args.world_size, args.rank or 0
        init_fake_world(nd, rank)
        if config is not None:  # real tensors on the GPU under the fake group: the allocator measures
            device = pick_device(config, 0)
    else:
        nd, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if config is not None:
            device = pick_device(config, int(os.environ.get("LOCAL_RANK", "0")))
        elif torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if config is not None:
        fake = args.simulated and (config.fake_tensors if config.fake_tensors is not None else device.type == "cpu")
        inject_fault(rank)
    else:
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
        if device.type == "cuda":
            meta["cuda_capability"] = list(torch.cuda.get_device_capability(device))
        meta["fake_tensors"] = fake
        # "ranks": one list of rows per rank, as validate.worker writes them for validate.harness
        write_text_atomic(args.out, json.dumps({"meta": meta, "rows": rows, "ranks": [[r] for r in rows]}))
    leave_world(barrier=not args.simulated)  # seen once without the barrier: a gloo rank aborting in teardown


# the parent's side, importable from here as before (notebooks, docs)
from validate.engines.fsdp2_compare import FAKE_TENSOR_PHASES, build_report, compare, predicted_run  # noqa: E402, F401

if __name__ == "__main__":
    main()
