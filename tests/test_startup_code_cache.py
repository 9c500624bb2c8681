"""The code of generated texts kept between processes (``zeroplan.cli_startup.CodeCache``; docs/benchmarks.md,
"2026-12-03, startup"): each code read back is the code ``exec`` and ``compile`` give the standard library's
``dataclasses`` and ``typing`` for that text, a command answers the same with the file, without it, and with a
damaged one, and nothing is written where bytecode is not."""

import __future__
import dataclasses
import marshal
import os
import subprocess
import sys
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from typing import ClassVar, ForwardRef, Optional

import pytest

from zeroplan.cli_startup import CodeCache, cached_dataclass_code, deferred_dataclass_methods, shared_forward_ref_code

PLAN = ["plan", "--engine", "fsdp2", "--model", "llama2-7b", "--gpus", "8", "--gpu", "a100-40gb"]
METHODS = ("__init__", "__repr__", "__eq__", "__hash__", "__setattr__", "__delattr__", "__lt__", "__ge__")


def _zeroplan(args: list, prefix: object, write: bool = True) -> subprocess.CompletedProcess:
    """``python -m zeroplan.cli ARGS`` with its bytecode (and so the code cache) under ``prefix``."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(prefix)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, "-m", "zeroplan.cli", *args], capture_output=True, text=True, env=env,
                          check=True)


def _cache_files(prefix: object) -> list:
    return sorted(str(p) for p in Path(prefix).rglob("generated_code.*.marshal"))


def test_a_command_answers_the_same_with_the_file_without_it_and_with_a_damaged_one(tmp_path):
    plain = _zeroplan(PLAN, tmp_path / "never", write=False)
    assert _cache_files(tmp_path / "never") == []  # PYTHONDONTWRITEBYTECODE: nothing written
    first = _zeroplan(PLAN, tmp_path / "kept")
    (path,) = _cache_files(tmp_path / "kept")
    data = open(path, "rb").read()
    assert data.startswith(MAGIC_NUMBER) and len(marshal.loads(data[len(MAGIC_NUMBER):])) > 100
    second = _zeroplan(PLAN, tmp_path / "kept")
    assert open(path, "rb").read() == data  # every text found: not written again
    assert plain.stdout == first.stdout == second.stdout and plain.stderr == first.stderr == second.stderr
    for damaged in (b"", MAGIC_NUMBER, MAGIC_NUMBER + b"\x00junk", b"\x00\x00\r\n" + data[4:],
                    MAGIC_NUMBER + marshal.dumps([1, 2])):
        open(path, "wb").write(damaged)
        again = _zeroplan(PLAN, tmp_path / "kept")
        assert again.stdout == plain.stdout and again.stderr == plain.stderr
        again = open(path, "rb").read()
        assert again.startswith(MAGIC_NUMBER) and marshal.loads(again[len(MAGIC_NUMBER):]).keys() == \
            marshal.loads(data[len(MAGIC_NUMBER):]).keys()


def test_every_code_kept_by_a_real_command_is_the_code_of_its_text(tmp_path):
    # the file of an FSDP2 plan, `estimate` and help: each code equal to the text compiled here (this module has no
    # future imports, as dataclasses and typing: code objects compare their bytecode, constants, names and flags),
    # and different from the text compiled with a future import
    for args in (PLAN, ["estimate", "--params", "7.5e9", "--gpus", "64"], ["--help"]):
        _zeroplan(args, tmp_path)
    (path,) = _cache_files(tmp_path)
    kept = marshal.loads(open(path, "rb").read()[len(MAGIC_NUMBER):])
    regexes = {key: parts for key, parts in kept.items() if key[0] == "re"}  # tests/test_startup_generated.py
    kept = {key: code for key, code in kept.items() if key[0] != "re"}
    modes = {mode for mode, _ in kept}
    assert modes == {"exec", "eval"} and len(kept) > 150 and len(regexes) > 20
    for (mode, text), code in kept.items():
        fresh = compile(text, "<string>", mode)
        assert code == fresh and code.co_flags == fresh.co_flags and code.co_filename == "<string>", text
    import _sre
    import re

    for (_, magic, pattern, flags), parts in regexes.items():  # each regex the commands kept: re's own
        assert magic == _sre.MAGIC and _sre.compile(pattern, *parts) == re._compiler.compile(pattern, flags), pattern
    with_future = __future__.annotations.compiler_flag  # what a module with it would have compiled
    typed = next(key for key in kept if key[0] == "exec" and ":_type_" in key[1])
    assert kept[typed] != compile(typed[1], "<string>", "exec", flags=with_future, dont_inherit=True)


def _classes() -> list:
    """Dataclasses of every kind dataclasses writes methods for."""

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        a: int
        b: Optional[str] = "x"

    @dataclasses.dataclass(order=True)
    class Ordered:
        a: int
        b: list = dataclasses.field(default_factory=list)
        c: ClassVar[int] = 3

    @dataclasses.dataclass(unsafe_hash=True, kw_only=True)
    class KwOnly:
        a: int = 1
        b: "dict[str, int]" = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted(Frozen):
        c: int = 2
        d: dataclasses.InitVar[int] = 0

        def __post_init__(self, d: int) -> None:
            object.__setattr__(self, "c", self.c + d)

    return [Frozen, Ordered, KwOnly, Slotted]


def _made(codes: Optional[CodeCache], defer: bool = False) -> list:
    undo = [cached_dataclass_code(codes)] if codes is not None else []
    undo += [deferred_dataclass_methods()] if defer else []
    try:
        return _classes()
    finally:
        for each in reversed(undo):
            each()


@pytest.mark.skipif(not hasattr(dataclasses, "_create_fn"), reason="Python 3.13+: another dataclasses")
def test_classes_made_with_the_cache_are_the_classes_made_without(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = str(tmp_path / "codes.marshal")
    plain, writer = _made(None), CodeCache(path)
    first = _made(writer)
    writer.save()
    reader = CodeCache(path)
    second, deferred = _made(reader), _made(CodeCache(path), defer=True)
    assert reader.new is False and len(reader.used) == len(writer.used) > 10  # all read back, none compiled
    assert "exec" not in vars(dataclasses)
    for classes in (first, second, deferred):
        for cls, alone in zip(classes, plain):
            for name in METHODS:
                mine, theirs = cls.__dict__.get(name), alone.__dict__.get(name)
                if classes is deferred and name != "__init__" and mine is not None:
                    continue  # a stand-in until first called (tests/test_startup_dataclasses.py)
                assert (mine is None) == (theirs is None), (cls, name)
                if mine is not None and hasattr(mine, "__code__"):
                    assert mine.__code__ == theirs.__code__, (cls, name)
            assert cls.__doc__ == alone.__doc__ and repr(cls.__init__.__annotations__) == repr(
                alone.__init__.__annotations__).replace(alone.__qualname__, cls.__qualname__)
    for classes in (plain, first, second, deferred):
        frozen, ordered, kw_only, slotted = classes
        assert repr(frozen(1)) == repr(plain[0](1)).replace(plain[0].__qualname__, frozen.__qualname__)
        assert frozen(1) == frozen(1) and hash(frozen(1)) == hash(frozen(1)) and ordered(1) < ordered(2)
        assert kw_only(a=2) == kw_only(a=2) and hash(kw_only(a=2)) == hash(kw_only(a=2))
        assert slotted(1, "y", 2, 5).c == 7 and "__slots__" in vars(slotted)
        with pytest.raises(dataclasses.FrozenInstanceError):
            frozen(1).a = 2


def test_forward_references_read_back_are_typings_own():
    path_codes = CodeCache(kept=False)
    alone = [ForwardRef(t) for t in ("dict[str, int]", "*Ts", "Optional[int]")]
    restore = shared_forward_ref_code(path_codes)
    try:
        shared = [ForwardRef(t) for t in ("dict[str, int]", "*Ts", "Optional[int]")]
        with pytest.raises(SyntaxError, match="Forward reference must be an expression -- got 'a b'"):
            ForwardRef("a b")
    finally:
        restore()
    assert "compile" not in vars(__import__("typing"))
    assert [r.__forward_code__ for r in shared] == [r.__forward_code__ for r in alone]
    assert path_codes.compile("1 + 2", "<other>", "exec").co_filename == "<other>"  # not kept: compiled as asked
    assert len(path_codes.used) == 3


def test_a_file_that_cannot_be_written_is_left_and_the_answer_is_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    codes = CodeCache(str(blocked / "sub" / "codes.marshal"))
    _made(codes)
    codes.save()  # cannot make the directory: nothing raised, nothing written
    assert blocked.read_text() == "not a directory" and codes.new is True
    unwritten = CodeCache(str(tmp_path / "x.marshal"), kept=False)
    _made(unwritten)
    unwritten.save()
    assert not (tmp_path / "x.marshal").exists()


def test_past_the_most_texts_a_command_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = str(tmp_path / "codes.marshal")
    old = {("exec", f"x = {i}"): compile(f"x = {i}", "<string>", "exec") for i in range(20)}
    open(path, "wb").write(MAGIC_NUMBER + marshal.dumps(old))
    monkeypatch.setattr(__import__("zeroplan.cli_startup").cli_startup, "CODE_CACHE_MAX", 25)
    codes = CodeCache(path)
    assert codes.code("exec", "x = 3") is codes.code("exec", "x = 3") and codes.new is False  # read, not compiled
    codes.code("exec", "y = 1")
    codes.save()
    kept = marshal.loads(open(path, "rb").read()[len(MAGIC_NUMBER):])
    assert len(kept) == 21 and kept[("exec", "y = 1")] == compile("y = 1", "<string>", "exec")
    many = CodeCache(path)
    for i in range(5):
        many.code("exec", f"z = {i}")
    many.save()  # 26 texts: past the most, the five compiled alone
    assert set(marshal.loads(open(path, "rb").read()[len(MAGIC_NUMBER):])) == {("exec", f"z = {i}") for i in range(5)}
