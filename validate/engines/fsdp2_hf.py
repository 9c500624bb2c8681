"""transformers' own classes under the FSDP2 runner (``Fsdp2Settings.hf``): the model, its decoder layers, and
MemTracker's categories at a phase's peak (what ``validate.engines.fsdp2.measure`` records to read a miss).
Torch is imported by the callers' module (the ranks); nothing here imports the runner."""

from __future__ import annotations

import torch
from torch import nn

from validate.models import build


def build_model(spec, settings, device) -> nn.Module:
    """The unsharded fp32 model of ``settings`` (an ``Fsdp2Settings``) with ``loss(batch)``: the validator's ``CausalLM``, or with ``hf`` the
    transformers class of the config.json (``validate.engines.deepspeed.hf_builder``, the one home of that
    build). ``labels=False``: the loss is taken outside the model, from its logits, as ``CausalLM.loss``
    does (``logits.float()``, mean cross-entropy), so the root's forward returns before the loss."""
    if not settings.hf:
        return build(spec, torch.float32, device)
    from validate.engines.deepspeed import hf_builder

    model = hf_builder(settings.model)().to(device)
    if not settings.labels:
        import torch.nn.functional as F

        def loss(batch):
            tokens, targets = batch
            logits = model(input_ids=tokens, use_cache=False).logits.float()
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)

        model.loss = loss
    return model


def decoder_layers(model: nn.Module, spec) -> nn.ModuleList:
    """The decoder layers FSDP2 wraps one by one: ``model.blocks`` (CausalLM), or transformers' own list
    named as ``zeroplan.architectures.spec.block_prefix`` says (``transformer.h``, ``model.layers``)."""
    if hasattr(model, "blocks"):
        return model.blocks
    from zeroplan.architectures.spec import block_prefix

    return model.get_submodule(block_prefix(spec).rstrip("."))


def peak_breakdown(tracker) -> dict[str, int]:
    """MemTracker's own categories (parameters, gradients, optimizer states, activations, temporaries,
    buffers, inputs) at the peak of the open phase, summed over the devices that hold memory."""
    out: dict[str, int] = {}
    for dev, snap in tracker.get_tracker_snapshot("peak").items():
        if torch.device(dev).type != "meta":
            for key, value in snap.items():
                name = getattr(key, "value", key)
                out[name] = out.get(name, 0) + value
    return {k: v for k, v in out.items() if v}
