"""How sizes, counts, fractions, integer sets and lists of names are written for people to read."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def human_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def format_ranges(nums: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``; ``"none"`` for an empty list."""
    if not nums:
        return "none"
    out, start, prev = [], nums[0], nums[0]
    for x in nums[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def format_percent(frac: float) -> str:
    """``0.0123`` -> ``"1.23%"``; tiny fractions keep two significant digits (``"1.0e-05%"``)."""
    if frac == 0:
        return "0%"
    return f"{frac * 100:.2f}%" if frac >= 1e-4 else f"{frac * 100:.1e}%"


def format_some(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` names and how many more: ``"a, b, c and 14 more"``."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
