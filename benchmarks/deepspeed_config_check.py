"""Validate every `zero_optimization` block zeroplan emits with DeepSpeed's own pydantic config model.

DeepSpeed is not a dependency, and importing the installed package pulls in its whole runtime, so this
loads only the config modules (``deepspeed/runtime/zero/config.py`` and what it imports) from a DeepSpeed
source tree. ``DeepSpeedZeroConfig`` forbids unknown keys, so a misspelt key fails here.

    pip download --no-deps --no-binary :all: deepspeed==0.19.8 && tar xzf deepspeed-0.19.8.tar.gz
    python benchmarks/deepspeed_config_check.py deepspeed-0.19.8/deepspeed
"""

from __future__ import annotations

import importlib
import logging
import sys
import types


def load_zero_config(src: str) -> types.ModuleType:
    """deepspeed.runtime.zero.config from a source tree, with package __init__ files bypassed."""
    packages = {
        "deepspeed": "",
        "deepspeed.runtime": "/runtime",
        "deepspeed.runtime.zero": "/runtime/zero",
        "deepspeed.runtime.zenflow": "/runtime/zenflow",
    }
    for name, sub in packages.items():
        module = types.ModuleType(name)
        module.__path__ = [src + sub]
        sys.modules[name] = module
    utils = types.ModuleType("deepspeed.utils")
    utils.logger = logging.getLogger("deepspeed")
    sys.modules["deepspeed.utils"] = utils
    return importlib.import_module("deepspeed.runtime.zero.config")


def main(src: str) -> None:
    from zeroplan.engines.deepspeed import deepspeed_config
    from zeroplan.planning.plan import LADDER

    config = load_zero_config(src)
    for stage, offload in LADDER:
        zero = deepspeed_config(stage, offload, micro_batch=2, grad_accum=4)["zero_optimization"]
        parsed = config.DeepSpeedZeroConfig(**zero)
        assert parsed.stage == stage
        print(f"stage {stage} + {offload.label:30s} accepted by DeepSpeedZeroConfig")
    try:
        config.DeepSpeedZeroConfig(stage=2, no_such_key=1)
    except Exception as exc:  # pydantic.ValidationError
        print(f"an unknown key is rejected ({type(exc).__name__}), so the check can fail")
    else:
        raise SystemExit("DeepSpeedZeroConfig accepted an unknown key: this check proves nothing")


if __name__ == "__main__":
    main(sys.argv[1])
