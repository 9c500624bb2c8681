"""A term's tensors as the trace builder (``step_trace._Builder``) keys and sizes them: the name that makes
"... of N ..." one collection from moment to moment, its tensors' sizes, and the rounding of a size to the
allocation block (``Term.rounded``'s convention)."""

from __future__ import annotations

import re
from functools import lru_cache

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
