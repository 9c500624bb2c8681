"""Every runner says what it changes in the engine it measures, in every report row (issue 16: synchronous
collectives, GC off, the fp16 capability answered on CPU): each runner's ``runner_changes``, checked without
starting a rank (the live rows are asserted in tests/test_deepspeed_async.py)."""

from __future__ import annotations


def test_the_reference_runtimes_rows_name_the_thread_and_the_settled_reading():
    from validate.report import RUNNER_CHANGES

    assert any("OMP_NUM_THREADS=1" in c for c in RUNNER_CHANGES)
    assert any("gloo has let go" in c for c in RUNNER_CHANGES)


def test_fsdp2_rows_name_the_synchronous_release_on_gloo_and_the_simulation():
    from validate.engines.fsdp2_compare import runner_changes

    gloo = runner_changes({"backend": "gloo"})
    assert any("gloo's worker thread has let its tensors go" in c for c in gloo)
    assert not any("gloo" in c and "let" in c for c in runner_changes({"backend": "nccl"}))
    assert any("FakeTensorMode" in c for c in runner_changes({"backend": "fake", "fake_tensors": True}))
    assert any("real tensors" in c for c in runner_changes({"backend": "fake"}))


def test_deepspeed_rows_name_synchronous_collectives_gc_off_and_the_fp16_answer():
    from validate.engines.deepspeed_changes import runner_changes

    row = {"gloo_settle": {}, "fp16_capability_overridden": True, "config": {"zero_optimization": {"stage": 2}}}
    changes = " | ".join(runner_changes(row))
    for said in ("collectives made synchronous", "GlooSettled", "cyclic garbage collector off",
                 "fp16 capability answered yes on CPU"):  # fmt: skip
        assert said in changes, said
    asynchronous = " | ".join(runner_changes({**row, "gloo_settle": None, "fp16_capability_overridden": False}))
    assert "collectives left asynchronous" in asynchronous and "(no GlooSettled)" in asynchronous
    assert "made synchronous" not in asynchronous and "fp16 capability" not in asynchronous
    quantized = {**row, "config": {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}}
    assert any("Python stand-in" in c for c in runner_changes(quantized))
