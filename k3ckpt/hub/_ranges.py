"""Bytes of a listed file: plain ranged GETs (:func:`read_range`) and safetensors headers (:func:`fetch_header`).

``huggingface_hub`` can read ranges (``HfFileSystem`` files, ``HfApi.get_safetensors_metadata``
for headers) and ``modelscope_hub`` has no public ranged read; one reader serves both hubs with
the same rules: the URL pinned to the listed commit, credentials dropped on a redirect to another
origin, the answer's ``Content-Range`` checked against the request, a header's announced length
checked against the listed file size and ``K3CKPT_MAX_HEADER_BYTES`` before it is requested,
and one retry policy.

Server and client quirks worked around:

- ModelScope has been seen answering a Range request with ``200`` and a correct
  ``Content-Range`` (modelscope_hub issue #50); :func:`read_range` accepts that only when the
  ``Content-Range`` matches the request exactly.
- ``requests`` would replace an ``Authorization`` header with ``~/.netrc`` credentials and keep
  cookies set by one hub for the next; our session (the package's ``_http`` module) disables both.
"""

from __future__ import annotations

import gc
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import requests
import urllib3.exceptions

if TYPE_CHECKING:
    from concurrent.futures import Future

from ..env import K3CKPT_MAX_HEADER_BYTES
from ..errors import (
    EntryNotFoundError,
    HubError,
    HubShortReadError,
    HubUnreachableError,
    K3ckptError,
    RangeMismatchError,
    RangeNotSupportedError,
    SafetensorsHeaderError,
)
from ..format.checkpoint import bulk_allocation, header_pool
from ..format.header import HeaderColumns, parse_header_columns
from . import _http
from ._endpoints import auth_headers, file_url
from ._listing import DEFAULT_RETRY, HubListing, RetryPolicy

#: When a server ignores ``Range`` and sends the whole file from byte 0, we read and discard up
#: to this many leading bytes to reach the requested offset; beyond it we refuse rather than
#: stream most of a multi-GB shard to read a few bytes.
RANGE_SKIP_LIMIT = 1 << 20
_READ_CHUNK = 1 << 20


class _Transient(Exception):
    """A failure worth another try; carries the typed error to raise if tries run out."""

    def __init__(self, error: HubError) -> None:
        super().__init__(str(error))
        self.error = error


def _read_exactly(resp: requests.Response, n: int, skip: int = 0) -> bytes:
    """Read ``skip`` bytes and drop them, then up to ``n`` bytes, from the raw (undecoded) body."""
    raw = resp.raw
    while skip > 0:
        chunk = raw.read(min(skip, _READ_CHUNK), decode_content=False)
        if not chunk:
            break
        skip -= len(chunk)
    if skip > 0:
        return b""
    buf = bytearray()
    while len(buf) < n:
        chunk = raw.read(min(n - len(buf), _READ_CHUNK), decode_content=False)
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _body(resp: requests.Response, url: str, start: int, end: int, size: int | None,
          ctx: dict[str, Any]) -> bytes:
    """The requested bytes from a 2xx answer, or a typed error; never bytes from another offset."""
    length = end - start + 1
    encoding = (resp.headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise RangeMismatchError(f"{url}: server applied Content-Encoding {encoding!r} to a byte-range request", **ctx)
    content_range = resp.headers.get("Content-Range")
    announced = _http.content_length(resp)
    skip = 0
    if content_range is not None:
        m = _http.CONTENT_RANGE.match(content_range)
        if not m:
            raise RangeMismatchError(f"{url}: unparseable Content-Range {content_range!r} "
                                f"(asked for bytes {start}-{end})", **ctx)
        got_start, got_end, total = int(m.group(1)), int(m.group(2)), m.group(3)
        if (got_start, got_end) != (start, end):
            raise RangeMismatchError(f"{url}: asked for bytes {start}-{end}, server answered "
                                f"{content_range!r} (HTTP {resp.status_code})", **ctx)
        if total != "*" and size is not None and int(total) != size:
            raise RangeMismatchError(f"{url}: Content-Range {content_range!r} says the file is {total} bytes, "
                                f"the listing says {size}", **ctx)
        if announced is not None and announced != length:
            raise RangeMismatchError(f"{url}: Content-Range {content_range!r} with Content-Length {announced}", **ctx)
    elif resp.status_code == 206:
        raise RangeMismatchError(f"{url}: HTTP 206 without Content-Range (asked for bytes {start}-{end})", **ctx)
    else:
        # 200 without Content-Range: the server ignored Range and sends the file from byte 0.
        if start > RANGE_SKIP_LIMIT:
            raise RangeNotSupportedError(f"{url}: server ignored Range (HTTP 200, whole body) and byte {start} is "
                                    f"past the {RANGE_SKIP_LIMIT}-byte skip limit", **ctx)
        if announced is not None and size is not None and announced != size:
            what = "HTML page" if _http.is_html(resp) else "body"
            raise RangeMismatchError(f"{url}: server ignored Range and sent a {announced}-byte {what} for a "
                                f"{size}-byte file", **ctx)
        skip = start
    try:
        data = _read_exactly(resp, length, skip)
        if len(data) == length and content_range is not None and announced is None:
            # Chunked 206: make sure the server does not send more than the range it announced.
            if _read_exactly(resp, 1):
                raise RangeMismatchError(f"{url}: body is longer than the {length} bytes of the range", **ctx)
    except (urllib3.exceptions.HTTPError, requests.exceptions.RequestException, OSError) as e:
        raise _Transient(HubShortReadError(f"{url}: connection lost reading bytes {start}-{end} "
                                   f"({type(e).__name__})", **ctx)) from None
    if len(data) != length:
        raise _Transient(HubShortReadError(f"{url}: expected {length} bytes (bytes {start}-{end}), got {len(data)}", **ctx))
    return data


def _read(listing: HubListing, path: str, start: int, length: int, headers: Mapping[str, str], timeout: float,
          retry: RetryPolicy) -> bytes:
    entry = listing.files.get(path)
    ctx: dict[str, Any] = {"hub": listing.hub, "repo": listing.repo, "revision": listing.revision, "path": path,
                           "endpoint": listing.endpoint}
    if entry is None:
        raise EntryNotFoundError("not in the listing", **ctx)
    if start < 0 or length < 0:
        raise ValueError(f"start and length must be >= 0 (got {start}, {length})")
    if start + length > entry.size:
        raise ValueError(f"{path}: bytes {start}..{start + length} run past the end of the "
                         f"{entry.size}-byte file")
    if length == 0:
        return b""
    end = start + length - 1
    url = file_url(listing, path)
    hdrs = dict(headers)
    hdrs["Range"] = f"bytes={start}-{end}"
    # Ranges address the stored bytes; a compressed representation would shift every offset.
    hdrs["Accept-Encoding"] = "identity"
    session = _http.session()
    last: HubError | None = None
    for attempt in range(1, retry.attempts + 1):
        retry_after: float | None = None
        try:
            resp, final_url = _http.get(session, url, hdrs, timeout, ctx)
        except requests.exceptions.ConnectionError as e:
            # requests raises with the PreparedRequest, whose url is a str; the url asked for otherwise.
            sent = e.request.url if e.request is not None else None
            target = sent if isinstance(sent, str) else url
            if _http.is_connect_failure(e):
                host = "{}://{}".format(*urlsplit(target)[:2])
                last = HubUnreachableError(f"cannot reach {host} ({_http.connection_reason(e)})", **ctx)
            else:
                last = HubError(f"{target}: connection lost before an answer ({_http.connection_reason(e)})", **ctx)
        except requests.exceptions.Timeout:
            last = HubError(f"{url}: timed out after {timeout} s", **ctx)
        except requests.exceptions.RequestException as e:  # a bad URL and the like: no retry helps
            raise HubError(f"{url}: {type(e).__name__}: {_http.one_line(str(e))[:200]}", **ctx) from None
        else:
            shown = _http.shown_url(url, final_url)
            with resp:
                status = resp.status_code
                if _http.retryable_status(status):
                    retry_after = _http.retry_after(resp)
                    last = HubError(f"{shown}: HTTP {status} after {attempt} attempt(s)", **ctx)
                elif _http.signed_url_refused(status, url, final_url):
                    retry_after = 0.0  # no back-off: the next try resolves a fresh signed URL
                    last = HubError(f"{shown}: HTTP 403 from the download host (signed URL refused, e.g. "
                                    f"expired) after {attempt} attempt(s)", **ctx)
                elif status not in (200, 206):
                    raise _http.status_error(resp, shown, ctx)
                else:
                    try:
                        return _body(resp, shown, start, end, entry.size, ctx)
                    except _Transient as t:
                        last = t.error
        if attempt < retry.attempts:
            retry.sleep(retry.delay(attempt, retry_after))
    assert last is not None
    raise last


def read_range(
    listing: HubListing,
    path: str,
    start: int,
    length: int,
    *,
    token: str | None = None,
    timeout: float = 30.0,
    retry: RetryPolicy | None = None,
) -> bytes:
    """Read ``length`` bytes at ``start`` of a listed file with one ranged GET (plus retries).

    ``Range: bytes=start-end`` is sent with ``Accept-Encoding: identity``.  Accepted answers: 206
    whose ``Content-Range`` is exactly the requested range; 200 with the same exact
    ``Content-Range`` (ModelScope); 200 without one (the server ignored ``Range``: the body starts
    at byte 0, so the first ``start`` bytes are discarded if ``start <= RANGE_SKIP_LIMIT``).
    Redirects are followed; ``Authorization`` and ``Cookie`` are dropped when one leaves the
    original origin.

    Args:
        listing (`HubListing`):
            The listing the file belongs to; the URL is pinned to its revision.
        path (`str`):
            Repo-relative path (must be in the listing).
        start (`int`):
            First byte.
        length (`int`):
            Number of bytes; ``start + length`` must not pass the listed size.
        token (`str`, *optional*):
            See :func:`auth_headers`.
        timeout (`float`, *optional*, defaults to 30):
            Connect and read timeout per request, in seconds.
        retry (`RetryPolicy`, *optional*):
            Defaults to :data:`DEFAULT_RETRY`.

    Returns:
        `bytes`: Exactly ``length`` bytes.

    Raises:
        RangeNotSupportedError: The server ignored ``Range`` and ``start`` is past the skip limit.
        RangeMismatchError: The server answered another range, size or encoding.
        HubShortReadError: The body stayed short after the retries.
        EntryNotFoundError, RepoNotFoundError, RevisionNotFoundError, HubAuthError: 404 / 401 / 403.
        HubUnreachableError: The endpoint cannot be connected to.
        HubError: 429/5xx after the retries, or another HTTP failure.
        ValueError: A negative or out-of-file range.
    """
    return _read(listing, path, start, length, auth_headers(listing, token), timeout, retry or DEFAULT_RETRY)


def fetch_header(
    listing: HubListing,
    path: str,
    *,
    token: str | None = None,
    timeout: float = 30.0,
    retry: RetryPolicy | None = None,
) -> HeaderColumns:
    """Read and validate a remote safetensors header: 8 bytes, then exactly the header.

    The length prefix is checked against :data:`k3ckpt.env.K3CKPT_MAX_HEADER_BYTES` and
    the listed file size *before* the header is requested, so a hostile prefix cannot make us
    download or allocate more than the limit.

    Args:
        listing (`HubListing`):
            The listing the shard belongs to.
        path (`str`):
            Repo-relative path of a ``.safetensors`` file.
        token (`str`, *optional*):
            See :func:`auth_headers`.
        timeout (`float`, *optional*, defaults to 30):
            Per-request timeout, in seconds.
        retry (`RetryPolicy`, *optional*):
            Defaults to :data:`DEFAULT_RETRY`.

    Returns:
        `HeaderColumns`: As :func:`k3ckpt.safetensors_header.parse_header_columns`, with
        ``file`` = the repo-relative path and ``path`` = ``"<hub>:<repo>@<revision>/<path>"``.

    Raises:
        SafetensorsHeaderError: A short file, an oversized or overrunning length prefix, or a
            malformed header.
        HubError: As :func:`read_range`.
    """
    return _parse(*_header_bytes(listing, path, auth_headers(listing, token), timeout, retry or DEFAULT_RETRY))


def _header_bytes(listing: HubListing, path: str, headers: Mapping[str, str], timeout: float,
                  policy: RetryPolicy) -> tuple[bytes, str, str, int]:
    """``(header JSON, path, label, file size)`` of a remote shard: :func:`fetch_header`'s reads
    and checks, all but the parse."""
    entry = listing.files.get(path)
    if entry is None:
        raise EntryNotFoundError("not in the listing", hub=listing.hub, repo=listing.repo, revision=listing.revision,
                            path=path, endpoint=listing.endpoint)
    label = f"{listing.hub}:{listing.repo}@{listing.revision}/{path}"
    size = entry.size
    if size < 8:
        raise SafetensorsHeaderError(label, f"file is {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", _read(listing, path, 0, 8, headers, timeout, policy))
    limit = K3CKPT_MAX_HEADER_BYTES.get()  # read at call time, as the local reader does
    if n > limit:
        raise SafetensorsHeaderError(label, f"header length {n} exceeds the {limit}-byte limit")
    if 8 + n > size:
        raise SafetensorsHeaderError(label, f"header length {n} runs past the end of the {size}-byte file (truncated?)")
    return _read(listing, path, 8, n, headers, timeout, policy), path, label, size


def _parse(raw: bytes, path: str, label: str, size: int) -> HeaderColumns:
    return parse_header_columns(raw, file=path, path=label, file_size=size)


def _parse_in_worker(raw: bytes, path: str, label: str, size: int) -> HeaderColumns:
    """:func:`_parse` in a forked worker, whose every allocation is acyclic (bulk_allocation)."""
    gc.disable()
    return _parse(raw, path, label, size)


def fetch_headers(
    listing: HubListing,
    paths: list[str],
    *,
    token: str | None = None,
    jobs: int = 8,
    timeout: float = 30.0,
    retry: RetryPolicy | None = None,
) -> list[HeaderColumns]:
    """:func:`fetch_header` of several shards, ``jobs`` at a time, in the order of ``paths``.

    Raises:
        SafetensorsHeaderError, HubError: As :func:`fetch_header`, for the first shard that fails.
    """
    got = fetch_headers_each(listing, paths, token=token, jobs=jobs, timeout=timeout, retry=retry)
    out = []
    for path in paths:
        one = got[path]
        if isinstance(one, K3ckptError):
            raise one
        out.append(one)
    return out


def fetch_headers_each(
    listing: HubListing,
    paths: list[str],
    *,
    token: str | None = None,
    jobs: int = 8,
    timeout: float = 30.0,
    retry: RetryPolicy | None = None,
) -> dict[str, HeaderColumns | K3ckptError]:
    """:func:`fetch_header` of each of ``paths``, ``jobs`` at a time: path -> its header, or the
    error it failed with (``SafetensorsHeaderError``, ``HubError``), the others read all the same.
    For a caller that learns only later which of the files it needs (:func:`read_source` reads
    the likely shards while the index that names them arrives)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    headers, policy = auth_headers(listing, token), retry or DEFAULT_RETRY
    # Parsing holds the interpreter lock (75 MB of JSON at K3's scale): with many shards it goes
    # to forked workers, forked here by a first job, before this call's threads start (a
    # caller's thread may run meanwhile: the children only parse, and touch none of its locks).
    workers = header_pool(len(paths))
    if workers is not None:
        workers.submit(int).result()

    def one(path: str) -> HeaderColumns | K3ckptError | Future[HeaderColumns]:
        try:
            got = _header_bytes(listing, path, headers, timeout, policy)
            return _parse(*got) if workers is None else workers.submit(_parse_in_worker, *got)
        except K3ckptError as e:
            return e

    def outcome(got: HeaderColumns | K3ckptError | Future[HeaderColumns]) -> HeaderColumns | K3ckptError:
        if not isinstance(got, Future):
            return got
        try:
            return got.result()
        except K3ckptError as e:  # raised in the worker, sent back as it was
            return e

    try:
        # the cyclic GC paused: each header parsed is ~3 containers per tensor, kept (bulk_allocation)
        with bulk_allocation(), ThreadPoolExecutor(max_workers=max(1, min(jobs, len(paths) or 1))) as ex:
            read = dict(zip(paths, ex.map(one, paths)))
            return {p: outcome(r) for p, r in read.items()}
    finally:
        if workers is not None:
            workers.shutdown(wait=True, cancel_futures=True)
