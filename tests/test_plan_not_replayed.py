"""A plan row whose live peak alone exceeds the GPU less the headroom is not replayed through the allocator model
(``planning/reserved_fit.py live_over``): reserved >= allocated >= live, so "fits: no" is settled without it. Its
reserved cell prints ``—`` and its JSON ``reserved_bytes`` is null with ``reserved_not_replayed``; every other row
is replayed as before (with ``replay_all``: an engine's plan otherwise stops at its first fitting row,
tests/test_plan_first_fit.py), and ``estimate`` always replays. gpt-tiny (2 layers, d = 36) on 2 ranks: CPU seconds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import zeroplan
from zeroplan.planning import engine_plan, plan as ladder
from zeroplan.planning.reserved_fit import NOT_REPLAYED
from zeroplan.render.plan import to_json, to_table

TINY = str(Path(__file__).parent / "data" / "hf_configs" / "tiny-gpt2.json")
ROOMY = 2**40  # every row's live peak fits: every traced row replayed


@pytest.fixture(scope="module")
def roomy() -> dict:
    """{engine: its plan of gpt-tiny on 2 ranks of a 1 TiB card}."""
    return {e: zeroplan.plan(TINY, gpus=2, gpu_memory_bytes=ROOMY, engine=e, replay_all=True)
            for e in ("fsdp2", "deepspeed", "reference")}  # fmt: skip


def _traced(p) -> list:
    """The rows with an allocation trace (an offload option of the ladder has none)."""
    return [o for o in p.options if o.reserved is not None or o.not_replayed is not None]


def _between(p) -> int:
    """A card between the traced rows' live peaks: some alone exceed it, some fit (the median, rounded up)."""
    peaks = sorted({o.peak.peak_bytes for o in _traced(p)})
    assert len(peaks) >= 2, peaks
    return peaks[len(peaks) // 2] - 1


def test_every_replayed_row_reserves_at_least_its_allocated_bytes_and_allocates_at_least_its_live_peak(roomy):
    # the premise of the rule: were it false for a row, skipping its replay could turn "fits: yes" into "no"
    for p in roomy.values():
        rows = _traced(p)
        assert len(rows) == 4 if p.config.engine != "deepspeed" else len(rows) == 16
        for o in rows:
            assert o.not_replayed is None
            assert o.reserved.reserved_bytes >= o.reserved.allocated_bytes >= o.peak.peak_bytes


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed", "reference"])
def test_a_row_is_replayed_exactly_when_its_live_peak_fits(engine, roomy, monkeypatch):
    memory = _between(roomy[engine])
    replayed = []
    for module in (engine_plan, ladder):  # the plan's replays (the fragmentation advice's own are not counted)
        real = module.reserved_of
        monkeypatch.setattr(module, "reserved_of", lambda t, conf="", real=real: replayed.append(t) or real(t, conf))
    p = zeroplan.plan(TINY, gpus=2, gpu_memory_bytes=memory, engine=engine, replay_all=True)
    rows = _traced(p)
    over = [o for o in rows if o.peak.peak_bytes > p.budget_bytes]
    assert 0 < len(over) < len(rows) and len(replayed) == len(rows) - len(over)
    before = {o.label: o for o in _traced(roomy[engine])}
    for o in rows:
        if o in over:
            assert o.reserved is None and o.not_replayed == NOT_REPLAYED and not o.fits
        else:  # replayed, to the same bytes as on the roomy card
            assert o.not_replayed is None and o.reserved == before[o.label].reserved
            assert o.fits == (o.reserved.reserved_bytes <= p.budget_bytes)
    assert p.fit_basis == roomy[engine].fit_basis  # still fits on reserved bytes, though some rows were not replayed


@pytest.mark.parametrize("engine", ["fsdp2", "reference"])
def test_the_dash_and_the_null_appear_only_on_rows_not_replayed(engine, roomy):
    for memory in (ROOMY, _between(roomy[engine])):
        p = roomy[engine] if memory == ROOMY else zeroplan.plan(TINY, gpus=2, gpu_memory_bytes=memory, engine=engine,
                                                                replay_all=True)  # fmt: skip
        over = {o.label for o in _traced(p) if o.peak.peak_bytes > p.budget_bytes}
        assert bool(over) == (memory != ROOMY)
        doc = json.loads(to_json(p))
        for row in doc["stages"] + doc["offload"]:
            if row["label"] in over:
                assert row["reserved_bytes"] is None and row["reserved_phases"] is None
                assert row["reserved_not_replayed"] == NOT_REPLAYED
            else:
                assert "reserved_not_replayed" not in row
                assert (row["reserved_bytes"] is None) == (row["offload"]["optimizer"] != "none")
        lines = to_table(p).splitlines()
        header = next(i for i, line in enumerate(lines) if re.split(r"\s{2,}", line.strip())[-1] in ("exposed", "PCIe"))
        column = re.split(r"\s{2,}", lines[header].strip()).index("reserved")
        cells = {}
        for line in lines[header + 2: header + 2 + len(p.options)]:
            row = re.split(r"\s{2,}", line.strip())
            cells[row[0]] = row[column]
        assert {label for label, cell in cells.items() if cell == "—"} == over
        notes = [line for line in lines if line.startswith("reserved —: ")]
        assert notes == ([f"reserved —: {NOT_REPLAYED}."] if over else [])
        assert lines.index(notes[0]) == header + 2 + len(p.options) if over else True  # right under the table


def test_estimate_replays_the_configuration_asked_even_when_its_live_peak_exceeds_the_card():
    e = zeroplan.estimate(model=TINY, gpus=2, gpu_memory_bytes=2**20, engine="fsdp2")
    (row,) = e.stages
    assert row.peak.peak_bytes > 2**20 and not row.fits
    assert row.reserved.reserved_bytes >= row.reserved.allocated_bytes >= row.peak.peak_bytes
