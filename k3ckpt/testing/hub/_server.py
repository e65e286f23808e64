"""The HTTP core of the hub: the listening sockets and their threads, the request log
(:class:`RequestRecord`), the per-path counters and their epochs, and the request handler's
plumbing that every route shares (logging a request, auth, the HF and ModelScope error formats,
``scope="api"`` and listing faults).

The routes are mixins of :class:`HandlerBase` in their own modules (``_hf``, ``_ms``, ``_xet``,
file bodies in ``_bodies``); ``_hub`` puts them together into the handler and the hub.  A
handler sees its hub as a :class:`HubView`.

Counters and log cover the requests that arrived since the last reset (an *epoch*): a body still
being sent from before it (say, an earlier test's stall waking up) is counted nowhere.
"""

from __future__ import annotations

import collections
import dataclasses
import http.server
import json
import socket
import sys
import threading
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from ._faults import LISTING_FAULTS, FaultSet
from ._repo import FileEntry, RepoSnapshot

_TRUE = {"1", "true", "yes", "on"}


@dataclasses.dataclass
class RequestRecord:
    """One request as the hub saw it. It enters the log as its response's headers are sent,
    before the client can see any of it, so a client that has its answer finds it there.
    ``body_bytes`` then grows as the body is sent; like the byte counters, it can trail what the
    client has read by a moment, until ``finished``. A request answered with nothing (a dropped
    connection) enters the log when it ends.

    Attributes:
        method: HTTP method.
        target: Request target (path and query).
        route: Route name, e.g. ``hf.resolve``, ``hf.tree``, ``ms.files``, ``ms.download``.
        status: Status code answered.
        repo: Repo id, if the route names one.
        file: Repo-relative file path for downloads.
        range: The ``Range`` header, if any.
        body_bytes: Body bytes handed to the socket.
        credentials: Whether the request carried an ``Authorization`` header or a ModelScope
            ``m_session_id`` cookie (what must not follow a redirect to another host); on the
            Xet bridge, any ``Authorization`` or ``Cookie`` header at all.
        server: ``"hub"``, or ``"bridge"`` for the Xet bridge host (see ``_xet``).
        started: ``time.monotonic()`` when the request arrived: records are appended when a
            response starts, so "did B arrive after A" compares ``started``, not log positions.
        finished: Whether the hub is done with the request: from then on its ``body_bytes``
            and its share of the counters are final.
    """

    method: str
    target: str
    route: str
    status: int
    repo: str | None
    file: str | None
    range: str | None
    body_bytes: int
    credentials: bool = False
    server: str = "hub"
    started: float = 0.0  # time.monotonic() when the request arrived (the log is in response order)
    finished: bool = False


class Counters:
    """Per-(repo, path) requests and body bytes of the requests that arrived in the current
    epoch. A reset starts a new epoch: a handler still running from before it (a body stalled for
    seconds by an earlier test's fault, which then wakes and writes into its dead socket) counts
    nowhere, instead of in whatever a later test is measuring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._reqs: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.epoch = 0

    def request(self, epoch: int, repo: str, path: str, method: str) -> None:
        with self._lock:
            if epoch == self.epoch:
                self._reqs[(repo, path, method)] += 1

    def sent(self, epoch: int, repo: str, path: str, n: int) -> None:
        if n:
            with self._lock:
                if epoch == self.epoch:
                    self._bytes[(repo, path)] += n

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._reqs.clear()
            self.epoch += 1

    def bytes_sent(self, path: str, repo: str | None) -> int:
        with self._lock:
            return sum(n for (r, p), n in self._bytes.items() if p == path and (repo is None or r == repo))

    def requests(self, path: str, repo: str | None, method: str | None) -> int:
        with self._lock:
            return sum(
                n
                for (r, p, m), n in self._reqs.items()
                if p == path and (repo is None or r == repo) and (method is None or m == method.upper())
            )

    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())



class Abort(Exception):
    """Raised inside a handler to drop the connection without writing anything more."""


class Server(http.server.ThreadingHTTPServer):
    """A listening socket of the hub (``role`` "hub", or "bridge" for the Xet bridge host): a
    thread per connection, and the open connections, so that stopping can drop them."""

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog of 5 overflows when a client opens a dozen connections at
    # once (parallel header reads, 8+ download workers); the kernel then drops SYNs and the
    # client's connect waits a full second for the retransmit.
    request_queue_size = 128
    hub: HubView

    def __init__(self, addr: tuple[str, int], hub: HubView, handler: type[HandlerBase], role: str = "hub") -> None:
        self.hub = hub
        self.role = role  # "hub", or "bridge" for the Xet bridge host
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(addr, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client hanging up or timing out mid-keep-alive (downloaders cancel, tests kill) is
        # normal traffic for a hub: socket errors are; only other errors deserve socketserver's
        # traceback on stderr.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_all_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def fmt_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


class HubView(Protocol):
    """What a request handler reads and calls on the hub its server belongs to
    (:class:`~k3ckpt.testing.hub.LoopbackHub`)."""

    host: str
    port: int
    token: str | None
    page_size: int
    faults: FaultSet
    _counters: Counters
    _snapshots: dict[str, RepoSnapshot]
    _stopping: threading.Event

    @property
    def bridge_url(self) -> str: ...

    def is_xet(self, repo_id: str) -> bool: ...

    def signed_bridge_url(self, repo_id: str, entry: FileEntry) -> str: ...

    def check_signature(self, target: str) -> str | None: ...

    def bridge_object(self, path: str) -> tuple[RepoSnapshot, FileEntry] | None: ...

    def _record(self, epoch: int, rec: RequestRecord) -> None: ...


class HandlerBase(http.server.BaseHTTPRequestHandler):
    """The request handler's state and the plumbing every route uses; the handler the hub
    serves with (``_hub.Handler``) sets the per-request state below for each request."""

    protocol_version = "HTTP/1.1"
    server_version = "k3ckpt-loopback-hub/1.0"
    sys_version = ""
    timeout = 120
    # TCP_NODELAY, as production servers set it: the headers and the sendfile'd body go out as
    # separate writes, and with Nagle on the body waits for the client's delayed ACK of the
    # headers - 40 ms per response, which small ranged requests (tensor ranges) pay in full.
    disable_nagle_algorithm = True
    server: Server
    # Per request:
    _started: float
    _epoch: int  # what this request counts in (see Counters)
    _method: str
    _route: str
    _repo: str | None
    _file: str | None
    _status: int
    _body_bytes: int
    _logged: RequestRecord | None
    _rx_body: bytes
    _query: dict[str, str]

    # -- plumbing ------------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Silence the default stderr access log (see ``LoopbackHub.request_log``)."""

    def _log_request(self) -> RequestRecord:
        """Put this request in the hub's log (see :class:`RequestRecord` for when)."""
        self._logged = RequestRecord(
            method=self._method,
            target=self.path,
            route=self._route,
            status=self._status,
            repo=self._repo,
            file=self._file,
            range=self.headers.get("Range"),
            body_bytes=self._body_bytes,
            credentials=self._carries_credentials(),
            server=self.server.role,
            started=self._started,
        )
        self.server.hub._record(self._epoch, self._logged)
        return self._logged

    def _carries_credentials(self) -> bool:
        if self.server.role == "bridge":
            # Nothing a client holds for the hub has any business on the bridge host.
            return bool(self.headers.get("Authorization") or self.headers.get("Cookie"))
        return bool(self.headers.get("Authorization")) or "m_session_id" in (self.headers.get("Cookie") or "")

    def _authorized(self, token: str) -> bool:
        auth = self.headers.get("Authorization", "")
        if auth == f"Bearer {token}":
            return True
        cookie = self.headers.get("Cookie", "")
        return f"m_session_id={token}" in [c.strip() for c in cookie.split(";")]

    def _unauthorized(self, is_ms: bool) -> None:
        supplied = bool(self.headers.get("Authorization"))
        if is_ms:
            self._ms_error(401, "Invalid access token" if supplied else "User not logged in")
            return
        headers = {"WWW-Authenticate": 'Bearer realm="loopback-hub"'}
        if supplied:
            headers["X-Error-Message"] = "Invalid credentials in Authorization header"
        self._json(401, {"error": "Invalid credentials in Authorization header" if supplied else "Unauthorized"},
                   headers)

    def _send_head(self, status: int, headers: Mapping[str, str]) -> None:
        self._status = status
        if self._logged is None:
            self._log_request()  # before the client can see the answer
        self.send_response(status)
        for k, v in headers.items():
            # http.server encodes headers as latin-1; keep non-ASCII paths from breaking a response.
            self.send_header(k, v.encode("ascii", "backslashreplace").decode("ascii"))
        self.end_headers()

    def _json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        h = {"Content-Type": "application/json; charset=utf-8", "Content-Length": str(len(body))}
        h.update(headers or {})
        self._send_head(status, h)
        if self._method != "HEAD":
            self.wfile.write(body)

    def _hf_error(self, status: int, code: str | None, message: str, headers: Mapping[str, str] | None = None) -> None:
        h = {"X-Error-Message": message}
        if code:
            h["X-Error-Code"] = code
        h.update(headers or {})
        self._json(status, {"error": message}, h)

    def _ms_envelope(self, data: Any) -> dict[str, Any]:
        return {"Code": 200, "Data": data, "Message": "success", "RequestId": uuid.uuid4().hex, "Success": True}

    def _ms_error(self, status: int, message: str, code: Any = None, headers: Mapping[str, str] | None = None) -> None:
        self._json(
            status,
            {
                "Code": code if code is not None else status,
                "Data": None,
                "Message": message,
                "RequestId": uuid.uuid4().hex,
                "Success": False,
            },
            headers,
        )

    def _base_url(self) -> str:
        host = self.headers.get("Host") or f"{self.server.hub.host}:{self.server.hub.port}"
        return f"http://{host}"

    def _api_fault(self, raw_path: str, ms: bool) -> bool:
        """Apply an armed ``scope="api"`` status fault; True if it answered the request."""
        taken = self.server.hub.faults.take("api", self._repo or "", raw_path, self._method, lambda f: True)
        for f in taken:
            headers = {"Retry-After": fmt_seconds(f.retry_after)} if f.retry_after is not None else {}
            if ms:
                self._ms_error(f.status, f"injected fault: HTTP {f.status}", headers=headers)
            else:
                self._hf_error(f.status, None, f"injected fault: HTTP {f.status}", headers)
            return True
        return False

    def _match_repo(self, rest: str) -> tuple[RepoSnapshot | None, str]:
        """Split ``owner/name/<tail>`` into the served repo and the tail."""
        hub = self.server.hub
        for repo_id in sorted(hub._snapshots, key=len, reverse=True):
            if rest == repo_id or rest.startswith(repo_id + "/"):
                return hub._snapshots[repo_id], rest[len(repo_id) + 1 :]
        return None, rest

    def _listed(self, snap: RepoSnapshot, e: FileEntry) -> tuple[str, int]:
        """The (path, size) a listing reports for a file: the truth unless a listing fault lies."""
        taken = self.server.hub.faults.take("file", snap.repo_id, e.path, self._method,
                                            lambda f: f.kind in LISTING_FAULTS)
        path, size = e.path, e.size
        for f in taken:
            if f.kind == "list_as":
                path = f.name
            else:
                size = max(0, size + f.delta)
        return path, size
