"""The one safe JSON reader and the one atomic writer: every file zeroplan reads or writes goes through here.

Writes are atomic: a reader (or a crash) sees the whole new file or the old one, never a part."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def check_writable(path: str | Path) -> Path:
    """The directory ``path`` would be written into; ValueError with one line if it is missing or ``path``
    is a directory. Commands call this before any work, and ``atomic_write`` again when writing."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{str(path)!r}: directory {str(parent)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"{str(path)!r}: is a directory; give a file name")
    return parent


def atomic_write(path: str | Path, write: Callable[[str], None], suffix: str = "") -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``.

    ``suffix`` keeps the extension for writers that look at it (matplotlib). ValueError with one line
    when the file cannot be written (no such directory, a directory in the way, no permission).
    """
    path = Path(path)
    parent = check_writable(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=suffix)
    except OSError as exc:
        raise ValueError(f"{str(path)!r}: cannot write there ({exc.strerror})") from None
    os.close(fd)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600; give the file the usual permissions
        write(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise ValueError(f"{str(path)!r}: cannot write there ({exc.strerror})") from None
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """``text`` into ``path``, atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


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
