"""The ModelScope routes, as modelscope 1.40 -> modelscope_hub 0.5 calls them, JSON in the
legacy envelope ``{"Code", "Data", "Message", "RequestId", "Success"}``:

- ``GET /api/v1/repos/internalAccelerationInfo`` (probed with a 0.2 s timeout before every
  snapshot for intra-cloud routing; answered with an empty region);
- ``GET /api/v1/models/{id}``, ``GET /api/v1/models/{id}/revisions`` (``RevisionMap``);
- ``GET /api/v1/models/{id}/repo/files?Revision=R&Recursive=True[&Root=dir]`` ->
  ``Data.Files[{Name, Path, Type: blob|tree, Size, Sha256, Revision, IsLFS, ...}]``;
- ``HEAD|GET /api/v1/models/{id}/repo?Revision=R&FilePath=P`` -> the bytes;
- ``/openapi/v1/...`` is not emulated: it answers 404 ``ResourceNotFound``, on which
  modelscope_hub falls back to the legacy ``/api/v1`` endpoints above.
- Errors: 404 with ``Success: false`` (the client raises ``NotExistError``, which the
  ``modelscope.snapshot_download`` shim re-raises as ``requests.HTTPError``).

Client quirks found while building this (modelscope_hub 0.5.1)
--------------------------------------------------------------
- modelscope_hub reads ``MODELSCOPE_ENDPOINT`` (full URL) or the deprecated
  ``MODELSCOPE_DOMAIN`` once, when the *first* ``HubApi`` of the process is built (even one
  given ``endpoint=``), and caches it as the process-wide default config.  Setting the
  variable later is silently ignored and the client then talks to modelscope.cn.  In-process,
  pass ``endpoint=hub.url`` (``modelscope.snapshot_download`` accepts it), or set the variable
  and clear the cache with ``modelscope_hub.config.set_default_config(None)``; subprocesses
  just need the variable.  ``MODELSCOPE_DOMAIN`` without a scheme becomes ``https://...``, so
  give it ``http://127.0.0.1:PORT``.  An explicit endpoint (argument or variable) also
  disables the probe of modelscope.cn / modelscope.ai done by ``resolve_endpoint_for_read``.
- modelscope_hub takes ``Sha256``/``Size`` from the listing and verifies each file; a ranged
  resume is treated as partial when the answer is 206 *or* carries ``Content-Range`` (the
  ``ignore_range_with_content_range`` fault reproduces modelscope_hub issue #50: the
  real server answers a Range request with 200 but a correct ``Content-Range`` and body).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from ._bodies import FileBodies
from ._repo import RepoSnapshot
from ._server import truthy


class MSRoutes(FileBodies):
    """The ModelScope API and download routes."""

    def _handle_ms(self, rest: str) -> None:
        self._route = "ms.api"
        if rest == "repos/internalAccelerationInfo":
            self._route = "ms.acceleration"
            self._json(200, self._ms_envelope({"InternalRegionQueryAddress": ""}))
            return
        kind, _, tail = rest.partition("/")
        if kind not in ("models", "datasets") or not tail:
            self._ms_error(404, f"Not found: /api/v1/{rest}")
            return
        snap, sub = self._match_repo(tail) if kind == "models" else (None, tail)
        if snap is None:
            self._route = "ms.repo"
            self._ms_error(404, "Model does not exist" if kind == "models" else "Dataset does not exist")
            return
        self._repo = snap.repo_id
        if sub != "repo" and self._api_fault("/api/v1/" + rest, ms=True):
            return
        if sub == "" and self._method in ("GET", "HEAD"):
            self._route = "ms.model"
            self._ms_model(snap)
        elif sub == "revisions" and self._method in ("GET", "HEAD"):
            self._route = "ms.revisions"
            self._ms_revisions(snap)
        elif sub == "repo/files" and self._method in ("GET", "HEAD"):
            self._route = "ms.files"
            self._ms_files(snap)
        elif sub == "repo" and self._method in ("GET", "HEAD"):
            self._route = "ms.download"
            self._ms_download(snap)
        else:
            self._ms_error(404, f"Not found: /api/v1/{rest}")

    def _ms_commit_or_404(self, snap: RepoSnapshot) -> str | None:
        revision = self._query.get("Revision") or self._query.get("revision") or "master"
        commit = snap.resolve(revision)
        if commit is None:
            self._ms_error(404, f"Revision {revision} does not exist")
        return commit

    def _ms_model(self, snap: RepoSnapshot) -> None:
        owner, _, name = snap.repo_id.rpartition("/")
        created = int(snap.created)
        self._json(
            200,
            self._ms_envelope(
                {
                    "Id": int(snap.commit[:8], 16),
                    "Name": name,
                    "Path": owner,
                    "ChineseName": "",
                    "Description": f"{snap.repo_id} served by the k3ckpt loopback hub",
                    "CreatedBy": owner,
                    "CreatedTime": created,
                    "LastUpdatedTime": created,
                    "CreatedAt": created,
                    "UpdatedAt": created,
                    "Visibility": 5,
                    "IsPublished": 1,
                    "Downloads": 0,
                    "Stars": 0,
                    "License": "other",
                    "Tags": [],
                    "ModelType": [],
                    "StorageSize": sum(e.size for e in snap.files.values()),
                    "ModelRevisions": [{"Revision": t} for t in snap.spec.tags],
                }
            ),
        )

    def _ms_revisions(self, snap: RepoSnapshot) -> None:
        created = int(snap.created)

        def rev(name: str) -> dict[str, Any]:
            return {"Revision": name, "CreatedAt": created, "CommitId": snap.commit, "Description": ""}

        self._json(
            200,
            self._ms_envelope(
                {
                    "RevisionMap": {
                        "Branches": [rev(b) for b in snap.spec.branches],
                        "Tags": [rev(t) for t in snap.spec.tags],
                    }
                }
            ),
        )

    def _ms_files(self, snap: RepoSnapshot) -> None:
        commit = self._ms_commit_or_404(snap)
        if commit is None:
            return
        root = (self._query.get("Root") or "").strip("/")
        if root and root not in snap.dirs:
            self._ms_error(404, f"Path {root} does not exist")
            return
        recursive = truthy(self._query.get("Recursive"))
        paths = snap.descendants(root) if recursive else snap.children(root)
        created = int(snap.created)
        files = []
        for p in paths:
            base = {
                "Name": p.rsplit("/", 1)[-1],
                "Path": p,
                "Revision": commit,
                "CommitId": commit,
                "CommitMessage": "Upload checkpoint (loopback hub)",
                "CommittedDate": created,
                "Committer": "loopback",
            }
            if p in snap.files:
                e = snap.files[p]
                listed_path, size = self._listed(snap, e)
                base.update(
                    {"Path": listed_path, "Name": listed_path.rsplit("/", 1)[-1], "Type": "blob", "Mode": "100644",
                     "Id": e.blob_id, "Size": size, "Sha256": e.sha256, "IsLFS": e.lfs}
                )
            else:
                base.update({"Type": "tree", "Mode": "40000", "Id": snap.dirs[p], "Size": 0, "Sha256": "",
                             "IsLFS": False})
            files.append(base)
        self._json(200, self._ms_envelope({"Files": files, "IsVisual": 0}))

    def _ms_download(self, snap: RepoSnapshot) -> None:
        path = (self._query.get("FilePath") or "").lstrip("/")
        self._file = path or None
        if not path:
            self._ms_error(400, "FilePath is required")
            return
        commit = self._ms_commit_or_404(snap)
        if commit is None:
            return
        entry = snap.files.get(path)
        if entry is None:
            self._ms_error(404, f"File {path} does not exist")
            return
        headers = {
            "ETag": f'"{entry.sha256}"',
            "Content-Disposition": f"attachment; filename*=UTF-8''{quote(Path(path).name)}",
        }
        if entry.lfs:
            headers["X-Linked-ETag"] = f'"{entry.sha256}"'
        self._serve_file(snap, entry, headers, ms=True)
