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

Concurrent fetches into one destination are excluded by ``dest/.k3ckpt-fetch.lock`` (created
exclusively, NFS-safe; a lock whose process is dead, or another host's older than
``K3CKPT_LOCK_STALE_SECONDS``, is broken safely: see the package's ``_dest`` module).

This module is the entry point: :func:`fetch_files` plans a run (the files to fetch, the skip
check of files already present, the destination's lock, the free-space check, the resumable
chunks) and its settings live here. The parts, in the package's private modules:

- ``_filejob``: one file's ``.part``, its journal (crash safety, format) and the GETs that
  write it;
- ``_digest``: the digest computed as a file downloads, and the checks against the listing;
- ``_fetchrun``: the run's workers and task queue, retries and the sequential fallback, each
  file's verify-and-rename, and :class:`FetchResult`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from ..env import K3CKPT_DIRECT_IO, K3CKPT_SHARE_FILES
from ..errors import DiskSpaceError, FetchLockedError
from ..utils.ownership import locked_output_dir
from ..utils.space import require_free_space
from . import _dest, _transfer
from . import client as hubclient
from ._dest import LOCK_NAME
from ._digest import already_present
from ._fetchrun import FetchResult, FetchRun
from ._filejob import FileJob
from .client import HubFile, HubListing, RetryPolicy, default_requests

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

#: Default chunk size: one ranged GET, and the unit of resume. Each chunk ends its request: the
#: stream stops until the last piece is written and the next request answers. At 64 MiB that cost
#: a whole fetch 6-7 % of its wall and ~4 % of its CPU against 256 MiB (2026-12-05, 2 cores,
#: loopback hub, 5-6 interleaved rounds: k3-density 2.77 -> 2.60 s, k3-8gb 6.32 -> 5.88 s; a node
#: fetch, whose requests it caps, the same or 5 % faster). Larger gained no more on two 4 GB
#: files (fewer chunks to share among the workers at the end). Still small enough that a crash
#: costs seconds of a fast link (the chunks in flight) and that a 17 GB shard spreads over 66.
DEFAULT_CHUNK = 256 * 1024 * 1024
#: Connect/read timeout per request, in seconds (a module setting so tests can shorten it).
TIMEOUT = 60.0
#: Bytes read from a body and written per step (a module setting so tests can make a connection
#: loss land mid-chunk on small files).
PIECE = _transfer.PIECE
#: Retry policy when none is given: a multi-hour download should ride out a hub hiccup.
FETCH_RETRY = RetryPolicy(attempts=8, backoff=1.0, max_backoff=60.0, max_retry_after=300.0)

#: Filesystems on a local block device, where an ``O_DIRECT`` write goes to the disk without
#: a page-cache copy. Elsewhere fetch writes through the page cache: on NFS or SMB every direct
#: write is a synchronous round trip (and a COMMIT), on tmpfs there is nothing to bypass, and
#: FUSE or cluster filesystems each do something of their own.
DIRECT_IO_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs"})
#: Where the mount table is read from (a module setting so tests can give another).
MOUNTINFO = "/proc/self/mountinfo"


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
    workers: int | None = None,
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
        dest: Destination directory (created if missing, and removed again with the parents
            this run created when it is refused before its first byte); files land at
            ``dest/<path>``.
        paths: Repo-relative paths to fetch; ``None`` fetches the whole listing.  A path not in
            the listing is reported in ``failed``.
        workers: Parallel requests (threads) [default: :func:`~k3ckpt.hub.client.default_requests`].
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
    workers = default_requests() if workers is None else workers
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    if take_lock:  # a refusal (disk space) leaves no directory it made
        with locked_output_dir(dest, _dest.DestLock(os.path.realpath(dest))):
            return fetch_files(listing, dest, paths, workers=workers, chunk_size=chunk_size, token=token,
                               progress=progress, on_plan=on_plan, retry=retry, check_space=check_space,
                               take_lock=False, place=place)
    t0 = time.monotonic()
    policy = retry or FETCH_RETRY
    dest_path = Path(dest)
    os.makedirs(dest_path, exist_ok=True)
    dest_real = os.path.realpath(dest_path)
    wanted = list(listing.files) if paths is None else list(dict.fromkeys(paths))
    result = FetchResult(dest=dest_path)

    # read here, not in a worker: a bad value is the run's error
    direct = K3CKPT_DIRECT_IO.get() and filesystem_of(dest_real) in DIRECT_IO_FILESYSTEMS
    share_files = K3CKPT_SHARE_FILES.get()
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
        present = list(pool.map(lambda ef: already_present(*ef), entries))
    jobs: list[FileJob] = []
    for (entry, final), is_there in zip(entries, present):
        if is_there:
            result.skipped.append(entry.path)
            # Leftovers of a run killed between its rename and its journal removal.
            _dest.unlink(final + ".part.journal")
            if os.path.isfile(final + ".part") and not os.path.islink(final + ".part"):
                _dest.unlink(final + ".part")
            continue
        job = FileJob(entry, final, chunk_size, dest_real, direct)
        job.load_resume()
        jobs.append(job)

    resumed = {job.entry.path for job in jobs if job.done}  # an earlier run's journaled chunks adopted
    # From the journaled chunks, not by walking every chunk: a hostile listing's size of
    # 2**60 bytes must reach the space check below, not spin through 2**34 chunks first.
    to_download = sum(job.entry.size - sum(job.chunk(i)[1] for i in job.done) for job in jobs)
    if check_space and jobs:
        needed = sum(job.entry.size - job.resumable_bytes() for job in jobs)
        require_free_space(dest_real, needed, f"to fetch {len(jobs)} file(s)")
    if on_plan is not None:
        on_plan(to_download)

    hubclient.load_client(listing.hub)  # before the workers: see load_client
    run = FetchRun(listing, hubclient.auth_headers(listing, token), policy, workers, progress, result,
                   timeout=TIMEOUT, piece=PIECE, share_files=share_files)
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
    result.resumed = sorted(resumed & set(result.fetched))
    result.fetched.sort()
    result.skipped.sort()
    result.seconds = time.monotonic() - t0
    return result
