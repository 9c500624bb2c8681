"""Text and JSON views of a ``Plan`` (``zeroplan plan``). No computation happens here."""

from __future__ import annotations

from typing import Optional

from zeroplan.engines import get_engine
from zeroplan.planning.records import LAUNCHER_KEYS, Plan, PlanOption
from zeroplan.presets import LinkSpec
from zeroplan.render.plan_cells import (
    count_cell, fit_sentence, fits_cell, not_replayed_note, reserved_cell, seconds_cell, size_cell,
)  # fmt: skip
from zeroplan.render.table import convention_line, format_bytes, format_count, format_table, peak_phase_cell

SCHEMA = "zeroplan.plan/1"
ESTIMATE_NOTE = (
    "Communication time is an alpha-beta estimate (nominal link bandwidth as nccl-tests bus bandwidth, "
    "ring/tree latency per step); it ignores protocol choice, achieved vs nominal bandwidth, in-network "
    "reduction, contention with model-parallel traffic and stragglers. Compute: 6·Ψ·tokens at the given MFU."
)
MEMORY_NOTE = (
    "Model states only (parameters, gradients, optimizer states; ZeRO sec. 3.1). Activations, buckets, "
    "gathered stage-3 layers and fragmentation must fit in the headroom; they are not modelled."
)

PEAK_NOTE = (
    "fits: reserved, the caching allocator's max_memory_reserved for the engine's allocation trace of a training "
    "step (docs/allocator.md), within the GPU's memory less the headroom (0 by default); the CUDA context and "
    "NCCL buffers are not counted. peak: the live bytes of the largest phase (model states, activations, buffers "
    "and temporaries; docs/peak.md), terms rounded to 512-byte CUDA blocks. An offload option fits on its "
    "stage's peak with the offloaded model states on the host after init (docs/plan.md); min GPUs counts model "
    "states, a lower bound."
)
LAUNCHER_NOTE = (
    "Launchers: none printed. These rows are the ZeRO paper's model states and the reference runtime's peak "
    "(validate/), not a DeepSpeed or FSDP2 run, whose own peaks differ; `zeroplan plan --engine deepspeed` "
    "or `--engine fsdp2` (with --model) searches that engine's configurations and prints exactly the one "
    "it predicted."
)


def _link(link: LinkSpec) -> dict:
    return {"name": link.name, "bandwidth_gbps": link.bandwidth_gbps, "alpha_s": link.alpha_s}


def option_dict(o: PlanOption, per_node: int) -> dict:
    """One option as ``stages[]`` and ``offload[]`` of ``plan --json`` (``schemas.PlanOptionOut``)."""
    out: dict = {
        "stage": o.stage,
        "name": o.name,
        "offload": {"optimizer": o.offload.optimizer, "params": o.offload.params},
        "label": o.label,
        "max_params": o.max_params,
        "max_params_with_headroom": o.max_params_with_headroom,
        "fits": o.fits,
        "min_gpus": o.min_gpus,
    }
    s = o.states
    if s is None:
        return out
    out.update(
        gpu_bytes={
            "params_bytes": s.gpu.params_bytes,
            "grads_bytes": s.gpu.grads_bytes,
            "optimizer_bytes": s.gpu.optimizer_bytes,
            "model_states_bytes": s.gpu.model_states_bytes,
        },
        host_bytes_per_gpu=s.host_bytes,
        host_bytes_per_node=s.host_bytes * per_node,
        **host_basis(o),
        nvme_bytes_per_gpu=s.nvme_bytes,
        nvme_bytes_per_node=s.nvme_bytes * per_node,
        pcie={
            "h2d_bytes": s.h2d_bytes,
            "d2h_bytes": s.d2h_bytes,
            "nvme_read_bytes": s.nvme_read_bytes,
            "nvme_write_bytes": s.nvme_write_bytes,
            "seconds": o.pcie_s,
        },
        comm_volume_elements=o.comm_volume_elements,
        comm_bytes_per_rank=o.comm_bytes_per_rank,
        **peak_keys(o.peak),
        reserved_bytes=None if o.reserved is None else o.reserved.reserved_bytes,
        reserved_phases=None if o.reserved is None else o.reserved.reserved_phases,
        reserved_not_replayed=o.not_replayed,
        peak_rank=o.peak_rank,
        comm_time={
            "link": o.time.link,
            "algorithm": o.time.algorithm,
            "comm_s": o.time.comm_s,
            "compute_s": o.time.compute_s,
            "exposed_comm_s": o.time.exposed_comm_s,
            "step_s": o.time.step_s,
            "collectives": [
                {
                    **t.collective.as_dict(),
                    "calls_per_step": t.calls_per_step,
                    "seconds_per_call": t.seconds_per_call,
                }
                for t in o.time.collectives
            ],
        },
    )
    return out


def host_basis(o: PlanOption) -> dict:
    """Which host bytes ``host_bytes_per_gpu`` is: an engine's offload (``HostMemory``) the larger of the steady
    bytes and init's peak, ``host_peak_at`` naming which (as ``estimate --json``); a reference offload row the steady
    bytes (ZeRO-Offload's states after init; init's host memory not modelled: null); no offload 0 and 0."""
    h = o.host
    if h is not None:
        return dict(host_steady_bytes_per_gpu=h.steady_bytes, host_init_peak_bytes_per_gpu=h.init_peak_bytes,
                    host_peak_at=h.peak_at)  # fmt: skip
    return dict(host_steady_bytes_per_gpu=o.states.host_bytes, host_peak_at="steady",
                host_init_peak_bytes_per_gpu=None if o.offload.any else 0)  # fmt: skip


def peak_keys(peak) -> dict:
    """``peak_bytes``, ``peak_phase``, ``phases``, ``peak_terms`` of a peak (all None without one)."""
    if peak is None:
        return dict(peak_bytes=None, peak_phase=None, phases=None, peak_terms=None)
    return dict(
        peak_bytes=peak.peak_bytes, peak_phase=peak.peak_phase, phases=peak.by_phase(),
        peak_terms=[{"name": t.name, "bytes": t.bytes, "source": t.source} for t in peak.peak_terms],
    )  # fmt: skip


ENGINE_NOTE = (  # after the fit sentence (plan_cells.fit_sentence)
    "peak: the engine's predicted live bytes of the largest phase (docs/engines/). "
    "GPU: model states as the engine holds them. The configuration printed is exactly the one predicted."
)


ENGINE_HOST_NOTE = (
    "host/node is one rank's host memory x {per_node} GPUs per node, the larger of its steady bytes and init's peak "
    "(HostMemory.host_bytes; \"(init)\": init's peak, host_peak_at in --json); no fit compares it (plan --engine "
    "takes no --host-memory)"
)


def _host_fit(p: Plan, unit: str) -> str:
    """What ``--host-memory`` was compared with (``planning.plan.fits``): the steady host bytes of each option."""
    per_node = _per_node(p)
    return (f"each option's steady host bytes (the offloaded model states after init, host_peak_at steady; init's "
            f"host memory is not modelled for these rows) x {per_node} GPUs per node within --host-memory "
            f"{format_bytes(p.host_budget_bytes * per_node, unit)}")


def _engine_plan(p: Plan) -> bool:
    """The options are an engine's own candidates (``plan --engine fsdp2|deepspeed``)."""
    return any(o.candidate is not None for o in p.options)


def _with_peak(p: Plan) -> bool:
    return any(o.peak is not None for o in p.options)


def _per_node(p: Plan) -> int:
    return min(p.config.gpus_per_node, p.config.gpus)


def plan_dict(p: Plan, auto=None, largest: Optional[dict] = None) -> dict:
    """``plan --json``'s document; ``largest``: ``planning/largest_batch.py largest_json`` (``--max-micro-batch``),
    written as ``largest_micro_batch`` (absent without it)."""
    from zeroplan.render.schemas import auto_out

    c = p.config
    rec = p.recommendation
    recommendation = None
    if rec is not None:
        recommendation = {
            "stage": rec.stage,
            "offload": {"optimizer": rec.offload.optimizer, "params": rec.offload.params},
            "label": rec.label,
            **(p.launchers or dict.fromkeys(LAUNCHER_KEYS)),
        }
    return {
        "schema": SCHEMA,
        "inputs": {
            "model": c.model,
            "params": p.params,
            "psi": p.psi,
            "gpu": c.gpu,
            "gpu_memory_bytes": p.gpu_memory_bytes,
            "headroom": c.headroom,
            "alloc_conf": c.alloc_conf,
            "budget_bytes": p.budget_bytes,
            "host_memory_bytes": c.host_memory_bytes,
            "gpus": c.gpus,
            "gpus_per_node": c.gpus_per_node,
            "nd": c.nd,
            "nm": c.model_parallel,
            "micro_batch": c.micro_batch,
            "grad_accum": c.grad_accum,
            "tokens_per_step": p.tokens_per_step,
            "offload_allowed": c.offload,
            "peak_flops": c.flops,
            "mfu": c.mfu,
            "bucket_numel": c.bucket_numel,
            "links": {
                "intra": _link(p.intra),
                "inter": _link(p.inter),
                "ring": _link(p.ring),
                "host": _link(p.host_link),
            },
            "bytes_per_param": dict(p.bytes_per_param),
            "policy": c.policy.resolved(),
            "engine": c.engine,
            "foreach": c.foreach,
            "ds_config_auto": auto_out(auto),
        },
        "stages": [option_dict(o, _per_node(p)) for o in p.stages],
        "offload": [option_dict(o, _per_node(p)) for o in p.offload_options],
        "activations": {
            "bytes": p.activation_bytes,
            "checkpointing": c.checkpointing,
            "seq_len": c.sequence_length,
            "micro_batch": c.micro_batch,
            "tp": c.model_parallel,
            "headroom_bytes": p.headroom_bytes,
            "within_headroom": None if p.activation_bytes is None else p.activation_bytes <= p.headroom_bytes,
        },
        "recommendation": recommendation,
        "reason": p.reason,
        "fit_basis": p.fit_basis,
        "cut_first": p.cut_first,
        "fragmentation": p.fragmentation,
        "notes": [f"{fit_sentence(p)} {ENGINE_NOTE}" if _engine_plan(p) else PEAK_NOTE if _with_peak(p) else MEMORY_NOTE,
                  ESTIMATE_NOTE],  # fmt: skip
        **({} if largest is None else {"largest_micro_batch": largest}),
    }


def to_json(p: Plan, auto=None, largest: Optional[dict] = None) -> str:
    """``plan_dict`` checked and ordered by ``zeroplan.render.schemas.PlanDoc``; ``auto``: the ``AutoResolution``
    of a ``--deepspeed-config`` with ``"auto"`` (``zeroplan.cli_integrations.resolve_hf_auto``), written as
    ``inputs.ds_config_auto``; ``largest``: ``--max-micro-batch``'s search (``largest_micro_batch``)."""
    from zeroplan.render.schemas import PlanDoc, json_text

    return json_text(PlanDoc.model_validate(plan_dict(p, auto, largest)).dump(), indent=2)


def to_table(p: Plan, unit: str = "GiB") -> str:
    c = p.config
    what = (
        f"{c.model}: Ψ = {format_count(p.params)}"
        if c.model
        else (f"Ψ = {format_count(p.params)}" if p.params else "no model given")
    )
    where = f"{c.gpus} x {c.gpu}" if c.gpu else f"{c.gpus} GPUs"
    lines = [
        f"{what}; {where} ({format_bytes(p.gpu_memory_bytes, unit)} each; N_d = {c.nd} x N_m = "
        f"{c.model_parallel}; {c.gpus_per_node} GPUs per node)",
        f"{'a run' if _with_peak(p) else 'model states'} may use {format_bytes(p.budget_bytes, unit)} per GPU "
        f"({c.headroom:.0%} headroom); "
        f"data-parallel ring on {p.ring.name} ({p.ring.bandwidth_gbps:g} GB/s, "
        f"α {p.ring.alpha_s * 1e6:g} µs); "
        f"host link {p.host_link.name} ({p.host_link.bandwidth_gbps:g} GB/s)",
        convention_line(p.bytes_per_param, p.k),
    ]
    if _engine_plan(p):
        return "\n".join([*lines, "", *_engine_table(p, unit)])
    if p.params is not None:
        lines.append(activation_line(p, unit))
    lines.append("")
    header = ["stage + offload", "max Ψ", f"max Ψ ({c.headroom:.0%} free)"]
    peak = _with_peak(p)
    if p.params is not None:
        header[1:1] = ["GPU", *(["peak", "reserved"] if peak else []), "host/node", "NVMe/node", "fits", "min GPUs"]
        header += ["sent/rank/step", "comm", "exposed", "PCIe"]
    rows = [header]
    per_node = _per_node(p)
    for o in p.options:
        row = [o.label, count_cell(o.max_params), count_cell(o.max_params_with_headroom)]
        if o.states is not None:
            s = o.states
            row[1:1] = [
                size_cell(s.gpu.model_states_bytes, unit),
                *([size_cell(o.peak and o.peak.peak_bytes, unit), reserved_cell(o, unit)] if peak else []),
                size_cell(s.host_bytes * per_node, unit),
                size_cell(s.nvme_bytes * per_node, unit),
                "yes" if o.fits else "no",
                "never" if o.min_gpus is None else str(o.min_gpus),
            ]
            row += [
                size_cell(o.comm_bytes_per_rank, unit),
                seconds_cell(o.time.comm_s),
                seconds_cell(o.time.exposed_comm_s),
                seconds_cell(o.pcie_s) if o.offload.any else "-",
            ]
        rows.append(row)
    lines += [*format_table(rows, left=1), *not_replayed_note(p)]
    lines += ["", f"Recommendation: {_recommendation(p, unit)}"]
    if p.params is not None:
        lines.append(f"Fit: {p.fit_basis}.")
    if p.host_budget_bytes is not None and p.params is not None:
        lines.append(f"Host fit: {_host_fit(p, unit)}.")
    if p.cut_first is not None:
        lines.append(f"Cut first: {p.cut_first}.")
    if p.fragmentation is not None:
        lines.append(f"Fragmentation: {p.fragmentation}.")
    if p.recommendation is not None:
        lines += ["", LAUNCHER_NOTE]
    lines += [
        "",
        PEAK_NOTE if peak else MEMORY_NOTE,
        ESTIMATE_NOTE,
        "max Ψ: largest model whose states fill the GPU (ZeRO Table 2); min GPUs: fewest N_d x N_m that fit.",
    ]
    return "\n".join(lines)


def _engine_table(p: Plan, unit: str) -> list[str]:
    """The candidates of an engine's own plan, its recommendation and exactly the configuration to run."""
    rows = [["configuration", "ZeRO", "GPU", "peak", "peak phase", "reserved", "fits", "sent/rank/step", "comm",
             "exposed"]]  # fmt: skip
    offload = any(o.offload.any for o in p.options)  # the engine's own offload rows (DeepSpeed offload_optimizer)
    if offload:
        rows[0][3:3] = ["host/node"]
        rows[0].append("PCIe")
    per_node = _per_node(p)
    for o in p.options:
        row = [
            o.label, str(o.stage), size_cell(o.states.gpu.model_states_bytes, unit),
            size_cell(o.peak and o.peak.peak_bytes, unit),
            peak_phase_cell(o.peak.peak_phase, o.peak_rank) if o.peak else "-",
            reserved_cell(o, unit), fits_cell(o),
            size_cell(o.comm_bytes_per_rank, unit), seconds_cell(o.time.comm_s), seconds_cell(o.time.exposed_comm_s),
        ]  # fmt: skip
        if offload:
            at_init = o.host is not None and o.host.peak_at == "init"
            row[3:3] = [size_cell(o.states.host_bytes * per_node, unit) + (" (init)" if at_init else "")]
            row.append(seconds_cell(o.pcie_s) if o.offload.any else "-")
        rows.append(row)
    lines = [*format_table(rows, left=1), *not_replayed_note(p), "", f"Recommendation: {_recommendation(p, unit)}",
             f"Fit: {p.fit_basis}."]  # fmt: skip
    if offload:
        lines.append(f"Host: {ENGINE_HOST_NOTE.format(per_node=per_node)}.")
    if p.cut_first is not None:
        lines.append(f"Cut first: {p.cut_first}.")
    if p.fragmentation is not None:
        lines.append(f"Fragmentation: {p.fragmentation}.")
    launcher = get_engine(p.config.engine).launcher if p.launchers else None  # its search's recommendation
    for key, title in launcher.parts if launcher is not None else ():
        text = p.launchers.get(key)
        if isinstance(text, dict):  # a ds_config (render.json_text: not the JSON documents' models)
            from zeroplan.render.json_text import json_text

            lines += ["", title, json_text(text, indent=2)]
        elif text is not None:
            lines += ["", title, text.rstrip("\n")]
    return [*lines, "", f"{fit_sentence(p)} {ENGINE_NOTE}", ESTIMATE_NOTE]


def _recommendation(p: Plan, unit: str) -> str:
    rec = p.recommendation
    if rec is None:
        return p.reason
    t = rec.time
    sent = format_bytes(rec.comm_bytes_per_rank, unit)
    volume = f"{rec.comm_volume_elements / p.psi:.2f}Ψ" if p.psi else "0Ψ"
    comm = (
        f"moves {volume} per step (ZeRO sec. 7 count), sends {sent} per GPU, "
        f"≈ {seconds_cell(t.comm_s)} of communication"
    )
    if t.compute_s is not None:
        comm += f" ({seconds_cell(t.exposed_comm_s)} exposed behind {seconds_cell(t.compute_s)} of compute)"
    what = rec.label if rec.candidate is not None else f"ZeRO stage {rec.label}"
    return f"{what}: {p.reason}; {comm}."


def activation_line(p: Plan, unit: str) -> str:
    """Activations against the headroom (they are not model states, so not in the fit)."""
    c = p.config
    shape = (
        f"{c.checkpointing} recomputation, s = {c.sequence_length}, b = {c.micro_batch}, "
        f"t = N_m = {c.model_parallel}"
    )
    if p.activation_bytes is None:
        return (
            f"activations ({shape}): not estimated; Korthikanti et al. 2022 publish constants for "
            "GPT-style layers only, use --checkpointing full for this model"
        )
    size, headroom = format_bytes(p.activation_bytes, unit), format_bytes(p.headroom_bytes, unit)
    if _with_peak(p):  # the fit counts them: the engine's activations are terms of its peak and its trace
        return f"activations ≈ {size} per GPU (Korthikanti et al. 2022, {shape}); the fit counts the engine's own"
    verdict = "within" if p.activation_bytes <= p.headroom_bytes else "MORE than"
    return (
        f"activations ≈ {size} per GPU (Korthikanti et al. 2022, {shape}): {verdict} the {headroom} headroom"
    )
