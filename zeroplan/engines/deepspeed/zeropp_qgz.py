"""ZeRO++ qgZ at ZeRO-3 (``zero_quantized_gradients``), DeepSpeed 0.19.8: the gradient reduce in quantized all-to-alls.

``stage3.py __avg_scatter_grads`` hands each bucket's gradients to ``runtime/comm/coalesced_collectives.py
all_to_all_quant_reduce`` when ``all2all_process_group`` is set (``engine.py``: ``groups._get_local_all_to_all_group``
when ``zero_quantized_gradients``) and there is more than one node: ``num_nodes = world // L`` with L =
``get_accelerator().device_count()`` (the GPUs per node; ``Settings.devices_per_node``); with one node the bucket
is reduce-scattered as without qgZ (``reduce_scatter_coalesced``). In ``all_to_all_quant_reduce``, tensor by tensor:

- a 1-D gradient, or one whose n elements are not a multiple of 2·N_d (DeepSpeed warns, PR 5056): its own
  ``reduce_scatter_coalesced([tensor])`` over the whole world (one reduce-scatter of ceil(n / N_d)·N_d elements);
- else, with G = max(rows, cols, N_d) quantization groups (``intra_quant_group``): ``swizzle_quant`` to 4 bits
  (int8 of n / 2, fp32 scales [G, 1]); two ``all_to_all_single`` in the local group of L consecutive ranks
  (``local_{rank // L}``: the int8, then the scales); ``quantized_reduction`` (int8 of n / 2L, fp32 scales
  [G / L, 1]); two ``all_to_all_single`` in the group of the ranks with the same local index on every node
  (``global_{rank % L}``: ``num_nodes`` ranks L apart); ``dequantize`` (fp16 of n / L) and the mean of its
  ``num_nodes`` chunks (fp16 of n / N_d: the rank's partition).

The quantizer is DeepSpeed's CUDA op (``QuantizerBuilder``); measured on the CPU with a stand-in that returns the
binding's shapes and dtypes (validate/engines/deepspeed_quantizer.py; docs/engines/deepspeed.md ZeRO++).
"""

from __future__ import annotations

from math import ceil, prod

QGZ_SRC = "runtime/comm/coalesced_collectives.py all_to_all_quant_reduce"
QGZ_FALLBACK_SRC = (f"{QGZ_SRC} (a 1-D gradient, or n not a multiple of 2·N_d) -> reduce_scatter_coalesced([tensor]) "
                    "over the world")  # fmt: skip


def qgz_nodes(nd: int, devices_per_node: int) -> int:
    """``num_nodes`` of ``__avg_scatter_grads`` (world // device_count); qgZ's all-to-alls run only above 1."""
    return nd // devices_per_node


def qgz_all_to_all(shape: tuple[int, ...], nd: int) -> bool:
    """Whether a gradient of ``shape`` goes through the all-to-alls (2-D, n a multiple of 2·N_d)."""
    return len(shape) == 2 and prod(shape) % (2 * nd) == 0


def qgz_groups(shape: tuple[int, ...], nd: int) -> int:
    """``intra_quant_group``: max(rows, cols, N_d) quantization groups of the swizzled gradient."""
    return max(shape[0], shape[1], nd)


def qgz_calls(shapes: tuple[tuple[int, ...], ...], nd: int,
              local: int) -> list[tuple[str, str, int, int, str]]:  # fmt: skip
    """One backward's reduce calls with qgZ over more than one node: ``(op, dtype, elements, group size, mesh
    dimension)`` per call: ``dp_shard`` for the whole world and the local group (consecutive ranks), ``dp_replicate``
    for the group across nodes (ranks L apart); the gradients' dtype written "grad" (the fallbacks' reduce-scatter)."""
    nodes, out = qgz_nodes(nd, local), []
    for shape in shapes:
        n = prod(shape)
        if not qgz_all_to_all(shape, nd):
            out.append(("reduce-scatter", "grad", ceil(n / nd) * nd, nd, "dp_shard"))
            continue
        g = qgz_groups(shape, nd)
        out += [("all-to-all", "int8", n // 2, local, "dp_shard"), ("all-to-all", "fp32", g, local, "dp_shard"),
                ("all-to-all", "int8", n // (2 * local), nodes, "dp_replicate"),
                ("all-to-all", "fp32", g // local, nodes, "dp_replicate")]
    return out


def qgz_check(shapes: tuple[tuple[int, ...], ...], nd: int, local: int) -> None:
    """ValueError where DeepSpeed's own all-to-alls cannot run: the world not whole nodes (``groups.py
    _get_local_all_to_all_group`` leaves the remainder's ranks without a group), or a scale buffer that its
    group cannot split evenly (``all_to_all_single`` of G, then G / L scales)."""
    if nd % local:
        raise ValueError(f"zero_optimization.zero_quantized_gradients: N_d={nd} is not a multiple of the "
                         f"{local} devices per node (utils/groups.py _get_local_all_to_all_group)")  # fmt: skip
    for shape in shapes:
        if qgz_all_to_all(shape, nd):
            g = qgz_groups(shape, nd)
            if g % local or (g // local) % (nd // local):
                raise ValueError(f"zero_optimization.zero_quantized_gradients: a {shape} gradient's {g} "
                                 f"quantization groups do not split over {local} local ranks and "
                                 f"{nd // local} nodes (all_to_all_single of the scales)")  # fmt: skip


QGZ_BUFFERS = "qgZ's quantized reduce buffers (the largest moment of the bucket's all_to_all_quant_reduce)"


def qgz_reduce_bytes(shapes: tuple[tuple[int, ...], ...], nd: int, local: int, gbytes: int, device: str) -> int:
    """Bytes ``all_to_all_quant_reduce`` holds beside the bucket at its largest moment, replayed from its source
    allocation by allocation: each kernel's outputs (``torch.empty`` in pt_binding.cpp: the binding allocates
    nothing else) and ``empty_like`` buffer is assigned to a local that keeps the previous tensor's until the
    assignment, so one gradient's buffers meet the previous gradient's; the mean of the ``num_nodes`` chunks holds
    two fp16 partials (``sum`` of the chunks, then ``/ num_nodes``), and each gradient's fp16 partition stays in
    ``output_lst``. A fallback gradient's ``reduce_scatter_coalesced`` adds, when n is not a multiple of N_d, its
    padded ``torch.cat`` (its partition is a view of it: kept) and on gloo the reduce-scatter's copy of the input
    (``zero3_epilogue.bucket_copies``). Not counted: gloo's all-to-all works on the buffers given (no copy)."""
    held: dict[str, int] = {}  # the loop's locals: name -> bytes of the tensor it holds
    kept = peak = 0

    def now(extra: int = 0) -> int:
        return sum(held.values()) + kept + extra

    def assign(*pairs: tuple[str, int]) -> None:  # the call's outputs made, then the old tensors let go
        nonlocal peak
        peak = max(peak, now(sum(b for _, b in pairs)))
        held.update(pairs)

    for shape in shapes:
        n = prod(shape)
        if not qgz_all_to_all(shape, nd):
            padded = ceil(n / nd) * nd
            flat = padded * gbytes if n % nd else 0
            peak = max(peak, now(flat + (padded * gbytes if device == "cpu" else 0)))
            kept += flat
            continue
        g, part = qgz_groups(shape, nd), n // nd * 2  # the fp16 partition
        assign(("intra_quant_int4", n // 2), ("intra_q_scales", g * 4))
        assign(("local_output", n // 2))
        assign(("scale_output", g * 4))
        assign(("global_input_tensor", n // (2 * local)), ("global_scales", g // local * 4))
        assign(("global_output", n // (2 * local)))
        assign(("global_scale_output", g // local * 4))
        assign(("final_output", n // local * 2))
        peak = max(peak, now(2 * part))  # sum(list(chunks)): a partial and the next one; then / num_nodes
        kept += part
    return peak
