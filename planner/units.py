"""Byte sizes as users type them, and as the planner prints them.

The rule (printed with every plan): SI prefixes are powers of ten, IEC prefixes are powers of two.
`40G` = `40GB` = 40 x 10^9 bytes (how GPU datasheets and disk vendors count); `40GiB` = 40 x 2^30 bytes
(how nvidia-smi, `free` and PyTorch's allocator count: nvidia-smi's "MiB" are 2^20 bytes). A bare number is
refused: `--vram 40` could mean either, and the two differ by 7%.
"""

from __future__ import annotations

import re

from planner.errors import PlanError

UNIT_RULE = "G/GB = 10^9 bytes, GiB = 2^30 bytes (M/MB = 10^6, MiB = 2^20; T/TB = 10^12, TiB = 2^40)"

_MULTIPLIERS = {
    "": None,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "ki": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "mi": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "gi": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
    "ti": 2**40,
    "b": 1,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, flag: str = "--vram") -> int:
    """'40G', '40GB', '40GiB', '80000M', '39.5GiB' -> bytes. Refuses bare numbers and unknown units."""
    match = _SIZE.match(str(text))
    if not match:
        raise PlanError(
            f"{flag} {text!r} is not a size: write a number with a unit, e.g. 40GB or 40GiB ({UNIT_RULE})"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _MULTIPLIERS:
        raise PlanError(
            f"{flag} {text!r} has an unknown unit {match.group(2)!r}: use B, MB, MiB, GB, GiB, TB or TiB"
        )
    if _MULTIPLIERS[unit] is None:
        raise PlanError(
            f"{flag} {text!r} has no unit: write {text}GB (10^9 bytes, as datasheets count) "
            f"or {text}GiB (2^30 bytes, as nvidia-smi counts)"
        )
    value = int(round(number * _MULTIPLIERS[unit]))
    if value <= 0:
        raise PlanError(f"{flag} {text!r} must be a positive size, e.g. 40GB")
    return value


def format_bytes(n_bytes: float, unit: str = "GiB") -> str:
    """Bytes for people: '37.25 GiB'. One unit per table keeps columns comparable."""
    scale = {"GiB": 2**30, "MiB": 2**20, "GB": 10**9, "MB": 10**6}[unit]
    value = n_bytes / scale
    return f"{value:.2f} {unit}" if abs(value) >= 0.01 or value == 0 else f"{n_bytes / 2**20:.1f} MiB"


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def parse_headroom(text, vram_bytes: int) -> int:
    """Headroom kept free on each GPU: '5%' or 0.05 (a share of VRAM), or a size like '2GiB'."""
    raw = str(text).strip()
    try:
        if raw.endswith("%"):
            fraction = float(raw[:-1]) / 100
        else:
            fraction = float(raw)
    except ValueError:
        return parse_bytes(raw, "--headroom")
    if not 0 <= fraction < 1:
        raise PlanError(
            f"--headroom {raw} must be a share of VRAM below 100% (e.g. 5%) or a size (e.g. 2GiB)"
        )
    return int(fraction * vram_bytes)


def plural(n: int, noun: str) -> str:
    """The noun as it reads after the count n: GPU for 1, GPUs for 8; (CPU) process, (CPU) processes."""
    if n == 1:
        return noun
    return noun + ("es" if noun.endswith(("s", "x", "sh", "ch")) else "s")


def count(n: int, noun: str) -> str:
    """A count with its noun: 1 GPU, 8 GPUs, 1 process, 2 processes."""
    return f"{n} {plural(n, noun)}"
