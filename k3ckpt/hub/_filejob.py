"""One file's chunked, resumable download: its ``.part``, its journal, and the GETs that write it.

Used by the downloader (:mod:`k3ckpt.hub.download`). A :class:`FileJob` is one file being
fetched: every chunk is streamed into a preallocated ``<final>.part`` with ``os.pwrite`` at its
offset (its aligned blocks with ``O_DIRECT`` when the run asks for it); once a chunk's bytes
are on disk (``fdatasync``) its index is recorded in a small journal ``<final>.part.journal``.
:func:`stream_chunk` is one ranged GET of a chunk, :func:`stream_whole` the whole-file GET for a
server that ignores ``Range`` (still journaled chunk by chunk).

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
     "sha256": "...", "git_sha1": null, "chunk_size": 268435456, "done": [0, 1, 5, ...]}

Why not :func:`k3ckpt.hub.client.read_range`: it returns the whole range as ``bytes`` (built in a
``bytearray`` and copied), i.e. one or two chunk-sized buffers (256 MiB) per worker; a downloader
must stream the body into the file as it arrives.  The streaming reader (the package's ``_transfer``
module, shared with the rank-aware fetch) uses the client's own session, manual redirect
handling (credentials never leave the origin), ``Retry-After`` parsing, status mapping and
``Content-Range`` grammar (the package's ``_http`` module).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

import urllib3.exceptions

from ..utils import write_atomic
from . import _dest, _http, _transfer
from ._digest import StreamDigest
from .client import HubFile, HubListing

_JOURNAL_VERSION = 1


class FileJob:
    """One file being downloaded: its ``.part`` descriptor, journal and outstanding chunks."""

    def __init__(self, entry: HubFile, final: str, chunk_size: int, dest_real: str, direct: bool = False) -> None:
        self.entry = entry
        self.final = final
        self.dest_real = dest_real
        self.part = final + ".part"
        self.journal = self.part + ".journal"
        self.chunk_size = chunk_size
        self.nchunks = _dest.chunk_count(entry.size, chunk_size)
        self.done: set[int] = set()
        self.lock = threading.Lock()
        # The .part's descriptor: set by open() before the first transfer, None again after
        # close(). Calls made while the job runs pass it with "type: ignore[arg-type]".
        self.fd: int | None = None
        # The same file opened with O_DIRECT (aligned pieces are written through it), or None:
        # K3CKPT_DIRECT_IO off, or a filesystem without direct I/O.
        self.direct = direct
        self.dfd: int | None = None
        # Chunks written through the page cache instead (they started ahead of the digest, so
        # their bytes are read back to hash them: from memory, not the disk). Under ``lock``.
        self.cached: set[int] = set()
        self.outstanding = 0  # queued or running tasks of this file
        self.failed: str | None = None
        self.refetched = False
        self.finished = False
        self.sequential = False  # the server ignores Range: one whole-file GET writes it
        # the last chunk is in and the file is being verified: no whole-file GET may start (it
        # would write through a descriptor _finish is about to close). Exclusive with
        # ``sequential``: both are only set under ``lock``, each only if the other is not.
        self.finishing = False
        self.digest = StreamDigest.for_entry(entry)

    def chunk(self, i: int) -> tuple[int, int]:
        start = i * self.chunk_size
        return start, min(self.chunk_size, self.entry.size - start)

    def journal_doc(self) -> dict[str, Any]:
        return {"version": _JOURNAL_VERSION, "path": self.entry.path, "size": self.entry.size,
                "sha256": self.entry.sha256, "git_sha1": self.entry.git_sha1, "chunk_size": self.chunk_size}

    def load_resume(self) -> None:
        """Adopt a ``.part`` + journal left by an earlier run if they belong to this content;
        otherwise forget them (a stale or foreign journal must not vouch for any byte)."""
        self.done = _dest.resumable(self.journal, self.part, self.entry.size, self.journal_doc(), self.nchunks,
                                    chunk_size=self.chunk_size)

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


#: Task index of a whole-file sequential GET (the fallback for a server that ignores ``Range``).
WHOLE = -1


def stream_chunk(listing: HubListing, job: FileJob, index: int, headers: dict[str, str], timeout: float,
                 cancel: threading.Event, count: Callable[[int], None]) -> None:
    """One ranged GET of chunk ``index`` written in place; raises Retryable/Fatal/Cancelled,
    or RangeIgnored when the server sends the whole file instead.

    The file's digest is fed the received bytes as they are written once this chunk is next in
    line (:meth:`StreamDigest.claim`: at once when every earlier chunk is hashed, else as soon
    as it is, after hashing from the ``.part`` what this request wrote before).

    A chunk that starts ahead of the digest (a worker joined the file) is written through the
    page cache even where the file is written with ``O_DIRECT``: its bytes are read back to be
    hashed, and from the cache that read is a memory copy, not a disk read beside the run's
    writes (on a disk-bound run, the joined bytes' second trip over the disk). The pages are let
    go once hashed (:func:`~k3ckpt.utils.release_pages`)."""
    start, length = job.chunk(index)
    digest = job.digest
    ahead = job.dfd is not None and digest.next != index  # a look without the lock: it picks a write path only
    with job.lock:  # a retry decides again
        (job.cached.add if ahead else job.cached.discard)(index)
    owner = False
    seen = 0  # bytes of this request written so far

    def sink(data: memoryview) -> None:
        nonlocal owner, seen
        # once the file went sequential, its whole-file GET alone feeds the digest (from byte 0)
        if not owner and not job.sequential and digest.claim(index):
            owner = True
            if seen:
                digest.hash_written(job, start, seen, cached=ahead)
        if owner:
            digest.feed(data)
        seen += len(data)

    try:
        _transfer.stream_range(listing, job.entry, start, length, job.fd, start, headers, timeout, cancel, count,  # type: ignore[arg-type]  # fd is open here
                               sink=sink, direct_fd=None if ahead else job.dfd)
    except BaseException:
        if owner:
            digest.rollback()
        raise
    if owner:
        digest.commit(index)


def stream_whole(listing: HubListing, job: FileJob, headers: dict[str, str], timeout: float,
                 cancel: threading.Event, count: Callable[[int], None],
                 chunk_reached: Callable[[int], None], piece: int) -> None:
    """The fallback for a server that ignores ``Range``: one plain GET of the whole file,
    written in place from byte 0, read ``piece`` bytes at a step. ``chunk_reached(i)`` is called
    as each chunk's last byte is written, so the journal keeps recording progress (a crash still
    resumes, though a server without ranges makes the resumed run read the file from its start
    again)."""
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
                                       piece=piece, direct_fd=job.dfd)
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
