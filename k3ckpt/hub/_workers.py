"""The workers that fill the output files of a rank-aware or node fetch, and the run around them.

:class:`OutputRun` holds a queue of tasks (:class:`~k3ckpt.hub._pieces.Task`) and ``workers``
threads; each task's pieces stream into their job's ``.part`` (the package's streaming code,
shared with the downloader: its response checks and retry rules) and are journaled once
``fdatasync``-ed. With a tensor-hash manifest each tensor is hashed while its bytes stream in (no
second read, :class:`TensorHasher`) and compared with the manifest; a mismatch re-fetches that
task once, then fails the file naming the tensor. A task whose every request is journaled was
verified (its last request is journaled only after the tensor hashes matched); a large tensor's
earlier requests are re-read from the ``.part`` on resume to rebuild its hash. With
``stream_digests`` (a node directory's files) every task's tensors are hashed that way, manifest
or not: the file's digest is built from them and its header
(:func:`~k3ckpt.format.filedigest.segments_sha256`), so a task's bytes are hashed once, by whichever
worker receives them, in whatever order the tasks complete. Tasks are handed out so that workers
spread over files (:class:`~k3ckpt.hub.schedule.SpreadQueue`). A complete
``.part`` is checked (size, header bytes) and renamed into place, then added to
:data:`SHARD_RECORD`.

:func:`fetch_run` is the frame of both fetches' runs (the downloader's destination lock, the
result, its timing); :func:`open_jobs` and :func:`fetch_outputs` are what both do inside it:
skip the output files already complete, resume or start the others, check the free space, fetch
the non-weight files whole through the downloader, then run the workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..env import K3CKPT_DIRECT_IO
from ..errors import K3ckptError
from ..faults import pause_point
from ..format.header import parse_header_bytes
from ..integrity.manifest import Manifest
from ..utils import fsync_dir, write_atomic
from ..utils.ownership import locked_output_dir
from ..utils.space import require_free_space
from . import _dest, _http, _transfer, download, schedule
from . import client as hubclient
from ._pieces import OutputJob, OutputPlan, Piece, PieceFailed, Task
from ._remote import check_against_manifest
from ._result import FetchPlanTotals, RankFetchResult
from .client import HubListing, RetryPolicy

_READ_BACK = 1 << 20  # bytes per pread when re-hashing a resumed large tensor


class TensorHasher:
    """sha256 of each tensor of a task, fed the task's bytes in output order."""

    def __init__(self, tensors: tuple[tuple[str, int, int], ...]) -> None:
        self.tensors = tensors
        self.i = 0
        self.pos = tensors[0][1] if tensors else 0
        self.h = hashlib.sha256()
        self.digests: dict[str, str] = {}
        self._close_finished()

    def _close_finished(self) -> None:
        while self.i < len(self.tensors) and self.pos == self.tensors[self.i][2]:
            self.digests[self.tensors[self.i][0]] = self.h.hexdigest()
            self.h = hashlib.sha256()
            self.i += 1

    def feed(self, data: memoryview) -> None:
        while data:
            take = min(len(data), self.tensors[self.i][2] - self.pos)
            self.h.update(data[:take])
            self.pos += take
            data = data[take:]
            self._close_finished()

    def snapshot(self) -> tuple[int, int, Any, dict[str, str]]:
        return self.i, self.pos, self.h.copy(), dict(self.digests)

    def restore(self, snap: tuple[int, int, Any, dict[str, str]]) -> None:
        self.i, self.pos, h, digests = snap
        self.h, self.digests = h.copy(), dict(digests)


#: Which source content each rewritten shard of the destination was written from
#: (:meth:`k3ckpt.hub.rankfetch.ShardPlan.content_key`), updated after each shard's rename. Size and header say
#: nothing about the tensor bytes: without a manifest, this record is what tells a shard of the
#: hub's current revision from one of an earlier revision with the same header.
SHARD_RECORD = ".cache/k3ckpt/rank-shards.json"


def load_shard_record(dest_real: str) -> dict[str, str]:
    try:
        doc = json.loads(Path(dest_real, SHARD_RECORD).read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)}


class OutputRun:
    """Shared state of the output files' download: a task queue and ``workers`` threads.

    ``before_rename(job, tensors)``, when given, runs once a ``.part`` is complete and checked,
    before its rename, with its tensors' sha256 by name when ``stream_digests`` (a node
    directory's writer records the file's digests there: raising :class:`PieceFailed` fails the
    file, which then never gets its final name)."""

    def __init__(self, listing: HubListing, manifest: Manifest | None, dest: Path, result: RankFetchResult,
                 headers: dict[str, str], retry: RetryPolicy, progress: Callable[[int], None] | None,
                 before_rename: Callable[[OutputJob, dict[str, str] | None], None] | None = None,
                 stream_digests: bool = False, direct: bool = False) -> None:
        self.listing = listing
        self.direct = direct  # write aligned pieces with O_DIRECT (see _transfer.open_direct)
        self.manifest = manifest
        self.before_rename = before_rename
        self.stream_digests = stream_digests
        self.streamed: dict[OutputJob, dict[str, str]] = {}  # tensor digests of the tasks done, per file
        self.result = result
        self.headers = headers
        self.retry = retry
        self.progress = progress
        self.cancel = threading.Event()
        self.cond = threading.Condition()
        # a spare worker joins a file in flight at once: each task's tensors are hashed by the
        # worker receiving them, and no digest needs the file's bytes in order
        self.queue: schedule.SpreadQueue[OutputJob, int | None] = schedule.SpreadQueue()
        self.pending = 0
        self.count_lock = threading.Lock()
        self.pieces_journaled = 0
        self.record_lock = threading.Lock()
        self.dest_real = os.path.realpath(dest)

    def count(self, n: int) -> None:
        with self.count_lock:
            self.result.bytes_downloaded += n
        if self.progress is not None:
            self.progress(n)

    def fail(self, job: OutputJob, reason: str) -> None:
        with job.lock:
            if job.failed is None:
                job.failed = reason
                with self.cond:
                    self.result.failed[job.plan.path] = reason

    # -- one task --------------------------------------------------------------------------------

    def run_task(self, job: OutputJob, k: int | None) -> None:
        """Fetch task ``k`` of ``job`` (None: the job has no task; it only needs finishing)."""
        with job.lock:
            if job.failed is not None:
                return
            if job.fd is None:
                job.open()
                if self.direct:
                    job.dfd = _transfer.open_direct(job.fd)  # type: ignore[arg-type]  # open() set it
        if k is None:
            return
        task = job.plan.tasks[k]
        manifest = self.manifest
        streamed = self.streamed.get(job)
        for attempt in (1, 2):
            hasher = TensorHasher(task.tensors) if manifest is not None or streamed is not None else None
            self._fetch_task(job, task, hasher)
            if hasher is None:
                return
            bad = [(n, d) for n, d in hasher.digests.items()
                   if manifest is not None and manifest.tensors[n].sha256 != d]
            if not bad:
                if manifest is not None:
                    with self.count_lock:
                        self.result.tensors_verified += len(hasher.digests)
                    if task.pieces and task.pieces[-1] not in job.done:
                        self._journal(job, [task.pieces[-1]])
                if streamed is not None:
                    with job.lock:
                        streamed.update(hasher.digests)
                return
            with job.lock:  # un-journal the task: its bytes are not what the manifest says
                job.done.difference_update(task.pieces)
                job.write_journal()
            if attempt == 2:
                name, got = bad[0]
                more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
                assert manifest is not None
                raise PieceFailed(f"tensor {name!r}: sha256 {got} but the manifest says "
                                  f"{manifest.tensors[name].sha256}{more}, also after re-fetching its bytes")

    def _fetch_task(self, job: OutputJob, task: Task, hasher: TensorHasher | None) -> None:
        """Write ``task``'s pieces not yet journaled (feeding ``hasher`` every byte of the task in
        order, the journaled ones read back from the ``.part``); each piece is journaled once
        synced, except the last with a manifest (journaled once its tensors match)."""
        sink = hasher.feed if hasher is not None else None
        for n, i in enumerate(task.pieces):
            piece = self.plan_piece(job, i)
            if i in job.done:
                if sink is not None:
                    self._rehash(job, piece, sink)
                continue
            self._fetch_piece(job, piece, hasher, sink)
            os.fdatasync(job.fd) if hasattr(os, "fdatasync") else os.fsync(job.fd)  # type: ignore[arg-type]  # fd is open here
            if not (n == len(task.pieces) - 1 and self.manifest is not None):  # a task's last piece is journaled once verified
                self._journal(job, [i])

    @staticmethod
    def plan_piece(job: OutputJob, i: int) -> Piece:
        return job.plan.pieces[i]

    def _journal(self, job: OutputJob, pieces: list[int]) -> None:
        with job.lock:
            if self.cancel.is_set() or job.failed is not None:
                return
            job.done.update(pieces)
            job.write_journal()
        with self.count_lock:
            self.pieces_journaled += 1
            n = self.pieces_journaled
        pause_point("after_piece", n)  # test hook: the n-th piece of the run journaled

    @staticmethod
    def _rehash(job: OutputJob, piece: Piece, sink: Callable[[memoryview], None]) -> None:
        """Feed a resumed piece's bytes from the ``.part`` (a task cut by a crash)."""
        off, end = piece.dst, piece.dst + piece.length
        while off < end:
            data = os.pread(job.fd, min(_READ_BACK, end - off), off)  # type: ignore[arg-type]  # fd is open here
            if not data:
                raise PieceFailed(f"{job.part}: short read at {off} while re-hashing resumed bytes")
            sink(memoryview(data))
            off += len(data)

    def _fetch_piece(self, job: OutputJob, piece: Piece, hasher: TensorHasher | None,
                     sink: Callable[[memoryview], None] | None) -> None:
        failures = 0
        where = f"bytes {piece.src}+{piece.length}"
        while True:
            if self.cancel.is_set():
                raise _transfer.Cancelled()
            snap = hasher.snapshot() if hasher is not None else None
            try:
                _transfer.stream_range(self.listing, job.plan.source_of(piece), piece.src, piece.length, job.fd,  # type: ignore[arg-type]  # fd is open here
                                       piece.dst, self.headers, download.TIMEOUT, self.cancel, self.count,
                                       sink=sink, direct_fd=job.dfd)
                return
            except _transfer.Fatal as e:
                raise PieceFailed(f"{e} ({where})") from None
            except _transfer.Retryable as e:
                failures += 1
                if hasher is not None and snap is not None:
                    hasher.restore(snap)  # what the failed response fed is void
                if failures >= self.retry.attempts:
                    raise PieceFailed(f"{e}; gave up after {failures} attempts ({where})") from None
                _transfer.back_off(self.retry, failures, e.retry_after)

    # -- finishing a shard -----------------------------------------------------------------------

    def finish(self, job: OutputJob) -> None:
        """Check the complete ``.part`` (size, header) and rename it into place."""
        sp = job.plan
        assert job.fd is not None
        os.fsync(job.fd)
        if os.fstat(job.fd).st_size != sp.size:
            raise PieceFailed(f"{job.part} is {os.fstat(job.fd).st_size} bytes, expected {sp.size}")
        head = os.pread(job.fd, len(sp.prefix), 0)
        if head != sp.prefix:
            raise PieceFailed(f"{job.part}: the header on disk is not the one written")
        parse_header_bytes(head[8:], file=sp.path, path=job.part, file_size=sp.size)  # valid safetensors
        streamed = self.streamed.get(job)
        with job.lock:
            digests = dict(streamed) if streamed is not None else None
        if self.before_rename is not None:
            self.before_rename(job, digests)
        pause_point("before_shard_rename")  # test hook
        with job.lock:
            job.close()
            os.replace(job.part, job.final)
            fsync_dir(os.path.dirname(job.final))
            _dest.unlink(job.journal)
        self.record_written(sp)
        with self.cond:
            self.result.written.append(sp.path)

    def record_written(self, sp: OutputPlan) -> None:
        """Add ``sp`` to :data:`SHARD_RECORD` (after its rename: a crash in between only costs a
        re-fetch of that shard)."""
        with self.record_lock:
            path = Path(self.dest_real, SHARD_RECORD)
            record = load_shard_record(self.dest_real)
            record[sp.path] = sp.content_key()
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, (json.dumps(dict(sorted(record.items())), indent=1) + "\n").encode())

    # -- workers ---------------------------------------------------------------------------------

    def submit(self, job: OutputJob) -> None:
        if self.stream_digests:
            self.streamed[job] = {}
        with self.cond:
            for k in range(len(job.plan.tasks)):
                self.queue.append((job, k))
                self.pending += 1
            if not job.plan.tasks:
                self.queue.append((job, None))  # nothing to fetch: just finish
                self.pending += 1
                job.remaining = 1
            self.cond.notify_all()

    def worker(self) -> None:
        while (item := schedule.next_task(self.cond, self.queue, lambda: self.pending > 0, self.cancel)) is not None:
            job, k = item
            try:
                self.run_task(job, k)
                with job.lock:
                    job.remaining -= 1
                    last = job.remaining == 0 and job.failed is None
                if last:
                    self.finish(job)
            except _transfer.Cancelled:
                pass
            except PieceFailed as e:
                self.fail(job, str(e))
            except K3ckptError as e:
                self.fail(job, str(e))
            except Exception as e:  # noqa: BLE001 - never lose a worker silently: fail the shard, keep going
                self.fail(job, f"{type(e).__name__}: {_http.one_line(str(e))[:300]}")
            finally:
                with self.cond:
                    self.queue.finished(job)
                    self.pending -= 1
                    self.cond.notify_all()

    def run(self, workers: int) -> None:
        schedule.run_workers(self.worker, workers, "k3ckpt-rankfetch", self.cond, lambda: self.pending > 0,
                              self.cancel)


class RunPlan(FetchPlanTotals, Protocol):
    """What :func:`fetch_run` and :func:`fetch_outputs` need of a rank-aware or node fetch plan."""

    @property
    def manifest(self) -> Manifest | None: ...
    @property
    def chunk_size(self) -> int: ...


@contextmanager
def fetch_run(plan: RunPlan, workers: int, retry: RetryPolicy | None,
              names: list[str]) -> Iterator[tuple[RankFetchResult, str, RetryPolicy]]:
    """The frame of a run: holds the destination's lock (the downloader's) and claims ``names`` in
    it for the body, which gets ``(result, dest_real, retry policy)``; once the body returned, the
    result's lists are sorted and its time set.

    Raises:
        ValueError: ``workers`` < 1.
        FetchLockedError: Another live fetch holds the destination's lock.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    t0 = time.monotonic()
    policy = retry or download.FETCH_RETRY
    result = RankFetchResult(dest=plan.dest, verification=plan.verification, bytes_total=plan.bytes_total)
    dest_real = os.path.realpath(plan.dest)
    with locked_output_dir(plan.dest, _dest.DestLock(dest_real)):  # a refusal leaves no directory it made
        _dest.claim_dest(dest_real, names)
        yield result, dest_real, policy
    result.written.sort()
    result.skipped.sort()
    result.seconds = time.monotonic() - t0


P = TypeVar("P", bound=OutputPlan)
T = TypeVar("T")


def open_jobs(dest_real: str, outputs: Iterable[P], present: Callable[[P, str], T | None], result: RankFetchResult,
              workers: int) -> tuple[list[OutputJob], dict[str, T]]:
    """A job (resumed from its journal when it can be) for each output file not already complete,
    and, by path, what ``present(op, final)`` said of those that are (something true). A file whose
    name leaves the destination fails in ``result``; a complete one is added to its ``skipped``."""
    targets: list[tuple[P, str]] = []
    for op in outputs:
        try:
            targets.append((op, _dest.target(dest_real, op.path)))
        except ValueError as e:
            result.failed[op.path] = str(e)
    # with a manifest this reads every present file: in parallel, as the downloader does
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = list(pool.map(lambda t: present(t[0], t[1]), targets))
    jobs: list[OutputJob] = []
    found: dict[str, T] = {}
    for (op, final), got in zip(targets, done):
        if got:
            found[op.path] = got
            result.skipped.append(op.path)
            _dest.unlink(final + ".part.journal")
            continue
        job = OutputJob(op, final, dest_real)
        job.load_resume()
        jobs.append(job)
    return jobs, found


def fetch_outputs(plan: RunPlan, result: RankFetchResult, dest_real: str, jobs: list[OutputJob], whole: list[str],
                  what: str, *, workers: int, token: str | None, progress: Callable[[int], None] | None,
                  on_plan: Callable[[int], None] | None, policy: RetryPolicy, check_space: bool,
                  before_rename: Callable[[OutputJob, dict[str, str] | None], None] | None = None,
                  stream_digests: bool = False) -> None:
    """Fetch the files ``whole`` through the downloader, then fill ``jobs`` (``what`` they are, for
    the free-space message) with the workers, recording everything in ``result``: nothing ends
    neither written nor failed. ``stream_digests``: each job's tensor digests are
    computed from the bytes as they are written and handed to ``before_rename``."""
    todo = sum(job.todo_bytes() for job in jobs)
    if check_space:
        # before any byte moves, for both stages together (the downloader checks its own
        # stage again, exactly); whole files not there at all are what they will take, and a
        # resumed .part is allocated already
        absent = [f for f in whole if not os.path.lexists(os.path.join(dest_real, f))]
        needed = sum(job.plan.size for job in jobs if not job.done) + sum(plan.listing.files[f].size for f in absent)
        require_free_space(dest_real, needed, f"for {len(jobs)} {what} and {len(absent)} file(s)")
    report = (lambda n: on_plan(n + todo)) if on_plan is not None else None
    if whole:
        fr = download.fetch_files(plan.listing, plan.dest, whole, workers=workers, chunk_size=plan.chunk_size,
                                  token=token, progress=progress, on_plan=report, retry=policy,
                                  check_space=check_space, take_lock=False)
        result.fetched, result.files_skipped = list(fr.fetched), list(fr.skipped)
        result.failed.update(fr.failed)
        result.bytes_downloaded += fr.bytes_downloaded
        if plan.manifest is not None:
            result.failed.update(check_against_manifest(plan.manifest, plan.listing, dest_real,
                                                        fr.fetched + fr.skipped))
    elif report is not None:
        report(0)

    hubclient.load_client(plan.listing.hub)  # before the workers: see load_client
    # read here, not in a worker: a bad value is the run's error (as the downloader's)
    direct = K3CKPT_DIRECT_IO.get() and download.filesystem_of(dest_real) in download.DIRECT_IO_FILESYSTEMS
    run = OutputRun(plan.listing, plan.manifest, plan.dest, result, hubclient.auth_headers(plan.listing, token), policy,
                    progress, before_rename, stream_digests, direct)
    for job in jobs:
        run.submit(job)
    try:
        if jobs:
            run.run(workers)
    finally:
        for job in jobs:
            job.close()
    for job in jobs:  # nothing may end neither written nor failed
        if job.plan.path not in result.written and job.plan.path not in result.failed:
            result.failed[job.plan.path] = "not completed"
