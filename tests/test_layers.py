"""The layers of the code, checked on the source (``ast``: nothing is imported, an import inside a function
counts): no import circle, no arrow back up, no module over 400 lines, no function body over 80 lines, no named
engine imported from outside the engines and the validator's engine runners (docs/architecture.md).

Layers, low to high (a module may import its own layer and the ones below):
files, hub, integrations (readers of the configs users have) < architectures < formulas, allocator < types < policy, presets, parsing, number_formats < engines
< estimation, planning, sweeping (and the ``zeroplan`` facade) < render < plots, plot_data (an edge)
< validate (above the planner) < cli, cli_options, cli_integrations and one module per command (cli_sweep,
cli_plot, cli_validate).

Each allow-list below names today's offenders, one line each with why; an entry that no longer offends
fails the test too, so the lists only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zeroplan", "validate")
MAX_LINES = 400
MAX_FUNCTION_LINES = 80
"""A function's body: its first statement after the docstring to its last line (the signature, where typer
declares a command's options, and the docstring are not counted)."""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("zeroplan.files", "zeroplan.terminated", "zeroplan.hub", "zeroplan.integrations"),
    ("zeroplan.architectures",),
    ("zeroplan.formulas", "zeroplan.allocator"),
    ("zeroplan.types",),
    ("zeroplan.policy", "zeroplan.presets", "zeroplan.parsing", "zeroplan.number_formats"),
    ("zeroplan.engines",),
    ("zeroplan", "zeroplan.estimation", "zeroplan.planning", "zeroplan.sweeping"),
    ("zeroplan.render",),
    ("zeroplan.plots", "zeroplan.plot_data"),
    ("validate",),
    ("zeroplan.cli", "zeroplan.cli_options", "zeroplan.cli_integrations", "zeroplan.cli_sweep", "zeroplan.cli_plot",
     "zeroplan.cli_validate", "zeroplan.cli_startup", "zeroplan.cli_deferred",
     "zeroplan.cli_exit", "zeroplan.cli_generated", "zeroplan.cli_typing"),
)

CIRCLES_ALLOWED: dict[tuple[str, ...], str] = {
    # a pair of modules that import each other (lazily, inside functions): none left (issue 16)
}
ARROWS_UP_ALLOWED: dict[str, str] = {
    # importer -> why it may still import a higher layer (to be emptied)
}
LONG_ALLOWED: dict[str, str] = {
    # module -> why it may still be over MAX_LINES (to be split by its owner)
}
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {
    # path:qualified name -> why its body may still be over MAX_FUNCTION_LINES (to be split by its owner); the
    # nine the issue 16 audit found (2026-12-02) are split (branch fnlen)
}
ENGINE_IMPORTS_ALLOWED: dict[str, str] = {
    # module outside zeroplan/engines/ and validate/engines/ that still imports a named engine: each goes
    # through the registry (zeroplan.engines.get_engine / Engine) instead
}


def modules() -> dict[str, Path]:
    """Every module of the packages: dotted name -> file (a package is its ``__init__.py``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports, anywhere in the file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a function or class: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, name, set(mods)) for name, path in mods.items()}


def layer(name: str) -> int:
    """The index in ``LAYERS`` of the longest prefix that names ``name``'s layer."""
    best = (-1, -1)
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if name == prefix or (prefix != "zeroplan" and name.startswith(prefix + ".")):  # the facade alone
                best = max(best, (len(prefix), i))
    if best[1] < 0:
        raise AssertionError(f"{name}: in no layer; add it to LAYERS")
    return best[1]


def function_lengths(path: Path) -> dict[str, int]:
    """Body lines (``MAX_FUNCTION_LINES``) of every function and method of ``path``, by qualified name."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    body = child.body
                    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    first = body[1] if docstring and len(body) > 1 else body[0]
                    out[name] = child.end_lineno - first.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def arrows_up(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets if layer(b) > layer(a))


def named_engines() -> set[str]:
    """The engines under zeroplan/engines/: every module or package but the contract (base, declared, live) and the
    registry."""
    here = ROOT / "zeroplan" / "engines"
    names = {p.stem for p in here.glob("*.py")} | {p.name for p in here.iterdir() if (p / "__init__.py").exists()}
    return {f"zeroplan.engines.{n}" for n in names - {"__init__", "base", "declared", "live"}}


def engine_importers(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Modules outside the engines and the validator's engine runners that import a named engine."""
    engines = named_engines()
    out: dict[str, set[str]] = {}
    for a, targets in edges.items():
        if a.startswith(("zeroplan.engines.", "validate.engines.")) or a in ("zeroplan.engines", "validate.engines"):
            continue
        hit = {e for e in engines for b in targets if b == e or b.startswith(e + ".")}
        if hit:
            out[a] = hit
    return out


def test_no_import_circle():
    found = {tuple(c) for c in circles(graph())}
    assert sorted(found - set(CIRCLES_ALLOWED)) == []
    stale = set(CIRCLES_ALLOWED) - found
    assert not stale, f"no longer a circle, remove from CIRCLES_ALLOWED: {sorted(stale)}"


def test_no_arrow_back_up():
    up = arrows_up(graph())
    assert [(a, b) for a, b in up if a not in ARROWS_UP_ALLOWED] == []
    stale = set(ARROWS_UP_ALLOWED) - {a for a, _ in up}
    assert not stale, f"no longer offending, remove from ARROWS_UP_ALLOWED: {sorted(stale)}"


def test_no_module_over_400_lines():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in modules().values()}
    long = {m for m, n in sizes.items() if n > MAX_LINES}
    assert sorted(long - set(LONG_ALLOWED)) == []
    stale = set(LONG_ALLOWED) - long
    assert not stale, f"no longer over {MAX_LINES} lines, remove from LONG_ALLOWED: {sorted(stale)}"


def test_no_function_body_over_80_lines():
    sizes = {f"{p.relative_to(ROOT).as_posix()}:{name}": n
             for p in modules().values() for name, n in function_lengths(p).items()}  # fmt: skip
    long = {f for f, n in sizes.items() if n > MAX_FUNCTION_LINES}
    assert sorted(long - set(LONG_FUNCTIONS_ALLOWED)) == []
    stale = set(LONG_FUNCTIONS_ALLOWED) - long
    assert not stale, f"no longer over {MAX_FUNCTION_LINES} lines, remove from LONG_FUNCTIONS_ALLOWED: {sorted(stale)}"


def test_named_engines_only_inside_engines_and_the_validators_runners():
    found = engine_importers(graph())
    assert sorted(set(found) - set(ENGINE_IMPORTS_ALLOWED)) == []
    stale = set(ENGINE_IMPORTS_ALLOWED) - set(found)
    assert not stale, f"no longer importing a named engine, remove from ENGINE_IMPORTS_ALLOWED: {sorted(stale)}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    # a circle of three, a self-contained pair, and one arrow up (formulas -> engines)
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": set()}
    assert circles(edges) == [["a", "b", "c"]]
    assert arrows_up({"zeroplan.formulas.x": {"zeroplan.engines.fsdp2", "zeroplan.types"}}) == [
        ("zeroplan.formulas.x", "zeroplan.engines.fsdp2"), ("zeroplan.formulas.x", "zeroplan.types")]  # fmt: skip
    assert layer("zeroplan.plot_data") == layer("zeroplan.plots") > layer("zeroplan.render.table")
    assert layer("zeroplan.engines.fsdp2.terms") == layer("zeroplan.engines") < layer("zeroplan") == layer(
        "zeroplan.planning.plan")  # fmt: skip
    with pytest.raises(AssertionError, match="in no layer"):
        layer("zeroplan.not_placed")  # `zeroplan` names the facade only, not every module of the package
    with pytest.raises(AssertionError, match="in no layer"):
        layer("numpy")
    # an import inside a function counts, `from package import module` names the module, relative resolves
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from zeroplan.engines import fsdp2, get_engine\n    from .x import y\n")
    known = {"zeroplan.engines", "zeroplan.engines.fsdp2", "pkg.x"}
    assert imports_of(src, "pkg.m", known) == {"zeroplan.engines", "zeroplan.engines.fsdp2", "pkg.x"}
    assert engine_importers({"zeroplan.cli": {"zeroplan.engines.fsdp2.plan"}, "zeroplan.engines": {
        "zeroplan.engines.fsdp2"}}) == {"zeroplan.cli": {"zeroplan.engines.fsdp2"}}  # fmt: skip
    # a function's body is counted without its signature and docstring, a method and a nested one by name
    src.write_text('class C:\n    def m(self,\n          x):\n        """doc"""\n        a = 1\n\n'
                   '        def inner():\n            return a\n        return inner\n')
    assert function_lengths(src) == {"C.m": 5, "C.m.inner": 1}
