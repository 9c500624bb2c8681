"""A Python stand-in for DeepSpeed 0.19.8's CUDA quantizer op (``ops/op_builder/quantizer.py QuantizerBuilder``),
so that ZeRO++ qwZ and qgZ run on the CPU, as the NVMe rows run with a stand-in for ``async_io``.

The op is JIT-built with nvcc (``csrc/quantization/*.cu``); the CPU accelerator has none, so without it no CPU run
reaches ``CUDAQuantizer`` (qwZ, ``runtime/zero/partition_parameters.py``) or ``all_to_all_quant_reduce`` (qgZ,
``runtime/comm/coalesced_collectives.py``). Each function below has the interface its binding declares
(``csrc/quantization/pt_binding.cpp``) and returns tensors of exactly the shapes and dtypes the binding allocates:
the binding's only allocations are its outputs (``torch::empty`` of the output and of the scales; the kernels
keep their work in registers: no ``__shared__`` buffer, no ``cudaMalloc`` in ``swizzled_quantize.cu``,
``quant_reduce.cu``, ``dequantize.cu``). The stand-in allocates the same outputs once (``torch.empty``, seen by
the probes as the kernel's would be) and fills them in place; the arithmetic that fills them (symmetric
quantization, groups of ``numel / groups`` elements, int4 packed two per int8) runs with the probes' dispatch
modes set aside (``_scratch``): its working tensors stand for the kernel's registers, freed before it returns, so
MemTracker and ``CommCounter`` see what a CUDA run's caller sees. Values follow the kernels' layout (the
swizzle puts each rank's partition where the two all-to-alls deliver it; ``quantized_reduction`` averages the
``devices_per_node`` chunks) so that training stays meaningful; memory does not depend on them.
"""

from __future__ import annotations

import types

SYMMETRIC, ASYMMETRIC = 0, 1


def _scratch():
    """Set the dispatch modes (MemTracker, CommCounter) aside: the stand-in's arithmetic is the kernel's
    registers, not tensors a CUDA run allocates."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _quantize_into(out, scales, x, groups: int, bits: int) -> None:
    """Symmetric quantization of ``x`` (flat) in ``groups`` equal groups into ``out`` (int8; int4 packed two per
    byte when ``bits`` is 4) and ``scales`` (fp32, one per group)."""
    import torch

    with _scratch():
        g = x.detach().reshape(groups, -1).float()
        q_max = 2 ** (bits - 1) - 1
        scale = g.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / q_max
        q = torch.round(g / scale).clamp_(-q_max - 1, q_max).to(torch.int8).reshape(-1)
        if bits == 4:
            q = ((q[0::2] & 0x0F) | (q[1::2] << 4)).to(torch.int8)
        out.view(-1).copy_(q)
        scales.view(-1).copy_(scale.reshape(-1))


def _dequantize_into(out, q, scales, groups: int, bits: int) -> None:
    import torch

    with _scratch():
        q = q.reshape(-1)
        if bits == 4:
            low = (q << 4) >> 4  # sign-extended low nibble
            high = q >> 4
            q = torch.stack((low, high), dim=1).reshape(-1)
        out.view(-1).copy_((q.float().reshape(groups, -1) * scales.reshape(groups, 1)).reshape(-1))


def quantize(input_vals, groups: int, num_bits: int, quant_type: int):
    """``quantize_kernel``: int8 of the input's shape (last dim halved at 4 bits) and fp32 scales [groups, 1]."""
    import torch

    sizes = list(input_vals.shape)
    sizes[-1] //= 1 if num_bits == 8 else 2
    out = torch.empty(sizes, dtype=torch.int8, device=input_vals.device)
    scales = torch.empty(groups, 2 if quant_type == ASYMMETRIC else 1, dtype=torch.float32, device=input_vals.device)
    _quantize_into(out, scales, input_vals, groups, num_bits)
    return [out, scales]


def dequantize(quantized_data, params, groups: int, num_bits: int, quant_type: int):
    """``dequantize<__half>``: fp16 of the input's shape (last dim doubled at 4 bits)."""
    import torch

    sizes = list(quantized_data.shape)
    sizes[-1] *= 1 if num_bits == 8 else 2
    out = torch.empty(sizes, dtype=torch.float16, device=quantized_data.device)
    _dequantize_into(out, quantized_data, params, groups, num_bits)
    return out


def swizzle_quant(input_vals, groups: int, num_bits: int, quant_type: int, pipeline_size: int, nodes: int,
                  devices_per_node: int):  # fmt: skip
    """``ds_swizzle_quant``: int8 [numel / (8 / bits)] and fp32 scales [groups, 1]; the N_d partitions reordered
    local rank first, node second, so the intra-node all-to-all hands local rank j the partitions of ranks
    j, L + j, 2L + j, ... and the inter-node one hands rank k·L + j its own."""
    import torch

    n = input_vals.numel()
    out = torch.empty(n // (8 // num_bits), dtype=torch.int8, device=input_vals.device)
    scales = torch.empty(groups, 2 if quant_type == ASYMMETRIC else 1, dtype=torch.float32, device=input_vals.device)
    with _scratch():
        parts = input_vals.detach().reshape(nodes, devices_per_node, -1).transpose(0, 1).reshape(-1)
    _quantize_into(out, scales, parts, groups, num_bits)
    return [out, scales]


def quantized_reduction(input_vals, input_scales, in_groups: int, out_groups: int, num_bits: int, quant_type: int,
                        devices_per_node: int):  # fmt: skip
    """``quantized_reduction``: int8 of the input's shape, last dim / ``devices_per_node``, and fp32 scales
    [out_groups, 1]: the ``devices_per_node`` chunks dequantized, averaged, quantized again."""
    import torch

    sizes = list(input_vals.shape)
    sizes[-1] //= devices_per_node
    out = torch.empty(sizes, dtype=torch.int8, device=input_vals.device)
    scales = torch.empty(out_groups, 2 if quant_type == ASYMMETRIC else 1, dtype=torch.float32,
                         device=input_vals.device)  # fmt: skip
    with _scratch():
        full = torch.empty(input_vals.numel() * (8 // num_bits), dtype=torch.float32)
        _dequantize_into(full, input_vals, input_scales, in_groups, num_bits)
        mean = full.reshape(devices_per_node, -1).mean(dim=0)
    _quantize_into(out, scales, mean, out_groups, num_bits)
    return [out, scales]


def module():
    """The loaded op as ``QuantizerBuilder().load()`` returns it (the functions ZeRO++ calls)."""
    return types.SimpleNamespace(quantize=quantize, dequantize=dequantize, swizzle_quant=swizzle_quant,
                                 quantized_reduction=quantized_reduction, Symmetric=SYMMETRIC,
                                 Asymmetric=ASYMMETRIC)  # fmt: skip


def install() -> None:
    """``QuantizerBuilder.load`` returns the stand-in (``CUDAQuantizer`` and ``all_to_all_quant_reduce`` load it
    there, once per process)."""
    from deepspeed.ops import op_builder

    op_builder.QuantizerBuilder.load = lambda self, verbose=True: module()


def uses_quantizer(config: dict) -> bool:
    """A ds_config that reaches the quantizer (qwZ or qgZ)."""
    zero = config.get("zero_optimization", {})
    return bool(zero.get("zero_quantized_weights") or zero.get("zero_quantized_gradients"))
