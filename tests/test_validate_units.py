"""In-process checks of the validator's parts: model shapes, flat layout, probes, verdicts. No processes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from validate.flat import FlatLayout
from validate.models import PRESETS, build, expected_shapes, spec_for
from validate.probes import CommCounter, MemoryProbe
from zeroplan.architectures.spec import gpt_for_params, numels
from zeroplan.formulas.sharding import flat_padded_numel, flat_shard_numel


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_models_build_exactly_the_planners_shapes(name):
    spec = PRESETS[name]
    model = build(spec, torch.bfloat16, "meta")
    assert tuple((n, tuple(p.shape)) for n, p in model.named_parameters()) == expected_shapes(spec)


def test_gpt_for_params_builds_the_papers_7_5b_model_shape():
    # ZeRO paper section 10.1 trains a 7.5B model; gpt_for_params(7.5e9) lands within 1% of that size.
    spec = gpt_for_params(7.5e9)
    model = build(spec, torch.bfloat16, "meta")
    psi = sum(p.numel() for p in model.parameters())
    assert psi == sum(numels(expected_shapes(spec)))
    assert psi == pytest.approx(7.5e9, rel=0.01)


def test_gpt_1b_wide_preset_has_over_a_billion_parameters():
    # V*d + T*d + L*(12 d^2 + 13 d) + 2 d with V = 50304, T = 128, L = 2, d = 6144 (GPT-2 layout).
    d = 6144
    assert (
        sum(numels(expected_shapes(spec_for("gpt-1b-wide", None))))
        == 50304 * d + 128 * d + 2 * (12 * d * d + 13 * d) + 2 * d
        == 1_215_995_904
    )


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=12),
    nd=st.integers(1, 9),
    cut=st.integers(0, 12),
)
def test_unit_shards_add_up_to_the_planners_shard(sizes, nd, cut):
    # Whatever the grouping into units, per-unit padding gives the planner's per-rank and full sizes.
    units = [sizes[:cut], sizes[cut:]] if 0 < cut < len(sizes) else [sizes]
    layouts = [FlatLayout(tuple((n,) for n in u), nd, nd) for u in units]
    assert sum(lay.shard_numel for lay in layouts) == flat_shard_numel(sizes, nd)
    assert sum(lay.full_numel for lay in layouts) == flat_padded_numel(sizes, nd)
    for lay in layouts:
        assert lay.full_numel == nd * lay.shard_numel
        assert all(o % nd == 0 for o in lay.offsets)  # every tensor starts on a multiple of N_d


def test_flat_pack_puts_tensors_at_their_offsets_and_zeroes_padding():
    lay = FlatLayout(((2, 3), (5,)), nd=4, align=4)  # 6 -> 8, 5 -> 8
    a, b = torch.arange(6.0).view(2, 3), torch.full((5,), 9.0)
    flat = lay.pack([a, b], torch.full((lay.full_numel,), -1.0))
    assert lay.offsets == (0, 8) and lay.full_numel == 16 and lay.shard_numel == 4
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 0] + [9] * 5 + [0, 0, 0]
    assert lay.owned(flat, 3).tolist() == [9, 0, 0, 0]


def test_memory_probe_counts_every_live_byte_and_phase_peaks():
    with MemoryProbe(torch.device("cpu")) as probe:
        keep = torch.empty(1000, dtype=torch.bfloat16)  # 2000 bytes
        probe.phase("forward")
        tmp = torch.empty(250, dtype=torch.float32)  # +1000 bytes, freed before the phase ends
        del tmp
        probe.phase("backward")
        probe.phase(None)
        assert probe.current_bytes() == 2000
        assert probe.peaks == {"forward": 3000, "backward": 2000}
        del keep
        assert probe.current_bytes() == 0


def test_comm_counter_records_each_call_and_the_report_derives_ring_bytes():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from validate.report import observed_collectives

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with warnings.catch_warnings(), CommCounter() as counter:
            warnings.simplefilter("ignore")
            full, shard = torch.empty(10, dtype=torch.bfloat16), torch.empty(3, dtype=torch.bfloat16)
            dist.all_reduce(full)
            dist.reduce_scatter_tensor(
                torch.empty(2, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
            )
            dist.all_gather_into_tensor(torch.empty(12, dtype=torch.bfloat16), shard)
    finally:
        dist.destroy_process_group()
    # observed per call: collective, full size in elements, dtype (no bytes are measured here)
    got = [(c.op, c.elements, c.dtype) for c in counter.calls]
    assert got == [("all-reduce", 10, "bfloat16"), ("reduce-scatter", 8, "bfloat16"), ("all-gather", 12, "bfloat16")]
    # derived: ring (nd-1) * ceil(n/nd) * 2 bytes, x2 for all-reduce: 2*3*3*2, 3*2*2, 3*3*2
    calls = [[c.op, c.phase, c.dtype, c.elements] for c in counter.calls]
    derived = {k: (v["elements"], v["derived_bytes_per_rank"]) for k, v in observed_collectives(calls, 4).items()}
    assert derived == {"all-reduce|setup|bf16": (10, 36), "reduce-scatter|setup|bf16": (8, 12),
                       "all-gather|setup|bf16": (12, 18)}  # fmt: skip


# gpt-tiny (CausalLM, GPT-2 config), stage 0, real gloo N_d = 2, b = 2, s = 16, per-tensor Adam: the peaks
# the probe measured per phase (zeroplan validate --world-size 2 --stage 0 --steps 2)
MEASURED_PEAKS = {"init": 363240, "forward": 687436, "backward": 700364, "optimizer step": 1017588}


def _rank_row(stage, boundary, calls, parity_ok=True, peak_extra=0):
    from validate.models import PRESETS, build
    from zeroplan.architectures.module_shapes import module_shapes

    shapes = [[n, list(s)] for n, s in module_shapes(build(PRESETS["gpt-tiny"], torch.bfloat16, "meta"))]
    return {
        "stage": stage, "rank": 0, "param_shapes": shapes, "boundary_bytes": boundary, "probe_breakdown": {}, "foreach": False,
        "peak_bytes_by_phase": {**MEASURED_PEAKS, "backward": MEASURED_PEAKS["backward"] + peak_extra},
        "calls_by_step": [[], *calls], "adam_step_bytes": 4, "seconds": 0.0,
        "step_time_s": {"probed": 0.2, "unprobed": 0.1, "unprobed_steps": 2},
        "parity": {"ok": parity_ok, "param_mean_abs_diff": 0.0},
    }  # fmt: skip


@pytest.mark.parametrize(
    "boundary_extra, rs_elements, parity_ok, failing",
    [
        (4, None, True, []),
        (4, None, "peak", ["peak_within_tolerance"]),  # backward 3% above the prediction
        (int(0.02 * 581184), None, True, ["model_states_within_tolerance"]),  # 2% over: out of 1%
        (-int(0.02 * 581184), None, True, ["model_states_within_tolerance"]),  # 2% under: out too
        (4, 1, True, ["collectives_match"]),  # one element too many
        (4, None, False, ["parity"]),
    ],
)
def test_compare_fails_rows_that_disagree(boundary_extra, rs_elements, parity_ok, failing):
    from validate.config import ValidateConfig
    from validate.report import compare

    # gpt-tiny: Ψ = 36,324; stage 0 at N_d = 2 keeps 16 B/param = 581,184 B, all-reduces 36,324 elements.
    config = ValidateConfig(model="gpt-tiny")
    elements = 36324 + (rs_elements or 0)
    calls = [[["all-reduce", "backward", "bfloat16", elements - 100], ["all-reduce", "backward", "bfloat16", 100]]]
    row = compare(config, {"world_size": 2, "backend": "gloo", "device": "cpu"}, 0,
                  [_rank_row(0, [581184 + boundary_extra] * 2, calls * 2, parity_ok is not False,
                             int(0.03 * 700364) if parity_ok == "peak" else 0)])  # fmt: skip
    assert row["predicted_model_states_bytes"] == 581184
    assert [k for k, v in row["checks"].items() if v is False] == failing
    assert row["ok"] is (not failing)
    assert row["predicted_peak_bytes_by_phase"] == {k.replace(" ", "_"): v for k, v in MEASURED_PEAKS.items()}


def _all_reduce_instead_of_reduce_scatter(out, full, nd, micro_steps=1):
    import torch.distributed as dist

    full.div_(nd * micro_steps)
    dist.all_reduce(full)
    out.copy_(full[: out.numel()])


def _extra_all_gather(original):
    def publish(self):
        original(self)
        from validate.collectives import all_gather

        all_gather(self.unit_params[0], self.layouts[0].owned(self.unit_params[0], self.rank), self.nd)

    return publish


@pytest.fixture
def fake_world_2():
    import torch.distributed as dist

    from validate.simulate import init_fake_world

    init_fake_world(2, 0)
    yield
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass")  # MemTracker, benign
@pytest.mark.parametrize("stage, break_it", [
    (1, None),
    (1, "all-reduce instead of reduce-scatter"),
    (2, "an extra all-gather"),
    (0, "one element short"),
])  # fmt: skip
def test_a_runtime_issuing_other_collectives_than_predicted_fails(fake_world_2, monkeypatch, stage, break_it):
    # Real tensors on a fake group of 2: every collective is issued with its real sizes (values unused).
    import validate.stage0
    import validate.stage1
    from validate.config import ValidateConfig
    from validate.report import compare
    from validate.stage1 import Stage1
    from validate.worker import measure_stage

    if break_it == "all-reduce instead of reduce-scatter":
        monkeypatch.setattr(validate.stage1, "reduce_scatter_mean", _all_reduce_instead_of_reduce_scatter)
    if break_it == "an extra all-gather":
        monkeypatch.setattr(Stage1, "publish", _extra_all_gather(Stage1.publish))
    if break_it == "one element short":
        original = validate.stage0.all_reduce_mean
        monkeypatch.setattr(validate.stage0, "all_reduce_mean", lambda t, nd, g=1: original(t[:-1], nd, g))
    config = ValidateConfig(model="mlp-tiny", world_sizes=(2,), steps=2, simulated=True, fake_tensors=False)
    rank_row = measure_stage(config, stage, 2, 0, torch.device("cpu"), False)
    row = compare(config, {"world_size": 2, "backend": "fake", "device": "cpu"}, stage, [rank_row])
    assert row["checks"]["collectives_match"] is (break_it is None)
    assert row["ok"] is (break_it is None)
    if break_it == "all-reduce instead of reduce-scatter":
        assert "all-reduce|backward|bf16" in row["measured_collectives"]


@pytest.fixture
def gloo_world_1(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:Expected a tensor or a traceable wrapper-subclass")  # MemTracker, benign
@pytest.mark.parametrize(
    "stage, break_it, failing_check",
    [
        (3, None, None),
        (3, "skip_update", "param"),  # the 16-bit parameters never see the optimizer's update
        (2, "double_grad", "grad"),  # reduced gradients off by 2x, as if not divided by N_d
    ],
)
def test_parity_check_catches_a_broken_runtime(gloo_world_1, monkeypatch, stage, break_it, failing_check):
    from validate.config import ValidateConfig
    from validate.stage2 import Stage2
    from validate.stage3 import Stage3
    from validate.worker import measure_stage

    if break_it == "skip_update":
        monkeypatch.setattr(Stage3, "publish", lambda self: None)
    if break_it == "double_grad":
        original = Stage2.reduced_grad
        monkeypatch.setattr(Stage2, "reduced_grad", lambda self, u: original(self, u) * 2)
    config = ValidateConfig(model="mlp-tiny", world_sizes=(1,), steps=3)
    parity = measure_stage(config, stage, 1, 0, torch.device("cpu"), False)["parity"]
    assert parity["ok"] is (failing_check is None)
    if failing_check == "grad":
        assert parity["grad_rel_diff"] > parity["grad_rtol"]
    if failing_check == "param":
        assert parity["params16_equal_rounded_master"] is False


def test_the_report_schema_imports_no_torch_and_reads_schema_1_rows():
    import subprocess
    import sys

    code = ("import sys, zeroplan.plots, validate.schema; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.stdout.strip() == "ok", proc.stderr
    from validate.schema import RENAMED_FROM_V1, ValidationRow

    v1 = {"stage": 1, "world_size": 2, "mode": "real", "backend": "gloo", "predicted_model_states_bytes": 10,
          "measured_model_states_bytes": 14, "predicted_comm_bytes_per_rank": 8,
          "measured_comm_bytes_per_rank": 8, "ok": True}  # fmt: skip
    assert ValidationRow.model_validate(v1).derived_comm_bytes_per_rank == 8
    assert RENAMED_FROM_V1["measured_comm_bytes_per_rank"] == "derived_comm_bytes_per_rank"


def test_parity_allowances_follow_dtype_ranks_and_steps():
    from validate.tolerances import PATH_FACTOR, gamma, parity_tolerance

    bf16_3, bf16_63 = parity_tolerance("bf16", 2, 3, 1e-3), parity_tolerance("bf16", 2, 63, 1e-3)
    # gradients: gamma_{N_d+2} sqrt(N_d) C_path, with bf16's unit roundoff 2^-8; independent of steps
    assert bf16_3.u == 2**-8 and bf16_3.grad_rtol == bf16_63.grad_rtol
    assert bf16_3.grad_rtol == pytest.approx(4 * 2**-8 / (1 - 4 * 2**-8) * math.sqrt(2) * PATH_FACTOR)
    assert gamma(4, 2**-8) == pytest.approx(4 / 252)  # 4u / (1 - 4u), u = 1/256
    # parameters grow linearly with the step count (the fixed 1e-4 failed at 63 steps: 1.08e-4 measured)
    assert bf16_63.param_mean_atol == pytest.approx(21 * bf16_3.param_mean_atol)
    assert bf16_63.param_mean_atol > 1.08e-4 * 10
    # Adam's per-step bound (Kingma & Ba 2015, 2.1): (1 - 0.9) / sqrt(1 - 0.999) = 3.16
    assert bf16_63.param_max_atol == pytest.approx(2 * 3.1623 * 1e-3 * 63, rel=1e-4)
    # more ranks, more roundings; fp16 rounds 8x finer than bf16
    assert parity_tolerance("bf16", 4, 3, 1e-3).grad_rtol > bf16_3.grad_rtol
    assert parity_tolerance("fp16", 2, 3, 1e-3).grad_rtol == pytest.approx(bf16_3.grad_rtol / 8, rel=0.02)


def test_the_peak_is_predicted_for_the_default_model():
    # a run without --model (ValidateConfig.model None: gpt-tiny) once crashed in the report
    from validate.config import ValidateConfig
    from validate.report import predicted_peak

    est = predicted_peak(ValidateConfig(), {"world_size": 2, "device": "cpu"}, 0, False)
    assert est.by_phase() == {k.replace(" ", "_"): v for k, v in MEASURED_PEAKS.items()}


def _toy_comparison(states_bytes, calls, peak=None, per_call=False, beside=()):
    from validate.compare import Prediction, Readings, compare
    from zeroplan.engines.base import EngineEstimate
    from zeroplan.formulas.collectives import Collective
    from zeroplan.formulas.memory import MemoryBreakdown
    from zeroplan.formulas.peak import Term

    predicted = (Collective("all-gather", "forward", 6, "fp32", 12), Collective("all-gather", "forward", 4, "fp32", 8))
    est = EngineEstimate("toy", "toy", 3, MemoryBreakdown(100, 50, 200), peak, predicted)
    measured_peaks = {"init": 400, "forward": 500, "backward": 0, "optimizer_step": 450}
    got = Readings(states_bytes, True, measured_peaks, [calls], calls, [], nd=2)
    prediction = Prediction(est, per_call=per_call, beside_states=tuple(Term(n, b, "toy.py") for n, b in beside))
    return compare(prediction, got, tolerance=0.01, peak_tolerance=0.02)


def test_one_comparison_puts_named_terms_on_the_prediction_side_and_guards_every_division():
    from validate.compare import rel_error

    calls = [["all-gather", "forward", "float32", 6], ["all-gather", "forward", "float32", 4]]
    row = _toy_comparison(366, calls, beside=[("mesh ranks", 16)])
    # the measurement is never corrected: the named term is part of what is predicted
    assert row["predicted_model_states_bytes"] == 350 + 16 and row["measured_model_states_bytes"] == 366
    assert row["model_states_extra_bytes"] == 0 and row["model_states_rel_error"] == 0
    assert row["predicted_beside_states_terms"] == [{"name": "mesh ranks", "bytes": 16, "source": "toy.py"}]
    assert row["checks"] == {"model_states_within_tolerance": True, "model_states_steady": True,
                             "collectives_match": True, "peak_within_tolerance": None}  # fmt: skip
    assert row["predicted_collectives"] == {"all-gather|forward|fp32": {"elements": 10, "bytes_per_rank": 20}}
    assert row["measured_collectives"]["all-gather|forward|fp32"]["derived_bytes_per_rank"] == 20  # 1·3·4 + 1·2·4
    # summed per key by default; call by call, in order, when the profile predicts each call
    swapped = list(reversed(calls))
    assert _toy_comparison(366, swapped)["checks"]["collectives_match"] is True
    assert _toy_comparison(366, swapped, per_call=True)["checks"]["collectives_match"] is False
    assert _toy_comparison(350, calls, beside=[("mesh ranks", 16)])["model_states_rel_error"] == pytest.approx(-16 / 366)
    # no collective predicted: 0 if none is seen, 1 (100%) if some is; a phase measured at 0 is not divided by
    assert (rel_error(0, 0, 0), rel_error(5, 0, 0), rel_error(3, 2, 4)) == (0.0, 1.0, 0.25)


def test_one_comparison_checks_every_measured_phase_against_the_predicted_peak():
    from zeroplan.formulas.peak import Moment, Term, peak_of

    moments = [Moment(p, p, (Term("t", b, "toy.py"),)) for p, b in
               (("init", 400), ("forward", 490), ("backward", 10), ("optimizer_step", 450))]  # fmt: skip
    calls = [["all-gather", "forward", "float32", 10]]
    row = _toy_comparison(350, calls, peak=peak_of(moments))
    assert row["peak_rel_error_by_phase"] == {"init": 0.0, "forward": pytest.approx(0.02), "optimizer_step": 0.0}
    assert row["peak_rel_error"] == pytest.approx(0.02) and row["checks"]["peak_within_tolerance"] is True
    assert row["predicted_peak_phase"] == "forward" and row["measured_peak_bytes"] == 500
