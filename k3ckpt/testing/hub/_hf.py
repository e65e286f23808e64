"""The Hugging Face routes: the metadata API and ``resolve``, as huggingface_hub 2.4 calls them.

- ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{rev}[?blobs=true]``
  (``model_info`` / ``repo_info`` / ``snapshot_download`` for a non-sha revision);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=[&cursor=]`` paginated with
  ``Link: <...>; rel="next"`` (``list_repo_tree``, ``snapshot_download``, ``hf cache verify``,
  ``HfFileSystem.ls``);
- ``POST /api/models/{repo}/paths-info/{rev}`` (form-encoded ``paths=..&expand=..`` as the
  client sends it, JSON also accepted) (``get_paths_info``, ``HfFileSystem.info``);
- ``GET /api/models/{repo}/refs`` (``list_repo_refs``);
- ``HEAD|GET /{repo}/resolve/{rev}/{path}`` (``hf_hub_download``: HEAD for ``X-Repo-Commit``,
  ``ETag``, ``X-Linked-Etag``, ``X-Linked-Size``, then GET; ``HfFileSystem`` ranged GETs); in
  Xet mode a 302 to the bridge host for LFS files (see ``_xet``);
- ``GET /api/models/{repo}/xet-read-token/{rev}`` (where a client with Xet enabled goes next):
  501, the CAS protocol is not emulated.
- 404s carry ``X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound`` (mapped by the
  client to ``RepositoryNotFoundError`` / ``RevisionNotFoundError`` /
  ``RemoteEntryNotFoundError``); datasets/spaces are answered ``RepoNotFound``.

Client quirks found while building this (huggingface_hub 2.4.0)
---------------------------------------------------------------
- ``huggingface_hub.constants.ENDPOINT`` is read from ``HF_ENDPOINT`` at import time, and so
  are ``HF_HUB_DISABLE_XET``, ``HF_HUB_OFFLINE`` and ``HF_HUB_DISABLE_PROGRESS_BARS``.
  In-process, pass ``endpoint=hub.url`` to ``snapshot_download``, ``hf_hub_download``,
  ``HfApi(endpoint=...)`` and ``HfFileSystem(endpoint=..., skip_instance_cache=True)``;
  ``hf_hub_url`` rewrites the default endpoint prefix into the given one, so nothing else
  leaks to huggingface.co.  For the ``hf`` CLI (which has no ``--endpoint`` flag for
  ``cache verify``) run a subprocess with ``env=hub.client_env()``.
- Outside Xet mode the emulator never sends ``X-Xet-Hash`` / ``xetHash``, so the client takes
  the plain HTTP path; ``HF_HUB_DISABLE_XET=1`` is exported by :meth:`LoopbackHub.client_env`
  for Xet mode's sake.
- ``hf_hub_download`` refuses a HEAD answer without ``X-Repo-Commit`` or ETag
  (``FileMetadataError``), and prefers ``X-Linked-Etag``/``X-Linked-Size`` over ``ETag``/
  ``Content-Length``; the ETag names the cache blob, so it must be the sha256 for LFS files and
  the git oid otherwise, or ``hf cache verify`` disagrees with the blob names.
- ``RepoFile`` requires ``lfs.pointerSize`` and ``oid`` on every tree entry; ``RepoFolder``
  requires ``oid``; ``paths-info`` is sent form-encoded with repeated ``paths`` keys and
  ``expand=false``.
- ``http_get`` reads the body in ``constants.DOWNLOAD_CHUNK_SIZE`` (10 MiB) pieces and only
  whole pieces count towards the resume offset: a body cut short after less than 10 MiB is
  re-fetched from byte 0 without a ``Range`` header.
- When a body ends early with a FIN (``short_body``, ``drop_after`` with ``reset=False``)
  ``http_get`` gets ``RemoteProtocolError``, sleeps 1 s and resumes with ``Range: bytes=N-``
  (a 200 answer makes it truncate and restart).  A connection *reset* mid-body
  (``drop_after``) surfaces as ``httpx2.ReadError``, which ``http_get`` does not retry: the
  download fails.
- ``hf_raise_for_status`` turns a 401 into ``RepositoryNotFoundError`` only when the URL
  matches its ``REPO_API_REGEX``, which is anchored on ``https://``; against this plain-HTTP
  hub a 401 stays a generic ``HfHubHTTPError`` (status 401).
- The ``hf`` CLI fetches ``GET /api/agent-harnesses`` (user-agent detection, cached daily in
  ``HF_HOME``); the emulator answers 404, which the CLI tolerates.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote

from ._repo import FileEntry, RepoSnapshot, repo_key
from ._server import truthy
from ._xet import XetBridge


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ts))


class HFRoutes(XetBridge):
    """The Hugging Face API and ``resolve`` routes."""

    def _handle_hf_api(self, rest: str) -> None:
        kind, _, tail = rest.partition("/")
        self._route = "hf.api"
        if kind in ("datasets", "spaces", "kernels") and tail:
            self._route = f"hf.{kind}"
            self._hf_error(404, "RepoNotFound", f"Repository not found: {kind} are not served by this hub")
            return
        if kind != "models" or not tail:
            self._hf_error(404, None, f"Not found: /api/{rest}")
            return
        snap, sub = self._match_repo(tail)
        if snap is None:
            self._route = "hf.repo"
            self._hf_error(404, "RepoNotFound", "Repository not found")
            return
        self._repo = snap.repo_id
        if self._api_fault("/api/" + rest, ms=False):
            return
        parts = sub.split("/") if sub else []
        if not parts and self._method in ("GET", "HEAD"):
            self._route = "hf.model_info"
            self._hf_model_info(snap, snap.default_branch)
        elif len(parts) == 2 and parts[0] == "revision" and self._method in ("GET", "HEAD"):
            self._route = "hf.model_info"
            self._hf_model_info(snap, unquote(parts[1]))
        elif len(parts) >= 2 and parts[0] == "tree" and self._method in ("GET", "HEAD"):
            self._route = "hf.tree"
            self._hf_tree(snap, unquote(parts[1]), unquote("/".join(parts[2:])))
        elif len(parts) == 2 and parts[0] == "paths-info" and self._method == "POST":
            self._route = "hf.paths_info"
            self._hf_paths_info(snap, unquote(parts[1]))
        elif parts == ["refs"] and self._method in ("GET", "HEAD"):
            self._route = "hf.refs"
            self._hf_refs(snap)
        elif len(parts) == 2 and parts[0] == "xet-read-token" and self._method == "GET":
            # What a client with Xet enabled asks next; the CAS protocol is not emulated.
            self._route = "hf.xet_token"
            self._hf_error(501, None, "the loopback hub serves Xet-backed files over the HTTP bridge only; "
                                      "set HF_HUB_DISABLE_XET=1")
        else:
            self._hf_error(404, None, f"Not found: /api/{rest}")

    def _hf_commit_or_404(self, snap: RepoSnapshot, revision: str) -> str | None:
        commit = snap.resolve(revision)
        if commit is None:
            self._hf_error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def _hf_file_json(self, snap: RepoSnapshot, e: FileEntry, expand: bool) -> dict[str, Any]:
        path, size = self._listed(snap, e)
        d: dict[str, Any] = {"type": "file", "oid": e.blob_id, "size": size, "path": path}
        if e.lfs:
            d["lfs"] = {"oid": e.sha256, "size": size, "pointerSize": len(e.pointer)}
            if self.server.hub.is_xet(snap.repo_id):
                d["xetHash"] = e.xet_hash
        if expand:
            d["lastCommit"] = self._hf_last_commit(snap)
            d["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False},
                                       "pickleImportScan": None}
        return d

    def _hf_dir_json(self, snap: RepoSnapshot, path: str, expand: bool) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "directory", "oid": snap.dirs[path], "size": 0, "path": path}
        if expand:
            d["lastCommit"] = self._hf_last_commit(snap)
        return d

    def _hf_last_commit(self, snap: RepoSnapshot) -> dict[str, Any]:
        return {"id": snap.commit, "title": "Upload checkpoint (loopback hub)", "date": _iso(snap.created)}

    def _hf_entry_json(self, snap: RepoSnapshot, path: str, expand: bool) -> dict[str, Any]:
        if path in snap.files:
            return self._hf_file_json(snap, snap.files[path], expand)
        return self._hf_dir_json(snap, path, expand)

    def _hf_model_info(self, snap: RepoSnapshot, revision: str) -> None:
        commit = self._hf_commit_or_404(snap, revision)
        if commit is None:
            return
        blobs = truthy(self._query.get("blobs"))
        siblings = []
        for e in snap.files.values():
            path, size = self._listed(snap, e)
            s: dict[str, Any] = {"rfilename": path}
            if blobs:
                s["size"] = size
                s["blobId"] = e.blob_id
                if e.lfs:
                    s["lfs"] = {"sha256": e.sha256, "size": size, "pointerSize": len(e.pointer)}
            siblings.append(s)
        owner = snap.repo_id.split("/")[0] if "/" in snap.repo_id else None
        payload = {
            "_id": repo_key(snap.repo_id),
            "id": snap.repo_id,
            "modelId": snap.repo_id,
            "author": owner,
            "sha": commit,
            "lastModified": _iso(snap.created),
            "createdAt": _iso(snap.created),
            "private": False,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "library_name": None,
            "siblings": siblings,
            "usedStorage": sum(e.size for e in snap.files.values()),
        }
        self._json(200, payload, {"X-Repo-Commit": commit})

    def _hf_tree(self, snap: RepoSnapshot, revision: str, path: str) -> None:
        commit = self._hf_commit_or_404(snap, revision)
        if commit is None:
            return
        path = path.strip("/")
        if path and path not in snap.dirs:
            if path in snap.files:
                self._hf_error(404, "EntryNotFound", f"{path} is a file, not a directory",
                               {"X-Repo-Commit": commit})
            else:
                self._hf_error(404, "EntryNotFound", f"Entry not found: {path}", {"X-Repo-Commit": commit})
            return
        recursive = truthy(self._query.get("recursive"))
        expand = truthy(self._query.get("expand"))
        entries = snap.descendants(path) if recursive else snap.children(path)
        page_size = self.server.hub.page_size
        try:
            start = int(self._query.get("cursor") or 0)
        except ValueError:
            self._hf_error(400, None, "invalid cursor")
            return
        page = entries[start : start + page_size]
        headers = {"X-Repo-Commit": commit}
        nxt = start + page_size
        if nxt < len(entries):
            url = (
                f"{self._base_url()}/api/models/{snap.repo_id}/tree/{quote(revision, safe='')}"
                + (f"/{quote(path, safe='/')}" if path else "")
                + f"?recursive={recursive}&expand={expand}&cursor={nxt}"
            )
            headers["Link"] = f'<{url}>; rel="next"'
        self._json(200, [self._hf_entry_json(snap, p, expand) for p in page], headers)

    def _hf_paths_info(self, snap: RepoSnapshot, revision: str) -> None:
        commit = self._hf_commit_or_404(snap, revision)
        if commit is None:
            return
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        paths: list[str]
        expand = False
        try:
            if ctype == "application/json":
                body = json.loads(self._rx_body or b"{}")
                raw = body.get("paths", [])
                paths = [raw] if isinstance(raw, str) else list(raw)
                expand = bool(body.get("expand", False))
            else:
                form = parse_qs(self._rx_body.decode(), keep_blank_values=True)
                paths = form.get("paths", [])
                expand = truthy((form.get("expand") or ["false"])[-1])
        except (ValueError, AttributeError, UnicodeDecodeError):
            self._hf_error(400, None, "invalid paths-info body")
            return
        out = []
        seen = set()
        for p in paths:
            p = p.strip("/")
            if p in seen or not p:
                continue
            seen.add(p)
            if p in snap.files or p in snap.dirs:
                out.append(self._hf_entry_json(snap, p, expand))
        self._json(200, out, {"X-Repo-Commit": commit})

    def _hf_refs(self, snap: RepoSnapshot) -> None:
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": snap.commit} for b in snap.spec.branches]
        tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": snap.commit} for t in snap.spec.tags]
        self._json(200, {"branches": branches, "converts": [], "tags": tags})

    def _handle_hf_resolve(self, rest: str) -> None:
        self._route = "hf.resolve"
        if self._method not in ("GET", "HEAD"):
            self._hf_error(405, None, "method not allowed")
            return
        snap, sub = self._match_repo(rest)
        if snap is None:
            segs = rest.split("/")
            if "resolve" in segs[:4]:
                self._hf_error(404, "RepoNotFound", "Repository not found")
            else:
                self._route = "unknown"
                self._hf_error(404, None, f"Not found: /{rest}")
            return
        self._repo = snap.repo_id
        kind, _, tail = sub.partition("/")
        rev_q, _, file_q = tail.partition("/")
        if kind != "resolve" or not rev_q:
            self._route = "unknown"
            self._hf_error(404, None, f"Not found: /{rest}")
            return
        revision, path = unquote(rev_q), unquote(file_q)
        self._file = path
        commit = self._hf_commit_or_404(snap, revision)
        if commit is None:
            return
        entry = snap.files.get(path)
        if entry is None:
            self._hf_error(404, "EntryNotFound", f"Entry not found: {path}", {"X-Repo-Commit": commit})
            return
        headers = {
            "X-Repo-Commit": commit,
            "ETag": f'"{entry.etag}"',
            "Content-Disposition": f"inline; filename*=UTF-8''{quote(Path(path).name)}; "
            f'filename="{quote(Path(path).name)}";',
        }
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(self._listed(snap, entry)[1])
            if self.server.hub.is_xet(snap.repo_id):
                self._xet_redirect(snap, entry, commit, headers)
                return
        self._serve_file(snap, entry, headers, ms=False)
