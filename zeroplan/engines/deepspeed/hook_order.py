"""The order in which a run's gradients become ready (their ``AccumulateGrad`` hooks fire), where ZeRO-1/2 bucket
them and ZeRO-3 reduces them: from the ZeRO-3 module trace's forward fetches and torch's autograd engine
(``grad_ready_order``, ``sparse_calls``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from zeroplan.architectures.spec import TransformerSpec, transformer_shapes
from zeroplan.engines.deepspeed.trace import _MOE_FORWARD, Stage3Trace


@lru_cache(maxsize=16)
def sparse_calls(spec: TransformerSpec) -> tuple[int, ...]:
    """Per parameter, the place of the sparse-MLP submodule holding it in the order the sparse MLP's forward calls
    them (trace.py ``_MOE_FORWARD``), 0 outside one: ``grad_ready_order``'s order within a ZeRO-3 leaf."""
    rank = {name: i for i, name in enumerate(_MOE_FORWARD)}
    return tuple(rank.get(name.partition(".mlp.")[2].partition(".")[0], 0) for name, _ in transformer_shapes(spec))


@lru_cache(maxsize=32)  # every rank's run and every candidate of a plan ask for the same trace's
def grad_ready_order(trace: Optional[Stage3Trace], numels: tuple[int, ...], calls: tuple[int, ...] = ()
                     ) -> tuple[int, ...]:
    """Parameter indices in the order their gradients are ready (their ``AccumulateGrad`` hooks fire, where
    ZeRO-1/2 bucket them: stage_1_and_2.py ``create_gradient_handling_hooks``): the reverse of the order their
    modules are first called in forward (``trace``'s forward fetches). torch's autograd engine runs the ready
    node made last first (its ready queue is ordered by sequence number) and an ``AccumulateGrad`` as soon as
    its gradient is ready, so a block's hooks come in the reverse of its calls: Llama's ``down_proj``,
    ``up_proj``, ``gate_proj``, ``post_attention_layernorm``, ``o_proj``, ``v_proj``, ``k_proj``, ``q_proj``,
    ``input_layernorm`` (registered self_attn, mlp, then the norms), GPT-2's its registration order reversed.
    Within a module the reverse of ``named_parameters`` (a Linear's bias is added by a later node than its
    weight's; Conv1D's ``addmm`` takes the bias first), but a norm's weight and bias (a module's parameters all
    of one size) come from one node (``native_layer_norm_backward``) in its inputs' order. The root's external
    head weight (validate/transformer.py CausalLM applies it with ``F.linear`` after the body) is first; a head
    tied to the token embedding is ready with the embedding's gradient, last. Checked against torch's hooks
    (tests/test_worst_rank.py). A ZeRO-3 leaf (a sparse MLP, trace.py ``_LEAF_SPARSE``: fetched as one module, its
    parameters in ``named_parameters`` order) holds several modules: its parameters come in the reverse of their
    modules' calls (``calls``, ``sparse_calls``): Qwen3-MoE's ``experts`` (registered first, called after the
    router) before its ``gate``; Qwen2-MoE's ``shared_expert_gate``, ``experts``, ``gate``, then ``shared_expert``
    (called first). Without a trace: the reverse of ``named_parameters``."""
    n_params = len(numels)
    if trace is None or not trace.events:
        return tuple(reversed(range(n_params)))
    root = trace.events[0].module  # fetched first: the root, whose only parameter is the external head
    first: dict[int, int] = {}
    one_node: set[int] = set()  # a norm's weight and bias: ready in their order
    modules = trace.modules
    for pos, m in trace.forward_fetches:  # the forward fetches' events and modules, kept by the trace (a speed-up)
        if m != root:
            own = [i for i in modules[m] if i not in first]
            for i in own:
                first[i] = pos
            if len(own) > 1 and len({numels[i] for i in own}) == 1:
                one_node.update(own)
    end = len(trace.events)
    return tuple(sorted(range(n_params), reverse=True, key=lambda i: (
        first.get(i, end), calls[i] if calls else 0, -i if i in one_node else i)))
