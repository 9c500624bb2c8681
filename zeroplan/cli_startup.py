"""What a fresh ``zeroplan`` process skips at start-up (docs/benchmarks.md, "Start-up, third pass" and "fourth
pass"): pydantic's plugin search when plugins are off, and typer's coercion of an option left unset. Kept out of
``cli`` so that the command module stays a list of commands."""

from __future__ import annotations

import os
import sys
import types


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
    import importlib

    if attr.startswith("__"):
        raise AttributeError(attr)
    del sys.modules[name]
    return getattr(importlib.import_module(name), attr)


class _CoercedWhenGiven:
    """An option's coercion, built on its first value that is not None. typer 0.29 builds a pydantic
    ``TypeAdapter`` per option before coercing (``_TyperParameter.get_runtime_param``), even for a value of None,
    which its ``RuntimeParam.coerce`` returns unchanged without asking the adapter; a command's options are mostly
    left unset (38 adapters built for ``estimate --params 7.5e9 --gpus 64``, 11 coerce a value)."""

    __slots__ = ()

    def coerce(self, value: object, param: object, ctx: object) -> object:
        if value is None and not (param.multiple or param.nargs == -1):  # type: ignore[attr-defined]
            return None  # typer's RuntimeParam.coerce, before it asks the adapter
        from typer._coercion import build_runtime_param

        real = build_runtime_param(param.type_descriptor)  # type: ignore[attr-defined]
        param._runtime_param = real  # type: ignore[attr-defined]
        return real.coerce(value, param=param, ctx=ctx)


_COERCED_WHEN_GIVEN = _CoercedWhenGiven()  # stateless: the option is the call's ``param``


def coerce_when_given(command: object) -> None:
    """Each option of ``command`` (a typer command about to parse) coerced through ``_CoercedWhenGiven``; a typer
    whose parameters keep no ``_runtime_param`` (another version) is left as it is."""
    for param in getattr(command, "params", ()):
        if getattr(param, "_runtime_param", False) is None and hasattr(param, "type_descriptor"):
            param._runtime_param = _COERCED_WHEN_GIVEN
