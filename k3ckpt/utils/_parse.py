"""How sizes people write are read back: the CLI's size options and the ``K3CKPT_*`` byte
variables go through one parser, so ``16M`` means the same everywhere."""

from __future__ import annotations

import re

#: Unit -> bytes, case-insensitive. K/M/G/T (and KB...) are decimal, as disks and the CLI's
#: output count; KiB/MiB/GiB/TiB are binary.
SIZE_UNITS: dict[str, int] = {
    "": 1, "B": 1,
    "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3, "T": 1000**4, "TB": 1000**4,
    "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
}
#: What to show a user who wrote something else.
SIZE_EXAMPLES = "examples: 64MiB, 5GiB, 20GB, 16M, 1048576"

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit (``64MiB``, ``5GiB``, ``20GB``, ``16M``,
    ``1.5G``, ``1048576``). Fractions round down to a whole byte.

    Raises:
        ValueError: ``text`` is not a size (negative numbers are not sizes either).
    """
    m = _SIZE.fullmatch(text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size ({SIZE_EXAMPLES})")
    return int(float(m.group(1)) * SIZE_UNITS[unit])
