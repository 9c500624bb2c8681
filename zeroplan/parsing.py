"""CLI string parsers: counts (7.5B), byte sizes (80GiB), comma-separated lists, offload specs.

Each raises ValueError with one line naming the option and the text. GB = 1e9 bytes (the ZeRO paper's
unit); GiB = 2**30.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal

from zeroplan.formulas.offload import DEVICES, Offload
from zeroplan.types import show

BYTE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
COUNT_SUFFIXES: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
MAX_DIGITS = 4000
"""Numbers with more digits are refused as text, before any conversion (Python's own limit for int
text is 4300 digits); below it, the ranges of ``zeroplan.types`` refuse what is too large, naming the
limit."""
OFFLOAD_HELP = (
    "offload: 'none', or OPT[/PARAMS] with each of none, cpu, nvme: where the optimizer states "
    "(and the parameters, stage 3 only) live, e.g. cpu, nvme, cpu/cpu, nvme/nvme, none/cpu"
)

_NUMBER = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _decimal(text: str, what: str) -> Decimal:
    """The exact value of a number written in decimal ('7.5', '9007199254740993', '1e3'); no float."""
    value = Decimal(text)
    if value.is_finite() and value.adjusted() > MAX_DIGITS:
        raise ValueError(f"{what}={show(text)}: out of range")
    return value


def parse_count(text: str, what: str = "params") -> int:
    """'7.5e9', '7.5B', '70b', '1T', '9007199254740993' -> the exact whole number; ValueError with a
    one-line message for text that is not a positive whole count ('7.5', '1.5K' is 1500 and fine)."""
    m = re.fullmatch(_NUMBER + r"\s*([kKmMbBtT]?)", str(text).strip())
    if not m:
        raise ValueError(f"{what}={show(text)!r}: not a number (examples: 7.5e9, 7.5B, 1T)")
    value = _decimal(m.group(1), what) * COUNT_SUFFIXES[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{what}={text!r}: must be a positive finite number")
    if value != value.to_integral_value():
        raise ValueError(f"{what}={text!r}: must be a whole number of parameters")
    return int(value)


def parse_bytes(text: str, what: str = "gpu-memory") -> int:
    """'80GiB', '32GB', '141 GB', '8e10' (bytes) -> exact whole bytes; ValueError with a one-line message,
    also for a fraction of a byte ('1.5' is not 1 byte)."""
    m = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", str(text).strip())
    unit = m.group(2).lower() if m else ""
    if not m or unit not in BYTE_UNITS and unit != "":
        raise ValueError(f"{what}={show(text)!r}: expected a size such as 80GiB, 32GB or 8e10 (bytes)")
    value = _decimal(m.group(1), what) * BYTE_UNITS.get(unit, 1)
    if value < 1:
        raise ValueError(f"{what}={text!r}: must be a positive size")
    if value != value.to_integral_value():
        raise ValueError(f"{what}={text!r}: must be a whole number of bytes")
    return int(value)


def parse_whole(text: str, what: str) -> int:
    """'64' -> 64; ValueError for '6.5', 'x', '1e3' (GPU counts and degrees are written as integers)."""
    if not re.fullmatch(r"[-+]?[0-9]+", text):
        raise ValueError(f"{what}={show(text)!r}: not a whole number")
    if len(text.lstrip("+-0")) > MAX_DIGITS:
        raise ValueError(f"{what}={show(text)}: out of range ({len(text)} digits)")
    return int(text)


def parse_list(text: str, what: str, parse: Callable[[str], object]) -> tuple:
    """'8,64,512' -> (8, 64, 512) with ``parse`` per item; ValueError naming the option and the item."""
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise ValueError(f"{what}={text!r}: give one or more comma-separated values")
    if "" in items:
        raise ValueError(f"{what}={text!r}: empty item between commas")
    return tuple(parse(t) for t in items)


def parse_wholes(text: str, what: str) -> tuple[int, ...]:
    """'8,64,512' -> (8, 64, 512): a list of whole numbers."""
    return parse_list(text, what, lambda t: parse_whole(t, what))


def parse_counts(text: str, what: str = "params") -> tuple[int, ...]:
    """'7B,70B' -> (7000000000, 70000000000): a list of counts."""
    return parse_list(text, what, lambda t: parse_count(t, what))


def parse_offload(text: str | Offload) -> Offload:
    """'none' | 'cpu' | 'nvme' | 'cpu/cpu' | 'none/cpu' ... -> Offload(optimizer, params); else ValueError."""
    if isinstance(text, Offload):
        return text
    parts = str(text).strip().lower().split("/")
    if len(parts) > 2 or not all(p in DEVICES for p in parts):
        raise ValueError(f"offload={text!r}: expected {OFFLOAD_HELP.removeprefix('offload: ')}")
    return Offload(parts[0], parts[1] if len(parts) == 2 else "none")


def parse_reshard(text: str) -> bool | int:
    """``--reshard-after-forward``: true, false, or a whole number of ranks (FSDP2's int: the post-forward
    group size, a divisor of N_d checked against N_d by ``zeroplan.engines.fsdp2.post_forward_group``)."""
    key = text.strip().lower()
    if key in ("true", "false"):
        return key == "true"
    if not re.fullmatch(r"[0-9]{1,9}", key) or int(key) < 1:
        raise ValueError(f"reshard-after-forward={show(text)!r}: expected true, false or a whole number of ranks >= 1")
    return int(key)
