"""The DeepSpeed plan's speed-ups that are not closed forms (issue 16) keep what they replaced: a term's CUDA blocks
computed at construction (``peak.Term``, ``rounded_total``), the frozen records built through ``__dict__`` (``Term``,
``Moment``, ``TraceEvent``, ``Stage3Gather``), a workload hashed once per object (``Workload.__hash__``), a bucket's
flattened copy found without listing its slices (``flat_copy.copy_numel``). The moments the ZeRO-1/2 and ZeRO-3 fast
paths pick are checked against the loops they replaced in test_deepspeed_winners.py."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest

from zeroplan.architectures.spec import transformer_shapes
from zeroplan.engines.base import Workload
from zeroplan.engines.deepspeed.coordinator import Stage3Gather
from zeroplan.engines.deepspeed.flat_copy import copy_numel, range_copy_numel
from zeroplan.engines.deepspeed.profile import run_moments
from zeroplan.engines.deepspeed.run import _layout, _trace
from zeroplan.engines.deepspeed.settings import Settings
from zeroplan.engines.deepspeed.terms import FlatGroup
from zeroplan.engines.deepspeed.trace import TraceEvent
from zeroplan.formulas.peak import CUDA_BLOCK_BYTES, Moment, Term, rounded_total
from zeroplan.presets import resolve_model


def test_cuda_blocks_of_a_term_equal_each_tensor_rounded():
    """``rounded_total`` at 512 B reads each term's blocks made at construction: n tensors of ceil(b / n) bytes,
    each rounded up to 512 B, on random terms (zero bytes and tensors, sizes around the block included)."""
    rng = random.Random(16)
    for _ in range(2000):
        tensors = rng.choice((0, 1, 1, 2, 3, 7, 64))
        nbytes = 0 if tensors == 0 else rng.choice((0, 1, 511, 512, 513, rng.randrange(10**12)))
        t = Term("t", nbytes, "test", tensors)
        each = -(-nbytes // tensors) if tensors else 0
        assert rounded_total((t,), CUDA_BLOCK_BYTES) == tensors * -(-each // 512) * 512
        assert t.rounded(CUDA_BLOCK_BYTES) == rounded_total((t,), CUDA_BLOCK_BYTES)
    terms = [Term("t", rng.randrange(10**9), "test", rng.randrange(1, 9)) for _ in range(300)]
    assert rounded_total(terms, 512) == sum(rounded_total((t,), 512) for t in terms)
    assert rounded_total(terms, 1024) == sum(t.tensors * -(-(-(-t.bytes // t.tensors)) // 1024) * 1024 for t in terms)


@pytest.mark.parametrize("record", [Term("a", 3, "s", 2), Moment("forward", "m", (Term("a", 3, "s"),)),
                                    TraceEvent("fetch", 4, False, True), Stage3Gather((1, 2), 3, 40, -1)])
def test_records_built_through_their_dict_are_the_dataclasses(record):
    """Equal and hashed by their fields, frozen, ``replace``d, ``asdict``ed and pickled as the dataclass's own
    ``__init__`` made them (keywords and defaults alike)."""
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    again = type(record)(**fields)
    assert again == record and hash(again) == hash(record) and dataclasses.asdict(again) == dataclasses.asdict(record)
    assert pickle.loads(pickle.dumps(record)) == record
    assert repr(record) == f"{type(record).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"
    first = dataclasses.fields(record)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, first, None)
    assert dataclasses.replace(record, **{first: fields[first]}) == record
    assert Term("a", 3, "s") == Term("a", 3, "s", 1) and TraceEvent("fetch", 1, True) == TraceEvent("fetch", 1, True, None)


def test_a_workload_is_keyed_by_value_and_hashed_once_per_object():
    """Two equal workloads (distinct objects) share the caches keyed by the workload: the same layout, trace and
    moments objects; a different workload does not. Its hash is the dataclass's rule (the fields' tuple), made
    once per object and left out of a pickle (a string's hash is per process); equality, ``repr`` and
    ``asdict`` see only the fields."""
    spec = resolve_model("gpt2-xl")
    w1, w2 = (Workload(transformer_shapes(spec), spec, 256, 1) for _ in range(2))
    assert w1 is not w2 and w1 == w2
    fields = tuple(getattr(w1, f.name) for f in dataclasses.fields(w1))
    assert hash(w1) == hash(fields) == hash(w2) and w1.__dict__["_hash"] == hash(fields)
    again = pickle.loads(pickle.dumps(w1))
    assert again == w1 and "_hash" not in again.__dict__ and hash(again) == hash(w1)
    assert "_hash" not in repr(w1) and list(dataclasses.asdict(w1)) == [f.name for f in dataclasses.fields(w1)]
    assert _layout(w1) is _layout(w2) and _trace(w1) is _trace(w2)
    s = Settings(stage=2)
    assert run_moments(s, w1, 8, None) is run_moments(s, w2, 8, None)
    other = dataclasses.replace(w1, seq_len=512)
    assert "_hash" not in other.__dict__ and hash(other) != hash(w1) and other != w1
    assert run_moments(s, other, 8, None) != run_moments(s, w1, 8, None)


def _listed_copy_numel(flat: FlatGroup, limit: int, params) -> int:
    """``copy_numel`` as it was (5bf0371): the bucket's slices listed, then grouped."""
    offsets, part = flat.offsets, flat.part
    slices: list[list[int]] = []  # [partition, elements], in the bucket's order
    for i in params:
        lo, hi = offsets[i], offsets[i + 1]
        while lo < hi:
            r = lo // part
            cut = min(hi, (r + 1) * part)
            if slices and slices[-1][0] == r:
                slices[-1][1] += cut - lo
            else:
                slices.append([r, cut - lo])
            lo = cut
    copy, count, numel = 0, 0, 0
    for _, n in slices:
        count, numel = count + 1, numel + n
        if numel > limit:
            copy, count, numel = max(copy, numel if count > 1 else 0), 0, 0
    return max(copy, numel if count > 1 else 0)


def test_a_bucket_copy_streamed_equals_the_listed_slices():
    """``copy_numel`` feeds the slices into the groups as it cuts them; on random flat groups (zero-size parameters,
    one to 300 partitions, a parameter over many, boundaries on and off a parameter's edge), limits and buckets
    (ranges, gradient-ready tuples in any order, one parameter, none) it equals the walk that listed them, 0 and not."""
    rng = random.Random(16)
    zero = copied = 0
    for _ in range(1500):
        numels = [rng.choice((0, 1, 2, 7, 64, 1000, rng.randrange(1, 5000))) for _ in range(rng.randrange(1, 40))]
        flat = FlatGroup(tuple(numels), rng.choice((1, 2, 3, 4, 8, 64, 300)))
        first = rng.randrange(len(numels))
        end = rng.randrange(first + 1, len(numels) + 1)
        limit = rng.choice((1, 10, 500, 10**4, 10**9, rng.randrange(1, 3000)))
        for params in (range(first, end), tuple(rng.sample(range(first, end), end - first)), [first], []):
            want = _listed_copy_numel(flat, limit, params)
            assert copy_numel(flat, limit, params) == want, (numels, flat.part, limit, params)
            if isinstance(params, range):  # consecutive parameters: the bucket's pieces of each partition
                got = range_copy_numel(flat.part, limit, flat.offsets[first], flat.offsets[end])
                assert got == want, (numels, flat.part, limit, params)
            zero, copied = zero + (want == 0), copied + (want > 0)
    assert zero > 1500 and copied > 1000  # both outcomes drawn often
