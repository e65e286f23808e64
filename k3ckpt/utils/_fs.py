"""Filesystem primitives shared by every command that writes."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_within(path: Path, root: Path) -> bool:
    """True when ``path`` is ``root`` or lies inside it (both resolved; neither need exist)."""
    p, r = Path(path).resolve(), Path(root).resolve()
    return p == r or r in p.parents
