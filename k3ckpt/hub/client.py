"""The client side of the model hubs (Hugging Face, ModelScope): listings and byte ranges, no bulk downloads.

Used by ``k3ckpt manifest pull``, ``k3ckpt verify --against hf|modelscope`` and ``k3ckpt fetch``.

Metadata comes from the *real* client libraries, so endpoint, token and error conventions are
theirs; bytes are read with plain ranged GETs, one reader for both hubs. This module is the
entry point (:func:`list_repo`, and every name below); the parts live in the package's private
modules:

- ``_listing``: :class:`HubFile`, :class:`HubListing` and the check of each listed entry,
  :class:`RetryPolicy`;
- ``_endpoints``: :func:`resolve_endpoint`, :func:`file_url`, :func:`auth_headers` - where a hub
  is and what its own client sends;
- ``_hf``: the Hugging Face listing (``huggingface_hub.HfApi.model_info``);
- ``_modelscope``: the ModelScope listing (``modelscope_hub.HubApi``), pinned to a commit;
- ``_ranges``: :func:`read_range`, :func:`fetch_header`, :func:`fetch_headers`, :func:`fetch_headers_each`;
- ``_concurrency``: :func:`default_requests` (light: ``plan`` and ``preflight`` use it).

Each part's docstring names the client quirks it works around (huggingface_hub 2.4,
modelscope 1.40 / modelscope_hub 0.5).
"""

from __future__ import annotations

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
    UnsafePathError,
)
from ..errors import SafetensorsHeaderError as SafetensorsHeaderError  # fetch_header raises it
from ._concurrency import default_requests as default_requests
from ._endpoints import HF_DEFAULT_ENDPOINT as HF_DEFAULT_ENDPOINT
from ._endpoints import auth_headers, file_url, resolve_endpoint
from ._endpoints import load_client as load_client
from ._hf import list_hf
from ._listing import DEFAULT_RETRY, HubFile, HubListing, RetryPolicy, check_hub
from ._listing import EMPTY_SHA256 as EMPTY_SHA256
from ._listing import HUBS as HUBS
from ._modelscope import list_modelscope
from ._ranges import RANGE_SKIP_LIMIT, fetch_header, fetch_headers, fetch_headers_each, read_range

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
    "default_requests",
    "fetch_header",
    "fetch_headers",
    "fetch_headers_each",
    "file_url",
    "list_repo",
    "read_range",
    "resolve_endpoint",
]


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
    check_hub(hub)
    ep = resolve_endpoint(hub, endpoint)
    if hub == "hf":
        return list_hf(repo, revision, ep, token)
    return list_modelscope(repo, revision, ep, token)
