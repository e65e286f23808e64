"""The hub: :class:`LoopbackHub` (its repos, lifecycle, Xet URL signing, faults, counters and
request log) and the request handler it serves with, which routes each request to the Hugging
Face, ModelScope or Xet bridge routes.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from ._faults import Fault, FaultSet
from ._hf import HFRoutes
from ._ms import MSRoutes
from ._repo import FileEntry, HashStats, RepoSnapshot, RepoSpec, repo_key, scan_repo
from ._server import Abort, Counters, RequestRecord, Server
from ._xet import XET_URL_TTL

_MAX_REQUEST_BODY = 16 << 20


class Handler(HFRoutes, MSRoutes):
    """The hub's request handler: one request's life (its body read, auth, routing to the HF,
    ModelScope or bridge routes, its log record)."""

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        """Handle GET."""
        self._dispatch("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        """Handle HEAD."""
        self._dispatch("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        """Handle POST."""
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        self._started = time.monotonic()
        self._epoch = self.server.hub._counters.epoch  # what this request counts in (see Counters)
        self._method = method
        self._route = "unknown"
        self._repo = None
        self._file = None
        self._status = 0
        self._body_bytes = 0
        self._logged = None
        self._rx_body = b""
        hub = self.server.hub
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_REQUEST_BODY:
                self.close_connection = True
                self._json(413, {"error": "request body too large"})
                return
            if length:
                self._rx_body = self.rfile.read(length)
            split = urlsplit(self.path)
            self._query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
            raw_path = split.path
            if self.server.role == "bridge":
                # A signed URL is its own credential: the hub token is neither needed nor wanted.
                self._handle_bridge(raw_path)
                return
            is_ms = raw_path.startswith("/api/v1/") or raw_path.startswith("/openapi/")
            if hub.token is not None and not self._authorized(hub.token):
                self._route = "auth"
                self._unauthorized(is_ms)
                return
            if raw_path.startswith("/openapi/"):
                self._route = "ms.openapi"
                self._ms_error(404, "OpenAPI is not emulated; use the legacy /api/v1 endpoints",
                               code="ResourceNotFound")
            elif raw_path.startswith("/api/v1/"):
                self._handle_ms(raw_path[len("/api/v1/") :])
            elif raw_path.startswith("/api/"):
                self._handle_hf_api(raw_path[len("/api/") :])
            else:
                self._handle_hf_resolve(raw_path.lstrip("/"))
        except Abort:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError):
            self.close_connection = True
        finally:
            # A request answered with nothing (no headers sent) is logged only now.
            record = self._logged if self._logged is not None else self._log_request()
            record.finished = True  # the last count is in



class LoopbackHub:
    """Serve local directories over the Hugging Face and ModelScope HTTP APIs on loopback.

    Args:
        repos: Repo id (``owner/name``) -> directory or :class:`RepoSpec`.
        host: Address to bind (keep it on loopback).
        port: Port to bind; 0 picks a free one.
        cache_dir: Where hash caches live; defaults to ``$TMPDIR/k3ckpt-hub-<uid>``.
        token: If set, every request needs ``Authorization: Bearer <token>`` (or the
            ModelScope ``m_session_id`` cookie), else 401.
        page_size: Entries per page of the HF tree listing (the real hub uses 1000).
        xet: Present every repo's LFS files as Xet-backed (a :class:`RepoSpec` may say
            otherwise per repo): see Xet mode in :mod:`k3ckpt.testing.hub._xet`.
        xet_url_ttl: Seconds a signed bridge URL stays valid (0: already expired when issued).

    Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        repos: Mapping[str, str | os.PathLike[str] | RepoSpec],
        host: str = "127.0.0.1",
        port: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
        page_size: int = 1000,
        xet: bool = False,
        xet_url_ttl: float = XET_URL_TTL,
    ) -> None:
        if not repos:
            raise ValueError("at least one repo is required")
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if xet_url_ttl < 0:
            raise ValueError("xet_url_ttl must be >= 0")
        self.specs: dict[str, RepoSpec] = {}
        for repo_id, value in repos.items():
            if not repo_id or repo_id.startswith("/") or repo_id.endswith("/") or repo_id.count("/") > 1:
                raise ValueError(f"invalid repo id {repo_id!r}")
            self.specs[repo_id] = value if isinstance(value, RepoSpec) else RepoSpec(Path(value))
        self.host = host
        self._requested_port = port
        self.port = port
        self.cache_dir = (
            Path(cache_dir)
            if cache_dir is not None
            else Path(tempfile.gettempdir()) / f"k3ckpt-hub-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        )
        self.token = token
        self.page_size = page_size
        self.xet = xet
        self.xet_url_ttl = xet_url_ttl
        # Signs the bridge URLs; only this process can mint one, so a URL is only ever valid
        # as the hub issued it.
        self._xet_secret = os.urandom(32)
        self._xet_objects: dict[tuple[str, str], tuple[str, str]] = {}
        self._bridge: Server | None = None
        self._bridge_thread: threading.Thread | None = None
        self.faults = FaultSet()
        self.hash_stats = HashStats()
        self._counters = Counters()
        self._log: collections.deque[RequestRecord] = collections.deque(maxlen=100_000)
        self._log_lock = threading.Lock()
        self._snapshots: dict[str, RepoSnapshot] = {}
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> LoopbackHub:
        """Scan and hash the repos, bind the socket and serve in a background thread."""
        if self._server is not None:
            return self
        self.rescan()
        self._stopping.clear()
        server = Server((self.host, self._requested_port), self, Handler)
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"loopback-hub:{self.port}", daemon=True
        )
        self._thread.start()
        if any(self.is_xet(rid) for rid in self.specs):
            # The bridge is "another host" to a client: same address, another port, so another
            # origin, to which no credential of the hub may be sent.
            bridge = Server((self.host, 0), self, Handler, role="bridge")
            self._bridge = bridge
            self._bridge_thread = threading.Thread(
                target=bridge.serve_forever, kwargs={"poll_interval": 0.05},
                name=f"loopback-hub-bridge:{bridge.server_address[1]}", daemon=True)
            self._bridge_thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and drop open connections (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        bridge, self._bridge = self._bridge, None
        for srv in (server, bridge):
            if srv is not None:
                srv.shutdown()
                srv.close_all_connections()
                srv.server_close()
        for thread in (self._thread, self._bridge_thread):
            if thread is not None:
                thread.join(timeout=5)
        self._thread = self._bridge_thread = None

    def __enter__(self) -> LoopbackHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def rescan(self) -> None:
        """Re-list and (re-)hash every repo; a content change yields a new commit sha."""
        stats = HashStats()
        snapshots = {rid: scan_repo(rid, spec, self.cache_dir, stats) for rid, spec in self.specs.items()}
        self.hash_stats = stats
        self._xet_objects = {
            (repo_key(rid), e.xet_hash): (rid, e.path)
            for rid, snap in snapshots.items() if self.is_xet(rid)
            for e in snap.files.values() if e.lfs
        }
        self._snapshots = snapshots

    @property
    def running(self) -> bool:
        """Whether the server thread is serving."""
        return self._server is not None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (valid after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("the hub is not running; call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def bridge_url(self) -> str:
        """Base URL of the Xet bridge host (valid after :meth:`start`, in Xet mode only)."""
        if self._bridge is None:
            raise RuntimeError("no Xet bridge: the hub is not running or serves no Xet-backed repo")
        return f"http://{self.host}:{self._bridge.server_address[1]}"

    def client_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a client subprocess: ``base`` (default ``os.environ``) plus the hub vars."""
        env = dict(os.environ if base is None else base)
        env.update(self.env_vars())
        return env

    def env_vars(self) -> dict[str, str]:
        """The variables pointing both clients at this hub."""
        return {
            "HF_ENDPOINT": self.url,
            "MODELSCOPE_ENDPOINT": self.url,
            "HF_HUB_DISABLE_XET": "1",
        }

    # -- repo info -------------------------------------------------------------------------------

    def snapshot(self, repo_id: str) -> RepoSnapshot:
        """The listing currently served for a repo."""
        if not self._snapshots:
            self.rescan()
        return self._snapshots[repo_id]

    def commit(self, repo_id: str) -> str:
        """The commit sha served for a repo."""
        return self.snapshot(repo_id).commit

    def files(self, repo_id: str) -> dict[str, FileEntry]:
        """Repo-relative path -> :class:`FileEntry` for a repo."""
        return self.snapshot(repo_id).files

    def is_xet(self, repo_id: str) -> bool:
        """Whether a repo's LFS files are presented as Xet-backed."""
        spec = self.specs[repo_id]
        return self.xet if spec.xet is None else spec.xet

    def signed_bridge_url(self, repo_id: str, entry: FileEntry) -> str:
        """A bridge URL for a file, signed and valid for ``xet_url_ttl`` seconds, in the shape
        of the real hub's."""
        expires = time.time() + self.xet_url_ttl
        disposition = (f"inline; filename*=UTF-8''{quote(Path(entry.path).name)}; "
                       f'filename="{quote(Path(entry.path).name)}";')
        signed = (f"/xet-bridge-us/{repo_key(repo_id)}/{entry.xet_hash}?X-Xet-Cas-Uid=public"
                  f"&response-content-disposition={quote(disposition, safe='')}&Expires={expires:.3f}")
        return f"{self.bridge_url}{signed}&Signature={self._sign(signed)}"

    def _sign(self, text: str) -> str:
        return hmac.new(self._xet_secret, text.encode(), hashlib.sha256).hexdigest()

    def check_signature(self, target: str) -> str | None:
        """Why a bridge request target (path and query) is refused, or None if it is valid."""
        signed, sep, signature = target.rpartition("&Signature=")
        if not sep or not hmac.compare_digest(self._sign(signed), signature):
            return "Invalid signature"
        try:
            expires = float(parse_qs(urlsplit(signed).query).get("Expires", [""])[-1])
        except ValueError:
            return "Invalid signature"
        if time.time() >= expires:
            return "Request has expired"
        return None

    def bridge_object(self, path: str) -> tuple[RepoSnapshot, FileEntry] | None:
        """The served file a bridge URL path names, or None."""
        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "xet-bridge-us":
            return None
        found = self._xet_objects.get((parts[1], parts[2]))
        if found is None:
            return None
        snap = self._snapshots[found[0]]
        return snap, snap.files[found[1]]

    def resolve_url(self, repo_id: str, path: str, revision: str = "main") -> str:
        """The Hugging Face ``resolve`` URL of a file."""
        return f"{self.url}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(path)}"

    def modelscope_url(self, repo_id: str, path: str, revision: str = "master") -> str:
        """The ModelScope download URL of a file."""
        return f"{self.url}/api/v1/models/{repo_id}/repo?Revision={quote(revision, safe='')}&FilePath={quote(path)}"

    # -- faults ----------------------------------------------------------------------------------

    def inject(
        self,
        kind: str,
        path_glob: str = "*",
        *,
        repo: str = "*",
        times: int | None = 1,
        methods: Sequence[str] = ("GET",),
        scope: str = "file",
        **params: Any,
    ) -> Fault:
        """Arm a :class:`Fault` (see :mod:`k3ckpt.testing.hub._faults` for kinds and parameters)."""
        return self.faults.add(
            Fault(kind=kind, path_glob=path_glob, repo=repo, times=times, methods=tuple(methods), scope=scope, **params)
        )

    # -- counters and log ------------------------------------------------------------------------

    def bytes_sent(self, path: str, repo: str | None = None) -> int:
        """Body bytes sent for a repo-relative file path (summed over repos unless ``repo``)."""
        return self._counters.bytes_sent(path, repo)

    def requests(self, path: str, repo: str | None = None, method: str | None = None) -> int:
        """File requests (GET and HEAD unless ``method``) for a repo-relative path."""
        return self._counters.requests(path, repo, method)

    def total_bytes_sent(self) -> int:
        """Body bytes sent for all files."""
        return self._counters.total_bytes()

    def reset_counters(self) -> None:
        """Zero the per-path counters and clear the request log. From here on they cover only
        requests that arrive after this call: one still being answered counts nowhere."""
        with self._log_lock:
            self._counters.reset()
            self._log.clear()

    @property
    def request_log(self) -> list[RequestRecord]:
        """Every request seen since the last :meth:`reset_counters`, in the order their answers
        started (see :class:`RequestRecord`)."""
        with self._log_lock:
            return list(self._log)

    @property
    def bridge_log(self) -> list[RequestRecord]:
        """The requests the Xet bridge host saw (``credentials`` says whether any carried one)."""
        return [r for r in self.request_log if r.server == "bridge"]

    def routes_used(self) -> collections.Counter[str]:
        """Route name -> number of requests, from the request log."""
        return collections.Counter(r.route for r in self.request_log)

    def _record(self, epoch: int, rec: RequestRecord) -> None:
        with self._log_lock:
            if epoch == self._counters.epoch:
                self._log.append(rec)
