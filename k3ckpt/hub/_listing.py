"""The data model every hub module shares: a listing and its files, the hubs, the retry policy.

A :class:`HubListing` is a repo's files (:class:`HubFile`: path, size, sha256 or git blob id)
at one resolved commit; both hubs' listings (:mod:`k3ckpt.hub._hf`, :mod:`k3ckpt.hub._modelscope`)
are built through :func:`add_file`, which refuses an unsafe path, a file listed twice, a
missing size and a malformed digest before any name reaches the disk. :class:`RetryPolicy` is
the bounded backoff of every request to a hub.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import HubListingError, UnsafePathError
from ..format.filedigest import SHA256_HEX
from . import _dest

#: The hubs understood by the client.
HUBS: tuple[str, ...] = ("hf", "modelscope")
#: sha256 of zero bytes: a hub reporting it for a non-empty file is reporting a broken upload.
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

HEX40 = re.compile(r"[0-9a-f]{40}")


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


def check_hub(hub: str) -> str:
    if hub not in HUBS:
        raise ValueError(f"unknown hub {hub!r}; expected one of {', '.join(HUBS)}")
    return hub


def _hex_or_none(value: Any, pattern: re.Pattern[str], what: str, ctx: dict[str, Any], path: str) -> str | None:
    if value is None or value == "":
        return None
    text = str(value).lower()
    if not pattern.fullmatch(text):
        raise HubListingError(f"malformed {what} {value!r} in the listing", path=path, **ctx)
    return text


def add_file(files: dict[str, HubFile], ctx: dict[str, Any], path: Any, size: Any, sha256: Any,
             git_sha1: Any, blob_id: Any = None) -> None:
    """Validate one listing entry and add it to ``files``."""
    reason = _dest.unsafe_reason(path)
    if reason is not None:
        raise UnsafePathError(f"refusing the path {path!r} from the listing: it {reason}", **ctx)
    if path in files:
        raise HubListingError("listed twice", path=path, **ctx)
    if type(size) is not int or size < 0:
        raise HubListingError(f"no usable size in the listing (got {size!r})", path=path, **ctx)
    sha = _hex_or_none(sha256, SHA256_HEX, "sha256", ctx, path)
    if sha == EMPTY_SHA256 and size > 0:
        raise HubListingError(f"the hub reports the sha256 of empty content for a {size}-byte file "
                              "(a broken upload?)", path=path, **ctx)
    files[path] = HubFile(path=path, size=size, sha256=sha, git_sha1=_hex_or_none(git_sha1, HEX40, "git blob id",
                                                                                 ctx, path),
                          blob_id=_hex_or_none(blob_id, HEX40, "git blob id", ctx, path))
