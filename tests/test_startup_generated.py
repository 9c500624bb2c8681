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
undo = cached_generated_code(cache.exec, cache.eval)
"""


def made(cached: bool) -> list:
    code = MADE.replace("CACHED", CACHED if cached else "").replace("UNDO", "undo()" if cached else "")
    code = code.replace("SEEN", "sorted({m for m, _ in cache.used})" if cached else "[]")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_generated_functions_are_their_own_modules_code_from_the_cache():
    cached, own = made(True), made(False)
    assert len(cached[0]) > 20 and cached[0] == own[0]  # every is_* function's and both __new__'s code, by hash
    assert cached[1:-1] == own[1:-1]  # the module's names (no `exec` left), its loader, no collections.eval after
    assert cached[2:5] == ["SourceFileLoader", True, False]
    assert cached[-1] == ["eval", "exec"] and own[-1] == []  # the texts went through the cache


def test_a_module_with_its_own_eval_or_a_seeded_module_already_imported_is_left_alone():
    code = ("import collections, sys\nfrom typing_inspection import typing_objects\nmine = lambda *a: 0\n"
            "collections.eval = mine\nfrom zeroplan.cli_startup import CodeCache\n"
            "from zeroplan.cli_generated import cached_generated_code\nc = CodeCache(kept=False)\n"
            "undo = cached_generated_code(c.exec, c.eval)\nseeding = len(sys.meta_path)\nundo()\n"
            "print(collections.eval is mine, 'exec' in vars(typing_objects), seeding - len(sys.meta_path))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "False", "1"]
