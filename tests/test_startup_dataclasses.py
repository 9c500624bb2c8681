"""Dataclass methods compiled on first call (``zeroplan.cli_startup.deferred_dataclass_methods``; docs/benchmarks.md,
"Start-up, sixth pass"): each class made while it is on behaves as the class the standard library makes, and its
deferred methods, once called, are the standard library's own code."""

import dataclasses
import inspect
import json
import subprocess
import sys
from typing import Optional

import pytest

from zeroplan.cli_startup import DEFERRED, deferred_dataclass_methods
from test_startup import ESTIMATE, run_main

pytestmark = pytest.mark.skipif(not hasattr(dataclasses, "_create_fn"), reason="Python 3.13+: left alone")


def _classes() -> dict:
    """One of each kind of dataclass: frozen (hash from fields), mutable (unhashable), ordered, with slots, an
    explicit unsafe hash, a subclass, a field left out of repr and comparison, a recursive one."""

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        """A frozen record."""
        a: int
        b: str = "x"

    @dataclasses.dataclass
    class Mutable:
        a: int
        b: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(order=True, frozen=True)
    class Ordered:
        a: int
        b: float = 0.5

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        a: int
        b: Optional[int] = None

    @dataclasses.dataclass(unsafe_hash=True)
    class UnsafeHash:
        a: int
        c: int = dataclasses.field(default=0, compare=False, repr=False)

    @dataclasses.dataclass(frozen=True)
    class Child(Frozen):
        c: tuple = ()

    @dataclasses.dataclass
    class Node:
        name: str
        link: Optional["Node"] = None

    return {cls.__name__: cls for cls in (Frozen, Mutable, Ordered, Slotted, UnsafeHash, Child, Node)}


def _behaviour(kinds: dict) -> list:
    """What each class answers: reprs, equalities, hashes, orderings, assignment errors, docs and fields."""
    out = []
    frozen, mutable, ordered, slotted, unsafe, child, node = (kinds[k] for k in (
        "Frozen", "Mutable", "Ordered", "Slotted", "UnsafeHash", "Child", "Node"))
    loop = node("a")
    loop.link = loop
    out += [repr(frozen(1)), repr(mutable(2, [3])), repr(ordered(1)), repr(slotted(4)), repr(unsafe(5, 6)),
            repr(child(1, "y", (2,))), repr(loop)]
    out += [frozen(1) == frozen(1), frozen(1) == frozen(2), frozen(1) == child(1), frozen(1) == (1, "x"),
            child(1) == child(1), mutable(1) == mutable(1), unsafe(1, 2) == unsafe(1, 3), slotted(1) == slotted(1),
            ordered(1) == ordered(1.0), node("a") == node("a", loop), node("b") != node("b")]
    out += [hash(frozen(1)) == hash((1, "x")), hash(child(1, "x", ())) == hash((1, "x", ())),
            hash(unsafe(1, 9)) == hash((1,)), hash(slotted(2)) == hash((2, None)), hash(ordered(3)) == hash((3, 0.5)),
            mutable.__hash__]
    out += [ordered(1) < ordered(2), ordered(2) <= ordered(1), ordered(1, 0.7) > ordered(1), ordered(1) >= ordered(1)]
    for cls, action in ((frozen, lambda o: setattr(o, "a", 3)), (frozen, lambda o: delattr(o, "b")),
                        (child, lambda o: setattr(o, "c", 3)), (slotted, lambda o: setattr(o, "a", 3)),
                        (frozen, lambda o: setattr(o, "other", 3)), (ordered, lambda o: setattr(o, "b", 1)),
                        (ordered, lambda o: delattr(o, "a")), (slotted, lambda o: delattr(o, "b")),
                        (child, lambda o: delattr(o, "nothing"))):
        try:
            action(cls(1))
            out.append("no error")
        except Exception as exc:  # noqa: BLE001 - the error itself is the answer compared
            out.append((type(exc).__name__, str(exc)))
    out += [(cls.__doc__, cls.__match_args__, [f.name for f in dataclasses.fields(cls)]) for cls in kinds.values()]
    out += [dataclasses.replace(frozen(1), b="z"), dataclasses.asdict(child(1, "y", (2,)))]
    return [repr(x) if isinstance(x, (frozen, child)) else x for x in out]


def _code(function) -> tuple:
    code = inspect.unwrap(function).__code__
    return code.co_code, code.co_consts, code.co_names, code.co_varnames, code.co_freevars


def test_classes_made_while_deferred_behave_as_the_standard_librarys():
    eager = _classes()
    restore = deferred_dataclass_methods()
    try:
        deferred = _classes()
    finally:
        restore()
    assert dataclasses._create_fn.__module__ == "dataclasses"  # restored
    stand_in = deferred["Frozen"].__dict__["__eq__"]
    assert stand_in.__qualname__ == eager["Frozen"].__eq__.__qualname__ == "_classes.<locals>.Frozen.__eq__"
    assert _code(stand_in) != _code(eager["Frozen"].__eq__)  # not compiled yet
    assert _behaviour(deferred) == _behaviour(eager)
    for name, cls in deferred.items():  # every deferred method called: now the standard library's own code
        for method in DEFERRED & set(cls.__dict__):
            mine, theirs = cls.__dict__[method], eager[name].__dict__[method]
            if theirs is None:
                assert mine is None
                continue
            assert (method, _code(mine)) == (method, _code(theirs))
            assert mine.__qualname__ == theirs.__qualname__ and mine.__module__ == theirs.__module__
    assert deferred["Frozen"].__dict__["__eq__"] is not stand_in  # set in the stand-in's place


def test_a_stand_in_called_through_a_subclass_sets_the_method_on_its_own_class():
    restore = deferred_dataclass_methods()
    try:
        kinds = _classes()
    finally:
        restore()
    frozen, child = kinds["Frozen"], kinds["Child"]

    class Plain(frozen):  # not a dataclass: inherits Frozen's methods
        pass

    stand_in = frozen.__dict__["__hash__"]
    assert hash(Plain(1)) == hash((1, "x"))
    assert frozen.__dict__["__hash__"] is not stand_in and "__hash__" not in Plain.__dict__
    assert child.__dict__["__hash__"].__name__ == "__hash__" and hash(child(1)) == hash((1, "x", ()))


def test_a_one_answer_command_compiles_few_dataclass_methods():
    # estimate and plan (cli_exit.ONE_ANSWER) make their dataclasses with deferred methods and call few of them
    count = ("import dataclasses\n"
             "classes = {c for name, m in list(sys.modules.items()) if name.startswith('zeroplan.') "
             "for c in vars(m).values() if isinstance(c, type) and dataclasses.is_dataclass(c)}\n"
             "kinds = [c.__dict__[m].__code__.co_name for c in classes for m in ('__eq__', '__repr__') "
             "if m in c.__dict__]\n"
             "print(len(classes), kinds.count('stand_in'), kinds.count('wrapper'), file=sys.stderr)\n")  # fmt: skip
    out = run_main(ESTIMATE.replace("'--params', '7.5e9'", "'--model', 'llama2-7b'"), after=count)
    assert json.loads(out.stdout)["stages"][3]["model_states_bytes"] > 0
    classes, waiting_eq, reprs = map(int, out.stderr.strip().splitlines()[-1].split())
    assert classes > 30 and reprs > 30 and waiting_eq > classes * 3 // 4  # most never called: not compiled


def test_importing_the_cli_leaves_the_collector_and_dataclasses_as_they_were():
    # quiet_imports: typer loads without collections and with deferred methods, both restored after the import
    code = ("import dataclasses, gc, sys\n{off}\nimport zeroplan.cli\nfrom typer._coercion import TypeDescriptor\n"
            "print(gc.isenabled(), dataclasses._create_fn.__module__, "
            "TypeDescriptor.__dict__['__eq__'].__code__.co_name)\n")  # fmt: skip
    for off, enabled in (("", "True"), ("gc.disable()", "False")):
        out = subprocess.run([sys.executable, "-c", code.format(off=off)], capture_output=True, text=True, check=True)
        assert out.stdout.split() == [enabled, "dataclasses", "stand_in"]


def test_forward_references_of_one_string_share_their_code():
    # shared_forward_ref_code: typing compiles a forward reference's string once, the same code object as before
    from typing import ForwardRef

    from zeroplan.cli_startup import shared_forward_ref_code

    alone = ForwardRef("dict[str, int]"), ForwardRef("dict[str, int]")
    restore = shared_forward_ref_code()
    try:
        shared = ForwardRef("dict[str, int]"), ForwardRef("dict[str, int]"), ForwardRef("*Ts")
        with pytest.raises(SyntaxError, match="Forward reference must be an expression -- got 'a b'"):
            ForwardRef("a b")
    finally:
        restore()
    assert "compile" not in vars(__import__("typing"))
    assert alone[0].__forward_code__ is not alone[1].__forward_code__
    assert shared[0].__forward_code__ is shared[1].__forward_code__
    assert shared[0].__forward_code__ == alone[0].__forward_code__ and shared[0] == alone[0]
    assert eval(shared[0].__forward_code__) == dict[str, int]
    assert shared[2].__forward_code__ == ForwardRef("*Ts").__forward_code__


def test_turned_on_twice_the_inner_call_changes_nothing():
    outer = deferred_dataclass_methods()
    try:
        deferring = dataclasses._create_fn
        inner = deferred_dataclass_methods()
        assert dataclasses._create_fn is deferring
        inner()
        assert dataclasses._create_fn is deferring
    finally:
        outer()
    assert dataclasses._create_fn.__module__ == "dataclasses"
