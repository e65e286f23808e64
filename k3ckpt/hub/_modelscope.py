"""The ModelScope API: a repo's listing through ``modelscope_hub``, pinned to a commit, its errors mapped to ours.

``modelscope_hub.HubApi`` (``modelscope`` 1.40 is a shim over it).
``list_repo_revisions(repo, "model")`` answers the tags and branches as dicts
``{Revision, CommitId, CreatedAt, Description}``; ``list_repo_files(repo, "model",
revision=, recursive=True)`` answers ``FileInfo(path, size, sha256, blob_id, type, lfs,
last_modified)`` (``type == "tree"`` for directories).  modelscope itself never pins a
download to a commit: it fetches by branch/tag name (``revision or "master"``).  We resolve
the name through the revision map and list (and later read) by ``CommitId``, so a listing and
the bytes read against it cannot come from two different pushes.

Client quirks worked around (modelscope 1.40 / modelscope_hub 0.5):

- ``modelscope_hub`` caches a process-wide default config (endpoint and token) on the first
  ``HubApi`` of the process; we build a fresh ``HubConfig`` per call instead, so a later
  ``MODELSCOPE_ENDPOINT`` is honoured.
- The ``modelscope`` shim's ``HubApi.get_model_files`` keeps only ``Path`` and ``Size``; the
  sha256 is only available from ``modelscope_hub.HubApi.list_repo_files``.
- ``modelscope_hub``'s API session retries connection errors 5 times with exponential backoff
  (about 15 s in total) before raising ``NetworkError``; that delay is the client's, not ours.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import requests

from ..errors import HubError, HubListingError, HubUnreachableError, RepoNotFoundError, RevisionNotFoundError
from . import _http
from ._listing import HubFile, HubListing, add_file

# What a ModelScope revision that is not a branch/tag name must look like to be tried as a commit
# id (git accepts abbreviations from 7 hex digits).
_COMMITISH = re.compile(r"[0-9a-fA-F]{7,64}")


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


def list_modelscope(repo: str, revision: str | None, endpoint: str, token: str | None) -> HubListing:
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
        add_file(files, ctx, info.path, info.size, info.sha256, None)
    return HubListing(hub="modelscope", repo=repo, revision=commit, endpoint=endpoint,
                      files=dict(sorted(files.items())))
