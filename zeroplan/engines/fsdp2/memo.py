"""Terms built once per FSDP2 run (a speed-up, no rule): the moments of a 126-block model ask the same
terms thousands of times, and ``leaders.phase_leaders`` rounds each distinct term object once."""

from __future__ import annotations

RANKED = ("adam", "run_states", "outside_backward")
"""The ``memo_term`` terms that depend on ``settings.rank`` (``Fsdp2Run.for_rank`` rebuilds them), and the moments
that hold them (``leaders.outside_backward``)."""


def memo_term(fn):
    """``fn(run, *args)`` built once per run and arguments (terms are frozen: sharing them changes nothing);
    a term that reads ``settings.rank`` is named in ``RANKED``."""
    name = fn.__name__

    def cached(run, *args, **kwargs):
        key = (name, *args, *sorted(kwargs.items())) if kwargs else (name, *args)
        try:
            out = run.memo.get(key)
        except TypeError:  # an unhashable argument (a list of units): built each time
            return fn(run, *args, **kwargs)
        if out is None:
            out = run.memo[key] = fn(run, *args, **kwargs)
        return out

    cached.__doc__, cached.__name__, cached.__wrapped__ = fn.__doc__, fn.__name__, fn
    return cached


def by_identity(fn):
    """``fn(obj, *rest)`` kept by the identity of ``obj`` and the value of ``rest`` (a speed-up, no rule): for a
    tuple a plan passes again as one object (a workload's shapes, a run's units: ``units._profile``), where hashing
    it would walk every element. Only tuples are kept (the plan's shapes and units are tuples of tuples and frozen
    objects: they cannot change; ``fn`` must read nothing else), each held beside its value so that its id stays
    its own; ``rest``: a few hashable arguments (a name prefix); a long-lived process keeps at most 64."""
    store: dict[tuple, tuple] = {}

    def cached(obj, *rest):
        key = (id(obj), *rest)
        got = store.get(key)
        if got is not None and got[0] is obj:
            return got[1]
        out = fn(obj, *rest)
        if type(obj) is tuple:
            if len(store) >= 64:
                store.clear()
            store[key] = (obj, out)
        return out

    cached.__doc__, cached.__name__, cached.__wrapped__ = fn.__doc__, fn.__name__, fn
    return cached
