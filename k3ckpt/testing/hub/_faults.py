"""Fault injection: what can be armed on a hub (:class:`Fault`, :data:`FAULT_KINDS`) and the
thread-safe set that hands armed faults to the requests they match (:class:`FaultSet`).

The faults act where their request is answered: file bodies in ``_bodies``, listings and
``scope="api"`` faults in ``_server`` (``HandlerBase``), ``expired_url`` on the Xet bridge.

``hub.inject(kind, path_glob="*", *, repo="*", times=1, methods=("GET",), **params)`` (or
``hub.faults.add(Fault(...))``) arms a :class:`Fault` that applies to the next ``times``
matching file requests (``times=None``: forever).  ``path_glob`` is an ``fnmatch`` pattern on
the repo-relative file path.  A fault is only consumed by a request it actually affects.
Kinds and parameters:

- ``status``: answer ``status`` (default 503) in the hub's error format; ``retry_after=s``
  adds ``Retry-After`` (use with 429).  Also applies to HEAD if listed in ``methods``.
- ``drop_after``: send ``after`` body bytes, then reset the connection (RST; with
  ``reset=False`` close it with a FIN instead).
- ``short_body``: announce the full ``Content-Length`` but send ``missing`` (default 1) bytes
  fewer, then close cleanly (FIN).
- ``stall``: send ``after`` bytes, sleep ``seconds``, then continue (or close if
  ``close=True``).
- ``corrupt_byte``: flip (XOR 0xFF) the byte at file offset ``offset`` if it is served.
- ``ignore_range``: answer a Range request with 200 and the whole body.
- ``ignore_range_with_content_range``: answer a Range request with 200 *and* the correct
  ``Content-Range`` and the requested slice (the ModelScope behaviour of issue #50).

Hostile hubs (a compromised mirror, a broken proxy or CDN), for security tests:

- ``lie_size``: every listing (HF siblings / tree / paths-info, ModelScope files) reports the
  matching files' size plus ``delta`` (may be negative); HEAD's ``X-Linked-Size`` too.
- ``list_as``: listings name the matching file ``name`` instead (e.g. ``../../etc/evil``).
- ``wrong_content_range``: answer a Range request with 206 and the range shifted by ``delta``
  bytes (its ``Content-Range`` and body agree with each other, not with the request).
- ``redirect``: answer 302 with ``Location: <location><request path and query>``; serve the
  same repo on another hub at ``location`` (e.g. ``http://127.0.0.2:PORT``) and look at its
  ``request_log`` (``RequestRecord.credentials``) to see whether the token followed.
- ``endless_body``: 200 without ``Content-Length`` (or, with ``content_range=True``, a 206 with
  the right ``Content-Range``) and a body of ``fill`` bytes that never ends (it stops after
  ``after`` bytes when ``after`` > 0, or when the client goes away).
- ``html_200``: answer 200 with ``Content-Type: text/html`` and an HTML error page.

Xet mode: ``expired_url``: the bridge answers the next ``times`` matching requests 403 "Request
has expired" whatever their URL's expiry, as if it had just run out (only requests whose range
starts at or past ``offset``: a URL that expires mid-download).

With ``scope="api"`` a ``status`` fault matches the URL path of API requests instead of file
paths (e.g. ``hub.inject("status", "/api/models/*/tree/*", scope="api", status=429)``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import threading
from typing import Any

#: The fault kinds understood by :class:`Fault`.
FAULT_KINDS = frozenset(
    {
        "status",
        "drop_after",
        "short_body",
        "stall",
        "corrupt_byte",
        "ignore_range",
        "ignore_range_with_content_range",
        # Hostile hubs (what a compromised mirror or a broken proxy might answer):
        "lie_size",
        "list_as",
        "wrong_content_range",
        "redirect",
        "endless_body",
        "html_200",
        # Xet mode:
        "expired_url",
    }
)
#: Fault kinds that change what the listings say rather than how a file is served.
LISTING_FAULTS = frozenset({"lie_size", "list_as"})


@dataclasses.dataclass
class Fault:
    """A misbehaviour armed for matching requests (see the module docstring for the kinds).

    Attributes:
        kind: One of :data:`FAULT_KINDS`.
        path_glob: ``fnmatch`` pattern on the repo-relative file path (``scope="file"``) or on
            the URL path (``scope="api"``).
        repo: ``fnmatch`` pattern on the repo id.
        times: How many requests it affects; ``None`` means forever.
        methods: HTTP methods it applies to.
        scope: ``"file"`` (file downloads) or ``"api"`` (metadata endpoints; ``status`` only).
        status: HTTP status for ``status`` faults.
        retry_after: ``Retry-After`` seconds for ``status`` faults.
        after: Body bytes sent before ``drop_after`` / ``stall`` acts.
        missing: Bytes left out by ``short_body``.
        seconds: Sleep of ``stall``.
        close: Whether ``stall`` closes the connection after sleeping.
        reset: Whether ``drop_after`` aborts with an RST (True) or closes with a FIN.
        offset: File offset flipped by ``corrupt_byte``; first offset ``expired_url`` applies to.
        delta: Size change of ``lie_size``; range shift of ``wrong_content_range``.
        name: The path ``list_as`` lists the file under.
        location: Base URL ``redirect`` sends the client to.
        content_range: Whether ``endless_body`` answers 206 with a correct ``Content-Range``.
        fill: The byte value an ``endless_body`` repeats.
        skip: Matching requests let through untouched before the fault acts (a server that
            honours ``Range`` for the first chunk and then stops, say).
        hits: How many requests it has affected so far.
    """

    kind: str
    path_glob: str = "*"
    repo: str = "*"
    times: int | None = 1
    methods: tuple[str, ...] = ("GET",)
    scope: str = "file"
    status: int = 503
    retry_after: float | None = None
    after: int = 0
    missing: int = 1
    seconds: float = 0.0
    close: bool = False
    reset: bool = True
    offset: int = 0
    delta: int = 1
    name: str = ""
    location: str = ""
    content_range: bool = False
    fill: int = 0
    skip: int = 0
    hits: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {sorted(FAULT_KINDS)}")
        if self.scope not in ("file", "api"):
            raise ValueError("scope must be 'file' or 'api'")
        if self.kind == "list_as" and not self.name:
            raise ValueError("list_as needs name=")
        if self.kind == "redirect" and not self.location:
            raise ValueError("redirect needs location=")
        if self.scope == "api" and self.kind != "status":
            raise ValueError("only 'status' faults can target API endpoints")
        if self.times is not None and self.times < 0:
            raise ValueError("times must be >= 0 or None")
        if self.kind == "status" and not 400 <= self.status <= 599:
            raise ValueError("status faults need a 4xx/5xx status")
        self.methods = tuple(m.upper() for m in self.methods)
        if min(self.after, self.missing, self.offset, self.skip) < 0 or self.seconds < 0:
            raise ValueError("fault sizes, offsets and durations must be >= 0")

    @property
    def exhausted(self) -> bool:
        """True once the fault has affected ``times`` requests."""
        return self.times is not None and self.hits >= self.times

    def matches(self, scope: str, repo_id: str, path: str, method: str) -> bool:
        """Whether a request falls under this fault (regardless of remaining uses)."""
        return (
            scope == self.scope
            and method in self.methods
            and fnmatch.fnmatchcase(repo_id, self.repo)
            and fnmatch.fnmatchcase(path, self.path_glob)
        )


class FaultSet:
    """A thread-safe list of armed faults."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def add(self, fault: Fault) -> Fault:
        """Arm a fault and return it."""
        with self._lock:
            self._faults.append(fault)
        return fault

    def remove(self, fault: Fault) -> None:
        """Disarm a fault (no error if it is not armed)."""
        with self._lock:
            self._faults = [f for f in self._faults if f is not fault]

    def clear(self) -> None:
        """Disarm every fault."""
        with self._lock:
            self._faults.clear()

    def active(self) -> list[Fault]:
        """The faults that still have uses left."""
        with self._lock:
            return [f for f in self._faults if not f.exhausted]

    def __len__(self) -> int:
        return len(self.active())

    def take(self, scope: str, repo_id: str, path: str, method: str, accept: Any) -> list[Fault]:
        """Consume one use of every live matching fault for which ``accept(fault)`` is true."""
        taken: list[Fault] = []
        with self._lock:
            for f in self._faults:
                if not f.exhausted and f.matches(scope, repo_id, path, method) and accept(f):
                    if f.skipped < f.skip:
                        f.skipped += 1
                        continue
                    f.hits += 1
                    taken.append(f)
        return taken
