"""ZeRO-3's module trace: the fetch and release hooks DeepSpeed 0.19.8 runs, module by module, in one
micro-step (``runtime/zero/parameter_offload.py``), derived from the parameter names of the model."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Optional

FETCH, RELEASE = "fetch", "release"


@dataclass(frozen=True)
class TraceEvent:
    """One hook of ZeRO-3's module trace: ``fetch`` (parameter_offload.py ``pre_sub_module_forward_function``
    / ``pre_sub_module_backward_function`` -> ``fetch_sub_module``) or ``release`` (``post_sub_module_forward_
    function`` / ``post_sub_module_backward_function`` -> ``release_sub_module``) of ``module``, in forward
    or backward."""

    op: Literal["fetch", "release"]
    module: int
    forward: bool
    in_backward: Optional[bool] = None
    """the training phase it happens in (all-gathers and peaks are counted there); None: backward iff not
    ``forward``. A forward hook inside backward (activation checkpointing's recomputed forward) sets True."""

    def __init__(self, op: Literal["fetch", "release"], module: int, forward: bool,
                 in_backward: Optional[bool] = None) -> None:
        d = self.__dict__  # the dataclass's __init__ without frozen setattr (a 405B trace: ~6,000 events)
        d["op"], d["module"], d["forward"], d["in_backward"] = op, module, forward, in_backward

    @property
    def backward_phase(self) -> bool:
        """Whether the event happens while backward runs."""
        return (not self.forward) if self.in_backward is None else self.in_backward


@dataclass(frozen=True)
class Stage3Trace:
    """One micro-step's module hooks as ZeRO-3 sees them: ``modules`` (per module, the indices of its
    parameters in ``named_parameters`` order, external ones included: partitioned_param_coordinator.py
    ``iter_params``), ``events`` (forward, then backward; a module fetched in backward and never released
    there, because no input of it needs a gradient, is released by ``release_backward_leftovers`` at the
    end) and ``marks``: (name, first event, last event) spans the peak moments read."""

    modules: tuple[tuple[int, ...], ...]
    events: tuple[TraceEvent, ...]
    marks: tuple[tuple[str, int, int], ...] = ()
    names: tuple[str, ...] = ()
    """the modules' names (``named_modules``), for reading; not used by the schedule."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """each parameter's shape (``named_parameters`` order): ZeRO++ qgZ reduces 2-D gradients in all-to-alls
    (``zeropp_qgz.py``); not used by the schedule."""

    def span(self, name: str) -> tuple[int, int]:
        """The (first, last) event of mark ``name`` (the first mark of that name)."""
        spans = self.__dict__.get("_spans")
        if spans is None:  # computed once: the moments read a 405B trace's marks hundreds of times
            spans = {}
            for mark, first, last in self.marks:
                spans.setdefault(mark, (first, last))
            object.__setattr__(self, "_spans", spans)
        return spans[name]

    @property
    def steps(self) -> tuple[tuple[bool, int, bool], ...]:
        """Per event (a fetch?, its module, in backward? ``TraceEvent.backward_phase``), computed once: what the
        coordinator's replay reads of each of a 405B trace's ~12,000 events."""
        steps = self.__dict__.get("_steps")
        if steps is None:
            steps = tuple((e.op == FETCH, e.module, (not e.forward) if e.in_backward is None else e.in_backward)
                          for e in self.events)  # fmt: skip
            object.__setattr__(self, "_steps", steps)
        return steps

    @property
    def forward_fetches(self) -> tuple[tuple[int, int], ...]:
        """(event, module) of each forward fetch (``op`` fetch, ``forward``), computed once (the builder's given:
        a speed-up, no rule): what ``hook_order.grad_ready_order`` reads of the events."""
        found = self.__dict__.get("_forward_fetches")
        if found is None:
            found = tuple((i, e.module) for i, e in enumerate(self.events) if e.op == FETCH and e.forward)
            object.__setattr__(self, "_forward_fetches", found)
        return found

    def __hash__(self) -> int:
        """The hash of its modules, ``steps`` (each event's kind, module and phase: equal events, equal steps),
        marks and names, computed once (the coordinator's cache is keyed by the trace: a 405B model's has ~6,000
        events; tuples of ints and bools hash in C, each ``TraceEvent`` in Python: a speed-up, no rule). Not a
        field: equality, ``repr`` and ``asdict`` are the dataclass's."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.modules, self.steps, self.marks, self.names))
            object.__setattr__(self, "_hash", h)
        return h


def _events(steps: tuple[tuple[bool, int, bool], ...]) -> tuple[TraceEvent, ...]:
    """The builder's events from its ``steps`` (no hook of its sets ``in_backward``): each the very object
    ``TraceEvent(op, module, forward)`` makes, its fields written as ``TraceEvent.__init__`` writes them, without
    the call (a speed-up, no rule: ~6,000 events in a 405B trace)."""
    new, out = object.__new__, []
    for is_fetch, module, backward in steps:
        e = new(TraceEvent)
        d = e.__dict__
        d["op"], d["module"] = FETCH if is_fetch else RELEASE, module
        d["forward"], d["in_backward"] = not backward, None
        out.append(e)
    return tuple(out)


_LLAMA_FORWARD = ("input_layernorm", "self_attn", "post_attention_layernorm", "pre_feedforward_layernorm", "mlp",
                  "post_feedforward_layernorm")
"""modeling_llama.py LlamaDecoderLayer.forward runs these in this order (registered self_attn, mlp, then the
norms), Gemma 2/3's decoder layers with their two feed-forward norms around the MLP (modeling_gemma2.py
Gemma2DecoderLayer.forward); GPT-2 blocks run in registration order."""


_LLAMA_RANK = {name: i for i, name in enumerate(_LLAMA_FORWARD)}


ATTENTION_FORWARD: dict[str, tuple[str, ...]] = {
    "qwen3": ("q_proj", "q_norm", "k_proj", "k_norm", "v_proj", "o_proj"),
    "qwen3_moe": ("q_proj", "q_norm", "k_proj", "k_norm", "v_proj", "o_proj"),
    "gemma3_text": ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj"),
}
"""The attention's submodules in the order its forward calls them where that is not their registration order
(q, k, v, o, then the q/k norms): modeling_qwen3.py ``Qwen3Attention.forward`` (and Qwen3-MoE's) normalises q and k
as it projects them, ``q_norm(q_proj(x))`` then ``k_norm(k_proj(x))``, then ``v_proj``; modeling_gemma3.py
``Gemma3Attention.forward`` projects q, k, v, then normalises q and k; both call ``o_proj`` last. In registration
order the norms came after ``o_proj``: their gradient hooks first in the block's attention
(``run.grad_ready_order``), so the post-attention norm's next module was ``k_norm``, not ``o_proj``
(``block_roles._llama_roles``), and ``o_proj``'s weight gradient was counted among the attention inputs' (found by
the differential draw 1-24, Qwen3-MoE ZeRO-3: backward 493,560 B over on every rank)."""


_MOE_FORWARD = ("shared_expert", "gate", "experts", "shared_experts", "shared_expert_gate")
"""A sparse MLP's submodules in the order its forward calls them (transformers 5.24), not their registration
order: ``Qwen2MoeSparseMoeBlock.forward`` runs ``shared_expert``, ``gate``, ``experts``, then
``shared_expert_gate``; ``Qwen3MoeSparseMoeBlock`` and ``DeepseekV3MoE`` register ``experts`` before ``gate`` and
call the router first (DeepSeek's ``shared_experts`` last); ``MixtralSparseMoeBlock`` registers them in call
order. Every module is called at every step whatever the routing: ``experts`` is one module holding every
expert's 3-D tensors (docs/engines/deepspeed.md "ZeRO-3 and mixture-of-experts")."""


_LEAF_SPARSE = frozenset({"gate", "experts", "shared_expert", "shared_expert_gate"})
"""The children of a sparse MLP that DeepSpeed 0.19.8 makes a ZeRO-3 leaf by default
(runtime/zero/leaf_module_config.py ``DEFAULT_LEAF_MODULE_CLASSES``: ``MixtralSparseMoeBlock``,
``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``; engine.py ``_configure_distributed_model`` ->
``apply_zero_leaf_module_config``): a module whose children are all of these (DeepSeek's ``DeepseekV3MoE`` has
``shared_experts`` and is not listed). A leaf gets hooks, its children none (parameter_offload.py
``_register_deepspeed_module``); its fetch gathers every parameter under it (``iter_params(recurse=True)``)."""


_MLP_PROJECTIONS = {"gpt": ("c_fc", "c_proj"), "llama": ("up_proj", "down_proj")}
"""A block's MLP input projection (the one run last before the activation product) and output projection
(validate/transformer.py GPT2MLP, LlamaMLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``)."""


@lru_cache(maxsize=8192)  # a module's forward and backward ask (a speed-up)
def _sparse_mark(path: str) -> Optional[str]:
    """``block j <leaf>`` for a decoder layer's post-attention norm or a submodule of its sparse MLP
    (``_MOE_FORWARD``; ``...layers.j.mlp.experts``), else None: the marks of the sparse block's forward moments
    (engines/deepspeed/moe.py)."""
    head, _, leaf = path.rpartition(".")
    if leaf in ("post_attention_layernorm", "mlp"):  # the mlp's marks are read where it is a leaf
        block = head
    elif leaf in _MOE_FORWARD and head.endswith(".mlp"):
        block = head[: -len(".mlp")]
    else:
        return None
    index = block.rpartition(".")[2]
    return f"block {index} {leaf}" if index.isdigit() else None


def _module_tree(names: list[str]) -> tuple[dict[str, list[str]], dict[str, list[int]]]:
    """(children of each module path, indices of each module's own parameters) from parameter names."""
    children: dict[str, list[str]] = {"": []}
    params: dict[str, list[int]] = {"": []}
    for i, name in enumerate(names):
        owner = name.rpartition(".")[0]
        own = params.get(owner)
        if own is not None and owner in children:  # a module seen before: its ancestors are registered too
            own.append(i)
            continue
        params.setdefault(owner, []).append(i)
        missing, path = [], owner  # its ancestors not registered yet, from the owner up (registered: theirs too)
        while path and path not in children:
            missing.append(path)
            path = path.rpartition(".")[0]
        for path in reversed(missing):  # registered from the top down, as each parent's children are listed
            children[path] = []
            params.setdefault(path, [])
            children[path.rpartition(".")[0]].append(path)
    return children, params


class _TraceBuilder:
    """Walks the module tree of ``stage3_trace``: forward from the root, then backward, recording each
    module's hooks (``events``) and the marks (``spans``) the peak moments read."""

    def __init__(self, shapes: tuple[tuple[str, tuple[int, ...]], ...], style: Optional[str], tied: bool,
                 head_module: bool, attention_calls: tuple[str, ...] = ()) -> None:
        self.attention_calls = {name: i for i, name in enumerate(attention_calls)}
        names = [name for name, _ in shapes]
        head = next((i for i, n in enumerate(names) if n == "lm_head.weight"), None)
        if head is None and tied:  # the head weight is the token embedding (CausalLM.head_weight; tied lm_head)
            head = next((i for i, n in enumerate(names) if n.endswith(("wte.weight", "embed_tokens.weight"))), None)
        self.style, self.head_module, self.head = style, head_module, head
        self.shapes = tuple(tuple(shape) for _, shape in shapes)
        self.children, self.params = _module_tree(names)
        # the modules named ``experts`` and their parents: only those can be sparse MLPs (``is_leaf``, ``_calls``)
        self._experts = frozenset(k for k in self.children if k.endswith("experts") and k.rpartition(".")[2] == "experts")
        self._experts_parents = frozenset(k.rpartition(".")[0] for k in self._experts)
        self.index: dict[str, int] = {}
        self.modules: list[tuple[int, ...]] = []
        self.steps: list[tuple[bool, int, bool]] = []  # per hook (a fetch?, module, in backward?): the trace's steps
        self.forward_fetches: list[tuple[int, int]] = []  # (event, module): the trace's ``forward_fetches``
        self.spans: dict[str, list[int]] = {}
        self._called: dict[str, list[str]] = {}
        self._leaf: dict[str, bool] = {}
        top = self.called("")
        self.bodies = [c for c in top if c != "lm_head" and self.children[c]] if head_module else []
        top = self.called(self.bodies[0]) if self.bodies else top  # the transformers body's own calls
        first_block = next((i for i, c in enumerate(top) if c.rpartition(".")[2].isdigit()), len(top))
        # the root, the body and the embeddings: fed token ids, no input needs a gradient
        self.no_grad_input = {"", *self.bodies} | set(top[:first_block] if style is not None else ())
        self.last_block = next((c for c in reversed(top) if c.rpartition(".")[2].isdigit()), None)
        self.projections = _MLP_PROJECTIONS.get(style or "", ())
        if style == "llama" and any(n.endswith(".mlp.gate_up_proj.weight") for n in names):
            self.projections = ("gate_up_proj", "down_proj")  # Phi-3's fused gate and up: the MLP input projection
        token = next((n for n in names if n.endswith(("wte.weight", "embed_tokens.weight"))), None)
        self.token_embedding = token.rpartition(".")[0] if token is not None else None

    def is_leaf(self, path: str) -> bool:
        """A sparse MLP DeepSpeed makes a ZeRO-3 leaf (``_LEAF_SPARSE``); once per module (asked twice), only for a
        module with a child named ``experts`` (a speed-up, no rule: the others are not)."""
        if path not in self._experts_parents:
            return False
        if path not in self._leaf:
            kids = {c.rpartition(".")[2] for c in self.children.get(path, ())}
            self._leaf[path] = "experts" in kids and kids <= _LEAF_SPARSE
        return self._leaf[path]

    def called(self, path: str) -> list[str]:
        """The modules ``path``'s forward calls, in order (containers never called are looked through);
        computed once per module (forward and backward walk the tree again)."""
        if path not in self._called:
            self._called[path] = self._calls(path)
        return self._called[path]

    def _calls(self, path: str) -> list[str]:
        style, head_module, children = self.style, self.head_module, self.children
        out = []
        if self.is_leaf(path):  # no hooks below a ZeRO-3 leaf
            return out
        for c in children.get(path, ()):
            if c == "lm_head" and style is not None and not head_module:
                continue  # CausalLM.forward: F.linear(x, self.head_weight)
            kids = children[c]  # an nn.ModuleList (children named 0, 1, ...) is looked through
            if (kids and all(k.rpartition(".")[2].isdigit() for k in kids)) or (
                    path == "" and style is not None and not head_module and not self.params[c]):
                out += self.called(c)
            else:
                out.append(c)
        if style == "llama" and path.rpartition(".")[2].isdigit():  # a decoder layer; sorted() is stable
            out.sort(key=lambda c: _LLAMA_RANK.get(c.rpartition(".")[2], 0))
        if self.attention_calls and path.endswith(".self_attn"):  # ATTENTION_FORWARD
            out.sort(key=lambda c: self.attention_calls.get(c.rpartition(".")[2], len(self.attention_calls)))
        if self._experts and any(c in self._experts for c in out):  # a sparse MLP (_MOE_FORWARD)
            moe = {name: i for i, name in enumerate(_MOE_FORWARD)}
            out.sort(key=lambda c: moe.get(c.rpartition(".")[2], len(moe)))
        if head_module and path == "" and self.head is not None and "lm_head" not in out:
            out.append("lm_head")  # tied: lm_head.weight is not in named_parameters, the module is still called
        return out

    def module(self, path: str) -> int:
        """The index of module ``path``, numbered in the order first fetched, with its parameters."""
        if path not in self.index:
            own = list(self.params.get(path, ()))
            if self.is_leaf(path):  # every parameter under it, in named_parameters order
                own = self._under(path)
            if path == "" and self.style is not None and not self.head_module:  # the head weight: the root's external parameter
                own += [self.head] if self.head is not None else []
            if path == "lm_head" and self.head_module:  # a tied head owns the embedding's weight: not in the names
                own = [self.head] if self.head is not None else []
            self.index[path] = len(self.modules)
            self.modules.append(tuple(own))
        return self.index[path]

    def _under(self, path: str) -> list[int]:
        """The parameters below ``path`` (its descendants), sorted: a speed-up, no rule (tests/test_deepspeed_trace_leaves.py)."""
        if not path:  # the root: as the scan of every name for the prefix "." found them
            return sorted(i for c, ps in self.params.items() if c.startswith(".") for i in ps)
        out, todo, children, params = [], list(self.children.get(path, ())), self.children, self.params
        while todo:
            c = todo.pop()
            out.extend(params.get(c, ())), todo.extend(children.get(c, ()))
        return sorted(out)

    def forward(self, path: str) -> None:
        events, spans = self.steps, self.spans
        start = len(events)
        module = self.module(path)  # numbered at its first fetch: the same index at its release
        events.append((True, module, False))
        self.forward_fetches.append((start, module))
        block, _, leaf = path.rpartition(".mlp.")
        if leaf in self.projections and block.rpartition(".")[2].isdigit():
            what = "MLP input" if leaf == self.projections[0] else "output projection"
            spans[f"block {block.rpartition('.')[2]} {what}"] = [start, start]
        if path == "lm_head" and self.head_module:  # its fetch: the final norm's output made, the logits not yet
            spans["LM head forward"] = spans["LM head fetch"] = [start, start]
        sparse = _sparse_mark(path)
        if sparse is not None:
            spans[f"{sparse} fetch"] = [start, start]
        for c in self.called(path):
            self.forward(c)
        if path == "" and not self.head_module:
            spans["LM head forward"] = [len(events) - 1, len(events) - 1]
        events.append((False, module, False))
        if self.projections[1:] == (leaf,) and block.rpartition(".")[2].isdigit():
            spans[f"block {block.rpartition('.')[2]} output projection released"] = [len(events) - 1] * 2
        if path == self.last_block:
            spans["last block forward"] = [start, len(events) - 1]
        if sparse is not None:
            spans[f"{sparse} released"] = [len(events) - 1] * 2
        owner, _, name = path.rpartition(".")
        j = owner.rpartition(".")[2]
        if name == "self_attn" and j.isdigit():  # its fetch to its release (a checkpointed sparse layer's moment)
            spans[f"block {j} attention"] = [start, len(events) - 1]
        if name == "mlp" and (f"block {j} experts fetch" in spans or self.is_leaf(path)):
            first = spans.get(f"block {j} experts fetch", spans[f"block {j} mlp fetch"])[0]
            spans[f"block {j} after experts"] = [first, len(events) - 1]  # from the experts' fetch to the MLP's release

    def backward(self, path: str) -> None:
        events, spans = self.steps, self.spans
        start = len(events)
        module = self.index[path]  # numbered in forward, which walks the same modules
        events.append((True, module, True))
        if path == ("lm_head" if self.head_module else ""):
            spans["LM head backward"] = [start, start]
        if path == self.token_embedding:  # its fetch: the last module of backward (a tied head's sum made there)
            spans["embedding backward"] = [start, start]
        sparse = _sparse_mark(path)
        if sparse is not None and sparse.endswith(" experts"):  # DeepSeek's: its shared experts released by now
            spans[f"{sparse} backward"] = [start, start]
        for c in reversed(self._called[path]):  # ``called``: forward asked every module's (a speed-up)
            self.backward(c)
        if path not in self.no_grad_input:
            events.append((False, module, True))
        if path == self.last_block:
            spans["last block backward"] = [start, len(events) - 1]

    def trace(self) -> Stage3Trace:
        self.forward("")
        self.spans["forward end"] = [len(self.steps) - 1, len(self.steps) - 1]
        self.backward("")
        self.spans.setdefault("last block forward", self.spans["forward end"])
        self.spans.setdefault("last block backward", self.spans["LM head backward"])
        marks = tuple((k, v[0], v[1]) for k, v in self.spans.items())
        by_index = sorted(self.index, key=self.index.get)
        steps = tuple(self.steps)
        trace = Stage3Trace(tuple(self.modules), _events(steps), marks, tuple(p or "(root)" for p in by_index),
                            self.shapes)  # fmt: skip
        trace.__dict__["_steps"] = steps  # what ``Stage3Trace.steps`` computes from the events (a speed-up, no rule)
        trace.__dict__["_forward_fetches"] = tuple(self.forward_fetches)  # as ``steps``
        return trace


def stage3_trace(shapes: tuple[tuple[str, tuple[int, ...]], ...], style: Optional[str] = None,
                 tied: bool = False, head_module: bool = False, attention_calls: tuple[str, ...] = ()) -> Stage3Trace:
    """ZeRO-3's module trace of the validator's causal LM (validate/transformer.py ``CausalLM``) from its
    parameter names: every module called in forward gets its hooks (parameter_offload.py
    ``_register_deepspeed_module``), containers that are never called (the ``transformer``/``model`` body,
    the block ``ModuleList``) do not; the head weight is applied by the root (``F.linear``), so it is an
    external parameter of the root (``ZeROOrderedDict.__getitem__`` -> ``register_external_parameter``;
    measured: the root's fetch all-gathers it) and ``lm_head`` itself is never called. Backward mirrors
    forward: a module's pre-backward fetch, its children from the last, its post-backward release, except
    where no input needs a gradient (the root and the embeddings, fed token ids): those wait for
    ``release_backward_leftovers``.

    ``head_module``: the transformers model instead (modeling_llama.py ``LlamaForCausalLM.forward``,
    modeling_gpt2.py ``GPT2LMHeadModel.forward``: ``self.model(...)`` / ``self.transformer(...)``, then
    ``self.lm_head(hidden_states)``): the body is called (hooks, no parameters of its own; fed token ids, so no
    post-backward release) and ``lm_head`` is a module called after it, owning the head weight (the token
    embedding's when tied); the root has no parameter. Measured (tiny-llama, N_d = 2): the all-gathers equal
    this trace's call for call. Modules without parameters (LlamaRotaryEmbedding, the MLP's activation) have
    hooks too; left out: they gather nothing and the replay's reuse distance walks elements.

    Mixture-of-experts layers (``_MOE_FORWARD``): the sparse MLP's submodules in call order, and per block j
    ``block j <leaf> fetch`` / ``block j <leaf> released`` for its post-attention norm and the sparse MLP's
    submodules (``_sparse_mark``), and ``block j experts backward``: the routed experts' backward fetch where they
    have hooks of their own (DeepSeek-V3: its shared experts have run backward and been released by then).

    Marks: per decoder block j, ``block j MLP input`` (the fetch of its MLP input projection), ``block j output
    projection`` (the fetch of its MLP output projection, the block's last module) and ``block j output projection
    released`` (that projection's post-forward release: it runs before the block adds its residual), for the
    forward moments. ``attention_calls``: the attention's submodules in call order (``ATTENTION_FORWARD``), where
    the family's forward does not call them in registration order."""
    return _TraceBuilder(shapes, style, tied, head_module, attention_calls).trace()
