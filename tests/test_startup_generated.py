"""typing_inspection's check functions and namedtuple's ``__new__`` compiled through the code cache
(``zeroplan.cli_generated``; docs/benchmarks.md, "2026-12-03, fifth session, startup3"): the same code as their own
``exec`` and ``eval`` make, the module as an import leaves it. Each case runs in a fresh interpreter."""

import json
import subprocess
import sys
import textwrap

MADE = """
import collections, hashlib, json, marshal, sys
CACHED
from typing_inspection import typing_objects
from typing import NamedTuple
Point = collections.namedtuple('Point', 'x y', defaults=(2,))
class Named(NamedTuple):
    a: int
    b: str = 'b'
UNDO
functions = {n: f for n, f in sorted(vars(typing_objects).items()) if n.startswith('is_') and callable(f)}
codes = {n: hashlib.sha256(marshal.dumps(f.__code__)).hexdigest() for n, f in functions.items()}
for cls in (Point, Named):
    codes[cls.__name__] = hashlib.sha256(marshal.dumps(cls.__new__.__code__)).hexdigest()
print(json.dumps([codes, sorted(vars(typing_objects)), type(typing_objects.__loader__).__name__,
                  typing_objects.__spec__.loader is typing_objects.__loader__, 'eval' in vars(collections),
                  typing_objects.is_literal(__import__('typing').Literal), repr(Point(1)), repr(Named(3)),
                  Point.__new__.__defaults__, Named.__new__.__defaults__, SEEN]))
"""

CACHED = """
from zeroplan.cli_startup import CodeCache
from zeroplan.cli_generated import cached_generated_code
cache = CodeCache(kept=False)
undo = cached_generated_code(cache.exec, cache.eval, cache.regex)
"""


def made(cached: bool) -> list:
    code = MADE.replace("CACHED", CACHED if cached else "").replace("UNDO", "undo()" if cached else "")
    code = code.replace("SEEN", "sorted({k[0] for k in cache.used})" if cached else "[]")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_generated_functions_are_their_own_modules_code_from_the_cache():
    cached, own = made(True), made(False)
    assert len(cached[0]) > 20 and cached[0] == own[0]  # every is_* function's and both __new__'s code, by hash
    assert cached[1:-1] == own[1:-1]  # the module's names (no `exec` left), its loader, no collections.eval after
    assert cached[2:5] == ["SourceFileLoader", True, False]
    assert cached[-1] == ["eval", "exec", "re"] and own[-1] == []  # the texts went through the cache


def test_a_module_with_its_own_eval_or_a_seeded_module_already_imported_is_left_alone():
    code = ("import collections, sys\nfrom typing_inspection import typing_objects\nmine = lambda *a: 0\n"
            "collections.eval = mine\nfrom zeroplan.cli_startup import CodeCache\n"
            "from zeroplan.cli_generated import cached_generated_code\nc = CodeCache(kept=False)\n"
            "undo = cached_generated_code(c.exec, c.eval, c.regex)\nseeding = len(sys.meta_path)\nundo()\n"
            "print(collections.eval is mine, 'exec' in vars(typing_objects), seeding - len(sys.meta_path))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "False", "1"]


PATTERNS = [r"\d+", r"(?P<name>[a-z_]\w*)\s*=\s*(?P<value>.*)$", r"^(?:\s*(\w+)\s*\.)?\s*(\w+)", r"a|b|c+?",
            r"(?i)straße", r"[^\x00-\x7f]+", r"(a)(b)?(?(2)c|d)", r"\bword\b", r"x{2,5}y*", r"(?s).+?(?=end)",
            r"(?x) a  # comment\n b", r"[\w.-]+/[\w.-]+(@[\w./-]+)?", "", r"(?<=a)b(?<!c)", r"\1?(x)"]
TEXTS = ["abc 123 x = 7\nend", "Straße STRASSE", "aab acd bd", "word words a_b.c", "xxxyyy xx", "org/name@v1.0"]


def test_a_regular_expression_from_its_kept_parts_is_the_one_re_compiles():
    # each pattern (str and bytes, with flags) made from the parts the cache keeps, also after a marshal round trip
    # (the file), compares equal to re's own compile (flags, pattern and code) and matches the same
    import marshal
    import re

    from zeroplan.cli_generated import compiled_regex, regex_parts

    own = re._compiler.compile
    for pattern in PATTERNS:
        for p, flags in ((pattern, 0), (pattern, re.MULTILINE | re.IGNORECASE), (pattern.encode(), 0)):
            if isinstance(p, bytes) and not p.isascii():
                continue
            try:
                plain = own(p, flags)
            except re.error:
                continue
            parts = marshal.loads(marshal.dumps(regex_parts(p, int(flags))))
            made = compiled_regex(own, lambda q, f: parts, p, flags)
            assert made == plain and made.groupindex == plain.groupindex and made.groups == plain.groups, p
            for text in TEXTS:
                t = text.encode() if isinstance(p, bytes) else text
                if isinstance(p, bytes) and not text.isascii():
                    continue
                seen = [(m.groups(), m.lastgroup, m.lastindex, m.span()) for m in made.finditer(t)]
                assert seen == [(m.groups(), m.lastgroup, m.lastindex, m.span()) for m in plain.finditer(t)], (p, t)
    assert compiled_regex(own, None, "a", re.DEBUG) == own("a", 0 | re.DEBUG)  # DEBUG prints: re's own
    assert compiled_regex(own, lambda q, f: (0, [1, 2], 0, {}, ()), "ab", 0) == own("ab", 0)  # bad code: re's own


def test_a_re_without_the_private_compiler_is_left_alone(monkeypatch):
    """Python 3.10's ``re`` has no ``_compiler``/``_parser`` (``sre_compile``, ``sre_parse``): every command crashed
    there when the cache patched ``re._compiler.compile`` unconditionally (found running the branch on 3.10). Without
    them, or without the pieces ``regex_parts`` reads, ``re`` is left as it is, and what else the cache does still
    works; with them, the compiler is patched and put back."""
    import re

    from zeroplan import cli_generated
    from zeroplan.cli_startup import CodeCache

    own = re._compiler.compile
    cache = CodeCache(kept=False)
    undo = cli_generated.cached_generated_code(cache.exec, cache.eval, cache.regex)
    try:
        assert re._compiler.compile is not own  # this Python (3.11+): patched
        assert re.compile("a(?P<b>c)+", re.I).match("ACC").group("b") == "C"
    finally:
        undo()
    assert re._compiler.compile is own
    monkeypatch.setattr(cli_generated, "_REGEX_PARTS_READABLE", False)
    undo = cli_generated.cached_generated_code(cache.exec, cache.eval, cache.regex)
    try:
        assert re._compiler.compile is own
    finally:
        undo()
    monkeypatch.delattr(re, "_compiler")
    undo = cli_generated.cached_generated_code(cache.exec, cache.eval, cache.regex)
    undo()
    assert not hasattr(re, "_compiler")
