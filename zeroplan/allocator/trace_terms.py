"""A term's tensors as the trace builder (``step_trace._Builder``) keys and sizes them: the name that makes
"... of N ..." one collection from moment to moment, its tensors' sizes, and the rounding of a size to the
allocation block (``Term.rounded``'s convention)."""

from __future__ import annotations

import re
from functools import lru_cache
from itertools import compress, count
from operator import is_not

from zeroplan.formulas.peak import Term

_COUNT = re.compile(r" of \d+ ")


class Rounded(dict):
    """{size: size rounded up to ``block`` bytes} (``Term.rounded``'s convention), each size worked out once: read
    in C (``map(rounded.__getitem__, sizes)``)."""

    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block

    def __missing__(self, size: int) -> int:
        out = self[size] = size if self.block <= 1 else -(-size // self.block) * self.block
        return out


def identity(name: str) -> str:
    """A term named "... of N ..." (``saved activations of 3 blocks``, ``sharded gradients of 2 unit(s)``) is a
    collection of N tensors: the same collection in the next moment, grown or shrunk by the difference (a name
    without " of " is its own: no pattern to run, no cache to fill; FSDP2's trace meets ~1,800 names, each new to
    its build)."""
    return _collection(name) if " of " in name else name


@lru_cache(maxsize=4096)  # a step names the same collections at every moment: each name is read once
def _collection(name: str) -> str:
    return _COUNT.sub(" of # ", name)


def default_stream(term: Term) -> int:
    """Every term on the default stream (0)."""
    return 0


def tensor_sizes(term: Term, block_bytes: int) -> list[tuple[int, int]]:
    """A term's tensors as (size, count): ``tensors`` equal ones of ``ceil(bytes / tensors)`` (rounded to
    ``block_bytes`` they sum to ``Term.rounded``); unrounded (``block_bytes`` 1) the remainder is spread so
    that they sum to ``bytes`` exactly."""
    if term.bytes <= 0:
        return []
    n = max(term.tensors, 1)
    if block_bytes > 1:
        return [(-(-term.bytes // n), n)]
    q, r = divmod(term.bytes, n)
    return [(size, count) for size, count in ((q + 1, r), (q, n - r)) if size and count]


def moved_terms(before: tuple[Term, ...], ids: set[int], terms: tuple[Term, ...]) -> tuple[list, list] | None:
    """The terms of ``before`` (no term twice; ``ids``: their ids) that ``terms`` lacks, and those of ``terms`` that
    ``before`` lacks, in order, by identity; None where ``terms`` holds a term twice; ``ids`` made ``terms``' ids.
    Two moments in a row share all but a few terms, most in the same places: only the terms between their
    common head and tail (found in C, by identity) may be gone or new, as no term of ``before`` is in two
    places; a new one must not be in the head or tail (a speed-up, no rule: rather than sets of every term's id;
    tests/test_step_trace.py compares it with the sets on random tuples and the traces on every engine)."""
    n = min(len(before), len(terms))
    head = next(compress(count(), map(is_not, before, terms)), n)  # in C: ~80 terms
    last, end, stop = len(before) - 1, len(terms) - 1, n - head
    tail = 0
    while tail < stop and before[last - tail] is terms[end - tail]:  # a few terms: no iterators to make
        tail += 1
    old, new = before[head:last + 1 - tail], terms[head:end + 1 - tail]
    old_ids, fresh = set(map(id, old)), set(map(id, new))
    if len(fresh) != len(new) or not ids.isdisjoint(fresh - old_ids):
        return None  # a term twice: among the new ones, or a new one also in the head or tail (in C)
    ids -= old_ids
    ids |= fresh
    return [t for t in old if id(t) not in fresh], [t for t in new if id(t) not in old_ids]
