"""Free disk space: the up-front check of every command that writes a lot (fetch, reshard,
unshard, mx conversions), and the shortfall an out-of-space error reports.

One wording for every command: ``PATH: not enough free space WHAT: need N bytes (H), only F
bytes (H) free``, so a user (or a script) reads the path, the bytes needed and the bytes free
the same way whichever command refused.
"""

from __future__ import annotations

import os
import shutil

from ..errors import DiskSpaceError
from ._format import human_bytes

__all__ = ["free_bytes", "require_free_space", "space_margin"]


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem."""
    return shutil.disk_usage(path).free


def space_margin(needed: int) -> int:
    """Headroom over the bytes a local copy (reshard, unshard) will write: the small files
    written besides them (manifests, indexes, records), filesystem blocks rounding each file up,
    and what other processes write meanwhile. 1 % plus 1 MiB, so that a run refused up front is
    not one that would have failed at 99 % for want of a few blocks."""
    return needed // 100 + (1 << 20)


def require_free_space(path: str | os.PathLike[str], needed: int, what: str, *,
                       error: type[DiskSpaceError] = DiskSpaceError) -> None:
    """Refuse (``error``, exit 2) when ``path``'s filesystem has fewer than ``needed`` bytes free.

    Args:
        path: An existing directory on the filesystem written to (named in the message).
        needed: Bytes needed, margin included (the caller decides the margin).
        what: What the bytes are for, completing "not enough free space ...", e.g.
            ``"to fetch 3 file(s)"``.
    """
    free = free_bytes(path)
    if needed > free:
        raise error(f"{path}: not enough free space {what}: need {needed} bytes ({human_bytes(needed)}), "
                    f"only {free} bytes ({human_bytes(free)}) free", path=path)
