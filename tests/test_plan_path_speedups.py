"""The speed-ups of the FSDP2 plan's path outside the allocator model (docs/benchmarks.md, "2026-12-03, fourth
session, startup2"), each against the plain computation it replaced, on real and random cases."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from zeroplan.architectures import spec as S
from zeroplan.architectures.moe import MoeSpec
from zeroplan.presets import model_presets, resolve_model

CONFIGS = sorted(str(p) for p in (Path(__file__).parent / "data" / "hf_configs").glob("*.json"))


def _real_specs():
    out = [resolve_model(name) for name in model_presets()]
    return out + [resolve_model(path) for path in CONFIGS]


def plain_shapes(spec: S.TransformerSpec) -> tuple:
    """``transformer_shapes`` as it was: every layer's parameters built under its own prefix."""
    d = spec.d_model
    if spec.style == "gpt":
        f = spec.ffn
        out = [("transformer.wte.weight", (spec.vocab_size, d)), ("transformer.wpe.weight", (spec.max_seq_len, d))]
        for i in range(spec.n_layer):
            p = f"transformer.h.{i}."
            out += [
                (p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                (p + "mlp.c_fc.weight", (d, f)), (p + "mlp.c_fc.bias", (f,)),
                (p + "mlp.c_proj.weight", (f, d)), (p + "mlp.c_proj.bias", (d,)),
            ]  # fmt: skip
        out += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    else:
        norms = ("input_layernorm", "post_attention_layernorm")
        if spec.sandwich_norms:
            norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        out = [("model.embed_tokens.weight", (spec.vocab_size, d))]
        for i in range(spec.n_layer):
            p = f"model.layers.{i}."
            out += S._attention_shapes(spec, p + "self_attn.") + S._mlp_shapes(spec, i, p + "mlp.")
            out += [(p + norm + ".weight", (d,)) for norm in norms]
        out.append(("model.norm.weight", (d,)))
    if not spec.tied:
        out.append(("lm_head.weight", (spec.vocab_size, spec.d_model)))
    return tuple(out)


def _random_specs(rng: random.Random, base: list) -> list:
    """Real specs with other layer counts, and the sparse ones with random sets of sparse layers (dense layers
    between, before and after them), some untied."""
    out = []
    for spec in base:
        for _ in range(3):
            n = rng.randint(1, 12)
            kw = {"n_layer": n}
            if spec.moe is not None:
                sparse = tuple(sorted(rng.sample(range(n), rng.randint(0, n))))
                kw["moe"] = replace(spec.moe, sparse_layers=sparse)
            if spec.layer_types is not None:
                kw["layer_types"] = tuple(rng.choice(("full_attention", "sliding_attention")) for _ in range(n))
            if rng.random() < 0.3 and spec.style == "llama":
                kw["tie_word_embeddings"] = not spec.tied
            out.append(replace(spec, **kw))
    return out


def test_transformer_shapes_builds_each_layer_as_under_its_own_prefix():
    """Every preset, every checked-in config, and 3 random variants of each (layer counts, sparse layer sets,
    tying): the same names, shapes and order as every layer built under its own prefix."""
    real = _real_specs()
    specs = real + _random_specs(random.Random(16), real)
    assert any(s.moe is not None for s in real) and any(s.mla is not None for s in real)
    assert any(s.style == "gpt" for s in real) and any(s.sandwich_norms for s in real)
    assert any(s.fused_projections for s in real) and any(s.qk_norm for s in real)
    for spec in specs:
        assert S.transformer_shapes(spec) == plain_shapes(spec), spec


def test_a_sparse_model_names_its_dense_and_sparse_layers_apart():
    """A model whose first layer is dense and the others sparse (DeepSeek-V3's first_k_dense_replace): each
    layer's MLP is its own kind (one template per kind would fail this if keyed wrongly)."""
    spec = resolve_model(str(Path(__file__).parent / "data" / "hf_configs" / "tiny-deepseek-v3.json"))
    moe = MoeSpec(**{**vars(spec.moe), "sparse_layers": (1, 3)})
    spec = replace(spec, n_layer=5, moe=moe)
    shapes = S.transformer_shapes(spec)
    assert shapes == plain_shapes(spec)
    mlp = {i: {n.split(".mlp.")[1] for n, _ in shapes if n.startswith(f"model.layers.{i}.mlp.")} for i in range(5)}
    assert mlp[0] == mlp[2] == mlp[4] != mlp[1] == mlp[3]


@pytest.mark.parametrize("name", ["llama2-70b", "gpt2-xl"])
def test_transformer_shapes_of_a_preset_are_the_plain_ones(name):
    if name not in model_presets():
        pytest.skip(f"no preset {name}")
    spec = resolve_model(name)
    assert S.transformer_shapes(spec) == plain_shapes(spec)


def plain_distinct_rows(collectives):
    """``collectives.distinct_rows`` as it was: a loop over the rows' ids."""
    objects = {id(c): c for c in collectives}
    index: dict = {}
    slot = {k: index.setdefault(c, len(index)) for k, c in objects.items()}
    return tuple(index), [slot[id(c)] for c in collectives]


def test_distinct_rows_are_the_plain_loops_and_the_last_answer_is_kept_for_that_tuple_only():
    """500 random row tuples (rows repeated as one object, equal rows that are other objects, rows differing in
    one field), each asked twice, as a list, then an equal tuple that is another object, interleaved: the
    answer is always the plain loop's (a cache keyed wrongly, by value or length, or kept for a list, fails)."""
    from zeroplan.formulas.collectives import Collective, counted_rows, distinct_rows

    rng = random.Random(3)
    pool = [Collective(op, phase, n, dt, n * 2, m, group_size=g) for op in ("all-gather", "reduce-scatter")
            for phase in ("forward", "backward") for n in (10, 11) for dt in ("bf16",) for m in (1, 4) for g in (8, 64)]
    last = None
    for _ in range(500):
        rows = []
        for _ in range(rng.randint(0, 40)):
            c = rng.choice(pool)
            rows.append(c if rng.random() < 0.7 else replace(c))  # an equal row, another object
        rows = tuple(rows)
        kinds, index = plain_distinct_rows(rows)
        for asked in (rows, rows, list(rows), tuple(list(rows)), last or rows, rows):
            want_kinds, want_index = plain_distinct_rows(asked)
            got_kinds, got_index = distinct_rows(asked)
            assert got_kinds == want_kinds and list(got_index) == want_index
            assert [id(k) for k in got_kinds] == [id(k) for k in want_kinds]
        assert dict(counted_rows(rows)) == {k: index.count(i) for i, k in enumerate(kinds)}
        last = rows


def test_local_shapes_are_each_parameters_local_shape():
    """Every llama-layout preset and config at T = 1, 2, 4, 8 (the shapes as tuples and as lists), and random
    names (some outside the TP plan, one or many segments, empty ones): ``local_shapes`` is ``local_shape`` of each
    parameter, and a name outside the plan raises the same message (the first such name's)."""
    from zeroplan.engines.fsdp2.tp import local_shape, local_shapes

    def plain(shapes, t):
        return tuple((n, local_shape(n, tuple(s), t)) for n, s in shapes)

    def outcome(f, shapes, t):
        try:
            return f(shapes, t)
        except ValueError as exc:
            return str(exc)

    cases = [S.transformer_shapes(s) for s in _real_specs() if s.style == "llama"]
    rng = random.Random(7)
    parts = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head",
             "input_layernorm", "norm", "mlp", "layers", "model", "weight", "bias", "", "0", "7", "experts"]
    for _ in range(300):
        cases.append(tuple((".".join(rng.choice(parts) for _ in range(rng.randint(1, 5))),
                            tuple(rng.choice((8, 16, 24)) for _ in range(rng.randint(1, 2))))
                           for _ in range(rng.randint(0, 12))))
    raised = 0
    for shapes in cases:
        for t in (1, 2, 4, 8):
            want = outcome(plain, shapes, t)
            raised += isinstance(want, str)
            assert outcome(local_shapes, shapes, t) == want
            assert outcome(local_shapes, [(n, list(s)) for n, s in shapes], t) == want
    assert 0 < raised < 4 * len(cases)


def test_units_own_their_parameters_as_a_walk_per_parameter_finds():
    """``wrap._owners`` against the loop it replaced (``_innermost`` of every parameter, min and max), on 400
    random module trees and sets of units (the root among them or not), with parameters of one module apart."""
    from zeroplan.engines.fsdp2.wrap import _innermost, _owners

    def plain(names, seen, units):
        owner, first, last = [[] for _ in range(units)], [len(names)] * units, [0] * units
        for i, name in enumerate(names):
            module = name.rsplit(".", 1)[0] if "." in name else ""
            best = _innermost(module, seen)
            owner[seen[best]].append(i)
            first[seen[best]] = min(first[seen[best]], i)
            last[seen[best]] = max(last[seen[best]], i)
        return owner, first, last

    rng = random.Random(11)
    for _ in range(400):
        modules = sorted({".".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(12)})
        names = [rng.choice([*modules, ""]) for _ in range(rng.randint(0, 30))]
        names = [f"{m}.w{rng.randint(0, 2)}" if m else f"w{rng.randint(0, 2)}" for m in names]
        wrapped = rng.sample(modules, rng.randint(0, len(modules)))
        seen = {m: i for i, m in enumerate([""] + wrapped)}
        units = len(seen) + rng.randint(0, 2)  # units that own nothing keep their first and last
        assert _owners(tuple(names), seen, units) == plain(names, seen, units)


def test_the_wrappings_of_every_preset_resolve_as_before():
    """The blocks and torchtitan presets on every llama-layout preset and config: each unit's parameters (a unit of
    one module takes ``_owners``' order as it is) in ``named_parameters()`` order, every parameter in one unit."""
    from zeroplan.engines.fsdp2.wrap import _resolve, preset

    for spec in _real_specs():
        shapes = S.transformer_shapes(spec)
        names = [n for n, _ in shapes]
        for name in ("blocks", "torchtitan"):
            if name == "torchtitan" and spec.tied:
                continue
            units = _resolve.__wrapped__(preset(name, spec.style, True, spec.tied), shapes, ())
            got = sorted(n for u in units for n, _ in u.params)
            assert got == sorted(names)
            for u in units:
                if len(u.modules) == 1:
                    idx = [names.index(n) for n, _ in u.params]
                    assert idx == sorted(idx)


def test_a_units_numel_is_the_plain_sum():
    """``Unit.numel`` is the sum of its shapes' products (scalars, empty dims)."""
    from zeroplan.engines.fsdp2.param import Unit

    rng = random.Random(5)
    for _ in range(300):
        shapes = tuple(tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(0, 9)))
        assert Unit("u", shapes).numel == sum(math.prod(s) for s in shapes)


def test_rank_run_is_the_run_replaced_as_before():
    """``plan.rank_run`` (the replicas given to ``fsdp2_run``, the TP activations kept by value) against the two
    ``replace`` calls it made: the same run, field for field, on llama2-7b and a tiny llama at T = 1, 2, 4, flat and
    HSDP, with and without SP and loss parallel, on CUDA and gloo on CPU, every rank asked twice (the kept
    activations are the built ones); and the kept ``tp_acts`` equal to a fresh one on each."""
    from zeroplan.engines.fsdp2 import plan as P
    from zeroplan.engines.fsdp2.mesh import resolve_mesh, shard_groups, shard_rank
    from zeroplan.engines.fsdp2.settings import Settings
    from zeroplan.engines.fsdp2.terms import fsdp2_run
    from zeroplan.engines.fsdp2.tp import tp_acts
    from zeroplan.engines.fsdp2.tp_estimate import tp_local
    from zeroplan.estimation.workload import model_workload
    from zeroplan.formulas.dtypes import dtype_bytes

    def old_rank_run(workload, nd, settings):
        settings = settings.model_copy(update={"rank": shard_rank(settings, nd)})
        replicate, nd = shard_groups(settings, nd)
        run = replace(fsdp2_run(workload, nd, settings), replicate=replicate)
        if (settings.tp or 1) > 1 and run.acts is not None:
            run = replace(run, acts=tp_acts(run.acts, workload.spec, settings.tp, workload.micro_batch * workload.seq_len,
                                            dtype_bytes(settings.param), settings.sequence_parallel,
                                            settings.backend == "gloo", workload.seq_len, settings.loss_parallel))
        return run, nd

    tiny = str(Path(__file__).parent / "data" / "hf_configs" / "tiny-llama.json")
    checked = 0
    for model, nd in (("llama2-7b", 64), (tiny, 16)):
        spec = resolve_model(model)
        for ckpt in ("none", "full"):
            workload = model_workload(spec, min(512, spec.max_seq_len), 2, ckpt)
            for t in (1, 2, 4):
                for sp, lp, device, repl in ((True, True, "cuda", None), (False, True, "cuda", 2),
                                             (True, False, "cuda", 4), (False, False, "cpu", 2)):
                    kw = dict(tp=t, sequence_parallel=sp, loss_parallel=lp, device=device,
                              backend="gloo" if device == "cpu" else "nccl", dp_replicate=repl)
                    try:
                        settings = Settings(**kw, param_dtype="bf16", reduce_dtype="fp32")
                        w, n, s = tp_local(workload, nd, settings) if t > 1 else (workload, nd, settings)
                        s = resolve_mesh(s.model_copy(update={"rank": 0}), n)
                    except ValueError:
                        continue
                    for rank in (0, n - 1, 0):
                        s = s.model_copy(update={"rank": rank})
                        got, want = P.rank_run(w, n, s), old_rank_run(w, n, s)
                        assert got == want
                        checked += 1
                        if t > 1:
                            args = (want[0].acts, w.spec, t, 2 * w.seq_len, 2, sp, device == "cpu", w.seq_len, lp)
                            assert P._tp_acts(*args) == tp_acts(*args)
    assert checked > 40


def test_numels_and_a_ranks_memo_are_the_plain_ones():
    """``spec.numels`` is each shape's product (tuples, lists, scalars); ``Fsdp2Run.for_rank`` keeps every memo entry
    but the ranked ones (``memo.RANKED``), the same objects in the same order, as the loop it replaced."""
    from zeroplan.engines.fsdp2.memo import RANKED
    from zeroplan.engines.fsdp2.moments import moments
    from zeroplan.engines.fsdp2.plan import rank_run
    from zeroplan.engines.fsdp2.settings import Settings
    from zeroplan.estimation.workload import model_workload

    rng = random.Random(9)
    for _ in range(200):
        shapes = [(f"p{i}", [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]) for i in range(rng.randint(0, 9))]
        for given in (shapes, tuple((n, tuple(s)) for n, s in shapes)):
            assert S.numels(given) == tuple(math.prod(s) for _, s in given)
    spec = resolve_model(str(Path(__file__).parent / "data" / "hf_configs" / "tiny-llama.json"))
    for ckpt in ("none", "full"):
        run, _ = rank_run(model_workload(spec, 16, 2, ckpt), 8, Settings(rank=0, param_dtype="bf16"))
        moments(run)
        assert any(k[0] in RANKED for k in run.memo) and len(run.memo) > 20
        want = {k: v for k, v in run.memo.items() if k[0] not in RANKED}
        got = run.for_rank(5).memo
        assert list(got) == list(want) and all(got[k] is v for k, v in want.items())


def test_a_kept_wrapping_preset_is_the_one_built():
    """``wrap.preset`` kept by its arguments: equal to a fresh one for every name, layout, reshard value (True and 1,
    False and 0 apart: their entries keep their own types) and tying, asked twice; a refused one raises each time."""
    from zeroplan.engines.fsdp2.wrap import preset

    for name in ("blocks", "torchtitan", "nope"):
        for style in ("gpt", "llama"):
            for blocks in (True, False, 1, 0, 2, 8):
                for tied in (False, True):
                    try:
                        want = preset.__wrapped__(name, style, blocks, tied)
                    except ValueError as exc:
                        for _ in range(2):
                            with pytest.raises(ValueError, match=str(exc)[:30]):
                                preset(name, style, blocks, tied)
                        continue
                    for _ in range(2):
                        got = preset(name, style, blocks, tied)
                        assert got == want
                        assert [type(e.reshard_after_forward) for e in got.units] == \
                            [type(e.reshard_after_forward) for e in want.units]
