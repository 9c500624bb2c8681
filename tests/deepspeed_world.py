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
"""

from __future__ import annotations

import json

STEPS = 3
RUN_DEFAULTS = {"model": "gpt-tiny", "checkpointing": "none", "zero_init": False, "hf": False, "settle": True}


def _key(config: dict, run: dict) -> str:
    return json.dumps([config, {**RUN_DEFAULTS, **run}], sort_keys=True)


class SharedWorlds:
    """The session's worlds, run lazily, one per N_d (see the module docstring)."""

    def __init__(self, modules):
        self._modules = modules  # the collected test modules, in collection order
        self._worlds: dict[int, tuple[dict[str, int], list[list[dict]]] | BaseException] = {}

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
        from validate.engines.deepspeed import run_world

        index: dict[str, int] = {}
        configs, runs = [], []
        for module in self._modules:
            for config, run in getattr(module, "DEEPSPEED_WORLD", {}).get(nd, list)():
                if index.setdefault(_key(config, run), len(configs)) == len(configs):
                    configs.append(config)
                    runs.append({**RUN_DEFAULTS, **run})
        try:
            return index, run_world(configs, nd, steps=STEPS, runs=runs, timeout_s=3600)
        except Exception as e:  # every module reading this world fails with it; none starts it again
            return e
