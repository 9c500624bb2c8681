"""Test-session settings shared by every test module.

``ZEROPLAN_TEST_HIDE=deepspeed[,other]`` makes those packages unimportable, in this process and in every
Python child it starts (torchrun ranks, ``python -c`` subprocesses), as if they were not installed. It is
how the optional-extra skips are checked on a machine that has the extras:

    ZEROPLAN_TEST_HIDE=deepspeed pytest -q tests/test_deepspeed_batch.py -p no:cacheprovider -rs

Each test that needs DeepSpeed must then skip with a reason (``pytest.importorskip("deepspeed",
reason=...)``), and every other test must still pass.
"""

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import pytest

# Plots are rendered without a display, in tests and in executed notebooks.
os.environ.setdefault("MPLBACKEND", "agg")

# DeepSpeed JIT-builds its ops (fused_adam, cpu_adam) into $TORCH_EXTENSIONS_DIR/<op>, by default
# ~/.cache/torch_extensions/py311_cpu (torch/utils/cpp_extension.py ``_get_build_directory``): one directory
# per Python version, shared by every environment of that version on the machine. Two environments (a venv
# and the interpreter CI installs into) write different absolute paths into the op's build.ninja, so ninja
# rebuilt what the other had built, ~200 CPU-s each time (found 2026-12-02: the build log alternated between
# two command hashes, one per environment). The test session keeps one directory per environment, named by
# its ``sys.prefix``; an explicit $TORCH_EXTENSIONS_DIR wins. The validator as users run it keeps torch's.
_ENVIRONMENT = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
_EXTENSIONS = Path.home() / ".cache" / "torch_extensions" / f"zeroplan-tests-{_ENVIRONMENT}"
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_EXTENSIONS))

HIDE_ENV = "ZEROPLAN_TEST_HIDE"

# The finder, as source: conftest installs it here, and a sitecustomize.py on PYTHONPATH installs it in
# children (Python imports sitecustomize at start-up, before any test code runs).
_HIDER = '''
import os
import sys


class _Hidden:
    """A meta-path finder that answers None for the packages named in $ZEROPLAN_TEST_HIDE, as if missing.

    Every finder is wrapped, so the whole lookup finds nothing: ``importlib.util.find_spec`` returns None
    and ``import`` raises ModuleNotFoundError, exactly as when the package is not installed."""

    names = frozenset(n.strip() for n in os.environ.get("ZEROPLAN_TEST_HIDE", "").split(",") if n.strip())

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            return None
        return self.inner.find_spec(fullname, path, target)

    def __getattr__(self, name):
        return getattr(self.inner, name)


if _Hidden.names:
    sys.meta_path[:] = [f if type(f).__name__ == "_Hidden" or not hasattr(f, "find_spec") else _Hidden(f)
                        for f in sys.meta_path]
'''


def _hide_packages() -> None:
    if not os.environ.get(HIDE_ENV, "").strip():
        return
    hidden = [n for n in sys.modules if n.split(".")[0] in os.environ[HIDE_ENV].split(",")]
    if hidden:
        raise RuntimeError(f"{HIDE_ENV}: already imported before conftest: {sorted(hidden)[:3]}")
    exec(compile(_HIDER, "<ZEROPLAN_TEST_HIDE>", "exec"), {"__name__": "zeroplan_test_hide"})
    site = Path(tempfile.mkdtemp(prefix="zeroplan-hide-"))
    (site / "sitecustomize.py").write_text(_HIDER)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


_hide_packages()


_JIT_BUILD = None
_JOBS = None
_WORLDS = None


def pytest_collection_modifyitems(session, config, items):
    """The modules that read a background job run last: the jobs run meanwhile (tests/background.py)."""
    from background import last_readers

    items[:] = last_readers(items)


def pytest_collection_finish(session):
    """DeepSpeed's JIT ops, then the session's background jobs, run from here on (tests/background.py)."""
    global _JIT_BUILD, _JOBS, _WORLDS
    from background import Jobs, session_jobs
    from deepspeed_world import SharedWorlds, start_jit_builds

    modules = list(dict.fromkeys(m for m in (getattr(item, "module", None) for item in session.items) if m))
    _JOBS = Jobs()
    _WORLDS = SharedWorlds(modules, _JOBS)
    if session.config.option.collectonly:
        return
    _JIT_BUILD = start_jit_builds(modules)
    _JOBS.start(session_jobs(modules, _WORLDS, _JOBS.dir))


def pytest_sessionfinish(session):
    from deepspeed_world import finish_jit_builds

    if _JOBS is not None:
        _JOBS.stop()
    finish_jit_builds(_JIT_BUILD)


def pytest_terminal_summary(terminalreporter):
    for line in _JOBS.summary() if _JOBS is not None else []:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def background():
    """The session's background jobs (tests/background.py ``Jobs``): ``background.result(key, job)``."""
    return _JOBS


@pytest.fixture(scope="session")
def deepspeed_world():
    """The session's shared DeepSpeed worlds, one per N_d, over the collected modules' cases, each a background
    job from collection on (tests/deepspeed_world.py)."""
    return _WORLDS
