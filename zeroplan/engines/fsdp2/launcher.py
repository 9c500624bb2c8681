"""The code a user copies: ``fully_shard`` for exactly the settings predicted (``settings_snippet``), and
FSDP2's equivalent of a ZeRO stage and offload (``fsdp2_snippet``)."""

from __future__ import annotations

from zeroplan.engines.fsdp2.mesh import mesh_snippet
from zeroplan.engines.fsdp2.tp import tp_snippet, transformers_tp_snippet
from zeroplan.engines.fsdp2.settings import Settings
from zeroplan.engines.fsdp2.wrap import Wrapping
from zeroplan.formulas.offload import NO_OFFLOAD, Offload, check_offload
from zeroplan.policy import BF16_MIXED, PrecisionPolicy

_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def wrap_calls(wrapping: Wrapping) -> str:
    """The ``fully_shard`` calls of ``wrapping``, in its order, as ``validate/engines/fsdp2.py:shard`` makes
    them: one call per matched module, or one over all of them (``group``); no ``reshard_after_forward``
    where the wrapping says null (FSDP2's default)."""
    lines = ["def matching(model, pattern):  # `*` stands for one name segment (zeroplan --fsdp-wrap)",
             "    want = pattern.split(\".\")",
             "    return [m for name, m in model.named_modules() if len(name.split(\".\")) == len(want) and",
             "            all(w in (\"*\", h) for w, h in zip(want, name.split(\".\")))]\n"]  # fmt: skip
    for entry in wrapping.units:
        kw = "mp_policy=policy" + ("" if entry.reshard_after_forward is None
                                   else f", reshard_after_forward={entry.reshard_after_forward!r}")  # fmt: skip
        if entry.modules == ("",):
            lines.append(f"fully_shard(model, {kw})  # the root: every parameter not in a unit above")
        elif entry.group:
            found = ", ".join(f"*matching(model, {p!r})" for p in entry.modules)
            lines.append(f"fully_shard([{found}], {kw})  # one unit: one all-gather for all of them")
        else:
            for p in entry.modules:
                lines += [f"for module in matching(model, {p!r}):", f"    fully_shard(module, {kw})"]
    return "\n".join(lines) + "\n"


def settings_snippet(settings: Settings, checkpointing: str = "none", wrapping: Wrapping | None = None) -> str:
    """``fully_shard`` code for exactly ``settings`` and ``checkpointing`` (what ``estimate`` predicted),
    as ``validate/engines/fsdp2.py:shard`` runs it; ``model.layers`` stands for the decoder layers under the
    ``blocks`` wrapping, any other ``wrapping`` (``units.wrapping_of``) is written call by call."""
    dtype = _TORCH_DTYPE[settings.param]
    reduce = _TORCH_DTYPE[settings.reduce]
    ckpt = (
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper\n"
        "for i, block in enumerate(model.layers):  # activation checkpointing: recompute each block in backward\n"
        "    model.layers[i] = checkpoint_wrapper(block)\n"
        if checkpointing == "full" else ""
    )  # fmt: skip
    sac = settings.selective_ac
    if ckpt and sac != 1:  # torchtitan's selective AC (engines/fsdp2/selective_ac.py), as its own code applies it
        ckpt = ("from torchtitan.distributed.activation_checkpoint import SelectiveAC  # torchtitan 0.3.0\n"
                "for i, block in enumerate(model.layers):  # per op: the matmuls' outputs but every second one kept\n"
                "    model.layers[i] = SelectiveAC(SelectiveAC.Config())._wrap_block(block, base_fqn=f'layers.{i}')\n"
                if sac == "op" else ckpt.replace("    model.layers[i] =", f"    if (i + 1) % {sac} == 0:  # torchtitan "
                                                 f"0.2.2 _apply_layer_sac: layers {sac}, {2 * sac}, ...\n"
                                                 "        model.layers[i] =").replace(
                    "(block)\n", "(block, preserve_rng_state=False)\n"))  # fmt: skip
    calls = (
        "for block in model.layers:  # one unit per decoder layer: one all-gather and reduce-scatter each\n"
        f"    fully_shard(block, mp_policy=policy, reshard_after_forward={settings.reshard_after_forward!r})\n"
        "fully_shard(model, mp_policy=policy)  # the root: FSDP2 does not reshard it after forward\n"
        if wrapping is None or settings.wrap == "blocks" else wrap_calls(wrapping)
    )  # fmt: skip
    meta = settings.init == "meta"
    init_note = (
        "# built on the meta device: `with torch.device(\"meta\"): model = ...` (no memory until to_empty)\n"
        if meta else "# the model was built whole on the device (init holds all of it before sharding)\n"
    )  # fmt: skip
    materialize = (
        f"model.to_empty(device={settings.device!r})  # each rank allocates its shards only\n"
        "model.init_weights()  # your in-place initialisation, run on the shards (DTensor)\n"
        if meta else ""
    )  # fmt: skip
    hsdp = (settings.dp_replicate or 1) > 1  # a 2-D mesh (engines/fsdp2/mesh.py); flat: fully_shard's default
    mesh = ("from torch.distributed.device_mesh import init_device_mesh\n"
            + mesh_snippet(settings.dp_replicate, settings.dp_shard, settings.device)) if hsdp else ""  # fmt: skip
    calls = calls.replace("mp_policy=policy", "mesh=mesh, mp_policy=policy") if hsdp else calls  # every call
    if (settings.tp or 1) > 1:  # the mesh with tp innermost, parallelize_module first (engines/fsdp2/tp.py)
        mesh, calls = tp_mesh_snippet(settings), calls.replace("mesh=mesh, ", "").replace(
            "mp_policy=policy", "mesh=dp_mesh, mp_policy=policy")
    offload = settings.offload_policy == "cpu"  # CPUOffloadPolicy: every call, the shards materialized on the CPU
    if offload:
        calls = calls.replace("mp_policy=policy", "mp_policy=policy, offload_policy=offload")
        materialize = materialize.replace(f"device={settings.device!r}", "device='cpu'").replace(
            "each rank allocates its shards only", "the shards on the host (CPUOffloadPolicy)")
        init_note += "# CPUOffloadPolicy: FSDP2 wants the parameters on the CPU (_validate_cpu_offload_params)\n"
    return (
        "import torch\n"
        f"from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy{', CPUOffloadPolicy' if offload else ''}\n"
        f"{mesh}\n"
        f"# {settings.label()}, checkpointing {checkpointing}; shards stay {settings.module} (no master copy)\n"
        f"{init_note}"
        f"{ckpt}"
        f"policy = MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={reduce})\n"
        + (f"offload = CPUOffloadPolicy(pin_memory={settings.pin_memory!r})\n" if offload else "")
        + f"{calls}"
        f"{materialize}"
        f"optimizer = torch.optim.Adam(model.parameters(), foreach={settings.foreach!r}"
        + "".join(f", {k}=True" for k in ("amsgrad", "fused") if getattr(settings, k)) + ")\n"
    )




def tp_mesh_snippet(settings: Settings) -> str:
    """``init_device_mesh`` with ``tp`` innermost ((R,) S, T) and the ``parallelize_module`` code (``tp_snippet``)."""
    r, s, t = settings.dp_replicate or 1, settings.dp_shard, settings.tp
    names, shape = (("dp_replicate", "dp_shard", "tp"), (r, s, t)) if r > 1 else (("dp_shard", "tp"), (s, t))
    dp = 'mesh["dp_replicate", "dp_shard"]' if r > 1 else 'mesh["dp_shard"]'
    return ("from torch.distributed.device_mesh import init_device_mesh\n"
            f"mesh = init_device_mesh({settings.device!r}, {shape}, mesh_dim_names={names})\n"
            + (transformers_tp_snippet(t, dp) if settings.tp_plan == "transformers" else
               tp_snippet(t, dp, settings.sequence_parallel, settings.loss_parallel)))  # fmt: skip


def fsdp2_snippet(stage: int, offload: Offload = NO_OFFLOAD, policy: PrecisionPolicy = BF16_MIXED) -> str:
    """FSDP2 ``fully_shard`` code for ``stage`` and ``offload``, or a comment saying it has no equivalent."""
    check_offload(stage, offload)
    if stage == 0:
        return (
            "# ZeRO stage 0 is plain data parallelism: no FSDP needed.\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "model = DDP(model)  # gradients all-reduced in buckets during backward\n"
        )
    if stage == 1:
        return "# FSDP2 has no stage-1 equivalent (sharded optimizer states only); use DeepSpeed stage 1.\n"
    full_offload = offload == Offload("cpu", "cpu")
    if offload.any and not full_offload:
        return (
            f"# FSDP2 has no equivalent of stage {stage} + {offload.label}: its CPUOffloadPolicy offloads\n"
            "# parameters, gradients and the optimizer step together\n"
            "# (stage 3 + optimizer->cpu, params->cpu).\n"
        )
    dtype = _TORCH_DTYPE.get(policy.param_dtype, "torch.bfloat16")
    reduce = _TORCH_DTYPE.get(policy.resolved_grad_dtype, dtype)
    reshard = "True" if stage == 3 else "False"
    why = (
        "parameters gathered again for backward" if stage == 3 else "parameters kept unsharded until backward"
    )
    imports = "fully_shard, MixedPrecisionPolicy" + (", CPUOffloadPolicy" if full_offload else "")
    offload_arg = "\n    offload_policy=CPUOffloadPolicy(pin_memory=True)," if full_offload else ""
    return (
        "import torch\n"
        f"from torch.distributed.fsdp import {imports}\n\n"
        f"# ZeRO stage {stage}: reshard_after_forward={reshard} "
        f"({why}).\n"
        "# FSDP2 keeps sharded parameters in their original dtype (fp32) and casts them for compute, so the\n"
        "# optimizer needs no master copy: fp32 params + fp32 grads + Adam m, v = 16 bytes/param per shard.\n"
        "kwargs = dict(\n"
        f"    mp_policy=MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={reduce}),\n"
        f"    reshard_after_forward={reshard},{offload_arg}\n"
        ")\n"
        "for block in model.layers:  # one FSDP unit per block: one all-gather and reduce-scatter each\n"
        "    fully_shard(block, **kwargs)\n"
        "fully_shard(model, **kwargs)\n"
        "# Gradient accumulation: model.set_requires_gradient_sync(False) on all but the last micro-step\n"
        "# skips the reduce-scatter but keeps unsharded gradients (more memory than the plan assumes).\n"
    )
