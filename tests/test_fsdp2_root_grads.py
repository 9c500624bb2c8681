"""What is alive when a tied GPT's two embedding gradients are summed: FSDP2's "embedding backward" moment.

Autograd sums a tied weight's two gradients (the head's, the embedding's) in the AccumulateGrad node's
InputBuffer (``torch/csrc/autograd/input_buffer.cpp``) once the second arrives, after the embedding's own
backward has returned; ``wte.weight``'s tensor hook sees that sum. By then ``wpe``'s EmbeddingBackward
(made after ``wte``'s in forward: a higher sequence number, run first by ``engine.cpp``'s ready queue) has run
and released its saved position ids, and the final norm's and ``wpe``'s gradients sit on their parameters
(under FSDP2, on the unsharded parameters until the root's post_backward). ``hf_tree.root_backward_released``
states it; the moment's terms follow it; the recorded row ``fsdp2-real-4-gpt-5m-fp32-k2-ckpt-nd4`` is exact
(tests/test_measured_rows.py; it was 131,584 B over: the incoming gradient and the position ids counted)."""

from __future__ import annotations

import weakref

import pytest

from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.fsdp2.moments import moments
from zeroplan.engines.fsdp2.settings import Settings
from zeroplan.engines.fsdp2.terms import fsdp2_run


def _gpt_tiny():
    from validate.models import PRESETS

    return PRESETS["gpt-tiny"]


def test_tied_gpt_sum_sees_the_other_root_gradients_not_the_incoming_one():
    torch = pytest.importorskip("torch")
    from validate.models import build, make_batch

    spec = _gpt_tiny()
    model = build(spec, torch.float32, "cpu", checkpointing="full")
    tokens, targets = make_batch(spec, 2, torch.Generator().manual_seed(0), 16)
    ids, incoming = [], []

    def pack(t):  # the int64 tensors autograd saves: the token ids (wte's) and the position ids (wpe's)
        if t.dtype == torch.int64:
            ids.append((tuple(t.shape), weakref.ref(t)))
        return t

    def on_output(module, args, out):
        out.register_hook(lambda g: incoming.append(weakref.ref(g)))

    model.transformer.wte.register_forward_hook(on_output)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().view(-1, spec.vocab_size), targets.reshape(-1))
    seen = {}

    def at_sum(g):
        seen["wpe"] = model.transformer.wpe.weight.grad is not None
        seen["ln_f"] = (model.transformer.ln_f.weight.grad is not None, model.transformer.ln_f.bias.grad is not None)
        seen["incoming"] = [r() is not None for r in incoming]
        seen["ids"] = sorted((shape, r() is not None) for shape, r in ids)

    model.transformer.wte.weight.register_hook(at_sum)
    loss.backward()
    assert seen == {"wpe": True, "ln_f": (True, True), "incoming": [False], "ids": [((2, 16), True), ((16,), False)]}


def test_embedding_backward_moment_of_a_tied_gpt():
    spec = _gpt_tiny()
    w = Workload(transformer_shapes(spec), spec, seq_len=16, micro_batch=2, checkpointing="full")
    run = fsdp2_run(w, 2, Settings())
    (emb,) = [m for m in moments(run) if m.name == "embedding backward"]
    names = {t.name: t.bytes for t in emb.terms}
    d = spec.d_model
    assert names["other root gradients"] == (16 * d + 2 * d) * 4  # wpe (n_positions x d) and ln_f weight, bias
    assert names["their sum"] == spec.vocab_size * d * 4
    assert "incoming activation gradient" not in names
    assert "embedding saved (position ids)" not in names
