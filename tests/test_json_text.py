"""``render.json_text`` writes exactly what ``json.dumps(obj, indent=N, allow_nan=False)`` writes, each distinct flat
object once (a speed-up, no rule): compared on drawn documents full of the values json tells apart only by type or
sign, and on the documents the slowest plan and an estimate print."""

from __future__ import annotations

import enum
import json
import math
import random
from collections import OrderedDict

import pytest

import zeroplan
from zeroplan.render.json_text import json_text
from zeroplan.render.plan import plan_dict
from zeroplan.render.schemas import PlanDoc

LEAVES = [0, 1, -1, 1.0, 0.0, -0.0, True, False, None, "", "a", "é", "Ψ\n\"q\"", 2**70, 1e300, 2.5e-7, 1 / 3]


class Unit(str, enum.Enum):
    GIB = "GiB"


def _draw(rng: random.Random, depth: int = 0) -> object:
    roll = rng.random()
    if depth > 3 or roll < 0.35:
        return rng.choice([*LEAVES, Unit.GIB])
    if roll < 0.55:  # a flat object, often one seen before (the memo's case): equal values of other types too
        return {k: rng.choice(LEAVES[:9]) for k in rng.sample("abcd", rng.randint(0, 3))}
    if roll < 0.75:
        return [_draw(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if roll < 0.8:
        return tuple(_draw(rng, depth + 1) for _ in range(rng.randint(0, 3)))
    if roll < 0.85:
        return OrderedDict((k, _draw(rng, depth + 1)) for k in "xy")
    if roll < 0.9:
        return {1: _draw(rng, depth + 1), None: 2, True: 3}  # keys json coerces to strings
    return {k: _draw(rng, depth + 1) for k in rng.sample("pqrs", rng.randint(1, 4))}


@pytest.mark.parametrize("indent", [0, 1, 2, 4])
def test_drawn_documents_are_written_as_json_writes_them(indent):
    rng = random.Random(indent)
    for _ in range(400):
        doc = [_draw(rng) for _ in range(rng.randint(1, 6))]
        assert json_text(doc, indent=indent) == json.dumps(doc, indent=indent, allow_nan=False)


def test_values_equal_in_python_but_written_apart_stay_apart():
    keys = [{k: "v"} for k in (1, 1.0, True, "1", 0.0, -0.0, 0, False)] * 2  # keys json coerces, and their zeros
    assert json_text(keys, indent=2) == json.dumps(keys, indent=2)
    doc = [{"x": v} for v in (1, 1.0, True, 0, 0.0, -0.0, False)] * 2
    assert json_text(doc, indent=2) == json.dumps(doc, indent=2)
    assert [line.strip() for line in json_text(doc, indent=2).splitlines() if '"x"' in line][:7] == \
        ['"x": 1', '"x": 1.0', '"x": true', '"x": 0', '"x": 0.0', '"x": -0.0', '"x": false']  # fmt: skip


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_raise_as_json_raises_them(bad):
    for doc in ({"x": bad}, [{"a": 1}, {"a": bad}], {"deep": [{"x": 1.0}, {"x": bad}]}):
        with pytest.raises(ValueError):
            json_text(doc, indent=2)
    with pytest.raises(TypeError):
        json_text({"x": object()}, indent=2)


def test_the_slowest_plans_document_and_an_estimates_are_written_as_json_writes_them():
    p = zeroplan.plan("llama2-70b", gpu="h100-80gb", gpus=2048, engine="fsdp2")
    doc = PlanDoc.model_validate(plan_dict(p)).dump()  # as render.plan.to_json writes it
    assert json_text(doc, indent=2) == json.dumps(doc, indent=2, allow_nan=False)
    assert sum(len(row["comm_time"]["collectives"]) for row in doc["stages"]) > 4000  # the repeated flat objects
    from zeroplan.render.estimate import estimate_doc

    doc = estimate_doc(zeroplan.estimate(model="llama2-7b", gpus=64, engine="deepspeed", stage=3), None).dump()
    assert json_text(doc, indent=2) == json.dumps(doc, indent=2, allow_nan=False)
