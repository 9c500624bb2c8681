"""The JSON Schemas in docs/schemas/ are the ones the output models generate, and outputs obey them."""

import json
from pathlib import Path

import pytest

from golden import COMMANDS, GOLDEN
from zeroplan.render.schemas import DOCS, json_schemas
from zeroplan.sweeping.records import SweepRow
from zeroplan.sweeping.grid import COLUMNS

DOCS_DIR = Path(__file__).parents[1] / "docs" / "schemas"


@pytest.mark.parametrize("name", sorted(json_schemas()))
def test_committed_schema_equals_the_generated_one(name):
    # Regenerate with: python -m zeroplan.render.schemas docs/schemas
    assert (DOCS_DIR / name).read_text() == json_schemas()[name]


def test_no_stale_schema_files():
    assert {p.name for p in DOCS_DIR.glob("*.json")} == set(json_schemas())


def test_sweep_columns_are_the_row_model_fields():
    assert COLUMNS == tuple(SweepRow.model_fields)


@pytest.mark.parametrize("name", sorted(n for n in COMMANDS if n.endswith(".json")))
def test_golden_outputs_validate_against_their_model(name):
    doc = json.loads((GOLDEN / name).read_text())
    model = DOCS[doc["schema"].split(".")[1].split("/")[0]]
    assert model.model_validate(doc).dump() == doc


def test_a_wrong_key_fails_the_model():
    doc = json.loads((GOLDEN / "estimate_params.json").read_text())
    doc["stages"][0]["bytes"] = doc["stages"][0].pop("model_states_bytes")
    with pytest.raises(ValueError):
        DOCS["estimate"].model_validate(doc)
