"""A parallel, resumable, verified downloader for hub listings (the bytes behind ``k3ckpt fetch``).

Several files are fetched at once and every file is split into ``chunk_size`` pieces fetched
with ``Range`` requests; workers spread over files first (one worker per file, its chunks in
order) and share the chunks of the last files.  Each chunk is streamed into a preallocated
``<final>.part`` file with ``os.pwrite`` at its offset (its aligned blocks with ``O_DIRECT`` on
a local disk's filesystem: :data:`DIRECT_IO_FILESYSTEMS`, ``K3CKPT_DIRECT_IO``); once a chunk's
bytes are on disk (``fdatasync``) its index is recorded in a small journal
``<final>.part.journal``.  The file's
sha256 is computed while it downloads, in file order: the worker streaming the next chunk in
line feeds it the bytes it receives (the buffer it writes), and a chunk that completed ahead
of its turn is read back from the ``.part`` when its turn comes.  Only a ``.part`` whose digest
matches is renamed (``os.replace``) to its final name, after an ``fsync``, so a partial or
corrupt file never appears under the final name.

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

Concurrent fetches into one destination are excluded by ``dest/.k3ckpt-fetch.lock`` (created
exclusively, NFS-safe; a lock whose process is dead, or another host's older than
``K3CKPT_LOCK_STALE_SECONDS``, is broken safely: see the package's ``_dest`` module).

Faults: connection errors, timeouts, 429 and 5xx (except 501/505) and short or long bodies are
retried per chunk with exponential backoff plus jitter (``Retry-After`` is honoured as given); a
server that ignores ``Range`` is detected from the missing ``Content-Range`` (its body is never
written at the wrong offset) and the file is then fetched with one sequential GET from byte 0,
still journaled chunk by chunk (``FetchResult.notes`` says so); a file whose digest does not match is re-fetched once in
full (we do not know which chunk was bad), then reported.

Why not :func:`k3ckpt.hub.client.read_range`: it returns the whole range as ``bytes`` (built in a
``bytearray`` and copied), i.e. one or two 64 MiB buffers per worker; a downloader must stream
the body into the file as it arrives.  The streaming reader (the package's ``_transfer``
module, shared with the rank-aware fetch) uses the client's own session, manual redirect
handling (credentials never leave the origin), ``Retry-After`` parsing, status mapping and
``Content-Range`` grammar (the package's ``_http`` module).
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import mmap
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3.exceptions

from ..env import K3CKPT_DIRECT_IO
from ..errors import DiskSpaceError, FetchLockedError
from ..integrity.hashing import HashError, hash_file
from ..utils import fsync_dir, write_atomic
from ..utils.space import require_free_space
from . import _dest, _http, _transfer
from . import client as hubclient
from ._dest import LOCK_NAME
from .client import HubFile, HubListing, RetryPolicy

__all__ = [
    "DEFAULT_CHUNK",
    "DIRECT_IO_FILESYSTEMS",
    "FETCH_RETRY",
    "LOCK_NAME",
    "DiskSpaceError",
    "FetchLockedError",
    "FetchResult",
    "fetch_files",
    "filesystem_of",
]

#: Default chunk size: big enough that per-request overhead vanishes, small enough that a crash
#: loses little and that a 17 GB shard still spreads over all workers.
DEFAULT_CHUNK = 64 * 1024 * 1024
#: Connect/read timeout per request, in seconds (a module setting so tests can shorten it).
TIMEOUT = 60.0
#: Bytes read from a body and written per step (a module setting so tests can make a connection
#: loss land mid-chunk on small files).
PIECE = _transfer.PIECE
#: Retry policy when none is given: a multi-hour download should ride out a hub hiccup.
FETCH_RETRY = RetryPolicy(attempts=8, backoff=1.0, max_backoff=60.0, max_retry_after=300.0)

_JOURNAL_VERSION = 1

#: Filesystems on a local block device, where an ``O_DIRECT`` write goes to the disk without
#: a page-cache copy. Elsewhere fetch writes through the page cache: on NFS or SMB every direct
#: write is a synchronous round trip (and a COMMIT), on tmpfs there is nothing to bypass, and
#: FUSE or cluster filesystems each do something of their own.
DIRECT_IO_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs"})
#: Where the mount table is read from (a module setting so tests can give another).
MOUNTINFO = "/proc/self/mountinfo"


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
# Per-file state
# ----------------------------------------------------------------------------------------------


class _StreamDigest:
    """The digest of a ``.part``, computed while the download runs, in file order.

    Two ways a chunk gets hashed:

    - **as it arrives**: the worker streaming chunk ``i`` takes the digest over (:meth:`claim`)
      once every byte before the chunk is hashed, and feeds it each received buffer - the same
      buffer it writes, so no byte is read back. With one worker per file (how the run hands
      out chunks while there are more files than workers) every chunk goes this way. If the
      request fails, :meth:`rollback` restores the digest as it was at the chunk's start (the
      retry's bytes replace the failed one's); :meth:`commit` moves the cursor past the chunk.
    - **after it is on disk**: a chunk that completed ahead of the cursor (several workers on
      one file) is hashed by whichever worker finds it next in line (:meth:`advance`), read
      back from the ``.part``.

    One thread hashes a file at a time (``busy``); the others never wait for it.
    """

    def __init__(self, entry: HubFile) -> None:
        self.git = entry.sha256 is None and entry.git_sha1 is not None
        self.size = entry.size
        self.busy = threading.Lock()
        self.saved: tuple[Any, Any, int] | None = None  # the state at the claimed chunk's start
        self.reset()

    def reset(self) -> None:
        """Start over (the file is being fetched again); the caller holds ``busy``."""
        self.next = 0  # index of the first chunk not yet hashed
        self.hashed = 0  # bytes hashed
        self.sha256 = hashlib.sha256()
        self.blob = hashlib.sha1(b"blob %d\0" % self.size) if self.git else None

    def feed(self, data: memoryview) -> None:
        """Hash the next bytes of the file (the caller holds ``busy``)."""
        self.sha256.update(data)
        if self.blob is not None:
            self.blob.update(data)
        self.hashed += len(data)

    def hash_written(self, job: _Job, start: int, length: int) -> None:
        """Hash ``length`` bytes of the ``.part`` from ``start``, read back from it (through the
        ``O_DIRECT`` descriptor when there is one and the offset allows: the bytes were written
        past the page cache, and reading them through it would allocate it after all)."""
        fd, dfd = job.fd, job.dfd
        view = _hash_buffer()
        pos, end = start, start + length
        while pos < end:
            want = min(len(view), end - pos)
            n = -1
            if dfd is not None and pos % _transfer.DIRECT_ALIGN == 0:
                try:  # whole blocks: the last may reach past ``end`` (into the view, not the result)
                    n = min(want, os.preadv(dfd, [view[:-(-want // _transfer.DIRECT_ALIGN) * _transfer.DIRECT_ALIGN]], pos))
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
            if n < 0:
                n = os.preadv(fd, [view[:want]], pos)  # type: ignore[arg-type]  # fd is open here
            if n <= 0:
                raise OSError(f"the .part ended at byte {pos}, expected {end}")
            self.feed(view[:n])
            pos += n

    def claim(self, index: int) -> bool:
        """Take the digest over for the worker streaming chunk ``index`` if every byte before
        the chunk is hashed and no other thread is hashing; the claimant then feeds it, and
        ends with :meth:`commit` or :meth:`rollback` (which release ``busy``)."""
        if self.next != index or not self.busy.acquire(blocking=False):
            return False
        if self.next != index:  # moved on between the look and the lock
            self.busy.release()
            return False
        self.saved = (self.sha256.copy(), self.blob.copy() if self.blob is not None else None, self.hashed)
        return True

    def commit(self, index: int) -> None:
        """Every byte of claimed chunk ``index`` (as written) is hashed: move past it."""
        self.next = index + 1
        self.saved = None
        self.busy.release()

    def rollback(self) -> None:
        """The claimed chunk's request failed: forget what it fed (its retry writes the bytes again)."""
        assert self.saved is not None
        self.sha256, self.blob, self.hashed = self.saved
        self.saved = None
        self.busy.release()

    def advance(self, job: _Job, *, wait: bool = False) -> None:
        """Hash the chunks from the cursor on that are done; with ``wait``, wait for the thread
        already hashing this file instead of leaving the work to it."""
        while self.busy.acquire(blocking=wait):
            try:
                while True:
                    with job.lock:
                        i, fd = self.next, job.fd
                        ready = i < job.nchunks and i in job.done
                    if not ready or fd is None:
                        break
                    start, length = job.chunk(i)
                    self.hash_written(job, start, length)
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
    """This thread's reusable read buffer for hashing (no allocation per chunk; an anonymous
    ``mmap``, so page-aligned for ``O_DIRECT`` reads)."""
    buf = getattr(_HASH_LOCAL, "buf", None)
    if buf is None:
        buf = _HASH_LOCAL.buf = memoryview(mmap.mmap(-1, 8 << 20))
    return buf


class _Job:
    """One file being downloaded: its ``.part`` descriptor, journal and outstanding chunks."""

    def __init__(self, entry: HubFile, final: str, chunk_size: int, dest_real: str, direct: bool = False) -> None:
        self.entry = entry
        self.final = final
        self.dest_real = dest_real
        self.part = final + ".part"
        self.journal = self.part + ".journal"
        self.chunk_size = chunk_size
        self.nchunks = max(1, -(-entry.size // chunk_size))
        self.done: set[int] = set()
        self.lock = threading.Lock()
        # The .part's descriptor: set by open() before the first transfer, None again after
        # close(). Calls made while the job runs pass it with "type: ignore[arg-type]".
        self.fd: int | None = None
        # The same file opened with O_DIRECT (aligned pieces are written through it), or None:
        # K3CKPT_DIRECT_IO off, or a filesystem without direct I/O.
        self.direct = direct
        self.dfd: int | None = None
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
        self.done = _dest.resumable(self.journal, self.part, self.entry.size, self.journal_doc(), self.nchunks)

    def resumable_bytes(self) -> int:
        """Bytes already allocated for this file by a ``.part`` we will reuse."""
        return self.entry.size if self.done else 0

    def open(self) -> None:
        """Open (resume) or create and preallocate the ``.part``; called under ``self.lock``."""
        if self.fd is not None:
            return
        try:
            self.fd = _dest.open_part(self.part, self.final, self.dest_real, self.entry.path, self.entry.size,
                                      resume=bool(self.done))
        except ValueError as e:  # its directory resolves outside the destination
            raise _transfer.Fatal(str(e)) from None
        if self.direct:
            self.dfd = _transfer.open_direct(self.fd)
        if not self.done:
            self.write_journal()

    def write_journal(self) -> None:
        doc = self.journal_doc()
        doc["done"] = sorted(self.done)
        # One fixed temporary name, under the destination lock: a kill leaves one file, not one per chunk.
        write_atomic(self.journal, json.dumps(doc).encode(), reuse_temp=True)

    def close(self) -> None:
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ----------------------------------------------------------------------------------------------
# Streaming one chunk
# ----------------------------------------------------------------------------------------------


#: Task index of a whole-file sequential GET (the fallback for a server that ignores ``Range``).
_WHOLE = -1


def _stream_chunk(listing: HubListing, job: _Job, index: int, headers: dict[str, str], timeout: float,
                  cancel: threading.Event, count: Callable[[int], None]) -> None:
    """One ranged GET of chunk ``index`` written in place; raises Retryable/Fatal/Cancelled,
    or RangeIgnored when the server sends the whole file instead.

    The file's digest is fed the received bytes as they are written once this chunk is next in
    line (:meth:`_StreamDigest.claim`: at once when every earlier chunk is hashed, else as soon
    as it is, after hashing from the ``.part`` what this request wrote before)."""
    start, length = job.chunk(index)
    digest = job.digest
    owner = False
    seen = 0  # bytes of this request written so far

    def sink(data: memoryview) -> None:
        nonlocal owner, seen
        # once the file went sequential, its whole-file GET alone feeds the digest (from byte 0)
        if not owner and not job.sequential and digest.claim(index):
            owner = True
            if seen:
                digest.hash_written(job, start, seen)
        if owner:
            digest.feed(data)
        seen += len(data)

    try:
        _transfer.stream_range(listing, job.entry, start, length, job.fd, start, headers, timeout, cancel, count,  # type: ignore[arg-type]  # fd is open here
                               sink=sink, direct_fd=job.dfd)
    except BaseException:
        if owner:
            digest.rollback()
        raise
    if owner:
        digest.commit(index)


def _stream_whole(listing: HubListing, job: _Job, headers: dict[str, str], timeout: float,
                  cancel: threading.Event, count: Callable[[int], None],
                  chunk_reached: Callable[[int], None]) -> None:
    """The fallback for a server that ignores ``Range``: one plain GET of the whole file,
    written in place from byte 0. ``chunk_reached(i)`` is called as each chunk's last byte is
    written, so the journal keeps recording progress (a crash still resumes, though a server
    without ranges makes the resumed run read the file from its start again)."""
    entry = job.entry
    resp, _ = _transfer.request(listing, entry, headers, timeout, None)
    with resp:
        if resp.status_code != 200 or resp.headers.get("Content-Range") is not None:
            raise _transfer.Fatal(f"HTTP {resp.status_code} with Content-Range {resp.headers.get('Content-Range')!r} "
                         f"to a GET without Range")
        announced = _http.content_length(resp)
        if announced is not None and announced != entry.size:
            what = "an empty body" if announced == 0 else f"a {announced}-byte body"
            raise _transfer.Retryable(f"server sent {what} (HTTP 200) for a {entry.size}-byte file")
        reached = [0]  # chunks whose every byte has been written

        def on_offset(offset: int) -> None:
            while reached[0] < job.nchunks and sum(job.chunk(reached[0])) <= offset:
                chunk_reached(reached[0])
                reached[0] += 1

        received = _transfer.copy_body(resp, job.fd, 0, 0, entry.size, cancel, count, on_offset=on_offset,  # type: ignore[arg-type]  # fd is open here
                                       piece=PIECE, direct_fd=job.dfd)
        extra = b""
        if received == entry.size and announced is None:
            try:
                extra = resp.raw.read(1, decode_content=False)
            except (urllib3.exceptions.HTTPError, ConnectionError):
                extra = b""
        if extra:
            raise _transfer.Retryable(f"body is longer than the file's {entry.size} bytes")
        if received != entry.size:
            got = "an empty body" if received == 0 else f"{received} bytes"
            raise _transfer.Retryable(f"got {got} of the {entry.size}-byte file (HTTP 200, whole file)")


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


class _Tasks:
    """The queued (job, chunk) tasks of a run, per file, handed out so that workers spread over
    files: a worker gets the next chunk of the first file nobody is working on, and only when
    every file with chunks left is in someone's hands does it join one (the file with the most
    chunks left). While there are more files than workers each file is then fetched by one
    worker, chunk after chunk, so its digest is fed as the bytes arrive (no read-back) and its
    chunks are written in order; the last files still spread over all workers.

    Not thread-safe on its own: the run calls it under its condition."""

    def __init__(self) -> None:
        self.queued: dict[_Job, collections.deque[int | None]] = {}
        self.running: collections.Counter[_Job] = collections.Counter()
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def append(self, item: tuple[_Job, int | None]) -> None:
        job, index = item
        self.queued.setdefault(job, collections.deque()).append(index)
        self.count += 1

    def popleft(self) -> tuple[_Job, int | None]:
        if not self.count:
            raise IndexError("no task queued")
        job = next((j for j in self.queued if not self.running[j]), None)
        if job is None:
            job = max(self.queued, key=lambda j: len(self.queued[j]))  # the first of the longest
        tasks = self.queued[job]
        index = tasks.popleft()
        if not tasks:
            del self.queued[job]
        self.count -= 1
        self.running[job] += 1
        return job, index

    def finished(self, job: _Job) -> None:
        """A task of ``job`` handed out by :meth:`popleft` is over."""
        self.running[job] -= 1
        if not self.running[job]:
            del self.running[job]


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
        self.queue = _Tasks()
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

    def _task_done(self, job: _Job) -> None:
        with self.cond:
            self.queue.finished(job)
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
        while (item := _transfer.next_task(self.cond, self.queue, lambda: self.pending > 0, self.cancel)) is not None:
            job, index = item
            try:
                self._run_task(job, index)
            except _transfer.Cancelled:
                pass
            except _transfer.Fatal as e:
                self.fail(job, str(e))
            except OSError as e:  # the local side: disk full, file too large, out of descriptors
                self.fail(job, _local_failure(e, job.part))
            except Exception as e:  # noqa: BLE001 - never lose a worker silently: fail the file, keep going
                self.fail(job, f"{type(e).__name__}: {_http.one_line(str(e))[:300]}")
            finally:
                with job.lock:
                    job.outstanding -= 1
                    # The last task of a failed or finished file closes its .part descriptor.
                    if job.outstanding == 0 and (job.failed is not None or job.finished):
                        job.close()
                self._task_done(job)

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
                os.fdatasync(job.fd) if hasattr(os, "fdatasync") else os.fsync(job.fd)  # type: ignore[arg-type]  # fd is open here
                job.done.add(index)
                job.write_journal()
                complete = len(job.done) == job.nchunks
                job.finishing = complete
            with self.bytes_lock:
                self.chunks_journaled += 1
                journaled = self.chunks_journaled
            _transfer.pause_point("after_chunk", journaled)
            if not complete:
                job.digest.advance(job)
                return
        self._finish(job)

    def _fetch_chunk(self, job: _Job, index: int) -> None:
        failures = 0
        while True:
            if self.cancel.is_set():
                raise _transfer.Cancelled()
            if job.failed is not None:
                return
            try:
                _stream_chunk(self.listing, job, index, self.headers, self.timeout, self.cancel, self.count)
                return
            except _transfer.RangeIgnored:
                self._go_sequential(job)
                return
            except _transfer.Fatal as e:
                self.fail(job, f"{e} (bytes {job.chunk(index)[0]}+{job.chunk(index)[1]})")
                return
            except _transfer.Retryable as e:
                failures += 1
                if not self._backoff(job, e, failures):
                    return

    def _backoff(self, job: _Job, e: _transfer.Retryable, failures: int) -> bool:
        """Sleep before the next attempt; False (and the file failed) when attempts ran out."""
        if failures >= self.retry.attempts:
            self.fail(job, f"{e}; gave up after {failures} attempts")
            return False
        _transfer.back_off(self.retry, failures, e.retry_after)
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
                    raise _transfer.Cancelled()
                if i not in job.done:
                    os.fdatasync(job.fd) if hasattr(os, "fdatasync") else os.fsync(job.fd)  # type: ignore[arg-type]  # fd is open here
                    job.done.add(i)
                    job.write_journal()
            job.digest.advance(job)

        failures = 0
        while True:
            if self.cancel.is_set():
                raise _transfer.Cancelled()
            if job.failed is not None:
                return False
            self._restart_from_byte_zero(job)
            try:
                _stream_whole(self.listing, job, self.headers, self.timeout, self.cancel, self.count, chunk_reached)
                return True
            except _transfer.Fatal as e:
                self.fail(job, str(e))
                return False
            except _transfer.Retryable as e:
                failures += 1
                if not self._backoff(job, e, failures):
                    return False

    def _restart_from_byte_zero(self, job: _Job) -> None:
        """Forget what was hashed and journaled before a whole-file GET: it rewrites the file
        from byte 0, so chunks that ranged GETs (or an earlier attempt) wrote and hashed get new
        bytes, which the digest must cover instead of the old ones."""
        with job.digest.busy:
            job.digest.reset()
        with job.lock:
            job.done = set()
            job.write_journal()

    def _finish(self, job: _Job) -> None:
        """Verify the complete ``.part`` and rename it into place (or re-fetch once, or fail)."""
        entry = job.entry
        os.fsync(job.fd)  # type: ignore[arg-type]  # fd is open here
        try:
            # Every chunk is done: this hashes what the workers have not hashed yet (usually
            # the last chunk or two), waiting for a worker still hashing this file.
            job.digest.advance(job, wait=True)
            hashed, sha256, git_sha1 = job.digest.hexdigests()
            size = os.fstat(job.fd).st_size  # type: ignore[arg-type]  # fd is open here
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
                _dest.unlink(job.journal)
                _dest.unlink(job.part)
            return
        _transfer.pause_point("before_rename")
        with job.lock:
            job.close()
            os.replace(job.part, job.final)
            fsync_dir(os.path.dirname(job.final))
            _dest.unlink(job.journal)
            job.finished = True
            with self.cond:
                self.result.fetched.append(entry.path)

    def run(self) -> None:
        _transfer.run_workers(self.worker, self.workers, "k3ckpt-fetch", self.cond, lambda: self.pending > 0,
                              self.cancel)


def _local_failure(e: OSError, path: str) -> str:
    """One line for a local I/O failure, naming the file and what to do about it."""
    hint = ""
    if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        hint = "; free space (or raise the file-size limit) and re-run: finished chunks are kept"
    elif e.errno in (errno.EMFILE, errno.ENFILE):
        hint = "; raise the open-files limit (ulimit -n) or use fewer --jobs, and re-run"
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


def filesystem_of(path: str | os.PathLike[str]) -> str | None:
    """The type (``ext4``, ``nfs4``...) of the filesystem holding ``path`` (resolved), from the
    mount table :data:`MOUNTINFO` (the mount point that is the longest prefix wins); None when
    there is no mount table (not Linux) or it cannot be read."""
    real = os.path.realpath(path)
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            table = f.read().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in table:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(" "), right.split(" ")
        if not sep or len(fields) < 5 or not tail[0]:
            continue
        # octal escapes of space, tab, newline and backslash in the mount point
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if real == point or real.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= best[0]:
                best = (len(point), tail[0])
    return best[1] if best is not None else None


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
    place: Callable[[HubFile], str] | None = None,
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
        place: Where a file goes, relative to ``dest`` (default: its repo path); a hub cache
            stores files under their blob names (:mod:`k3ckpt.hub.cache`).

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

    # read here, not in a worker: a bad value is the run's error
    direct = K3CKPT_DIRECT_IO.get() and filesystem_of(dest_real) in DIRECT_IO_FILESYSTEMS
    lock = _dest.DestLock(dest_real)
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
                final = _dest.target(dest_real, rel if place is None else place(entry))
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
                _dest.unlink(final + ".part.journal")
                if os.path.isfile(final + ".part") and not os.path.islink(final + ".part"):
                    _dest.unlink(final + ".part")
                continue
            job = _Job(entry, final, chunk_size, dest_real, direct)
            job.load_resume()
            jobs.append(job)

        # From the journaled chunks, not by walking every chunk: a hostile listing's size of
        # 2**60 bytes must reach the space check below, not spin through 2**34 chunks first.
        to_download = sum(job.entry.size - sum(job.chunk(i)[1] for i in job.done) for job in jobs)
        if check_space and jobs:
            needed = sum(job.entry.size - job.resumable_bytes() for job in jobs)
            require_free_space(dest_real, needed, f"to fetch {len(jobs)} file(s)")
        if on_plan is not None:
            on_plan(to_download)

        hubclient.load_client(listing.hub)  # before the workers: see load_client
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
