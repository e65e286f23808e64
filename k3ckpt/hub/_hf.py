"""The Hugging Face API: a repo's listing through ``huggingface_hub``, its errors mapped to ours.

``huggingface_hub.HfApi(endpoint=, token=).model_info(repo, revision=, files_metadata=True)``
answers ``sha`` (the commit the revision resolved to) and ``siblings``, a list of
``RepoSibling(rfilename, size, blob_id, lfs)`` where ``lfs`` is ``BlobLfsInfo(size, sha256,
pointer_size)`` for LFS files and ``None`` otherwise (then ``blob_id`` is the git blob sha1 of
the content).

Client quirk worked around (huggingface_hub 2.4): it keeps a 401 on a plain-``http://``
endpoint as a generic ``HfHubHTTPError`` (its repo-URL regex is anchored on ``https://``), so
401/403 are mapped by status, not only by exception class.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from .. import __version__
from ..errors import HubError, HubListingError, HubUnreachableError, RepoNotFoundError, RevisionNotFoundError
from . import _http
from ._endpoints import auth_headers
from ._listing import HEX40, HubFile, HubListing, add_file


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


def list_hf(repo: str, revision: str | None, endpoint: str, token: str | None) -> HubListing:
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
    if not HEX40.fullmatch(sha):
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
            add_file(files, ctx, sib.rfilename, sib.size, lfs_sha, None, sib.blob_id)
        else:
            add_file(files, ctx, sib.rfilename, sib.size, None, sib.blob_id, sib.blob_id)
    return HubListing(hub="hf", repo=repo, revision=sha, endpoint=endpoint, files=dict(sorted(files.items())))
