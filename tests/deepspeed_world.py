"""One torchrun world of real DeepSpeed ranks per N_d, shared by every DeepSpeed test module of a session.

A world pays its setup once (torchrun, torch and DeepSpeed imported on every rank, gloo, the JIT ops
loaded: ~30 s on two shared cores) and then ~2 s per ds_config; five modules used to start five worlds
at N_d = 2 (issue 16: the suite's time budget). A module declares its cases as ``DEEPSPEED_WORLD``, a dict
``{nd: function returning [(ds_config, run), ...]}`` (``run``: the runner's per-config overrides, ``model``,
``checkpointing``, ``zero_init``, ``hf``, ``settle``: ``validate.engines.deepspeed_compare.run_world``), and
reads its rows with ``deepspeed_world.ranks(module, nd)`` (the ``deepspeed_world`` fixture, conftest.py):
``ranks[rank][case]``, in its own order, as ``run_world`` returned them to it before.

On first use the world of that N_d runs the cases of every *collected* module that declares it (a module
run alone starts only its own), identical cases once (the same ds_config and run, defaults spelled out), all
for ``STEPS`` steps: three, the most any module needs (ZeRO-3's steady-state collectives are the third
step's; a two-step module reads its second step and the step boundaries it read before, which a third step
adds to but does not change). A failed world fails every module that reads it, once: the error is kept.
Each world is one of the session's background jobs (tests/background.py): started at collection, niced,
while the other tests run; the modules that read it run last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

STEPS = 3
RUN_DEFAULTS = {"model": "gpt-tiny", "checkpointing": "none", "zero_init": False, "hf": False, "settle": True}


def _key(config: dict, run: dict) -> str:
    return json.dumps([config, {**RUN_DEFAULTS, **run}], sort_keys=True)


class SharedWorlds:
    """The session's worlds, one per N_d, each a background job (tests/background.py) or run when first read."""

    def __init__(self, modules, jobs=None):
        self._modules = modules  # the collected test modules, in collection order
        self.jobs = jobs  # the session's background jobs (tests/background.py Jobs), set once they start
        self._worlds: dict[int, tuple[dict[str, int], list[list[dict]]] | BaseException] = {}

    def _cases(self, nd: int) -> tuple[dict[str, int], list[dict], list[dict]]:
        index: dict[str, int] = {}
        configs, runs = [], []
        for module in self._modules:
            for config, run in getattr(module, "DEEPSPEED_WORLD", {}).get(nd, list)():
                if index.setdefault(_key(config, run), len(configs)) == len(configs):
                    configs.append(config)
                    runs.append({**RUN_DEFAULTS, **run})
        return index, configs, runs

    def job(self, nd: int) -> tuple[str, dict]:
        """The world of ``nd`` as a job: its key and ``validate.engines.deepspeed.run_world``'s arguments."""
        _, configs, runs = self._cases(nd)
        kwargs = {"configs": configs, "nd": nd, "steps": STEPS, "runs": runs, "timeout_s": 3600}
        return f"deepspeed-world-nd{nd}", {"fn": "validate.engines.deepspeed:run_world", "kwargs": kwargs}

    def ranks(self, module, nd: int) -> list[list[dict]]:
        """``ranks[rank][i]``: what every rank measured for ``module``'s i-th case at ``nd``."""
        if nd not in self._worlds:
            self._worlds[nd] = self._run(nd)
        world = self._worlds[nd]
        if isinstance(world, BaseException):
            raise world
        index, ranks = world
        wanted = [index[_key(c, r)] for c, r in module.DEEPSPEED_WORLD[nd]()]
        return [[rank[i] for i in wanted] for rank in ranks]

    def _run(self, nd: int):
        from background import call

        index = self._cases(nd)[0]
        try:
            return index, (self.jobs.result(*self.job(nd)) if self.jobs is not None else call(self.job(nd)[1]))
        except Exception as e:  # every module reading this world fails with it; none starts it again
            return e


# DeepSpeed JIT-builds a C++ op the first time a config needs it, into ~/.cache/torch_extensions: the default
# Adam on the CPU accelerator is FusedAdam (runtime/engine.py get_optimizer_configuration: no torch_adam, no
# CPU offload), whose ``fused_adam`` op (csrc/cpu/adam/fused_adam.cpp + cpu_adam_impl.cpp, -O3 -g) took
# 181 CPU-s to build on a clean cache (2026-12-01, 2 shared cores). A module whose cases need one names its
# builder in ``DEEPSPEED_JIT_OPS``; the session starts building those at collection, at the lowest CPU
# priority, so that the build runs on the core the single-process tests leave idle before the first world
# asks for it (a rank that needs the op waits on torch's build lock, then loads it). Cached: ~3 s, no build.
_BUILD = """
import os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.accelerator import get_accelerator
for name in sys.argv[1:]:
    get_accelerator().create_op_builder(name).load()
"""


def start_jit_builds(modules) -> subprocess.Popen | None:
    """Start building the ops the ``modules`` declare (``DEEPSPEED_JIT_OPS``), niced, in one child, or None."""
    ops = sorted({op for m in modules for op in getattr(m, "DEEPSPEED_JIT_OPS", ())})
    if not ops:
        return None
    return subprocess.Popen([sys.executable, "-c", _BUILD, *ops], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19))  # fmt: skip


def finish_jit_builds(build: subprocess.Popen | None, timeout_s: float = 900.0) -> None:
    """Wait for the build: killed halfway, it would leave torch's lock file for the next load to wait on."""
    if build is not None:
        try:
            build.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass  # left to finish on its own; the lock it holds is released when it does
