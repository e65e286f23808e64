"""Talking HTTP to a hub: the one place the client's ranged reads and the downloader's streams
share.

A per-thread ``requests`` session that never applies ``~/.netrc`` and never keeps cookies; a GET
that follows redirects by hand so that credentials never leave the original origin, and reuses
the signed URL on another host a file was redirected to (a CDN, the Xet bridge) until it is
refused; what such a URL refusing us means (resolve it again) and how it is shown (without its
query, which is a credential); which statuses are worth a retry and how long
``Retry-After`` asks to wait; how an HTTP error status maps to a typed
:class:`~k3ckpt.hub.client.HubError`; and the small readings of a response or a connection
failure that go into one-line messages.
"""

from __future__ import annotations

import email.utils
import hashlib
import http.cookiejar
import re
import threading
import time
from http import HTTPStatus
from typing import Any
from urllib.parse import urljoin, urlsplit

import requests
import urllib3.exceptions

from ..errors import (
    EntryNotFoundError,
    HubAuthError,
    HubError,
    RangeMismatchError,
    RepoNotFoundError,
    RevisionNotFoundError,
)

#: ``Content-Range: bytes <first>-<last>/<total or *>``.
CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)\s*-\s*(\d+)\s*/\s*(\d+|\*)\s*$", re.IGNORECASE)

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 10
# 501 (Not Implemented) and 505 (HTTP Version Not Supported) will not change on a retry.
_NOT_RETRYABLE_5XX = frozenset({501, 505})

#: The environment variable each hub's client reads a token from (``--token`` overrides it).
TOKEN_VARIABLES = {"hf": "HF_TOKEN", "modelscope": "MODELSCOPE_API_TOKEN"}


def auth_error(status: int | None, ctx: dict[str, Any], *, token_sent: bool, detail: str = "",
               problem: str = "") -> HubAuthError:
    """A 401/403 of the hub itself, saying how to give it a token: ``401 Unauthorized: the repo
    needs a token: set HF_TOKEN or pass --token`` when none was sent; when one was, that it was
    refused (``detail``: the server's words, then). ``problem`` replaces "the repo needs a token" /
    "the token was refused" (a gated repo says what to accept)."""
    var = TOKEN_VARIABLES.get(ctx["hub"], "the hub's token variable")
    head = f"{status} {HTTPStatus(status).phrase}" if status in (401, 403) else "access denied"
    said = f" ({detail})" if detail else ""
    if token_sent:
        what = problem or "the token was refused"
        return HubAuthError(f"{head}: {what}{said}: set {var} or pass --token with one that can read this repo",
                            **ctx)
    # (what the server says to an anonymous request - "Unauthorized", "User not logged in" - adds nothing)
    return HubAuthError(f"{head}: {problem or 'the repo needs a token'}: set {var} or pass --token", **ctx)


def one_line(text: str) -> str:
    """Collapse whitespace (client messages span several lines; ours are one line for the CLI)."""
    return " ".join(str(text).split())


def connection_reason(exc: BaseException) -> str:
    """The useful part of a connection error ("[Errno 111] Connection refused"), not the repr chain."""
    text = str(exc)
    m = re.search(r"\[Errno -?\d+\][^\"')(]*", text)
    if m:
        return m.group(0).strip(" :,")
    return one_line(text)[:200] or type(exc).__name__


def is_connect_failure(exc: BaseException) -> bool:
    """Whether the connection was never established (refused, DNS, no route, connect timeout),
    as opposed to dropped after the request went out.  Walks the wrapping chain that requests,
    urllib3 and modelscope_hub build around the socket error."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        if isinstance(e, (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError,
                          ConnectionRefusedError, requests.exceptions.ConnectTimeout)):
            return True
        todo.extend([e.__cause__, e.__context__, getattr(e, "reason", None), *e.args])
    return False


def _no_auth(request: requests.PreparedRequest) -> requests.PreparedRequest:
    """A no-op ``requests`` auth: its presence stops ``requests`` from applying ``~/.netrc``
    credentials, which would overwrite the hub token we put in ``Authorization``."""
    return request


_local = threading.local()


def session() -> requests.Session:
    """A per-thread session (connection reuse across the many small reads of a header pass)."""
    session = getattr(_local, "session", None)
    if session is None:
        session = requests.Session()
        session.auth = _no_auth
        # Never keep cookies a server sets: credentials are exactly the headers we send.
        session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        _local.session = session
    return session


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


#: How long a redirect target on another host (a signed CDN / Xet bridge URL) is reused for
#: the same file before asking the hub again. The real ones are valid for an hour; a refused
#: one (403, e.g. expired early) is replaced at once whatever its age.
SIGNED_URL_REUSE = 600.0
_TARGETS_MAX = 4096


class _Targets:
    """Redirect targets on another host, by the hub URL that redirected there (and credentials).

    A fetch reads each file in many ranges (256 MiB chunks, or a rank's tensors); resolving every
    one would cost the hub a request each - and the hub rate-limits ``resolve`` calls (a 1.5 TB
    checkpoint is ~5,800 chunks) - so the signed URL a file resolved to serves its later ranges
    until it is refused or :data:`SIGNED_URL_REUSE` old. In memory only, never written anywhere,
    and keyed by the credentials too: a library user serving several tokens in one process
    never reads a file through a URL the hub signed for another token.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, tuple[str, float]] = {}

    @staticmethod
    def key(url: str, headers: Any) -> str:
        creds = f"{headers.get('Authorization', '')}\0{headers.get('Cookie', '')}"
        return f"{hashlib.sha256(creds.encode()).hexdigest()} {url}"

    def get(self, key: str) -> str | None:
        with self._lock:
            hit = self._by_key.get(key)
            if hit is None:
                return None
            if time.monotonic() - hit[1] > SIGNED_URL_REUSE:
                del self._by_key[key]
                return None
            return hit[0]

    def put(self, key: str, target: str) -> None:
        with self._lock:
            if len(self._by_key) >= _TARGETS_MAX:
                self._by_key.clear()  # a bound, not a policy: a run touches a few hundred files
            self._by_key[key] = (target, time.monotonic())

    def forget(self, key: str, target: str) -> None:
        with self._lock:
            if self._by_key.get(key, ("",))[0] == target:
                del self._by_key[key]


_targets = _Targets()


def get(session: requests.Session, url: str, headers: dict[str, str], timeout: float,
        ctx: dict[str, Any]) -> tuple[requests.Response, str]:
    """GET with redirects followed by hand, so credentials never leave the original origin.

    A target on another host that answered 2xx is reused for ``url`` (see :class:`_Targets`);
    when it answers anything else, or cannot be reached, it is dropped and ``url`` is asked
    again at once, so a signed URL that expired mid-download is replaced by a fresh one without
    a retry.

    Returns ``(response, final URL)``; the body is streamed. Raises ``HubError`` (with ``ctx``)
    after too many redirects, and what ``requests`` raises for the connection.
    """
    hdrs = requests.structures.CaseInsensitiveDict(headers)
    key = _targets.key(url, hdrs)
    target = _targets.get(key)
    if target is not None:
        hdrs.pop("Authorization", None)
        hdrs.pop("Cookie", None)
        try:
            resp = session.get(target, headers=hdrs, timeout=timeout, stream=True, allow_redirects=False)
        except requests.exceptions.RequestException:
            resp = None  # that host is gone or unwell: the hub may name another
        if resp is not None and resp.status_code in (200, 206):
            return resp, target
        if resp is not None:
            resp.close()
        _targets.forget(key, target)
        hdrs = requests.structures.CaseInsensitiveDict(headers)
    resp, final = _follow(session, url, hdrs, timeout, ctx)
    if resp.status_code in (200, 206) and left_origin(url, final):
        _targets.put(key, final)
    return resp, final


def _follow(session: requests.Session, url: str, hdrs: requests.structures.CaseInsensitiveDict[str],
            timeout: float, ctx: dict[str, Any]) -> tuple[requests.Response, str]:
    """The GET of :func:`get`, from the hub URL on, with credentials dropped on leaving its origin."""
    first = url
    origin = _origin(url)
    for _ in range(_MAX_REDIRECTS + 1):
        resp = session.get(url, headers=hdrs, timeout=timeout, stream=True, allow_redirects=False)
        location = resp.headers.get("Location")
        if resp.status_code not in _REDIRECTS or not location:
            return resp, url
        resp.close()
        url = urljoin(url, location)
        if _origin(url) != origin:
            # A CDN on another host must not see the hub token (requests would strip
            # Authorization too, but not a Cookie header set by hand).
            hdrs.pop("Authorization", None)
            hdrs.pop("Cookie", None)
    raise HubError(f"more than {_MAX_REDIRECTS} redirects, last to {shown_url(first, url)}", **ctx)


def left_origin(url: str, final_url: str) -> bool:
    """Whether a request was redirected to another origin (a CDN, the Xet bridge host)."""
    return _origin(url) != _origin(final_url)


def signed_url_refused(status: int, url: str, final_url: str) -> bool:
    """Whether an answer is a redirect target on another host refusing its signed URL (403):
    the hub hands out short-lived URLs (a Xet-backed ``resolve`` redirects to one valid for an
    hour), and one can expire between the redirect and the request, or during a long run of
    retries. Asking the hub again yields a fresh one; the hub token is not the problem."""
    return status == 403 and left_origin(url, final_url)


def shown_url(url: str, final_url: str) -> str:
    """``final_url`` for a message: without its query when it is on another origin, where the
    query is a signed URL's signature (a bearer credential until it expires)."""
    if not left_origin(url, final_url):
        return final_url
    parts = urlsplit(final_url)
    return parts._replace(query="<signed>" if parts.query else "", fragment="").geturl()


def retryable_status(status: int) -> bool:
    """Whether an HTTP status is worth another try: 429 and 5xx (but 501 and 505)."""
    return status == 429 or (status >= 500 and status not in _NOT_RETRYABLE_5XX)


def retry_after(resp: requests.Response) -> float | None:
    """The delay a ``Retry-After`` header asks for (seconds or an HTTP date), or None."""
    value = resp.headers.get("Retry-After")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def content_length(resp: requests.Response) -> int | None:
    """The announced ``Content-Length``, or None when there is none (chunked) or it is not a number."""
    cl = resp.headers.get("Content-Length")
    return int(cl) if cl and cl.strip().isdigit() else None


def is_html(resp: requests.Response) -> bool:
    """Whether a response is a web page (an error page of a proxy, portal or CDN): named as such
    in errors, since "a 312-byte body for a 17 GB file" leaves the operator guessing."""
    return (resp.headers.get("Content-Type") or "").split(";")[0].strip().lower() in ("text/html", "application/xhtml+xml")


def status_error(resp: requests.Response, url: str, ctx: dict[str, Any]) -> HubError:
    """The typed error for a final (not retried) non-2xx answer: 401/403, 404 by the hub's
    ``X-Error-Code``, 416, else a plain :class:`~k3ckpt.hub.client.HubError`."""
    status = resp.status_code
    code = resp.headers.get("X-Error-Code", "")
    message = one_line(resp.headers.get("X-Error-Message", ""))[:200]
    detail = f"{url}: HTTP {status}" + (f" ({message})" if message else "")
    if status in (401, 403):
        if _origin(url) != _origin(ctx.get("endpoint") or url):
            # another host (a CDN's signed URL) refused: not a matter of the hub token, never sent there
            return HubAuthError(detail, **ctx)
        sent = "authorization" in {k.lower() for k in resp.request.headers} if resp.request is not None else False
        return auth_error(status, ctx, token_sent=sent, detail=message)
    if status == 404:
        if code == "RepoNotFound":
            return RepoNotFoundError(detail, **ctx)
        if code == "RevisionNotFound":
            return RevisionNotFoundError(detail, **ctx)
        return EntryNotFoundError(detail, **ctx)
    if status == 416:
        return RangeMismatchError(f"{detail}: range not satisfiable (Content-Range "
                                  f"{resp.headers.get('Content-Range')!r})", **ctx)
    return HubError(detail, **ctx)
