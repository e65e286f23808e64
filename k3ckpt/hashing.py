"""Parallel file hashing: whole-file sha256 and, in the same read, one sha256 per tensor.

sha256 of one file is sequential by nature, so parallelism comes from hashing several files at
once in threads: ``hashlib`` releases the GIL while it digests a large buffer, and so does the
``readinto`` that fills it, so N threads keep N cores busy at OpenSSL's speed. Each thread
reuses one large buffer (no per-chunk allocation), and the kernel is told the access is
sequential so read-ahead stays ahead of the hasher.

Per-tensor digests come from the same bytes as the file digest - one read, two hashers - so
``--tensor-hashes`` costs CPU, not I/O.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

#: Read size per call. Large enough that syscall and GIL hand-offs vanish next to hashing.
BUFFER_BYTES = int(os.environ.get("K3CKPT_HASH_BUFFER", 16 * 1024 * 1024))

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Span:
    """A named byte range ``[start, stop)`` of a file, hashed on its own (a tensor's data)."""

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


class HashError(OSError):
    """A file could not be read to the end (vanished, truncated while reading, I/O error)."""


def hash_file(
    path: str | os.PathLike[str],
    *,
    rel: str | None = None,
    spans: Sequence[Span] = (),
    git_sha1: bool = False,
    progress: Progress | None = None,
    buffer: bytearray | None = None,
) -> FileDigest:
    """sha256 of the file at ``path`` and of each of ``spans`` (which must not overlap), in one read.

    Raises:
        HashError: the file shrank while it was read, or reading failed.
    """
    p = os.fspath(path)
    buf = buffer if buffer is not None else bytearray(BUFFER_BYTES)
    view = memoryview(buf)
    whole = hashlib.sha256()
    ordered = sorted(spans, key=lambda s: s.start)
    span_hashers = [hashlib.sha256() for _ in ordered]
    blob = None
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError as e:
        raise HashError(e.errno, f"cannot open: {e.strerror}", p) from None
    try:
        size = os.fstat(fd).st_size
        if git_sha1:
            blob = hashlib.sha1(b"blob %d\0" % size)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        pos = 0
        si = 0  # first span that may still overlap the current chunk
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                chunk = view[:n]
                whole.update(chunk)
                if blob is not None:
                    blob.update(chunk)
                end = pos + n
                while si < len(ordered) and ordered[si].stop <= pos:
                    si += 1
                k = si
                while k < len(ordered) and ordered[k].start < end:
                    s = ordered[k]
                    lo, hi = max(s.start, pos), min(s.stop, end)
                    if hi > lo:
                        span_hashers[k].update(chunk[lo - pos: hi - pos])
                    k += 1
                pos = end
                if progress is not None:
                    progress(n)
        if pos != size:
            raise HashError(0, f"read {pos} bytes but the file is {size} (changed while hashing?)", p)
    except OSError as e:
        if isinstance(e, HashError):
            raise
        raise HashError(e.errno, f"read failed: {e.strerror}", p) from None
    finally:
        os.close(fd)
    return FileDigest(
        path=rel if rel is not None else os.path.basename(p),
        size=size,
        sha256=whole.hexdigest(),
        spans={s.name: h.hexdigest() for s, h in zip(ordered, span_hashers)} if ordered else None,
        git_sha1=blob.hexdigest() if blob is not None else None,
    )


def hash_files(
    root: Path,
    files: Iterable[str],
    *,
    jobs: int | None = None,
    spans: dict[str, Sequence[Span]] | None = None,
    git_sha1: Callable[[str], bool] | None = None,
    progress: Progress | None = None,
    on_done: Callable[[FileDigest], None] | None = None,
) -> tuple[dict[str, FileDigest], dict[str, HashError]]:
    """Hash ``files`` (relative to ``root``) with ``jobs`` threads, largest first.

    Returns ``(digests, errors)``: a file that cannot be read is an error entry, never a
    missing silence, and never stops the others.
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
    local = threading.local()
    digests: dict[str, FileDigest] = {}
    errors: dict[str, HashError] = {}
    lock = threading.Lock()

    def one(f: str) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(BUFFER_BYTES)
        try:
            d = hash_file(root / f, rel=f, spans=(spans or {}).get(f, ()),
                          git_sha1=bool(git_sha1 and git_sha1(f)), progress=progress, buffer=buf)
        except HashError as e:
            with lock:
                errors[f] = e
            return
        with lock:
            digests[f] = d
        if on_done is not None:
            on_done(d)

    if workers == 1:
        for f in todo:
            one(f)
    else:
        with ThreadPoolExecutor(max_workers=workers) as ex:
            list(ex.map(one, todo))
    return digests, errors
