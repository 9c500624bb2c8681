"""Types a command reads twice, or checks the long way, while it loads (docs/benchmarks.md, "2026-12-03, sixth
session, imports4"). ``typing``'s check of a type argument is answered without its comparisons where the answer is
known, for a string (a forward reference) and a plain class: ``typing._type_check`` compares every argument with
eight special forms (``arg in (Any, LiteralString, NoReturn, Never, Self, TypeAlias)``, then ``arg in (Generic,
Protocol)``), each comparison of a ``ForwardRef`` a call of its Python ``__eq__``; a command checks about 750 strings
(pydantic_core's ``TypedDict``s, 605 of them, and pydantic's) and 200 classes. typer reads a command's parameters
(``inspect.signature`` with its annotations evaluated, ``get_type_hints``, a copy of each option) twice, once for the
options and once for the callback, which keeps only their names: the second reading is the first's answer. Kept out
of ``cli_startup`` (full) beside it. Each a speed-up, no rule."""

from __future__ import annotations

import sys
from collections.abc import Callable

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


def checked_type(check: Callable, convert: Callable, plain: tuple) -> Callable:
    """``check`` (``typing._type_check``) with two answers given without it: a ``str`` is ``convert``'s
    ``ForwardRef`` (``check`` converts it first; a ``ForwardRef`` equals only a ``ForwardRef``, is no special form,
    no generic alias, no tuple, so ``check`` returns it as converted); a class whose type is ``type`` itself and
    that is none of ``plain`` (``Generic``, ``Protocol``: refused by ``check``) is returned as it is (no special
    form or alias is such a class). Anything else goes to ``check``."""

    def type_check(arg, msg, is_argument=True, module=None, *, allow_special_forms=False):
        if isinstance(arg, str):
            return convert(arg, module=module, allow_special_forms=allow_special_forms)
        if type(arg) is type and arg not in plain:
            return arg
        return check(arg, msg, is_argument, module, allow_special_forms=allow_special_forms)

    type_check.__wrapped__ = check  # type: ignore[attr-defined]
    return type_check


def quick_type_checks() -> Callable[[], None]:
    """Until the returned function is called, ``typing._type_check`` is ``checked_type``'s (a ``typing`` of another
    shape is left alone; so is one whose ``_type_check`` is already replaced)."""
    import typing

    if not _readable(typing) or getattr(typing._type_check, "__wrapped__", None) is not None:
        return lambda: None
    own = typing._type_check
    typing._type_check = quick = checked_type(own, typing._type_convert, (typing.Generic, typing.Protocol))

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


def quick_types() -> Callable[[], None]:
    """``quick_type_checks`` and ``parameters_read_once``; the returned function undoes both."""
    undo = (quick_type_checks(), parameters_read_once())

    def off() -> None:
        for each in reversed(undo):
            each()

    return off
