"""A fixed-seed fuzz pass over zeroplan's inputs: the five commands and ``zeroplan.estimate/plan/sweep``.

Each case starts from a valid call and changes one to three things: an option's value (numbers out of
range or of the wrong form, long and non-ASCII text, odd paths), a key of the Hugging Face config.json or
of the ds_config.json it reads (values of every JSON type, dimensions at and past their bounds), or the
output path (one of the inputs under another name, a directory, a device). Every case runs in this
process under a timeout (SIGALRM) and must keep the promises of docs/limits.md:

- exit 0 or 2 (``validate``: also 1, a run that failed or drifted); never an uncaught exception;
- on exit 2: nothing on stdout and exactly one line on stderr, ``zeroplan: error: ...``;
- on exit 0: no nan or inf printed;
- no input file changed; the case ends within the timeout;
- in Python: a result or a ValueError, nothing else.

Run: python benchmarks/fuzz_inputs.py [--seed 18] [--count 800] [--timeout 60] [--validate]
A case that breaks a promise is printed with its command line; keep it as a test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from typer.testing import CliRunner

import zeroplan
from zeroplan.cli import app
from zeroplan.types import MAX_LAYERS, dimension_limit

LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "intermediate_size": 128}  # fmt: skip
CONFIGS = {
    "llama": LLAMA,
    "gpt2": {"model_type": "gpt2", "vocab_size": 320, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "qwen2": {**LLAMA, "model_type": "qwen2", "num_key_value_heads": 2, "use_sliding_window": False},
    "mistral": {**LLAMA, "model_type": "mistral", "num_key_value_heads": 2, "sliding_window": 64},
}
CONFIG_KEYS = ["model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta",
               "rope_scaling", "rope_parameters", "layer_types", "tie_word_embeddings", "hidden_act", "rms_norm_eps",
               "sliding_window", "use_sliding_window", "n_embd", "n_layer", "n_head", "n_positions", "n_inner",
               "attention_bias", "mlp_bias", "max_window_layers"]  # fmt: skip
DS_KEYS = [("zero_optimization", "stage"), ("zero_optimization", "reduce_bucket_size"),
           ("zero_optimization", "offload_optimizer"), ("zero_optimization", "overlap_comm"),
           ("bf16", "enabled"), ("fp16", "enabled"), ("train_micro_batch_size_per_gpu",),
           ("gradient_accumulation_steps",), ("train_batch_size",), ("optimizer", "type")]  # fmt: skip
ODD_JSON = [None, True, False, -1, 0, 1, 3, 4, 2**31, 10**30, 1.5, -0.0, 1e300, "3", "", "auto", "ü" * 50, [], [3],
            [["x"]], {}, {"device": "cpu"}, {"rope_type": "nonsense"}, {"type": "linear", "factor": -1}]
NUMBERS = ["0", "-1", "1", "8", "1e15", "1e16", "1.5", "nan", "inf", "-inf", "", " 8", "8,8", "0x10", "٨",
           "9" * 5000, "1e-300", "2**40", "7B", "1T", "80GiB", "1.5GB", "16777217", "65537", str(2**63)]
TEXT = ["", "a" * 300, "é" * 200, "../x", "llama2-7b", "none", "fp16", "bf16", "fp8", "int4", "adam", "lion",
        "full", "selective", "true", "cpu", "nvme/nvme", "ring", "tree", "h100-80gb", "nope", "\u202e"]
BASE = {
    "estimate": [["estimate", "--params", "7B", "--gpus", "8"], ["estimate", "--model", "{cfg}", "--gpus", "2"],
                 ["estimate", "--model", "{cfg}", "--engine", "fsdp2", "--gpus", "2"],
                 ["estimate", "--model", "{cfg}", "--engine", "deepspeed", "--deepspeed-config", "{ds}", "--gpus", "2"],
                 ["estimate", "--shapes", "{shapes}", "--gpus", "4", "--json"]],
    "plan": [["plan", "--params", "7B", "--gpu", "h100-80gb"], ["plan", "--model", "{cfg}", "--gpu", "h100-80gb"],
             ["plan", "--model", "{cfg}", "--gpu", "a100-40gb", "--engine", "fsdp2"],
             ["plan", "--model", "{cfg}", "--gpu", "h100-80gb", "--engine", "deepspeed", "--deepspeed-config", "{ds}"]],
    "sweep": [["sweep", "--params", "1B,7B", "--gpus", "8,64"], ["sweep", "--model", "{cfg}", "--gpus", "2,4"],
              ["sweep", "--model", "{cfg}", "--engine", "deepspeed", "--deepspeed-config", "{ds}", "--out", "{out}"],
              ["sweep", "--shapes", "{shapes}", "--out", "{out}"]],
    "plot": [["plot", "--params", "7B", "--out", "{png}"], ["plot", "--model", "llama2-7b", "--view", "comm",
                                                            "--out", "{png}"]],
    "validate": [["validate", "--simulated", "--model", "{cfg}", "--world-size", "2", "--stage", "1", "--steps", "2"]],
}  # fmt: skip
OPTIONS = {  # option -> the pool its fuzzed value comes from
    **dict.fromkeys(["--gpus", "--params", "--model-parallel", "--micro-batch", "--grad-accum", "--seq-len",
                     "--gpu-memory", "--host-memory", "--bw", "--inter-bw", "--peak-tflops", "--mfu", "--headroom",
                     "--stage", "--steps", "--world-size", "--gpus-per-node", "--timeout", "--tolerance"], NUMBERS),
    **dict.fromkeys(["--param-dtype", "--grad-dtype", "--optimizer", "--optimizer-dtype", "--checkpointing",
                     "--offload", "--algorithm", "--gpu", "--engine", "--reduce-dtype", "--reshard-after-forward",
                     "--model", "--interconnect", "--units", "--view"], TEXT),
}  # fmt: skip
PATHS = ["{cfg}", "{ds}", "{shapes}", "{dir}", "/dev/null", "{link}", "{d}/sub/../cfg.json", "{hard}", "{d}/no/x.csv",
         "a" * 300, "{d}/é.csv"]
NAN = re.compile(r"\b(nan|inf|NaN|Infinity)\b")


class CaseTimeout(BaseException):
    """A case ran past its timeout (raised by SIGALRM; BaseException so that no handler swallows it)."""


@dataclass
class Report:
    ran: int = 0
    exits: dict = field(default_factory=dict)
    broken: list = field(default_factory=list)
    seconds: float = 0.0


def _files(folder: Path, rng: random.Random) -> dict[str, str]:
    """The case's input files: a config.json (maybe with a key changed), a ds_config, a shapes file."""
    family = rng.choice(list(CONFIGS))
    config = dict(CONFIGS[family])
    if rng.random() < 0.6:
        key = rng.choice(CONFIG_KEYS)
        bound = dimension_limit(key)
        config[key] = rng.choice([*ODD_JSON, bound, bound + 1, MAX_LAYERS + 1])
    ds = {"zero_optimization": {"stage": 2}}
    if rng.random() < 0.4:
        path = rng.choice(DS_KEYS)
        section = ds
        for k in path[:-1]:
            section = section.setdefault(k, {})
        section[path[-1]] = rng.choice(ODD_JSON)
    shapes = [[4, 4], [3]] if rng.random() < 0.8 else rng.choice([[], [[0]], [[-1]], [[10**16]], [["x"]], {"a": 1}])
    (folder / "cfg.json").write_text(json.dumps(config))
    (folder / "ds.json").write_text(json.dumps(ds))
    (folder / "shapes.json").write_text(json.dumps(shapes))
    (folder / "dir").mkdir(exist_ok=True)
    (folder / "sub").mkdir(exist_ok=True)
    for name, target in (("link", "cfg.json"), ("hard", "cfg.json")):
        (folder / name).unlink(missing_ok=True)
    (folder / "link").symlink_to(folder / "cfg.json")
    (folder / "hard").hardlink_to(folder / "cfg.json")
    d = str(folder)
    return {"{cfg}": f"{d}/cfg.json", "{ds}": f"{d}/ds.json", "{shapes}": f"{d}/shapes.json", "{dir}": f"{d}/dir",
            "{link}": f"{d}/link", "{hard}": f"{d}/hard", "{d}": d, "{out}": f"{d}/out.csv", "{png}": f"{d}/out.png"}


def _fill(argv: list[str], names: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for k, v in names.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def _mutate(argv: list[str], rng: random.Random) -> list[str]:
    """``argv`` with one to three options set to a fuzzed value (added when absent)."""
    argv = list(argv)
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.25 and ("--out" in argv or "--json" in argv or argv[0] in ("sweep", "plot")):
            flag = "--out" if argv[0] != "validate" else "--json"
            value = rng.choice(PATHS)
        else:
            flag = rng.choice(list(OPTIONS))
            value = rng.choice(OPTIONS[flag])
        if flag in argv and flag not in ("--world-size", "--stage"):
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


def _inputs(argv: list[str]) -> list[Path]:
    """The files ``argv`` reads: the value of every option but the output (``--out``, ``validate --json``)
    that names an existing file."""
    out = {i + 1 for i, a in enumerate(argv) if a in ("--out", "--json")}
    return [Path(a) for i, a in enumerate(argv) if i not in out and i > 0 and len(a) < 4000 and _is_file(a)]


def _is_file(name: str) -> bool:
    try:
        return Path(name).is_file()
    except (OSError, ValueError):
        return False


def _digest(files: list[Path]) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files if _is_file(str(p))}


def _alarm(_signum, _frame) -> None:
    raise CaseTimeout()


def _cli_case(argv: list[str], folder: Path, timeout_s: float) -> tuple[str, str | None]:
    """(exit label, broken promise or None) of ``zeroplan ARGV``."""
    inputs = _inputs(argv)
    before = _digest(inputs)
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        r = CliRunner().invoke(app, argv)
    except CaseTimeout:
        return "timeout", f"no answer within {timeout_s:g} s"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return "exception", f"{type(r.exception).__name__}: {str(r.exception)[:200]}"
    code = r.exit_code
    allowed = (0, 1, 2) if argv[0] == "validate" else (0, 2)
    if code not in allowed:
        return f"exit {code}", f"exit {code}: {r.output[-300:]!r}"
    if code == 2:
        lines = r.stderr.splitlines()
        if r.stdout or len(lines) != 1 or not lines[0].startswith("zeroplan: error: ") or "Traceback" in r.stderr:
            return "exit 2", f"not one error line: stdout={r.stdout[:100]!r} stderr={r.stderr[:300]!r}"
    if code == 0 and NAN.search(r.stdout):
        return "exit 0", f"nan or inf printed: {NAN.search(r.stdout).group()!r}"
    after = _digest(inputs)
    if any(after.get(name) != digest for name, digest in before.items()):
        return f"exit {code}", "an input file changed"
    return f"exit {code}", None


API = {
    "estimate": (lambda **k: zeroplan.estimate(**k), {"params": 7e9, "gpus": 8}),
    "estimate-model": (lambda **k: zeroplan.estimate(**k), {"model": "{cfg}", "gpus": 2}),
    "plan": (lambda **k: zeroplan.plan(**k), {"model": "{cfg}", "gpu": "h100-80gb", "gpus": 8}),
    "sweep": (lambda **k: zeroplan.sweep(**k), {"model": "{cfg}", "gpus": (2, 4)}),
}
API_VALUES = [None, True, -1, 0, 1, 8, 2**24 + 1, 10**30, 1.5, math.nan, math.inf, "8", "", "7B", b"x", [], [8],
              (2, 2), {}, {"a": 1}, object(), Path("cfg.json")]  # fmt: skip
API_KEYS = ["params", "gpus", "model", "model_parallel", "stage", "seq_len", "micro_batch", "grad_accum",
            "checkpointing", "engine", "gpu_memory_bytes", "param_dtype", "optimizer", "tensor_numels", "gpu",
            "headroom", "offload", "stages", "ds_config", "reshard_after_forward"]  # fmt: skip


def _api_case(rng: random.Random, names: dict[str, str], timeout_s: float) -> tuple[str, str, str | None]:
    name = rng.choice(list(API))
    function, kwargs = API[name]
    kwargs = {k: names.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    for _ in range(rng.randint(1, 2)):
        kwargs[rng.choice(API_KEYS)] = rng.choice(API_VALUES)
    text = f"zeroplan.{name.split('-')[0]}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        function(**kwargs)
        return text, "ok", None
    except ValueError:
        return text, "ValueError", None
    except CaseTimeout:
        return text, "timeout", f"no answer within {timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001 - the promise is: nothing but ValueError
        return text, type(exc).__name__, f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def run_cases(seed: int = 18, count: int = 800, folder: Path | None = None, timeout_s: float = 60,
              include_validate: bool = False) -> Report:
    """Run ``count`` cases drawn with ``seed``; the report counts exits and lists each broken promise."""
    rng = random.Random(seed)
    report = Report()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(folder or scratch)
        surfaces = ["estimate", "plan", "sweep", "plot", "api", "api"] + (["validate"] if include_validate else [])
        for i in range(count):
            case_dir = folder / f"case{i}"
            case_dir.mkdir(parents=True, exist_ok=True)
            names = _files(case_dir, rng)
            surface = rng.choice(surfaces)
            if surface == "api":
                text, label, broken = _api_case(rng, names, timeout_s)
            else:
                argv = _fill(_mutate(rng.choice(BASE[surface]), rng), names)
                text = "zeroplan " + " ".join(a if len(a) < 60 else a[:20] + f"...({len(a)})" for a in argv)
                label, broken = _cli_case(argv, case_dir, timeout_s)
            report.ran += 1
            report.exits[label] = report.exits.get(label, 0) + 1
            if broken is not None:
                report.broken.append(f"case {i} (seed {seed}): {text}\n    -> {broken}")
    report.seconds = time.perf_counter() - start
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--count", type=int, default=800)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--validate", action="store_true", help="also fuzz `zeroplan validate --simulated`")
    args = parser.parse_args()
    report = run_cases(args.seed, args.count, None, args.timeout, args.validate)
    print(f"{report.ran} cases, seed {args.seed}, {report.seconds:.0f} s; outcomes: "
          + ", ".join(f"{k} {v}" for k, v in sorted(report.exits.items())))  # fmt: skip
    print(f"{len(report.broken)} broken promises" + (":" if report.broken else ""))
    for line in report.broken:
        print(line)


if __name__ == "__main__":
    main()
