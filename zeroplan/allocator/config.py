"""The caching allocator's sizes and options: constants, ``PYTORCH_CUDA_ALLOC_CONF`` and the size rules.

Source: ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch, the stored copy at commit 001074d2, the
torch 2.5-2.8 layout) and the generic ``c10/core/CachingDeviceAllocator`` that later releases moved the
same rules into (unchanged: ``round_size``, ``get_allocation_size``, ``should_split``, ``get_free_block``);
the option parser is ``c10/core/AllocatorConfig.cpp`` (``AllocatorConfig::parseArgs``, commit 065861fb).
Every constant below is named as it is there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20
K_MIN_BLOCK_SIZE = 512
"""``kMinBlockSize``: every request is rounded up to a multiple of 512 bytes."""
K_SMALL_SIZE = MIB
"""``kSmallSize``: requests of at most 1 MiB (after rounding) go to the small pool."""
K_SMALL_BUFFER = 2 * MIB
"""``kSmallBuffer``: small requests are packed in 2 MiB segments."""
K_LARGE_BUFFER = 20 * MIB
"""``kLargeBuffer``: requests between 1 and 10 MiB get a 20 MiB segment; also the expandable-segment page of
the large pool and the default ``max_non_split_rounding_mb``."""
PAGE_BYTES = {True: K_SMALL_BUFFER, False: K_LARGE_BUFFER}
"""Expandable segments map pages of ``kSmallBuffer`` (small pool) or ``kLargeBuffer`` (large pool)."""
K_MIN_LARGE_ALLOC = 10 * MIB
"""``kMinLargeAlloc``: from 10 MiB on, a segment is the request rounded up to ``kRoundLarge``."""
K_ROUND_LARGE = 2 * MIB
"""``kRoundLarge``: large segments are rounded up to 2 MiB."""
ROUNDUP_INTERVALS = 16
"""``kRoundUpPowerOfTwoIntervals``: ``roundup_power2_divisions`` holds one value per power of two from 1 MiB
(``kRoundUpPowerOfTwoStart``) to 64 GiB."""
NO_LIMIT = (1 << 64) - 1
"""``std::numeric_limits<size_t>::max()``: ``max_split_size`` when unset (every block may be split)."""


@dataclass(frozen=True)
class AllocatorConfig:
    """The options of ``PYTORCH_CUDA_ALLOC_CONF`` the native allocator reads, with torch's defaults."""

    expandable_segments: bool = False
    """One growing segment per stream and pool, mapped in pages (2 MiB small, 20 MiB large)."""
    max_split_size_bytes: int = NO_LIMIT
    """Blocks of at least this size are never split (``max_split_size_mb``; >= 20 MiB)."""
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    """An oversize request takes a cached block less than this much bigger (``max_non_split_rounding_mb``)."""
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * ROUNDUP_INTERVALS)
    """Divisions per power-of-two interval from 1 MiB up (0 or 1: plain 512-byte rounding)."""
    garbage_collection_threshold: float = 0.0
    """Reclaim unused cached blocks above this fraction of the allowed memory (only with a memory fraction)."""

    def __post_init__(self) -> None:
        if self.max_split_size_bytes < K_LARGE_BUFFER:
            raise ValueError(f"max_split_size_bytes={self.max_split_size_bytes}: must be >= {K_LARGE_BUFFER} (20 MiB)")
        if self.max_non_split_rounding_bytes < K_LARGE_BUFFER:
            raise ValueError(f"max_non_split_rounding_bytes={self.max_non_split_rounding_bytes}: must be >= "
                             f"{K_LARGE_BUFFER} (20 MiB)")  # fmt: skip
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise ValueError(f"roundup_power2_divisions has {len(self.roundup_power2_divisions)} values: needs "
                             f"{ROUNDUP_INTERVALS}")  # fmt: skip
        bad = [d for d in self.roundup_power2_divisions if d != 0 and d & (d - 1)]
        if bad:
            raise ValueError(f"roundup_power2_divisions={bad[0]}: must be a power of 2 or 0")
        if not (self.garbage_collection_threshold == 0 or 0 < self.garbage_collection_threshold < 1):
            raise ValueError(f"garbage_collection_threshold={self.garbage_collection_threshold}: must be in (0, 1)")

    def divisions(self, size: int) -> int:
        """``AllocatorConfig::roundup_power2_divisions(size)``: the divisions of ``size``'s interval."""
        index = size.bit_length() - 1 - (MIB.bit_length() - 1)
        return self.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]


def round_size(size: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """``DeviceCachingAllocator::round_size``: the block size a request of ``size`` bytes asks the pool for."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.divisions(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: 1200 with 4 divisions of [1024, 2048) -> 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def least_split_rest(small: bool, expandable: bool) -> int:
    """``should_split``'s least rest: a block serving a request is split when at least this much of it is left
    (small pool or expandable segments: 512 B; large pool: over 1 MiB, and the request under ``max_split_size``).
    The one home of the rule for the allocator model and its fast paths (``caching``, ``plain_loop``, ``balanced``,
    ``cached_runs``)."""
    return K_MIN_BLOCK_SIZE if small or expandable else K_SMALL_SIZE + 1


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` gets for a rounded request that no cached block fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def is_small(size: int) -> bool:
    """``get_pool``: a rounded request of at most ``kSmallSize`` goes to the small pool."""
    return size <= K_SMALL_SIZE


def _tokens(text: str) -> list[str]:
    """``AllocatorConfig::lexArgs``: ``,``, ``:``, ``[`` and ``]`` are tokens of their own; spaces vanish."""
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif ch != " ":
            buf += ch
    return out + ([buf] if buf else [])


def _int(value: str, key: str) -> int:
    if not value.isdigit():
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}:{value}: expected a whole number")
    return int(value)


def _bool(value: str, key: str) -> bool:
    if value not in ("True", "False"):
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}:{value}: expected True or False")
    return value == "True"


def _divisions(tok: list[str], i: int) -> tuple[tuple[int, ...], int]:
    """``parseRoundUpPower2Divisions``: ``4`` (every interval) or ``[256:1,512:2,>:8]`` (from a size on)."""
    if tok[i] != "[":
        value = _int(tok[i], "roundup_power2_divisions")
        return (value,) * ROUNDUP_INTERVALS, i
    out, first, last = [0] * ROUNDUP_INTERVALS, True, 0
    i += 1
    while i < len(tok) and tok[i] != "]":
        at = tok[i]
        if i + 2 >= len(tok) or tok[i + 1] != ":":
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions: expected size:divisions at {at!r}")
        value = _int(tok[i + 2], "roundup_power2_divisions")
        if at == ">":
            out[last:] = [value] * (ROUNDUP_INTERVALS - last)
        else:
            mb = _int(at, "roundup_power2_divisions")
            if mb == 0 or mb & (mb - 1):
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions {mb}: the interval must be a "
                                 "power of 2 (MiB)")  # fmt: skip
            index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first:
                out[:index] = [value] * index
                first = False
            out[index], last = value, index
        i += 3
        if i < len(tok) and tok[i] == ",":
            i += 1
    if i >= len(tok):
        raise ValueError("PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions: missing ']'")
    return tuple(out), i


IGNORED = ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
           "pinned_use_background_threads", "pinned_reserve_segment_size_mb",
           "graph_capture_record_stream_reuse")  # fmt: skip
"""Keys torch accepts that do not change where device blocks go (``backend:cudaMallocAsync`` is refused)."""


def parse_alloc_conf(text: str) -> AllocatorConfig:
    """``PYTORCH_CUDA_ALLOC_CONF`` as the native allocator reads it (``AllocatorConfig::parseArgs``): keys
    ``expandable_segments``, ``max_split_size_mb``, ``max_non_split_rounding_mb``, ``roundup_power2_divisions``,
    ``garbage_collection_threshold``; a bad string raises ValueError with one line quoting the part."""
    tok, values, i = _tokens(text), {}, 0
    while i < len(tok):
        key = tok[i]
        if i + 2 >= len(tok) or tok[i + 1] != ":":
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: expected key:value at {key!r}")
        value = tok[i + 2]
        if key == "expandable_segments":
            values["expandable_segments"] = _bool(value, key)
        elif key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = _int(value, key)
            if mb * MIB < K_LARGE_BUFFER:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}:{mb}: too small, must be >= 20")
            values[key.replace("_mb", "_bytes")] = mb * MIB
        elif key == "garbage_collection_threshold":
            try:
                fraction = float(value)
            except ValueError:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}:{value}: expected a number") from None
            if not 0 < fraction < 1:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}:{value}: must be in (0.0, 1.0)")
            values[key] = fraction
        elif key == "roundup_power2_divisions":
            values[key], i = _divisions(tok, i + 2)
            i -= 2
        elif key == "backend" and value != "native":
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF backend:{value}: only the native allocator is modelled")
        elif key not in IGNORED:
            raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {key}: unrecognized option")
        i += 3
        if i < len(tok):
            if tok[i] != ",":
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {text!r}: expected ',' before {tok[i]!r}")
            i += 1
    return AllocatorConfig(**values)
