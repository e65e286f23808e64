"""File bodies: how every route that hands out a file's bytes (HF ``resolve``, ModelScope
download, the Xet bridge) answers, and the file faults that act on a body on the way.

File bodies stream from disk (``socket.sendfile``), honour one ``Range: bytes=a-b | a- | -n``
(206 + ``Content-Range``; 416 + ``Content-Range: bytes */size`` if unsatisfiable; multi-range
requests get the whole file with 200), support HEAD, and always set ``Content-Length`` on an
HTTP/1.1 keep-alive connection.  Armed faults (see ``_faults``) turn that into an error status,
a cut, stalled or corrupted body, an ignored or shifted range, or a hostile answer.
"""

from __future__ import annotations

import email.utils
import os
import re
import socket
import struct
from typing import Any

from ._faults import Fault
from ._repo import FileEntry, RepoSnapshot
from ._server import Abort, HandlerBase, fmt_seconds

_SENDFILE_CHUNK = 8 << 20
_COPY_CHUNK = 1 << 20
_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)


def _http_date(ts: float) -> str:
    return email.utils.formatdate(ts, usegmt=True)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """Parse a single byte range.

    Returns (start, end_inclusive), None to serve the whole file (no/invalid/multi range), or
    the string ``"unsatisfiable"``.
    """
    if header is None:
        return None
    m = _RANGE_RE.match(header)
    if not m:
        return None  # multi-range or malformed: RFC 9110 lets the server ignore it
    a, b = m.group(1), m.group(2)
    if a == "" and b == "":
        return None
    if a == "":
        n = int(b)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    start = int(a)
    end = int(b) if b != "" else size - 1
    if b != "" and end < start:
        return None  # invalid: ignore
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size - 1)



class FileBodies(HandlerBase):
    """Serve a file's bytes, through whatever faults are armed for it."""

    def _serve_file(self, snap: RepoSnapshot, entry: FileEntry, headers: dict[str, str], ms: bool) -> None:
        hub = self.server.hub
        method = self._method
        hub._counters.request(self._epoch, snap.repo_id, entry.path, method)
        size = entry.size
        range_header = self.headers.get("Range")
        parsed = parse_range(range_header, size)
        has_range = parsed is not None

        status_faults = hub.faults.take(
            "file", snap.repo_id, entry.path, method, lambda f: f.kind == "status"
        )
        if status_faults:
            f = status_faults[0]
            extra = {"Retry-After": fmt_seconds(f.retry_after)} if f.retry_after is not None else {}
            msg = f"injected fault: HTTP {f.status}"
            if ms:
                self._ms_error(f.status, msg, headers=extra)
            else:
                self._hf_error(f.status, None, msg, extra)
            return

        if self._hostile(snap, entry, parsed, ms):
            return

        range_faults = hub.faults.take(
            "file",
            snap.repo_id,
            entry.path,
            method,
            lambda f: f.kind in ("ignore_range", "ignore_range_with_content_range") and has_range,
        )
        kinds = {f.kind for f in range_faults}
        if "ignore_range" in kinds:
            parsed = None

        base = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "Last-Modified": _http_date(entry.mtime_ns / 1e9),
            **headers,
        }
        if parsed == "unsatisfiable":
            base["Content-Range"] = f"bytes */{size}"
            base["Content-Length"] = "0"
            base["Content-Type"] = "text/plain"
            self._send_head(416, base)
            return
        if isinstance(parsed, tuple):
            start, end = parsed
            status = 200 if "ignore_range_with_content_range" in kinds else 206
            base["Content-Range"] = f"bytes {start}-{end}/{size}"
        else:
            start, end = 0, size - 1
            status = 200
        length = end - start + 1
        base["Content-Length"] = str(length)
        if method == "HEAD":
            self._send_head(status, base)
            return

        def body_fault(f: Fault) -> bool:
            if f.kind == "corrupt_byte":
                return start <= f.offset < start + length
            return f.kind in ("drop_after", "short_body", "stall")

        faults = hub.faults.take("file", snap.repo_id, entry.path, method, body_fault)
        self._send_head(status, base)
        if not faults:
            self._sendfile(snap.repo_id, entry, start, length)
        else:
            self._send_faulty(snap.repo_id, entry, start, length, faults)

    def _hostile(self, snap: RepoSnapshot, entry: FileEntry, parsed: Any, ms: bool) -> bool:
        """Apply an armed hostile fault to a file request; True if it answered the request."""
        kinds = ("redirect", "html_200", "endless_body", "wrong_content_range")
        taken = self.server.hub.faults.take(
            "file", snap.repo_id, entry.path, self._method,
            lambda f: f.kind in kinds and (f.kind != "wrong_content_range" or isinstance(parsed, tuple)))
        if not taken:
            return False
        f = taken[0]
        if f.kind == "redirect":
            self._send_head(302, {"Location": f.location.rstrip("/") + self.path, "Content-Length": "0"})
        elif f.kind == "html_200":
            page = (b"<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body><h1>Bad Gateway</h1>"
                    b"<p>The upstream server is temporarily unavailable. Please try again later.</p></body></html>\n")
            self._send_head(200, {"Content-Type": "text/html; charset=utf-8", "Content-Length": str(len(page))})
            if self._method != "HEAD":
                self.wfile.write(page)
                self._count(snap.repo_id, entry.path, len(page))
        elif f.kind == "endless_body":
            self._endless(snap, entry, parsed, f)
        else:
            start, end = parsed
            size = entry.size
            # Shifted but self-consistent: only comparing with the request shows it is wrong.
            s0 = min(max(0, start + f.delta), size - 1)
            e0 = min(max(s0, end + f.delta), size - 1)
            self._send_head(206, {"Content-Type": "application/octet-stream", "Content-Range": f"bytes {s0}-{e0}/{size}",
                                  "Content-Length": str(e0 - s0 + 1)})
            if self._method != "HEAD":
                self._sendfile(snap.repo_id, entry, s0, e0 - s0 + 1)
        return True

    def _endless(self, snap: RepoSnapshot, entry: FileEntry, parsed: Any, f: Fault) -> None:
        """A body that never ends (until the client leaves, the hub stops, or ``f.after`` bytes)."""
        headers = {"Content-Type": "application/octet-stream", "Connection": "close"}
        status = 200
        if f.content_range and isinstance(parsed, tuple):
            status = 206
            headers["Content-Range"] = f"bytes {parsed[0]}-{parsed[1]}/{entry.size}"
        self.close_connection = True
        self._send_head(status, headers)
        if self._method == "HEAD":
            return
        block = bytes([f.fill & 0xFF]) * _COPY_CHUNK
        sent = 0
        while not self.server.hub._stopping.is_set() and (f.after == 0 or sent < f.after):
            self.wfile.write(block)
            self._count(snap.repo_id, entry.path, len(block))
            sent += len(block)
        raise Abort()

    def _count(self, repo: str, path: str, n: int) -> None:
        self._body_bytes += n
        if self._logged is not None:
            self._logged.body_bytes = self._body_bytes
        self.server.hub._counters.sent(self._epoch, repo, path, n)

    def _sendfile(self, repo: str, entry: FileEntry, start: int, length: int) -> None:
        with open(entry.abspath, "rb") as f:
            offset, remaining = start, length
            while remaining > 0:
                n = self.connection.sendfile(f, offset, min(remaining, _SENDFILE_CHUNK))
                if n <= 0:
                    break
                self._count(repo, entry.path, n)
                offset += n
                remaining -= n
        if remaining:
            # The file shrank under us: the announced Content-Length can no longer be met.
            raise Abort()

    def _send_faulty(self, repo: str, entry: FileEntry, start: int, length: int, faults: list[Fault]) -> None:
        """Stream a body through the armed body faults (read/modify/write in 1 MiB blocks)."""
        hub = self.server.hub
        limit, end_action = length, None  # bytes to send, then how to end: None | "rst" | "fin"
        for f in faults:
            if f.kind == "drop_after" and (end_action is None or f.after < limit):
                limit, end_action = min(f.after, limit), ("rst" if f.reset else "fin")
            elif f.kind == "short_body" and (end_action is None or length - f.missing < limit):
                limit, end_action = max(0, length - f.missing), "fin"
        stall = next((f for f in faults if f.kind == "stall"), None)
        stall_at = min(stall.after, limit) if stall is not None else None
        corrupt = [f.offset for f in faults if f.kind == "corrupt_byte"]
        sent = 0
        with open(entry.abspath, "rb") as fh:
            fh.seek(start)
            while True:
                if stall is not None and stall_at == sent:
                    stall_at = None
                    hub._stopping.wait(stall.seconds)
                    if stall.close:
                        end_action = "fin"
                        break
                if sent >= limit:
                    break
                want = min(_COPY_CHUNK, limit - sent)
                if stall_at is not None:
                    want = min(want, stall_at - sent)
                chunk = bytearray(fh.read(want))
                if not chunk:
                    raise Abort()  # the file shrank under us
                for off in corrupt:
                    rel = off - (start + sent)
                    if 0 <= rel < len(chunk):
                        chunk[rel] ^= 0xFF
                self.wfile.write(chunk)
                self._count(repo, entry.path, len(chunk))
                sent += len(chunk)
        if end_action == "rst":
            self._reset_connection()
        if end_action == "fin":
            try:
                self.connection.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            raise Abort()

    def _reset_connection(self) -> None:
        """Abort the TCP connection with an RST (SO_LINGER 0) right now, then stop handling."""
        sock = self.connection
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            # socket.close() would wait for the rfile/wfile wrappers; detach and close the fd now.
            os.close(sock.detach())
        except OSError:
            pass
        raise Abort()
