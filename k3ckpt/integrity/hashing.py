"""Parallel file hashing: whole-file sha256 and, in the same read, one sha256 per tensor.

sha256 of one file is sequential by nature, so parallelism comes from hashing several files at
once in threads: ``hashlib`` releases the GIL while it digests a large chunk, so N threads keep
N cores busy at OpenSSL's speed. A thread reads a file into a small buffer that stays in the
CPU's cache while it is hashed (see :func:`_chunks`), and the kernel is told the access is
sequential, so its readahead keeps the disk ahead of the hasher.

Per-tensor digests come from the same bytes as the file digest - one read, two hashers - so
``--tensor-hashes`` costs CPU, not I/O.
"""

from __future__ import annotations

import errno
import hashlib
import operator
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

from ..env import K3CKPT_HASH_BUFFER
from ..errors import HashError
from ..utils import read_in_order

Progress = Callable[[int], None]


class Span(NamedTuple):
    """A named byte range ``[start, stop)`` of a file, hashed on its own (a tensor's data).

    A named tuple, not a frozen dataclass: verify makes one per tensor (twice, for the hashes
    and the scale scan) before the first byte is hashed, and a tuple is built in C, several
    times faster."""

    name: str
    start: int
    stop: int


@dataclass
class FileDigest:
    path: str  # relative to the root it was hashed under
    size: int
    sha256: str
    spans: dict[str, str] | None = None  # span name -> sha256, when spans were asked for
    git_sha1: str | None = None  # git blob id ("blob <size>\\0" + bytes), when asked for
    flagged: list[str] | None = None  # scanned spans that contain the needle byte


def hash_file(
    path: str | os.PathLike[str],
    *,
    rel: str | None = None,
    spans: Sequence[Span] = (),
    scan: Sequence[Span] = (),
    needle: bytes = b"\xff",
    git_sha1: bool = False,
    progress: Progress | None = None,
    buffer: bytearray | None = None,
    chunk_bytes: int | None = None,
    cancel: threading.Event | None = None,
    late_spans: Callable[[], Sequence[Span] | None] | None = None,
    late_scan: Callable[[bool], Sequence[Span] | None] | None = None,
    whole: bool = True,
) -> FileDigest:
    """sha256 of the file at ``path`` and of each of ``spans`` (which must not overlap), in one
    read; spans of ``scan`` are searched for ``needle`` (an E8M0 NaN scale is byte 0xFF) in the
    same pass.

    ``late_spans``: the ``spans``, when they are not known yet as hashing starts (``verify``
    hashes while it parses the manifest that has them): asked before each chunk until it returns
    them; their bytes already hashed are then read again, only those (see
    :meth:`StreamHasher.add_spans`).

    ``late_scan``: likewise the ``scan`` spans (``verify`` starts hashing a shard before its
    header is parsed): asked with ``False`` before each chunk until it returns them, and with
    ``True`` (answer now) if the read ends first; the parts of them already read are then read
    again and searched, only those.

    ``whole``: False skips the file's own sha256 (``sha256`` is then ``""``): a node file's digest
    is built from its header and its ``spans`` (:func:`~k3ckpt.format.filedigest.segments_sha256`),
    and the second hash of every byte would double the CPU.

    The bytes are read ``$K3CKPT_HASH_BUFFER`` at a time into ``buffer`` (or a new one) and
    hashed there, while they are in the CPU's cache (see :func:`_chunks`).

    Raises:
        HashError: the file shrank or grew while it was read, or reading failed.
    """
    p = os.fspath(path)
    # Bytes per read (``chunk_bytes``, else the buffer's size, else $K3CKPT_HASH_BUFFER): large
    # enough that syscalls and GIL hand-offs vanish next to hashing, small enough to stay in cache.
    step = chunk_bytes or (len(buffer) if buffer is not None else K3CKPT_HASH_BUFFER.get())
    scan_cursor = _Cursor(sorted(scan, key=_span_start))
    flagged: set[str] = set()
    with _reading(p) as fd:
        size = os.fstat(fd).st_size
        hasher = StreamHasher(spans, git_size=size if git_sha1 else None, whole=whole)
        for chunk in _chunks(fd, size, step, buffer):
            if cancel is not None and cancel.is_set():
                raise HashError(0, "cancelled", p)
            if late_spans is not None and (known := late_spans()) is not None:
                hasher.add_spans(known, partial(_pread_range, fd, p, step))
                late_spans = None
            if late_scan is not None and (known := late_scan(False)) is not None:
                scan = known
                scan_cursor = _Cursor(sorted(scan, key=_span_start))
                flagged |= _search_before(fd, p, step, scan_cursor.spans, chunk.pos, needle)
                late_scan = None
            pos, n = chunk.pos, len(chunk.view)
            hasher.feed(chunk.view)
            for k, lo, hi in scan_cursor.overlapping(pos, pos + n):
                if chunk.find(needle, lo - pos, hi - pos):
                    flagged.add(scan_cursor.spans[k].name)
            if progress is not None:
                progress(n)
        if late_scan is not None:  # the read ended before the spans were known: search them now
            scan = late_scan(True) or ()
            flagged |= _search_before(fd, p, step, sorted(scan, key=_span_start), hasher.pos, needle)
        now = os.fstat(fd).st_size
        if hasher.pos != size or now != size:
            raise HashError(0, f"read {hasher.pos} bytes but the file is {now} (changed while hashing?)", p)
    d = hasher.digest(rel if rel is not None else os.path.basename(p))
    d.flagged = sorted(flagged) if scan else None
    return d


@dataclass
class _Chunk:
    """``view``: the file's bytes from offset ``pos``, held at the start of ``source`` (a
    bytearray: it searches in C)."""

    pos: int
    view: memoryview
    source: bytearray

    def find(self, needle: bytes, lo: int, hi: int) -> bool:
        """Does ``needle`` occur in ``view[lo:hi]``?"""
        return self.source.find(needle, lo, hi) >= 0


def _chunks(fd: int, size: int, step: int, buffer: bytearray | None) -> Iterator[_Chunk]:
    """The first ``size`` bytes of the open file ``fd`` in order (to its end if it says 0:
    procfs), read ``step`` bytes at a time into ``buffer`` (or a new one), each chunk valid until
    the next is asked for. A file that ends early ends the chunks: the caller compares what it
    got with ``size``.

    Read into a small buffer, not hashed in place through a mapping of the page cache: the copy
    leaves the bytes in the CPU's cache, where sha256 reads them - and reads them again for a
    tensor's digest, the second of two digests of every byte with a tensor-hash manifest. Side
    by side on the 2-core VM (2026-12-05, k3-density, 3-4 interleaved rounds each), against 16
    MiB mapped windows: with a tensor-hash manifest 27 % less wall and CPU cold, 11-12 % warm;
    with file digests only, 11 % less in one state of the page cache and the same after the
    bench's evict-and-read-once (the mapping then pays in page faults what it saves in waits).
    16 MiB reads outgrow the cache (~0.15 CPU-s per GB more). Never worse, and a read cannot
    SIGBUS on a file truncated under it, as a mapping can.

    The reading ahead is the kernel's (:func:`~k3ckpt.utils.read_in_order` says why: until
    2026-12-06 16 MiB ``POSIX_FADV_WILLNEED`` windows ahead of the hasher cost a cold verify of
    k3-density 1.42 s against 1.33, of k3-8gb 3.79 against 2.99).
    """
    read_in_order(fd)
    buf = buffer if buffer is not None and len(buffer) >= step else bytearray(step)
    view = memoryview(buf)
    pos = 0
    while not size or pos < size:
        n = os.preadv(fd, [view[:step if not size else min(step, size - pos)]], pos)
        if not n:
            return
        yield _Chunk(pos, view[:n], buf)
        pos += n


class StreamHasher:
    """sha256 of a byte stream and, in the same pass, of named spans of it (tensors' data):
    what :func:`hash_file` computes over a local file, for bytes that arrive in pieces from
    anywhere (a hub's response body). Feed the bytes in order, starting at offset ``start``
    (a ranged read of a file hashes its spans; its ``whole`` digest then covers the range only).

    ``git_size``: also the git blob id (``"blob <size>\\0" + bytes``) of a file of that size;
    ``whole`` False: the spans only (the stream's own ``sha256`` is then ``""``).
    """

    def __init__(self, spans: Sequence[Span] = (), *, start: int = 0, git_size: int | None = None,
                 whole: bool = True) -> None:
        self.start = self.pos = start
        self.whole = hashlib.sha256() if whole else None
        self._ordered = sorted(spans, key=lambda s: s.start)
        self._hashers = [hashlib.sha256() for _ in self._ordered]
        self._cursor = _Cursor(self._ordered)
        self._blob = hashlib.sha1(b"blob %d\0" % git_size) if git_size is not None else None

    def feed(self, chunk: memoryview | bytes) -> None:
        """Hash the next bytes of the stream (they start at :attr:`pos`)."""
        pos, n = self.pos, len(chunk)
        if self.whole is not None:
            self.whole.update(chunk)
        if self._blob is not None:
            self._blob.update(chunk)
        for k, lo, hi in self._cursor.overlapping(pos, pos + n):
            self._hashers[k].update(chunk[lo - pos: hi - pos])
        self.pos = pos + n

    def add_spans(self, spans: Sequence[Span], prefix: Callable[[int, int], Iterable[bytes]]) -> None:
        """Hash ``spans`` too from now on (the stream was started without them): their parts
        already fed, before :attr:`pos`, are the pieces ``prefix(lo, hi)`` gives."""
        if self._ordered:
            raise ValueError("spans were given already")
        self._ordered = sorted(spans, key=lambda s: s.start)
        self._hashers = [hashlib.sha256() for _ in self._ordered]
        for k, lo, hi in _Cursor(self._ordered).overlapping(self.start, self.pos):
            for piece in prefix(lo, hi):
                self._hashers[k].update(piece)
        self._cursor = _Cursor(self._ordered)

    def span_digests(self) -> dict[str, str]:
        """Span name -> sha256 (of what was fed of it)."""
        return {s.name: h.hexdigest() for s, h in zip(self._ordered, self._hashers)}

    def digest(self, rel: str) -> FileDigest:
        """What was fed as a :class:`FileDigest` named ``rel`` (``spans`` None when none were asked for)."""
        return FileDigest(
            path=rel, size=self.pos - self.start, sha256=self.whole.hexdigest() if self.whole is not None else "",
            spans=self.span_digests() if self._ordered else None,
            git_sha1=self._blob.hexdigest() if self._blob is not None else None,
        )


class _Cursor:
    """Walks sorted, non-overlapping spans alongside a sequential read."""

    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans
        self.first = 0  # first span that may still overlap the current chunk

    def overlapping(self, pos: int, end: int) -> Iterable[tuple[int, int, int]]:
        """``(index, lo, hi)`` of each span's part inside ``[pos, end)``."""
        spans = self.spans
        while self.first < len(spans) and spans[self.first].stop <= pos:
            self.first += 1
        k = self.first
        while k < len(spans) and spans[k].start < end:
            lo, hi = max(spans[k].start, pos), min(spans[k].stop, end)
            if hi > lo:
                yield k, lo, hi
            k += 1


def scan_file(path: str | os.PathLike[str], spans: Sequence[Span], needle: bytes = b"\xff") -> list[str]:
    """Names of ``spans`` of the file that contain ``needle``, reading only those spans - and
    skipping holes of sparse files (``SEEK_DATA``), which read as zeros and cannot contain it
    unless the needle is zero.

    Raises:
        HashError: the file cannot be read.
    """
    p = os.fspath(path)
    step = K3CKPT_HASH_BUFFER.get()
    found = []
    with _reading(p) as fd:
        size = os.fstat(fd).st_size
        data = _data_segments(fd, size) if needle != b"\x00" else [(0, size)]
        for s in sorted(spans, key=lambda s: s.start):
            for lo, hi in data:
                a, b = max(lo, s.start), min(hi, s.stop)
                if b <= a:
                    continue
                while a < b:
                    n = min(b - a, step)
                    chunk = os.pread(fd, n, a)
                    if len(chunk) != n:
                        raise HashError(0, f"short read at {a} ({len(chunk)} of {n} bytes; truncated?)", p)
                    if needle in chunk:
                        found.append(s.name)
                        break
                    a += n
                if found and found[-1] == s.name:
                    break
    return found


def _search_before(fd: int, path: str, step: int, spans: Sequence[Span], end: int, needle: bytes) -> set[str]:
    """Names of ``spans`` whose bytes before offset ``end`` contain ``needle`` (one byte: a
    piece boundary cannot split it), read again from the open file ``fd``."""
    found = set()
    for s in spans:
        if s.start >= end:
            break
        if any(needle in piece for piece in _pread_range(fd, path, step, s.start, min(s.stop, end))):
            found.add(s.name)
    return found


#: A :class:`Span`'s start, as a sort key (in C).
_span_start = operator.itemgetter(1)


def _pread_range(fd: int, path: str, step: int, lo: int, hi: int) -> Iterator[bytes]:
    """Bytes ``[lo, hi)`` of the open file ``fd``, ``step`` at a time.

    Raises:
        HashError: the file is shorter than ``hi`` now.
    """
    while lo < hi:
        piece = os.pread(fd, min(step, hi - lo), lo)
        if not piece:
            raise HashError(0, f"short read at {lo} (truncated while hashing?)", path)
        yield piece
        lo += len(piece)


@contextmanager
def _reading(path: str) -> Iterator[int]:
    """An fd open for reading; any OSError on the way becomes a :class:`HashError` naming the file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise HashError(e.errno, f"cannot open: {e.strerror}", path) from None
    try:
        yield fd
    except HashError:
        raise
    except OSError as e:
        raise HashError(e.errno, f"read failed: {e.strerror}", path) from None
    finally:
        os.close(fd)


def _data_segments(fd: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of a file that hold data (not holes); the whole file when the
    filesystem cannot tell."""
    if not hasattr(os, "SEEK_DATA"):
        return [(0, size)]
    out = []
    pos = 0
    try:
        if size == 0:  # nothing to map; a file that says 0 but reads more (procfs) stays what a read says
            raise OSError(errno.EINVAL, "empty")
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data after pos: the rest is a hole
                    break
                raise
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, min(stop, size)))
            pos = stop
    except OSError:
        return [(0, size)]
    return out


def hash_files(
    root: Path,
    files: Iterable[str],
    *,
    jobs: int | None = None,
    spans: Mapping[str, Sequence[Span]] | None = None,
    scan: Mapping[str, Sequence[Span]] | None = None,
    git_sha1: Callable[[str], bool] | None = None,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    spans_only: Callable[[str], bool] | None = None,
) -> tuple[dict[str, FileDigest], dict[str, HashError]]:
    """Hash ``files`` (relative to ``root``) with ``jobs`` threads, largest first; the files
    ``spans_only`` names get their spans' digests only (``whole=False`` of :func:`hash_file`).

    Returns ``(digests, errors)``: a file that cannot be read is an error entry, never a
    missing silence, and never stops the others. Setting ``cancel`` stops every thread at its
    next chunk (its files then come back as errors).
    """
    todo = list(files)
    sizes = {}
    for f in todo:
        try:
            sizes[f] = os.stat(root / f).st_size
        except OSError:
            sizes[f] = 0
    todo.sort(key=lambda f: -sizes[f])  # big files first: the last thread to finish idles least
    workers = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    chunk_bytes = K3CKPT_HASH_BUFFER.get()  # here, not in the threads: a bad value stops the run once
    digests: dict[str, FileDigest] = {}
    errors: dict[str, HashError] = {}
    lock = threading.Lock()

    def one(f: str) -> None:
        if cancel is not None and cancel.is_set():
            with lock:
                errors[f] = HashError(0, "cancelled", str(root / f))
            return
        try:
            d = hash_file(root / f, rel=f, spans=(spans or {}).get(f, ()), scan=(scan or {}).get(f, ()),
                          git_sha1=bool(git_sha1 and git_sha1(f)), progress=progress, chunk_bytes=chunk_bytes,
                          cancel=cancel, whole=not (spans_only and spans_only(f)))
        except HashError as e:
            with lock:
                errors[f] = e
            return
        with lock:
            digests[f] = d

    if workers == 1:
        for f in todo:
            one(f)
    else:
        from concurrent.futures import ThreadPoolExecutor  # (here: 6 ms of imports verify's start need not pay)

        with ThreadPoolExecutor(max_workers=workers) as ex:
            list(ex.map(one, todo))
    return digests, errors
