"""Figures of a sweep and of validator results. The one module that imports matplotlib.

Every function takes numbers already computed elsewhere (a ``zeroplan.sweep`` DataFrame, or rows of a
``zeroplan validate --json`` file) and returns a ``matplotlib.figure.Figure``; nothing is computed here.
Figures are built without pyplot, so no global state leaks between calls; ``save`` writes them atomically.
What is not drawing (the validator rows read, the checks before any work, axis labels) is in
``zeroplan.plot_data``, re-exported here. Units: GB = 1e9 bytes, the ZeRO paper's unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

from zeroplan.files import atomic_write
from zeroplan.formulas.stages import STAGES
from zeroplan.number_formats import format_count
from zeroplan.plot_data import (  # noqa: F401 (re-exported: plots.load_validation, plots.check_points, ...)
    FORMATS, GB, MAX_GPU_COUNTS, MAX_PANELS, MAX_RUNS, STAGE_WHAT, VIEWS, ValidationRow, _auto_unit, _gb, _one_value,
    _suptitle, _title_params, check_format, check_points, load_validation, stage_label,
)  # fmt: skip

LOG_TICK_SUBS = (1.0, 2.0, 5.0)
"""Labelled log ticks at 1, 2, 5 x 10^k, so a range narrower than a decade still has labels."""
STAGE_COLORS = ("#4d4d4d", "#1f77b4", "#ff7f0e", "#2ca02c")  # grey for plain DP, then one hue per stage
STAGE_MARKERS = ("o", "s", "^", "D")
COMPONENT_COLORS = {"params_bytes": "#4c72b0", "grads_bytes": "#dd8452", "optimizer_bytes": "#55a868"}
COMPONENT_LABELS = {
    "params_bytes": "parameters",
    "grads_bytes": "gradients",
    "optimizer_bytes": "optimizer states",
}


def _capacity(ax: Any, gpu_memory_bytes: Optional[int], gpu_label: Optional[str]) -> None:
    if gpu_memory_bytes is None:
        return
    name = f"{gpu_label}: " if gpu_label else "GPU memory "
    ax.axhline(
        gpu_memory_bytes,
        color="#d62728",
        linestyle="--",
        linewidth=1.5,
        label=f"{name}{gpu_memory_bytes / GB:.1f} GB = {gpu_memory_bytes / 2**30:.1f} GiB",
    )


def _legend(fig: Figure, ax: Any, ncol: int = 2, handles: Optional[list] = None) -> None:
    """One legend for the whole figure, below the axes, so it never covers data."""
    if handles is None:
        handles, _ = ax.get_legend_handles_labels()
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=9, frameon=False)


def memory_vs_nd(
    frame: Any, gpu_memory_bytes: Optional[int] = None, gpu_label: Optional[str] = None
) -> Figure:
    """Model states per GPU against N_d, one line per stage, log-log, one panel per Ψ (ZeRO Table 1)."""
    params = list(dict.fromkeys(frame["params"]))
    nds = sorted({int(n) for n in frame["nd"]})
    check_points("memory", n_params=len(params), n_gpus=len(nds))
    fig = Figure(figsize=(7.5 if len(params) == 1 else 5.0 * len(params), 6.0), layout="constrained")
    axes = fig.subplots(1, len(params), sharey=True, squeeze=False)[0]
    for ax, p in zip(axes, params):
        sub = frame[frame["params"] == p]
        for stage in sorted({int(s) for s in sub["stage"]}):
            rows = sub[sub["stage"] == stage].sort_values("nd")
            ax.plot(
                rows["nd"],
                rows["model_states_bytes"],
                marker=STAGE_MARKERS[stage],
                color=STAGE_COLORS[stage],
                linewidth=2,
                markersize=6,
                label=stage_label(stage),
            )
        _capacity(ax, gpu_memory_bytes, gpu_label)
        _log_memory_axes(ax, nds)
        ax.set_title(_title_params(sub))
    axes[0].set_ylabel("model states per GPU, GB (log scale)")
    _legend(fig, axes[0])
    fig.suptitle(_suptitle(frame, "Per-GPU memory of model states by ZeRO stage"))
    return fig


def breakdown_bars(
    frame: Any, gpu_memory_bytes: Optional[int] = None, gpu_label: Optional[str] = None
) -> Figure:
    """Stacked bars of parameters, gradients and optimizer states per stage; one panel per N_d (one Ψ)."""
    _one_value(frame, "params", "breakdown")
    nds = sorted({int(n) for n in frame["nd"]})
    if len(nds) > 6:
        raise ValueError(f"breakdown: at most 6 GPU counts fit side by side, got {len(nds)}")
    fig = Figure(figsize=(max(6.5, 3.2 * len(nds)), 5.6), layout="constrained")
    axes = fig.subplots(1, len(nds), sharey=True, squeeze=False)[0]
    for ax, nd in zip(axes, nds):
        sub = frame[frame["nd"] == nd].sort_values("stage")
        x = list(range(len(sub)))
        bottom = [0] * len(sub)
        for col, color in COMPONENT_COLORS.items():
            values = [int(v) for v in sub[col]]
            ax.bar(x, values, bottom=bottom, color=color, width=0.7, label=COMPONENT_LABELS[col])
            bottom = [b + v for b, v in zip(bottom, values)]
        for xi, total in zip(x, bottom):
            ax.annotate(
                _gb(total),
                (xi, total),
                ha="center",
                va="bottom",
                fontsize=9,
                xytext=(0, 2),
                textcoords="offset points",
            )
        _capacity(ax, gpu_memory_bytes, gpu_label)
        ax.set_xticks(x, [f"{s}\n{STAGES[int(s)].name}" for s in sub["stage"]])
        ax.yaxis.set_major_formatter(FuncFormatter(_gb))
        ax.set_title(f"N_d = {nd}")
        ax.set_xlabel("ZeRO stage")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(top=max(max(bottom), gpu_memory_bytes or 0) * 1.12)
    axes[0].set_ylabel("model states per GPU, GB")
    _legend(fig, axes[0], ncol=4)
    fig.suptitle(_suptitle(frame, f"Model states per GPU by component, {_title_params(frame)}"))
    return fig


def comm_bars(frame: Any) -> Figure:
    """Bytes each rank sends per step, grouped by N_d, one bar per stage (ZeRO sec. 7: 2Ψ vs 3Ψ)."""
    _one_value(frame, "params", "comm")
    nds = sorted({int(n) for n in frame["nd"]})
    check_points("comm", n_gpus=len(nds))
    stages = sorted({int(s) for s in frame["stage"]})
    fig = Figure(figsize=(min(14.0, 5.0 + 0.35 * len(nds) * len(stages)), 5.6), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(stages)
    for i, stage in enumerate(stages):
        rows = frame[frame["stage"] == stage].sort_values("nd")
        xs = [nds.index(int(n)) + (i - (len(stages) - 1) / 2) * width for n in rows["nd"]]
        ax.bar(
            xs,
            rows["comm_bytes_per_rank"],
            width=width * 0.95,
            color=STAGE_COLORS[stage],
            label=stage_label(stage),
        )
    ax.set_xticks(range(len(nds)), [str(n) for n in nds])
    ax.set_xlabel("N_d, data-parallel GPUs")
    ax.set_ylabel("bytes sent per GPU per step, GB (ring collectives)")
    ax.yaxis.set_major_formatter(FuncFormatter(_gb))
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(
        "stages 0-2 move 2Ψ elements per step, stage 3 moves 3Ψ (ZeRO sec. 7); "
        "each GPU sends (N_d-1)/N_d of that",
        fontsize=9,
    )
    _legend(fig, ax)
    fig.suptitle(_suptitle(frame, f"Communication per step by ZeRO stage, {_title_params(frame)}"))
    return fig


def stage_tradeoffs(plans: Sequence[Any]) -> Figure:
    """Memory per GPU and communication time per step against N_d, per stage, from ``zeroplan.plan``
    answers (one per GPU count, same model and hardware): what each stage buys and what it costs.

    Right panel: one bar per stage and N_d, the estimated communication time per optimizer step
    (``zeroplan.formulas.commtime``), solid where it is exposed (not hidden behind compute), hatched where hidden;
    the black tick is the compute time of the step.
    """
    plans = sorted(plans, key=lambda p: p.config.nd)
    nds = [p.config.nd for p in plans]
    fig = Figure(figsize=(13, 5.6), layout="constrained")
    mem_ax, time_ax = fig.subplots(1, 2)
    stages = [o.stage for o in plans[0].stages]
    for stage in stages:
        mem = [p.option(stage).states.gpu.model_states_bytes for p in plans]
        mem_ax.plot(
            nds,
            mem,
            marker=STAGE_MARKERS[stage],
            color=STAGE_COLORS[stage],
            linewidth=2,
            label=stage_label(stage),
        )
    _capacity(mem_ax, plans[0].gpu_memory_bytes, plans[0].config.gpu)
    _log_memory_axes(mem_ax, nds)
    mem_ax.set_ylabel("model states per GPU, GB (log scale)")
    mem_ax.set_title("memory")

    width = 0.8 / len(stages)
    for i, stage in enumerate(stages):
        xs = [j + (i - (len(stages) - 1) / 2) * width for j in range(len(plans))]
        times = [p.option(stage).time for p in plans]
        exposed = [t.exposed_comm_s if t.exposed_comm_s is not None else t.comm_s for t in times]
        hidden = [t.comm_s - e for t, e in zip(times, exposed)]
        time_ax.bar(xs, exposed, width=width * 0.95, color=STAGE_COLORS[stage])
        time_ax.bar(
            xs,
            hidden,
            bottom=exposed,
            width=width * 0.95,
            color="white",
            edgecolor=STAGE_COLORS[stage],
            hatch="//",
            linewidth=1,
        )
    compute = [p.option(stages[0]).time.compute_s for p in plans]
    if all(c is not None for c in compute):
        time_ax.hlines(
            compute,
            [j - 0.45 for j in range(len(plans))],
            [j + 0.45 for j in range(len(plans))],
            colors="black",
            linewidth=2.5,
        )
    time_ax.set_xticks(range(len(plans)), [str(n) for n in nds])
    time_ax.set_xlabel("N_d, data-parallel GPUs")
    time_ax.set_ylabel("seconds per optimizer step (estimate)")
    time_ax.grid(True, axis="y", alpha=0.3)
    links = sorted({p.ring.name for p in plans})
    time_ax.set_title(f"communication time (alpha-beta, ring over {' / '.join(links)})", fontsize=10)
    handles, _ = mem_ax.get_legend_handles_labels()
    handles += [
        Patch(facecolor="#777777", label="communication exposed"),
        Patch(
            facecolor="white", edgecolor="#777777", hatch="//", label="communication hidden behind compute"
        ),
    ]
    if all(c is not None for c in compute):
        handles.append(Line2D([], [], color="black", linewidth=2.5, label="compute per step"))
    _legend(fig, mem_ax, ncol=3, handles=handles)
    p0 = plans[0]
    model = p0.config.model or f"Ψ = {format_count(p0.params)}"
    fig.suptitle(
        f"ZeRO stage trade-offs: {model} on {p0.config.gpu or 'GPUs'}, "
        f"{p0.tokens_per_step:,} tokens per GPU per step"
    )
    return fig


def predicted_vs_measured(rows: Sequence[ValidationRow]) -> Figure:
    """Predicted and measured bytes side by side for every validator run: model states and bytes sent.

    Bars, not a scatter: runs of stages 0-2 send the same bytes, and points would hide one another.
    """
    check_points("validate", runs=len(rows))
    fig = Figure(figsize=(max(8.0, 0.75 * len(rows) + 3), 8.0), layout="constrained")
    axes = fig.subplots(2, 1)
    panels = (
        ("model states per GPU", "predicted_model_states_bytes", "measured_model_states_bytes"),
        ("bytes sent per GPU per step (derived)", "predicted_comm_bytes_per_rank", "derived_comm_bytes_per_rank"),
    )
    several_modes = len({(r.mode, r.backend) for r in rows}) > 1
    labels = [
        f"stage {r.stage}\n{r.world_size} ranks" + (f"\n{r.mode}/{r.backend}" if several_modes else "")
        for r in rows
    ]
    x = list(range(len(rows)))
    for ax, (what, pred_key, meas_key) in zip(axes, panels):
        pred = [getattr(r, pred_key) for r in rows]
        meas = [getattr(r, meas_key) for r in rows]
        unit, scale = _auto_unit(pred + meas)
        colors = [STAGE_COLORS[r.stage] if 0 <= r.stage < len(STAGES) else "#000000" for r in rows]
        ax.bar(
            [i - 0.2 for i in x],
            [p / scale for p in pred],
            width=0.4,
            color="white",
            edgecolor=colors,
            hatch="//",
            linewidth=1.2,
        )
        ax.bar(
            [i + 0.2 for i in x],
            [m / scale for m in meas],
            width=0.4,
            color=colors,
            edgecolor=["#d62728" if not r.ok else c for r, c in zip(rows, colors)],
            linewidth=[3 if not r.ok else 1 for r in rows],
        )
        for i, (p, m) in enumerate(zip(pred, meas)):
            if p > 0:  # the relative error a reader would otherwise estimate by eye
                ax.annotate(
                    f"{100 * (m - p) / p:+.2g}%",
                    (i, max(p, m) / scale),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ax.set_ylim(top=max(pred + meas) / scale * 1.12)
        ax.set_xticks(x, labels, fontsize=8.5)
        ax.set_ylabel(f"{what}, {unit}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_xlim(-0.6, len(rows) - 0.4)
    handles = [
        Patch(facecolor="white", edgecolor="#555555", hatch="//", label="predicted by zeroplan"),
        Patch(facecolor="#555555", label="measured (colour = stage)"),
    ]
    if not all(r.ok for r in rows):
        handles.append(
            Patch(
                facecolor="#555555",
                edgecolor="#d62728",
                linewidth=3,
                label="measured, outside the validator's bounds",
            )
        )
    _legend(fig, axes[1], ncol=3, handles=handles)
    modes = ", ".join(sorted({f"{r.mode}/{r.backend}" for r in rows}))
    n_ok = sum(r.ok for r in rows)
    fig.suptitle(f"zeroplan prediction vs measurement ({modes}; {n_ok} of {len(rows)} runs within bounds)")
    return fig


PEAK_PHASES = ("init", "forward", "backward", "optimizer_step")  # zeroplan.formulas.peak.PHASES, in step order


def peak_by_phase(rows: Sequence[Any], labels: Sequence[str]) -> Figure:
    """Predicted and measured peak of each phase for validator runs (``validate.schema.ReportRow``), one
    panel per phase, one pair of bars per run labelled by ``labels``; the relative error
    (measured - predicted) / measured above each pair, "not checked" where the row says so."""
    if len(labels) != len(rows) or not rows:
        raise ValueError(f"peak_by_phase: {len(rows)} rows and {len(labels)} labels: need one label per row")
    fig = Figure(figsize=(max(8.0, 0.9 * len(rows) + 3), 10.0), layout="constrained")
    axes = fig.subplots(len(PEAK_PHASES), 1, sharex=True)
    x = list(range(len(rows)))
    for ax, phase in zip(axes, PEAK_PHASES):
        pred = [r.predicted_peak_bytes_by_phase[phase] for r in rows]
        meas = [r.measured_peak_bytes_by_phase[phase] for r in rows]
        unit, scale = _auto_unit(pred + meas)
        ax.bar([i - 0.2 for i in x], [p / scale for p in pred], width=0.4, color="white", edgecolor="#1f77b4",
               hatch="//", linewidth=1.2)  # fmt: skip
        ax.bar([i + 0.2 for i in x], [m / scale for m in meas], width=0.4, color="#1f77b4")
        for i, (r, p, m) in enumerate(zip(rows, pred, meas)):
            unchecked = phase in (r.peak_unchecked_phases or {})
            text = f"{100 * (m - p) / m:+.2f}%" + (" (not checked)" if unchecked else "")
            ax.annotate(text, (i, max(p, m) / scale), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")  # fmt: skip
        ax.set_yscale("log")
        ax.set_ylabel(f"{phase}, {unit}")
        ax.grid(True, axis="y", alpha=0.3)
    axes[-1].set_xticks(x, labels, fontsize=8)
    handles = [Patch(facecolor="white", edgecolor="#1f77b4", hatch="//", label="predicted peak"),
               Patch(facecolor="#1f77b4", label="measured peak")]  # fmt: skip
    _legend(fig, axes[-1], ncol=2, handles=handles)
    fig.suptitle("peak per phase: prediction vs measurement (error = (measured - predicted) / measured)")
    return fig


def _log_memory_axes(ax: Any, nds: Sequence[int]) -> None:
    """Log-log axes of bytes per GPU against N_d: one labelled tick per N_d, GB ticks at 1-2-5."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(nds, [str(n) for n in nds])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=LOG_TICK_SUBS))
    ax.yaxis.set_major_formatter(FuncFormatter(_gb))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda x, pos: ""))
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlabel("N_d, data-parallel GPUs (log scale)")


def save(fig: Figure, path: str | Path, dpi: int = 150, inputs: Sequence[str | Path | None] = ()) -> None:
    """Render ``fig`` to ``path`` atomically, so no partial image is left (never over one of ``inputs``)."""
    suffix = check_format(Path(path))
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=suffix[1:], dpi=dpi), suffix, inputs)


def figure(
    view: str,
    frame: Any = None,
    rows: Optional[Sequence[ValidationRow]] = None,
    gpu_memory_bytes: Optional[int] = None,
    gpu_label: Optional[str] = None,
) -> Figure:
    """The figure for one ``zeroplan plot --view``."""
    if view == "memory":
        return memory_vs_nd(frame, gpu_memory_bytes, gpu_label)
    if view == "breakdown":
        return breakdown_bars(frame, gpu_memory_bytes, gpu_label)
    if view == "comm":
        return comm_bars(frame)
    if view == "validate":
        return predicted_vs_measured(rows)
    raise ValueError(f"view={view!r}: expected one of {', '.join(VIEWS)}")
