"""A Llama-shaped block's activations at its attention inputs' gradient hooks (engines/deepspeed/attention_hooks.py)
against transformers' classes: the live bytes (storages ops made, parameters and their ``.grad`` left out) at
each weight's post-accumulate-grad hook, with and without ZeRO-3's wrapper functions on every module's inputs
(runtime/zero/parameter_offload.py ``PostBackwardFunctionModule``: forward ``output.detach()``, backward returns
its gradients), compared step by step from the output projection's hook (``reduce._block_hook_activations``'
"attention output projection" moment, measured before) with the moments the profile lists there."""

from __future__ import annotations

import weakref

import pytest

DIMS = {"hidden_size": 96, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 101, "max_position_embeddings": 64}  # fmt: skip
HOOKED = ("o_proj", "v_proj", "k_proj", "q_proj")


def _live_at_hooks(cfg: dict, dtype: str, zero3: bool, tokens: int) -> dict[str, int]:
    """Layer 1's attention weights: live non-parameter bytes at each one's hook, less every ``.grad``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch.utils._python_dispatch import TorchDispatchMode

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          dtype=getattr(torch, dtype), attn_implementation="sdpa")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    class Live(TorchDispatchMode):
        sizes: dict[int, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    key = st.data_ptr()
                    if key not in self.sizes and key not in params and st.nbytes():
                        self.sizes[key] = st.nbytes()
                        weakref.finalize(st, self.sizes.pop, key, 0)
            return out

    class Wrapper(torch.autograd.Function):  # ZeRO-3's PostBackwardFunctionModule
        @staticmethod
        def forward(x):
            return x.detach()

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, *grads):
            return grads

    if zero3:
        for m in model.modules():
            m.register_forward_pre_hook(lambda m, args: tuple(
                Wrapper.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args))
    mode, live = Live(), {}

    def hook(name):
        def at(p):
            grads = sum(q.grad.untyped_storage().nbytes() for q in model.parameters()
                        if q.grad is not None and q.grad.untyped_storage().data_ptr() in mode.sizes)
            live[name] = sum(mode.sizes.values()) - grads
        return at

    for name in HOOKED:
        getattr(model.model.layers[1].self_attn, name).weight.register_post_accumulate_grad_hook(hook(name))
    ids = torch.randint(0, cfg["vocab_size"], (1, tokens))
    with mode:
        model(ids, labels=ids).loss.backward()
    return live


def _predicted_at_hooks(cfg: dict, dtype: str, stage: int, tokens: int) -> dict[str, int]:
    """The profile's block activations (terms, less the hooked weight gradients) at layer 1's same hooks."""
    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.architectures.spec import transformer_shapes
    from zeroplan.engines import deepspeed as D
    from zeroplan.engines.base import Workload
    from zeroplan.engines.deepspeed.reduce import _block_hook_activations
    from zeroplan.engines.deepspeed.wrapper import ds_run

    spec = spec_from_hf_config(cfg)
    shapes = transformer_shapes(spec)
    run = ds_run(D.Settings(stage=stage, dtype=dtype), Workload(shapes, spec, tokens, 1, transformers=True), 2)
    names = [n for n, _ in shapes]
    out = {}
    for name in HOOKED:
        hook = names.index(f"model.layers.1.self_attn.{name}.weight")
        _, terms, _ = _block_hook_activations(run, 1, hook)
        out[name] = sum(t.bytes for t in terms)
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("zero3", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_attention_input_hooks_step_as_measured(family, zero3, dtype):
    """Each step from o_proj's hook to v's, k's and q's equals the profile's, to the byte (Qwen3: q/k norms; ZeRO-3's
    wrappers: one input gradient more at k's and q's). Before (the bound at o_proj's saved tensors, with
    every projection's output gradient in flight) q's hook was 477,440 B over at draw 1-24's widths (Qwen3-MoE,
    d 384, 8 heads, 2 kv heads, head_dim 64, fp32, 32 tokens)."""
    cfg = {**DIMS, "model_type": family}
    live = _live_at_hooks(cfg, {"fp32": "float32", "bf16": "bfloat16"}[dtype], zero3, 32)
    predicted = _predicted_at_hooks(cfg, dtype, 3 if zero3 else 2, 32)
    for name in HOOKED[1:]:
        assert live[name] - live["o_proj"] == predicted[name] - predicted["o_proj"], (name, live, predicted)
