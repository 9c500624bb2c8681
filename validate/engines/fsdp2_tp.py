"""Real FSDP2 + tensor parallelism (torchtitan's llama plan) trained under the validator's probes.

The model is the validator's own llama ``CausalLM`` (validate/transformer.py; transformers' parameter names)
of a llama config (default ``TINY``, validate/models.py's ``llama-tiny``), fp32 on CPU with gloo, on the mesh
``init_device_mesh("cpu", (S, T), ("dp_shard", "tp"))``, or torchtitan's 3-D one ``(R, S, T)``,
``("dp_replicate", "dp_shard", "tp")`` with ``--dp-replicate R`` (HSDP x TP: ``fully_shard`` on
``mesh["dp_replicate", "dp_shard"]``). Order as torchtitan's: ``parallelize_module`` with the plan of
``zeroplan.engines.fsdp2.tp`` (colwise q/k/v, gate/up; rowwise o, down; ``SequenceParallel`` norms;
embedding rowwise to Shard(1); head colwise to vocabulary-sharded logits) on the meta device, then
``fully_shard`` of each decoder layer and the root over the data-parallel mesh, ``to_empty`` and init; Adam.
``CausalLM`` applies its head with ``F.linear`` on the head's weight, outside any module hook, so the run
replaces the root's ``forward`` by ``tp_forward`` (the same ops, the head called as the module ``lm_head``,
so its ``ColwiseParallel`` hooks run) and computes the loss in ``loss_parallel()``. ``--tp-plan transformers``:
transformers' own plan instead, applied by transformers (``validate.engines.fsdp2_tp_hf``; no SP, the logits
gathered, the plain loss), as accelerate's TP needs it.

Phases, probes and the c10d counter are FSDP2's runner's (``validate.engines.fsdp2``); each call's process
group is recorded as its ranks and as the mesh dimension it is (``dim``). Every collective returns only once
gloo's worker thread has let its tensors go (``validate.engines.fsdp2_gloo_release``: waited for as events, so a
tensor gloo frees late cannot sit in a phase's peak on a loaded machine; the ops are unchanged). Alone:
``torchrun --nproc-per-node 4 -m validate.engines.fsdp2_tp --tp 2 --out F``; under ``zeroplan validate
--engine fsdp2 --tp T`` (validate.harness): ``--config JSON --out F --raw``, compared by
``validate.engines.fsdp2_tp_compare``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from validate.engines.fsdp2 import optimizer_state_bytes
from validate.engines.fsdp2_gloo_release import dist_collectives_released, functional_collectives_released
from validate.lifeline import leave_world
from validate.models import LLAMA_TINY, build, make_batch, spec_for
from validate.probes import CommCounter, MemoryProbe
from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.files import write_text_atomic

TINY = LLAMA_TINY
"""Odd TP-local widths on purpose: ffn 102 / 2 = 51 and vocab 130 / 2 = 65 rows, padded by FSDP2 over 2."""
PHASES = ("init", "forward", "backward", "optimizer_step")


def tp_plan(sequence_parallel: bool = True, loss_parallel: bool = True) -> dict:
    """``parallelize_module``'s plan for the validator's llama layer names (``zeroplan.engines.fsdp2.tp``);
    without loss parallel the head's output is ``Replicate`` (all-gathered logits, a plain tensor), as
    torchtitan's ``disable_loss_parallel``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)  # fmt: skip

    act = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "lm_head": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        plan["model.norm"] = SequenceParallel()
    return plan, {
        **({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
           if sequence_parallel else {}),
        "self_attn": PrepareModuleInput(input_layouts=(act, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(output_layouts=act),
        "mlp": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=act),
    }  # fmt: skip


def tp_forward(self, tokens: torch.Tensor) -> torch.Tensor:
    """``CausalLM.forward`` with the head called as a module: vocabulary-sharded logits (a DTensor)."""
    x = self.model.embed_tokens(tokens)
    rope, mask = self._positions(tokens.unsqueeze(-1).to(x.dtype))  # the whole sequence's positions
    for block in self.model.layers:
        x = block(x, rope, mask)
    x = self.model.norm(x)  # rebound, as CausalLM.forward (and torchtitan): the last block's output is let go
    return self.lm_head(x)


def build_tp(spec, tp_mesh, dp_mesh, sequence_parallel: bool, param_dtype: str = "fp32", checkpointing: bool = False,
             loss_parallel: bool = True, plan: str = "torchtitan"):
    """Meta build, ``parallelize_module`` on the ``tp`` mesh (``plan`` transformers: transformers' own
    ``apply_tensor_parallelism``, ``validate.engines.fsdp2_tp_hf``), ``fully_shard`` on ``dp_shard``, then memory."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = build(spec, torch.float32, "meta")
    model.forward = types.MethodType(tp_forward, model)
    if plan == "transformers":
        from validate.engines.fsdp2_tp_hf import apply_transformers_plan

        apply_transformers_plan(model, spec, tp_mesh)
    else:
        root, layer = tp_plan(sequence_parallel, loss_parallel)
        parallelize_module(model, tp_mesh, root)
        for block in model.model.layers:
            parallelize_module(block, tp_mesh, layer)
    if checkpointing:  # after TP, before fully_shard (torchtitan's order): recompute each block in backward
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.model.layers):
            model.model.layers[i] = checkpoint_wrapper(block)
    policy = MixedPrecisionPolicy(param_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[param_dtype])
    for block in model.model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    model.to_empty(device="cpu")
    model._init_weights()
    return model


def loss_context(on: bool):
    """``loss_parallel()`` with loss parallel, else nothing (the logits are whole, a plain tensor)."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if on else nullcontext()


def loss_of(model, batch, on: bool = True) -> torch.Tensor:
    """``CausalLM.loss`` (under loss parallel when ``on``): fp32 logits (``.float()``, a no-op in fp32), mean
    cross-entropy."""
    tokens, targets = batch
    with loss_context(on):
        return F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())


FUNCTIONAL = {"all_reduce": ("all-reduce", 2), "all_gather_single": ("all-gather", 2),
              "reduce_scatter_single": ("reduce-scatter", 3)}  # fmt: skip
"""DTensor's collectives, torch ``distributed/_functional_collectives.py`` (``funcol``): function -> (name, the
position of its ``group`` (``all_gather_tensor`` and ``reduce_scatter_tensor`` call the ``_single`` ones).
Counted where they are called: DTensor's redistributions and loss parallel's
all-reduces (``tensor/parallel/loss.py``) run inside DTensor's dispatch, below a ``TorchDispatchMode``."""


class GroupCounter(CommCounter):
    """``CommCounter`` that also keeps each call's process group as its ranks (``groups``) and, while
    ``functional()`` is entered, counts DTensor's functional collectives (``FUNCTIONAL``; sizes as FSDP2's: an
    all-gather's output, a reduce-scatter's input, an all-reduce's tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: list[list[int]] = []

    @contextmanager
    def functional(self):
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.distributed_c10d import _resolve_process_group
        from validate.probes import CommCall

        originals = {name: getattr(funcol, name) for name in FUNCTIONAL}

        def counted(name):
            op, at = FUNCTIONAL[name]

            def call(*args, **kwargs):
                group = kwargs.get("group", args[at] if len(args) > at else None)
                ranks = dist.get_process_group_ranks(_resolve_process_group(funcol._resolve_group_name(group)))
                t = args[0]
                n = t.numel() * (len(ranks) if op == "all-gather" else 1)
                self.calls.append(CommCall(op, self.phase, self.step, n, str(t.dtype).removeprefix("torch."),
                                           len(ranks)))  # fmt: skip
                self.groups.append(ranks)
                return originals[name](*args, **kwargs)

            return call

        for name in FUNCTIONAL:
            setattr(funcol, name, counted(name))
        try:
            yield
        finally:
            for name, f in originals.items():
                setattr(funcol, name, f)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.namespace == "c10d":
            pg = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
            try:
                self.groups.append(dist.get_process_group_ranks(dist.ProcessGroup.unbox(pg)))
            except (AttributeError, RuntimeError, ValueError):
                self.groups.append([])
        return super().__torch_dispatch__(func, types_, args, kwargs)


@dataclass(frozen=True)
class TpRun:
    """One run of this runner: the mesh (R x S x T over the world), the model and the training step."""

    tp: int = 2
    dp_replicate: int = 1
    steps: int = 2
    batch: int = 2  # sequences per data-parallel rank
    seq_len: int = 16
    sequence_parallel: bool = True
    param_dtype: str = "fp32"  # MixedPrecisionPolicy.param_dtype (the reduce dtype follows it)
    checkpointing: bool = False
    loss_parallel: bool = True  # False: torchtitan's disable_loss_parallel (the head's output Replicate)
    model: str | None = None  # None: TINY; else a validate.models preset or a llama config.json
    tp_plan: str = "torchtitan"  # transformers: the model's own tp_plan (accelerate's TP; no SP, no loss parallel)

    @classmethod
    def from_validate(cls, config) -> TpRun:
        """The run ``zeroplan validate --engine fsdp2 --tp T`` asks for (``validate.config.ValidateConfig``)."""
        spec = spec_for(config.model_name, None)
        hf = config.tp_plan == "transformers"  # no SP, the logits gathered (validate.engines.fsdp2_tp_hf)
        return cls(tp=config.tp, dp_replicate=config.dp_replicate or 1, steps=config.steps,
                   batch=config.batch_per_rank, seq_len=config.seq_len or spec.max_seq_len,
                   sequence_parallel=config.sequence_parallel is not False and not hf, param_dtype=config.param_dtype,
                   checkpointing=config.checkpointing == "full", loss_parallel=config.loss_parallel is not False and not hf,
                   model=None if config.model_name == "llama-tiny" else config.model_name,
                   tp_plan=config.tp_plan or "torchtitan")  # fmt: skip

    def mesh(self, nd: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``init_device_mesh``'s shape and names on ``nd`` ranks (``tp`` innermost, torchtitan's order)."""
        dp = nd // self.tp
        if self.dp_replicate == 1:
            return (dp, self.tp), ("dp_shard", "tp")
        return (self.dp_replicate, dp // self.dp_replicate, self.tp), ("dp_replicate", "dp_shard", "tp")


def _groups(mesh) -> dict[tuple[int, ...], str]:
    """This rank's process group of each mesh dimension, as its sorted ranks -> the dimension's name."""
    return {tuple(sorted(mesh[name].mesh.flatten().tolist())): name for name in mesh.mesh_dim_names}


def measure(run: TpRun, nd: int, rank: int) -> dict:
    """Build and train ``run`` on this rank under the probes; returns its row (every phase's peak, readings,
    each call with its process group and mesh dimension, the local shapes)."""
    from torch.distributed.device_mesh import init_device_mesh

    spec = spec_for(run.model, None) if run.model else spec_from_hf_config(TINY, "validate/engines/fsdp2_tp.py TINY")
    shape, names = run.mesh(nd)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    # sliced before the probes; the slices share the mesh's int32 rank map (4·R·S·T bytes), which MemTracker counts
    # from its first use in init (zeroplan/engines/fsdp2/tp_estimate.py mesh_rank_map)
    tp_mesh = mesh["tp"]
    dp_mesh = mesh["dp_replicate", "dp_shard"] if run.dp_replicate > 1 else mesh["dp_shard"]
    dims = _groups(mesh)
    gen = torch.Generator().manual_seed(1234)
    dp = nd // run.tp
    globals_ = [make_batch(spec, dp * run.batch, gen, run.seq_len) for _ in range(run.steps)]
    d = rank // run.tp  # the data-parallel rank: every TP rank of it trains the same sequences
    local = [tuple(t[d * run.batch : (d + 1) * run.batch].clone() for t in g) for g in globals_]
    readings: dict[str, list[int]] = defaultdict(list)
    counter, probe = GroupCounter(), MemoryProbe(torch.device("cpu"))

    def enter(phase):
        probe.phase(phase)
        counter.phase = phase or "between steps"

    step_s = []
    # every collective finished and let go by gloo before the rank goes on: validate/engines/fsdp2_gloo_release.py
    with (probe, counter, counter.functional(), dist_collectives_released(probe.tracker),
          functional_collectives_released()):
        enter("init")
        model = build_tp(spec, tp_mesh, dp_mesh, run.sequence_parallel, run.param_dtype, run.checkpointing,
                         run.loss_parallel, run.tp_plan)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        enter(None)
        readings["after_init"].append(probe.settled_bytes())
        t0 = time.perf_counter()
        for i in range(run.steps):
            t_step = time.perf_counter()
            counter.step = i
            enter("forward")
            b = tuple(t.clone() for t in local[i])
            loss = loss_of(model, b, run.loss_parallel)
            readings["after_forward"].append(probe.settled_bytes())
            enter("backward")
            with loss_context(run.loss_parallel):
                loss.backward()
            del loss, b
            readings["after_backward"].append(probe.settled_bytes())
            enter("optimizer_step")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            enter(None)
            readings["boundary"].append(probe.settled_bytes())
            step_s.append(time.perf_counter() - t_step)
        seconds = time.perf_counter() - t0
        breakdown = probe.breakdown()
    unprobed_s = [_unprobed_step(model, optimizer, local[-1], run.loss_parallel)]
    calls = [dict(op=c.op, phase=c.phase, step=c.step, elements=c.elements, dtype=c.dtype, group=g,
                  dim=dims.get(tuple(sorted(g)), "world" if len(g) == nd else "?"))
             for c, g in zip(counter.calls, counter.groups)]  # fmt: skip
    return {
        "rank": rank,
        "readings_bytes": dict(readings),
        "peak_bytes_by_phase": {p: probe.peaks.get(p, 0) for p in PHASES},
        "calls": calls,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "local_shapes": [(n, list(p.to_local().shape)) for n, p in model.named_parameters()],
        "probe_breakdown": breakdown,
        "seconds": round(seconds, 3),
        "step_time_s": {"probed": statistics.median(step_s[1:] or step_s), "unprobed": statistics.median(unprobed_s),
                        "unprobed_steps": len(unprobed_s)},  # fmt: skip
    }


def _unprobed_step(model, optimizer, batch, on: bool = True) -> float:
    """Seconds of one training step without any probe (the probes' cost, as FSDP2's runner reports it)."""
    t = time.perf_counter()
    loss = loss_of(model, tuple(x.clone() for x in batch), on)
    with loss_context(on):
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def meta_of(run: TpRun, nd: int, spec_config: dict) -> dict:
    """The run's description, written beside the rows (tests/data/measured/fsdp2_tp.json keeps it)."""
    return {"world_size": nd, "tp": run.tp, "steps": run.steps, "batch": run.batch, "seq_len": run.seq_len,
            "sequence_parallel": run.sequence_parallel, **({} if run.loss_parallel else {"loss_parallel": False}),
            **({} if run.tp_plan == "torchtitan" else {"tp_plan": run.tp_plan}),
            "param_dtype": run.param_dtype, "hf_config": spec_config,
            "checkpointing": "full" if run.checkpointing else "none", "torch": torch.__version__,
            **({"dp_replicate": run.dp_replicate} if run.dp_replicate > 1 else {}),
            "backend": "gloo", "device": "cpu", "model": "validate/transformer.py CausalLM (llama layout)"}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from validate.lifeline import die_with_parent

    die_with_parent()  # a rank never outlives its launcher (validate.harness)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp-replicate", type=int, default=1, help="HSDP x TP: replicas R of the 3-D mesh")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--no-sp", action="store_true", help="without sequence parallelism")
    parser.add_argument("--no-loss-parallel", action="store_true",
                        help="the head's output Replicate, plain cross-entropy (torchtitan's disable_loss_parallel)")
    parser.add_argument("--param-dtype", default="fp32", choices=("fp32", "bf16"),
                        help="MixedPrecisionPolicy.param_dtype (the reduce dtype follows it)")
    parser.add_argument("--checkpointing", action="store_true", help="checkpoint_wrapper on every decoder layer")
    parser.add_argument("--tp-plan", default="torchtitan", choices=("torchtitan", "transformers"),
                        help="transformers: the model's own tp_plan, applied by transformers (accelerate's TP); "
                        "implies --no-sp --no-loss-parallel")
    parser.add_argument("--config", default=None, help="instead: a ValidateConfig as JSON (zeroplan validate)")
    parser.add_argument("--raw", action="store_true", help="accepted for validate.harness (rows are always raw)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    nd, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if args.config is not None:
        from validate.config import ValidateConfig
        from validate.worker import inject_fault

        run = TpRun.from_validate(ValidateConfig.model_validate_json(args.config))
        inject_fault(rank)
    else:
        hf = args.tp_plan == "transformers"  # its plan: no SP, the head's output gathered (validate.engines.fsdp2_tp_hf)
        run = TpRun(args.tp, args.dp_replicate, args.steps, args.batch, args.seq_len, not (args.no_sp or hf),
                    args.param_dtype, args.checkpointing, not (args.no_loss_parallel or hf), tp_plan=args.tp_plan)  # fmt: skip
    dist.init_process_group("gloo")
    row = measure(run, nd, rank)
    rows = [None] * nd if rank == 0 else None
    dist.gather_object(row, rows, dst=0)
    if rank == 0:
        config = TINY if run.model is None else _hf_config(run.model)
        # "ranks": one list of rows per rank, as validate.worker writes them for validate.harness
        write_text_atomic(args.out, json.dumps({"meta": meta_of(run, nd, config), "rows": rows,
                                                "ranks": [[r] for r in rows]}))  # fmt: skip
    leave_world()


def _hf_config(model: str) -> dict | str:
    """The config.json of ``model`` as read (a path), or the preset's name."""
    from zeroplan.files import read_json

    return read_json(model, "model config") if model.endswith(".json") else model


if __name__ == "__main__":
    main()
