"""``offload_walk.walk_peaks`` (every rank at once) equals ZeRO-1's walk after backward under ``cpu_offload`` replayed
rank by rank (the walk as ``moe_offload`` first wrote it, kept here as the reference; stage_1_and_2.py
``reduce_gradients`` -> ``reduce_independent_p_g_buckets_and_remove_grads``), on random layouts: small and
larger-than-bucket gradients, zero-size parameters, padding after Ψ, partitions inside one parameter."""

import random

import pytest

from zeroplan.engines.deepspeed.offload_walk import walk_peaks


def _plain_walk(numels, offsets, part, bucket, g, rank):
    """One rank's walk, parameter by parameter: the reference."""
    def sliced(i):
        return max(0, min(offsets[i + 1], (rank + 1) * part) - max(offsets[i], rank * part))

    remaining, kept, best = sum(numels), 0, (0, 0, -1, 0)
    pending = []

    def take(m):
        nonlocal best
        if m[0] * g + 8 * m[1] > best[0] * g + 8 * best[1]:
            best = m

    def flush():
        nonlocal kept
        clone = sum(numels[q] for q in pending if numels[q] > bucket)
        for q in pending:
            if sliced(q):
                take((remaining + clone + kept, sliced(q), q, 0))
                if numels[q] > bucket:
                    clone -= numels[q]
            elif numels[q] > bucket:
                kept += numels[q]
                clone -= numels[q]
        pending.clear()

    elements = 0
    for k, n in enumerate(numels):
        if n == 0:
            continue
        if elements + n > bucket:
            flush()
            elements = 0
        remaining -= n
        if n > bucket:
            take((remaining + 2 * n + kept, 0, k, 1))
        pending.append(k)
        elements += n
    flush()
    return best


def _layout(rng):
    numels = [rng.choice([0, rng.randint(1, 40), rng.randint(1, 400), rng.randint(100, 3000)])
              for _ in range(rng.randint(1, 40))]
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    nd = rng.randint(1, 12)
    part = max(1, -(-offsets[-1] // nd) + rng.choice([0, 0, rng.randint(0, 50)]))  # padding after Ψ sometimes
    return numels, offsets, part, nd, rng.randint(1, 1500), rng.choice([2, 4])


@pytest.mark.parametrize("seed", range(4))
def test_every_rank_at_once_equals_the_walk_rank_by_rank(seed):
    rng = random.Random(seed)
    compared = clones = 0
    for _ in range(400):
        numels, offsets, part, nd, bucket, g = _layout(rng)
        got = walk_peaks(numels, offsets, part, bucket, g, range(nd))
        for rank in range(nd):
            want = _plain_walk(numels, offsets, part, bucket, g, rank)
            assert got[rank] == want, (numels, part, bucket, g, rank)
            compared += 1
            clones += want[3]
    assert compared > 1500 and clones > 100  # the draws reach both kinds of moment


def test_equal_clone_moments_after_a_partition_name_the_first():
    """Two larger-than-bucket gradients of one size in a row make equal clone moments (the first's alive = the second's:
    remaining + 2n + kept); the walk keeps the first (strictly larger replaces), and so must the suffix maximum."""
    numels, offsets = [10, 500, 500], [0, 10, 510, 1010]
    want = _plain_walk(numels, offsets, 10, 100, 4, 0)
    assert want == (1500, 0, 1, 1)
    assert walk_peaks(numels, offsets, 10, 100, 4, [0])[0] == want


@pytest.mark.parametrize("model, bucket, nd, device", [("tiny-llama", 5_000, 7, "cuda"), ("tiny-llama", 2_000, 16, "cpu"),
                                                       ("tiny-gpt2-untied", 3_000, 5, "cuda")])
def test_every_rank_walk_lists_the_first_largest_rank_only(model, bucket, nd, device, monkeypatch):
    """Every rank described, ``stage1_offload_walk`` lists one rank's moment (``DSRun.first_largest`` of its terms
    rounded to the peak's block): the backward peak (its bytes, moment and terms) equals the one with every rank's
    moment listed (as before), and the moment listed is the family's first largest by ``peak_of``'s sums. (Every
    family listed whole, the optimizer step's peak can name a tied moment of another family: not this one's.)"""
    import json
    from pathlib import Path

    from zeroplan.architectures.hf_config import spec_from_hf_config
    from zeroplan.architectures.spec import transformer_shapes
    from zeroplan.engines.base import Workload
    from zeroplan.engines.deepspeed.offload_settings import OffloadTarget
    from zeroplan.engines.deepspeed.offload_walk import WALK
    from zeroplan.engines.deepspeed.phases import moments
    from zeroplan.engines.deepspeed.run import DSRun
    from zeroplan.engines.deepspeed.settings import Settings
    from zeroplan.engines.deepspeed.wrapper import ds_run
    from zeroplan.formulas.peak import peak_of

    config = Path(__file__).parent / "data" / "hf_configs" / f"{model}.json"
    spec = spec_from_hf_config(json.loads(config.read_text()))
    workload = Workload(transformer_shapes(spec), spec, 4, 2, transformers=True)
    settings = Settings(stage=1, reduce_bucket_size=bucket, allgather_bucket_size=bucket, device=device,
                        offload_optimizer=OffloadTarget(device="cpu"))
    block = settings.block_bytes
    got = moments(ds_run(settings, workload, nd))
    assert sum(m.name.startswith(WALK) for m in got) == 1
    monkeypatch.setattr(DSRun, "first_largest", lambda self, extra, ranks=None: tuple(self.ranks if ranks is None else ranks))
    want = moments(ds_run(settings, workload, nd))
    assert sum(m.name.startswith(WALK) for m in want) > 1, "one rank walks: nothing to choose"
    backward = [p for p in peak_of(got, block).phases if p.phase == "backward"]
    assert backward == [p for p in peak_of(want, block).phases if p.phase == "backward"]
    walk = [m for m in want if m.name.startswith(WALK)]
    first = max(walk, key=lambda m: m.total(block))  # the family's first largest, by peak_of's sums
    assert [m for m in got if m.name.startswith(WALK)] == [first]
