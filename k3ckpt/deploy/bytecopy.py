"""Moving byte runs between files: kernel-side where possible, hashed while written.

Shared by ``reshard`` (source shards -> rank files) and ``unshard`` (rank files -> a local-dir
checkpoint). A *run* is ``count`` rows of ``length`` bytes ``stride`` apart in a source file;
contiguous runs are copied with ``os.copy_file_range`` (falling back to ``os.sendfile``, then to
a bounded ``pread``/``pwrite``) in chunks of :data:`CHUNK` bytes, and each chunk is hashed in
the same pass from the source, read a little at a time into a buffer that stays in the CPU's
cache (no read-back of the output; the copy that follows finds the source's pages hot).
Strided runs are gathered, and split parts interleaved, through bounded buffers. Memory is a
few :data:`CHUNK`-sized buffers per worker, whatever the size of the data.

Output files are written under temporary names (:func:`tmp_name`), fsync'd and renamed; a
directory is fsync'd after renames (:func:`k3ckpt.utils.fsync_dir`).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from ..env import K3CKPT_LOCK_STALE_SECONDS
from ..errors import SourceShortReadError
from ..utils import pwrite_all, read_in_order, release_pages
from ..utils.lock import OUTPUT_LOCK_NAME, DirLock

#: Bytes per copy / hash step (and the size of each worker's buffers).
CHUNK = 8 * 1024 * 1024
#: A strided row at least this long is copied as its own contiguous run instead of gathered.
ROW_COPY_MIN = 1024 * 1024


class Run(NamedTuple):
    """``count`` rows of ``length`` bytes, ``stride`` apart, from absolute offset ``offset``.
    A named tuple: a K3 reshard plans one per tensor (~497k), built in C-level loops."""

    offset: int
    length: int
    count: int = 1  # type: ignore[assignment]  # (shadows tuple.count, which no caller uses)
    stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.length * self.count


_KERNEL_FALLBACK = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF, errno.EPERM)


def _gather_rows(data: memoryview, out: memoryview, rows: int, length: int, stride: int) -> None:
    """``out[:rows * length]`` = the first ``length`` bytes of each of ``rows`` rows ``stride``
    apart in ``data``. A slice assignment per row, not numpy: a TP slice of a later dim has
    rows of a few KB (~0.4 us each here: 0.08 CPU-s for the 197k rows of k3-8shard's
    ``--ep 8 --tp 2``), while importing numpy cost ~0.14 CPU-s plus an OpenBLAS thread
    spinning beside the writers (~0.1 CPU-s per run on 2 cores)."""
    o = 0
    s = 0
    for _ in range(rows):
        out[o:o + length] = data[s:s + length]
        o += length
        s += stride


class Copier:
    """Moves byte runs from source fds to a destination fd, hashing what it writes.

    Each chunk written is handed to :func:`~k3ckpt.utils.release_pages` at once: its writeback
    starts now and its pages leave the cache once written. Copied output is not read again;
    without this the kernel lets gigabytes of dirty pages pile up and the final ``fsync`` waits
    for all of them while the disk was idle before (side by side on the rank format of
    k3-density, 2026-12-06: 3.91 s with it, 4.53 s leaving writeback to the kernel)."""

    def __init__(self, mode: str, sources: FdCache | None, hash_step: int) -> None:
        """``hash_step``: bytes of a source read and hashed at a time before a chunk is copied
        kernel-side (``$K3CKPT_HASH_BUFFER``, which a run reads before its first byte)."""
        self.mode = mode  # "kernel" (copy_file_range, sendfile fallback) or "buffered"
        self.sources = sources  # the source fds' owner: names a source that ends early
        self.buf = bytearray(CHUNK)
        self.view = memoryview(self.buf)
        self.gbuf: bytearray | None = None  # gather buffer for strided runs
        self.hash_step = min(CHUNK, hash_step)

    def _kernel(self, src: int, dst: int, n: int, so: int, do: int) -> bool:
        """Copy ``n`` bytes kernel-side; False when the kernel cannot (fall back to buffered)."""
        while n:
            if self.mode == "kernel":
                try:
                    k = os.copy_file_range(src, dst, n, so, do)
                except OSError as e:
                    if e.errno not in _KERNEL_FALLBACK:
                        raise
                    self.mode = "sendfile"
                    continue
            elif self.mode == "sendfile":
                try:
                    os.lseek(dst, do, os.SEEK_SET)
                    k = os.sendfile(dst, src, so, n)
                except OSError as e:
                    if e.errno not in _KERNEL_FALLBACK:
                        raise
                    self.mode = "buffered"
                    return False
            else:
                return False
            if k == 0:
                raise self._short(src, n, so)
            n -= k
            so += k
            do += k
        return True

    def _short(self, fd: int, missing: int, offset: int) -> SourceShortReadError:
        """The error for a source (truncated under us) that ended ``missing`` bytes early."""
        path = self.sources.path_of_fd(fd) if self.sources is not None else None
        where = f"{path}: " if path is not None else ""
        return SourceShortReadError(f"{where}source ended early: {missing} bytes missing at offset {offset}",
                                    path=path)

    def _pread(self, fd: int, n: int, off: int) -> memoryview:
        v = self.view[:n]
        got = 0
        while got < n:
            k = os.preadv(fd, [v[got:]], off + got)
            if k == 0:
                raise self._short(fd, n - got, off + got)
            got += k
        return v

    def contiguous(self, src: int, dst: int, so: int, do: int, n: int,
                   sinks: Callable[[memoryview], None] | None) -> None:
        """Copy ``n`` bytes and feed them, in order, to ``sinks`` (None: nobody needs them, a
        plain kernel-side copy)."""
        while n:
            k = min(n, CHUNK)
            if not self._copied_in_kernel(src, dst, k, so, do, sinks):
                data = self._pread(src, k, so)
                pwrite_all(dst, data, do)
                if sinks is not None:
                    sinks(data)
            release_pages(dst, do, k)
            n -= k
            so += k
            do += k

    def _copied_in_kernel(self, src: int, dst: int, k: int, so: int, do: int,
                          sinks: Callable[[memoryview], None] | None) -> bool:
        """Copy ``k`` bytes kernel-side, feeding ``sinks`` from the source first; False, with
        nothing written or fed, when the mode or the kernel says to copy through a buffer."""
        if self.mode == "buffered":
            return False
        if sinks is None:
            return self._kernel(src, dst, k, so, do)
        self._hash_and_copy(src, dst, k, so, do, sinks)
        return True

    def _hash_and_copy(self, src: int, dst: int, k: int, so: int, do: int,
                       sinks: Callable[[memoryview], None]) -> None:
        """One pass over ``k`` source bytes: read them :attr:`hash_step` at a time into a buffer
        and hash them there, then copy them kernel-side (through the buffer if the kernel
        turns out unable to: they are hashed already).

        Why a small buffer: sha256 then reads bytes the read just left in the CPU's cache,
        where hashing the page cache in place through a mapping makes it wait on memory (or
        the kernel fault the mapping in page by page). Side by side on the 2-core VM
        (2026-12-05, ``reshard --format rank --ep 8 --tp 2`` of k3-density, 3-4 rounds): the
        same CPU as a mapped window, or ~1.2 user CPU-s (25 %) less, by the state of the page
        cache; a read into the whole 8 MiB chunk outgrows the cache. A read also cannot SIGBUS
        on a source truncated under it, as a mapping can: a short read is
        :class:`SourceShortReadError`.
        """
        fed = 0
        while fed < k:
            step = min(self.hash_step, k - fed)
            sinks(self._pread(src, step, so + fed))
            fed += step
        if not self._kernel(src, dst, k, so, do):
            pwrite_all(dst, self._pread(src, k, so), do)

    def strided(self, src: int, dst: int, run: Run, do: int, sinks: Callable[[memoryview], None] | None) -> None:
        """Gather ``run.count`` rows of ``run.length`` bytes through bounded buffers."""
        if run.length >= ROW_COPY_MIN or run.stride > CHUNK:
            for i in range(run.count):
                self.contiguous(src, dst, run.offset + i * run.stride, do + i * run.length, run.length, sinks)
            return
        if self.gbuf is None:
            self.gbuf = bytearray(CHUNK)
        rows = max(1, CHUNK // run.stride)
        gview = memoryview(self.gbuf)
        n = run.length
        for first in range(0, run.count, rows):
            k = min(rows, run.count - first)
            # whole rows except the tail of the last one
            span = (k - 1) * run.stride + n
            data = self._pread(src, span, run.offset + first * run.stride)
            _gather_rows(data, gview, k, n, run.stride)
            mv = gview[: k * n]
            pwrite_all(dst, mv, do)
            if sinks is not None:
                sinks(mv)
            release_pages(dst, do, k * n)
            do += k * n

    def interleave(self, srcs: list[tuple[int, int]], dst: int, do: int, rows: int, length: int,
                   sinks: list[Callable[[memoryview], None]]) -> None:
        """The inverse of a split of a later dim: write ``rows`` rows of ``len(srcs) * length``
        bytes at ``do``, row ``j`` being row ``j`` of each source in turn.

        ``srcs[p] = (fd, offset)``: part ``p``, ``rows`` rows of ``length`` bytes back to back.
        ``sinks[p]`` receives part ``p``'s bytes in its own order (so its digest can be checked
        while copying). Rows are interleaved through one bounded buffer; rows long enough to be
        worth a syscall each are copied as contiguous runs (kernel-side where possible).
        """
        import numpy as np

        k = len(srcs)
        width = k * length
        if length >= ROW_COPY_MIN or width > CHUNK:
            for j in range(rows):
                for p, (fd, off) in enumerate(srcs):
                    self.contiguous(fd, dst, off + j * length, do + j * width + p * length, length, sinks[p])
            return
        if self.gbuf is None:
            self.gbuf = bytearray(CHUNK)
        band = max(1, CHUNK // width)
        gview = np.frombuffer(self.gbuf, dtype=np.uint8)
        for first in range(0, rows, band):
            n = min(band, rows - first)
            out = gview[: n * width].reshape(n, k, length)
            for p, (fd, off) in enumerate(srcs):
                data = self._pread(fd, n * length, off + first * length)
                sinks[p](data)
                out[:, p, :] = np.frombuffer(data, dtype=np.uint8).reshape(n, length)
            pwrite_all(dst, memoryview(self.gbuf)[: n * width], do + first * width)
            release_pages(dst, do + first * width, n * width)


#: What a write answers when the filesystem (or the user's quota) is full.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def output_lock(out: Path, command: str) -> DirLock:
    """The exclusive lock ``reshard`` and ``unshard`` hold on their output directory for the whole
    run (``OUT/.k3ckpt-output.lock``, the same kind as fetch's: a second run is refused with the
    holder's host and pid)."""
    return DirLock(out, OUTPUT_LOCK_NAME, command=command, stale_seconds=K3CKPT_LOCK_STALE_SECONDS.get())


def tmp_name(final: Path) -> Path:
    """The temporary name of an output file written in place and renamed only once all files of
    its rank (or shard set) are complete, so not :func:`k3ckpt.utils.temp_name`'s unique one:
    fixed, so that a re-run truncates what a killed run left instead of adding one more file."""
    return final.with_name(f".{final.name}.tmp")


class FdCache:
    """Read-only fds of source files (named by ``path_of``), opened on first use by one output
    file's writer.
    Not shared between workers: the kernel's readahead state belongs to the open file, and
    workers reading different regions through one descriptor defeat it."""

    def __init__(self, path_of: Callable[[str], Path]) -> None:
        self._path_of = path_of
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = self._fds[file] = os.open(self._path_of(file), os.O_RDONLY)
                    read_in_order(fd)  # the kernel reads ahead (not WILLNEED: see there)
        return fd

    def path_of_fd(self, fd: int) -> Path | None:
        """The path of the source this cache opened as ``fd`` (None: not one of ours)."""
        file = next((f for f, mine in self._fds.items() if mine == fd), None)
        return None if file is None else self._path_of(file)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
