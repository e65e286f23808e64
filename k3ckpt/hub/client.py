"""The client side of the model hubs (Hugging Face, ModelScope): listings and byte ranges, no bulk downloads.

Used by ``k3ckpt manifest pull``, ``k3ckpt verify --against hf|modelscope`` and ``k3ckpt fetch``.

Metadata comes from the *real* client libraries, so endpoint, token and error conventions are
theirs:

- Hugging Face: ``huggingface_hub.HfApi(endpoint=, token=).model_info(repo, revision=,
  files_metadata=True)`` answers ``sha`` (the commit the revision resolved to) and ``siblings``,
  a list of ``RepoSibling(rfilename, size, blob_id, lfs)`` where ``lfs`` is
  ``BlobLfsInfo(size, sha256, pointer_size)`` for LFS files and ``None`` otherwise (then
  ``blob_id`` is the git blob sha1 of the content).
- ModelScope: ``modelscope_hub.HubApi`` (``modelscope`` 1.40 is a shim over it).
  ``list_repo_revisions(repo, "model")`` answers the tags and branches as dicts
  ``{Revision, CommitId, CreatedAt, Description}``; ``list_repo_files(repo, "model",
  revision=, recursive=True)`` answers ``FileInfo(path, size, sha256, blob_id, type, lfs,
  last_modified)`` (``type == "tree"`` for directories).  modelscope itself never pins a
  download to a commit: it fetches by branch/tag name (``revision or "master"``).  We resolve
  the name through the revision map and list (and later read) by ``CommitId``, so a listing and
  the bytes read against it cannot come from two different pushes.

Bytes are read with plain ranged GETs (:func:`read_range`, :func:`fetch_header`).
``huggingface_hub`` can read ranges (``HfFileSystem`` files, ``HfApi.get_safetensors_metadata``
for headers) and ``modelscope_hub`` has no public ranged read; one reader serves both hubs with
the same rules: the URL pinned to the listed commit, credentials dropped on a redirect to another
origin, the answer's ``Content-Range`` checked against the request, a header's announced length
checked against the listed file size and ``K3CKPT_MAX_HEADER_BYTES`` before it is requested,
and one retry policy.

Client quirks this module works around (huggingface_hub 2.4, modelscope 1.40 / modelscope_hub 0.5):

- ``huggingface_hub`` reads ``HF_ENDPOINT`` at import time; we resolve the endpoint per call
  (:func:`resolve_endpoint`) and always pass ``endpoint=`` explicitly.
- ``modelscope_hub`` caches a process-wide default config (endpoint and token) on the first
  ``HubApi`` of the process; we build a fresh ``HubConfig`` per call instead, so a later
  ``MODELSCOPE_ENDPOINT`` is honoured.
- The ``modelscope`` shim's ``HubApi.get_model_files`` keeps only ``Path`` and ``Size``; the
  sha256 is only available from ``modelscope_hub.HubApi.list_repo_files``.
- ``modelscope_hub``'s API session retries connection errors 5 times with exponential backoff
  (about 15 s in total) before raising ``NetworkError``; that delay is the client's, not ours.
- ``huggingface_hub`` keeps a 401 on a plain-``http://`` endpoint as a generic
  ``HfHubHTTPError`` (its repo-URL regex is anchored on ``https://``), so 401/403 are mapped by
  status, not only by exception class.
- ModelScope has been seen answering a Range request with ``200`` and a correct
  ``Content-Range`` (modelscope_hub issue #50); :func:`read_range` accepts that only when the
  ``Content-Range`` matches the request exactly.
- ``requests`` would replace an ``Authorization`` header with ``~/.netrc`` credentials and keep
  cookies set by one hub for the next; our session disables both.
"""

from __future__ import annotations

import importlib
import os
import re
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any
from urllib.parse import quote_plus, urlsplit

import requests
import urllib3.exceptions

from .. import __version__
from ..env import K3CKPT_MAX_HEADER_BYTES
from ..errors import (
    EntryNotFoundError,
    HubAuthError,
    HubError,
    HubListingError,
    HubShortReadError,
    HubUnreachableError,
    RangeMismatchError,
    RangeNotSupportedError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SafetensorsHeaderError,
    UnsafePathError,
)
from ..format.header import HeaderColumns, parse_header_columns
from . import _dest, _http

__all__ = [
    "DEFAULT_RETRY",
    "EntryNotFoundError",
    "HubAuthError",
    "HubError",
    "HubFile",
    "HubListing",
    "HubListingError",
    "HubShortReadError",
    "HubUnreachableError",
    "RANGE_SKIP_LIMIT",
    "RangeMismatchError",
    "RangeNotSupportedError",
    "RepoNotFoundError",
    "RetryPolicy",
    "RevisionNotFoundError",
    "UnsafePathError",
    "auth_headers",
    "fetch_header",
    "fetch_headers",
    "file_url",
    "list_repo",
    "read_range",
    "resolve_endpoint",
]

#: The hubs understood by this module.
HUBS: tuple[str, ...] = ("hf", "modelscope")
#: ``huggingface_hub``'s default endpoint (``constants._HF_DEFAULT_ENDPOINT``).
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
#: When a server ignores ``Range`` and sends the whole file from byte 0, we read and discard up
#: to this many leading bytes to reach the requested offset; beyond it we refuse rather than
#: stream most of a multi-GB shard to read a few bytes.
RANGE_SKIP_LIMIT = 1 << 20
#: sha256 of zero bytes: a hub reporting it for a non-empty file is reporting a broken upload.
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

_HEX40 = re.compile(r"[0-9a-f]{40}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# What a ModelScope revision that is not a branch/tag name must look like to be tried as a commit
# id (git accepts abbreviations from 7 hex digits).
_COMMITISH = re.compile(r"[0-9a-fA-F]{7,64}")
_READ_CHUNK = 1 << 20


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------




# ----------------------------------------------------------------------------------------------
# Data model
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubFile:
    """One file of a hub listing.

    Attributes:
        path (`str`):
            Posix path relative to the repo root (validated: no absolute path, ``..``,
            backslash or NUL).
        size (`int`):
            Size in bytes.
        sha256 (`str`, *optional*):
            Lowercase hex sha256 of the content: known for LFS files on Hugging Face
            (``lfs.sha256``) and for every file on ModelScope (``Sha256``).
        git_sha1 (`str`, *optional*):
            Hugging Face blob id of a non-LFS file (sha1 of ``b"blob <size>\\0" + content``),
            else ``None``.
        blob_id (`str`, *optional*):
            Hugging Face git blob id of the repo entry (for an LFS file: of its pointer file), as
            the ``blobId``/``oid`` of the listing; what ``huggingface_hub``'s tree cache records
            (``fetch --cache-dir`` writes it). ``None`` on ModelScope.
    """

    path: str
    size: int
    sha256: str | None
    git_sha1: str | None
    blob_id: str | None = None


@dataclass(frozen=True)
class HubListing:
    """A repo's files at one resolved revision.

    Attributes:
        hub (`str`):
            ``"hf"`` or ``"modelscope"``.
        repo (`str`):
            Repo id, ``owner/name``.
        revision (`str`):
            The resolved commit: 40-hex ``sha`` on Hugging Face; on ModelScope the ``CommitId``
            its revision map reports for the branch/tag (or the requested name when the server
            reports no commit id).  Every URL built from the listing is pinned to it.
        endpoint (`str`):
            The endpoint the listing came from (scheme + host, no trailing slash).
        files (`dict[str, HubFile]`):
            Repo-relative path -> file, sorted by path.
    """

    hub: str
    repo: str
    revision: str
    endpoint: str
    files: dict[str, HubFile] = field(default_factory=dict)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retry with exponential backoff for :func:`read_range`.

    Retried: connection errors and timeouts, bodies cut short, 429 and 5xx (except 501/505).
    A ``Retry-After`` header (seconds or HTTP date) replaces the backoff, capped at
    ``max_retry_after``.  No jitter, so a test sees exactly which delays were slept.

    Attributes:
        attempts (`int`):
            Total tries, the first one included.
        backoff (`float`):
            Delay after the first failure; doubled after each further one.
        max_backoff (`float`):
            Cap on the computed backoff.
        max_retry_after (`float`):
            Cap on a server's ``Retry-After``.
        sleep (`Callable[[float], None]`):
            How to wait (tests pass a recorder).
    """

    attempts: int = 4
    backoff: float = 0.5
    max_backoff: float = 8.0
    max_retry_after: float = 30.0
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")
        if min(self.backoff, self.max_backoff, self.max_retry_after) < 0:
            raise ValueError("delays must be >= 0")

    def delay(self, failures: int, retry_after: float | None = None) -> float:
        """Seconds to wait after the ``failures``-th failed try (1-based)."""
        if retry_after is not None:
            return min(max(0.0, retry_after), self.max_retry_after)
        return min(self.backoff * (2 ** (failures - 1)), self.max_backoff)


#: The policy used when none is given.
DEFAULT_RETRY = RetryPolicy()


# ----------------------------------------------------------------------------------------------
# Endpoints, URLs, headers
# ----------------------------------------------------------------------------------------------


def _check_hub(hub: str) -> str:
    if hub not in HUBS:
        raise ValueError(f"unknown hub {hub!r}; expected one of {', '.join(HUBS)}")
    return hub


def resolve_endpoint(hub: str, endpoint: str | None = None) -> str:
    """The endpoint a hub's client would talk to, resolved now (not at import time).

    Args:
        hub (`str`):
            ``"hf"`` or ``"modelscope"``.
        endpoint (`str`, *optional*):
            An explicit endpoint; wins over the environment.

    Returns:
        `str`: The endpoint without a trailing slash.  Hugging Face: ``endpoint`` >
        ``HF_ENDPOINT`` > ``https://huggingface.co``.  ModelScope: ``endpoint`` >
        ``MODELSCOPE_ENDPOINT`` > ``MODELSCOPE_DOMAIN`` > ``https://modelscope.cn`` (the default
        of ``modelscope_hub``), with ``https://`` added to a value without a scheme, exactly as
        ``modelscope_hub.config.HubConfig`` does (that is what computes it).
    """
    _check_hub(hub)
    if hub == "hf":
        # huggingface_hub.constants.ENDPOINT is frozen at import; read the variable per call.
        value = endpoint or os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT
        return value.strip().rstrip("/")
    from modelscope_hub.config import HubConfig

    # HubConfig implements the precedence and the scheme rules (MODELSCOPE_DOMAIN without a
    # scheme gets https://, with a FutureWarning); token="" keeps it from reading saved cookies.
    resolved = HubConfig(endpoint=endpoint or None, token="").endpoint
    assert resolved is not None  # typed Optional for its "not given" default; __post_init__ always sets a str
    return resolved


def file_url(listing: HubListing, path: str) -> str:
    """The URL of a file's bytes, pinned to ``listing.revision``.

    Args:
        listing (`HubListing`):
            The listing the file belongs to.
        path (`str`):
            Repo-relative path.

    Returns:
        `str`: Hugging Face: ``{endpoint}/{repo}/resolve/{commit}/{path}`` (built by
        ``huggingface_hub.hf_hub_url``).  ModelScope:
        ``{endpoint}/api/v1/models/{repo}/repo?Revision={commit}&FilePath={path}``.
    """
    _check_hub(listing.hub)
    if listing.hub == "hf":
        from huggingface_hub import hf_hub_url

        return hf_hub_url(listing.repo, path, revision=listing.revision, endpoint=listing.endpoint)
    # Same pattern and quoting as modelscope_hub's LegacyClient.get_download_url, which needs a
    # client (and so a config, a user agent and a session file) just to format a string.
    return (
        f"{listing.endpoint}/api/v1/models/{listing.repo}/repo"
        f"?Revision={quote_plus(listing.revision)}&FilePath={quote_plus(path)}"
    )


def load_client(hub: str) -> None:
    """Import, in the calling thread, what :func:`file_url` needs from the hub's client. Call it
    before starting download workers: ``huggingface_hub`` imports ``file_download`` (and with it
    ``subprocess``) on the first ``hf_hub_url``, and a worker doing that import while the
    open-files limit is reached failed with an ImportError that named no limit."""
    if _check_hub(hub) == "hf":
        from huggingface_hub import hf_hub_url  # noqa: F401  (the import is the point)


def auth_headers(listing_or_hub: HubListing | str, token: str | None = None) -> dict[str, str]:
    """The identification and credential headers the hub's own client would send.

    Args:
        listing_or_hub (`HubListing` or `str`):
            A listing, or a hub name (``"hf"`` / ``"modelscope"``).
        token (`str`, *optional*):
            An explicit token.  ``None`` lets the client decide (Hugging Face: ``HF_TOKEN``,
            then the saved login, unless ``HF_HUB_DISABLE_IMPLICIT_TOKEN``; ModelScope:
            ``MODELSCOPE_API_TOKEN``, then the saved ``m_session_id`` cookie).  ``""`` sends none.

    Returns:
        `dict[str, str]`: Hugging Face: ``huggingface_hub.utils.build_hf_headers`` (``user-agent``
        and, with a token, ``authorization: Bearer``).  ModelScope: ``User-Agent`` and, with a
        token, both ``Authorization: Bearer <token>`` and the ``m_session_id=<token>`` cookie, as
        ``modelscope_hub``'s legacy client sends both on every request.
    """
    if isinstance(listing_or_hub, HubListing):
        hub, endpoint = listing_or_hub.hub, listing_or_hub.endpoint
    else:
        hub, endpoint = _check_hub(listing_or_hub), None
    _check_hub(hub)
    if hub == "hf":
        from huggingface_hub.utils import build_hf_headers

        # "" would become "authorization: Bearer " in build_hf_headers; False means "no token".
        return dict(build_hf_headers(token=False if token == "" else token, library_name="k3ckpt",
                                     library_version=__version__))
    from modelscope_hub.config import HubConfig
    from modelscope_hub.utils import build_user_agent

    config = HubConfig(endpoint=endpoint or resolve_endpoint("modelscope"), token=token)
    headers = {"User-Agent": build_user_agent(config=config, extra={"k3ckpt": __version__})}
    if config.token:
        headers["Authorization"] = f"Bearer {config.token}"
        headers["Cookie"] = f"m_session_id={config.token}"
    return headers


# ----------------------------------------------------------------------------------------------
# Listings
# ----------------------------------------------------------------------------------------------


def _hex_or_none(value: Any, pattern: re.Pattern[str], what: str, ctx: dict[str, Any], path: str) -> str | None:
    if value is None or value == "":
        return None
    text = str(value).lower()
    if not pattern.fullmatch(text):
        raise HubListingError(f"malformed {what} {value!r} in the listing", path=path, **ctx)
    return text


def _add_file(files: dict[str, HubFile], ctx: dict[str, Any], path: Any, size: Any, sha256: Any,
              git_sha1: Any, blob_id: Any = None) -> None:
    """Validate one listing entry and add it to ``files``."""
    reason = _dest.unsafe_reason(path)
    if reason is not None:
        raise UnsafePathError(f"refusing the path {path!r} from the listing: it {reason}", **ctx)
    if path in files:
        raise HubListingError("listed twice", path=path, **ctx)
    if type(size) is not int or size < 0:
        raise HubListingError(f"no usable size in the listing (got {size!r})", path=path, **ctx)
    sha = _hex_or_none(sha256, _HEX64, "sha256", ctx, path)
    if sha == EMPTY_SHA256 and size > 0:
        raise HubListingError(f"the hub reports the sha256 of empty content for a {size}-byte file "
                              "(a broken upload?)", path=path, **ctx)
    files[path] = HubFile(path=path, size=size, sha256=sha, git_sha1=_hex_or_none(git_sha1, _HEX40, "git blob id",
                                                                                 ctx, path),
                          blob_id=_hex_or_none(blob_id, _HEX40, "git blob id", ctx, path))


def _sends_token(hub: str, token: str | None) -> bool:
    """Whether requests to ``hub`` carry a token (``token``, else what the client finds: the
    environment or a saved login), for what a 401/403 tells to do."""
    return "authorization" in {k.lower() for k in auth_headers(hub, token)}


def _status(e: Any) -> int | None:
    """The HTTP status of a huggingface_hub error."""
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _hf_http_package(hf_errors: ModuleType) -> ModuleType:
    """The HTTP package whose transport errors ``HfApi`` raises: httpx (huggingface_hub 1.x) or httpx2 (2.x).

    Taken from the base class of huggingface_hub's own ``HfHubHTTPError`` rather than imported by
    name: the package is huggingface_hub's dependency, not ours, and changes with its major version.
    """
    return importlib.import_module(hf_errors.HTTPError.__module__.partition(".")[0])


def _list_hf(repo: str, revision: str | None, endpoint: str, token: str | None) -> HubListing:
    import huggingface_hub
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import errors as hf_errors

    httpx = _hf_http_package(hf_errors)
    rev = revision or hf_constants.DEFAULT_REVISION  # "main", as hf_hub_download/snapshot_download
    ctx: dict[str, Any] = {"hub": "hf", "repo": repo, "revision": rev, "endpoint": endpoint}
    api = huggingface_hub.HfApi(endpoint=endpoint, token=False if token == "" else token,
                                library_name="k3ckpt", library_version=__version__)
    try:
        info = api.model_info(repo, revision=rev, files_metadata=True)
    except hf_errors.GatedRepoError as e:
        raise _http.auth_error(_status(e), ctx, token_sent=_sends_token("hf", token),
                               problem="gated repo: accept its terms on the hub, then use a token of that account",
                               detail=e.server_message or "") from None
    except hf_errors.RepositoryNotFoundError:
        raise RepoNotFoundError("repository not found (or private and not visible with these credentials)",
                           **ctx) from None
    except hf_errors.RevisionNotFoundError:
        raise RevisionNotFoundError("revision not found", **ctx) from None
    except hf_errors.HfHubHTTPError as e:
        status = _status(e)
        detail = e.server_message or _http.one_line(str(e)).split(" for url")[0]
        if status in (401, 403):
            raise _http.auth_error(status, ctx, token_sent=_sends_token("hf", token),
                                   detail=e.server_message or "") from None
        raise HubError(f"HTTP {status} from {endpoint}: {detail}", **ctx) from None
    except hf_errors.OfflineModeIsEnabled:
        raise HubError("HF_HUB_OFFLINE is set: cannot list the repo", **ctx) from None
    except hf_errors.HFValidationError as e:
        raise HubError(f"invalid repo id or revision ({e})", **ctx) from None
    except httpx.ConnectError as e:
        raise HubUnreachableError(f"cannot reach {endpoint} ({_http.connection_reason(e)})", **ctx) from None
    except httpx.TimeoutException as e:
        raise HubError(f"timed out talking to {endpoint} ({type(e).__name__})", **ctx) from None
    except httpx.TransportError as e:
        raise HubError(f"network error talking to {endpoint} ({_http.one_line(str(e)) or type(e).__name__})",
                       **ctx) from None
    except ValueError as e:  # a body that is not the JSON model_info expects
        raise HubListingError(f"unexpected model_info answer from {endpoint} ({e})", **ctx) from None

    sha = str(info.sha or "").lower()
    if not _HEX40.fullmatch(sha):
        raise HubListingError(f"model_info reported no commit sha (got {info.sha!r})", **ctx)
    files: dict[str, HubFile] = {}
    for sib in info.siblings or []:
        lfs = sib.lfs
        if lfs is not None:
            lfs_sha, lfs_size = lfs.get("sha256"), lfs.get("size")
            if lfs_size is not None and sib.size is not None and lfs_size != sib.size:
                raise HubListingError(f"size {sib.size} disagrees with its LFS size {lfs_size}", path=sib.rfilename,
                                      **ctx)
            if not lfs_sha:
                raise HubListingError("LFS file without a sha256", path=sib.rfilename, **ctx)
            _add_file(files, ctx, sib.rfilename, sib.size, lfs_sha, None, sib.blob_id)
        else:
            _add_file(files, ctx, sib.rfilename, sib.size, None, sib.blob_id, sib.blob_id)
    return HubListing(hub="hf", repo=repo, revision=sha, endpoint=endpoint, files=dict(sorted(files.items())))


def _ms_error(exc: BaseException, ctx: dict[str, Any], not_found: type[HubError], what: str, *,
              token_sent: bool) -> HubError:
    """Map a modelscope_hub exception raised while ``what`` to one of ours (``token_sent``: whether
    the request carried a token, for what a 401/403 tells to do)."""
    from modelscope_hub import errors as ms_errors

    endpoint = ctx["endpoint"]
    detail = _http.one_line(getattr(exc, "message", None) or str(exc))
    if isinstance(exc, ms_errors.NotExistError):
        return not_found(f"{what}: not found ({detail})", **ctx)
    if isinstance(exc, (ms_errors.AuthenticationError, ms_errors.PermissionDeniedError)):
        return _http.auth_error(getattr(exc, "status_code", None), ctx, token_sent=token_sent, detail=detail)
    if isinstance(exc, ms_errors.RequestTimeoutError):
        return HubError(f"{what}: timed out talking to {endpoint}", **ctx)
    if isinstance(exc, ms_errors.NetworkError):
        if _http.is_connect_failure(exc):
            return HubUnreachableError(f"cannot reach {endpoint} ({_http.connection_reason(exc)})", **ctx)
        return HubError(f"{what}: network error talking to {endpoint} ({detail[:200]})", **ctx)
    if isinstance(exc, ms_errors.APIError):
        return HubError(f"{what}: HTTP {getattr(exc, 'status_code', '?')} from {endpoint} ({detail[:200]})", **ctx)
    return HubError(f"{what}: {type(exc).__name__}: {detail[:200]}", **ctx)


def _list_modelscope(repo: str, revision: str | None, endpoint: str, token: str | None) -> HubListing:
    from modelscope_hub import HubApi
    from modelscope_hub import errors as ms_errors
    from modelscope_hub.config import HubConfig

    rev = revision or "master"  # modelscope_hub's default for downloads and listings
    ctx: dict[str, Any] = {"hub": "modelscope", "repo": repo, "revision": rev, "endpoint": endpoint}
    # A fresh config: the process-wide default one freezes the endpoint/token of the first HubApi.
    config = HubConfig(endpoint=endpoint, token=token)
    api = HubApi(config=config)
    try:
        revisions = api.list_repo_revisions(repo, "model")
    except ms_errors.HubError as e:
        raise _ms_error(e, ctx, RepoNotFoundError, "listing revisions", token_sent=bool(config.token)) from None
    except (requests.RequestException, ValueError, TypeError, AttributeError) as e:
        raise HubListingError(f"unexpected revisions answer from {endpoint} ({type(e).__name__}: {e})",
                              **ctx) from None

    commit: str | None = None
    for entry in revisions if isinstance(revisions, list) else []:
        if isinstance(entry, Mapping) and entry.get("Revision") == rev:
            commit = str(entry.get("CommitId") or rev)
            break
    if commit is None:
        if not _COMMITISH.fullmatch(rev):
            names = sorted(str(e.get("Revision")) for e in revisions if isinstance(e, Mapping))
            raise RevisionNotFoundError(f"no branch or tag of that name (have: {', '.join(names) or 'none'})", **ctx)
        commit = rev  # looks like a commit id: the file listing below accepts or refuses it
    ctx["revision"] = commit
    try:
        infos = api.list_repo_files(repo, "model", revision=commit, recursive=True)
    except ms_errors.HubError as e:
        raise _ms_error(e, ctx, RevisionNotFoundError, "listing files", token_sent=bool(config.token)) from None
    except (requests.RequestException, ValueError, TypeError, AttributeError) as e:
        raise HubListingError(f"unexpected file listing from {endpoint} ({type(e).__name__}: {e})",
                              **ctx) from None
    # repo/files silently truncates; modelscope_hub walks the tree per directory to recover and
    # only logs a warning when it could not. A truncated listing would make `verify` miss files.
    if getattr(getattr(api.legacy, "_read_state", None), "listing_incomplete", False):
        raise HubListingError("the hub's file listing is incomplete (truncated by the server)", **ctx)

    files: dict[str, HubFile] = {}
    for info in infos:
        if info.type == "tree":
            continue
        _add_file(files, ctx, info.path, info.size, info.sha256, None)
    return HubListing(hub="modelscope", repo=repo, revision=commit, endpoint=endpoint,
                      files=dict(sorted(files.items())))


def list_repo(
    hub: str,
    repo: str,
    revision: str | None = None,
    *,
    endpoint: str | None = None,
    token: str | None = None,
) -> HubListing:
    """List a model repo's files with sizes and hashes, at the commit ``revision`` resolves to.

    Args:
        hub (`str`):
            ``"hf"`` or ``"modelscope"``.
        repo (`str`):
            Repo id, ``owner/name``.
        revision (`str`, *optional*):
            Branch, tag or commit.  Defaults to what the hub's client downloads by default:
            ``main`` (Hugging Face), ``master`` (ModelScope).
        endpoint (`str`, *optional*):
            See :func:`resolve_endpoint`.
        token (`str`, *optional*):
            See :func:`auth_headers`; ``None`` lets the client find one.

    Returns:
        `HubListing`: Files keyed by path; ``revision`` is the resolved commit.

    Raises:
        RepoNotFoundError: The repo does not exist (or is not visible).
        RevisionNotFoundError: The revision does not exist.
        HubAuthError: Credentials refused or required.
        HubUnreachableError: The endpoint cannot be connected to.
        UnsafePathError: A listed path is absolute or contains ``..``, a backslash or NUL.
        HubListingError: The listing is otherwise unusable.
        HubError: Any other hub or network failure.
    """
    _check_hub(hub)
    ep = resolve_endpoint(hub, endpoint)
    if hub == "hf":
        return _list_hf(repo, revision, ep, token)
    return _list_modelscope(repo, revision, ep, token)


# ----------------------------------------------------------------------------------------------
# Byte ranges
# ----------------------------------------------------------------------------------------------


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
    entry = listing.files.get(path)
    if entry is None:
        raise EntryNotFoundError("not in the listing", hub=listing.hub, repo=listing.repo, revision=listing.revision,
                            path=path, endpoint=listing.endpoint)
    label = f"{listing.hub}:{listing.repo}@{listing.revision}/{path}"
    size = entry.size
    if size < 8:
        raise SafetensorsHeaderError(label, f"file is {size} bytes, too short for a safetensors header")
    headers = auth_headers(listing, token)
    policy = retry or DEFAULT_RETRY
    (n,) = struct.unpack("<Q", _read(listing, path, 0, 8, headers, timeout, policy))
    limit = K3CKPT_MAX_HEADER_BYTES.get()  # read at call time, as the local reader does
    if n > limit:
        raise SafetensorsHeaderError(label, f"header length {n} exceeds the {limit}-byte limit")
    if 8 + n > size:
        raise SafetensorsHeaderError(label, f"header length {n} runs past the end of the {size}-byte file (truncated?)")
    raw = _read(listing, path, 8, n, headers, timeout, policy)
    return parse_header_columns(raw, file=path, path=label, file_size=size)


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
    from concurrent.futures import ThreadPoolExecutor

    def one(path: str) -> HeaderColumns:
        return fetch_header(listing, path, token=token, timeout=timeout, retry=retry)

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(paths) or 1))) as ex:
        return list(ex.map(one, paths))
