"""Where each hub is and what its own client sends: endpoint, file URL, identification and credentials.

Computed the way each hub's client computes them (``huggingface_hub``, ``modelscope_hub``), at
call time:

- ``huggingface_hub`` reads ``HF_ENDPOINT`` at import time; we resolve the endpoint per call
  (:func:`resolve_endpoint`) and always pass ``endpoint=`` explicitly.
- A file's URL (:func:`file_url`) is pinned to the listing's resolved commit, so a listing and
  the bytes read against it cannot come from two different pushes.
"""

from __future__ import annotations

import os
from urllib.parse import quote_plus

from .. import __version__
from ._listing import HubListing, check_hub

#: ``huggingface_hub``'s default endpoint (``constants._HF_DEFAULT_ENDPOINT``).
HF_DEFAULT_ENDPOINT = "https://huggingface.co"


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
    check_hub(hub)
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
    check_hub(listing.hub)
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
    if check_hub(hub) == "hf":
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
        hub, endpoint = check_hub(listing_or_hub), None
    check_hub(hub)
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
