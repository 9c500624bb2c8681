"""Standard-library modules (and two of typer's) a ``zeroplan`` command imports (through typer, pydantic and
``inspect``) and never uses,
run at their first use instead of at their import (docs/benchmarks.md, "2026-12-03, fifth session, startup3"). Kept
out of ``cli_startup`` (full) beside it. A speed-up, no rule."""

from __future__ import annotations

import _thread
import sys
import types
from collections.abc import Callable, Iterable
from importlib.machinery import SourceFileLoader
from typing import Optional

DEFERRED_MODULES = frozenset((
    "secrets",  # pydantic.types (``secrets.compare_digest`` of a SecretStr): hmac, hashlib, OpenSSL's _hashlib, random
    "base64",  # pydantic.types (Base64 types), with binascii
    "struct",  # base64
    "subprocess",  # typer._completion_shared (shell completion): signal, selectors, select, fcntl, _posixsubprocess
    "signal",  # zeroplan.terminated (a signal while a file is written: sweep, plot)
    "bz2",  # shutil (archives), with _bz2
    "lzma",  # shutil (archives), with _lzma
    "linecache",  # inspect and traceback (source lines, read when a traceback or a source is printed)
    "tokenize",  # inspect (getsource)
    "token",  # inspect, tokenize
    "tempfile",  # zeroplan.files (a file written: sweep, plot): random, with _sha512, bisect, _random
    "shellingham",  # typer's shell completion (not a standard module: typer's own dependency)
    "typer.colors",  # typer (``typer.colors.RED``, for a caller's ``typer.style``)
))  # fmt: skip
"""The modules deferred: each is imported as ``import NAME`` by a module a command loads and used by neither
``estimate`` nor ``plan`` (every engine; tests/test_startup_deferred.py; ``--help`` runs ``struct`` and ``linecache``
for rich); the names after each are what the importer needs it for, then what its running would import. Together
about 33 M instructions of a plan (OpenSSL's ``_hashlib`` alone 2.8-3.6 CPU-ms of ``-X importtime``); ``tempfile``
about 4 M of ``estimate``, which imports ``zeroplan.files`` to read a shapes file (sixth session, imports4)."""

class DeferredModule(types.ModuleType):
    """A module whose code has not run yet. Its ``__spec__`` is read without running it (the import statement reads
    it of a module already imported: ``import subprocess`` a second time leaves it deferred); any other attribute
    read, set or deleted runs the code first (``run``), and the module is then a plain ``types.ModuleType``."""

    def __getattribute__(self, attr: str) -> object:
        if attr == "__spec__":
            return object.__getattribute__(self, "__dict__")["__spec__"]
        run(self)
        return types.ModuleType.__getattribute__(self, attr)

    def __setattr__(self, attr: str, value: object) -> None:
        run(self)
        types.ModuleType.__setattr__(self, attr, value)

    def __delattr__(self, attr: str) -> None:
        run(self)
        types.ModuleType.__delattr__(self, attr)


class DeferringLoader:
    """The loader of a deferred module's spec until it runs: ``exec_module`` makes the module a ``DeferredModule``
    (created by the import system, its ``__file__``, ``__cached__`` and ``__spec__`` set as for any module) and
    keeps itself in the spec's ``loader_state`` (None after the run, as after an import); ``loader`` is the module's
    own, which runs it, ``lock`` the module's, held while it runs."""

    def __init__(self, loader: SourceFileLoader) -> None:
        self.loader, self.running, self.lock = loader, False, _thread.RLock()

    def create_module(self, spec: object) -> Optional[types.ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__.loader_state = self
        module.__class__ = DeferredModule


def run(module: types.ModuleType) -> None:
    """Runs a ``DeferredModule``'s code once, with its own loader, which becomes its ``__spec__.loader`` and
    ``__loader__`` as after an import. Its own reads while it runs (the same thread) see it as it fills, as during an
    import; another thread waits for it (the module's lock, as the import system's per module). A module whose code
    raises is removed from ``sys.modules``, as by a failed import, and the error raised to the reader."""
    namespace = object.__getattribute__(module, "__dict__")
    spec = namespace["__spec__"]
    deferring = spec.loader_state
    if not isinstance(deferring, DeferringLoader):
        return  # run meanwhile
    with deferring.lock:
        if deferring.running:  # run, or running in this thread
            return
        deferring.running = True
        spec.loader = namespace["__loader__"] = deferring.loader
        try:
            deferring.loader.exec_module(module)
        except BaseException:
            if sys.modules.get(spec.name) is module:
                del sys.modules[spec.name]
            raise
        finally:
            object.__setattr__(module, "__class__", types.ModuleType)
            spec.loader_state = None


class DeferringFinder:
    """A ``sys.meta_path`` finder for ``names``: the spec the rest of the meta path finds, its loader wrapped in a
    ``DeferringLoader`` where it is a plain source file's (``SourceFileLoader``); any other spec as found. A finder
    that asks the whole meta path in turn (an import hook wrapping loaders) is answered None while this one asks it."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names, self.finding = frozenset(names), set()

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        return wrapped_spec(self, name, path, target, DeferringLoader) if name in self.names else None


def wrapped_spec(me: object, name: str, path: object, target: object, wrap: Callable) -> object:
    """What a finder that wraps a found module's loader (``DeferringFinder``, ``cli_generated.SeedingFinder``,
    ``cli_typing.QualifiedFinder``) answers for ``name``: the spec the rest of the meta path finds (``others_spec``),
    its loader ``wrap(loader)`` where it is a plain source file's (``SourceFileLoader``), any other spec as found;
    None while ``me`` is itself asking for ``name`` (``me.finding``, a set: a hook that asks the whole meta path in
    turn would loop)."""
    if name in me.finding:  # type: ignore[attr-defined]
        return None
    me.finding.add(name)  # type: ignore[attr-defined]
    try:
        spec = others_spec(me, name, path, target)
    finally:
        me.finding.discard(name)  # type: ignore[attr-defined]
    if spec is not None and type(spec.loader) is SourceFileLoader:
        spec.loader = wrap(spec.loader)
    return spec


def others_spec(me: object, name: str, path: object, target: object) -> object:
    """The spec the rest of ``sys.meta_path`` (every finder but ``me``) finds for ``name``, or None: what a finder
    that wraps a found module's loader (``DeferringFinder``, ``cli_generated.SeedingFinder``) starts from."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None) if finder is not me else None
        spec = find(name, path, target) if find is not None else None
        if spec is not None:
            return spec
    return None


def deferred_imports(names: Iterable[str] = DEFERRED_MODULES) -> Callable[[], None]:
    """Until the returned function is called, a module of ``names`` imported for the first time is a
    ``DeferredModule``: its code runs at its first use (never, for a command that does not use it). A module already
    imported is left as it is, and one deferred stays so after (it runs when used)."""
    finder = DeferringFinder(names)
    sys.meta_path.insert(0, finder)

    def restore() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    return restore
