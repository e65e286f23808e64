"""The lock that keeps two runs out of one output directory: ``fetch`` (``dest/.k3ckpt-fetch.lock``)
and ``reshard``/``unshard`` (``OUT/.k3ckpt-output.lock``) take one before writing anything.

The lock file is created exclusively and with its content already in place (a hard link of a
private temp file, else ``O_CREAT | O_EXCL``; both atomic on NFS v3+, unlike ``flock``).  It
holds host, pid, start time and a random token.  A lock is stale when its host is this host and
its pid is dead, or, for another host (whose pids we cannot check), when it is older than
``stale_seconds`` (the callers pass ``K3CKPT_LOCK_STALE_SECONDS``, default 24 h).  A stale lock
is broken under a second exclusive-create lock (``<lock>.break``) so that two processes breaking
the same stale lock cannot delete each other's fresh one.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from typing import Any

from ..errors import OutputLockedError
from ._fs import pwrite_all

__all__ = ["LOCK_UNREADABLE_GRACE", "OUTPUT_LOCK_NAME", "DirLock", "is_lock_file"]

#: The lock of ``reshard`` and ``unshard`` in their output directory (``fetch`` keeps its own
#: name, ``.k3ckpt-fetch.lock``, which older versions look for).
OUTPUT_LOCK_NAME = ".k3ckpt-output.lock"
#: A lock file that exists but is still empty/unparseable after this many seconds was left by a
#: process that died between creating and writing it.
LOCK_UNREADABLE_GRACE = 30.0
#: Default age after which another host's lock is considered abandoned.
DEFAULT_STALE_SECONDS = 24 * 3600.0
# ``open`` flag: never through a symlink planted at the name.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def is_lock_file(name: str) -> bool:
    """True for a k3ckpt lock file, its ``.break`` or its private temp file (a base name)."""
    return name.startswith(".k3ckpt-") and ".lock" in name


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: exists, owned by someone else
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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    try:
        pwrite_all(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


class DirLock:
    """``directory/name``: exclusive-create lock with stale-lock detection (see module doc).

    Args:
        directory: The directory the run writes into (it must exist).
        name: The lock file's name in it.
        command: What a holder is doing, for the refusal (``fetch``, ``reshard``, ...).
        stale_seconds: Another host's lock older than this is broken.
        error: The error class raised when a live run holds the lock.
    """

    def __init__(self, directory: str | os.PathLike[str], name: str = OUTPUT_LOCK_NAME, *, command: str = "run",
                 stale_seconds: float = DEFAULT_STALE_SECONDS,
                 error: type[OutputLockedError] = OutputLockedError) -> None:
        self.path = os.path.join(os.fspath(directory), name)
        self.command = command
        self.token = uuid.uuid4().hex
        self.held = False
        self.stale_seconds = stale_seconds
        self.error = error

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _try_create(self) -> bool:
        """Create the lock with its content already in it, or return False if it exists.

        The content is written to a private temp file first and then hard-linked to the lock
        name: ``link`` is an atomic exclusive create (also on NFS, where it is the classic
        lock primitive), and nobody ever sees an empty lock file.  Filesystems without hard
        links fall back to ``O_CREAT | O_EXCL`` followed by the write.
        """
        info = json.dumps({"host": _hostname(), "pid": os.getpid(), "started": time.time(),
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
            _unlink(tmp)
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
        if host == _hostname() and isinstance(pid, int):
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
        """Take the lock, breaking a stale one.

        Raises:
            OutputLockedError (``error``): a live run holds it (host, pid and lock file named).
        """
        for _ in range(20):
            if self._try_create():
                self.held = True
                return
            info = _read_lock(self.path)
            if self._stale_reason(info) is None:
                raise self.error(f"{os.path.dirname(self.path)}: another {self.command} is running there: "
                                 f"{self._holder(info)}; lock file {self.path} (remove it only if "
                                 "that process is gone)", path=self.path)
            self._break(info)
        raise self.error(f"{self.path}: could not take the lock (contended)", path=self.path)

    def _break(self, seen: dict[str, Any] | None) -> None:
        """Remove a stale lock, holding a second exclusive lock so that two breakers cannot both
        act on the same stale content (the slower one would delete the faster one's new lock)."""
        breaker = self.path + ".break"
        try:
            fd = os.open(breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        except FileExistsError:
            try:
                if time.time() - os.stat(breaker).st_mtime > LOCK_UNREADABLE_GRACE:
                    _unlink(breaker)  # its owner died while breaking
            except FileNotFoundError:
                pass
            time.sleep(0.05)
            return
        os.close(fd)
        try:
            now = _read_lock(self.path)
            if now == seen and self._stale_reason(now) is not None:
                _unlink(self.path)
        finally:
            _unlink(breaker)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        info = _read_lock(self.path)
        if info is not None and info.get("token") == self.token:
            _unlink(self.path)


def _hostname() -> str:
    # uname(2)'s nodename is what gethostname(2) returns; importing socket for it was 5 ms of
    # reshard's and fetch's start-up.
    if hasattr(os, "uname"):
        return os.uname().nodename
    import socket  # (no uname: Windows)

    return socket.gethostname()
