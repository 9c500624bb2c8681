"""`zeroplan.plots` and `zeroplan plot`: figures carry the sweep's numbers, files are written whole."""

import json

import pytest
from typer.testing import CliRunner

from zeroplan import plots
from zeroplan.cli import app
from zeroplan import sweep
from clicheck import assert_one_line_error

runner = CliRunner()
H100_BYTES = 80 * 2**30

# A results file shaped like `zeroplan validate --json` output. Synthetic numbers: this tests the plot,
# it is not a measurement.
RESULT_ROWS = [
    {
        "stage": s,
        "world_size": n,
        "mode": "cpu",
        "backend": "gloo",
        "predicted_model_states_bytes": 1_000_000 * (4 - s) // n,
        "measured_model_states_bytes": 1_000_000 * (4 - s) // n,
        "predicted_comm_bytes_per_rank": 500_000 * (n - 1) // n,
        "measured_comm_bytes_per_rank": 500_000 * (n - 1) // n,
        "measured_peak_bytes": 3_000_000,
        "ok": not (s == 3 and n == 4),
    }
    for s in range(4)
    for n in (2, 4)
]


def test_memory_view_plots_the_sweep_on_log_log_axes_with_the_capacity_line():
    frame = sweep([7.5e9], [8, 16, 32, 64])
    fig = plots.memory_vs_nd(frame, H100_BYTES, "h100-80gb")
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    stage3 = lines["stage 3 P_os+g+p (+ parameters sharded)"]
    assert list(stage3.get_xdata()) == [8, 16, 32, 64]
    # ZeRO Table 1: 7.5B at N_d = 64 is 1.88 GB per GPU at stage 3 (exactly 16·7.5e9/64 bytes).
    assert list(stage3.get_ydata())[-1] == 1_875_000_000
    capacity = lines["h100-80gb: 85.9 GB = 80.0 GiB"]
    assert list(capacity.get_ydata()) == [H100_BYTES, H100_BYTES]
    assert "GB" in ax.get_ylabel() and "N_d" in ax.get_xlabel()
    assert len(fig.legends) == 1 and len(fig.legends[0].get_texts()) == 5


def test_memory_view_has_one_panel_per_model_size():
    fig = plots.memory_vs_nd(sweep([7e9, 70e9], [8, 64]))
    assert [ax.get_title() for ax in fig.axes] == ["Ψ = 7B", "Ψ = 70B"]


def test_breakdown_bars_stack_to_the_stage_total():
    frame = sweep([7.5e9], [64])
    fig = plots.breakdown_bars(frame)
    (ax,) = fig.axes
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0), patch.get_y() + patch.get_height())
    # 120, 31.4, 16.6, 1.88 GB (ZeRO Table 1, 7.5B, N_d = 64).
    assert [tops[x] for x in range(4)] == [120e9, 31_406_250_000, 16_640_625_000, 1_875_000_000]
    assert [t.get_text() for t in ax.texts] == ["120", "31.4", "16.6", "1.88"]


def test_comm_bars_are_the_bytes_each_rank_sends():
    frame = sweep([7.5e9], [8, 64])
    (ax,) = plots.comm_bars(frame).axes
    heights = sorted({round(p.get_height()) for p in ax.patches})
    # Ring: (N_d-1)/N_d · 2Ψ · 2 B (stages 0-2) and · 3Ψ · 2 B (stage 3); Ψ = 7.5e9.
    assert heights == [26_250_000_000, 29_531_250_000, 39_375_000_000, 44_296_875_000]


def test_predicted_vs_measured_marks_runs_outside_bounds(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": RESULT_ROWS}))
    rows = plots.load_validation(path)
    fig = plots.predicted_vs_measured(rows)
    states_ax, comm_ax = fig.axes
    assert "7 of 8 runs within bounds" in fig.get_suptitle()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[-1] == "measured, outside the validator's bounds"
    assert states_ax.get_ylabel() == "model states per GPU, MB" and comm_ax.get_ylabel().endswith(", kB")
    # Predicted and measured bars alternate per run, in the file's units scaled to MB.
    heights = [p.get_height() for p in states_ax.patches]
    assert heights[:8] == [r["predicted_model_states_bytes"] / 1e6 for r in RESULT_ROWS]
    assert heights[8:] == [r["measured_model_states_bytes"] / 1e6 for r in RESULT_ROWS]
    assert [t.get_text() for t in states_ax.texts] == ["+0%"] * 8  # (measured - predicted) / predicted
    assert [t.get_text() for t in states_ax.get_xticklabels()][:2] == ["stage 0\n2 ranks", "stage 0\n4 ranks"]


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_cli_writes_each_format_whole_and_leaves_no_temporary_file(tmp_path, suffix, magic):
    out = tmp_path / f"mem{suffix}"
    r = runner.invoke(
        app, ["plot", "--params", "7e9", "--gpus", "8,16,32,64", "--out", str(out), "--gpu-memory", "80GiB"]
    )
    assert r.exit_code == 0, r.output
    assert out.read_bytes().startswith(magic)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


@pytest.mark.parametrize(
    ("view", "model"), [("breakdown", ["--params", "7e9"]), ("comm", ["--model", "llama2-7b"])]
)
def test_cli_other_views(tmp_path, view, model):
    out = tmp_path / "v.png"
    r = runner.invoke(app, ["plot", "--view", view, *model, "--gpus", "8,64", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes().startswith(b"\x89PNG")


def test_cli_validate_view(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps(RESULT_ROWS))  # a bare list of rows is accepted too
    out = tmp_path / "v.svg"
    r = runner.invoke(app, ["plot", "--view", "validate", "--results", str(results), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert b"measured" in out.read_bytes()


@pytest.mark.parametrize(
    ("args", "content", "message"),
    [
        (
            ["--params", "7e9", "--out", "{d}/m.jpg"],
            None,
            "unknown image extension '.jpg'; use .png, .svg or .pdf",
        ),
        (["--params", "7e9", "--out", "{d}/m"], None, "no image extension"),
        (["--out", "{d}/m.png"], None, "--view memory needs exactly one of --params and --model"),
        (
            ["--params", "7e9", "--model", "llama2-7b", "--out", "{d}/m.png"],
            None,
            "exactly one of --params and",
        ),
        (["--model", "no-such-model", "--out", "{d}/m.png"], None, "unknown model 'no-such-model'"),
        (
            ["--view", "validate", "--params", "7e9", "--results", "{d}/r.json", "--out", "{d}/m.png"],
            None,
            "--params does not apply to --view validate",
        ),
        (["--params", "7e9", "--gpus", "8,0", "--out", "{d}/m.png"], None, "gpus=0: must be >= 1"),
        (
            ["--params", "7e9,70e9", "--view", "breakdown", "--out", "{d}/m.png"],
            None,
            "give one params value",
        ),
        (["--view", "validate", "--out", "{d}/m.png"], None, "--view validate needs --results FILE"),
        (["--view", "validate", "--results", "{d}/none.json", "--out", "{d}/m.png"], None, "No such file"),
        (
            ["--view", "validate", "--results", "{d}/r.json", "--out", "{d}/m.png"],
            "{not json",
            "not valid JSON",
        ),
        (
            ["--view", "validate", "--results", "{d}/r.json", "--out", "{d}/m.png"],
            "{}",
            "non-empty list 'rows'",
        ),
        (
            ["--view", "validate", "--results", "{d}/r.json", "--out", "{d}/m.png"],
            json.dumps([{"stage": 1}]),
            "rows[0]: world_size: Field required",
        ),
        (
            ["--params", "7e9", "--results", "{d}/r.json", "--out", "{d}/m.png"],
            "[]",
            "--results does not apply to --view memory",
        ),
    ],
)
def test_cli_bad_input_is_one_line_exit_2_and_no_file(tmp_path, args, content, message):
    if content is not None:
        (tmp_path / "r.json").write_text(content)
    before = set(tmp_path.iterdir())
    r = runner.invoke(app, ["plot", *[a.format(d=tmp_path) for a in args]])
    assert_one_line_error(r, message)
    assert set(tmp_path.iterdir()) == before


def test_stage_tradeoffs_draw_the_plans_numbers():
    import zeroplan

    plans = [zeroplan.plan("llama2-7b", gpu="h100-80gb", gpus=g) for g in (8, 64)]
    fig = plots.stage_tradeoffs(plans)
    mem_ax, time_ax = fig.axes
    lines = {line.get_label(): line for line in mem_ax.get_lines()}
    stage3 = lines["stage 3 P_os+g+p (+ parameters sharded)"]
    assert list(stage3.get_ydata()) == [p.option(3).states.gpu.model_states_bytes for p in plans]
    # Each stage and N_d: a solid bar (exposed) with a hatched bar stacked on it (hidden) summing to comm_s.
    bars = time_ax.patches
    assert len(bars) == 4 * 2 * 2
    stage3_exposed, stage3_hidden = bars[-4:-2], bars[-2:]
    for plan, low, high in zip(plans, stage3_exposed, stage3_hidden):
        t = plan.option(3).time
        assert low.get_height() == t.exposed_comm_s
        assert low.get_height() + high.get_height() == pytest.approx(t.comm_s, rel=1e-12)


def test_only_the_plotting_module_imports_matplotlib_and_only_the_sweep_module_pandas():
    # The house rule (the zeroplan package docstring's layout): pandas in the sweep grid only, matplotlib
    # in plots only, so `estimate` and `plan` never load them; checked on the AST, so an import inside a
    # function counts too.
    import ast
    from pathlib import Path

    import zeroplan

    owners = {"pandas": set(), "matplotlib": set()}
    package = Path(zeroplan.__file__).parent
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in owners:
                    owners[top].add(path.relative_to(package).as_posix())
    assert owners == {"pandas": {"sweeping/grid.py"}, "matplotlib": {"plots.py"}}


def test_peak_by_phase_draws_each_phase_with_its_error():
    from types import SimpleNamespace

    # synthetic numbers (the plot, not a measurement): run 2's optimizer phase is not checked
    pred = {"init": 1_000_000, "forward": 2_000_000, "backward": 4_000_000, "optimizer_step": 1_000_000}
    meas = {**pred, "backward": 4_040_404}
    rows = [SimpleNamespace(predicted_peak_bytes_by_phase=pred, measured_peak_bytes_by_phase=pred,
                            peak_unchecked_phases=None),
            SimpleNamespace(predicted_peak_bytes_by_phase=pred, measured_peak_bytes_by_phase=meas,
                            peak_unchecked_phases={"optimizer_step": "FakeTensorMode"})]  # fmt: skip
    fig = plots.peak_by_phase(rows, ["a", "b"])
    init_ax, _, backward_ax, opt_ax = fig.axes[:4]
    assert backward_ax.get_ylabel() == "backward, MB" and init_ax.get_yscale() == "log"
    assert [p.get_height() for p in backward_ax.patches] == [4.0, 4.0, 4.0, 4.040404]
    assert [t.get_text() for t in backward_ax.texts] == ["+0.00%", "+1.00%"]  # (measured - predicted) / measured
    assert [t.get_text() for t in opt_ax.texts] == ["+0.00%", "+0.00% (not checked)"]
    with pytest.raises(ValueError, match="one label per row"):
        plots.peak_by_phase(rows, ["a"])
