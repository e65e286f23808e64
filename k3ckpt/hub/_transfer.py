"""Moving a hub file's bytes into a local file: the machinery the downloader
(:mod:`k3ckpt.hub.download`) and the rank-aware fetch (:mod:`k3ckpt.hub.rankfetch`) share.

A ranged GET streamed in :data:`PIECE`-sized pieces straight into a file descriptor at any
offset (never a whole chunk in memory; each piece written by a helper thread while the next
is received and hashed), with the downloader's response checks; the signals a worker acts on
(:class:`Retryable`, :class:`Fatal`, :class:`Cancelled`, :class:`RangeIgnored`); and jittered
back-off between retries. Handing tasks to workers is :mod:`k3ckpt.hub.schedule`.
"""

from __future__ import annotations

import errno
import http.client
import mmap
import os
import queue
import random
import threading
from collections.abc import Callable
from typing import Any

import requests
import urllib3.exceptions

from ..utils import pwrite_all
from . import _http
from .client import HubError, HubFile, HubListing, RetryPolicy, file_url

#: Size of the pieces a body is read and ``pwrite``-n in: a chunk is never held in memory whole
#: (a worker holds :data:`WRITE_DEPTH` of them). Each piece costs a receive, a hash and a hand-over
#: to the writer thread: 1 MiB pieces took 1.8 CPU-s more than 4 MiB ones on 8 GB (two 4 GB files,
#: 2 cores, 2026-12-03), larger ones gained nothing more.
PIECE = 4 << 20



# ----------------------------------------------------------------------------------------------
# What a worker acts on
# ----------------------------------------------------------------------------------------------


class Retryable(Exception):
    """A request failed in a way worth another try; ``retry_after`` is the server's wish, if any."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class Fatal(Exception):
    """A request failed in a way no retry changes: the file (or shard) fails with this reason."""


class Cancelled(Exception):
    """The run was cancelled (Ctrl-C): stop between pieces, record nothing more."""


class RangeIgnored(Fatal):
    """The server answered a ranged GET with the whole file (HTTP 200, no ``Content-Range``).
    Fatal for that range; the downloader falls back to one sequential GET of the file."""



# ----------------------------------------------------------------------------------------------
# Streaming a range
# ----------------------------------------------------------------------------------------------


def request(listing: HubListing, entry: HubFile, headers: dict[str, str], timeout: float,
            byte_range: tuple[int, int] | None) -> tuple[Any, dict[str, Any]]:
    """Send the GET (ranged or not) and check the status; returns ``(response, context)``."""
    ctx: dict[str, Any] = {"hub": listing.hub, "repo": listing.repo, "revision": listing.revision,
                           "path": entry.path, "endpoint": listing.endpoint}
    url = file_url(listing, entry.path)
    hdrs = dict(headers)
    if byte_range is not None:
        hdrs["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
    hdrs["Accept-Encoding"] = "identity"  # a compressed representation would shift every offset
    session = _http.session()
    try:
        resp, final_url = _http.get(session, url, hdrs, timeout, ctx)
    except requests.exceptions.Timeout:
        raise Retryable(f"timed out after {timeout} s") from None
    except requests.exceptions.ConnectionError as e:
        raise Retryable(f"connection failed ({_http.connection_reason(e)})") from None
    except requests.exceptions.RequestException as e:
        raise Fatal(f"{type(e).__name__}: {_http.one_line(str(e))[:200]}") from None
    except HubError as e:  # too many redirects
        raise Fatal(e.problem) from None
    status = resp.status_code
    try:
        if _http.retryable_status(status):
            raise Retryable(f"HTTP {status}", _http.retry_after(resp))
        if _http.signed_url_refused(status, url, final_url):
            # No back-off (retry_after 0): the next try resolves a fresh URL, which is the fix.
            raise Retryable(f"HTTP 403 from the download host {_http.shown_url(url, final_url)} "
                            f"(signed URL refused, e.g. expired; each try resolves a fresh one)", 0.0)
        if status not in (200, 206):
            raise Fatal(_http.status_error(resp, _http.shown_url(url, final_url), ctx).problem)
        encoding = (resp.headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            raise Fatal(f"server applied Content-Encoding {encoding!r} to a file download")
    except BaseException:
        resp.close()
        raise
    return resp, ctx


def copy_body(resp: Any, fd: int, start: int, dest_offset: int, length: int, cancel: threading.Event,
              count: Callable[[int], None], sink: Callable[[memoryview], None] | None = None,
              on_offset: Callable[[int], None] | None = None, piece: int = PIECE,
              direct_fd: int | None = None) -> int:
    """Write up to ``length`` body bytes (bytes ``start``... of the file) to ``fd`` at
    ``dest_offset``, reading ``piece`` bytes at a time; returns how many arrived. ``sink`` sees
    every written piece in order (to hash while streaming; the view is valid only during the
    call: the buffer behind it is reused for the next piece); ``on_offset`` is told the offset
    reached after each piece (the sequential fallback journals with it); ``direct_fd`` (the
    same file opened with ``O_DIRECT``, see :func:`open_direct`) takes the aligned pieces."""
    return _copy_body(resp, fd, start, dest_offset, length, cancel, count, sink, on_offset, piece, direct_fd)


#: ``O_DIRECT`` wants the buffer address, the file offset and the length aligned to the
#: device's logical block: 4 KiB covers both 512-byte and 4 KiB sectors.
DIRECT_ALIGN = 4096

_LOCAL = threading.local()


def piece_buffer(size: int) -> memoryview:
    """This thread's reusable receive buffer of at least ``size`` bytes: an anonymous ``mmap``,
    so page-aligned (an ``O_DIRECT`` write may take it as it is) and never freed and faulted in
    again per piece, as a fresh ``bytes`` per read would be."""
    buf: memoryview | None = getattr(_LOCAL, "buf", None)
    if buf is None or len(buf) < size:
        buf = _LOCAL.buf = memoryview(mmap.mmap(-1, max(size, PIECE)))
    return buf


def open_direct(fd: int) -> int | None:
    """A second descriptor on ``fd``'s file with ``O_DIRECT`` (re-opened through
    ``/proc/self/fd``, so it is the same inode even if the name changed), or None where the
    platform or filesystem has no direct I/O (tmpfs before Linux 6.6, some FUSE mounts).

    Why: a buffered write copies every byte into freshly allocated page cache (the biggest CPU
    cost of a fetch after sha256; on a VM each new page may also fault in the host) and leaves
    it dirty for the ``fdatasync`` to write. ``O_DIRECT`` hands the receive buffer to the disk
    instead: no copy, no dirty pages, the same durability once ``fdatasync`` returns. Callers
    ask only when ``K3CKPT_DIRECT_IO`` is on (read once per run, before any worker starts)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | flag)
    except OSError:
        return None


def _readinto_of(resp: Any) -> Callable[[memoryview], int]:
    """How to read ``resp``'s body into a buffer. The ``http.client`` response under urllib3's
    (``raw._fp``) has ``readinto``: the socket fills our buffer directly, with http.client's own
    Content-Length / chunked framing. urllib3's ``read`` returns a new ``bytes`` per call (one
    more copy and allocation); that path stays for any other raw stream, and whenever urllib3
    has buffered or decodes anything (never here: identity encoding is required)."""
    raw = resp.raw
    fp = getattr(raw, "_fp", None)
    decoded = getattr(raw, "_decoded_buffer", None)
    if isinstance(fp, http.client.HTTPResponse) and getattr(raw, "_decoder", None) is None and not decoded:
        def read_direct(view: memoryview) -> int:
            n = fp.readinto(view)
            if not n and view and fp.length:
                # http.client returns 0 when the peer closes before Content-Length (urllib3 raises)
                raise http.client.IncompleteRead(b"", fp.length)
            return n

        return read_direct

    def read_copy(view: memoryview) -> int:
        data = raw.read(len(view), decode_content=False)
        view[:len(data)] = data
        return len(data)

    return read_copy


def _write_piece(fd: int, direct_fd: int | None, data: memoryview, offset: int) -> bool:
    """Write ``data`` at ``offset``: its whole blocks through ``direct_fd`` when the offset is
    aligned, the rest (a file's unaligned tail) through ``fd``; False when the direct write was
    refused (the caller stops trying it for this body)."""
    head = len(data) - len(data) % DIRECT_ALIGN
    if direct_fd is not None and head and offset % DIRECT_ALIGN == 0:
        try:
            pwrite_all(direct_fd, data[:head], offset)
        except OSError as e:
            if e.errno != errno.EINVAL:  # a stricter alignment than ours: fall back; anything else is real
                raise
            pwrite_all(fd, data, offset)
            return False
        if head < len(data):
            pwrite_all(fd, data[head:], offset + head)
        return True
    pwrite_all(fd, data, offset)
    return True


#: Pieces of a body in flight per receiving thread: while one is written, the next is received
#: and hashed (see :class:`_WriteBehind`).
WRITE_DEPTH = 3


class _WriteBehind:
    """The writes of one body, made by a helper thread while the receiving thread reads and
    hashes the next piece.

    Why: an ``O_DIRECT`` ``pwrite`` returns only once the disk has the bytes (~0.6 ms per MiB
    on these machines), and a worker that receives, hashes and writes in turn leaves its socket
    unread for that time: one stream then moved ~0.45 GB/s where the disk takes 1.7 GB/s.
    ``pwrite``, ``recv_into`` and ``sha256.update`` all release the GIL, so the three overlap.

    The ring is :data:`WRITE_DEPTH` buffers of this thread's :func:`piece_buffer`; a buffer is
    handed out again only once its write returned, so what is hashed is exactly what is written.
    The first write error is raised in the receiving thread (at its next buffer, or at the end);
    later pieces are not written after it."""

    def __init__(self, fd: int, direct_fd: int | None, piece: int) -> None:
        self.fd, self.direct_fd = fd, direct_fd
        stride = -(-piece // DIRECT_ALIGN) * DIRECT_ALIGN  # every buffer aligned for O_DIRECT
        ring = piece_buffer(stride * WRITE_DEPTH)
        self.free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for i in range(WRITE_DEPTH):
            self.free.put(ring[i * stride:i * stride + piece])
        self.todo: queue.SimpleQueue[tuple[memoryview, int, int] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def buffer(self) -> memoryview:
        """A free buffer to receive the next piece into (waits for a write to return if need be)."""
        buf = self.free.get()  # the writer returns every buffer, even after an error
        self._raise()
        return buf

    def write(self, buf: memoryview, n: int, offset: int) -> None:
        """Write ``buf[:n]`` at ``offset``, behind the caller's back."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"{threading.current_thread().name}-write",
                                           daemon=True)
            self.thread.start()
        self.todo.put((buf, n, offset))

    def flush(self) -> None:
        """Return once every piece handed over is written (a read-back of those bytes may follow)."""
        if self.thread is not None:
            self.todo.put(None)
            self.thread.join()
            self.thread = None
        self._raise()

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            buf, n, offset = item
            if self.error is None:
                try:
                    if not _write_piece(self.fd, self.direct_fd, buf[:n], offset):
                        self.direct_fd = None
                except BaseException as e:  # noqa: BLE001 - handed to the receiving thread
                    self.error = e
            self.free.put(buf)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


def flush_writes() -> None:
    """Return once every piece this thread's body in progress handed to its writer is on disk
    (a no-op outside one). A sink that reads back bytes this same body wrote (the digest taken
    over mid-request) calls it first: the writes run behind the receive (:class:`_WriteBehind`)."""
    writes: _WriteBehind | None = getattr(_LOCAL, "writes", None)
    if writes is not None:
        writes.flush()


def _copy_body(resp: Any, fd: int | None, start: int, dest_offset: int, length: int, cancel: threading.Event,
               count: Callable[[int], None], sink: Callable[[memoryview], None] | None,
               on_offset: Callable[[int], None] | None, piece: int, direct_fd: int | None = None) -> int:
    """:func:`copy_body`; ``fd`` None writes nothing (only ``sink`` sees the bytes).

    The socket is read into a buffer of this thread, the piece's write is handed to a helper
    (:class:`_WriteBehind`), ``sink`` hashes the same buffer while it is written, and the next
    piece is received meanwhile; every write has returned before this does. ``on_offset`` (the
    sequential fallback's journal) wants each offset on disk when told, so that body is written
    in the receiving thread."""
    if fd is None or on_offset is not None:
        return _copy_inline(resp, fd, start, dest_offset, length, cancel, count, sink, on_offset, piece, direct_fd)
    writes = _LOCAL.writes = _WriteBehind(fd, direct_fd, piece)
    try:
        received = _receive(resp, start, length, cancel, count, sink, writes.buffer, dest_offset, writes.write,
                            align=DIRECT_ALIGN if direct_fd is not None else 0)
    except BaseException:
        _LOCAL.writes = None
        try:
            writes.flush()
        except Exception:  # noqa: BLE001 - the error in flight is the one to report
            pass
        raise
    _LOCAL.writes = None
    writes.flush()
    return received


def _copy_inline(resp: Any, fd: int | None, start: int, dest_offset: int, length: int, cancel: threading.Event,
                 count: Callable[[int], None], sink: Callable[[memoryview], None] | None,
                 on_offset: Callable[[int], None] | None, piece: int, direct_fd: int | None) -> int:
    """:func:`_copy_body` with each piece written (when ``fd`` is given) before the next is read."""
    buf = piece_buffer(piece)[:piece]
    direct = [direct_fd]

    def write(view: memoryview, n: int, offset: int) -> None:
        if fd is not None and not _write_piece(fd, direct[0], view[:n], offset):
            direct[0] = None
        if on_offset is not None:
            on_offset(offset + n)

    return _receive(resp, start, length, cancel, count, sink, lambda: buf, dest_offset, write,
                    align=DIRECT_ALIGN if direct_fd is not None else 0)


def _receive(resp: Any, start: int, length: int, cancel: threading.Event, count: Callable[[int], None],
             sink: Callable[[memoryview], None] | None, buffer: Callable[[], memoryview], dest_offset: int,
             write: Callable[[memoryview, int, int], None], align: int = 0) -> int:
    """Read up to ``length`` body bytes piece by piece into ``buffer()``; each piece goes to
    ``write(buf, n, offset)`` and then to ``sink``. Returns how many arrived. ``align``: a piece
    that would start off a multiple of it is cut short so the next one starts on one (a node
    file's tensors lie at any offset: without this, a body written there would never be aligned
    for ``O_DIRECT`` and would go through the page cache whole)."""
    readinto = _readinto_of(resp)
    received = 0
    offset = dest_offset
    while received < length:
        if cancel.is_set():
            raise Cancelled()
        buf = buffer()
        want = min(length - received, len(buf))
        if align and offset % align:
            want = min(want, align - offset % align)
        try:
            n = readinto(buf[:want])
        except (OSError, http.client.HTTPException, urllib3.exceptions.HTTPError,
                requests.exceptions.RequestException) as e:
            # (TimeoutError and ConnectionError are OSErrors: the socket's, never the disk's here)
            got = "an empty body" if received == 0 else f"{received} of {length} bytes"
            raise Retryable(f"connection lost after {got} (bytes {start}-{start + length - 1}; "
                            f"{type(e).__name__})") from None
        if not n:
            break
        count(n)
        write(buf, n, offset)
        if sink is not None:
            sink(buf[:n])
        offset += n
        received += n
    return received


def stream_range(listing: HubListing, entry: HubFile, start: int, length: int, fd: int, dest_offset: int,
                 headers: dict[str, str], timeout: float, cancel: threading.Event, count: Callable[[int], None],
                 sink: Callable[[memoryview], None] | None = None, direct_fd: int | None = None) -> None:
    """One ranged GET of bytes ``[start, start + length)`` of ``entry``, written to ``fd`` at
    ``dest_offset`` (the rank-aware fetch writes a tensor at another offset than the source's);
    ``sink`` sees every written piece in order; ``direct_fd``: see :func:`copy_body`. See
    :func:`_stream_range`."""
    _stream_range(listing, entry, start, length, fd, dest_offset, headers, timeout, cancel, count, sink, direct_fd)


def hash_range(listing: HubListing, entry: HubFile, start: int, length: int, headers: dict[str, str],
               timeout: float, cancel: threading.Event, count: Callable[[int], None],
               sink: Callable[[memoryview], None]) -> None:
    """:func:`stream_range` that stores nothing: ``sink`` (a hasher) sees every piece in order
    (``manifest pull --tensor-hashes``: a hub file's tensor digests in bounded memory)."""
    _stream_range(listing, entry, start, length, None, 0, headers, timeout, cancel, count, sink)


def _stream_range(listing: HubListing, entry: HubFile, start: int, length: int, fd: int | None, dest_offset: int,
                  headers: dict[str, str], timeout: float, cancel: threading.Event, count: Callable[[int], None],
                  sink: Callable[[memoryview], None] | None, direct_fd: int | None = None) -> None:
    """One ranged GET into ``fd`` (None: nowhere) and ``sink``. Raises Retryable/Fatal/Cancelled
    (after one of them, what ``sink`` saw is void for a writer that journals whole requests; it
    was every byte received, in order), or RangeIgnored.

    The response checks mirror :func:`~k3ckpt.hub.client.read_range`'s: a body is only written when its
    ``Content-Range`` is exactly the requested range, or when there is none and the range asked
    for is the whole file (a 200 then carries exactly it); any other 200 without
    ``Content-Range`` is :class:`RangeIgnored`, and nothing of its body is read.
    """
    end = start + length - 1
    resp, _ = request(listing, entry, headers, timeout, (start, end))
    with resp:
        content_range = resp.headers.get("Content-Range")
        announced = _http.content_length(resp)
        if content_range is not None:
            m = _http.CONTENT_RANGE.match(content_range)
            if not m:
                raise Fatal(f"unparseable Content-Range {content_range!r} (asked for bytes {start}-{end})")
            got_range, total = (int(m.group(1)), int(m.group(2))), m.group(3)
            if got_range != (start, end):
                raise Fatal(f"asked for bytes {start}-{end}, server answered {content_range!r}")
            if total != "*" and int(total) != entry.size:
                raise Fatal(f"Content-Range {content_range!r} says the file is {total} bytes, "
                            f"the listing says {entry.size}")
            if announced is not None and announced != length:
                raise Retryable(f"Content-Range {content_range!r} with Content-Length {announced}")
        elif resp.status_code == 206:
            raise Fatal(f"HTTP 206 without Content-Range (asked for bytes {start}-{end})")
        else:
            # 200 without Content-Range: the server ignored Range and sends the file from byte 0.
            if announced is not None and announced != entry.size:
                what = "an empty body" if announced == 0 else f"a {announced}-byte body"
                if _http.is_html(resp):  # a proxy's or portal's error page, not the file
                    what = f"a {announced}-byte HTML page"
                raise Retryable(f"server sent {what} (HTTP 200) for a {entry.size}-byte file")
            if start != 0 or length != entry.size:
                raise RangeIgnored(f"the server ignores Range (HTTP 200 with the whole file for bytes {start}-{end})")
        received = _copy_body(resp, fd, start, dest_offset, length, cancel, count, sink, None, PIECE, direct_fd)
        extra = b""
        if received == length and announced is None:
            try:
                extra = resp.raw.read(1, decode_content=False)  # chunked: no more than asked for
            except (urllib3.exceptions.HTTPError, ConnectionError):
                extra = b""
        if extra:
            raise Retryable(f"body is longer than the {length} bytes of bytes {start}-{end}")
        if received != length:
            got = "an empty body" if received == 0 else f"{received} bytes"
            raise Retryable(f"got {got} for bytes {start}-{end} ({length} bytes)")


# ----------------------------------------------------------------------------------------------
# Retries
# ----------------------------------------------------------------------------------------------


def back_off(policy: RetryPolicy, failures: int, retry_after: float | None) -> None:
    """Sleep before retry number ``failures`` (``Retry-After`` as given, else the backoff)."""
    delay = policy.delay(failures, retry_after)
    if retry_after is None:
        # Equal jitter: workers that failed together must not retry in lockstep.
        delay = delay / 2 + random.uniform(0, delay / 2)
    policy.sleep(delay)
