"""What a fresh ``zeroplan`` process skips at start-up (docs/benchmarks.md, "Start-up, third pass"): pydantic's
plugin search when plugins are off. Kept out of ``cli`` so that the command module stays a list of commands."""

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
