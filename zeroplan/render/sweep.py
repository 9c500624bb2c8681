"""JSON, CSV and Parquet views of a sweep (frames of ``zeroplan.sweep``). Nothing is computed here.

The writers take the sweep as consecutive frames (``zeroplan.sweeping.grid.sweep_frames``) and stream
them to a binary file, so a million-row sweep never becomes one 200 MB string. CSV is formatted
column by column with pyarrow when it is installed (the text is the same as pandas' ``to_csv``:
``tests/test_hardening.py`` compares them), else with pandas, one frame at a time. Parquet needs pyarrow.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO, Any

from zeroplan.render.schemas import PolicyOut, SweepDoc, SweepInputs, json_text
from zeroplan.sweeping.config import SweepConfig

_NEEDS_QUOTES = set(',"\r\n')


def to_records(frame) -> list[dict]:
    """Rows as plain Python values (``fits`` None when unknown), for JSON."""
    nullable = ("fits", "reduction_vs_dp", "activation_bytes", "total_bytes", "total_fits", "peak_bytes",
                "peak_fits", "peak_rank", "reserved_bytes", "reserved_fits")  # fmt: skip
    out = frame.astype({**dict.fromkeys(nullable, object), "name": str, "offload": str, "collectives": str,
                        "peak_phase": str})  # fmt: skip
    for column in nullable:  # unknown fit or activations, no ratio when nothing stays on the GPU
        out[column] = out[column].where(out[column].notna(), None)
    phase = out["peak_phase"].astype(object)
    out["peak_phase"] = phase.where(phase != "", None)  # "" codes no peak
    return out.to_dict(orient="records")


def _json_head(columns: list[str], config: SweepConfig) -> str:
    doc = SweepDoc(
        inputs=SweepInputs(
            gpu_memory_bytes=config.gpu_memory_bytes, policy=PolicyOut(**config.byte_policy.resolved()),
            **(dict(model=config.model, seq_len=config.sequence_length, checkpointing=config.checkpointing,
                    foreach=config.foreach, engine=config.engine, alloc_conf=config.alloc_conf)
               if config.model is not None else
               dict(model=None, seq_len=None, checkpointing=None, foreach=None, engine=None, alloc_conf=None)),
            headroom=config.headroom,
        ),
        columns=columns,
        rows=[],
    )
    return json_text(doc.dump(), indent=2).removesuffix("[]\n}").removesuffix("[]}")


def write_json(frames: Iterable[Any], config: SweepConfig, out: IO[bytes]) -> None:
    """The sweep as one JSON object: schema, the fixed inputs, and ``rows`` (one per configuration, stage).

    One row per line keeps a big sweep greppable and diffable; the rest is indented as usual. Rows are
    the frame's columns, which are ``SweepRow``'s fields by construction (``COLUMNS``); they are not
    validated one by one here (that would double the time of a million-row sweep): the tests do.
    """
    first = True
    for frame in frames:
        if first:
            out.write(f"{_json_head(list(frame.columns), config)}[\n".encode())
        rows = ",\n".join("    " + json_text(r) for r in to_records(frame))
        out.write(((",\n" if not first else "") + rows).encode())
        first = False
    out.write(b"\n  ]\n}\n")


def to_json(frame, config: SweepConfig) -> str:
    """``write_json`` of one frame, as text."""
    import io

    buffer = io.BytesIO()
    write_json([frame], config, buffer)
    return buffer.getvalue().decode()


def _arrow_strings(column) -> Any:
    """One column as a pyarrow array that the CSV writer prints as pandas' ``to_csv`` does: strings
    formatted here, integers left to the writer."""
    import numpy as np
    import pyarrow as pa

    dtype = column.dtype.name  # by name: pandas is imported by the sweep module only
    if dtype == "category":
        labels = [str(c) for c in column.cat.categories]
        if any(_NEEDS_QUOTES & set(x) for x in labels):
            return None
        codes = pa.array(column.cat.codes.to_numpy())
        return pa.DictionaryArray.from_arrays(codes, pa.array(labels, pa.string()))
    if dtype == "float64":
        return _float_strings(column.to_numpy())
    if dtype == "boolean":
        data, mask = column.array._data, column.array._mask
        codes = data.astype(np.int8) + 2 * mask.astype(np.int8)
        labels = pa.array(["False", "True", "", ""], pa.string())
        return pa.DictionaryArray.from_arrays(pa.array(codes), labels)
    if dtype == "Int64":  # pyarrow's CSV writer prints integers as str() does, and a null as nothing
        return pa.array(column.array._data, mask=column.array._mask)
    if dtype == "int64":
        return pa.array(column.to_numpy())
    return None


def _float_strings(values) -> Any:
    """Floats as ``repr`` writes them (pandas' CSV text), NaN empty. pyarrow's shortest round-trip text
    is the same digits for |x| in [1e-4, 1e10) (``tests/test_hardening.py`` checks), except that it
    drops the ``.0`` of whole numbers; other values (rare here: ratios) are formatted by ``repr``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    size = np.abs(values)
    plain = (size >= 1e-4) & (size < 1e10)
    whole = plain & (values == np.floor(values))
    texts = pc.cast(pa.array(values), pa.string())
    whole_texts = pc.binary_join_element_wise(
        pc.cast(pa.array(np.where(whole, values, 0).astype(np.int64)), pa.string()), ".0", ""
    )
    texts = pc.if_else(pa.array(whole), whole_texts, texts)
    if plain.all():
        return texts
    out = texts.to_numpy(zero_copy_only=False).astype(object)
    for i in np.flatnonzero(~plain):
        out[i] = "" if np.isnan(values[i]) else repr(float(values[i]))
    return pa.array(out, pa.string())


def _arrow_table(frame) -> Any:
    """``frame`` as a pyarrow table of what the CSV writer should print; None when a column is not one
    of the sweep's dtypes or a value would need quotes (the caller then lets pandas write the frame)."""
    import pyarrow as pa

    columns = {}
    for name in frame.columns:
        values = _arrow_strings(frame[name])
        if values is None:
            return None
        columns[name] = values
    return pa.table(columns)


def _write_rows(frame, table, out: IO[bytes]) -> None:
    if table is None:
        out.write(frame.to_csv(index=False, header=False, lineterminator="\n").encode())
        return
    import pyarrow.csv as pa_csv

    pa_csv.write_csv(table, out, pa_csv.WriteOptions(include_header=False, quoting_style="none"))


def write_csv(frames: Iterable[Any], out: IO[bytes]) -> None:
    """The sweep as CSV with a header row, frame by frame; ``fits`` is empty when no GPU memory was given."""
    try:
        import pyarrow  # noqa: F401

        fast = True
    except ImportError:
        fast = False
    for i, frame in enumerate(frames):
        if i == 0:
            out.write((",".join(frame.columns) + "\n").encode())
        _write_rows(frame, _arrow_table(frame) if fast else None, out)


def to_csv(frame) -> str:
    """The sweep as CSV text with a header row (pandas' own formatting)."""
    return frame.to_csv(index=False, lineterminator="\n")


def write_parquet(frames: Iterable[Any], path: str) -> None:
    """The sweep as a Parquet file (pyarrow), one row group per frame; dtypes kept (categories, nullable
    integers and booleans)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    try:
        for frame in frames:
            if writer is None:
                table = pa.Table.from_pandas(frame, preserve_index=False)
                writer = pq.ParquetWriter(path, table.schema)
            else:
                table = pa.Table.from_pandas(frame, schema=writer.schema, preserve_index=False)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()
