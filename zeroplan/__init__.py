"""zeroplan: per-GPU memory and per-step communication of ZeRO / FSDP sharded data parallelism.

Glossary (symbols follow Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC20, arXiv:1910.02054):

- Ψ (``psi``): number of model parameters (elements), after dividing by model parallelism.
- K (``k``): bytes of optimizer state per parameter; 12 for mixed-precision Adam
  (fp32 master copy 4 + momentum 4 + variance 4).
- N_d (``nd``): data-parallel degree, the number of ranks a ZeRO stage shards over.
- N_m (``nm``): model-parallel degree (tensor/pipeline); the paper divides model states by N_m.
- rank: one process, one GPU. shard: the 1/N_d slice of a flat buffer a rank owns.
- bucket: a group of gradients reduced together during backward.
- Units: ``_numel`` counts elements, ``_bytes`` counts bytes; GB = 1e9 bytes (the paper's unit),
  GiB = 2**30 bytes.

Layout: ``formulas/`` pure math; ``architectures/`` model shapes; ``presets`` GPUs, links, models;
``policy`` dtypes and bytes per parameter; ``estimation/``, ``planning/``, ``sweeping/`` one command's
config, records and entry point each; ``engines/`` one module per training engine; ``render/`` text,
JSON and CSV views; ``cli`` the typer commands; ``plots`` matplotlib.

Stages: 0 = plain DP, 1 = P_os (optimizer states sharded), 2 = P_os+g (+ gradients),
3 = P_os+g+p (+ parameters).
"""

_HOMES: dict[str, str] = {
    "Collective": "zeroplan.formulas.collectives",
    "Estimate": "zeroplan.estimation.records",
    "EstimateConfig": "zeroplan.estimation.config",
    "MemoryBreakdown": "zeroplan.formulas.memory",
    "Plan": "zeroplan.planning.records",
    "PlanConfig": "zeroplan.planning.config",
    "PlanOption": "zeroplan.planning.records",
    "PrecisionPolicy": "zeroplan.policy",
    "StageEstimate": "zeroplan.estimation.records",
    "SweepConfig": "zeroplan.sweeping.config",
    "estimate": "zeroplan.estimation.estimate",
    "plan": "zeroplan.planning.plan",
    "sweep": "zeroplan.sweeping.grid",
}
"""Each public name and the module it lives in, imported on first use: ``zeroplan estimate`` never builds
the plan's or the sweep's pydantic models, and never loads pandas (``sweep``)."""

__all__ = [
    "Collective",
    "Estimate",
    "EstimateConfig",
    "MemoryBreakdown",
    "Plan",
    "PlanConfig",
    "PlanOption",
    "PrecisionPolicy",
    "StageEstimate",
    "SweepConfig",
    "estimate",
    "plan",
    "sweep",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """A public name (``_HOMES``), imported from its module the first time it is asked for."""
    if name not in _HOMES:
        raise AttributeError(f"module 'zeroplan' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
