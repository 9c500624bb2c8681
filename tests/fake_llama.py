"""A plan's printed FSDP2 snippet run on transformers' ``LlamaForCausalLM`` as rank 0 of a fake process group
(torch's ``fake`` backend: no communication), for the tests that check what the snippet builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_on_fake_llama(tmp_path: Path, config: Path, snippet: str, world_size: int, report: str):
    """Run ``snippet`` as rank 0 of a fake group of ``world_size`` on ``LlamaForCausalLM`` of the HF ``config``
    (built on meta; ``model.layers`` aliased to ``model.model.layers`` and ``init_weights`` a no-op, as the
    snippet's comments tell the user), then print ``report`` (a Python expression) as JSON: returned parsed."""
    script = tmp_path / "snippet.py"
    script.write_text(
        "import json, torch, torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        f"dist.init_process_group('fake', store=FakeStore(), rank=0, world_size={world_size})\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        f"config = LlamaConfig(**json.load(open({str(config)!r})))\n"
        "with torch.device('meta'):\n"
        "    model = LlamaForCausalLM(config)\n"
        "model.layers, model.init_weights = model.model.layers, lambda: None\n"
        + snippet + f"print(json.dumps({report}))\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])
