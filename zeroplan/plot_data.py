"""What a figure needs that is not drawing: the rows it reads, the checks made before any work, and the
labels of its axes. No matplotlib here (``zeroplan.plots`` draws, and re-exports these names), so the
validator's report schema (``validate.schema.ReportRow``) extends ``ValidationRow`` without loading it.
Units: GB = 1e9 bytes, the ZeRO paper's unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictStr, ValidationError

from zeroplan.files import read_json
from zeroplan.number_formats import format_count
from zeroplan.formulas.stages import STAGES
from zeroplan.types import ByteCount, Flag, GpuCount, StageNumber, error_line

GB = 1e9
FORMATS = (".png", ".svg", ".pdf")
MAX_RUNS = 60
"""Most validator runs one ``validate`` figure draws: each is a labelled pair of bars 0.75 in wide, so 60
make a 48-inch figure, already past what a screen shows; filter the rows for more."""
MAX_PANELS = 6
"""Most Ψ panels side by side in the memory view (5 in each)."""
MAX_GPU_COUNTS = 64
"""Most GPU counts on one axis (ticks of the memory view, bar groups of the comm view)."""
VIEWS = ("memory", "breakdown", "comm", "validate")
STAGE_WHAT = ("no sharding", "optimizer sharded", "+ gradients sharded", "+ parameters sharded")


class ValidationRow(BaseModel):
    """The keys every row has (what ``zeroplan plot`` reads; other keys are ignored here)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    stage: StageNumber = Field(description="ZeRO stage 0-3")
    world_size: GpuCount = Field(description="N_d")
    mode: StrictStr = Field(description="real or simulated")
    backend: StrictStr = Field(description="gloo, nccl or fake")
    predicted_model_states_bytes: ByteCount = Field(description="zeroplan.estimate's model states per rank")
    measured_model_states_bytes: ByteCount = Field(
        description="live tensor bytes at the step boundary, max over ranks"
    )
    predicted_comm_bytes_per_rank: ByteCount = Field(description="zeroplan.estimate's bytes sent per rank per step")
    derived_comm_bytes_per_rank: ByteCount = Field(
        validation_alias=AliasChoices("derived_comm_bytes_per_rank", "measured_comm_bytes_per_rank"),
        description="ring rule applied to each observed call (derived; schema /1 called it measured_...)",
    )
    ok: Flag = Field(description="every check passed")


def load_validation(path: str | Path) -> list[ValidationRow]:
    """Rows of a ``zeroplan validate --json`` file; ValueError with one line if missing or malformed."""
    name = str(path)
    doc = read_json(path, "validation file")
    rows = doc.get("rows") if isinstance(doc, dict) else doc
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"validation file {name!r}: expected a non-empty list 'rows' of results")
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(ValidationRow.model_validate(row))
        except ValidationError as exc:
            raise ValueError(f"validation file {name!r}: rows[{i}]: {error_line(exc)}") from None
    return out


def _auto_unit(values: Sequence[float]) -> tuple[str, float]:
    """The decimal unit that puts the largest value between 1 and 1000: ('MB', 1e6), ..."""
    top = max(max(values), 1)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if top >= scale:
            return unit, scale
    return "B", 1.0


def check_format(path: str | Path) -> str:
    """The output format from the file name: '.png', '.svg' or '.pdf'; ValueError for anything else."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        what = f"unknown image extension {suffix!r}" if suffix else "no image extension"
        raise ValueError(f"out={str(path)!r}: {what}; use .png, .svg or .pdf")
    return suffix


def check_points(view: str, n_params: int = 1, n_gpus: int = 1, runs: int = 0) -> None:
    """ValueError with one line when a figure would hold more than can be read (see ``MAX_PANELS``,
    ``MAX_GPU_COUNTS``, ``MAX_RUNS``). Checked before any work: a 20,000-run validate figure took 5
    minutes and 12 GB to draw a 75 MB image no one could read."""
    if view == "validate" and runs > MAX_RUNS:
        raise ValueError(
            f"--view validate: {runs} runs, at most {MAX_RUNS} fit one figure (a labelled pair of bars "
            "each); keep fewer rows, e.g. jq '.rows |= map(select(.stage == 3))' results.json"
        )
    if view == "memory" and n_params > MAX_PANELS:
        raise ValueError(
            f"--view memory: {n_params} params values, at most {MAX_PANELS} panels fit; plot fewer"
        )
    if view in ("memory", "breakdown", "comm") and n_gpus > MAX_GPU_COUNTS:
        raise ValueError(
            f"--view {view}: {n_gpus} GPU counts, at most {MAX_GPU_COUNTS} fit one axis; give fewer --gpus"
        )


def stage_label(stage: int) -> str:
    """'stage 2 P_os+g (+ gradients sharded)'."""
    return f"stage {stage} {STAGES[stage].name} ({STAGE_WHAT[stage]})"


def _gb(x: float, _pos: object = None) -> str:
    """Tick label in GB with as few digits as the value needs: 0.5, 2, 31.4, 1200."""
    v = x / GB
    if v == 0:
        return "0"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _title_params(frame: Any) -> str:
    return ", ".join(f"Ψ = {format_count(p)}" for p in dict.fromkeys(frame["params"]))


def _one_value(frame: Any, column: str, what: str) -> int:
    values = list(dict.fromkeys(frame[column]))
    if len(values) != 1:
        raise ValueError(f"{what}: give one {column} value for this view, got {values}")
    return int(values[0])


def _suptitle(frame: Any, what: str) -> str:
    mp = sorted({int(m) for m in frame["model_parallel"]})
    tail = f", model parallel N_m = {mp[0]}" if mp != [1] else ""
    return f"{what}{tail}"
