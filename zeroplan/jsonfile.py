"""Reading a user's JSON file with a one-line error for every way it can be wrong."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(path: str | Path, what: str) -> object:
    """The parsed content of ``path``; ValueError naming ``what`` and the file if unreadable or not JSON."""
    name = f"{what} {str(path)!r}"
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{name}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not valid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
