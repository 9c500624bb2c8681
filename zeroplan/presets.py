"""Hardware and reference-model presets: data files in ``zeroplan/data/`` validated by pydantic models.

Each preset cites its source in the data file. Units: bytes for memory (exact integers), FLOP/s for
compute, GB/s (1e9 bytes/s, one direction, per GPU) for links, seconds for latency. Names are looked up
case-insensitively; an unknown name raises ValueError listing the known ones.
"""

import json
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict

from zeroplan.architectures.hf_config import read_hf_config, spec_from_hf_config
from zeroplan.architectures.spec import TransformerSpec, numels, transformer_shapes
from zeroplan.hub import cached_config, is_hub_name
from zeroplan.types import Bandwidth, ByteSize, Flops, Latency, SeqLen


class GpuSpec(BaseModel):
    """One accelerator: memory in exact bytes, dense 16-bit peak FLOP/s, its default links."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)  # built when a preset is first read

    name: str
    description: str
    memory_bytes: ByteSize
    """nominal HBM capacity in bytes (see the data file's ``about`` for the convention)."""
    peak_flops: Flops
    """dense 16-bit tensor-core peak, FLOP/s."""
    peak_flops_dtype: str
    intra_node: str
    """name of the interconnect preset that links GPUs inside a node."""
    host_link: str
    """name of the interconnect preset between GPU and host memory (offload traffic)."""
    source: str


class LinkSpec(BaseModel):
    """A link as the alpha-beta model sees it: per-GPU one-direction bandwidth and per-step latency."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    name: str
    scope: Literal["intra", "inter"]
    """intra: inside a node (NVLink, PCIe, Infinity Fabric); inter: between nodes (a NIC per GPU)."""
    bandwidth_gbps: Bandwidth
    """GB/s (1e9 bytes/s) one GPU sends in one direction; used as the nccl-tests bus bandwidth."""
    alpha_s: Latency
    """latency of one ring step, seconds."""
    source: str = "given on the command line"

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9


class ModelPreset(BaseModel):
    """A reference model: the architecture keys of its Hugging Face ``config.json``, read by
    ``zeroplan.architectures.hf_config`` as a user's file is; Ψ follows from ``architectures.spec.transformer_shapes``."""

    model_config = ConfigDict(extra="forbid", frozen=True, ignored_types=(cached_property,), defer_build=True)

    name: str
    seq_len: SeqLen
    """training context length, tokens (the default --seq-len)."""
    source: str
    hf_config: dict[str, Any]
    """config.json keys (``model_type`` and the architecture); absent keys take transformers' defaults. Read
    (and so checked) when the preset is first used, once: loading the table built every preset's architecture
    for the one a command names (issue 16); tests/test_architectures.py reads each against transformers."""

    @cached_property
    def spec(self) -> TransformerSpec:
        """The architecture; ValueError (one line) for a preset that does not read: a broken data file."""
        return spec_from_hf_config(self.hf_config, f"model preset {self.name!r}")

    @property
    def tensor_numels(self) -> tuple[int, ...]:
        """Elements of every parameter tensor, in registration order (exact padding per tensor)."""
        return numels(transformer_shapes(self.spec))

    @property
    def params(self) -> int:
        return sum(self.tensor_numels)


DATA_DIR = Path(__file__).parent / "data"
"""The preset files, installed beside this module (``[tool.setuptools.package-data]``). Read as plain files:
``importlib.resources`` (readers for zip archives and namespace packages, which an installed zeroplan is not)
cost every command about 6 CPU-ms to import."""


def _read(filename: str) -> dict:
    return json.loads((DATA_DIR / filename).read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def gpu_presets() -> dict[str, GpuSpec]:
    """Every GPU preset by name, validated."""
    return {g["name"]: GpuSpec(**g) for g in _read("gpus.json")["gpus"]}


@lru_cache(maxsize=None)
def interconnect_presets() -> dict[str, LinkSpec]:
    """Every interconnect preset by name, validated."""
    return {c["name"]: LinkSpec(**c) for c in _read("interconnects.json")["interconnects"]}


@lru_cache(maxsize=None)
def model_presets() -> dict[str, ModelPreset]:
    """Every reference model by name, validated."""
    return {m["name"]: ModelPreset(**m) for m in _read("models.json")["models"]}


def _lookup(table: dict, name: str, what: str):
    key = str(name).strip().lower()
    if key not in table:
        raise ValueError(f"unknown {what} {name!r}: known {what}s are {', '.join(table)}")
    return table[key]


def get_gpu(name: str) -> GpuSpec:
    """The GPU preset ``name``; ValueError listing the known names otherwise."""
    return _lookup(gpu_presets(), name, "gpu")


def get_interconnect(name: str) -> LinkSpec:
    """The interconnect preset ``name``; ValueError listing the known names otherwise."""
    return _lookup(interconnect_presets(), name, "interconnect")


def get_model(name: str) -> ModelPreset:
    """The reference model ``name``; ValueError listing the known names otherwise."""
    return _lookup(model_presets(), name, "model")


GpuName = Annotated[str, AfterValidator(lambda v: get_gpu(v).name)]
"""A GPU preset name, stored as the preset spells it."""
ModelName = Annotated[str, AfterValidator(lambda v: get_model(v).name)]
"""A reference-model preset name, stored as the preset spells it."""


def gpu_capacity(gpu: Optional[str], gpu_memory_bytes: Optional[int]) -> tuple[Optional[int], Optional[str]]:
    """(bytes, label) from a GPU preset name or a memory size (not both); (None, None) if neither."""
    if gpu is not None and gpu_memory_bytes is not None:
        raise ValueError("give at most one of --gpu and --gpu-memory")
    if gpu is not None:
        spec = get_gpu(gpu)
        return spec.memory_bytes, spec.name
    return gpu_memory_bytes, None


def is_config_path(name_or_path: str) -> bool:
    """``--model`` names a config file (not a preset) when it ends in ``.json`` or exists as a path."""
    if name_or_path.endswith(".json"):
        return True
    try:
        return Path(name_or_path).exists()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte: no file, so not a path
        return False


def _model_ref(v: str) -> str:
    """A preset keeps the preset's spelling; a config file must read (one-line error otherwise)."""
    resolve_model(v)
    return v if is_config_path(v) or is_hub_name(v) else get_model(v).name


def resolve_model(name_or_path: str) -> TransformerSpec:
    """The architecture ``--model`` names: a local Hugging Face ``config.json`` when ``name_or_path``
    exists or ends in ``.json`` (read, never downloaded), the cached config.json of ``ORG/NAME[@REV]``
    (``zeroplan.hub``), else a reference model preset; ValueError (one line, listing the presets) otherwise."""
    if not isinstance(name_or_path, str):
        raise ValueError(f"model={name_or_path!r}: expected a preset name or the path of a config.json")
    if is_config_path(name_or_path):
        return read_hf_config(name_or_path)
    if is_hub_name(name_or_path):
        return read_hf_config(cached_config(name_or_path))
    try:
        return get_model(name_or_path).spec
    except ValueError as exc:
        raise ValueError(f"{exc} (or the path of a Hugging Face config.json)") from None


DEFAULT_SEQ_LEN = 2048
"""Tokens per sequence when neither ``--seq-len`` nor a preset gives one (GPT-3's context); a config
file's default is its maximum positions capped at this (a 128k-position config is rarely trained at
128k, and a peak at full context would be the largest answer, not the usual one)."""


def model_seq_len(name_or_path: str, spec: TransformerSpec) -> int:
    """The default ``--seq-len`` of ``--model``: the preset's training context, or for a config file
    min(maximum positions, ``DEFAULT_SEQ_LEN``)."""
    if not is_config_path(name_or_path):
        key = name_or_path.strip().lower()
        if key in model_presets():
            return min(model_presets()[key].seq_len, spec.max_seq_len)
    return min(spec.max_seq_len, DEFAULT_SEQ_LEN)


ModelRef = Annotated[str, AfterValidator(_model_ref)]
"""``--model``: a model preset (stored as the preset spells it) or the path of a config.json that reads."""
