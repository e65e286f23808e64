"""The destination directory of a fetch: which local path a hub path may take, the ``.part``
files written in place, and the lock that keeps two fetches out of one directory.

Shared by the downloader (:mod:`k3ckpt.hub.download`) and the rank-aware fetch
(:mod:`k3ckpt.hub.rankfetch`), which write into the same kind of destination under the same lock.

The lock, ``dest/.k3ckpt-fetch.lock``, is created exclusively and with its content already in
place (a hard link of a private temp file, else ``O_CREAT | O_EXCL``; both atomic on NFS v3+,
unlike ``flock``).  It holds host, pid, start time and a random token.  A lock is stale when
its host is this host and its pid is dead, or, for another host (whose pids we cannot check),
when it is older than ``K3CKPT_LOCK_STALE_SECONDS`` (default 24 h).  A stale lock is broken
under a second exclusive-create lock (``.k3ckpt-fetch.lock.break``) so that two processes
breaking the same stale lock cannot delete each other's fresh one.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import time
import uuid
from typing import Any

from ..env import K3CKPT_LOCK_STALE_SECONDS
from ..errors import FetchLockedError
from ..utils import is_within, pwrite_all

#: Name of the lock file in the destination directory.
LOCK_NAME = ".k3ckpt-fetch.lock"
#: Another host's lock older than this (seconds) is considered abandoned (env overrides).
LOCK_STALE_SECONDS = K3CKPT_LOCK_STALE_SECONDS.default
#: A lock file that exists but is still empty/unparseable after this many seconds was left by a
#: process that died between creating and writing it.
LOCK_UNREADABLE_GRACE = 30.0
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


def resumable(journal: str, part: str, size: int, expect: dict[str, Any], count: int) -> set[int]:
    """The indices the ``journal`` of an earlier run says are on disk, if it and its ``.part``
    belong to this very content: the journal has ``expect``'s values, the ``.part`` is a regular
    file (not a symlink) of ``size`` bytes, every index is below ``count``. Otherwise an empty
    set, and the journal is removed: a stale or foreign journal must not vouch for any byte.
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
    if isinstance(doc, dict) and part_ok and all(doc.get(k) == v for k, v in expect.items()):
        done = doc.get("done")
        if isinstance(done, list) and all(type(i) is int and 0 <= i < count for i in done):
            return set(done)
    unlink(journal)
    return set()


# ----------------------------------------------------------------------------------------------
# Lock
# ----------------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True
    return True


def _read_lock(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            info = json.loads(f.read(4096) or b"null")
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _create_synced(path: str, data: bytes) -> None:
    """Create ``path`` exclusively (never through a symlink) holding ``data``, fsync-ed.

    Raises:
        FileExistsError: ``path`` exists.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
    try:
        pwrite_all(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


class DestLock:
    """``dest/.k3ckpt-fetch.lock``: exclusive-create lock with stale-lock detection (see module doc)."""

    def __init__(self, dest: str) -> None:
        self.path = os.path.join(dest, LOCK_NAME)
        self.token = uuid.uuid4().hex
        self.held = False
        self.stale_seconds = K3CKPT_LOCK_STALE_SECONDS.get()  # a bad value fails before any download

    def _try_create(self) -> bool:
        """Create the lock with its content already in it, or return False if it exists.

        The content is written to a private temp file first and then hard-linked to the lock
        name: ``link`` is an atomic exclusive create (also on NFS, where it is the classic
        lock primitive), and nobody ever sees an empty lock file.  Filesystems without hard
        links fall back to ``O_CREAT | O_EXCL`` followed by the write.
        """
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                           "token": self.token}).encode()
        tmp = f"{self.path}.{self.token}.tmp"
        _create_synced(tmp, info)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some FUSE/SMB mounts)
            pass
        finally:
            unlink(tmp)
        try:
            _create_synced(self.path, info)
        except FileExistsError:
            return False
        return True

    def _stale_reason(self, info: dict[str, Any] | None) -> str | None:
        """Why the current lock may be broken, or None if it is (or may be) live."""
        try:
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return "gone"
        if info is None:
            return "unreadable and old" if age > LOCK_UNREADABLE_GRACE else None
        host, pid = info.get("host"), info.get("pid")
        if host == socket.gethostname() and isinstance(pid, int):
            return None if _pid_alive(pid) else f"pid {pid} is not running"
        if age > self.stale_seconds:
            return f"older than {self.stale_seconds:.0f} s"
        return None

    def _holder(self, info: dict[str, Any] | None) -> str:
        if info is None:
            return "an unknown process (the lock file is being written or is unreadable)"
        started = info.get("started")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
        return f"pid {info.get('pid')} on host {info.get('host')} (since {when})"

    def acquire(self) -> None:
        for _ in range(20):
            if self._try_create():
                self.held = True
                return
            info = _read_lock(self.path)
            if self._stale_reason(info) is None:
                raise FetchLockedError(f"{os.path.dirname(self.path)}: another fetch is running there: "
                                       f"{self._holder(info)}; lock file {self.path} (remove it only if "
                                       "that process is gone)")
            self._break(info)
        raise FetchLockedError(f"{self.path}: could not take the lock (contended)")

    def _break(self, seen: dict[str, Any] | None) -> None:
        """Remove a stale lock, holding a second exclusive lock so that two breakers cannot both
        act on the same stale content (the slower one would delete the faster one's new lock)."""
        breaker = self.path + ".break"
        try:
            fd = os.open(breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
        except FileExistsError:
            try:
                if time.time() - os.stat(breaker).st_mtime > LOCK_UNREADABLE_GRACE:
                    unlink(breaker)  # its owner died while breaking
            except FileNotFoundError:
                pass
            time.sleep(0.05)
            return
        os.close(fd)
        try:
            now = _read_lock(self.path)
            if now == seen and self._stale_reason(now) is not None:
                unlink(self.path)
        finally:
            unlink(breaker)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        info = _read_lock(self.path)
        if info is not None and info.get("token") == self.token:
            unlink(self.path)
