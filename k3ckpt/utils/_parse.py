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


#: What to show a user who wrote a rate some other way.
RATE_EXAMPLES = "examples: 25Gbit/s, 100Gbit, 7GB/s, 3.5GiB/s"

_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?(bit|B)(?:/s)?\s*", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """Bytes per second in ``text``: bits as ``25Gbit/s`` or ``100Mbit`` (network links), bytes
    as ``7GB/s`` or ``3.5GiB/s`` (disks); ``/s`` is optional. Prefixes as in :func:`parse_size`
    (K/M/G/T decimal, Ki/Mi/Gi/Ti binary). The unit must say which: ``bit`` for bits, an upper-case
    ``B`` for bytes. ``25Gb/s``, ``25Gbps`` and a bare ``25G`` are refused, since people write
    each of them for both.

    Raises:
        ValueError: ``text`` is not a rate, or it is zero.
    """
    m = _RATE.fullmatch(text)
    # "b" alone is upper-case "B" only: the regex ignores case for the prefix and "bit"
    if m is None or m.group(3) == "b":
        raise ValueError(f"{text!r} is not a rate: write bits as Gbit/s or bytes as GB/s ({RATE_EXAMPLES})")
    bits = m.group(3).lower() == "bit"
    prefix = (m.group(2) or "").upper()
    rate = float(m.group(1)) * (SIZE_UNITS[prefix + "B"] if prefix else 1) / (8 if bits else 1)
    if rate <= 0:
        raise ValueError(f"{text!r} is not a rate: it must be more than zero")
    return rate
