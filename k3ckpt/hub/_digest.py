"""Verification of fetched bytes: what makes a downloaded file trusted before it gets its final name.

Used by the downloader (:mod:`k3ckpt.hub.download`):

- :class:`StreamDigest`: a ``.part``'s sha256 (and git blob id, for a file the hub lists by
  one) computed while it downloads, in file order. The worker streaming the next chunk in line
  feeds it the bytes it receives (the buffer it writes), and a chunk that completed ahead of
  its turn is read back from the ``.part`` when its turn comes.
- :func:`mismatch`: why a size and digest do not match the listing (the check of a finished
  ``.part`` before its rename).
- :func:`already_present`: the skip check of a file already under its final name (size, then
  the full digest: that is the contract).
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
from typing import Any, Protocol

from ..integrity.hashing import HashError, hash_file
from ..utils import release_pages
from . import _transfer
from .client import HubFile


class PartFile(Protocol):
    """What the digest reads of a file being written: a downloaded file
    (:class:`~k3ckpt.hub._filejob.FileJob`, whose chunks are its ranged requests). ``done``
    holds the chunks whose bytes are all written (and checked, where they are checked);
    ``cached`` the chunks written through the page cache (ahead of the digest: see
    :func:`~k3ckpt.hub._filejob.stream_chunk`)."""

    @property
    def fd(self) -> int | None: ...
    @property
    def dfd(self) -> int | None: ...
    @property
    def lock(self) -> threading.Lock: ...
    @property
    def nchunks(self) -> int: ...
    @property
    def done(self) -> set[int]: ...
    @property
    def cached(self) -> set[int]: ...

    def chunk(self, i: int) -> tuple[int, int]: ...


class StreamDigest:
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

    def __init__(self, size: int, *, git: bool = False) -> None:
        self.git = git
        self.size = size
        self.busy = threading.Lock()
        self.saved: tuple[Any, Any, int] | None = None  # the state at the claimed chunk's start
        self.reset()

    def reset(self) -> None:
        """Start over (the file is being fetched again); the caller holds ``busy``."""
        self.next = 0  # index of the first chunk not yet hashed
        self.hashed = 0  # bytes hashed
        self.sha256 = hashlib.sha256()
        self.blob = hashlib.sha1(b"blob %d\0" % self.size) if self.git else None

    @classmethod
    def for_entry(cls, entry: HubFile) -> StreamDigest:
        """The digest a hub file is checked by: its sha256, and its git blob id where the hub lists only that."""
        return cls(entry.size, git=entry.sha256 is None and entry.git_sha1 is not None)

    def feed(self, data: memoryview) -> None:
        """Hash the next bytes of the file (the caller holds ``busy``)."""
        self.sha256.update(data)
        if self.blob is not None:
            self.blob.update(data)
        self.hashed += len(data)

    def hash_written(self, job: PartFile, start: int, length: int, *, cached: bool = False) -> None:
        """Hash ``length`` bytes of the ``.part`` from ``start``, read back from it. Bytes written
        past the page cache are read through the ``O_DIRECT`` descriptor when there is one and
        the offset allows (reading them through the cache would allocate it after all); bytes
        written through it (``cached``: a chunk that started ahead of the digest) are read from
        the cache, a memory copy instead of a disk read, and their pages let go once hashed.
        This thread's own writes still in flight land first
        (:func:`~k3ckpt.hub._transfer.flush_writes`)."""
        _transfer.flush_writes()
        fd, dfd = job.fd, None if cached else job.dfd
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
        if cached:  # read once, as O_DIRECT would have left them: not held in the cache
            release_pages(fd, start, length)  # type: ignore[arg-type]  # fd is open here

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

    def advance(self, job: PartFile, *, wait: bool = False) -> None:
        """Hash the chunks from the cursor on that are done; with ``wait``, wait for the thread
        already hashing this file instead of leaving the work to it."""
        while self.busy.acquire(blocking=wait):
            try:
                while True:
                    with job.lock:
                        i, fd = self.next, job.fd
                        ready = i < job.nchunks and i in job.done
                        cached = i in job.cached
                    if not ready or fd is None:
                        break
                    start, length = job.chunk(i)
                    self.hash_written(job, start, length, cached=cached)
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


def mismatch(entry: HubFile, size: int, sha256: str, git_sha1: str | None) -> str | None:
    """Why local content does not match the listing, or None if it does."""
    if size != entry.size:
        return f"size {size} != listed {entry.size}"
    if entry.sha256 is not None:
        return None if sha256 == entry.sha256 else f"sha256 mismatch: expected {entry.sha256}, got {sha256}"
    if entry.git_sha1 is not None:
        return None if git_sha1 == entry.git_sha1 else f"git blob id mismatch: expected {entry.git_sha1}, got {git_sha1}"
    return None  # the hub gave no digest: size is all there is to check


def already_present(entry: HubFile, final: str) -> bool:
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
    return mismatch(entry, digest.size, digest.sha256, digest.git_sha1) is None
