"""A parallel, resumable, verified downloader for hub listings (the bytes behind ``k3ckpt fetch``).

Several files are fetched at once and every file is split into ``chunk_size`` pieces fetched in
parallel with ``Range`` requests.  Each chunk is streamed into a preallocated ``<final>.part``
file with ``os.pwrite`` at its offset; once a chunk's bytes are on disk (``fdatasync``) its index
is recorded in a small journal ``<final>.part.journal``.  The file's sha256 is computed while
it downloads (chunks are hashed in order from the page cache as soon as every earlier chunk is
on disk), and only a ``.part`` whose digest matches is renamed (``os.replace``) to its final
name, so a partial or corrupt file never appears under the final name.

Crash safety (SIGKILL, power loss, Ctrl-C at any moment):

- the journal only ever names chunks whose bytes were ``fdatasync``-ed *before* the journal was
  rewritten (write temp file, ``fsync``, ``os.replace``), so a resumed run never trusts bytes
  that never reached the disk.  What a crash loses is at most the chunks in flight (at most
  ``workers`` of them);
- the journal records the size, sha256 / git blob id and chunk size of the file it belongs to;
  a journal for other content (a new revision, another chunk size) or a ``.part`` of the wrong
  size is discarded and the file is fetched from scratch;
- the final rename is followed by an ``fsync`` of the directory, then the journal is removed.

Journal format (JSON, version 1)::

    {"version": 1, "path": "model-00001-of-000096.safetensors", "size": 16990911504,
     "sha256": "...", "git_sha1": null, "chunk_size": 67108864, "done": [0, 1, 5, ...]}

Concurrent fetches into one destination are excluded by ``dest/.k3ckpt-fetch.lock``, created
exclusively and with its content already in place (a hard link of a private temp file, else
``O_CREAT | O_EXCL``; both atomic on NFS v3+, unlike ``flock``, which NFS may emulate locally or
not at all).  It holds host, pid, start time and a random token.  A lock is stale
when its host is this host and its pid is dead, or, for another host (whose pids we cannot
check), when it is older than ``K3CKPT_LOCK_STALE_SECONDS`` (default 24 h).  A stale lock is
broken under a second exclusive-create lock (``.k3ckpt-fetch.lock.break``) so that two processes
breaking the same stale lock cannot delete each other's fresh one.

Faults: connection errors, timeouts, 429 and 5xx (except 501/505) and short or long bodies are
retried per chunk with exponential backoff plus jitter (``Retry-After`` is honoured as given); a
server that ignores ``Range`` is detected from the missing ``Content-Range`` (its body is never
written at the wrong offset) and the file is then fetched with one sequential GET from byte 0,
still journaled chunk by chunk (``FetchResult.notes`` says so); a file whose digest does not match is re-fetched once in
full (we do not know which chunk was bad), then reported.

Why not :func:`k3ckpt.hubclient.read_range`: it returns the whole range as ``bytes`` (built in a
``bytearray`` and copied), i.e. one or two 64 MiB buffers per worker; a downloader must stream
the body into the file as it arrives.  We add nothing to ``hubclient``: the streaming reader
below reuses its session, headers, manual redirect handling (credentials never leave the
origin), ``Retry-After`` parsing, status mapping and ``Content-Range`` grammar.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import urllib3.exceptions

from . import client as hubclient
from ..env import K3CKPT_LOCK_STALE_SECONDS, K3CKPT_TEST_PAUSE_AT, K3CKPT_TEST_PAUSE_FILE
from ..errors import DiskSpaceError, FetchLockedError
from ..integrity.hashing import HashError, hash_file
from .client import HubFile, HubListing, RetryPolicy

__all__ = [
    "DEFAULT_CHUNK",
    "FETCH_RETRY",
    "LOCK_NAME",
    "DiskSpaceError",
    "FetchLockedError",
    "FetchResult",
    "fetch_files",
]

#: Default chunk size: big enough that per-request overhead vanishes, small enough that a crash
#: loses little and that a 17 GB shard still spreads over all workers.
DEFAULT_CHUNK = 64 * 1024 * 1024
#: Name of the lock file in the destination directory.
LOCK_NAME = ".k3ckpt-fetch.lock"
#: Another host's lock older than this (seconds) is considered abandoned (env overrides).
LOCK_STALE_SECONDS = K3CKPT_LOCK_STALE_SECONDS.default
#: A lock file that exists but is still empty/unparseable after this many seconds was left by a
#: process that died between creating and writing it.
LOCK_UNREADABLE_GRACE = 30.0
#: Connect/read timeout per request, in seconds (a module setting so tests can shorten it).
TIMEOUT = 60.0
#: Size of the pieces a body is read and ``pwrite``-n in: a chunk is never held in memory whole.
PIECE = 1 << 20
#: Retry policy when none is given: a multi-hour download should ride out a hub hiccup.
FETCH_RETRY = RetryPolicy(attempts=8, backoff=1.0, max_backoff=60.0, max_retry_after=300.0)

_JOURNAL_VERSION = 1
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass
class FetchResult:
    """What one :func:`fetch_files` run did.

    Attributes:
        dest: The destination directory.
        fetched: Paths downloaded (fully or resumed) and verified this run.
        skipped: Paths already present with matching size and sha256 (or git blob id).
        failed: Path -> one-line reason, for every file that could not be fetched.
        notes: One line per thing the user should know that is not a failure (a server that
            ignores ``Range`` and was read sequentially).
        bytes_downloaded: Body bytes received this run (retries included).
        bytes_total: Sum of the sizes of all requested files.
        seconds: Wall time of the run.
    """

    dest: Path
    fetched: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    bytes_downloaded: int = 0
    bytes_total: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True only if every requested file is present and verified."""
        return not self.failed

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable summary (``--json`` output of ``k3ckpt fetch``)."""
        return {
            "dest": str(self.dest),
            "ok": self.ok,
            "fetched": sorted(self.fetched),
            "skipped": sorted(self.skipped),
            "failed": dict(sorted(self.failed.items())),
            "bytes_downloaded": self.bytes_downloaded,
            "bytes_total": self.bytes_total,
            "seconds": round(self.seconds, 3),
            "notes": list(self.notes),
        }


# ----------------------------------------------------------------------------------------------
# Test hook
# ----------------------------------------------------------------------------------------------


def _pause_point(name: str, n: int | None = None) -> None:
    """Freeze the whole process at a named point when ``K3CKPT_TEST_PAUSE_AT`` names it.

    Crash tests SIGKILL a fetch at exact moments (between chunks, just before a rename).  The
    hook writes ``K3CKPT_TEST_PAUSE_FILE`` (so the test knows the point was reached) and sends
    itself SIGSTOP, freezing every thread at once.  ``after_chunk:N`` names the moment the N-th
    chunk of the run was journaled; ``before_rename`` the moment a verified ``.part`` is about
    to be renamed.  Unset (production), it is one dict lookup.
    """
    want = K3CKPT_TEST_PAUSE_AT.get()
    if not want:
        return
    if want != (name if n is None else f"{name}:{n}"):
        return
    marker = K3CKPT_TEST_PAUSE_FILE.get()
    if marker is not None:
        with open(marker, "w") as f:
            f.write(name)
    os.kill(os.getpid(), signal.SIGSTOP)
    # The group stop can land a moment after kill() returns; this thread must not take another
    # step past its pause point in that moment (the test SIGKILLs the process from here on).
    while True:
        time.sleep(60)


# ----------------------------------------------------------------------------------------------
# Small filesystem helpers
# ----------------------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    """Make a rename/create in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` via a fsync-ed temp file and ``os.replace`` (never half a file)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _within(root: str, path: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{n} B"  # pragma: no cover


_WORK_SUFFIXES = (".part", ".part.journal", ".part.journal.tmp")


def _target(dest_real: str, rel: str) -> str:
    """The local path for a hub path, or ValueError saying why it is refused.

    Refused: what :mod:`hubclient` calls unsafe (absolute, ``..``, backslash, NUL, empty
    components), names that collide with our own working files, and paths whose existing
    components (symlinks included) resolve outside ``dest_real``.
    """
    reason = hubclient._unsafe_reason(rel)
    if reason is not None:
        raise ValueError(f"refusing the path {rel!r} from the listing: it {reason}")
    if rel == LOCK_NAME or rel.startswith(LOCK_NAME) or rel.endswith(_WORK_SUFFIXES):
        raise ValueError(f"refusing the path {rel!r}: it collides with the downloader's working files")
    final = os.path.join(dest_real, *rel.split("/"))
    cur = dest_real
    for comp in rel.split("/"):
        cur = os.path.join(cur, comp)
        if os.path.lexists(cur) and not _within(dest_real, os.path.realpath(cur)):
            raise ValueError(f"refusing {rel!r}: {os.path.relpath(cur, dest_real)!r} in the destination is a "
                             f"symlink to {os.path.realpath(cur)!r}, outside {dest_real!r}")
    return final


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


class _DestLock:
    """``dest/.k3ckpt-fetch.lock``: exclusive-create lock with stale-lock detection (see module doc)."""

    def __init__(self, dest: str) -> None:
        self.path = os.path.join(dest, LOCK_NAME)
        self.token = uuid.uuid4().hex
        self.held = False
        self.stale_seconds = K3CKPT_LOCK_STALE_SECONDS.get()  # now: a bad value fails before any download

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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        try:
            os.write(fd, info)
            os.fsync(fd)
        finally:
            os.close(fd)
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
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, info)
            os.fsync(fd)
        finally:
            os.close(fd)
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


# ----------------------------------------------------------------------------------------------
# Per-file state
# ----------------------------------------------------------------------------------------------


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class _Fatal(Exception):
    pass


class _Cancelled(Exception):
    pass


class _StreamDigest:
    """The digest of a ``.part``, computed while the download runs.

    Chunks complete out of order, but sha256 is sequential: whichever worker finishes a chunk
    hashes, from the page cache, every chunk from the cursor on that is already on disk. The
    last chunk's arrival then leaves at most a chunk or two to hash, instead of a second pass
    over the whole file after the download. One thread hashes a file at a time (``busy``);
    the others never wait for it.
    """

    def __init__(self, entry: HubFile) -> None:
        self.git = entry.sha256 is None and entry.git_sha1 is not None
        self.size = entry.size
        self.busy = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Start over (the file is being fetched again); the caller holds ``busy``."""
        self.next = 0  # index of the first chunk not yet hashed
        self.hashed = 0  # bytes hashed
        self.sha256 = hashlib.sha256()
        self.blob = hashlib.sha1(b"blob %d\0" % self.size) if self.git else None

    def _hash_range(self, fd: int, start: int, length: int) -> None:
        view = _hash_buffer()
        pos, end = start, start + length
        while pos < end:
            n = os.preadv(fd, [view[:min(len(view), end - pos)]], pos)
            if n <= 0:
                raise OSError(f"the .part ended at byte {pos}, expected {end}")
            data = view[:n]
            self.sha256.update(data)
            if self.blob is not None:
                self.blob.update(data)
            pos += n
        self.hashed += length

    def advance(self, job: "_Job", *, wait: bool = False) -> None:
        """Hash the chunks from the cursor on that are done; with ``wait``, wait for the thread
        already hashing this file instead of leaving the work to it."""
        while self.busy.acquire(blocking=wait):
            try:
                while True:
                    with job.lock:
                        i, fd = self.next, job.fd
                        ready = i < job.nchunks and i in job.done and fd is not None
                    if not ready:
                        break
                    start, length = job.chunk(i)
                    self._hash_range(fd, start, length)
                    self.next = i + 1
            finally:
                self.busy.release()
            # A chunk that completed while we were finishing found ``busy`` held and left:
            # look once more so it is not left for the final pass.
            with job.lock:
                if not (self.next < job.nchunks and self.next in job.done):
                    return
            wait = False

    def hexdigests(self) -> tuple[int, str, str | None]:
        """``(bytes hashed, sha256, git blob id or None)``."""
        return self.hashed, self.sha256.hexdigest(), self.blob.hexdigest() if self.blob is not None else None


_HASH_LOCAL = threading.local()


def _hash_buffer() -> memoryview:
    """This thread's reusable read buffer for hashing (no allocation per chunk)."""
    buf = getattr(_HASH_LOCAL, "buf", None)
    if buf is None:
        buf = _HASH_LOCAL.buf = memoryview(bytearray(8 << 20))
    return buf


class _Job:
    """One file being downloaded: its ``.part`` descriptor, journal and outstanding chunks."""

    def __init__(self, entry: HubFile, final: str, chunk_size: int, dest_real: str) -> None:
        self.entry = entry
        self.final = final
        self.dest_real = dest_real
        self.part = final + ".part"
        self.journal = self.part + ".journal"
        self.chunk_size = chunk_size
        self.nchunks = max(1, -(-entry.size // chunk_size))
        self.done: set[int] = set()
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.outstanding = 0  # queued or running tasks of this file
        self.failed: str | None = None
        self.refetched = False
        self.finished = False
        self.sequential = False  # the server ignores Range: one whole-file GET writes it
        # the last chunk is in and the file is being verified: no whole-file GET may start (it
        # would write through a descriptor _finish is about to close). Exclusive with
        # ``sequential``: both are only set under ``lock``, each only if the other is not.
        self.finishing = False
        self.digest = _StreamDigest(entry)

    def chunk(self, i: int) -> tuple[int, int]:
        start = i * self.chunk_size
        return start, min(self.chunk_size, self.entry.size - start)

    def journal_doc(self) -> dict[str, Any]:
        return {"version": _JOURNAL_VERSION, "path": self.entry.path, "size": self.entry.size,
                "sha256": self.entry.sha256, "git_sha1": self.entry.git_sha1, "chunk_size": self.chunk_size}

    def load_resume(self) -> None:
        """Adopt a ``.part`` + journal left by an earlier run if they belong to this content;
        otherwise forget them (a stale or foreign journal must not vouch for any byte)."""
        doc: Any = None
        try:
            with open(self.journal, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            doc = None
        try:
            st = os.lstat(self.part)
            part_ok = os.path.isfile(self.part) and not os.path.islink(self.part) and st.st_size == self.entry.size
        except FileNotFoundError:
            part_ok = False
        if isinstance(doc, dict) and part_ok and all(doc.get(k) == v for k, v in self.journal_doc().items()):
            done = doc.get("done")
            if isinstance(done, list) and all(type(i) is int and 0 <= i < self.nchunks for i in done):
                self.done = set(done)
                return
        self.done = set()
        _unlink(self.journal)

    def resumable_bytes(self) -> int:
        """Bytes already allocated for this file by a ``.part`` we will reuse."""
        return self.entry.size if self.done else 0

    def open(self) -> None:
        """Open (resume) or create and preallocate the ``.part``; called under ``self.lock``."""
        if self.fd is not None:
            return
        if self.done:
            self.fd = os.open(self.part, os.O_RDWR | _NOFOLLOW)
            return
        # Fresh start: an old .part without a valid journal is untrusted; a symlink is not ours.
        _unlink(self.part)
        parent = os.path.dirname(self.final)
        os.makedirs(parent, exist_ok=True)
        # Checked again now that the directories exist: a symlink planted since the plan was
        # made must not redirect the write outside the destination.
        if not _within(self.dest_real, os.path.realpath(parent)):
            raise _Fatal(f"refusing to write {self.entry.path!r}: its directory resolves to "
                         f"{os.path.realpath(parent)!r}, outside {self.dest_real!r}")
        self.fd = _create_part(self.part, self.entry.size)
        self.write_journal()

    def write_journal(self) -> None:
        doc = self.journal_doc()
        doc["done"] = sorted(self.done)
        _write_atomic(self.journal, json.dumps(doc).encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ----------------------------------------------------------------------------------------------
# Streaming one chunk
# ----------------------------------------------------------------------------------------------


#: Task index of a whole-file sequential GET (the fallback for a server that ignores ``Range``).
_WHOLE = -1


def _create_part(path: str, size: int, head: bytes = b"") -> int:
    """Create ``path`` exclusively (never through a symlink), reserve ``size`` bytes, write
    ``head`` at offset 0, ``fsync``; return the open descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    try:
        if size:
            try:
                # Reserve the blocks now: ENOSPC here, not in the middle of chunk 900.
                os.posix_fallocate(fd, 0, size)
            except (AttributeError, OSError):
                os.ftruncate(fd, size)  # filesystems without fallocate: sparse
        if head:
            os.pwrite(fd, head, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _RangeIgnored(_Fatal):
    """The server answered a ranged GET with the whole file (HTTP 200, no ``Content-Range``).
    Fatal for that range; :class:`_Run` falls back to one sequential GET of the file."""


def _request(listing: HubListing, entry: HubFile, headers: dict[str, str], timeout: float,
             byte_range: tuple[int, int] | None) -> tuple[Any, dict[str, Any]]:
    """Send the GET (ranged or not) and check the status; returns ``(response, context)``."""
    ctx: dict[str, Any] = {"hub": listing.hub, "repo": listing.repo, "revision": listing.revision,
                           "path": entry.path, "endpoint": listing.endpoint}
    url = hubclient.file_url(listing, entry.path)
    hdrs = dict(headers)
    if byte_range is not None:
        hdrs["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
    hdrs["Accept-Encoding"] = "identity"  # a compressed representation would shift every offset
    session = hubclient._session()
    try:
        resp, final_url = hubclient._get(session, url, hdrs, timeout, ctx)
    except requests.exceptions.Timeout:
        raise _Retryable(f"timed out after {timeout} s") from None
    except requests.exceptions.ConnectionError as e:
        raise _Retryable(f"connection failed ({hubclient._connection_reason(e)})") from None
    except requests.exceptions.RequestException as e:
        raise _Fatal(f"{type(e).__name__}: {hubclient._one_line(str(e))[:200]}") from None
    except hubclient.HubError as e:  # too many redirects
        raise _Fatal(e.problem) from None
    status = resp.status_code
    try:
        if status == 429 or (status >= 500 and status not in hubclient._NOT_RETRYABLE_5XX):
            raise _Retryable(f"HTTP {status}", hubclient._retry_after(resp))
        if status not in (200, 206):
            raise _Fatal(hubclient._status_error(resp, final_url, ctx).problem)
        encoding = (resp.headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            raise _Fatal(f"server applied Content-Encoding {encoding!r} to a file download")
    except BaseException:
        resp.close()
        raise
    return resp, ctx


def _content_length(resp: Any) -> int | None:
    cl = resp.headers.get("Content-Length")
    return int(cl) if cl and cl.strip().isdigit() else None


def _copy_body(resp: Any, fd: int, start: int, dest_offset: int, length: int, cancel: threading.Event,
               count: Callable[[int], None], sink: Callable[[memoryview], None] | None = None,
               on_offset: Callable[[int], None] | None = None) -> int:
    """Write up to ``length`` body bytes (bytes ``start``... of the file) to ``fd`` at
    ``dest_offset``; returns how many arrived. ``sink`` sees every written piece in order (to hash
    while streaming); ``on_offset`` is told the offset reached after each piece (the sequential
    fallback journals with it)."""
    raw = resp.raw
    received = 0
    offset = dest_offset
    try:
        while received < length:
            if cancel.is_set():
                raise _Cancelled()
            data = raw.read(min(length - received, PIECE), decode_content=False)
            if not data:
                break
            count(len(data))
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view = view[n:]
                offset += n
            if sink is not None:
                sink(memoryview(data))
            received += len(data)
            if on_offset is not None:
                on_offset(offset)
    except (TimeoutError, urllib3.exceptions.HTTPError, requests.exceptions.RequestException, ConnectionError) as e:
        got = "an empty body" if received == 0 else f"{received} of {length} bytes"
        raise _Retryable(f"connection lost after {got} (bytes {start}-{start + length - 1}; {type(e).__name__})") from None
    return received


def _stream_chunk(listing: HubListing, job: _Job, index: int, headers: dict[str, str], timeout: float,
                  cancel: threading.Event, count: Callable[[int], None]) -> None:
    """One ranged GET of chunk ``index`` written in place; raises _Retryable/_Fatal/_Cancelled,
    or _RangeIgnored when the server sends the whole file instead."""
    start, length = job.chunk(index)
    _stream_range(listing, job.entry, start, length, job.fd, start, headers, timeout, cancel, count)  # type: ignore[arg-type]


def _stream_range(listing: HubListing, entry: HubFile, start: int, length: int, fd: int, dest_offset: int,
                  headers: dict[str, str], timeout: float, cancel: threading.Event, count: Callable[[int], None],
                  sink: Callable[[memoryview], None] | None = None) -> None:
    """One ranged GET of bytes ``[start, start + length)`` of ``entry``, written to ``fd`` at
    ``dest_offset`` (the rank-aware fetch writes a tensor at another offset than the source's);
    ``sink`` sees every written piece in order. Raises _Retryable/_Fatal/_Cancelled (after one of
    them, what ``sink`` saw is void), or _RangeIgnored.

    The response checks mirror :func:`hubclient._body`: a body is only written when its
    ``Content-Range`` is exactly the requested range, or when there is none and the range asked
    for is the whole file (a 200 then carries exactly it); any other 200 without
    ``Content-Range`` is :class:`_RangeIgnored`, and nothing of its body is read.
    """
    end = start + length - 1
    resp, _ = _request(listing, entry, headers, timeout, (start, end))
    with resp:
        content_range = resp.headers.get("Content-Range")
        announced = _content_length(resp)
        if content_range is not None:
            m = hubclient._CONTENT_RANGE.match(content_range)
            if not m:
                raise _Fatal(f"unparseable Content-Range {content_range!r} (asked for bytes {start}-{end})")
            got, total = (int(m.group(1)), int(m.group(2))), m.group(3)
            if got != (start, end):
                raise _Fatal(f"asked for bytes {start}-{end}, server answered {content_range!r}")
            if total != "*" and int(total) != entry.size:
                raise _Fatal(f"Content-Range {content_range!r} says the file is {total} bytes, "
                             f"the listing says {entry.size}")
            if announced is not None and announced != length:
                raise _Retryable(f"Content-Range {content_range!r} with Content-Length {announced}")
        elif resp.status_code == 206:
            raise _Fatal(f"HTTP 206 without Content-Range (asked for bytes {start}-{end})")
        else:
            # 200 without Content-Range: the server ignored Range and sends the file from byte 0.
            if announced is not None and announced != entry.size:
                what = "an empty body" if announced == 0 else f"a {announced}-byte body"
                if hubclient._is_html(resp):  # a proxy's or portal's error page, not the file
                    what = f"a {announced}-byte HTML page"
                raise _Retryable(f"server sent {what} (HTTP 200) for a {entry.size}-byte file")
            if start != 0 or length != entry.size:
                raise _RangeIgnored(f"the server ignores Range (HTTP 200 with the whole file for bytes {start}-{end})")
        received = _copy_body(resp, fd, start, dest_offset, length, cancel, count, sink)
        extra = b""
        if received == length and announced is None:
            try:
                extra = resp.raw.read(1, decode_content=False)  # chunked: no more than asked for
            except (urllib3.exceptions.HTTPError, ConnectionError):
                extra = b""
        if extra:
            raise _Retryable(f"body is longer than the {length} bytes of bytes {start}-{end}")
        if received != length:
            got = "an empty body" if received == 0 else f"{received} bytes"
            raise _Retryable(f"got {got} for bytes {start}-{end} ({length} bytes)")


def _stream_whole(listing: HubListing, job: _Job, headers: dict[str, str], timeout: float,
                  cancel: threading.Event, count: Callable[[int], None],
                  chunk_reached: Callable[[int], None]) -> None:
    """The fallback for a server that ignores ``Range``: one plain GET of the whole file,
    written in place from byte 0. ``chunk_reached(i)`` is called as each chunk's last byte is
    written, so the journal keeps recording progress (a crash still resumes, though a server
    without ranges makes the resumed run read the file from its start again)."""
    entry = job.entry
    resp, _ = _request(listing, entry, headers, timeout, None)
    with resp:
        if resp.status_code != 200 or resp.headers.get("Content-Range") is not None:
            raise _Fatal(f"HTTP {resp.status_code} with Content-Range {resp.headers.get('Content-Range')!r} "
                         f"to a GET without Range")
        announced = _content_length(resp)
        if announced is not None and announced != entry.size:
            what = "an empty body" if announced == 0 else f"a {announced}-byte body"
            raise _Retryable(f"server sent {what} (HTTP 200) for a {entry.size}-byte file")
        reached = [0]  # chunks whose every byte has been written

        def on_offset(offset: int) -> None:
            while reached[0] < job.nchunks and sum(job.chunk(reached[0])) <= offset:
                chunk_reached(reached[0])
                reached[0] += 1

        received = _copy_body(resp, job.fd, 0, 0, entry.size, cancel, count, on_offset=on_offset)  # type: ignore[arg-type]
        extra = b""
        if received == entry.size and announced is None:
            try:
                extra = resp.raw.read(1, decode_content=False)
            except (urllib3.exceptions.HTTPError, ConnectionError):
                extra = b""
        if extra:
            raise _Retryable(f"body is longer than the file's {entry.size} bytes")
        if received != entry.size:
            got = "an empty body" if received == 0 else f"{received} bytes"
            raise _Retryable(f"got {got} of the {entry.size}-byte file (HTTP 200, whole file)")


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


class _Run:
    """Shared state of one fetch: a work queue of (job, chunk) tasks and ``workers`` threads."""

    def __init__(self, listing: HubListing, headers: dict[str, str], retry: RetryPolicy, workers: int,
                 progress: Callable[[int], None] | None, result: FetchResult) -> None:
        self.listing = listing
        self.headers = headers
        self.retry = retry
        self.workers = workers
        self.progress = progress
        self.result = result
        self.cond = threading.Condition()
        self.queue: collections.deque[tuple[_Job, int | None]] = collections.deque()
        self.pending = 0  # tasks queued or running
        self.cancel = threading.Event()
        self.bytes_lock = threading.Lock()
        self.timeout = TIMEOUT
        self.chunks_journaled = 0

    # -- bookkeeping -----------------------------------------------------------------------------

    def count(self, n: int) -> None:
        with self.bytes_lock:
            self.result.bytes_downloaded += n
        if self.progress is not None:
            self.progress(n)

    def submit(self, job: _Job, index: int | None) -> None:
        """Queue chunk ``index`` of ``job`` (``None``: nothing to download, just verify)."""
        with job.lock:
            job.outstanding += 1
        with self.cond:
            self.queue.append((job, index))
            self.pending += 1
            self.cond.notify()

    def _task_done(self) -> None:
        with self.cond:
            self.pending -= 1
            self.cond.notify_all()

    def fail(self, job: _Job, reason: str) -> None:
        with job.lock:
            if job.failed is None and not job.finished:
                job.failed = reason
                with self.cond:
                    self.result.failed[job.entry.path] = reason

    # -- workers ---------------------------------------------------------------------------------

    def worker(self) -> None:
        while (item := _next_task(self.cond, self.queue, lambda: self.pending > 0, self.cancel)) is not None:
            job, index = item
            try:
                self._run_task(job, index)
            except _Cancelled:
                pass
            except _Fatal as e:
                self.fail(job, str(e))
            except OSError as e:  # the local side: disk full, file too large, out of descriptors
                self.fail(job, _local_failure(e, job.part))
            except Exception as e:  # noqa: BLE001 - never lose a worker silently: fail the file, keep going
                self.fail(job, f"{type(e).__name__}: {hubclient._one_line(str(e))[:300]}")
            finally:
                with job.lock:
                    job.outstanding -= 1
                    # The last task of a failed or finished file closes its .part descriptor.
                    if job.outstanding == 0 and (job.failed is not None or job.finished):
                        job.close()
                self._task_done()

    def _run_task(self, job: _Job, index: int | None) -> None:
        with job.lock:
            if job.failed is not None or job.finished:
                return
            if job.sequential and index is not None and index != _WHOLE:
                return  # the whole-file GET writes this chunk
            if index == _WHOLE and job.finishing:
                return  # every chunk arrived by range after all: nothing left for it to do
            job.open()
        if index == _WHOLE:
            if self._fetch_whole(job):
                self._finish(job)
            return
        if index is not None:
            self._fetch_chunk(job, index)
            with job.lock:
                if job.failed is not None or self.cancel.is_set() or job.sequential:
                    return  # cancelled: the caller may already have released the lock
                # The bytes first, then the journal: a crash between the two re-fetches this
                # chunk; the reverse order could record bytes that never reached the disk.
                os.fdatasync(job.fd) if hasattr(os, "fdatasync") else os.fsync(job.fd)  # type: ignore[arg-type]
                job.done.add(index)
                job.write_journal()
                complete = len(job.done) == job.nchunks
                job.finishing = complete
            with self.bytes_lock:
                self.chunks_journaled += 1
                journaled = self.chunks_journaled
            _pause_point("after_chunk", journaled)
            if not complete:
                job.digest.advance(job)
                return
        self._finish(job)

    def _fetch_chunk(self, job: _Job, index: int) -> None:
        failures = 0
        while True:
            if self.cancel.is_set():
                raise _Cancelled()
            if job.failed is not None:
                return
            try:
                _stream_chunk(self.listing, job, index, self.headers, self.timeout, self.cancel, self.count)
                return
            except _RangeIgnored:
                self._go_sequential(job)
                return
            except _Fatal as e:
                self.fail(job, f"{e} (bytes {job.chunk(index)[0]}+{job.chunk(index)[1]})")
                return
            except _Retryable as e:
                failures += 1
                if not self._backoff(job, e, failures):
                    return

    def _backoff(self, job: _Job, e: _Retryable, failures: int) -> bool:
        """Sleep before the next attempt; False (and the file failed) when attempts ran out."""
        if failures >= self.retry.attempts:
            self.fail(job, f"{e}; gave up after {failures} attempts")
            return False
        _back_off(self.retry, failures, e.retry_after)
        return True

    def _go_sequential(self, job: _Job) -> None:
        """The server ignores Range for this file: queue one whole-file GET (once)."""
        with job.lock:
            if job.sequential or job.failed is not None or job.finishing:
                return
            job.sequential = True
        with self.cond:
            self.result.notes.append(f"{job.entry.path}: the server ignores Range; fetched with one "
                                     f"sequential GET instead of parallel chunks")
        self.submit(job, _WHOLE)

    def _fetch_whole(self, job: _Job) -> bool:
        """Download ``job`` with one plain GET (retried from byte 0); True when every byte arrived."""

        def chunk_reached(i: int) -> None:
            with job.lock:
                if job.failed is not None or self.cancel.is_set():
                    raise _Cancelled()
                if i not in job.done:
                    os.fdatasync(job.fd) if hasattr(os, "fdatasync") else os.fsync(job.fd)  # type: ignore[arg-type]
                    job.done.add(i)
                    job.write_journal()
            job.digest.advance(job)

        failures = 0
        while True:
            if self.cancel.is_set():
                raise _Cancelled()
            if job.failed is not None:
                return False
            try:
                _stream_whole(self.listing, job, self.headers, self.timeout, self.cancel, self.count, chunk_reached)
                return True
            except _Fatal as e:
                self.fail(job, str(e))
                return False
            except _Retryable as e:
                failures += 1
                if not self._backoff(job, e, failures):
                    return False

    def _finish(self, job: _Job) -> None:
        """Verify the complete ``.part`` and rename it into place (or re-fetch once, or fail)."""
        entry = job.entry
        os.fsync(job.fd)  # type: ignore[arg-type]
        try:
            # Every chunk is done: this hashes what the workers have not hashed yet (usually
            # the last chunk or two), waiting for a worker still hashing this file.
            job.digest.advance(job, wait=True)
            hashed, sha256, git_sha1 = job.digest.hexdigests()
            size = os.fstat(job.fd).st_size  # type: ignore[arg-type]
        except OSError as e:
            self.fail(job, f"cannot hash the downloaded file: {e}")
            return
        problem = _mismatch(entry, size if hashed == size else hashed, sha256, git_sha1)
        if problem is not None:
            if not job.refetched:
                # We cannot tell which chunk was bad: fetch the whole file again, once.
                with job.digest.busy:
                    job.digest.reset()
                with job.lock:
                    job.refetched = True
                    job.finishing = False
                    job.done = set()
                    job.write_journal()
                for i in ([_WHOLE] if job.sequential else range(job.nchunks)):
                    self.submit(job, i)
                return
            self.fail(job, f"{problem} (also after re-fetching the whole file)")
            with job.lock:
                job.close()
                _unlink(job.journal)
                _unlink(job.part)
            return
        _pause_point("before_rename")
        with job.lock:
            job.close()
            os.replace(job.part, job.final)
            _fsync_dir(os.path.dirname(job.final))
            _unlink(job.journal)
            job.finished = True
            with self.cond:
                self.result.fetched.append(entry.path)

    def run(self) -> None:
        _run_workers(self.worker, self.workers, "k3ckpt-fetch", self.cond, lambda: self.pending > 0, self.cancel)


def _back_off(policy: RetryPolicy, failures: int, retry_after: float | None) -> None:
    """Sleep before retry number ``failures`` (``Retry-After`` as given, else the backoff)."""
    delay = policy.delay(failures, retry_after)
    if retry_after is None:
        # Equal jitter: workers that failed together must not retry in lockstep.
        delay = delay / 2 + random.uniform(0, delay / 2)
    policy.sleep(delay)


def _next_task(cond: threading.Condition, queue: collections.deque[Any], busy: Callable[[], bool],
               cancel: threading.Event) -> Any | None:
    """A worker's next task: waits (under ``cond``) while the queue is empty but tasks are still
    running (a running task may queue more); None when cancelled or when nothing is left."""
    with cond:
        while not queue and busy() and not cancel.is_set():
            cond.wait()
        if cancel.is_set() or not queue:
            return None
        return queue.popleft()


def _run_workers(worker: Callable[[], None], workers: int, name: str, cond: threading.Condition,
                 busy: Callable[[], bool], cancel: threading.Event) -> None:
    """Run ``workers`` daemon threads of ``worker`` until ``busy()`` (read under ``cond``) is false."""
    threads = [threading.Thread(target=worker, name=f"{name}-{i}", daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    try:
        with cond:
            while busy():
                cond.wait(0.5)
    except BaseException:
        # Ctrl-C: stop the workers between pieces; the journal is consistent at any moment.
        # A worker blocked in a read is not waited for beyond a moment (it is a daemon
        # thread, and once cancelled it records nothing more in any journal).
        cancel.set()
        with cond:
            cond.notify_all()
        deadline = time.monotonic() + 2.0
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        raise
    for t in threads:
        t.join()


def _local_failure(e: OSError, path: str) -> str:
    """One line for a local I/O failure, naming the file and what to do about it."""
    hint = ""
    if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        hint = "; free space (or raise the file-size limit) and re-run: finished chunks are kept"
    elif e.errno in (errno.EMFILE, errno.ENFILE):
        hint = "; raise the open-files limit (ulimit -n) or use fewer --workers, and re-run"
    return f"{e.filename or path}: {e.strerror or e}{hint}"


def _mismatch(entry: HubFile, size: int, sha256: str, git_sha1: str | None) -> str | None:
    """Why local content does not match the listing, or None if it does."""
    if size != entry.size:
        return f"size {size} != listed {entry.size}"
    if entry.sha256 is not None:
        return None if sha256 == entry.sha256 else f"sha256 mismatch: expected {entry.sha256}, got {sha256}"
    if entry.git_sha1 is not None:
        return None if git_sha1 == entry.git_sha1 else f"git blob id mismatch: expected {entry.git_sha1}, got {git_sha1}"
    return None  # the hub gave no digest: size is all there is to check


def _already_present(entry: HubFile, final: str) -> bool:
    """Whether ``final`` holds exactly the listed content (size, then the full digest)."""
    try:
        st = os.stat(final)
    except OSError:
        return False
    if not os.path.isfile(final) or st.st_size != entry.size:
        return False
    try:
        digest = hash_file(final, git_sha1=entry.sha256 is None and entry.git_sha1 is not None)
    except (HashError, OSError):
        return False
    return _mismatch(entry, digest.size, digest.sha256, digest.git_sha1) is None


def fetch_files(
    listing: HubListing,
    dest: str | Path,
    paths: list[str] | None = None,
    *,
    workers: int = 8,
    chunk_size: int = DEFAULT_CHUNK,
    token: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    retry: RetryPolicy | None = None,
    check_space: bool = True,
    take_lock: bool = True,
) -> FetchResult:
    """Download files of ``listing`` into ``dest``: parallel, chunked, resumable and verified.

    Args:
        listing: The hub listing (its revision pins every URL).
        dest: Destination directory (created if missing); files land at ``dest/<path>``.
        paths: Repo-relative paths to fetch; ``None`` fetches the whole listing.  A path not in
            the listing is reported in ``failed``.
        workers: Parallel requests (threads).
        chunk_size: Bytes per ranged request; also the unit of resume.
        token: See :func:`k3ckpt.hubclient.auth_headers` (``""`` sends none).
        progress: Called with the number of body bytes each time some arrive (from worker
            threads, so it must be thread-safe).
        on_plan: Called once, before the first byte is requested, with the number of bytes
            this run will download (already present files and resumed chunks excluded).
        retry: Per-chunk retry policy; defaults to :data:`FETCH_RETRY`.  Backoff delays get
            jitter; ``Retry-After`` is honoured as given (capped at ``max_retry_after``).
        check_space: Refuse to start when the filesystem has less free space than needed.
        take_lock: ``False`` when the caller already holds ``dest``'s lock (the rank-aware fetch
            downloads its whole files inside its own locked run).

    Returns:
        FetchResult: ``ok`` only if every requested file is present and verified; every file
        that could not be fetched is in ``failed`` with a one-line reason.

    Raises:
        FetchLockedError: Another live fetch holds ``dest``'s lock.
        DiskSpaceError: Not enough free space (needed and free are in the message).
        KeyboardInterrupt: Passed through after the workers stopped; re-run to resume.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    t0 = time.monotonic()
    policy = retry or FETCH_RETRY
    dest_path = Path(dest)
    os.makedirs(dest_path, exist_ok=True)
    dest_real = os.path.realpath(dest_path)
    wanted = list(listing.files) if paths is None else list(dict.fromkeys(paths))
    result = FetchResult(dest=dest_path)

    lock = _DestLock(dest_real)
    if take_lock:
        lock.acquire()
    try:
        entries: list[tuple[HubFile, str]] = []
        for rel in wanted:
            entry = listing.files.get(rel)
            if entry is None:
                result.failed[rel] = "not in the listing"
                continue
            # Check the listing's own name too: a hand-built listing skips hubclient's validation.
            try:
                final = _target(dest_real, rel)
                if entry.path != rel:
                    raise ValueError(f"listing key {rel!r} names the file {entry.path!r}")
            except ValueError as e:
                result.failed[rel] = str(e)
                continue
            result.bytes_total += entry.size
            entries.append((entry, final))

        # Skip check: size, then the full digest (that is the contract), hashed in parallel.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=workers) as pool:
            present = list(pool.map(lambda ef: _already_present(*ef), entries))
        jobs: list[_Job] = []
        for (entry, final), is_there in zip(entries, present):
            if is_there:
                result.skipped.append(entry.path)
                # Leftovers of a run killed between its rename and its journal removal.
                _unlink(final + ".part.journal")
                if os.path.isfile(final + ".part") and not os.path.islink(final + ".part"):
                    _unlink(final + ".part")
                continue
            job = _Job(entry, final, chunk_size, dest_real)
            job.load_resume()
            jobs.append(job)

        # From the journaled chunks, not by walking every chunk: a hostile listing's size of
        # 2**60 bytes must reach the space check below, not spin through 2**34 chunks first.
        to_download = sum(job.entry.size - sum(job.chunk(i)[1] for i in job.done) for job in jobs)
        if check_space and jobs:
            needed = sum(job.entry.size - job.resumable_bytes() for job in jobs)
            free = shutil.disk_usage(dest_real).free
            if needed > free:
                raise DiskSpaceError(f"{dest_real}: not enough free space to fetch {len(jobs)} file(s): "
                                     f"need {needed} bytes ({_human(needed)}), only {free} bytes "
                                     f"({_human(free)}) free")
        if on_plan is not None:
            on_plan(to_download)

        run = _Run(listing, hubclient.auth_headers(listing, token), policy, workers, progress, result)
        for job in jobs:
            todo = [i for i in range(job.nchunks) if i not in job.done] if job.entry.size else []
            if todo:
                for i in todo:
                    run.submit(job, i)
            else:
                run.submit(job, None)  # empty file, or complete .part left before its rename
        if jobs:
            run.run()
        for job in jobs:  # belt and braces: nothing may end neither fetched nor failed
            if job.entry.path not in result.fetched and job.entry.path not in result.failed:
                result.failed[job.entry.path] = "not completed"
    finally:
        lock.release()
    result.fetched.sort()
    result.skipped.sort()
    result.seconds = time.monotonic() - t0
    return result
