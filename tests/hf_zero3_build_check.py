"""One process (a gloo world of one): a transformers config built under ZeRO-3 two ways, with every ``torch.empty``
of the build filled with NaN, so a parameter nobody initialises is NaN; prints one JSON line.

``runner``: ``validate.engines.deepspeed.build_model(hf_builder(config), ds_config, zero_init=True)`` (the runner's
build: ``hf_zero3_build``); ``raw``: the runner's build before issue 17's fix, its own ``deepspeed.zero.Init`` around
``from_config``. For each: the parameters with non-finite elements, the largest |std - initializer_range| of the
others, and whether transformers still sees ZeRO-3 after the build. tests/test_deepspeed_skipped.py runs it.

    DS_ACCELERATOR=cpu PYTHONPATH=$PWD python tests/hf_zero3_build_check.py tests/data/hf_configs/tiny-deepseek-v3.json
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import warnings


def _world_of_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(config_path: str) -> dict:
    _world_of_one()
    warnings.filterwarnings("ignore")
    import deepspeed
    import deepspeed.runtime.zero.partition_parameters as pp
    import torch
    import torch._dynamo  # noqa: F401 (imported before zero.Init patches torch.Tensor.__new__, as the runner's probes do)
    import torch.nn.functional as F
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from validate.engines.deepspeed import build_model, ds_config, hf_builder

    importlib.import_module("transformers.generation.utils")  # the same: its lazy import runs torch._dynamo's

    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the runner: its JIT build is not needed
    deepspeed.init_distributed(dist_backend="gloo")
    ds = ds_config(3, optimizer_params={"torch_adam": True})
    std = json.loads(open(config_path).read()).get("initializer_range", 0.02)
    orig_empty, linear = pp._orig_torch_empty, F.linear

    def nan_empty(*args, **kwargs):
        t = orig_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def raw(model_fn, config, _):
        with deepspeed.zero.Init(config_dict_or_path=config):
            return model_fn()

    out = {}
    for name, build in (("runner", build_model), ("raw", raw)):
        # zero.Init's torch.empty wraps the module global _orig_torch_empty taken at __enter__
        pp._orig_torch_empty = nan_empty
        try:
            model = build(hf_builder(config_path), ds, True)
        finally:
            pp._orig_torch_empty, F.linear = orig_empty, linear
        nonfinite, worst = [], 0.0
        for pname, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                full = p.data.float()
                if not torch.isfinite(full).all():
                    nonfinite.append(pname)
                elif full.numel() > 1 and full.std() > 0 and not pname.endswith(("norm.weight", "layernorm.weight")):
                    worst = max(worst, abs(float(full.std()) - std))
        out[name] = {"nonfinite": nonfinite, "worst_std_off": worst, "zero3_after": is_deepspeed_zero3_enabled()}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
    # the answer is out: leave without the interpreter's teardown, where a C++ thread of the gloo world (still
    # joinable) was destroyed once in four suite runs ("terminate called without an active exception", SIGABRT
    # after the JSON line, 2026-12-03); an exception in ``main`` still exits non-zero before this line
    os._exit(0)
