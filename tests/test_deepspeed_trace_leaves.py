"""ZeRO-3's module trace gathers, at a sparse MLP leaf's fetch, every parameter below it (``trace._TraceBuilder``
``_under``: its descendants in the module tree). A speed-up, no rule (issue 16's plan speed: each leaf of a sparse
model tested every module's name): checked here against that scan, module for module, on every architecture of
tests/data/hf_configs, the validator's causal LM and transformers' model (its head tied as a run ties it), and on random
module trees whose names share prefixes (``a.b`` beside ``a.bc``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from zeroplan.architectures.hf_config import spec_from_hf_config
from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.deepspeed.trace import ATTENTION_FORWARD, _TraceBuilder, stage3_trace

CONFIGS = sorted((Path(__file__).resolve().parent / "data" / "hf_configs").glob("*.json"))


def _scan(builder, path):
    """The parameters below ``path`` as ``_TraceBuilder.module`` found them before (main at 9c9090d)."""
    return sorted(i for c, ps in builder.params.items() if c.startswith(path + ".") for i in ps)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_module_under_equals_the_name_scan(config, monkeypatch):
    spec = spec_from_hf_config(json.loads(config.read_text()))
    shapes = tuple(transformer_shapes(spec))
    for hf in (False, True):
        for tied in (spec.tie_word_embeddings and (spec.style == "gpt" or hf),):  # run.head_tied's
            calls = ATTENTION_FORWARD.get(spec.model_type, ()) if hf else ()
            builder = _TraceBuilder(shapes, spec.style, tied, hf, calls)
            for path in builder.children:
                assert builder._under(path) == _scan(builder, path), path
            got = stage3_trace(shapes, spec.style, tied, hf, calls)
            monkeypatch.setattr(_TraceBuilder, "_under", _scan)
            want = stage3_trace(shapes, spec.style, tied, hf, calls)
            monkeypatch.undo()
            assert got.modules == want.modules and got.steps == want.steps and got == want


def test_random_trees_with_shared_prefixes():
    rng = random.Random(3)
    for _ in range(300):
        names, paths = [], [""]
        for _ in range(rng.randint(1, 40)):
            parent = rng.choice(paths)
            child = (parent + "." if parent else "") + rng.choice(("a", "b", "ab", "a.b", "experts", "0", "1", "10"))
            paths.append(child)
            if rng.random() < 0.7:
                names.append(child + "." + rng.choice(("weight", "bias")))
        names = list(dict.fromkeys(names)) or ["w"]
        builder = _TraceBuilder(tuple((n, (2,)) for n in names), None, False, False)
        for path in builder.children:
            assert builder._under(path) == _scan(builder, path), (names, path)
