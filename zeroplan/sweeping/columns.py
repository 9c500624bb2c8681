"""A sweep's columns as numpy arrays, before pandas: what ``zeroplan sweep --out x.csv`` formats without
importing pandas (``zeroplan.render.sweep.write_csv``) and what ``zeroplan.sweeping.grid.to_frame`` turns into
the DataFrame of ``zeroplan.sweep``.

A column is one of: an int64 or float64 array (every value known), ``Masked`` (nullable int64 or bool: pandas'
``Int64`` and ``boolean``) or ``Labels`` (pandas' ``category``).
"""

from __future__ import annotations

from typing import NamedTuple, Union

import numpy as np


class Masked(NamedTuple):
    """A nullable int64 or bool column: ``values`` where ``missing`` is False, unknown where it is True."""

    values: np.ndarray
    missing: np.ndarray


class Labels(NamedTuple):
    """A categorical column: row i is ``categories[codes[i]]``."""

    codes: np.ndarray
    categories: tuple[str, ...]


Column = Union[np.ndarray, Masked, Labels]
Columns = dict[str, Column]
"""Column name -> values, in ``zeroplan.sweeping.grid.COLUMNS`` order."""


def labels(values: list[str]) -> Labels:
    """``values`` as codes into their distinct values, in order of first appearance."""
    categories = list(dict.fromkeys(values))
    index = {c: i for i, c in enumerate(categories)}
    return Labels(np.array([index[v] for v in values], dtype=np.int64), tuple(categories))


def row_slice(columns: Columns, start: int, stop: int) -> Columns:
    """Rows ``start`` to ``stop`` of ``columns`` (views, no copy)."""

    def one(c: Column) -> Column:
        if isinstance(c, Labels):
            return Labels(c.codes[start:stop], c.categories)
        if isinstance(c, Masked):
            return Masked(c.values[start:stop], c.missing[start:stop])
        return c[start:stop]

    return {name: one(c) for name, c in columns.items()}


def n_rows(columns: Columns) -> int:
    """How many rows ``columns`` hold."""
    first = next(iter(columns.values()))
    return len(first.codes if isinstance(first, Labels) else first.values if isinstance(first, Masked) else first)
