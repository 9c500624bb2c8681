"""Text, JSON and CSV views of an ``Estimate``. No computation happens here.

The JSON documents' pydantic models (``zeroplan.render.schemas``) are imported by the JSON views only: a
table never builds them, nor imports ``csv`` (start-up time, issue 16; docs/benchmarks.md, "2026-12-03, sixth
session, imports4")."""

from __future__ import annotations

import io

from zeroplan.engines import get_engine
from zeroplan.estimation.records import Estimate, StageEstimate
from zeroplan.formulas.collectives import on_mesh
from zeroplan.formulas.mesh import DEFAULT_GPUS_PER_NODE
from zeroplan.render.table import convention_line, format_bytes, format_count, format_table, peak_phase_cell

CSV_COLUMNS = (
    "stage", "name", "params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes",
    "reduction_vs_dp", "fits", "comm_volume_elements", "comm_bytes_per_rank", "peak_bytes", "peak_phase",
    "reserved_bytes",
)  # fmt: skip


def stage_out(s: StageEstimate, e: Estimate | None = None) -> StageOut:
    """One stage as ``stages[]`` of ``estimate --json`` (``zeroplan.render.schemas.StageOut``); its collectives
    placed on the mesh of ``e`` (``zeroplan.formulas.collectives.on_mesh``: group size and link class)."""
    from zeroplan.render.schemas import CollectiveOut, PeakTermOut, PhasesOut, StageOut

    collectives = s.collectives if e is None else on_mesh(s.collectives, e.nd, e.nm, gpus_per_node(e))
    return StageOut(
        stage=s.stage,
        name=s.name,
        params_bytes=s.memory.params_bytes,
        grads_bytes=s.memory.grads_bytes,
        optimizer_bytes=s.memory.optimizer_bytes,
        model_states_bytes=s.memory.model_states_bytes,
        reduction_vs_dp=s.reduction_vs_dp,
        fits=s.fits,
        comm_volume_elements=s.comm_volume_elements,
        comm_bytes_per_rank=s.comm_bytes_per_rank,
        collectives=[CollectiveOut(**c.as_dict()) for c in collectives],
        peak_bytes=None if s.peak is None else s.peak.peak_bytes,
        peak_phase=None if s.peak is None else s.peak.peak_phase,
        phases=None if s.peak is None else PhasesOut(**s.peak.by_phase()),
        peak_terms=None if s.peak is None else [PeakTermOut(name=t.name, bytes=t.bytes, source=t.source)
                                                 for t in s.peak.peak_terms],  # fmt: skip
        reserved_bytes=None if s.reserved is None else s.reserved.reserved_bytes,
        reserved_not_replayed=None if e is None else e.reserved_not_replayed,
        reserved_phases=None if s.reserved is None else PhasesOut(**s.reserved.reserved_phases),
        own_estimator_bytes=s.own_estimate_bytes,
        peak_rank=s.peak_rank,
        **({} if s.host is None or e is None else host_keys(s.host, ranks_per_node(e))),
    )


def ranks_per_node(e: Estimate) -> int:
    """The GPUs of one node the run uses: the node size, or fewer when the run has fewer GPUs."""
    return min(e.gpus, gpus_per_node(e))


def host_keys(host, per_node: int) -> dict:
    """``StageOut``'s offload keys: one rank's host memory, per node (``per_node`` GPUs), its pinned part, its terms;
    the steady bytes and init's peak, each with its terms (``HostMemory``; host_bytes is the larger); the NVMe bytes
    of a step (None without NVMe)."""
    from zeroplan.render.schemas import PeakTermOut

    return {"host_bytes_per_gpu": host.host_bytes, "host_bytes_per_node": host.host_bytes * per_node,
            "host_pinned_bytes_per_node": host.pinned_bytes * per_node,
            "host_terms": [PeakTermOut(name=t.name, bytes=t.bytes, source=t.source) for t in host.terms],
            "host_steady_bytes_per_gpu": host.steady_bytes, "host_init_peak_bytes_per_gpu": host.init_peak_bytes,
            "host_peak_at": host.peak_at,
            "host_init_peak_terms": [PeakTermOut(name=t.name, bytes=t.bytes, source=t.source) for t in host.init_peak],
            "nvme_read_bytes_per_step": host.nvme_read_bytes, "nvme_write_bytes_per_step": host.nvme_write_bytes}


def step_out(e: Estimate) -> StepOut | None:
    """The training step of the peak, or None without an architecture."""
    from zeroplan.render.schemas import StepOut

    w = e.workload
    if w is None:
        return None
    return StepOut(
        seq_len=w.seq_len, micro_batch=w.micro_batch, checkpointing=w.checkpointing, grad_accum=w.grad_accum,
        foreach=w.foreach, block_bytes=e.block_bytes, alloc_conf=e.alloc_conf,
    )  # fmt: skip


def stage_dict(s: StageEstimate, e: Estimate | None = None) -> dict:
    return stage_out(s, e).dump()


def gpus_per_node(e: Estimate) -> int:
    """The node size the links are read for: the estimate's, else 8 (``zeroplan.formulas.mesh``)."""
    return getattr(e, "gpus_per_node", None) or DEFAULT_GPUS_PER_NODE


def estimate_doc(e: Estimate, auto=None) -> EstimateDoc:
    """``estimate --json``; ``auto``: the ``AutoResolution`` of a ``--deepspeed-config`` with ``"auto"``
    (``zeroplan.cli_integrations.resolve_hf_auto``), written as ``inputs.ds_config_auto``."""
    from zeroplan.render.schemas import EstimateDoc, EstimateInputs, PolicyOut, auto_out

    return EstimateDoc(
        inputs=EstimateInputs(
            params=e.total_params,
            psi=e.psi,
            gpus=e.gpus,
            nd=e.nd,
            nm=e.nm,
            gpu_memory_bytes=e.gpu_memory_bytes,
            policy=PolicyOut(**e.policy.resolved()),
            engine=e.engine,
            model=e.model,
            step=step_out(e),
            ds_config_auto=auto_out(auto),
        ),
        bytes_per_param=dict(e.bytes_per_param),
        k=e.k,
        stages=[stage_out(s, e) for s in e.stages],
    )


def to_json(e: Estimate, auto=None) -> str:
    from zeroplan.render.schemas import json_text

    return json_text(estimate_doc(e, auto).dump(), indent=2)


def to_csv(e: Estimate) -> str:
    import csv  # here: a table or JSON estimate does not load it (a speed-up, no rule)

    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for s in e.stages:
        writer.writerow(stage_dict(s, e))
    return out.getvalue()


def step_line(e: Estimate) -> str:
    """'training step: llama2-7b, 1 x 4096 tokens per GPU, checkpointing none, foreach on, grad-accum 1'."""
    w = e.workload
    return (
        f"training step: {e.model}, {w.micro_batch} x {w.seq_len} tokens per GPU, checkpointing "
        f"{w.checkpointing}, Adam foreach {'on' if w.foreach else 'off'}, grad-accum {w.grad_accum}, engine {e.engine}"
    )


def nvme_lines(e: Estimate, unit: str) -> list[str]:
    """One line per stage whose offload swaps to the NVMe (``HostMemory.nvme_read_bytes``): one rank's bytes per step."""
    return [f"NVMe, stage {s.stage}: {format_bytes(s.host.nvme_read_bytes, unit)} read, "
            f"{format_bytes(s.host.nvme_write_bytes, unit)} written per rank per steady optimizer step "
            f"{s.host.nvme_note}" for s in e.stages
            if s.host is not None and s.host.nvme_read_bytes is not None]  # fmt: skip


def to_table(e: Estimate, unit: str = "GB") -> str:
    tp = "" if e.tp == 1 else f" x tp {e.tp}"  # tensor parallelism: N_d = GPUs / (T·N_m) DP ranks of T TP ranks
    head = (
        f"Ψ = {format_count(e.total_params)} parameters on {e.gpus} GPUs "
        f"(N_d = {e.nd // e.tp} data-parallel{tp} x N_m = {e.nm} model-parallel; "
        f"Ψ per MP rank = {format_count(e.psi)})"
    )
    columns = ["stage", "ZeRO", "params", "grads", "optimizer", "total/GPU", "vs DP", "comm/step", "sent/rank"]
    if e.workload is not None:
        columns += ["peak/GPU", "peak phase", "reserved/GPU"]
    if e.own_estimator is not None:
        columns.append(e.own_estimator)
    offload = any(s.host is not None for s in e.stages)  # the engine's offload: host memory per node
    if offload:
        columns.append("host/node")
    if e.gpu_memory_bytes is not None:
        columns.append(f"fits {format_bytes(e.gpu_memory_bytes, unit)}")
    rows = []
    for s in e.stages:
        m = s.memory
        row = [
            str(s.stage), s.name,
            format_bytes(m.params_bytes, unit), format_bytes(m.grads_bytes, unit),
            format_bytes(m.optimizer_bytes, unit), format_bytes(m.model_states_bytes, unit),
            "-" if s.reduction_vs_dp is None else f"{s.reduction_vs_dp:.2f}x", f"{s.comm_volume_elements / e.psi:.2f}Ψ",
            format_bytes(s.comm_bytes_per_rank, unit),
        ]  # fmt: skip
        if e.workload is not None:
            row += [format_bytes(s.peak.peak_bytes, unit), peak_phase_cell(s.peak.peak_phase, s.peak_rank),
                    "-" if s.reserved is None else format_bytes(s.reserved.reserved_bytes, unit)]
        if e.own_estimator is not None:
            row.append(format_bytes(s.own_estimate_bytes, unit))
        if offload:
            row.append("-" if s.host is None else format_bytes(s.host.host_bytes * ranks_per_node(e), unit))
        if s.fits is not None:
            row.append("yes" if s.fits else "no")
        rows.append(row)
    lines = [head, convention_line(e.bytes_per_param, e.k)]
    if e.workload is not None:
        lines.append(step_line(e))
    lines += ["", *format_table([columns, *rows], left=2), ""]
    if e.workload is None:
        lines += [
            f"{unit} = {'1e9' if unit == 'GB' else '2**30'} bytes. Model states only (params, grads, optimizer; "
            "ZeRO paper sec. 3.1, 5); activations and buffers come on top.",
            "peak/GPU: needs --model (a preset or a config.json): the peak of a training step needs an architecture.",
        ]
    else:
        fitted = "peak/GPU" if e.reserved_not_replayed else "reserved/GPU"
        fits = f" fits: {fitted} <= GPU memory." if e.gpu_memory_bytes is not None else ""
        conf = f"PYTORCH_CUDA_ALLOC_CONF={e.alloc_conf}" if e.alloc_conf else "torch's default PYTORCH_CUDA_ALLOC_CONF"
        lines += [
            f"{unit} = {'1e9' if unit == 'GB' else '2**30'} bytes. total/GPU: model states (ZeRO paper sec. 3.1, 5); "
            f"peak/GPU: the largest phase of a training step on the {e.engine} engine (docs/peak.md).{fits}",
            (f"Peak terms rounded up to {e.block_bytes}-byte CUDA blocks, plus cuBLAS/cuBLASLt workspaces after "
             "init (docs/peak.md). " if e.block_bytes > 1 else "Peak terms as allocated (no allocator block rounding). ")
            + (f"reserved/GPU -: {e.reserved_not_replayed}." if e.reserved_not_replayed else
               "reserved/GPU: max_memory_reserved of the engine's allocation trace replayed through the caching "
               f"allocator model under {conf} (docs/allocator.md: an estimate, errors measured there); the CUDA "
               "context and NCCL buffers come on top."),
        ]  # fmt: skip
    if offload:
        lines.append(f"host/node: what the engine's offload keeps in host memory, pinned buffers included, for "
                     f"{ranks_per_node(e)} GPUs per node (docs/engines/{e.engine}.md); total/GPU and peak/GPU are GPU memory.")
        lines += nvme_lines(e, unit)
    if e.own_estimator is not None:
        lines.append(f"{e.own_estimator}: the engine's own formula for the same run (model states only: no "
                     "buckets, activations or temporaries), shown beside the prediction to compare; never used for it.")  # fmt: skip
    paper = get_engine(e.engine).comm_count  # the reference engine's: the paper's count
    counted = (paper[0] if paper is not None else
               f"by the calls the {e.engine} engine itself issues (its own collectives, not the paper's count)")
    accum = 1 if e.workload is None else e.workload.grad_accum
    moved = f"elements moved per rank per step {counted}"
    if accum > 1:  # the rows count one optimizer step (EngineEstimate.collectives)
        moved = (f"elements moved per rank per optimizer step of {accum} micro-steps, " + (
            paper[1].format(accum=accum) if paper is not None else
            f"every micro-step's calls the {e.engine} engine itself issues"))
    lines += [
        f"comm/step: {moved}; sent/rank: bytes each rank sends with ring collectives, (N_d-1)/N_d of that.",
    ]  # fmt: skip
    return "\n".join(lines)
