"""Standard modules run at their first use (``zeroplan.cli_deferred``; docs/benchmarks.md, "2026-12-03, fifth
session, startup3"): a command runs none of ``DEFERRED_MODULES``, and a deferred module, once used, is the module an
import makes. Each check runs in a fresh interpreter (what is imported depends on the process's history)."""

import json
import subprocess
import sys
import textwrap

from zeroplan.cli_deferred import DEFERRED_MODULES


def fresh(code: str) -> str:
    """``code`` run in a fresh interpreter; its stdout's last line."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


SHOW = """
import sys
before = set(sys.modules)  # what site and its .pth files imported
import json, types
from zeroplan.cli_deferred import DEFERRED_MODULES, DeferredModule
from zeroplan.cli import main
sys.argv = ['zeroplan', *ARGV]
try:
    main()
except SystemExit:
    pass
new = set(sys.modules) - before
ran = sorted(n for n in DEFERRED_MODULES & new if type(sys.modules[n]) is not DeferredModule)
print(json.dumps([ran, sorted(n for n in ('hmac', '_hashlib', 'selectors', '_bz2', '_lzma') if n in new)]))
"""


def test_a_plan_and_an_estimate_run_none_of_the_deferred_modules():
    for argv in (["plan", "--engine", "fsdp2", "--model", "llama2-7b", "--gpu", "h100-80gb", "--gpus", "16"],
                 ["plan", "--engine", "deepspeed", "--model", "llama2-7b", "--gpu", "a100-40gb", "--gpus", "8"],
                 ["plan", "--model", "llama2-7b", "--gpus", "8", "--gpu", "a100-40gb", "--json"],
                 ["estimate", "--params", "7.5e9", "--gpus", "64", "--json"]):
        assert json.loads(fresh(SHOW.replace("ARGV", repr(argv)))) == [[], []], argv
    ran, loaded = json.loads(fresh(SHOW.replace("ARGV", "['--help']")))  # rich prints the help: it reads struct
    # selectors is left out for --help: pygments 2.20 (rich's highlighter) finds its plugins through importlib.metadata,
    # which imports email, hence socket and selectors (2.21 does not); that is pygments' import, not a deferred one's
    assert not {"hmac", "_hashlib", "_bz2", "_lzma"} & set(loaded)
    assert not {"secrets", "subprocess", "bz2", "lzma"} & set(ran)


EACH = """
import sys
names = [n for n in NAMES if n not in sys.modules]  # those site and its .pth files did not import
import importlib, json, types
__file__ = json.__file__  # a source file for linecache
if DEFER:
    from zeroplan.cli_deferred import DeferredModule, deferred_imports
    restore = deferred_imports(names)
    modules = [importlib.import_module(n) for n in names]
    assert [type(m) for m in modules] == [DeferredModule] * len(names)
    again = [importlib.import_module(n) for n in names]  # as the import statement, reads only __spec__
    assert all(a is m for a, m in zip(again, modules)) and [type(m) for m in modules] == [DeferredModule] * len(names)
    assert all(m.__spec__.name == n for m, n in zip(modules, names))
    restore()
else:
    modules = [importlib.import_module(n) for n in names]
from base64 import b64encode
from bz2 import compress, decompress
from lzma import compress as xz, decompress as unxz
uses = [__import__('secrets').token_hex(4), b64encode(b'zeroplan').decode(), __import__('struct').pack('<I', 7).hex(),
        __import__('subprocess').run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout,
        __import__('signal').Signals(2).name, decompress(compress(b'x' * 99)).decode(), unxz(xz(b'y' * 9)).decode(),
        __import__('linecache').getline(__file__, 1) == open(__file__).readline() != '',
        __import__('token').tok_name[1], sys.modules['typer.colors'].RED, sys.modules['shellingham'].__name__,
        [t.string for t in __import__('tokenize').generate_tokens(iter(['a = 1\\n']).__next__)][:3],
        __import__('tempfile').gettempprefix(), __import__('os').path.isdir(__import__('tempfile').gettempdir())]
assert all(type(sys.modules[n]) is types.ModuleType for n in names)
print(json.dumps([names] + [[n, sorted(vars(m)), type(m.__loader__).__name__, m.__spec__.loader is m.__loader__,
                             m.__file__, m.__cached__, m.__spec__.origin, m.__spec__.loader_state]
                            for n, m in zip(names, modules)]
                 + [len(uses[0])] + uses[1:]))
"""


def test_a_deferred_module_once_used_is_the_module_an_import_makes():
    code = EACH.replace("NAMES", repr(sorted(DEFERRED_MODULES)))
    deferred = json.loads(fresh(code.replace("DEFER", "True")))
    eager = json.loads(fresh(code.replace("DEFER", "False")))
    assert deferred == eager
    names, rows = deferred[0], deferred[1:]
    assert {"secrets", "subprocess", "tokenize", "typer.colors"} <= set(names)  # no .pth file imports these
    assert [row[0] for row in rows[:len(names)]] == names
    assert [row[2] for row in rows[:len(names)]] == ["SourceFileLoader"] * len(names)
    assert rows[len(names):] == [8, "emVyb3BsYW4=", "07000000", "42\n", "SIGINT", "x" * 99, "y" * 9,
                                     True,
                                     "NAME", "red", "shellingham", ["a", "=", "1"], "tmp", True]


ALREADY = """
import sys
sys.path.insert(0, DIRECTORY)
import first_module
from zeroplan.cli_deferred import DeferredModule, deferred_imports
restore = deferred_imports(['first_module', 'second_module'])
import first_module, second_module
restore()
print(type(first_module).__name__, type(second_module).__name__, first_module.value)
"""


def test_a_module_imported_before_the_deferral_is_left_as_it_is(tmp_path):
    """What CI's machine does to ``bz2`` and ``lzma`` (a ``.pth`` file imports them at start-up)."""
    for name in ("first_module", "second_module"):
        (tmp_path / f"{name}.py").write_text("value = 7\n")
    assert fresh(ALREADY.replace("DIRECTORY", repr(str(tmp_path)))) == "module DeferredModule 7"


THREADS = """
import builtins, sys, threading, time
sys.path.insert(0, DIRECTORY)
from zeroplan.cli_deferred import DeferredModule, deferred_imports
builtins.runs = 0
restore = deferred_imports(['slow_module'])
import slow_module
restore()
assert type(slow_module) is DeferredModule
seen, start = [], threading.Barrier(8)
def read():
    start.wait()
    seen.append(slow_module.value)
threads = [threading.Thread(target=read) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(builtins.runs, seen)
"""


def test_a_deferred_module_runs_once_and_a_second_thread_waits_for_it(tmp_path):
    (tmp_path / "slow_module.py").write_text("import builtins, time\nbuiltins.runs += 1\ntime.sleep(0.2)\n"
                                             "value = 42 if builtins.runs == 1 else None\n")
    assert fresh(THREADS.replace("DIRECTORY", repr(str(tmp_path)))) == f"1 {[42] * 8}"


FAILING = """
import sys
sys.path.insert(0, DIRECTORY)
import textwrap
from zeroplan.cli_deferred import deferred_imports
restore = deferred_imports(['broken_module', 'textwrap'])
import broken_module, textwrap
restore()
try:
    broken_module.value
except ZeroDivisionError as error:
    print('broken_module' in sys.modules, type(broken_module).__name__, type(textwrap).__name__, error)
"""


def test_a_deferred_module_that_raises_is_dropped_as_after_a_failed_import(tmp_path):
    # its reader gets the module's error; the module leaves sys.modules; an already imported module is not deferred
    (tmp_path / "broken_module.py").write_text("value = 1 / 0\n")
    assert fresh(FAILING.replace("DIRECTORY", repr(str(tmp_path)))) == "False module module division by zero"


WRAPPING = """
import importlib.machinery, sys
from zeroplan.cli_deferred import DeferredModule, deferred_imports
class Asking:  # an import hook that asks the whole meta path (a profiler's, a coverage tool's)
    def find_spec(self, name, path=None, target=None):
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                return spec
restore = deferred_imports(['secrets'])
sys.meta_path.insert(0, Asking())  # asks the deferring finder, which asks it
import secrets
restore()
print(type(secrets).__name__, len(secrets.token_hex(3)), type(secrets).__name__)
"""


def test_a_hook_that_asks_the_whole_meta_path_does_not_loop():
    # each finder asks the other: the deferring finder answers None while it asks (RecursionError without it)
    assert fresh(WRAPPING) == "DeferredModule 6 module"
