"""Before regenerating the golden files after an output gained keys, columns or lines: list every
pre-existing value that changed. Run: PYTHONPATH=$PWD python tests/golden_superset.py

JSON: every key of the stored file must be in the new output with the same value (lists element by
element); CSV: every stored column, row by row; text: the stored lines, in order, among the new ones.
Prints one line per difference and exits 1 if there is any; the golden files are not touched.
"""

from __future__ import annotations

import csv
import io
import json
import sys

from golden import COMMANDS, GOLDEN, run


def json_diffs(old: object, new: object, path: str = "") -> list[str]:
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{path}: was an object"]
        out = []
        for k, v in old.items():
            out += json_diffs(v, new[k], f"{path}.{k}") if k in new else [f"{path}.{k}: key removed"]
        return out
    if isinstance(old, list):
        if isinstance(new, list) and len(new) > len(old) and new[: len(old)] == old and path.endswith("columns"):
            return []  # columns appended at the end
        if not isinstance(new, list) or len(new) != len(old):
            return [f"{path}: list length {len(old)} -> {len(new) if isinstance(new, list) else new!r}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in json_diffs(a, b, f"{path}[{i}]")]
    return [] if old == new and type(old) is type(new) else [f"{path}: {old!r} -> {new!r}"]


def csv_diffs(old: str, new: str) -> list[str]:
    a, b = list(csv.DictReader(io.StringIO(old))), list(csv.DictReader(io.StringIO(new)))
    if len(a) != len(b):
        return [f"rows {len(a)} -> {len(b)}"]
    return [f"row {i} {k}: {r[k]!r} -> {s.get(k)!r}" for i, (r, s) in enumerate(zip(a, b)) for k in r if r[k] != s.get(k)]


def text_diffs(old: str, new: str) -> list[str]:
    """Stored lines not found, in order, among the new ones (a missing line does not consume the rest)."""
    lines, at, out = new.splitlines(), 0, []
    for line in old.splitlines():
        if line in lines[at:]:
            at = lines.index(line, at) + 1
        else:
            out.append(f"line gone or changed: {line!r}")
    return out


def main() -> int:
    bad = 0
    for name, argv in COMMANDS.items():
        path = GOLDEN / name
        if not path.exists():
            print(f"{name}: new case")
            continue
        old, new = path.read_text(), run(argv)
        check = json_diffs(json.loads(old), json.loads(new)) if name.endswith(".json") else (
            csv_diffs(old, new) if name.endswith(".csv") else text_diffs(old, new))  # fmt: skip
        for d in check:
            print(f"{name}: {d}")
        bad += bool(check)
        if not check:
            print(f"{name}: every stored value unchanged" + ("" if old == new else " (keys/columns/lines added)"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
