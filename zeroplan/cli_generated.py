"""The texts two more of a command's modules compile at run time, their code from the code cache
(``cli_startup.CodeCache``), as ``dataclasses``' and ``typing``'s are: typing_inspection's 30 check functions
(``typing_objects``, made by ``exec`` while pydantic loads) and ``collections.namedtuple``'s ``__new__`` (made by
``eval``; inspect, dis, typing's ``NamedTuple`` and others make about twenty while a command loads). Neither module
has future imports, so ``exec`` and ``eval`` compile their texts with no future flags: the code is the one
``CodeCache`` compiles (``dont_inherit=True``; docs/benchmarks.md, "2026-12-03, fifth session, startup3"). Kept out
of ``cli_startup`` (full) beside it. A speed-up, no rule."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.machinery import SourceFileLoader
from typing import Optional

from zeroplan.cli_deferred import wrapped_spec

SEEDED = "typing_inspection.typing_objects"
"""The module run with a global ``exec`` of the cache's (``SeedingFinder``), removed once it has run."""


class SeedingFinder:
    """A ``sys.meta_path`` finder for ``SEEDED`` not yet imported: the spec the rest of the meta path finds, its
    source loader's ``exec_module`` running the module with the global ``exec`` given (then removed from it); any
    other spec as found."""

    def __init__(self, exec_: Callable) -> None:
        self.exec, self.finding = exec_, set()

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        return wrapped_spec(self, name, path, target, self.seeded) if name == SEEDED else None

    def seeded(self, loader: SourceFileLoader) -> SeededLoader:
        return SeededLoader(loader, self.exec)


class SeededLoader:
    """``loader``'s module run with the global ``exec`` seeded; the module's loader is ``loader``, as after an
    import."""

    def __init__(self, loader: SourceFileLoader, exec_: Callable) -> None:
        self.loader, self.exec = loader, exec_

    def create_module(self, spec: object) -> object:
        return self.loader.create_module(spec)

    def exec_module(self, module: object) -> None:
        namespace = vars(module)
        module.__spec__.loader = namespace["__loader__"] = self.loader
        namespace["exec"] = self.exec
        try:
            self.loader.exec_module(module)
        finally:
            if namespace.get("exec") is self.exec:
                del namespace["exec"]


def cached_generated_code(exec_: Callable, eval_: Callable, regex: Callable) -> Callable[[], None]:
    """Until the returned function is called, ``SEEDED`` (imported meanwhile) runs with the global ``exec`` ``exec_``,
    ``collections``' global ``eval`` is ``eval_`` (a ``collections`` that has one is left alone) and ``re``'s
    compiler is ``compiled_regex`` through ``regex`` (a ``re`` whose compiler is not its own is left alone)."""
    import collections
    import re

    finder = SeedingFinder(exec_)
    sys.meta_path.insert(0, finder)
    seeded: Optional[Callable] = None
    if "eval" not in vars(collections):
        collections.eval = seeded = eval_  # type: ignore[attr-defined]
    compiler = getattr(re, "_compiler", None)  # Python 3.11+ (3.10's is sre_compile: its re is left alone)
    own = getattr(compiler, "compile", None)
    cached = own
    if own is not None and own.__module__ == compiler.__name__ and _REGEX_PARTS_READABLE:
        cached = compiler.compile = lambda p, flags=0: compiled_regex(own, regex, p, flags)

    def restore() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        if seeded is not None and vars(collections).get("eval") is seeded:
            del collections.eval  # type: ignore[attr-defined]
        if cached is not own and compiler.compile is cached:
            compiler.compile = own

    return restore


def _parts_readable() -> bool:
    """Whether this Python's ``re`` has the private pieces ``regex_parts`` reads (3.11-3.13 have them; 3.10 has
    ``sre_parse`` and ``sre_compile`` instead): without them the regular expressions are compiled as ``re`` does."""
    import re

    parser, compiler = getattr(re, "_parser", None), getattr(re, "_compiler", None)
    return callable(getattr(parser, "parse", None)) and callable(getattr(compiler, "_code", None))


_REGEX_PARTS_READABLE = _parts_readable()


def regex_parts(pattern: object, flags: int) -> tuple:
    """What ``re._compiler.compile`` gives ``_sre.compile`` for ``pattern`` (a str or bytes) and ``flags``, as plain
    ints, strings, a dict and tuples (``marshal`` keeps them): its flags, code, groups, group index and group names."""
    import re

    parsed = re._parser.parse(pattern, flags)  # type: ignore[attr-defined]
    code = [int(c) for c in re._compiler._code(parsed, flags)]  # type: ignore[attr-defined]
    names = [None] * parsed.state.groups
    for name, i in parsed.state.groupdict.items():
        names[i] = name
    return int(flags | parsed.state.flags), code, parsed.state.groups - 1, dict(parsed.state.groupdict), tuple(names)


def compiled_regex(own: Callable, regex: Callable, pattern: object, flags: int = 0) -> object:
    """``re._compiler.compile(pattern, flags)`` (``own``) from the parts ``regex(pattern, flags)`` keeps
    (``CodeCache.regex``, which makes them with ``regex_parts``): ``_sre.compile`` of the same parts makes the same
    pattern (and checks the code). A parsed pattern, ``re.DEBUG`` or parts that do not compile: ``own``'s."""
    import _sre
    import re

    if type(pattern) not in (str, bytes) or flags & re.DEBUG:
        return own(pattern, flags)
    try:
        final, code, groups, index, names = regex(pattern, int(flags))
        return _sre.compile(pattern, final, code, groups, index, names)
    except (TypeError, ValueError, RuntimeError, AttributeError):  # AttributeError: re's private pieces moved
        return own(pattern, flags)
