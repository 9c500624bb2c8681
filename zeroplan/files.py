"""The one safe JSON reader and the one atomic writer: every file zeroplan reads or writes goes through here.

Reading refuses what is not a plain file (a FIFO would block, ``/dev/zero`` never ends), files above
``MAX_JSON_BYTES``, JSON nested deeper than ``MAX_JSON_DEPTH`` (Python's parser would recurse until
RecursionError) and the non-JSON constants NaN and Infinity, each with one line.

Writes are atomic: a reader (or a crash) sees the whole new file or the old one, never a part. The
hidden temporary file is removed on every way out: an error, Ctrl-C, SIGTERM or SIGHUP. The target
must be a regular file or not exist yet (renaming over ``/dev/null``, a FIFO or a symlink would
replace it), and must not be one of the command's inputs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate
from pathlib import Path

from zeroplan.terminated import Terminated  # raised by _signals_held; importable from here too

MAX_JSON_BYTES = 64 * 2**20
"""Largest JSON file read (64 MiB): a shapes file of a 1e15-parameter model or a validator report is a
few MB; anything larger is not one of zeroplan's inputs."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects read; zeroplan's inputs nest at most 4 deep."""
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")
_DEPTH = {"[": 1, "{": 1, "]": -1, "}": -1}


def file_identity(path: str | Path) -> tuple:
    """What makes two names the same file: ``(st_dev, st_ino)`` of the file ``path`` names, links resolved
    (``os.stat`` follows them; hard links share an inode), or, for a name that does not exist yet,
    ``("new", resolved parent directory, name)``. Never compares strings: ``./d/../cfg.json``,
    ``cfg.json`` and a symlink to it are one file."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):  # missing, a name the file system refuses (too long), or a NUL byte
        path = Path(path)
        return ("new", os.path.realpath(path.parent if str(path.parent) else "."), path.name)
    return (info.st_dev, info.st_ino)


def refuse_input_as_output(output: str | Path, inputs: Sequence[str | Path | None]) -> None:
    """ValueError (one line) when ``output`` is the same file as one of ``inputs`` (``file_identity``).

    The one home of the rule "no command writes over its own input": every command that writes a file
    (``sweep --out``, ``plot --out``, ``validate --json``) passes every file it reads (``--model`` config,
    ``--shapes``, ``--deepspeed-config``, ``--results``, ``--baseline``). An input that does not exist
    (a preset name given to ``--model``) is no file and is skipped."""
    target = file_identity(output)
    if target[0] == "new":
        return  # an input was read, so it exists; a name not yet created is none of them
    for source in inputs:
        if source is not None and os.path.exists(source) and file_identity(source) == target:
            raise ValueError(f"{str(output)[:80]!r}: is also an input of this command ({str(source)[:80]!r}); "
                             "write to another file")


def check_writable(path: str | Path, inputs: Sequence[str | Path | None] = ()) -> Path:
    """The directory ``path`` would be written into; ValueError with one line if it is missing, if
    ``path`` is a directory or anything but a regular file (FIFO, device, symlink), or if it is one of
    ``inputs``. Commands call this before any work, and ``atomic_write`` again when writing."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:  # is_dir raises for a name the file system refuses (too long)
        if not parent.is_dir():
            raise ValueError(f"{str(path)[:80]!r}: directory {str(parent)[:80]!r} does not exist")
        if path.is_dir():
            raise ValueError(f"{str(path)[:80]!r}: is a directory; give a file name")
    except OSError as exc:
        raise ValueError(f"{str(path)[:80]!r}: cannot write there ({exc.strerror})") from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise ValueError(f"{str(path)!r}: cannot write there ({exc.strerror})") from None
    if mode is not None and stat.S_ISLNK(mode):
        raise ValueError(f"{str(path)!r}: is a symbolic link; give the file it points to, or a new name")
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(f"{str(path)!r}: not a regular file (a device, FIFO or socket); give a file name")
    refuse_input_as_output(path, inputs)
    # The writer's own first step, tried now: a temporary file beside the target, with a name as long as
    # the writer's (``~`` where it has ``.``, so the probe is never mistaken for a write in progress);
    # SIGTERM and SIGHUP wait until it is gone, so a signal cannot leave it behind.
    with _signals_held():
        try:
            fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}~")
        except OSError as exc:
            raise ValueError(f"{str(path)[:80]!r}: cannot write there ({exc.strerror})") from None
        os.close(fd)
        os.unlink(tmp)
    return parent


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Terminated`` in the main thread while the block runs, so the cleanup
    of ``atomic_write`` runs as it does for Ctrl-C; the previous handlers are restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    wanted = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {s: signal.signal(s, handler) for s in wanted}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGHUP wait until the block ends: a handler of ours records them, and on leaving the handler
    before it gets the first again (``signal.raise_signal``: ``Terminated`` inside ``atomic_write``, the default
    action outside it). Not a signal mask: ``pthread_sigmask`` holds a signal for the calling thread only, and the
    kernel hands a process's signal to any thread that does not block it (numpy's, pyarrow's), after which CPython
    runs the Python handler in the main thread at once: inside ``mkstemp``, after the file exists and before its
    name is known (a sweep's temporary file was left behind that way, once in a full test run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []

    def hold(signum: int, _frame: object) -> None:
        arrived.append(signum)

    wanted = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {s: signal.signal(s, hold) for s in wanted}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if arrived:
            signal.raise_signal(arrived[0])


def atomic_write(
    path: str | Path,
    write: Callable[[str], None],
    suffix: str = "",
    inputs: Sequence[str | Path | None] = (),
) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``.

    ``suffix`` keeps the extension for writers that look at it (matplotlib). ValueError with one line
    when the file cannot be written (no such directory, a directory or a non-regular file in the way,
    an input of the command, no permission). SIGTERM and SIGHUP during the write remove the temporary
    file and raise ``Terminated``.
    """
    path = Path(path)
    parent = check_writable(path, inputs)
    tmp = None
    with _signals_raise():
        try:
            with _signals_held():  # a signal between creating the file and knowing its name would leak it
                fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=suffix)
                os.close(fd)
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600; give the file the usual permissions
            write(tmp)
            check_writable(path, inputs)  # nothing was put in the way while writing
            os.replace(tmp, path)
        except BaseException as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise ValueError(f"{str(path)!r}: cannot write there ({exc.strerror})") from None
            raise


def write_text_atomic(path: str | Path, text: str, inputs: Sequence[str | Path | None] = ()) -> None:
    """``text`` into ``path``, atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text), inputs=inputs)


def _read_bounded(path: Path, name: str) -> bytes:
    """The bytes of ``path`` if it resolves to a regular file of at most ``MAX_JSON_BYTES``."""
    try:
        # O_NONBLOCK: opening a FIFO that no one writes to returns at once instead of blocking.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ValueError(f"{name}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # the file opened, after every symlink: no race with a check by name
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{name}: not a regular file (a device, FIFO or directory)")
        if info.st_size > MAX_JSON_BYTES:
            raise ValueError(f"{name}: {info.st_size:,} bytes, above the limit of {MAX_JSON_BYTES:,}")
        chunks, size = [], 0
        while size <= MAX_JSON_BYTES:  # the file may grow after fstat: never read past the limit
            chunk = os.read(fd, MAX_JSON_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_JSON_BYTES:
            raise ValueError(f"{name}: above the limit of {MAX_JSON_BYTES:,} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise ValueError(f"{name}: {exc.strerror}") from None
    finally:
        os.close(fd)


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of ``path``, bounded as ``read_json`` (a YAML or TOML config is parsed by its reader);
    ValueError naming ``what`` and the file."""
    name = f"{what} {str(path)!r}"
    try:
        return _read_bounded(Path(path), name).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not UTF-8 text") from None


def json_depth(text: str) -> int:
    """Deepest nesting of ``[`` and ``{`` in JSON ``text``, brackets inside strings not counted."""
    brackets = _BRACKET.findall(_STRING.sub("", text))
    return max(accumulate(_DEPTH[b] for b in brackets), default=0)


def _refuse_constant(constant: str) -> object:
    raise ValueError(f"{constant} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is too large for a number")
    return value


def read_json(path: str | Path, what: str) -> object:
    """The parsed content of ``path``; ValueError naming ``what`` and the file if unreadable, not a
    regular file, larger than ``MAX_JSON_BYTES``, nested deeper than ``MAX_JSON_DEPTH`` or not JSON."""
    name = f"{what} {str(path)!r}"
    data = _read_bounded(Path(path), name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not valid JSON (not UTF-8 text)") from None
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{name}: nested {depth} deep, above the limit of {MAX_JSON_DEPTH}")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except ValueError as exc:  # NaN/Infinity above, or an integer of more than 4300 digits (Python's limit)
        why = "a number of more than 4300 digits" if "4300 digits" in str(exc) else str(exc).splitlines()[0]
        raise ValueError(f"{name}: not valid JSON ({why})") from None
