"""What CUDA allocates beyond a step's tensors, measured op by op (``python -m validate.cuda_extras``).

On CPU the validator's peak equals the sum of the tensors a step holds. On a GPU the caching allocator
also serves library workspaces that outlive the op that made them: cuBLAS keeps one workspace per
(handle, stream) (``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``getCurrentCUDABlasHandle`` and the
``cublas_handle_stream_to_workspace`` map, sized by ``getChosenWorkspaceSize``), and each thread has
its own handle (``DeviceThreadHandlePool``), so autograd's device thread gets a second one in backward.
This script measures each candidate alone, from ``torch.cuda.memory_allocated`` and
``max_memory_allocated``, so the engine profiles can carry them as measured terms. It prints one JSON
object: {case: {"kept": bytes still allocated after the op (workspace), "peak": extra peak during it}}.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F


def _clear() -> None:
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.synchronize()


def _case(fn, *inputs) -> dict[str, int]:
    """Bytes ``fn`` leaves allocated beyond its result, and its extra peak over inputs + result."""
    _clear()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn(*inputs)
    torch.cuda.synchronize()
    result = sum(t.untyped_storage().nbytes() for t in (out if isinstance(out, tuple) else (out,)) if t is not None)
    kept = torch.cuda.memory_allocated() - before - result
    peak = torch.cuda.max_memory_allocated() - before - result
    del out
    return {"kept": kept, "peak": peak}


def main() -> None:
    dev = torch.device("cuda")
    cases: dict[str, dict[str, int]] = {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        a = torch.randn(256, 256, device=dev, dtype=dtype)
        w = torch.randn(256, 256, device=dev, dtype=dtype)
        b = torch.randn(256, device=dev, dtype=dtype)
        cases[f"mm_{name}"] = _case(torch.mm, a, w)
        cases[f"linear_bias_{name}"] = _case(F.linear, a, w, b)
        x = torch.randn(1, 4, 128, 64, device=dev, dtype=dtype)
        cases[f"sdpa_causal_{name}"] = _case(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), x)
        logits = torch.randn(128, 1000, device=dev, dtype=dtype)
        target = torch.randint(0, 1000, (128,), device=dev)
        cases[f"cross_entropy_{name}"] = _case(F.cross_entropy, logits, target)

        def fwd_bwd(a=a, w=w):  # forward on this thread, backward on autograd's device thread
            a2, w2 = a.clone().requires_grad_(), w.clone().requires_grad_()
            (a2 @ w2).sum().backward()
            return a2.grad, w2.grad

        cases[f"mm_fwd_bwd_{name}"] = _case(fwd_bwd)
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0))}  # fmt: skip
    json.dump({"meta": meta, "cases": cases}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
