"""An engine's plan (fsdp2, deepspeed) replays its rows in order up to the first that fits and no further
(``planning/reserved_fit.py AFTER_FIT``): a row after the recommendation prints reserved ``—`` and fits ``—`` (JSON
null, with the reason), ``--replay-all`` replays every row, and nothing else of the plan changes. Checked on the
slowest plan of the matrix (FSDP2, Llama-2-70B, 2,048 GPUs), on a DeepSpeed plan of transformers' Llama-2-7B config,
and on a fixed-seed draw of small configurations whose card lies between the rows' live peaks."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from clicheck import assert_one_line_error, run, run_json

import zeroplan
from zeroplan.planning import engine_plan
from zeroplan.planning.reserved_fit import AFTER_FIT, NOT_REPLAYED
from zeroplan.render.plan import to_json, to_table

CONFIGS = Path(__file__).parent / "data" / "hf_configs"


def _both(model: str, **options) -> tuple:
    """The plan as printed by default, and with every row replayed (``replay_all``)."""
    return zeroplan.plan(model, **options), zeroplan.plan(model, replay_all=True, **options)


def _same_but_after_fit(first, every) -> int:
    """Assert that ``first`` (default) is ``every`` (``--replay-all``) but for its rows after the recommendation,
    which lack reserved bytes and a fit, with ``AFTER_FIT`` as the reason; how many such rows there are."""
    assert first.recommendation == every.recommendation
    at = None if first.recommendation is None else first.options.index(first.recommendation)
    skipped = 0
    for i, (a, b) in enumerate(zip(first.options, every.options, strict=True)):
        if at is None or i <= at or a.not_replayed != AFTER_FIT:
            assert a == b, (i, a.label)
            assert a.not_replayed != AFTER_FIT
            continue
        skipped += 1
        assert a.reserved is None and a.fits is None
        assert b.not_replayed is None and b.reserved is not None and b.fits is not None  # replayed with --replay-all
        assert b.peak.peak_bytes <= every.budget_bytes  # only a row whose live peak fits waits on a replay
        assert a == replace(b, reserved=None, fits=None, not_replayed=AFTER_FIT)
    assert replace(first, options=(), recommendation=None, config=None) == \
        replace(every, options=(), recommendation=None, config=None)  # fmt: skip
    return skipped


@pytest.fixture(scope="module")
def llama70b() -> tuple:
    return _both("llama2-70b", gpu="h100-80gb", gpus=2048, engine="fsdp2")


def test_the_slowest_plan_stops_replaying_at_its_recommendation(llama70b, monkeypatch):
    first, every = llama70b
    assert [o.fits for o in every.options] == [False, False, True, True]  # each live peak fits, the first two
    assert [o.fits for o in first.options] == [False, False, True, None]  # rows' reserved bytes do not
    assert _same_but_after_fit(first, every) == 1
    traced = []
    real = engine_plan.reserved_of
    monkeypatch.setattr(engine_plan, "reserved_of", lambda t, conf="": traced.append(t) or real(t, conf))
    zeroplan.plan("llama2-70b", gpu="h100-80gb", gpus=2048, engine="fsdp2")
    assert len(traced) == 3  # rows 1-3 (the Fragmentation line's replay of row 1 is reserved_fit's own)


def test_a_row_after_the_recommendation_prints_dashes_and_nulls_with_its_reason(llama70b):
    first, every = llama70b
    table = to_table(first).splitlines()
    header, *rows = [re.split(r"\s{2,}", line.strip()) for line in table
                     if line.startswith(("configuration", "reshard_after_forward"))]  # fmt: skip
    cells = [[row[header.index("reserved")], row[header.index("fits")]] for row in rows]
    assert [c[1] for c in cells] == ["no", "no", "yes", "—"] and cells[3][0] == "—" and "—" not in cells[2][0]
    assert f"reserved —: {AFTER_FIT}." in table
    assert not any(line.startswith("reserved —:") for line in to_table(every).splitlines())
    doc = json.loads(to_json(first))
    assert [(r["fits"], r.get("reserved_bytes"), r.get("reserved_not_replayed")) for r in doc["stages"][3:]] == \
        [(None, None, AFTER_FIT)]  # fmt: skip
    assert all("reserved_not_replayed" not in r for r in json.loads(to_json(every))["stages"])


def test_a_deepspeed_plan_of_a_transformers_config_changes_only_rows_after_its_recommendation():
    first, every = _both(str(CONFIGS / "llama-2-7b.json"), gpu="a100-80gb", gpus=64, engine="deepspeed")
    assert _same_but_after_fit(first, every) >= 1


def _draw(rng: random.Random) -> tuple[str, dict]:
    engine = rng.choice(["fsdp2", "deepspeed"])
    model = str(CONFIGS / rng.choice(["tiny-gpt2.json", "tiny-llama.json", "tiny-qwen3.json", "tiny-mixtral.json"]))
    options = dict(engine=engine, gpus=rng.choice([2, 4, 8]), micro_batch=rng.choice([1, 2, 4]),
                   headroom=rng.choice([0.0, 0.1]))  # fmt: skip
    roomy = zeroplan.plan(model, gpu_memory_bytes=2**40, replay_all=True, **options)
    peaks = sorted(o.peak.peak_bytes for o in roomy.options if o.peak is not None)
    # a card at a drawn row's live peak: rows before it may not fit, some after it do
    memory = int(rng.choice(peaks) / (1 - options["headroom"])) + rng.choice([0, 1 << 20, 1 << 24])
    return model, {**options, "gpu_memory_bytes": memory}


def test_drawn_configurations_keep_their_recommendation_and_every_row_up_to_it():
    rng = random.Random(20261203)
    skipped = []
    for _ in range(10):
        model, options = _draw(rng)
        skipped.append(_same_but_after_fit(*_both(model, **options)))
    assert sum(skipped) >= 5 and skipped.count(0) >= 1  # the draw has both: rows skipped, and plans with none


def test_a_row_over_the_budget_on_its_live_peak_keeps_its_own_reason():
    # live_over comes first: a row after the recommendation whose live peak alone does not fit is "no", not "—"
    model = str(CONFIGS / "tiny-llama.json")
    roomy = zeroplan.plan(model, gpus=2, gpu_memory_bytes=2**40, engine="deepspeed", replay_all=True)
    for memory in sorted({o.peak.peak_bytes for o in roomy.options}):
        first, every = _both(model, gpus=2, gpu_memory_bytes=memory, engine="deepspeed")
        _same_but_after_fit(first, every)
        reasons = {o.not_replayed for o in first.options}
        if {AFTER_FIT, NOT_REPLAYED} <= reasons:
            over = [o for o in first.options if o.not_replayed == NOT_REPLAYED]
            assert all(o.fits is False for o in over)
            lines = to_table(first).splitlines()
            assert f"reserved —: {NOT_REPLAYED}." in lines and f"reserved —: {AFTER_FIT}." in lines
            return
    pytest.fail("no card between the peaks gave both reasons")


def test_the_reference_plan_refuses_replay_all_in_one_line():
    result = run("plan", "--model", "llama2-7b", "--gpu", "a100-80gb", "--replay-all")
    assert_one_line_error(result, "--replay-all does not apply to plan --engine reference, which replays every row")


def test_the_cli_flag_reaches_the_plan():
    args = ("plan", "--model", str(CONFIGS / "tiny-llama.json"), "--gpus", "2", "--gpu-memory", "1TiB", "--engine")
    first, every = run_json(*args, "deepspeed"), run_json(*args, "deepspeed", "--replay-all")
    assert [r["fits"] for r in first["stages"]].count(None) == len(first["stages"]) - 1  # all fit: the first kept
    assert [r["fits"] for r in every["stages"]] == [True] * len(every["stages"])
