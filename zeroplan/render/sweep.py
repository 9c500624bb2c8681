"""JSON, CSV and Parquet views of a sweep (frames of ``zeroplan.sweep``). Nothing is computed here.

The writers take the sweep as consecutive frames (``zeroplan.sweeping.grid.sweep_frames``; CSV also takes
the numpy ``Columns`` of ``sweep_columns``, without pandas) and stream them to a binary file, so a
million-row sweep never becomes one 200 MB string. CSV is formatted with pyarrow when it is installed (the
text is the same as pandas' ``to_csv``: ``tests/test_hardening.py`` compares them), else with pandas, one
frame at a time: each column's text once per distinct value where it has few (GPU counts, stages, labels,
constants; adjacent ones merged), else cast per row, and the columns joined into lines. Parquet needs pyarrow.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO, Any

from zeroplan.sweeping.columns import Labels, Masked, n_rows, row_slice
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
    from zeroplan.render.schemas import PolicyOut, SweepDoc, SweepInputs, json_text

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
    from zeroplan.render.schemas import json_text  # the JSON documents' models: not loaded for CSV

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


CSV_SLICE_ROWS = 2**15
"""Rows formatted at a time (about 7 MB of text, one pyarrow string array): small, so the text of a slice
adds little to the peak RSS (2**17 rows added 45 MiB) and costs no more CPU time."""
MERGE_LABELS = 4096
"""Most labels a run of adjacent coded columns is merged into (their text joined once per label, not per row)."""


def _array(values, missing=None) -> Any:
    """An int64, float64, int8 or bool numpy array as a pyarrow array, ``missing`` (bool) as nulls. Built from
    the buffers: ``pa.array`` would import pandas to ask whether ``values`` is a pandas object."""
    import numpy as np
    import pyarrow as pa

    n = len(values)
    validity = None if missing is None else pa.py_buffer(np.packbits(~missing, bitorder="little"))
    if values.dtype == bool:
        return pa.Array.from_buffers(pa.bool_(), n, [validity, pa.py_buffer(np.packbits(values, bitorder="little"))])
    kind = {"int64": pa.int64(), "float64": pa.float64(), "int8": pa.int8()}[values.dtype.name]
    return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(np.ascontiguousarray(values))])


def _strings(texts: list[str]) -> Any:
    """``texts`` as a pyarrow string array, from its buffers (see ``_array``)."""
    import numpy as np
    import pyarrow as pa

    text = "".join(texts)
    if text.isascii():  # a character is a byte: the lengths of the str are those of the UTF-8 (the usual case)
        data, lengths = text.encode(), map(len, texts)
    else:
        encoded = [t.encode() for t in texts]
        data, lengths = b"".join(encoded), map(len, encoded)
    offsets = np.zeros(len(texts) + 1, dtype=np.int32)
    offsets[1:] = np.fromiter(lengths, dtype=np.int64, count=len(texts)).cumsum()
    return pa.Array.from_buffers(pa.string(), len(texts), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _text(values) -> Any:
    """An int64 or float64 pyarrow array as strings (``pyarrow.compute.cast``, safe)."""
    import pyarrow as pa

    return _call("cast", values, options=_compute().CastOptions.safe(pa.string()))


def _call(name: str, *args, options=None) -> Any:
    """The pyarrow compute function ``name`` (``pyarrow.compute.call_function``, from the module that defines it):
    importing ``pyarrow.compute`` builds a Python wrapper for each of its functions, about 40 ms of CPU time
    (docs/benchmarks.md, "The CSV sweep, fifth pass"), and the CSV needs four of them."""
    return _compute().call_function(name, list(args), options)


def _compute() -> Any:
    """``pyarrow._compute``, the module ``pyarrow.compute`` takes ``call_function``, ``CastOptions`` and
    ``JoinOptions`` from (a private module: a pyarrow that moves them gets the public ``pyarrow.compute``, the
    same functions, ~40 ms slower to import)."""
    try:
        import pyarrow._compute as pc

        pc.call_function, pc.CastOptions, pc.JoinOptions  # noqa: B018 (the three names this module uses)
    except (ImportError, AttributeError):
        import pyarrow.compute as pc
    return pc


def _joined(*args, null_as_empty: bool = False) -> Any:
    """``binary_join_element_wise``: ``args[:-1]`` joined by ``args[-1]`` row by row; a null field is empty
    text when ``null_as_empty``, else it makes the row null (pyarrow's default)."""
    JoinOptions = _compute().JoinOptions

    options = JoinOptions(null_handling="replace", null_replacement="") if null_as_empty else JoinOptions()
    return _call("binary_join_element_wise", *args, options=options)


def _float_strings(values) -> Any:
    """Floats as ``repr`` writes them (pandas' CSV text), NaN empty. pyarrow's shortest round-trip text
    is the same digits for |x| in [1e-4, 1e10) (``tests/test_hardening.py`` checks), except that it
    drops the ``.0`` of whole numbers; other values (rare here: ratios) are formatted by ``repr``."""
    import numpy as np

    size = np.abs(values)
    plain = (size >= 1e-4) & (size < 1e10)
    whole = plain & (values == np.floor(values))
    texts = _text(_array(values))
    if whole.any():  # "1" -> "1.0", only where a value is whole (stage 0's ratio is 1.0)
        dot_zero, empty = _strings([".0", ""])
        fixed = _joined(_text(_array(values[whole].astype(np.int64))), empty, dot_zero)
        texts = _call("replace_with_mask", texts, _array(whole), fixed)
    if plain.all():
        return texts
    out = texts.to_numpy(zero_copy_only=False).astype(object)
    for i in np.flatnonzero(~plain):
        out[i] = "" if np.isnan(values[i]) else repr(float(values[i]))
    return _strings(list(out))


def _columns_of(frame) -> Any:
    """A sweep DataFrame as ``Columns`` (by dtype name: pandas is imported by the sweep module only); None when
    a column is not one of the sweep's dtypes."""
    columns = {}
    for name in frame.columns:
        column = frame[name]
        dtype = column.dtype.name
        if dtype == "category":
            codes = column.cat.codes.to_numpy()
            if codes.size and codes.min() < 0:
                return None
            columns[name] = Labels(codes, tuple(str(c) for c in column.cat.categories))
        elif dtype in ("Int64", "boolean"):
            columns[name] = Masked(column.array._data, column.array._mask)
        elif dtype in ("int64", "float64"):
            columns[name] = column.to_numpy()
        else:
            return None
    return columns


def _pieces(columns) -> Any:
    """Each column as (codes, labels) where its text has few values (codes None: the same on every row), else
    as a pyarrow string array (nulls for empty); None when a label would need CSV quotes."""
    import numpy as np

    pieces = []
    for column in columns.values():
        if isinstance(column, Labels):
            if any(_NEEDS_QUOTES & set(x) for x in column.categories):
                return None
            pieces.append(_coded(column.codes, list(column.categories)))
        elif isinstance(column, Masked) and column.missing.all():
            pieces.append((None, [""]))
        elif isinstance(column, Masked) and column.values.dtype == bool:
            codes = column.values.astype(np.int64) + 2 * column.missing
            pieces.append(_coded(codes, ["False", "True", "", ""]))
        elif isinstance(column, Masked):
            pieces.append(_text(_array(column.values, column.missing)))
        elif column.dtype == np.float64:
            pieces.append(_float_strings(column))
        else:
            pieces.append(_int_piece(column))
    return pieces


def _coded(codes, texts: list[str]) -> tuple:
    """(codes, labels), or (None, [the one label]) when every row has the same code."""
    if codes.size and codes.min() == codes.max():
        return None, [texts[int(codes[0])]]
    return codes, texts


def _int_piece(column) -> Any:
    """An int64 column's text: labels of the values present for small counts (GPU counts, stages), of runs of
    one value (Ψ over a block of rows), else formatted per row by pyarrow."""
    import numpy as np

    low, high = (int(column.min()), int(column.max())) if column.size else (0, 0)
    if low == high:
        return None, [str(low)]
    if low >= 0 and high < MERGE_LABELS:  # labels of the values present only (a grid has few of 0..high)
        present = np.zeros(high + 1, dtype=bool)
        present[column] = True
        return (np.cumsum(present) - 1)[column], [str(v) for v in np.flatnonzero(present).tolist()]
    starts = np.empty(column.size, dtype=bool)
    starts[0] = True
    np.not_equal(column[1:], column[:-1], out=starts[1:])
    if np.count_nonzero(starts) <= column.size // 8:
        return np.cumsum(starts) - 1, [str(v) for v in column[starts].tolist()]
    return _text(_array(column))


def _merged(pieces: list) -> list:
    """Adjacent coded pieces merged into one while their labels multiply to at most ``MERGE_LABELS``: the
    columns that repeat (constants, stage and name, empty peak columns) cost one lookup per row, not one each."""
    import numpy as np

    out: list = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, tuple) and isinstance(last, tuple) and len(last[1]) * len(piece[1]) <= MERGE_LABELS:
            (a, a_labels), (b, b_labels) = last, piece
            a, b = (None if c is None else c.astype(np.int64, copy=False) for c in (a, b))  # int8 codes overflow
            codes = None if a is None and b is None else (0 if a is None else a * len(b_labels)) + (0 if b is None else b)
            out[-1] = (codes, [f"{x},{y}" for x in a_labels for y in b_labels])
        else:
            out.append(piece)
    return out


def _csv_text(columns) -> Any:
    """The CSV lines of ``columns`` (no header) as bytes, formatted by pyarrow as pandas' ``to_csv`` writes
    them; None when a label would need quotes (the caller lets pandas write those rows)."""
    import numpy as np

    pieces = _pieces(columns)
    if pieces is None:
        return None
    pieces = _merged(pieces)
    if isinstance(pieces[-1], tuple):  # the line ends inside the last labels
        pieces[-1] = (pieces[-1][0], [f"{x}\n" for x in pieces[-1][1]])
    else:  # text + "\n" + "" (a null as empty text)
        empty, newline = _strings(["", "\n"])
        pieces[-1] = _joined(pieces[-1], empty, newline, null_as_empty=True)
    arrays = []
    for piece in pieces:
        if isinstance(piece, tuple):
            codes, texts = piece
            labels = _strings(texts)
            indices = None if codes is None else _array(np.asarray(codes, dtype=np.int64))
            arrays.append(labels[0] if codes is None else _call("take", labels, indices))
        else:
            arrays.append(piece)
    comma, = _strings([","])
    if len(arrays) == 1 and isinstance(pieces[0], tuple) and pieces[0][0] is None:  # every column constant
        return (pieces[0][1][0] * n_rows(columns)).encode()
    lines = arrays[0] if len(arrays) == 1 else _joined(*arrays, comma, null_as_empty=True)
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32, count=len(lines) + 1, offset=4 * lines.offset)
    return memoryview(lines.buffers()[2])[offsets[0]:offsets[-1]]


def write_csv(frames: Iterable[Any], out: IO[bytes]) -> None:
    """The sweep as CSV with a header row, part by part (``Columns`` from ``sweep_columns``, or DataFrames);
    ``fits`` is empty when no GPU memory was given. Formatted with pyarrow when it is installed (the text is
    pandas' ``to_csv``: ``tests/test_hardening.py`` compares them), else by pandas."""
    try:
        import pyarrow  # noqa: F401

        fast = True
    except ImportError:
        fast = False
    for i, part in enumerate(frames):
        if i == 0:
            out.write((",".join(part if isinstance(part, dict) else part.columns) + "\n").encode())
        columns = part if isinstance(part, dict) else _columns_of(part) if fast else None
        if columns is None:
            _write_with_pandas(part, out)
            continue
        for start in range(0, n_rows(columns), CSV_SLICE_ROWS):
            text = _csv_text(row_slice(columns, start, start + CSV_SLICE_ROWS))
            if text is None:  # a label needs quotes: the same in every slice, so nothing of this part is written
                _write_with_pandas(part, out)
                break
            out.write(text)


def _write_with_pandas(part, out: IO[bytes]) -> None:
    if isinstance(part, dict):
        from zeroplan.sweeping.grid import to_frame

        part = to_frame(part)
    out.write(part.to_csv(index=False, header=False, lineterminator="\n").encode())


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
