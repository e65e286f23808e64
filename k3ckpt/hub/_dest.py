"""The destination directory of a fetch: which local path a hub path may take, the ``.part``
files written in place, and the lock that keeps two fetches out of one directory.

Shared by the downloader (:mod:`k3ckpt.hub.download`) and the rank-aware fetch
(:mod:`k3ckpt.hub.rankfetch`), which write into the same kind of destination under the same lock.

The lock, ``dest/.k3ckpt-fetch.lock``, is :class:`k3ckpt.utils.lock.DirLock` (the one reshard
and unshard take on their output too): created exclusively with its content in place (atomic
on NFS v3+), holding host, pid, start time and a token; stale when its pid is dead (this host)
or older than ``K3CKPT_LOCK_STALE_SECONDS`` (another host), and then broken under a second
lock (``.k3ckpt-fetch.lock.break``).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..env import K3CKPT_LOCK_STALE_SECONDS
from ..errors import FetchLockedError
from ..utils import is_within, pwrite_all
from ..utils.lock import LOCK_UNREADABLE_GRACE, DirLock
from ..utils.ownership import OwnedDir, check_output_dir, claim_output_dir

#: Name of the lock file in the destination directory.
LOCK_NAME = ".k3ckpt-fetch.lock"
#: Another host's lock older than this (seconds) is considered abandoned (env overrides).
LOCK_STALE_SECONDS = K3CKPT_LOCK_STALE_SECONDS.default
__all__ = ["LOCK_NAME", "LOCK_STALE_SECONDS", "LOCK_UNREADABLE_GRACE", "DestLock", "check_dest", "claim_dest",
           "create_part", "open_part", "resumable", "target", "unlink", "unsafe_reason"]
#: Endings of the working files next to a file being fetched: a hub path may not take them.
WORK_SUFFIXES = (".part", ".part.journal", ".part.journal.tmp")
#: ``open`` flag: never through a symlink planted at the name.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_DRIVE = re.compile(r"^[A-Za-z]:")


# ----------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------


def unsafe_reason(path: Any) -> str | None:
    """Why a hub-supplied path must not be joined to a local directory, or None if it is fine."""
    if not isinstance(path, str) or not path:
        return "empty or non-string path"
    if "\x00" in path:
        return "contains NUL"
    if "\\" in path:
        return "contains a backslash"
    if path.startswith("/"):
        return "is absolute"
    if _DRIVE.match(path):
        return "starts with a drive letter"
    parts = path.split("/")
    if ".." in parts:
        return "contains '..'"
    if "" in parts or "." in parts:
        return "has an empty or '.' component"
    return None


def target(dest_real: str, rel: str) -> str:
    """The local path for a hub path, or ValueError saying why it is refused.

    Refused: what :func:`unsafe_reason` calls unsafe (absolute, ``..``, backslash, NUL, empty
    components), names that collide with our own working files, and paths whose existing
    components (symlinks included) resolve outside ``dest_real``.
    """
    reason = unsafe_reason(rel)
    if reason is not None:
        raise ValueError(f"refusing the path {rel!r} from the listing: it {reason}")
    if rel == LOCK_NAME or rel.startswith(LOCK_NAME) or rel.endswith(WORK_SUFFIXES):
        raise ValueError(f"refusing the path {rel!r}: it collides with the downloader's working files")
    final = os.path.join(dest_real, *rel.split("/"))
    cur = dest_real
    for comp in rel.split("/"):
        cur = os.path.join(cur, comp)
        if os.path.lexists(cur) and not is_within(cur, dest_real):
            raise ValueError(f"refusing {rel!r}: {os.path.relpath(cur, dest_real)!r} in the destination is a "
                             f"symlink to {os.path.realpath(cur)!r}, outside {dest_real!r}")
    return final


def unlink(path: str) -> None:
    """Remove ``path`` if it is there (a missing file is what we wanted)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def create_part(path: str, size: int, head: bytes = b"") -> int:
    """Create ``path`` exclusively (never through a symlink), reserve ``size`` bytes, write
    ``head`` at offset 0, ``fsync``; return the open descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
    try:
        if size:
            try:
                # Reserve the blocks now: ENOSPC here, not in the middle of chunk 900.
                os.posix_fallocate(fd, 0, size)
            except (AttributeError, OSError):
                os.ftruncate(fd, size)  # filesystems without fallocate: sparse
        if head:
            pwrite_all(fd, head, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_part(part: str, final: str, dest_real: str, rel: str, size: int, head: bytes = b"", *,
              resume: bool) -> int:
    """The descriptor of ``final``'s ``.part``: when resuming, the one on disk (never through a
    symlink); else a new one (:func:`create_part`), after removing whatever was there (an old
    ``.part`` without a valid journal is untrusted; a symlink is not ours).

    Raises:
        ValueError: ``final``'s directory, created now, resolves outside ``dest_real``.
    """
    if resume:
        return os.open(part, os.O_RDWR | NOFOLLOW)
    unlink(part)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    # Checked again now that the directories exist: a symlink planted since the plan was
    # made must not redirect the write outside the destination.
    if not is_within(parent, dest_real):
        raise ValueError(f"refusing to write {rel!r}: its directory resolves to "
                         f"{os.path.realpath(parent)!r}, outside {dest_real!r}")
    return create_part(part, size, head)


def chunk_count(size: int, chunk_size: int) -> int:
    """Chunks of ``chunk_size`` bytes a ``size``-byte file is fetched in (one for an empty file:
    it is still a request and a journal entry). The downloader's jobs and the journals they
    resume from count with this one rule."""
    return max(1, -(-size // chunk_size))


def resumable(journal: str, part: str, size: int, expect: dict[str, Any], count: int, *,
              chunk_size: int | None = None) -> set[int]:
    """The indices the ``journal`` of an earlier run says are on disk, if it and its ``.part``
    belong to this very content: the journal has ``expect``'s values, the ``.part`` is a regular
    file (not a symlink) of ``size`` bytes, every index is below ``count``. Otherwise an empty
    set, and the journal is removed: a stale or foreign journal must not vouch for any byte.

    With ``chunk_size`` (the downloader's journals, whose indices are chunks of the file), a
    journal of another chunk size still counts: a chunk is on disk when every byte of it lies in
    the journal's chunks, which were ``fdatasync``-ed whatever their size (:func:`regroup_chunks`).
    A fetch resumed with another ``--chunk-size``, or after the default changed, keeps its bytes.
    """
    try:
        with open(journal, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError):
        doc = None
    try:
        st = os.lstat(part)
        part_ok = stat.S_ISREG(st.st_mode) and st.st_size == size
    except OSError:
        part_ok = False
    if isinstance(doc, dict) and part_ok:
        old_chunk: Any = doc.get("chunk_size")
        regroup = chunk_size is not None and type(old_chunk) is int and 0 < old_chunk != chunk_size
        keys = [k for k in expect if not (regroup and k == "chunk_size")]  # else the chunk size must match too
        journal_count = chunk_count(size, old_chunk) if regroup else count
        done = doc.get("done")
        if (all(doc.get(k) == expect[k] for k in keys) and isinstance(done, list)
                and all(type(i) is int and 0 <= i < journal_count for i in done)):
            return regroup_chunks(set(done), old_chunk, chunk_size, size) if regroup and chunk_size else set(done)
    unlink(journal)
    return set()


def regroup_chunks(done: set[int], old_chunk: int, new_chunk: int, size: int) -> set[int]:
    """The chunks of ``new_chunk`` bytes of a ``size``-byte file whose every byte lies in one of
    the ``done`` chunks of ``old_chunk`` bytes (none of an empty file: it has no byte to prove)."""
    regrouped = set()
    for j in range(-(-size // new_chunk)):
        first, last = j * new_chunk, min((j + 1) * new_chunk, size) - 1
        if all(i in done for i in range(first // old_chunk, last // old_chunk + 1)):
            regrouped.add(j)
    return regrouped


# ----------------------------------------------------------------------------------------------
# Lock
# ----------------------------------------------------------------------------------------------


class DestLock(DirLock):
    """``dest/.k3ckpt-fetch.lock``: :class:`k3ckpt.utils.lock.DirLock` under fetch's own name,
    raising :class:`~k3ckpt.errors.FetchLockedError`."""

    def __init__(self, dest: str) -> None:
        # a bad K3CKPT_LOCK_STALE_SECONDS fails here, before any download
        super().__init__(dest, LOCK_NAME, command="fetch", stale_seconds=K3CKPT_LOCK_STALE_SECONDS.get(),
                         error=FetchLockedError)


# ----------------------------------------------------------------------------------------------
# Ownership
# ----------------------------------------------------------------------------------------------


def _is_work_file(name: str) -> bool:
    return name.endswith(WORK_SUFFIXES)


def _fetched_before(dest: Path) -> bool:
    """An earlier version's fetch destination: no ownership record, but fetch's own records
    (``.cache/k3ckpt/``: the source revision, rewritten-shard and node digests) are there."""
    recs = dest / ".cache" / "k3ckpt"
    return recs.is_dir() and not recs.is_symlink() and any(recs.iterdir())


def claim_dest(dest_real: str, paths: list[str]) -> OwnedDir:
    """Claim a fetch destination (call it holding the lock): new, empty, or fetch's own
    (:func:`k3ckpt.utils.ownership.claim_output_dir`); ``paths`` are what this run writes.
    ``*.part`` files and journals are never foreign: fetch trusts no byte of them unchecked."""
    safe = [p for p in paths if unsafe_reason(p) is None]  # a hostile name is refused later, per file
    return claim_output_dir(dest_real, "fetch", safe, working=_is_work_file, adopt=_fetched_before)


def check_dest(dest: str | os.PathLike[str]) -> None:
    """Refuse a fetch destination as :func:`claim_dest` would, writing nothing (``--dry-run``)."""
    check_output_dir(dest, "fetch", working=_is_work_file, adopt=_fetched_before)
