"""One run of :func:`k3ckpt.hub.download.fetch_files`: its workers, their tasks, and what the run did.

:class:`FetchRun` holds the run's shared state: a queue of (file, chunk) tasks handed out so
that workers spread over files first (one worker per file, its chunks in order) and share the
chunks of the last files (:class:`~k3ckpt.hub.schedule.SpreadQueue`); ``workers`` threads that stream each chunk into its
file (:mod:`k3ckpt.hub._filejob`) and journal it; and each file's finish: the complete ``.part``
verified against the listing (:mod:`k3ckpt.hub._digest`), ``fsync``-ed and renamed
(``os.replace``) to its final name, so a partial or corrupt file never appears under the final
name. :class:`FetchResult` is what the run did.

Faults: connection errors, timeouts, 429 and 5xx (except 501/505) and short or long bodies are
retried per chunk with exponential backoff plus jitter (``Retry-After`` is honoured as given); a
server that ignores ``Range`` is detected from the missing ``Content-Range`` (its body is never
written at the wrong offset) and the file is then fetched with one sequential GET from byte 0,
still journaled chunk by chunk (``FetchResult.notes`` says so); a file whose digest does not match is re-fetched once in
full (we do not know which chunk was bad), then reported.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..faults import pause_point
from ..utils import fsync_dir, release_pages
from . import _dest, _http, _transfer, schedule
from ._digest import mismatch
from ._filejob import WHOLE, FileJob, stream_chunk, stream_whole
from .client import HubListing, RetryPolicy


@dataclass
class FetchResult:
    """What one :func:`fetch_files` run did.

    Attributes:
        dest: The destination directory.
        fetched: Paths downloaded (fully or resumed) and verified this run.
        resumed: Of ``fetched``, those continued from an earlier run's journaled chunks (only the
            chunks it had not finished were downloaded).
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
    resumed: list[str] = field(default_factory=list)

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
            "resumed": sorted(self.resumed),
            "skipped": sorted(self.skipped),
            "failed": dict(sorted(self.failed.items())),
            "bytes_downloaded": self.bytes_downloaded,
            "bytes_total": self.bytes_total,
            "seconds": round(self.seconds, 3),
            "notes": list(self.notes),
        }


class FetchRun:
    """Shared state of one fetch: a work queue of (job, chunk) tasks and ``workers`` threads.

    ``timeout`` is the connect/read timeout per request, ``piece`` the bytes a whole-file GET
    reads and writes per step (the downloader's module settings, read when the run starts);
    ``share_files``: ``K3CKPT_SHARE_FILES`` (see :func:`~k3ckpt.hub.schedule.join_rule`)."""

    def __init__(self, listing: HubListing, headers: dict[str, str], retry: RetryPolicy, workers: int,
                 progress: Callable[[int], None] | None, result: FetchResult, *, timeout: float,
                 piece: int, share_files: bool | None = None) -> None:
        self.listing = listing
        self.headers = headers
        self.retry = retry
        self.workers = workers
        self.progress = progress
        self.result = result
        self.cond = threading.Condition()
        # a spare worker joins a file in flight only while that buys receive rate (its bytes
        # are hashed later, read back from the disk)
        may_join = schedule.join_rule(share_files, lambda: self.result.bytes_downloaded)
        self.queue: schedule.SpreadQueue[FileJob, int | None] = schedule.SpreadQueue(may_join)
        self.pending = 0  # tasks queued or running
        self.cancel = threading.Event()
        self.bytes_lock = threading.Lock()
        self.timeout = timeout
        self.piece = piece
        self.chunks_journaled = 0

    # -- bookkeeping -----------------------------------------------------------------------------

    def count(self, n: int) -> None:
        with self.bytes_lock:
            self.result.bytes_downloaded += n
        if self.progress is not None:
            self.progress(n)

    def submit(self, job: FileJob, index: int | None) -> None:
        """Queue chunk ``index`` of ``job`` (``None``: nothing to download, just verify)."""
        with job.lock:
            job.outstanding += 1
        with self.cond:
            self.queue.append((job, index))
            self.pending += 1
            self.cond.notify()

    def _task_done(self, job: FileJob) -> None:
        with self.cond:
            self.queue.finished(job)
            self.pending -= 1
            self.cond.notify_all()

    def fail(self, job: FileJob, reason: str) -> None:
        with job.lock:
            if job.failed is None and not job.finished:
                job.failed = reason
                with self.cond:
                    self.result.failed[job.entry.path] = reason

    # -- workers ---------------------------------------------------------------------------------

    def worker(self) -> None:
        while (item := schedule.next_task(self.cond, self.queue, lambda: self.pending > 0, self.cancel)) is not None:
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

    def _run_task(self, job: FileJob, index: int | None) -> None:
        with job.lock:
            if job.failed is not None or job.finished:
                return
            if job.sequential and index is not None and index != WHOLE:
                return  # the whole-file GET writes this chunk
            if index == WHOLE and job.finishing:
                return  # every chunk arrived by range after all: nothing left for it to do
            job.open()
        if index == WHOLE:
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
                if index in job.cached and job.digest.next > index:
                    # written through the cache and hashed as it arrived: its pages are clean now
                    release_pages(job.fd, *job.chunk(index))  # type: ignore[arg-type]  # fd is open here
                job.done.add(index)
                job.write_journal()
                complete = len(job.done) == job.nchunks
                job.finishing = complete
            with self.bytes_lock:
                self.chunks_journaled += 1
                journaled = self.chunks_journaled
            pause_point("after_chunk", journaled)
            if not complete:
                job.digest.advance(job)
                return
        self._finish(job)

    def _fetch_chunk(self, job: FileJob, index: int) -> None:
        failures = 0
        while True:
            if self.cancel.is_set():
                raise _transfer.Cancelled()
            if job.failed is not None:
                return
            try:
                stream_chunk(self.listing, job, index, self.headers, self.timeout, self.cancel, self.count)
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

    def _backoff(self, job: FileJob, e: _transfer.Retryable, failures: int) -> bool:
        """Sleep before the next attempt; False (and the file failed) when attempts ran out."""
        if failures >= self.retry.attempts:
            self.fail(job, f"{e}; gave up after {failures} attempts")
            return False
        _transfer.back_off(self.retry, failures, e.retry_after)
        return True

    def _go_sequential(self, job: FileJob) -> None:
        """The server ignores Range for this file: queue one whole-file GET (once)."""
        with job.lock:
            if job.sequential or job.failed is not None or job.finishing:
                return
            job.sequential = True
        with self.cond:
            self.result.notes.append(f"{job.entry.path}: the server ignores Range; fetched with one "
                                     f"sequential GET instead of parallel chunks")
        self.submit(job, WHOLE)

    def _fetch_whole(self, job: FileJob) -> bool:
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
                stream_whole(self.listing, job, self.headers, self.timeout, self.cancel, self.count, chunk_reached,
                             self.piece)
                return True
            except _transfer.Fatal as e:
                self.fail(job, str(e))
                return False
            except _transfer.Retryable as e:
                failures += 1
                if not self._backoff(job, e, failures):
                    return False

    def _restart_from_byte_zero(self, job: FileJob) -> None:
        """Forget what was hashed and journaled before a whole-file GET: it rewrites the file
        from byte 0, so chunks that ranged GETs (or an earlier attempt) wrote and hashed get new
        bytes, which the digest must cover instead of the old ones."""
        with job.digest.busy:
            job.digest.reset()
        with job.lock:
            job.done = set()
            job.cached = set()  # the whole-file GET writes every chunk, as the run writes in line
            job.write_journal()

    def _finish(self, job: FileJob) -> None:
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
        problem = mismatch(entry, size if hashed == size else hashed, sha256, git_sha1)
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
                for i in ([WHOLE] if job.sequential else range(job.nchunks)):
                    self.submit(job, i)
                return
            self.fail(job, f"{problem} (also after re-fetching the whole file)")
            with job.lock:
                job.close()
                _dest.unlink(job.journal)
                _dest.unlink(job.part)
            return
        pause_point("before_rename")
        with job.lock:
            job.close()
            os.replace(job.part, job.final)
            fsync_dir(os.path.dirname(job.final))
            _dest.unlink(job.journal)
            job.finished = True
            with self.cond:
                self.result.fetched.append(entry.path)

    def run(self) -> None:
        schedule.run_workers(self.worker, self.workers, "k3ckpt-fetch", self.cond, lambda: self.pending > 0,
                              self.cancel)


def _local_failure(e: OSError, path: str) -> str:
    """One line for a local I/O failure, naming the file and what to do about it."""
    hint = ""
    if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        hint = "; free space (or raise the file-size limit) and re-run: finished chunks are kept"
    elif e.errno in (errno.EMFILE, errno.ENFILE):
        hint = "; raise the open-files limit (ulimit -n) or use fewer --jobs, and re-run"
    return f"{e.filename or path}: {e.strerror or e}{hint}"
