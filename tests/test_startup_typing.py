"""``typing._type_check`` answered without its comparisons for strings and plain classes (``zeroplan.cli_typing``;
docs/benchmarks.md, "2026-12-03, sixth session, imports4"): the same answer, or the same error, as typing's own on
every kind of argument, and the module as it was once the command's imports are done."""

import json
import marshal
import subprocess
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Final, Generic, Literal, NoReturn, Optional, Protocol, TypeVar, Union

import pytest

from zeroplan.cli_typing import checked_type, quick_type_checks

T = TypeVar("T")


class Plain:
    pass


class Meta(type):
    pass


class WithMeta(metaclass=Meta):
    pass


class EqualsGeneric(type):
    def __eq__(self, other: object) -> bool:  # a class equal to Generic: typing refuses it as it refuses Generic
        return other is Generic

    __hash__ = type.__hash__


class Equal(metaclass=EqualsGeneric):
    pass


class Gen(Generic[T]):
    pass


class Proto(Protocol):
    def f(self) -> int: ...


def answer(check: Callable, arg: object, **kwargs: object) -> tuple:
    """What ``check`` gives ``arg``: the value (a ForwardRef by its every attribute) or the error's type and text."""
    try:
        got = check(arg, "a message.", **kwargs)
    except Exception as e:  # noqa: BLE001 - the error is the answer
        return ("raised", type(e), str(e))
    if isinstance(got, typing.ForwardRef):
        return ("ref", type(got), [(k, shown(getattr(got, k, None))) for k in typing.ForwardRef.__slots__])
    return ("value", got)


def shown(v: object) -> object:
    return marshal.dumps(v) if isinstance(v, types.CodeType) else repr(v)


STRINGS = ["int", "Optional[int]", "'quoted'", "list[str]", "ClassVar[int]", "Final", "x.y.Z", "Literal['a', 1]",
           "*Ts", "Required[int]", "tuple[int, ...]", "dict[str, 'Plain']", "A | None", "Self", "Any"]
OTHERS = [int, str, bool, object, type, Plain, WithMeta, Meta, Equal, Gen, Gen[int], Proto, Generic, Protocol, Any,
          NoReturn, ClassVar, Final, ClassVar[int], Final[int], Union, Optional, Union[int, str], Optional[Plain],
          int | None, list[int], typing.List, typing.List[int], Literal["a"], T, None, (int, str), 3, "",
          typing.Tuple, Callable, Callable[[int], str], typing.Annotated[int, "m"], typing.ForwardRef("int"),
          type(None), typing.Type[int], dict, frozenset, typing.TypeAlias, list[ClassVar[int]], list["x"],
          dict[str, Final[int]], Union[int, "X"], Optional["Plain"], int | str | None, tuple[int, ...],
          Equal | int, list[Equal]]
KWARGS = [{}, {"is_argument": False}, {"module": "zeroplan.types"}, {"allow_special_forms": True},
          {"is_argument": False, "module": "m", "allow_special_forms": True}]


@pytest.mark.parametrize("kwargs", KWARGS)
def test_a_quick_check_answers_as_typings_own(kwargs):
    own = typing._type_check
    quick = checked_type(own, typing.ForwardRef, (Generic, Protocol),
                         (types.UnionType, typing._UnionGenericAlias, types.GenericAlias))
    for arg in [*STRINGS, *OTHERS]:
        assert answer(quick, arg, **kwargs) == answer(own, arg, **kwargs), arg
    assert answer(quick, Generic)[0] == answer(quick, Equal)[0] == answer(quick, (int,))[0] == "raised"  # checked


def test_the_quick_check_is_on_while_compiling_less_and_typing_is_as_it_was_after():
    own = typing._type_check
    undo = quick_type_checks()
    try:
        assert typing._type_check is not own and typing._type_check.__wrapped__ is own
        assert quick_type_checks()() is None and typing._type_check.__wrapped__ is own  # nested: left alone
        for kwargs in KWARGS:  # the check installed answers as typing's own too
            for arg in [*STRINGS, *OTHERS]:
                assert answer(typing._type_check, arg, **kwargs) == answer(own, arg, **kwargs), arg
        td = typing.TypedDict("TD", {"a": "int", "b": Optional[int], "c": Plain})
        assert td.__annotations__["a"] == typing.ForwardRef("int", module=__name__)
    finally:
        undo()
    assert typing._type_check is own
    undo()  # twice: nothing
    assert typing._type_check is own


def test_a_command_checks_its_types_quickly_and_typed_dicts_are_as_typings_own():
    code = ("import sys, typing\nmeta = list(sys.meta_path)\nown = typing._type_check\n"
            "from zeroplan.cli_startup import compiling_less\noff = compiling_less()\nquick = typing._type_check\n"
            "import pydantic_core.core_schema as cs, typing_extensions\noff()\n"
            "print(quick is not own, getattr(quick, '__wrapped__', None) is own, typing._type_check is own)\n"
            "print(sorted((n, repr(v)) for n, t in vars(cs).items() if typing_extensions.is_typeddict(t) "
            "for n, v in t.__annotations__.items()))\n"
            "keys = ('__required_keys__', '__optional_keys__', '__readonly_keys__', '__mutable_keys__')\n"
            "print(sorted((n, k, sorted(getattr(t, k, ()))) for n, t in vars(cs).items() "
            "if typing_extensions.is_typeddict(t) for k in keys))\n"
            "te = typing_extensions\nprint(type(te.__loader__).__name__, te.__spec__.loader is te.__loader__, "
            "hasattr(te._get_typeddict_qualifiers, '__wrapped__'), sys.meta_path == meta)\n")
    plain = code.replace("off = compiling_less()", "off = lambda: None")
    quick, own = (subprocess.run([sys.executable, "-c", c], capture_output=True, text=True, check=True).stdout
                  for c in (code, plain))
    assert quick.split("\n")[0] == "True True True" and own.split("\n")[0] == "False False True"
    assert quick.split("\n")[1] == own.split("\n")[1] and quick.count("ForwardRef(") > 500
    assert quick.split("\n")[2] == own.split("\n")[2] and quick.split("\n")[2].count("'type'") > 20  # the keys
    assert quick.split("\n")[3] == own.split("\n")[3] == "SourceFileLoader True False True"  # as imported after


def test_a_typing_of_another_shape_is_left_alone(monkeypatch):
    def _type_check(arg, msg):  # another signature
        return arg

    monkeypatch.setattr(typing, "_type_check", _type_check)
    assert quick_type_checks()() is None and typing._type_check is _type_check


def test_a_parameters_reading_is_kept_for_the_callbacks_reader_alone_and_once():
    from zeroplan.cli_typing import read_once

    reads = []

    def read(func):
        reads.append(func)
        return {"x": object()}

    def callback():
        return once(f)

    def other():
        return once(f)

    def f(x):
        return x

    once = read_once(read, callback.__code__)
    first = other()
    assert callback() is first and len(reads) == 1  # the reader's call: the kept answer
    assert callback() is not first and len(reads) == 2  # kept once only
    assert other() is not first and other() is not first and len(reads) == 4  # another caller reads anew
    other()
    assert once(lambda: 0) is not None and callback() is not first and len(reads) == 7  # another function between


COMMANDS = """
import json, sys, typer.main
import zeroplan.cli as cli
from zeroplan.cli_startup import compiling_less
reads = []
own = typer.main.get_params_from_function
typer.main.get_params_from_function = lambda f: reads.append(f.__name__) or own(f)
off = compiling_less() if QUICK else (lambda: None)
shown = lambda v: type(v).__name__ if ' at 0x' in repr(v) else repr(v)  # a function, an object: its type
described = lambda d: [shown(d.annotation), sorted((k, shown(v)) for k, v in vars(d.parameter_info).items())]
group = typer.main.get_command(cli.app_for([]))
off()
rows = []
for name, command in sorted(group.commands.items()):
    rows.append([name, command.help, [[sorted((k, shown(v)) for k, v in vars(p).items()), described(p.type_descriptor)]
                                     for p in command.params],
                 command.callback.__wrapped__.__name__])
print(json.dumps([rows, sorted(reads)]))
"""


def test_the_commands_typer_builds_are_as_before_with_each_command_read_once():
    quick, own = (json.loads(subprocess.run([sys.executable, "-c", COMMANDS.replace("QUICK", q)], capture_output=True,
                                            text=True, check=True).stdout) for q in ("True", "False"))
    assert quick[0] == own[0] and len(own[0]) == 5 and sum(len(r[2]) for r in own[0]) > 150
    assert sorted(quick[1] * 2) == own[1]  # each command's function and the group's callback: once, not twice


def test_no_qualifiers_is_typing_extensions_own_answer():
    import typing_extensions as te

    from zeroplan.cli_typing import no_qualifiers

    class Ref(typing.ForwardRef, _root=True):
        pass

    own = te._get_typeddict_qualifiers
    quick = no_qualifiers(own, typing.ForwardRef)
    cases = [typing.ForwardRef("int"), typing.ForwardRef("te.Required[int]"), Ref("x"), int, "int", None,
             te.Required[int], te.NotRequired["x"], te.ReadOnly[te.Required[int]], te.Annotated[te.NotRequired[int], 1],
             te.Annotated[typing.ForwardRef("x"), 2], Optional[int], te.Required[typing.ForwardRef("y")]]
    for case in cases:
        assert list(quick(case)) == list(own(case)), case
    assert [list(quick(c)) for c in cases[6:10]] == [[te.Required], [te.NotRequired], [te.ReadOnly, te.Required],
                                                     [te.NotRequired]]


class Recorded:
    """A mixin after the alias base in an MRO whose ``__setattr__`` ``super().__setattr__`` reaches."""

    def __setattr__(self, attr, val):
        object.__setattr__(self, "recorded", attr)
        object.__setattr__(self, attr, val)


def test_an_aliass_quick_setattr_is_typings_own():
    from zeroplan.cli_typing import alias_setattr

    base = typing._BaseGenericAlias
    own = vars(base)["__setattr__"]
    names = next(c for c in own.__code__.co_consts if type(c) is frozenset)
    quick = alias_setattr(base, names)

    class Mixed(typing._GenericAlias, Recorded, _root=True):
        pass

    def outcome(set_attr: Callable, make: Callable, attr: str) -> tuple:
        class Origin:
            pass

        alias = make(Origin)
        try:
            set_attr(alias, attr, 7)
        except Exception as e:  # noqa: BLE001 - the error is the outcome
            return ("raised", type(e), str(e))
        slots = {a: shown(getattr(alias, a, None)) for a in ("_name", "_inst", "_nparams", "recorded", attr)}
        return ("set", slots, vars(Origin).get(attr), vars(alias).get(attr) if hasattr(alias, "__dict__") else None)

    makers = [lambda o: typing._GenericAlias(o, (int,)), lambda o: typing._GenericAlias(int, (o,)),
              lambda o: typing._SpecialGenericAlias(o, 1, name="S"), lambda o: Mixed(o, (str,)),
              lambda o: typing._GenericAlias(tuple, (o,)), lambda o: typing._AnnotatedAlias(o, (1,)),
              lambda o: typing._UnionGenericAlias(typing.Union, (o, int)), lambda o: typing._CallableGenericAlias(
                  Callable, (int, o))]
    attrs = ["__module__", "__doc__", "__x__", "__", "_name", "_inst", "_nparams", "_paramspec_tvars", "_defaults",
             "custom", "_private", "__y", "z__"]
    for make in makers:
        for attr in attrs:
            assert outcome(quick, make, attr) == outcome(own, make, attr), (make, attr)
    assert outcome(quick, makers[3], "__x__")[1]["recorded"] == "'__x__'"  # the mixin's, as super() finds it
    assert outcome(quick, makers[1], "custom")[0] == "raised"  # set on int: refused as typing's own
