"""Types a command reads twice, or checks the long way, while it loads (docs/benchmarks.md, "2026-12-03, sixth
session, imports4"), each answered as the long way answers. ``typing``'s check of a type argument, without its
comparisons where the answer is known, for a string (a forward reference) and a plain class: ``typing._type_check``
compares every argument with eight special forms (``arg in (Any, LiteralString, NoReturn, Never, Self, TypeAlias)``,
then ``arg in (Generic, Protocol)``), each comparison of a ``ForwardRef`` a call of its Python ``__eq__``; a command
checks about 750 strings (pydantic_core's ``TypedDict``s, 605 of them, and pydantic's) and 200 classes. typing's
aliases setting their attributes (about 3,000) without a call of ``_is_dunder`` each; typing_extensions' qualifiers
of a ``TypedDict`` field given as a string, without a generator. typer reads a command's parameters
(``inspect.signature`` with its annotations evaluated, ``get_type_hints``, a copy of each option) twice, once for the
options and once for the callback, which keeps only their names: the second reading is the first's answer. Kept out
of ``cli_startup`` (full) beside it. Each a speed-up, no rule."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.machinery import SourceFileLoader

from zeroplan.cli_deferred import wrapped_spec

_REF_ATTRIBUTES = ("__forward_arg__", "__forward_module__", "__forward_is_class__", "__forward_is_argument__")
_PARAMETERS = ("arg", "msg", "is_argument", "module")
"""``_type_check``'s positional parameters on Python 3.10-3.13 (then ``allow_special_forms``, keyword-only)."""


def _readable(typing: object) -> bool:
    """Whether ``typing`` has the ``_type_check`` and ``_type_convert`` this module answers for (3.10-3.13:
    ``_type_check(arg, msg, is_argument=True, module=None, *, allow_special_forms=False)``, whose first step is
    ``_type_convert(arg, module=module, allow_special_forms=allow_special_forms)``)."""
    check, convert = getattr(typing, "_type_check", None), getattr(typing, "_type_convert", None)
    code, convert_code = getattr(check, "__code__", None), getattr(convert, "__code__", None)
    if code is None or convert_code is None:
        return False
    names = code.co_varnames
    return (names[:4] == _PARAMETERS and code.co_argcount == 4 and code.co_kwonlyargcount == 1
            and names[4] == "allow_special_forms" and convert_code.co_varnames[:2] == ("arg", "module")
            and convert_code.co_kwonlyargcount == 1 and convert_code.co_varnames[2] == "allow_special_forms")


def checked_type(check: Callable, convert: Callable, plain: tuple, unions: tuple = ()) -> Callable:
    """``check`` (``typing._type_check``) with three answers given without it: a ``str`` is the ``ForwardRef``
    ``convert`` makes (``typing.ForwardRef``: ``check`` converts a string to ``ForwardRef(arg, module=module,
    is_class=allow_special_forms)`` first, ``_type_convert``; a ``ForwardRef`` equals only a ``ForwardRef``, is no
    special form, no generic alias, no tuple, so ``check`` returns it as converted); a class whose type is ``type`` and
    that is none of ``plain`` (``Generic``, ``Protocol``: refused by ``check``) is returned as it is (no special
    form or alias is such a class); so is an object whose type is one of ``unions`` (``X | Y``, ``Union[X, Y]``,
    ``list[X]``: equal to no special form, no typing alias of ``ClassVar`` or ``Final``, callable). Anything else
    goes to ``check``."""

    def type_check(arg, msg, is_argument=True, module=None, *, allow_special_forms=False):
        if isinstance(arg, str):
            return convert(arg, module=module, is_class=allow_special_forms)
        if type(arg) is type and arg not in plain or type(arg) in unions:
            return arg
        return check(arg, msg, is_argument, module, allow_special_forms=allow_special_forms)

    type_check.__wrapped__ = check  # type: ignore[attr-defined]
    return type_check


def quick_type_checks() -> Callable[[], None]:
    """Until the returned function is called, ``typing._type_check`` is ``checked_type``'s (a ``typing`` of another
    shape is left alone; so is one whose ``_type_check`` is already replaced)."""
    import types
    import typing

    if not _readable(typing) or getattr(typing._type_check, "__wrapped__", None) is not None:
        return lambda: None
    own, ref = typing._type_check, typing.ForwardRef
    converted = typing._type_convert("x", module="m", allow_special_forms=True)
    made = ref("x", module="m", is_class=True)
    if type(converted) is not ref or any(getattr(converted, a, 0) != getattr(made, a, 0) for a in _REF_ATTRIBUTES):
        return lambda: None  # a _type_convert that makes something else of a string
    unions = tuple(t for t in (getattr(types, "UnionType", None), getattr(typing, "_UnionGenericAlias", None),
                               getattr(types, "GenericAlias", None)) if isinstance(t, type))
    typing._type_check = quick = checked_type(own, ref, (typing.Generic, typing.Protocol), unions)

    def restore() -> None:
        if vars(typing).get("_type_check") is quick:
            typing._type_check = own

    return restore


def read_once(read: Callable, reader: object) -> Callable:
    """``read`` (typer's ``get_params_from_function``) whose answer for a callback is kept for one more call, by
    ``reader`` alone (the code of typer's ``get_callback``, which reads the answer's names only) and with the same
    callback: that call gets the kept answer, and nothing is kept after it. Any other call reads anew."""
    kept: list = []

    def get_params_from_function(func):
        if kept and kept[0][0] is func and sys._getframe(1).f_code is reader:
            return kept.pop()[1]
        answer = read(func)
        kept[:] = [(func, answer)]
        return answer

    get_params_from_function.__wrapped__ = read  # type: ignore[attr-defined]
    return get_params_from_function


def parameters_read_once() -> Callable[[], None]:
    """Until the returned function is called, ``typer.main``'s ``get_params_from_function`` is ``read_once``'s,
    for ``get_callback`` (a typer not yet imported, or without either function, is left alone)."""
    main = sys.modules.get("typer.main")
    read, reader = getattr(main, "get_params_from_function", None), getattr(main, "get_callback", None)
    if not callable(read) or getattr(read, "__wrapped__", None) is not None or not hasattr(reader, "__code__"):
        return lambda: None
    main.get_params_from_function = once = read_once(read, reader.__code__)  # type: ignore[union-attr]

    def restore() -> None:
        if vars(main).get("get_params_from_function") is once:
            main.get_params_from_function = read  # type: ignore[union-attr]

    return restore


def no_qualifiers(own: Callable, ref: type) -> Callable:
    """``own`` (typing_extensions' ``_get_typeddict_qualifiers``, a generator of the ``Required``, ``NotRequired``
    and ``ReadOnly`` wrapping an annotation) answering a ``ForwardRef`` (exactly: a subclass goes to ``own``) with no
    qualifier, as ``own`` does (``get_origin`` of a forward reference is None): a ``TypedDict`` field given as a
    string, 603 of pydantic_core's 608."""

    def _get_typeddict_qualifiers(annotation_type):
        return iter(()) if type(annotation_type) is ref else own(annotation_type)

    _get_typeddict_qualifiers.__wrapped__ = own  # type: ignore[attr-defined]
    return _get_typeddict_qualifiers


class QualifiedLoader:
    """``loader``'s module (typing_extensions) run, then its ``_get_typeddict_qualifiers`` ``no_qualifiers``' where
    its ``get_origin`` finds none for a forward reference; the module's loader is ``loader``, as after an import."""

    def __init__(self, loader: SourceFileLoader, done: list) -> None:
        self.loader, self.done = loader, done

    def create_module(self, spec: object) -> object:
        return self.loader.create_module(spec)

    def exec_module(self, module: object) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # type: ignore[attr-defined]
        self.loader.exec_module(module)
        own, ref = getattr(module, "_get_typeddict_qualifiers", None), sys.modules["typing"].ForwardRef
        if callable(own) and getattr(module, "get_origin", lambda t: 0)(ref("x")) is None:
            module._get_typeddict_qualifiers = quick = no_qualifiers(own, ref)  # type: ignore[attr-defined]
            self.done.append((module, own, quick))


class QualifiedFinder:
    """A ``sys.meta_path`` finder for typing_extensions not yet imported: the spec the rest of the meta path finds,
    its source loader a ``QualifiedLoader``; any other spec as found."""

    def __init__(self) -> None:
        self.finding, self.done = set(), []

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        return wrapped_spec(self, name, path, target, self.qualified) if name == "typing_extensions" else None

    def qualified(self, loader: SourceFileLoader) -> QualifiedLoader:
        return QualifiedLoader(loader, self.done)


def qualifiers_quick() -> Callable[[], None]:
    """Until the returned function is called, typing_extensions imported meanwhile answers a forward reference's
    qualifiers with ``no_qualifiers`` (a typing_extensions imported before is left alone)."""
    finder = QualifiedFinder()
    sys.meta_path.insert(0, finder)

    def restore() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for module, own, quick in finder.done:
            if vars(module).get("_get_typeddict_qualifiers") is quick:
                module._get_typeddict_qualifiers = own

    return restore


_SETATTR_NAMES = {"__origin__", "__setattr__", "_is_dunder", "setattr", "super"}
"""The names ``_BaseGenericAlias.__setattr__`` reads on Python 3.10-3.13 (``_is_dunder(attr) or attr in NAMES``:
``super().__setattr__``, else ``setattr(self.__origin__, ...)``)."""


def alias_setattr(base: type, names: frozenset) -> Callable:
    """``typing._BaseGenericAlias.__setattr__`` (``base``'s, its own names ``names``) with ``typing._is_dunder``'s
    test written in place of its call (``attr.startswith('__') and attr.endswith('__')``) and ``super().__setattr__``
    found once per class (``next_setattr``): an alias sets four to eight attributes when made, about 3,000 while a
    command loads."""
    found: dict = {}

    def __setattr__(self, attr, val):
        if attr.startswith("__") and attr.endswith("__") or attr in names:
            cls = type(self)
            setter = found.get(cls)
            if setter is None:
                setter = found[cls] = next_setattr(cls, base)
            setter(self, attr, val)
        else:
            setattr(self.__origin__, attr, val)

    return __setattr__


def next_setattr(cls: type, base: type) -> Callable:
    """What ``super(base, instance).__setattr__`` calls for an instance of ``cls``: the ``__setattr__`` of the first
    class after ``base`` in ``cls``'s MRO that defines one (``object``'s for typing's aliases)."""
    mro = cls.__mro__
    return next(vars(k)["__setattr__"] for k in mro[mro.index(base) + 1:] if "__setattr__" in vars(k))


def quick_alias_setattr() -> Callable[[], None]:
    """Until the returned function is called, ``typing._BaseGenericAlias.__setattr__`` is ``alias_setattr``'s, where
    it and ``_is_dunder`` have the shape that function copies (a ``typing`` of another shape is left alone)."""
    import typing

    base, dunder = getattr(typing, "_BaseGenericAlias", None), getattr(typing, "_is_dunder", None)
    own = vars(base).get("__setattr__") if isinstance(base, type) else None
    code, test = getattr(own, "__code__", None), getattr(dunder, "__code__", None)
    if code is None or test is None or set(code.co_names) != _SETATTR_NAMES or code.co_varnames != ("self", "attr",
                                                                                                      "val"):
        return lambda: None
    names = [c for c in code.co_consts if type(c) is frozenset]
    if len(names) != 1 or test.co_names != ("startswith", "endswith") or "__" not in test.co_consts:
        return lambda: None
    base.__setattr__ = quick = alias_setattr(base, names[0])

    def restore() -> None:
        if vars(base).get("__setattr__") is quick:
            base.__setattr__ = own

    return restore


def quick_types() -> Callable[[], None]:
    """``quick_type_checks``, ``quick_alias_setattr``, ``qualifiers_quick`` and ``parameters_read_once``; the
    returned function undoes them."""
    undo = (quick_type_checks(), quick_alias_setattr(), qualifiers_quick(), parameters_read_once())

    def off() -> None:
        for each in reversed(undo):
            each()

    return off
