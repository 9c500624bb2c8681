"""What a fresh ``zeroplan`` process skips at start-up (docs/benchmarks.md, "Start-up, third pass" to "sixth
pass", "2026-12-03, startup"): pydantic's plugin search when plugins are off, typer's coercion of an option left unset
or at its own default, the modules of the commands it does not run, the compilation of dataclass methods it never
calls, and of the generated texts an earlier command compiled (``CodeCache``). Kept out of ``cli`` so that the command
module stays a list of commands. Each is a speed-up, no rule."""

from __future__ import annotations

import enum
import gc
import importlib
import marshal
import os
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

from zeroplan.cli_deferred import deferred_imports
from zeroplan.cli_generated import cached_generated_code, regex_parts
from zeroplan.cli_typing import quick_types

if TYPE_CHECKING:
    import typer


def no_plugin_search() -> None:
    """Plugins off: pydantic's loader (it imports importlib.metadata, 45 CPU-ms) replaced by one returning none."""
    name = "pydantic.plugin._loader"
    if os.environ.get("PYDANTIC_DISABLE_PLUGINS") in ("__all__", "1", "true") and name not in sys.modules:
        stand_in = types.ModuleType(name, "pydantic's plugin loader, plugins off (zeroplan.cli_startup)")
        stand_in.get_plugins = lambda: ()  # type: ignore[attr-defined]
        stand_in.__getattr__ = lambda attr: _real_loader(name, attr)  # type: ignore[attr-defined]
        sys.modules[name] = stand_in


def _real_loader(name: str, attr: str) -> object:
    """Anything but ``get_plugins`` (a pydantic that asks for more): the real loader, imported in place of the stand-in.
    Dunder probes (``__file__``, ``__path__`` asked by inspect or importlib) are not a request for the loader."""
    if attr.startswith("__"):
        raise AttributeError(attr)
    del sys.modules[name]
    return getattr(importlib.import_module(name), attr)


DEFERRED = frozenset(("__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__", "__lt__", "__le__", "__gt__",
                      "__ge__"))
"""The dataclass methods ``deferred_dataclass_methods`` compiles on their first call. Not ``__init__``: a class's
signature is read from it (``inspect.signature``: the ``__doc__`` dataclasses writes for a class without one)."""


def deferred_dataclass_methods() -> Callable[[], None]:
    """Until the returned function is called, each dataclass made gets its ``DEFERRED`` methods as stand-ins that
    compile the method on their first call, from the very arguments ``dataclasses`` gave its ``_create_fn``, and put
    it in the stand-in's place. Python 3.10-3.12's ``dataclasses`` writes each generated method as source text and
    compiles it with its own ``exec``, about 0.5 M instructions a method; the ``deepspeed`` 405B plan makes 104
    dataclasses (zeroplan's, pydantic's, typer's) with 425 such methods and calls 23 of them (docs/benchmarks.md,
    "Start-up, sixth pass"). Every decision (which methods a class gets, their text, the hash rule) is still the
    standard library's; the only difference is when the text is compiled, and the stand-in's frame on that first
    call. A ``dataclasses`` without ``_create_fn`` (Python 3.13+) is left alone. A speed-up, no rule."""
    import dataclasses  # imports inspect: under quiet_imports, not before

    create = getattr(dataclasses, "_create_fn", None)
    if create is None or getattr(create, "deferring", False):  # 3.13+, or already on (nested): nothing to undo
        return lambda: None

    def deferring(name, args, body, **kwargs):
        return create(name, args, body, **kwargs) if name not in DEFERRED else _compiled_on_first_call(
            create, name, args, body, kwargs)

    deferring.deferring = True  # type: ignore[attr-defined]
    dataclasses._create_fn = deferring  # type: ignore[attr-defined]

    def restore() -> None:
        if getattr(dataclasses, "_create_fn", None) is deferring:
            dataclasses._create_fn = create  # type: ignore[attr-defined]

    return restore


def shared_forward_ref_code(codes: Optional[CodeCache] = None) -> Callable[[], None]:
    """Until the returned function is called, ``typing.ForwardRef``s of one string share one code object, from
    ``codes``. A forward reference compiles its string when made (``compile(arg, '<string>', 'eval')``, typing's one
    call of ``compile``); pydantic_core's and pydantic's ``TypedDict``s are written with string annotations, 835
    forward references of 244 distinct strings in the ``deepspeed`` 405B plan, about 25 M instructions to compile
    again (docs/benchmarks.md, "Start-up, sixth pass"). A code object is immutable and ``compile`` gives equal ones
    for equal arguments (typing has no future imports, so its calls compile with no future flags), so typing's
    global ``compile`` is set to ``codes.compile``, and removed. A typing that already has its own global
    ``compile`` is left alone. A speed-up, no rule."""
    import functools
    import typing

    if "compile" in vars(typing):
        return lambda: None
    codes = CodeCache(kept=False) if codes is None else codes
    typing.compile = cached = functools.lru_cache(maxsize=None)(codes.compile)  # type: ignore[attr-defined]

    def restore() -> None:
        if vars(typing).get("compile") == cached:
            del typing.compile  # type: ignore[attr-defined]

    return restore


def cached_dataclass_code(codes: Optional[CodeCache] = None) -> Callable[[], None]:
    """Until the returned function is called, the text ``dataclasses`` writes for each generated method is compiled
    once per text, through ``codes`` (``dataclasses``' global ``exec`` set to ``codes.exec``, and removed): with
    ``codes`` read from its file, a process compiles none of the texts an earlier one did. Python 3.11 parses
    and compiles every dataclass's ``__init__`` (and each deferred method at its first call) from text: about 88 M
    instructions of the FSDP2 Llama-2-70B plan (116 texts; docs/benchmarks.md, "2026-12-03, startup"). The code
    is the one ``exec`` compiles (``dataclasses`` has no future imports); only where it comes from changes. A
    ``dataclasses`` with its own global ``exec`` is left alone. A speed-up, no rule."""
    import dataclasses

    if "exec" in vars(dataclasses):
        return lambda: None
    dataclasses.exec = cached = (CodeCache(kept=False) if codes is None else codes).exec  # type: ignore[attr-defined]

    def restore() -> None:
        if vars(dataclasses).get("exec") == cached:
            del dataclasses.exec  # type: ignore[attr-defined]

    return restore


CODE_CACHE_MAX = 1024
"""The most texts the code cache file keeps: past it, a process writes the codes it used alone (the file is read whole
by every command: texts of classes since changed are dropped; docs/benchmarks.md, "2026-12-03, startup": 432)."""


class CodeCache:
    """Code objects of the texts ``dataclasses`` and ``typing`` compile at run time, by mode and text, kept between
    processes in one file as Python keeps a module's bytecode: ``__pycache__/generated_code.<tag>.marshal`` beside
    this module (``importlib.util.cache_from_source``: ``sys.pycache_prefix`` and the optimization level honoured),
    the interpreter's ``MAGIC_NUMBER`` first, then a ``marshal``'d dict (mode, text) -> code. Read once, at the
    first text; a file of another interpreter, or that does not read back, is ignored. Written (``save``, at the end
    of a command that compiled a text the file did not hold) unless ``sys.dont_write_bytecode``
    (``PYTHONDONTWRITEBYTECODE``), through a temporary file and ``os.replace``; a directory that cannot be written
    is left as it is, as for bytecode. Every code is ``compile(text, '<string>', mode, dont_inherit=True)``: what
    ``exec`` and ``compile`` give the standard library's modules, which have no future imports
    (tests/test_startup_code_cache.py). A speed-up, no rule."""

    def __init__(self, path: Optional[str] = None, kept: bool = True) -> None:
        """``kept=False``: the codes are shared within the process only (no file read or written)."""
        self.path, self.known, self.used, self.new = path, None if kept else {}, {}, False
        self.kept = kept

    def file(self) -> Optional[str]:
        """Where the codes are kept; None where this interpreter keeps no bytecode."""
        if self.path is None:
            from importlib.util import cache_from_source

            try:
                self.path = cache_from_source(os.path.join(os.path.dirname(__file__), "generated_code.py"))
            except NotImplementedError:  # sys.implementation.cache_tag is None
                return None
            self.path = self.path.removesuffix(".pyc") + ".marshal"
        return self.path

    def code(self, mode: str, text: str) -> types.CodeType:
        """The code of ``text`` in ``mode``, from the file or compiled now."""
        key = (mode, text)
        code = self.used.get(key)
        if code is None:
            code = self._known().get(key)
            if type(code) is not types.CodeType:
                code, self.new = compile(text, "<string>", mode, dont_inherit=True), True
            self.used[key] = code
        return code

    def exec(self, source: object, globals: Optional[dict] = None, locals: Optional[dict] = None) -> None:
        """``exec`` with a text's code from the cache (``dataclasses``' one call passes all three)."""
        exec(self.code("exec", source) if type(source) is str else source, globals, locals)

    def regex(self, pattern: object, flags: int) -> tuple:
        """``cli_generated.regex_parts(pattern, flags)``, kept under this interpreter's regex code version."""
        key = ("re", sys.modules["_sre"].MAGIC, pattern, flags)
        parts = self.used.get(key)
        if parts is None:
            parts = self._known().get(key)
            if type(parts) is not tuple or len(parts) != 5:
                parts, self.new = regex_parts(pattern, flags), True
            self.used[key] = parts
        return parts

    def eval(self, source: object, globals: Optional[dict] = None, locals: Optional[object] = None) -> object:
        """``eval`` with a text's code from the cache (``collections.namedtuple``'s one call passes its globals)."""
        if globals is None:  # the caller's namespaces, as the builtin's
            frame = sys._getframe(1)
            globals, locals = frame.f_globals, frame.f_locals if locals is None else locals
        return eval(self.code("eval", source) if type(source) is str else source, globals, locals)

    def compile(self, source: object, filename: str, mode: str, *args: object, **kwargs: object) -> types.CodeType:
        """``compile``, with a ``'<string>'`` text's code from the cache (``typing``'s one call passes three)."""
        if type(source) is str and filename == "<string>" and mode in ("eval", "exec") and not args and not kwargs:
            return self.code(mode, source)
        kwargs.setdefault("dont_inherit", True)  # as from typing, which has no future imports
        return compile(source, filename, mode, *args, **kwargs)

    def _known(self) -> dict:
        if self.known is None:
            self.known = {}
            try:
                with open(self.file(), "rb") as f:  # type: ignore[arg-type]
                    data = f.read()
                from importlib.util import MAGIC_NUMBER

                known = marshal.loads(data[len(MAGIC_NUMBER):]) if data.startswith(MAGIC_NUMBER) else {}
                self.known = known if type(known) is dict else {}
            except (OSError, TypeError, ValueError, EOFError):
                pass
        return self.known

    def save(self) -> None:
        """The codes compiled by this process added to the file (only the ones it used past ``CODE_CACHE_MAX``)."""
        if sys.dont_write_bytecode or not (self.new and self.kept) or self.file() is None:
            return
        from importlib.util import MAGIC_NUMBER

        keep = {**self._known(), **self.used}
        keep = keep if len(keep) <= CODE_CACHE_MAX else self.used
        path, temporary = self.path, f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)  # type: ignore[arg-type]
            with open(temporary, "wb") as f:
                f.write(MAGIC_NUMBER + marshal.dumps(keep))
            os.replace(temporary, path)  # type: ignore[arg-type]
            self.known, self.new = keep, False
        except (OSError, ValueError):
            try:
                os.remove(temporary)
            except OSError:
                pass


def compiling_less(codes: Optional[CodeCache] = None) -> Callable[[], None]:
    """``deferred_dataclass_methods``, and ``cached_dataclass_code`` and ``shared_forward_ref_code`` with ``codes``
    (None: within the process only, ``import zeroplan.cli``: its few texts are not worth reading the file), first
    ``cli_deferred.deferred_imports`` (unused standard modules run at first use, never for a plan: before
    ``dataclasses`` imports ``inspect``), ``cli_typing.quick_types``, last ``cli_generated.cached_generated_code``
    (typing_inspection's and namedtuple's texts, the regular expressions through ``codes``); undone by the result."""
    codes = CodeCache(kept=False) if codes is None else codes
    undo = (deferred_imports(), deferred_dataclass_methods(), cached_dataclass_code(codes), quick_types(),
            shared_forward_ref_code(codes), cached_generated_code(codes.exec, codes.eval, codes.regex))

    def off() -> None:
        for each in reversed(undo):
            each()

    return off


class quiet_imports:  # noqa: N801 - used as ``with quiet_imports():``
    """``zeroplan.cli``'s imports (typer, the option blocks) without the cyclic collector's passes and compiling
    less (``compiling_less``): both as they were once the imports are done, for a console script and a library
    caller alike. The collector ran 20 times while typer loaded, on objects that all stay (docs/benchmarks.md,
    "Start-up, sixth pass")."""

    codes = CodeCache()  # the process's, read at its first text (typer's regexes pay for it), shared with cli.main

    def __enter__(self) -> None:
        self.collecting = gc.isenabled()
        gc.disable()  # first: compiling_less imports dataclasses (and inspect)
        try:
            self.restore = compiling_less(self.codes)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        getattr(self, "restore", lambda: None)()
        if self.collecting:
            gc.enable()


def _compiled_on_first_call(create: Callable, name: str, args: tuple, body: list, kwargs: dict) -> Callable:
    """A stand-in for ``create(name, args, body, **kwargs)``'s method, named as ``create`` names it: the first call
    compiles the method and sets it on the class that holds the stand-in (found through the instance's MRO, so a
    class remade with ``__slots__`` and subclasses are served); a stand-in kept elsewhere (``__repr__``'s recursion
    guard wraps it) goes straight to the compiled method."""
    compiled: list[Callable] = []

    def stand_in(*call_args, **call_kwargs):
        if not compiled:
            method = create(name, args, body, **kwargs)
            method.__qualname__ = stand_in.__qualname__  # set by dataclasses when the class was made
            compiled.append(method)
            stand_in.__wrapped__ = method  # inspect.unwrap and signature reach it through __repr__'s guard
            for owner in type(call_args[0]).__mro__ if call_args else ():
                if owner.__dict__.get(name) is stand_in:
                    setattr(owner, name, method)
                    break
        return compiled[0](*call_args, **call_kwargs)

    where = kwargs.get("globals")
    stand_in.__name__, stand_in.__qualname__ = name, f"__create_fn__.<locals>.{name}"
    stand_in.__module__ = "dataclasses" if where is None else where.get("__name__")
    return stand_in


class _CoercedWhenGiven:
    """An option's coercion, built on its first value that is not None. typer 0.29 builds a pydantic
    ``TypeAdapter`` per option before coercing (``_TyperParameter.get_runtime_param``), even for a value of None,
    which its ``RuntimeParam.coerce`` returns unchanged without asking the adapter; a command's options are mostly
    left unset (38 adapters built for ``estimate --params 7.5e9 --gpus 64``, 11 coerce a value)."""

    __slots__ = ()

    def coerce(self, value: object, param: object, ctx: object) -> object:
        if value is None and not (param.multiple or param.nargs == -1):  # type: ignore[attr-defined]
            return None  # typer's RuntimeParam.coerce, before it asks the adapter
        if _own_default(value, param, ctx):
            return value  # what typer's adapter hands back (tests/test_startup_coercion.py)
        plain = _plain_text(value, param)
        if plain is not None:
            return plain
        from typer._coercion import build_runtime_param

        real = build_runtime_param(param.type_descriptor)  # type: ignore[attr-defined]
        param._runtime_param = real  # type: ignore[attr-defined]
        return real.coerce(value, param=param, ctx=ctx)


def _own_default(value: object, param: object, ctx: object) -> bool:
    """``value`` is the option's own default (not given: click's ``ParameterSource.DEFAULT``), already of the
    declared type, which typer 0.29's adapter returns unchanged: an ``int`` or ``float`` without bounds (pydantic's
    number of the same type), a ``str`` (``str(value)``, then pydantic's string), a member of the declared ``Enum``
    (``coerce_cli_choice`` returns a member as it is); no ``parser``, one value, no file. Anything else (a value
    given on the command line or by the environment, a bounded number, an int default of a float option) goes to
    typer's own coercion. ``plan --engine fsdp2 --model llama3-405b --gpus 2048 --gpu h100-80gb``: 13 of its 19
    adapters were built for such defaults (the other six: its four given options and the two ``--help`` flags)."""
    from typer._click.core import ParameterSource

    desc = param.type_descriptor  # type: ignore[attr-defined]
    info, annotation = desc.parameter_info, desc.annotation
    one = not param.multiple and param.nargs == 1  # type: ignore[attr-defined]
    if not one or info.parser is not None or desc.file_annotation is not None:
        return False
    if ctx.get_parameter_source(param.name) is not ParameterSource.DEFAULT:  # type: ignore[attr-defined]
        return False
    if annotation is int or annotation is float:
        return type(value) is annotation and info.min is None and info.max is None
    return type(value) is annotation and (annotation is str or isinstance(value, enum.Enum))


def _plain_text(value: object, param: object) -> object:
    """The value typer 0.29's adapter makes of ``value``, a given option's text, where that is plain: for a ``str``
    option, ASCII text as it is (``_parse_cli_str`` returns it, pydantic's string accepts it; text that is not
    UTF-8, a lone surrogate from the command line, is pydantic's error); for an ``int`` option without bounds,
    decimal digits without a leading zero, at most 18 (``int`` of them, pydantic's integer). None for anything
    else, which goes to typer's coercion: signs, spaces, ``1_000``, ``1.0``, a float or ``Enum`` option. Both
    405B plans of docs/benchmarks.md give four such options (``--engine``, ``--model``, ``--gpu``, ``--gpus``)
    and, with the ``--help`` flags, no longer import ``typer._adapters`` ("Start-up, sixth pass")."""
    desc = param.type_descriptor  # type: ignore[attr-defined]
    info, annotation = desc.parameter_info, desc.annotation
    if type(value) is not str or not value.isascii() or info.parser is not None or desc.file_annotation is not None:
        return None
    if param.multiple or param.nargs != 1:  # type: ignore[attr-defined]
        return None
    if annotation is str:
        return value
    if annotation is int and info.min is None and info.max is None and value.isdigit() and len(value) <= 18:
        return int(value) if value[0] != "0" or value == "0" else None
    return None


_COERCED_WHEN_GIVEN = _CoercedWhenGiven()  # stateless: the option is the call's ``param``


def coerce_when_given(command: object, help_option: object = None) -> object:
    """Each option of ``command`` (a typer command about to parse), and its ``--help`` flag, coerced through
    ``_CoercedWhenGiven``; a typer whose parameters keep no ``_runtime_param`` (another version) is left as it is.
    typer built an adapter for each ``--help`` flag (the group's and the command's): its value is None unless
    given, and a flag given is a bool, which typer does not coerce. Returns ``help_option``."""
    for param in (*getattr(command, "params", ()), help_option):
        if getattr(param, "_runtime_param", False) is None and hasattr(param, "type_descriptor"):
            param._runtime_param = _COERCED_WHEN_GIVEN
    return help_option


ELSEWHERE = {"sweep": "zeroplan.cli_sweep", "plot": "zeroplan.cli_plot", "PlotView": "zeroplan.cli_plot",
             "validate_cmd": "zeroplan.cli_validate"}
"""The commands ``zeroplan.cli`` names but does not import (``COMMANDS``), and the plot views, by the module that
holds them: imported when they run or the whole group is listed. ``estimate`` and ``plan`` do not load them (about
7.5 M instructions, 1 CPU-ms; docs/benchmarks.md, "Start-up, fifth pass")."""


def imported(name: str) -> object:
    """``ELSEWHERE``'s ``name``, its module imported now; AttributeError for any other name (``zeroplan.cli``'s
    ``__getattr__``)."""
    if name not in ELSEWHERE:
        raise AttributeError(f"module 'zeroplan.cli' has no attribute {name!r}")
    return getattr(importlib.import_module(ELSEWHERE[name]), name)


def registered(group: typer.Typer, commands: dict) -> typer.Typer:
    """``group`` with ``commands`` (name -> function, or the name of one in ``ELSEWHERE``)."""
    for name, command in commands.items():
        group.command(name)(imported(command) if isinstance(command, str) else command)
    return group
