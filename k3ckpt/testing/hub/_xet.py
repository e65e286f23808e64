"""Xet mode: what a Xet-backed ``resolve`` answers, and the bridge host that serves the bytes.

``LoopbackHub(..., xet=True)`` (or ``RepoSpec(xet=True)`` per repo; ``--xet`` on the command
line) presents a repo as Xet-backed, the way huggingface.co answers for one (checked against
huggingface_hub 2.4's ``get_hf_file_metadata`` / ``parse_xet_file_data_from_response`` /
``RepoFile`` and public captures of the real headers).  For its LFS files:

- tree and paths-info entries carry ``xetHash`` (64 hex digits; a stand-in derived from the
  sha256, see :attr:`FileEntry.xet_hash`);
- ``HEAD|GET .../resolve/...`` answers 302 with ``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``
  (sha256), ``X-Linked-Size``, ``X-Xet-Hash``, ``Link: <.../xet-read-token/{commit}>;
  rel="xet-auth", <bridge/v1/reconstructions/{hash}>; rel="xet-reconstruction-info"`` and
  ``Location: http://127.0.0.1:<bridge port>/xet-bridge-us/<repo _id>/<xet hash>?...&Expires=T
  &Signature=S``: a URL signed (HMAC, secret per hub) and valid for ``xet_url_ttl`` seconds
  (default :data:`XET_URL_TTL`, an hour, as the real ones);
- the bridge is a second listening socket (same address, another port: another origin, so a
  client must not send the hub's credentials there).  It serves the file with the usual Range
  support, and answers 403 ``AccessDenied`` (S3-style XML) to an expired or forged URL, 404 to an
  unknown object, and 400 to any request carrying an ``Authorization`` or ``Cookie`` header,
  which its log records (``hub.bridge_log``, ``RequestRecord.credentials`` / ``server``).  The
  hub's ``token`` is not required there: the signature is the credential.
- File faults (``status``, ``drop_after``, ``corrupt_byte``, hostile kinds...) apply where the
  bytes are served, at the bridge, and so does ``expired_url``; the counters count bridge
  requests and bytes.  ModelScope endpoints are unchanged (ModelScope has no Xet).

``huggingface_hub`` with ``HF_HUB_DISABLE_XET=1`` (which :meth:`LoopbackHub.client_env` exports)
takes the HTTP path: it reads the metadata from the 302 itself, then GETs ``resolve`` again and
follows the redirect (httpx drops ``Authorization`` on the cross-origin hop).  With Xet enabled
and ``hf_xet`` installed it would call the xet-read-token route and fail on the 501.

The signed URLs are minted and checked by the hub (:meth:`LoopbackHub.signed_bridge_url`,
:meth:`LoopbackHub.check_signature`, :meth:`LoopbackHub.bridge_object`), which holds the secret.
"""

from __future__ import annotations

from ._bodies import FileBodies, parse_range
from ._repo import FileEntry, RepoSnapshot

#: Lifetime of the signed bridge URLs a Xet-backed ``resolve`` redirects to (the real hub's
#: are valid for an hour).
XET_URL_TTL = 3600.0


class XetBridge(FileBodies):
    """The Xet-backed ``resolve`` answer and the bridge host's route."""

    def _xet_redirect(self, snap: RepoSnapshot, entry: FileEntry, commit: str, headers: dict[str, str]) -> None:
        """Answer a Xet-backed ``resolve`` as the real hub does: 302 to a signed bridge URL,
        with the file's metadata (``X-Xet-Hash``, ``X-Linked-*``) on the redirect itself."""
        hub = self.server.hub
        location = hub.signed_bridge_url(snap.repo_id, entry)
        token_url = f"{self._base_url()}/api/models/{snap.repo_id}/xet-read-token/{commit}"
        headers.update({
            "X-Xet-Hash": entry.xet_hash,
            "Link": f'<{token_url}>; rel="xet-auth", '
                    f'<{hub.bridge_url}/v1/reconstructions/{entry.xet_hash}>; rel="xet-reconstruction-info"',
            "Location": location,
            "Accept-Ranges": "bytes",
            "Cache-Control": "no-cache",
            "Content-Length": "0",
        })
        self._send_head(302, headers)

    def _handle_bridge(self, raw_path: str) -> None:
        """Serve a signed bridge URL (``/xet-bridge-us/<repo key>/<xet hash>?...``)."""
        self._route = "xet.bridge"
        hub = self.server.hub
        if self._method not in ("GET", "HEAD"):
            self._bridge_error(405, "MethodNotAllowed", "The specified method is not allowed against this resource.")
            return
        if self._carries_credentials():
            # What S3 says to a request that is authenticated twice; the point here is that a
            # client sent the hub's credentials to another host, which the log now shows.
            self._bridge_error(400, "InvalidArgument", "Only one auth mechanism allowed; only the signed URL "
                                                       "or the Authorization header should be specified")
            return
        found = hub.bridge_object(raw_path)
        if found is None:
            self._bridge_error(404, "NoSuchKey", "The specified key does not exist.")
            return
        snap, entry = found
        self._repo, self._file = snap.repo_id, entry.path
        problem = hub.check_signature(self.path)
        parsed = parse_range(self.headers.get("Range"), entry.size)
        first = parsed[0] if isinstance(parsed, tuple) else 0
        if problem is None and hub.faults.take("file", snap.repo_id, entry.path, self._method,
                                               lambda f: f.kind == "expired_url" and first >= f.offset):
            problem = "Request has expired"
        if problem is not None:
            self._bridge_error(403, "AccessDenied", problem)
            return
        disposition = self._query.get("response-content-disposition")
        headers = {"ETag": f'"{entry.xet_hash}"'}
        if disposition:
            headers["Content-Disposition"] = disposition
        self._serve_file(snap, entry, headers, ms=False)

    def _bridge_error(self, status: int, code: str, message: str) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message></Error>").encode()
        self._send_head(status, {"Content-Type": "application/xml", "Content-Length": str(len(body))})
        if self._method != "HEAD":
            self.wfile.write(body)
