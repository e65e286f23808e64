"""A loopback Hugging Face + ModelScope hub emulator for tests, benchmarks and demos.

:class:`LoopbackHub` serves one or more local checkpoint directories on 127.0.0.1 over the
HTTP APIs that the *real* clients use, so ``huggingface_hub`` (2.x) and ``modelscope`` /
``modelscope_hub`` download through it unmodified.  Standard library only.

Quick start::

    from k3ckpt.testing.hub import LoopbackHub

    with LoopbackHub({"moonshotai/Kimi-K3": "/data/k3-mini"}) as hub:
        huggingface_hub.snapshot_download("moonshotai/Kimi-K3", endpoint=hub.url, local_dir=...)
        modelscope.snapshot_download("moonshotai/Kimi-K3", endpoint=hub.url, cache_dir=...)
        hub.inject("drop_after", "model-*.safetensors", after=4096, times=1)
        hub.bytes_sent("config.json"), hub.requests("config.json")

From a shell::

    python -m k3ckpt.testing.hub /data/k3-mini --repo moonshotai/Kimi-K3 --port 8765 [--xet]

Repository model
----------------
Each repo id (``owner/name``) maps to a directory; its files are every regular file below it
(symlinks to regular files are followed, so an HF cache snapshot folder can be served), minus
``.git/`` and ``.cache/huggingface/`` (see ``exclude``).  Files of at least 1 MiB and every
``*.safetensors`` are "LFS" files: listed with ``lfs: {oid: sha256, size, pointerSize}``, a
``blobId`` that is the git oid of their LFS pointer, and ETag = sha256.  Other files carry the
git blob oid (sha1 of ``"blob <size>\\0" + content``) as blobId and ETag.  The commit sha is a
deterministic 40-hex digest of the (path, size, oid) listing; the branches ``main`` (Hugging
Face default) and ``master`` (ModelScope default) resolve to it, as do ``refs/heads/<b>``,
extra tags from :class:`RepoSpec` and the commit sha itself.  The listing is taken at
:meth:`LoopbackHub.start` (or :meth:`LoopbackHub.rescan`); hashes are cached across runs in a
JSON file per served directory keyed by (path, size, mtime_ns).

Endpoints
---------
Hugging Face (what huggingface_hub 2.4 calls):

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
  Xet mode a 302 to the bridge host for LFS files (below);
- ``GET /api/models/{repo}/xet-read-token/{rev}`` (where a client with Xet enabled goes next):
  501, the CAS protocol is not emulated.
- 404s carry ``X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound`` (mapped by the
  client to ``RepositoryNotFoundError`` / ``RevisionNotFoundError`` /
  ``RemoteEntryNotFoundError``); datasets/spaces are answered ``RepoNotFound``.

ModelScope (what modelscope 1.40 -> modelscope_hub 0.5 calls), JSON in the legacy envelope
``{"Code", "Data", "Message", "RequestId", "Success"}``:

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

File bodies stream from disk (``socket.sendfile``), honour one ``Range: bytes=a-b | a- | -n``
(206 + ``Content-Range``; 416 + ``Content-Range: bytes */size`` if unsatisfiable; multi-range
requests get the whole file with 200), support HEAD, and always set ``Content-Length`` on an
HTTP/1.1 keep-alive connection.

Xet mode
--------
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

Client quirks found while building this (huggingface_hub 2.4.0, modelscope_hub 0.5.1)
---------------------------------------------------------------------------------------
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
  ``ignore_range_with_content_range`` fault below reproduces modelscope_hub issue #50: the
  real server answers a Range request with 200 but a correct ``Content-Range`` and body).

Fault injection
---------------
``hub.inject(kind, path_glob="*", *, repo="*", times=1, methods=("GET",), **params)`` (or
``hub.faults.add(Fault(...))``) arms a :class:`Fault` that applies to the next ``times``
matching file requests (``times=None``: forever).  ``path_glob`` is an ``fnmatch`` pattern on
the repo-relative file path.  A fault is only consumed by a request it actually affects.
Kinds and parameters:

- ``status``: answer ``status`` (default 503) in the hub's error format; ``retry_after=s``
  adds ``Retry-After`` (use with 429).  Also applies to HEAD if listed in ``methods``.
- ``drop_after``: send ``after`` body bytes, then reset the connection (RST; with
  ``reset=False`` close it with a FIN instead).
- ``short_body``: announce the full ``Content-Length`` but send ``missing`` (default 1) bytes
  fewer, then close cleanly (FIN).
- ``stall``: send ``after`` bytes, sleep ``seconds``, then continue (or close if
  ``close=True``).
- ``corrupt_byte``: flip (XOR 0xFF) the byte at file offset ``offset`` if it is served.
- ``ignore_range``: answer a Range request with 200 and the whole body.
- ``ignore_range_with_content_range``: answer a Range request with 200 *and* the correct
  ``Content-Range`` and the requested slice (the ModelScope behaviour of issue #50).

Hostile hubs (a compromised mirror, a broken proxy or CDN), for security tests:

- ``lie_size``: every listing (HF siblings / tree / paths-info, ModelScope files) reports the
  matching files' size plus ``delta`` (may be negative); HEAD's ``X-Linked-Size`` too.
- ``list_as``: listings name the matching file ``name`` instead (e.g. ``../../etc/evil``).
- ``wrong_content_range``: answer a Range request with 206 and the range shifted by ``delta``
  bytes (its ``Content-Range`` and body agree with each other, not with the request).
- ``redirect``: answer 302 with ``Location: <location><request path and query>``; serve the
  same repo on another hub at ``location`` (e.g. ``http://127.0.0.2:PORT``) and look at its
  ``request_log`` (``RequestRecord.credentials``) to see whether the token followed.
- ``endless_body``: 200 without ``Content-Length`` (or, with ``content_range=True``, a 206 with
  the right ``Content-Range``) and a body of ``fill`` bytes that never ends (it stops after
  ``after`` bytes when ``after`` > 0, or when the client goes away).
- ``html_200``: answer 200 with ``Content-Type: text/html`` and an HTML error page.

Xet mode: ``expired_url``: the bridge answers the next ``times`` matching requests 403 "Request
has expired" whatever their URL's expiry, as if it had just run out (only requests whose range
starts at or past ``offset``: a URL that expires mid-download).

With ``scope="api"`` a ``status`` fault matches the URL path of API requests instead of file
paths (e.g. ``hub.inject("status", "/api/models/*/tree/*", scope="api", status=429)``).

Counters: ``hub.bytes_sent(path)``, ``hub.requests(path)`` (body bytes handed to the socket and
requests, per (repo, path), summed over repos unless ``repo=`` is given), ``hub.reset_counters()``;
``hub.request_log`` lists every request with its route name as soon as its answer starts.
Counters and log cover the requests that arrived since the last reset: a body still being sent
from before it (say, an earlier test's stall waking up) is counted nowhere.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import email.utils
import fnmatch
import hashlib
import hmac
import http.server
import json
import os
import re
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from ..utils import write_atomic

__all__ = [
    "DEFAULT_EXCLUDE",
    "FAULT_KINDS",
    "LFS_THRESHOLD",
    "Fault",
    "FaultSet",
    "FileEntry",
    "HashStats",
    "LoopbackHub",
    "RepoSnapshot",
    "RepoSpec",
    "RequestRecord",
    "XET_URL_TTL",
    "main",
]

#: Files at least this large are reported as LFS files (``*.safetensors`` always are).
LFS_THRESHOLD = 1 << 20
#: Block size used to hash files and to stream bodies that are modified on the fly.
HASH_BLOCK = 8 << 20
#: Lifetime of the signed bridge URLs a Xet-backed ``resolve`` redirects to (the real hub's
#: are valid for an hour).
XET_URL_TTL = 3600.0
#: Glob patterns (on repo-relative posix paths) never served.
DEFAULT_EXCLUDE: tuple[str, ...] = (".git/*", ".cache/huggingface/*")
#: The fault kinds understood by :class:`Fault`.
FAULT_KINDS = frozenset(
    {
        "status",
        "drop_after",
        "short_body",
        "stall",
        "corrupt_byte",
        "ignore_range",
        "ignore_range_with_content_range",
        # Hostile hubs (what a compromised mirror or a broken proxy might answer):
        "lie_size",
        "list_as",
        "wrong_content_range",
        "redirect",
        "endless_body",
        "html_200",
        # Xet mode:
        "expired_url",
    }
)
#: Fault kinds that change what the listings say rather than how a file is served.
_LISTING_FAULTS = frozenset({"lie_size", "list_as"})

_HASH_CACHE_VERSION = 1
_SENDFILE_CHUNK = 8 << 20
_COPY_CHUNK = 1 << 20
_MAX_REQUEST_BODY = 16 << 20
_SHA40 = re.compile(r"[0-9a-f]{40}")
_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)
_TRUE = {"1", "true", "yes", "on"}


# ----------------------------------------------------------------------------------------------
# Repositories and hashing
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RepoSpec:
    """How to serve one directory.

    Attributes:
        path: The directory whose files make up the repo.
        branches: Branch names resolving to the commit (``main`` for HF, ``master`` for MS).
        tags: Extra tag names resolving to the commit.
        commit: Pin the 40-hex commit sha instead of deriving it from the listing.
        lfs_threshold: Size from which a file is reported as an LFS file.
        exclude: ``fnmatch`` patterns of repo-relative paths that are not served.
        xet: Whether the repo's LFS files are Xet-backed (see "Xet mode"); None follows the
            hub's ``xet`` argument.
    """

    path: Path
    branches: tuple[str, ...] = ("main", "master")
    tags: tuple[str, ...] = ()
    commit: str | None = None
    lfs_threshold: int = LFS_THRESHOLD
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    xet: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.commit is not None and not _SHA40.fullmatch(self.commit):
            raise ValueError(f"commit must be 40 lowercase hex digits, got {self.commit!r}")
        if not self.branches:
            raise ValueError("a repo needs at least one branch")


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One served file and its hashes.

    Attributes:
        path: Repo-relative posix path.
        abspath: Location on disk.
        size: Size in bytes.
        mtime_ns: Modification time used as part of the hash-cache key.
        sha256: Hex sha256 of the content.
        git_sha1: Git blob oid of the content (computed for non-LFS files only).
        lfs: Whether the file is reported as an LFS file.
    """

    path: str
    abspath: Path
    size: int
    mtime_ns: int
    sha256: str
    git_sha1: str | None
    lfs: bool

    @property
    def pointer(self) -> bytes:
        """The git-lfs pointer file that a git repo would store for this file."""
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n"
        ).encode()

    @property
    def blob_id(self) -> str:
        """The git oid of the blob in the tree: the pointer's for LFS files, else the content's."""
        if self.lfs:
            return _git_blob_oid(self.pointer)
        assert self.git_sha1 is not None
        return self.git_sha1

    @property
    def etag(self) -> str:
        """The ETag the Hugging Face hub reports: sha256 for LFS files, git oid otherwise."""
        return self.sha256 if self.lfs else self.blob_id

    @property
    def xet_hash(self) -> str:
        """A stand-in for the file's Xet hash (64 hex digits, derived from the sha256).

        The real one is the root of a Merkle tree over content-defined chunks; nothing here
        reconstructs files from CAS chunks, so only its shape and stability matter.
        """
        return hashlib.sha256(b"k3ckpt-loopback-xet\0" + bytes.fromhex(self.sha256)).hexdigest()


@dataclasses.dataclass(frozen=True)
class RepoSnapshot:
    """The immutable listing of one repo taken at start/rescan time.

    Attributes:
        repo_id: ``owner/name``.
        spec: The serving options.
        commit: The 40-hex commit sha.
        files: Repo-relative path -> entry, sorted by path.
        dirs: Repo-relative directory path -> tree oid (the root is not listed).
        refs: Branch/tag name -> commit.
        created: Unix time the snapshot was taken (reported as commit/modification date).
    """

    repo_id: str
    spec: RepoSpec
    commit: str
    files: dict[str, FileEntry]
    dirs: dict[str, str]
    refs: dict[str, str]
    created: float

    def resolve(self, revision: str) -> str | None:
        """Return the commit a revision names, or None if it names nothing in this repo."""
        rev = revision
        for prefix in ("refs/heads/", "refs/tags/"):
            if rev.startswith(prefix):
                rev = rev[len(prefix) :]
                break
        if rev in self.refs:
            return self.refs[rev]
        if rev == self.commit:
            return self.commit
        return None

    @property
    def default_branch(self) -> str:
        """``main`` if present, else the first branch."""
        return "main" if "main" in self.spec.branches else self.spec.branches[0]

    def children(self, directory: str) -> list[str]:
        """Direct children (files and dirs) of a directory ("" is the root), sorted."""
        prefix = f"{directory}/" if directory else ""
        out = []
        for p in (*self.dirs, *self.files):
            if p.startswith(prefix) and "/" not in p[len(prefix) :]:
                out.append(p)
        return sorted(out)

    def descendants(self, directory: str) -> list[str]:
        """Every file and directory below a directory ("" is the root), sorted."""
        prefix = f"{directory}/" if directory else ""
        return sorted(p for p in (*self.dirs, *self.files) if p.startswith(prefix))


def _repo_key(repo_id: str) -> str:
    """The repo's opaque id (as ``_id`` in ``model_info``), which bridge URLs carry."""
    return hashlib.sha1(repo_id.encode()).hexdigest()[:24]


def _git_blob_oid(data: bytes) -> str:
    h = hashlib.sha1(f"blob {len(data)}\0".encode())
    h.update(data)
    return h.hexdigest()


def _hash_file(path: Path, size: int, want_git: bool) -> tuple[str, str | None]:
    """Stream a file once, returning (sha256, git blob oid or None)."""
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode()) if want_git else None
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            sha256.update(block)
            if git is not None:
                git.update(block)
    return sha256.hexdigest(), (git.hexdigest() if git is not None else None)


def _excluded(rel: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(rel, pat) for pat in patterns)


def _walk_files(root: Path, exclude: Sequence[str]) -> Iterator[tuple[str, Path, os.stat_result]]:
    """Yield (relative posix path, absolute path, stat) of regular files below root."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(filenames):
            p = base / name
            rel = p.relative_to(root).as_posix()
            if _excluded(rel, exclude):
                continue
            try:
                st = p.stat()
            except OSError:
                continue
            if not os.path.isfile(p):
                continue
            yield rel, p, st


class _HashCache:
    """A JSON file of {relpath: {size, mtime_ns, sha256, git_sha1}} for one served directory."""

    def __init__(self, cache_dir: Path, served: Path) -> None:
        key = hashlib.sha1(str(served.resolve()).encode()).hexdigest()[:16]
        self.path = cache_dir / f"hashes-{served.name or 'root'}-{key}.json"
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") == _HASH_CACHE_VERSION and data.get("root") == str(served.resolve()):
                self.entries = dict(data.get("files", {}))
        except (OSError, ValueError, AttributeError):
            self.entries = {}

    def get(self, rel: str, size: int, mtime_ns: int, want_git: bool) -> tuple[str, str | None] | None:
        e = self.entries.get(rel)
        if not e or e.get("size") != size or e.get("mtime_ns") != mtime_ns:
            return None
        if want_git and not e.get("git_sha1"):
            return None
        return e["sha256"], e.get("git_sha1")

    def put(self, rel: str, size: int, mtime_ns: int, sha256: str, git_sha1: str | None) -> None:
        old = self.entries.get(rel) or {}
        if old.get("size") == size and old.get("mtime_ns") == mtime_ns and git_sha1 is None:
            git_sha1 = old.get("git_sha1")
        self.entries[rel] = {"size": size, "mtime_ns": mtime_ns, "sha256": sha256, "git_sha1": git_sha1}
        self.dirty = True

    def save(self, served: Path, keep: Iterable[str]) -> None:
        keep_set = set(keep)
        if set(self.entries) - keep_set:
            self.entries = {k: v for k, v in self.entries.items() if k in keep_set}
            self.dirty = True
        if not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"version": _HASH_CACHE_VERSION, "root": str(served.resolve()), "files": self.entries}
        write_atomic(self.path, json.dumps(payload, sort_keys=True).encode())
        self.dirty = False


@dataclasses.dataclass
class HashStats:
    """How many files the last scan hashed and how many came from the cache."""

    hashed: int = 0
    cached: int = 0
    bytes_hashed: int = 0


def _scan_repo(repo_id: str, spec: RepoSpec, cache_dir: Path, stats: HashStats) -> RepoSnapshot:
    root = spec.path
    if not root.is_dir():
        raise NotADirectoryError(f"{repo_id}: {root} is not a directory")
    cache = _HashCache(cache_dir, root)
    listing = list(_walk_files(root, spec.exclude))
    todo: list[tuple[str, Path, int, int, bool]] = []
    results: dict[str, tuple[str, str | None]] = {}
    lfs_of: dict[str, bool] = {}
    for rel, p, st in listing:
        lfs = st.st_size >= spec.lfs_threshold or rel.endswith(".safetensors")
        lfs_of[rel] = lfs
        hit = cache.get(rel, st.st_size, st.st_mtime_ns, want_git=not lfs)
        if hit is not None:
            results[rel] = hit
            stats.cached += 1
        else:
            todo.append((rel, p, st.st_size, st.st_mtime_ns, lfs))
    if todo:
        workers = max(1, min(8, os.cpu_count() or 1, len(todo)))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futs = {pool.submit(_hash_file, p, size, not lfs): (rel, size, mtime) for rel, p, size, mtime, lfs in todo}
            for fut in concurrent.futures.as_completed(futs):
                rel, size, mtime = futs[fut]
                sha256, git = fut.result()
                results[rel] = (sha256, git)
                cache.put(rel, size, mtime, sha256, git)
                stats.hashed += 1
                stats.bytes_hashed += size
    try:
        cache.save(root, (rel for rel, _, _ in listing))
    except OSError:
        pass  # a read-only cache location only costs re-hashing next time
    files: dict[str, FileEntry] = {}
    for rel, p, st in listing:
        sha256, git = results[rel]
        files[rel] = FileEntry(
            path=rel,
            abspath=p,
            size=st.st_size,
            mtime_ns=st.st_mtime_ns,
            sha256=sha256,
            git_sha1=None if lfs_of[rel] else git,
            lfs=lfs_of[rel],
        )
    dir_children: dict[str, list[str]] = collections.defaultdict(list)
    for rel in files:
        parts = rel.split("/")
        for i in range(1, len(parts) - 1):
            dir_children.setdefault("/".join(parts[:i]), [])  # ancestors without direct files
        if len(parts) > 1:
            dir_children["/".join(parts[:-1])].append(rel)
    dirs: dict[str, str] = {}
    for d in sorted(dir_children, key=lambda x: (-x.count("/"), x)):
        h = hashlib.sha1(b"tree\0")
        for rel in sorted(dir_children[d]):
            h.update(f"{rel}\0{files[rel].blob_id}\n".encode())
        for sub in sorted(k for k in dirs if k.startswith(d + "/") and "/" not in k[len(d) + 1 :]):
            h.update(f"{sub}/\0{dirs[sub]}\n".encode())
        dirs[d] = h.hexdigest()
    commit = spec.commit
    if commit is None:
        h = hashlib.sha1(b"k3ckpt-loopback-commit\0")
        for rel in sorted(files):
            e = files[rel]
            h.update(f"{rel}\0{e.size}\0{e.blob_id}\0{int(e.lfs)}\n".encode())
        commit = h.hexdigest()
    refs = {name: commit for name in (*spec.branches, *spec.tags)}
    return RepoSnapshot(
        repo_id=repo_id,
        spec=spec,
        commit=commit,
        files=dict(sorted(files.items())),
        dirs=dict(sorted(dirs.items())),
        refs=refs,
        created=time.time(),
    )


# ----------------------------------------------------------------------------------------------
# Faults and counters
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Fault:
    """A misbehaviour armed for matching requests (see the module docstring for the kinds).

    Attributes:
        kind: One of :data:`FAULT_KINDS`.
        path_glob: ``fnmatch`` pattern on the repo-relative file path (``scope="file"``) or on
            the URL path (``scope="api"``).
        repo: ``fnmatch`` pattern on the repo id.
        times: How many requests it affects; ``None`` means forever.
        methods: HTTP methods it applies to.
        scope: ``"file"`` (file downloads) or ``"api"`` (metadata endpoints; ``status`` only).
        status: HTTP status for ``status`` faults.
        retry_after: ``Retry-After`` seconds for ``status`` faults.
        after: Body bytes sent before ``drop_after`` / ``stall`` acts.
        missing: Bytes left out by ``short_body``.
        seconds: Sleep of ``stall``.
        close: Whether ``stall`` closes the connection after sleeping.
        reset: Whether ``drop_after`` aborts with an RST (True) or closes with a FIN.
        offset: File offset flipped by ``corrupt_byte``; first offset ``expired_url`` applies to.
        delta: Size change of ``lie_size``; range shift of ``wrong_content_range``.
        name: The path ``list_as`` lists the file under.
        location: Base URL ``redirect`` sends the client to.
        content_range: Whether ``endless_body`` answers 206 with a correct ``Content-Range``.
        fill: The byte value an ``endless_body`` repeats.
        skip: Matching requests let through untouched before the fault acts (a server that
            honours ``Range`` for the first chunk and then stops, say).
        hits: How many requests it has affected so far.
    """

    kind: str
    path_glob: str = "*"
    repo: str = "*"
    times: int | None = 1
    methods: tuple[str, ...] = ("GET",)
    scope: str = "file"
    status: int = 503
    retry_after: float | None = None
    after: int = 0
    missing: int = 1
    seconds: float = 0.0
    close: bool = False
    reset: bool = True
    offset: int = 0
    delta: int = 1
    name: str = ""
    location: str = ""
    content_range: bool = False
    fill: int = 0
    skip: int = 0
    hits: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {sorted(FAULT_KINDS)}")
        if self.scope not in ("file", "api"):
            raise ValueError("scope must be 'file' or 'api'")
        if self.kind == "list_as" and not self.name:
            raise ValueError("list_as needs name=")
        if self.kind == "redirect" and not self.location:
            raise ValueError("redirect needs location=")
        if self.scope == "api" and self.kind != "status":
            raise ValueError("only 'status' faults can target API endpoints")
        if self.times is not None and self.times < 0:
            raise ValueError("times must be >= 0 or None")
        if self.kind == "status" and not 400 <= self.status <= 599:
            raise ValueError("status faults need a 4xx/5xx status")
        self.methods = tuple(m.upper() for m in self.methods)
        if min(self.after, self.missing, self.offset, self.skip) < 0 or self.seconds < 0:
            raise ValueError("fault sizes, offsets and durations must be >= 0")

    @property
    def exhausted(self) -> bool:
        """True once the fault has affected ``times`` requests."""
        return self.times is not None and self.hits >= self.times

    def matches(self, scope: str, repo_id: str, path: str, method: str) -> bool:
        """Whether a request falls under this fault (regardless of remaining uses)."""
        return (
            scope == self.scope
            and method in self.methods
            and fnmatch.fnmatchcase(repo_id, self.repo)
            and fnmatch.fnmatchcase(path, self.path_glob)
        )


class FaultSet:
    """A thread-safe list of armed faults."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def add(self, fault: Fault) -> Fault:
        """Arm a fault and return it."""
        with self._lock:
            self._faults.append(fault)
        return fault

    def remove(self, fault: Fault) -> None:
        """Disarm a fault (no error if it is not armed)."""
        with self._lock:
            self._faults = [f for f in self._faults if f is not fault]

    def clear(self) -> None:
        """Disarm every fault."""
        with self._lock:
            self._faults.clear()

    def active(self) -> list[Fault]:
        """The faults that still have uses left."""
        with self._lock:
            return [f for f in self._faults if not f.exhausted]

    def __len__(self) -> int:
        return len(self.active())

    def take(self, scope: str, repo_id: str, path: str, method: str, accept: Any) -> list[Fault]:
        """Consume one use of every live matching fault for which ``accept(fault)`` is true."""
        taken: list[Fault] = []
        with self._lock:
            for f in self._faults:
                if not f.exhausted and f.matches(scope, repo_id, path, method) and accept(f):
                    if f.skipped < f.skip:
                        f.skipped += 1
                        continue
                    f.hits += 1
                    taken.append(f)
        return taken


@dataclasses.dataclass
class RequestRecord:
    """One request as the hub saw it. It enters the log as its response's headers are sent,
    before the client can see any of it, so a client that has its answer finds it there.
    ``body_bytes`` then grows as the body is sent; like the byte counters, it can trail what the
    client has read by a moment, until ``finished``. A request answered with nothing (a dropped
    connection) enters the log when it ends.

    Attributes:
        method: HTTP method.
        target: Request target (path and query).
        route: Route name, e.g. ``hf.resolve``, ``hf.tree``, ``ms.files``, ``ms.download``.
        status: Status code answered.
        repo: Repo id, if the route names one.
        file: Repo-relative file path for downloads.
        range: The ``Range`` header, if any.
        body_bytes: Body bytes handed to the socket.
        credentials: Whether the request carried an ``Authorization`` header or a ModelScope
            ``m_session_id`` cookie (what must not follow a redirect to another host); on the
            Xet bridge, any ``Authorization`` or ``Cookie`` header at all.
        server: ``"hub"``, or ``"bridge"`` for the Xet bridge host (see "Xet mode").
        started: ``time.monotonic()`` when the request arrived: records are appended when a
            response starts, so "did B arrive after A" compares ``started``, not log positions.
        finished: Whether the hub is done with the request: from then on its ``body_bytes``
            and its share of the counters are final.
    """

    method: str
    target: str
    route: str
    status: int
    repo: str | None
    file: str | None
    range: str | None
    body_bytes: int
    credentials: bool = False
    server: str = "hub"
    started: float = 0.0  # time.monotonic() when the request arrived (the log is in response order)
    finished: bool = False


class _Counters:
    """Per-(repo, path) requests and body bytes of the requests that arrived in the current
    epoch. A reset starts a new epoch: a handler still running from before it (a body stalled for
    seconds by an earlier test's fault, which then wakes and writes into its dead socket) counts
    nowhere, instead of in whatever a later test is measuring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._reqs: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.epoch = 0

    def request(self, epoch: int, repo: str, path: str, method: str) -> None:
        with self._lock:
            if epoch == self.epoch:
                self._reqs[(repo, path, method)] += 1

    def sent(self, epoch: int, repo: str, path: str, n: int) -> None:
        if n:
            with self._lock:
                if epoch == self.epoch:
                    self._bytes[(repo, path)] += n

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._reqs.clear()
            self.epoch += 1

    def bytes_sent(self, path: str, repo: str | None) -> int:
        with self._lock:
            return sum(n for (r, p), n in self._bytes.items() if p == path and (repo is None or r == repo))

    def requests(self, path: str, repo: str | None, method: str | None) -> int:
        with self._lock:
            return sum(
                n
                for (r, p, m), n in self._reqs.items()
                if p == path and (repo is None or r == repo) and (method is None or m == method.upper())
            )

    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())


# ----------------------------------------------------------------------------------------------
# HTTP
# ----------------------------------------------------------------------------------------------


class _Abort(Exception):
    """Raised inside a handler to drop the connection without writing anything more."""


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog of 5 overflows when a client opens a dozen connections at
    # once (parallel header reads, 8+ download workers); the kernel then drops SYNs and the
    # client's connect waits a full second for the retransmit.
    request_queue_size = 128
    hub: LoopbackHub

    def __init__(self, addr: tuple[str, int], hub: LoopbackHub, role: str = "hub") -> None:
        self.hub = hub
        self.role = role  # "hub", or "bridge" for the Xet bridge host
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(addr, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client hanging up or timing out mid-keep-alive (downloaders cancel, tests kill) is
        # normal traffic for a hub: socket errors are; only other errors deserve socketserver's
        # traceback on stderr.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_all_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _http_date(ts: float) -> str:
    return email.utils.formatdate(ts, usegmt=True)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ts))


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """Parse a single byte range.

    Returns (start, end_inclusive), None to serve the whole file (no/invalid/multi range), or
    the string ``"unsatisfiable"``.
    """
    if header is None:
        return None
    m = _RANGE_RE.match(header)
    if not m:
        return None  # multi-range or malformed: RFC 9110 lets the server ignore it
    a, b = m.group(1), m.group(2)
    if a == "" and b == "":
        return None
    if a == "":
        n = int(b)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size - 1
    start = int(a)
    end = int(b) if b != "" else size - 1
    if b != "" and end < start:
        return None  # invalid: ignore
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size - 1)


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "k3ckpt-loopback-hub/1.0"
    sys_version = ""
    timeout = 120
    # TCP_NODELAY, as production servers set it: the headers and the sendfile'd body go out as
    # separate writes, and with Nagle on the body waits for the client's delayed ACK of the
    # headers - 40 ms per response, which small ranged requests (tensor ranges) pay in full.
    disable_nagle_algorithm = True
    server: _Server

    # -- plumbing ------------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Silence the default stderr access log (see ``LoopbackHub.request_log``)."""

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        """Handle GET."""
        self._dispatch("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        """Handle HEAD."""
        self._dispatch("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        """Handle POST."""
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        self._started = time.monotonic()
        self._epoch = self.server.hub._counters.epoch  # what this request counts in (see _Counters)
        self._method = method
        self._route = "unknown"
        self._repo: str | None = None
        self._file: str | None = None
        self._status = 0
        self._body_bytes = 0
        self._logged: RequestRecord | None = None
        self._rx_body = b""
        hub = self.server.hub
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_REQUEST_BODY:
                self.close_connection = True
                self._json(413, {"error": "request body too large"})
                return
            if length:
                self._rx_body = self.rfile.read(length)
            split = urlsplit(self.path)
            self._query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
            raw_path = split.path
            if self.server.role == "bridge":
                # A signed URL is its own credential: the hub token is neither needed nor wanted.
                self._handle_bridge(raw_path)
                return
            is_ms = raw_path.startswith("/api/v1/") or raw_path.startswith("/openapi/")
            if hub.token is not None and not self._authorized(hub.token):
                self._route = "auth"
                self._unauthorized(is_ms)
                return
            if raw_path.startswith("/openapi/"):
                self._route = "ms.openapi"
                self._ms_error(404, "OpenAPI is not emulated; use the legacy /api/v1 endpoints",
                               code="ResourceNotFound")
            elif raw_path.startswith("/api/v1/"):
                self._handle_ms(raw_path[len("/api/v1/") :])
            elif raw_path.startswith("/api/"):
                self._handle_hf_api(raw_path[len("/api/") :])
            else:
                self._handle_hf_resolve(raw_path.lstrip("/"))
        except _Abort:
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError):
            self.close_connection = True
        finally:
            # A request answered with nothing (no headers sent) is logged only now.
            record = self._logged if self._logged is not None else self._log_request()
            record.finished = True  # the last count is in

    def _log_request(self) -> RequestRecord:
        """Put this request in the hub's log (see :class:`RequestRecord` for when)."""
        self._logged = RequestRecord(
            method=self._method,
            target=self.path,
            route=self._route,
            status=self._status,
            repo=self._repo,
            file=self._file,
            range=self.headers.get("Range"),
            body_bytes=self._body_bytes,
            credentials=self._carries_credentials(),
            server=self.server.role,
            started=self._started,
        )
        self.server.hub._record(self._epoch, self._logged)
        return self._logged

    def _carries_credentials(self) -> bool:
        if self.server.role == "bridge":
            # Nothing a client holds for the hub has any business on the bridge host.
            return bool(self.headers.get("Authorization") or self.headers.get("Cookie"))
        return bool(self.headers.get("Authorization")) or "m_session_id" in (self.headers.get("Cookie") or "")

    def _authorized(self, token: str) -> bool:
        auth = self.headers.get("Authorization", "")
        if auth == f"Bearer {token}":
            return True
        cookie = self.headers.get("Cookie", "")
        return f"m_session_id={token}" in [c.strip() for c in cookie.split(";")]

    def _unauthorized(self, is_ms: bool) -> None:
        supplied = bool(self.headers.get("Authorization"))
        if is_ms:
            self._ms_error(401, "Invalid access token" if supplied else "User not logged in")
            return
        headers = {"WWW-Authenticate": 'Bearer realm="loopback-hub"'}
        if supplied:
            headers["X-Error-Message"] = "Invalid credentials in Authorization header"
        self._json(401, {"error": "Invalid credentials in Authorization header" if supplied else "Unauthorized"},
                   headers)

    def _send_head(self, status: int, headers: Mapping[str, str]) -> None:
        self._status = status
        if self._logged is None:
            self._log_request()  # before the client can see the answer
        self.send_response(status)
        for k, v in headers.items():
            # http.server encodes headers as latin-1; keep non-ASCII paths from breaking a response.
            self.send_header(k, v.encode("ascii", "backslashreplace").decode("ascii"))
        self.end_headers()

    def _json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        h = {"Content-Type": "application/json; charset=utf-8", "Content-Length": str(len(body))}
        h.update(headers or {})
        self._send_head(status, h)
        if self._method != "HEAD":
            self.wfile.write(body)

    def _hf_error(self, status: int, code: str | None, message: str, headers: Mapping[str, str] | None = None) -> None:
        h = {"X-Error-Message": message}
        if code:
            h["X-Error-Code"] = code
        h.update(headers or {})
        self._json(status, {"error": message}, h)

    def _ms_envelope(self, data: Any) -> dict[str, Any]:
        return {"Code": 200, "Data": data, "Message": "success", "RequestId": uuid.uuid4().hex, "Success": True}

    def _ms_error(self, status: int, message: str, code: Any = None, headers: Mapping[str, str] | None = None) -> None:
        self._json(
            status,
            {
                "Code": code if code is not None else status,
                "Data": None,
                "Message": message,
                "RequestId": uuid.uuid4().hex,
                "Success": False,
            },
            headers,
        )

    def _base_url(self) -> str:
        host = self.headers.get("Host") or f"{self.server.hub.host}:{self.server.hub.port}"
        return f"http://{host}"

    def _api_fault(self, raw_path: str, ms: bool) -> bool:
        """Apply an armed ``scope="api"`` status fault; True if it answered the request."""
        taken = self.server.hub.faults.take("api", self._repo or "", raw_path, self._method, lambda f: True)
        for f in taken:
            headers = {"Retry-After": _fmt_seconds(f.retry_after)} if f.retry_after is not None else {}
            if ms:
                self._ms_error(f.status, f"injected fault: HTTP {f.status}", headers=headers)
            else:
                self._hf_error(f.status, None, f"injected fault: HTTP {f.status}", headers)
            return True
        return False

    def _match_repo(self, rest: str) -> tuple[RepoSnapshot | None, str]:
        """Split ``owner/name/<tail>`` into the served repo and the tail."""
        hub = self.server.hub
        for repo_id in sorted(hub._snapshots, key=len, reverse=True):
            if rest == repo_id or rest.startswith(repo_id + "/"):
                return hub._snapshots[repo_id], rest[len(repo_id) + 1 :]
        return None, rest

    # -- Hugging Face ----------------------------------------------------------------------------

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

    def _listed(self, snap: RepoSnapshot, e: FileEntry) -> tuple[str, int]:
        """The (path, size) a listing reports for a file: the truth unless a listing fault lies."""
        taken = self.server.hub.faults.take("file", snap.repo_id, e.path, self._method,
                                            lambda f: f.kind in _LISTING_FAULTS)
        path, size = e.path, e.size
        for f in taken:
            if f.kind == "list_as":
                path = f.name
            else:
                size = max(0, size + f.delta)
        return path, size

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
        blobs = _truthy(self._query.get("blobs"))
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
            "_id": _repo_key(snap.repo_id),
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
        recursive = _truthy(self._query.get("recursive"))
        expand = _truthy(self._query.get("expand"))
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
                expand = _truthy((form.get("expand") or ["false"])[-1])
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

    # -- the Xet bridge host -------------------------------------------------------------------

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
        parsed = _parse_range(self.headers.get("Range"), entry.size)
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

    # -- ModelScope ------------------------------------------------------------------------------

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
        recursive = _truthy(self._query.get("Recursive"))
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

    # -- file bodies -----------------------------------------------------------------------------

    def _serve_file(self, snap: RepoSnapshot, entry: FileEntry, headers: dict[str, str], ms: bool) -> None:
        hub = self.server.hub
        method = self._method
        hub._counters.request(self._epoch, snap.repo_id, entry.path, method)
        size = entry.size
        range_header = self.headers.get("Range")
        parsed = _parse_range(range_header, size)
        has_range = parsed is not None

        status_faults = hub.faults.take(
            "file", snap.repo_id, entry.path, method, lambda f: f.kind == "status"
        )
        if status_faults:
            f = status_faults[0]
            extra = {"Retry-After": _fmt_seconds(f.retry_after)} if f.retry_after is not None else {}
            msg = f"injected fault: HTTP {f.status}"
            if ms:
                self._ms_error(f.status, msg, headers=extra)
            else:
                self._hf_error(f.status, None, msg, extra)
            return

        if self._hostile(snap, entry, parsed, ms):
            return

        range_faults = hub.faults.take(
            "file",
            snap.repo_id,
            entry.path,
            method,
            lambda f: f.kind in ("ignore_range", "ignore_range_with_content_range") and has_range,
        )
        kinds = {f.kind for f in range_faults}
        if "ignore_range" in kinds:
            parsed = None

        base = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "Last-Modified": _http_date(entry.mtime_ns / 1e9),
            **headers,
        }
        if parsed == "unsatisfiable":
            base["Content-Range"] = f"bytes */{size}"
            base["Content-Length"] = "0"
            base["Content-Type"] = "text/plain"
            self._send_head(416, base)
            return
        if isinstance(parsed, tuple):
            start, end = parsed
            status = 200 if "ignore_range_with_content_range" in kinds else 206
            base["Content-Range"] = f"bytes {start}-{end}/{size}"
        else:
            start, end = 0, size - 1
            status = 200
        length = end - start + 1
        base["Content-Length"] = str(length)
        if method == "HEAD":
            self._send_head(status, base)
            return

        def body_fault(f: Fault) -> bool:
            if f.kind == "corrupt_byte":
                return start <= f.offset < start + length
            return f.kind in ("drop_after", "short_body", "stall")

        faults = hub.faults.take("file", snap.repo_id, entry.path, method, body_fault)
        self._send_head(status, base)
        if not faults:
            self._sendfile(snap.repo_id, entry, start, length)
        else:
            self._send_faulty(snap.repo_id, entry, start, length, faults)

    def _hostile(self, snap: RepoSnapshot, entry: FileEntry, parsed: Any, ms: bool) -> bool:
        """Apply an armed hostile fault to a file request; True if it answered the request."""
        kinds = ("redirect", "html_200", "endless_body", "wrong_content_range")
        taken = self.server.hub.faults.take(
            "file", snap.repo_id, entry.path, self._method,
            lambda f: f.kind in kinds and (f.kind != "wrong_content_range" or isinstance(parsed, tuple)))
        if not taken:
            return False
        f = taken[0]
        if f.kind == "redirect":
            self._send_head(302, {"Location": f.location.rstrip("/") + self.path, "Content-Length": "0"})
        elif f.kind == "html_200":
            page = (b"<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body><h1>Bad Gateway</h1>"
                    b"<p>The upstream server is temporarily unavailable. Please try again later.</p></body></html>\n")
            self._send_head(200, {"Content-Type": "text/html; charset=utf-8", "Content-Length": str(len(page))})
            if self._method != "HEAD":
                self.wfile.write(page)
                self._count(snap.repo_id, entry.path, len(page))
        elif f.kind == "endless_body":
            self._endless(snap, entry, parsed, f)
        else:
            start, end = parsed
            size = entry.size
            # Shifted but self-consistent: only comparing with the request shows it is wrong.
            s0 = min(max(0, start + f.delta), size - 1)
            e0 = min(max(s0, end + f.delta), size - 1)
            self._send_head(206, {"Content-Type": "application/octet-stream", "Content-Range": f"bytes {s0}-{e0}/{size}",
                                  "Content-Length": str(e0 - s0 + 1)})
            if self._method != "HEAD":
                self._sendfile(snap.repo_id, entry, s0, e0 - s0 + 1)
        return True

    def _endless(self, snap: RepoSnapshot, entry: FileEntry, parsed: Any, f: Fault) -> None:
        """A body that never ends (until the client leaves, the hub stops, or ``f.after`` bytes)."""
        headers = {"Content-Type": "application/octet-stream", "Connection": "close"}
        status = 200
        if f.content_range and isinstance(parsed, tuple):
            status = 206
            headers["Content-Range"] = f"bytes {parsed[0]}-{parsed[1]}/{entry.size}"
        self.close_connection = True
        self._send_head(status, headers)
        if self._method == "HEAD":
            return
        block = bytes([f.fill & 0xFF]) * _COPY_CHUNK
        sent = 0
        while not self.server.hub._stopping.is_set() and (f.after == 0 or sent < f.after):
            self.wfile.write(block)
            self._count(snap.repo_id, entry.path, len(block))
            sent += len(block)
        raise _Abort()

    def _count(self, repo: str, path: str, n: int) -> None:
        self._body_bytes += n
        if self._logged is not None:
            self._logged.body_bytes = self._body_bytes
        self.server.hub._counters.sent(self._epoch, repo, path, n)

    def _sendfile(self, repo: str, entry: FileEntry, start: int, length: int) -> None:
        with open(entry.abspath, "rb") as f:
            offset, remaining = start, length
            while remaining > 0:
                n = self.connection.sendfile(f, offset, min(remaining, _SENDFILE_CHUNK))
                if n <= 0:
                    break
                self._count(repo, entry.path, n)
                offset += n
                remaining -= n
        if remaining:
            # The file shrank under us: the announced Content-Length can no longer be met.
            raise _Abort()

    def _send_faulty(self, repo: str, entry: FileEntry, start: int, length: int, faults: list[Fault]) -> None:
        """Stream a body through the armed body faults (read/modify/write in 1 MiB blocks)."""
        hub = self.server.hub
        limit, end_action = length, None  # bytes to send, then how to end: None | "rst" | "fin"
        for f in faults:
            if f.kind == "drop_after" and (end_action is None or f.after < limit):
                limit, end_action = min(f.after, limit), ("rst" if f.reset else "fin")
            elif f.kind == "short_body" and (end_action is None or length - f.missing < limit):
                limit, end_action = max(0, length - f.missing), "fin"
        stall = next((f for f in faults if f.kind == "stall"), None)
        stall_at = min(stall.after, limit) if stall is not None else None
        corrupt = [f.offset for f in faults if f.kind == "corrupt_byte"]
        sent = 0
        with open(entry.abspath, "rb") as fh:
            fh.seek(start)
            while True:
                if stall is not None and stall_at == sent:
                    stall_at = None
                    hub._stopping.wait(stall.seconds)
                    if stall.close:
                        end_action = "fin"
                        break
                if sent >= limit:
                    break
                want = min(_COPY_CHUNK, limit - sent)
                if stall_at is not None:
                    want = min(want, stall_at - sent)
                chunk = bytearray(fh.read(want))
                if not chunk:
                    raise _Abort()  # the file shrank under us
                for off in corrupt:
                    rel = off - (start + sent)
                    if 0 <= rel < len(chunk):
                        chunk[rel] ^= 0xFF
                self.wfile.write(chunk)
                self._count(repo, entry.path, len(chunk))
                sent += len(chunk)
        if end_action == "rst":
            self._reset_connection()
        if end_action == "fin":
            try:
                self.connection.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            raise _Abort()

    def _reset_connection(self) -> None:
        """Abort the TCP connection with an RST (SO_LINGER 0) right now, then stop handling."""
        sock = self.connection
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            # socket.close() would wait for the rfile/wfile wrappers; detach and close the fd now.
            os.close(sock.detach())
        except OSError:
            pass
        raise _Abort()


def _fmt_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


# ----------------------------------------------------------------------------------------------
# The hub
# ----------------------------------------------------------------------------------------------


class LoopbackHub:
    """Serve local directories over the Hugging Face and ModelScope HTTP APIs on loopback.

    Args:
        repos: Repo id (``owner/name``) -> directory or :class:`RepoSpec`.
        host: Address to bind (keep it on loopback).
        port: Port to bind; 0 picks a free one.
        cache_dir: Where hash caches live; defaults to ``$TMPDIR/k3ckpt-hub-<uid>``.
        token: If set, every request needs ``Authorization: Bearer <token>`` (or the
            ModelScope ``m_session_id`` cookie), else 401.
        page_size: Entries per page of the HF tree listing (the real hub uses 1000).
        xet: Present every repo's LFS files as Xet-backed (a :class:`RepoSpec` may say
            otherwise per repo): see "Xet mode" in the module docstring.
        xet_url_ttl: Seconds a signed bridge URL stays valid (0: already expired when issued).

    Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        repos: Mapping[str, str | os.PathLike[str] | RepoSpec],
        host: str = "127.0.0.1",
        port: int = 0,
        cache_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
        page_size: int = 1000,
        xet: bool = False,
        xet_url_ttl: float = XET_URL_TTL,
    ) -> None:
        if not repos:
            raise ValueError("at least one repo is required")
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        if xet_url_ttl < 0:
            raise ValueError("xet_url_ttl must be >= 0")
        self.specs: dict[str, RepoSpec] = {}
        for repo_id, value in repos.items():
            if not repo_id or repo_id.startswith("/") or repo_id.endswith("/") or repo_id.count("/") > 1:
                raise ValueError(f"invalid repo id {repo_id!r}")
            self.specs[repo_id] = value if isinstance(value, RepoSpec) else RepoSpec(Path(value))
        self.host = host
        self._requested_port = port
        self.port = port
        self.cache_dir = (
            Path(cache_dir)
            if cache_dir is not None
            else Path(tempfile.gettempdir()) / f"k3ckpt-hub-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        )
        self.token = token
        self.page_size = page_size
        self.xet = xet
        self.xet_url_ttl = xet_url_ttl
        # Signs the bridge URLs; only this process can mint one, so a URL is only ever valid
        # as the hub issued it.
        self._xet_secret = os.urandom(32)
        self._xet_objects: dict[tuple[str, str], tuple[str, str]] = {}
        self._bridge: _Server | None = None
        self._bridge_thread: threading.Thread | None = None
        self.faults = FaultSet()
        self.hash_stats = HashStats()
        self._counters = _Counters()
        self._log: collections.deque[RequestRecord] = collections.deque(maxlen=100_000)
        self._log_lock = threading.Lock()
        self._snapshots: dict[str, RepoSnapshot] = {}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> LoopbackHub:
        """Scan and hash the repos, bind the socket and serve in a background thread."""
        if self._server is not None:
            return self
        self.rescan()
        self._stopping.clear()
        server = _Server((self.host, self._requested_port), self)
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"loopback-hub:{self.port}", daemon=True
        )
        self._thread.start()
        if any(self.is_xet(rid) for rid in self.specs):
            # The bridge is "another host" to a client: same address, another port, so another
            # origin, to which no credential of the hub may be sent.
            bridge = _Server((self.host, 0), self, role="bridge")
            self._bridge = bridge
            self._bridge_thread = threading.Thread(
                target=bridge.serve_forever, kwargs={"poll_interval": 0.05},
                name=f"loopback-hub-bridge:{bridge.server_address[1]}", daemon=True)
            self._bridge_thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and drop open connections (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        bridge, self._bridge = self._bridge, None
        for srv in (server, bridge):
            if srv is not None:
                srv.shutdown()
                srv.close_all_connections()
                srv.server_close()
        for thread in (self._thread, self._bridge_thread):
            if thread is not None:
                thread.join(timeout=5)
        self._thread = self._bridge_thread = None

    def __enter__(self) -> LoopbackHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def rescan(self) -> None:
        """Re-list and (re-)hash every repo; a content change yields a new commit sha."""
        stats = HashStats()
        snapshots = {rid: _scan_repo(rid, spec, self.cache_dir, stats) for rid, spec in self.specs.items()}
        self.hash_stats = stats
        self._xet_objects = {
            (_repo_key(rid), e.xet_hash): (rid, e.path)
            for rid, snap in snapshots.items() if self.is_xet(rid)
            for e in snap.files.values() if e.lfs
        }
        self._snapshots = snapshots

    @property
    def running(self) -> bool:
        """Whether the server thread is serving."""
        return self._server is not None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (valid after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("the hub is not running; call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def bridge_url(self) -> str:
        """Base URL of the Xet bridge host (valid after :meth:`start`, in Xet mode only)."""
        if self._bridge is None:
            raise RuntimeError("no Xet bridge: the hub is not running or serves no Xet-backed repo")
        return f"http://{self.host}:{self._bridge.server_address[1]}"

    def client_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a client subprocess: ``base`` (default ``os.environ``) plus the hub vars."""
        env = dict(os.environ if base is None else base)
        env.update(self.env_vars())
        return env

    def env_vars(self) -> dict[str, str]:
        """The variables pointing both clients at this hub."""
        return {
            "HF_ENDPOINT": self.url,
            "MODELSCOPE_ENDPOINT": self.url,
            "HF_HUB_DISABLE_XET": "1",
        }

    # -- repo info -------------------------------------------------------------------------------

    def snapshot(self, repo_id: str) -> RepoSnapshot:
        """The listing currently served for a repo."""
        if not self._snapshots:
            self.rescan()
        return self._snapshots[repo_id]

    def commit(self, repo_id: str) -> str:
        """The commit sha served for a repo."""
        return self.snapshot(repo_id).commit

    def files(self, repo_id: str) -> dict[str, FileEntry]:
        """Repo-relative path -> :class:`FileEntry` for a repo."""
        return self.snapshot(repo_id).files

    def is_xet(self, repo_id: str) -> bool:
        """Whether a repo's LFS files are presented as Xet-backed."""
        spec = self.specs[repo_id]
        return self.xet if spec.xet is None else spec.xet

    def signed_bridge_url(self, repo_id: str, entry: FileEntry) -> str:
        """A bridge URL for a file, signed and valid for ``xet_url_ttl`` seconds, in the shape
        of the real hub's."""
        expires = time.time() + self.xet_url_ttl
        disposition = (f"inline; filename*=UTF-8''{quote(Path(entry.path).name)}; "
                       f'filename="{quote(Path(entry.path).name)}";')
        signed = (f"/xet-bridge-us/{_repo_key(repo_id)}/{entry.xet_hash}?X-Xet-Cas-Uid=public"
                  f"&response-content-disposition={quote(disposition, safe='')}&Expires={expires:.3f}")
        return f"{self.bridge_url}{signed}&Signature={self._sign(signed)}"

    def _sign(self, text: str) -> str:
        return hmac.new(self._xet_secret, text.encode(), hashlib.sha256).hexdigest()

    def check_signature(self, target: str) -> str | None:
        """Why a bridge request target (path and query) is refused, or None if it is valid."""
        signed, sep, signature = target.rpartition("&Signature=")
        if not sep or not hmac.compare_digest(self._sign(signed), signature):
            return "Invalid signature"
        try:
            expires = float(parse_qs(urlsplit(signed).query).get("Expires", [""])[-1])
        except ValueError:
            return "Invalid signature"
        if time.time() >= expires:
            return "Request has expired"
        return None

    def bridge_object(self, path: str) -> tuple[RepoSnapshot, FileEntry] | None:
        """The served file a bridge URL path names, or None."""
        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "xet-bridge-us":
            return None
        found = self._xet_objects.get((parts[1], parts[2]))
        if found is None:
            return None
        snap = self._snapshots[found[0]]
        return snap, snap.files[found[1]]

    def resolve_url(self, repo_id: str, path: str, revision: str = "main") -> str:
        """The Hugging Face ``resolve`` URL of a file."""
        return f"{self.url}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(path)}"

    def modelscope_url(self, repo_id: str, path: str, revision: str = "master") -> str:
        """The ModelScope download URL of a file."""
        return f"{self.url}/api/v1/models/{repo_id}/repo?Revision={quote(revision, safe='')}&FilePath={quote(path)}"

    # -- faults ----------------------------------------------------------------------------------

    def inject(
        self,
        kind: str,
        path_glob: str = "*",
        *,
        repo: str = "*",
        times: int | None = 1,
        methods: Sequence[str] = ("GET",),
        scope: str = "file",
        **params: Any,
    ) -> Fault:
        """Arm a :class:`Fault` (see the module docstring for kinds and parameters)."""
        return self.faults.add(
            Fault(kind=kind, path_glob=path_glob, repo=repo, times=times, methods=tuple(methods), scope=scope, **params)
        )

    # -- counters and log ------------------------------------------------------------------------

    def bytes_sent(self, path: str, repo: str | None = None) -> int:
        """Body bytes sent for a repo-relative file path (summed over repos unless ``repo``)."""
        return self._counters.bytes_sent(path, repo)

    def requests(self, path: str, repo: str | None = None, method: str | None = None) -> int:
        """File requests (GET and HEAD unless ``method``) for a repo-relative path."""
        return self._counters.requests(path, repo, method)

    def total_bytes_sent(self) -> int:
        """Body bytes sent for all files."""
        return self._counters.total_bytes()

    def reset_counters(self) -> None:
        """Zero the per-path counters and clear the request log. From here on they cover only
        requests that arrive after this call: one still being answered counts nowhere."""
        with self._log_lock:
            self._counters.reset()
            self._log.clear()

    @property
    def request_log(self) -> list[RequestRecord]:
        """Every request seen since the last :meth:`reset_counters`, in the order their answers
        started (see :class:`RequestRecord`)."""
        with self._log_lock:
            return list(self._log)

    @property
    def bridge_log(self) -> list[RequestRecord]:
        """The requests the Xet bridge host saw (``credentials`` says whether any carried one)."""
        return [r for r in self.request_log if r.server == "bridge"]

    def routes_used(self) -> collections.Counter[str]:
        """Route name -> number of requests, from the request log."""
        return collections.Counter(r.route for r in self.request_log)

    def _record(self, epoch: int, rec: RequestRecord) -> None:
        with self._log_lock:
            if epoch == self._counters.epoch:
                self._log.append(rec)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Serve directories until interrupted: ``python -m k3ckpt.testing.hub DIR --repo ID``."""
    parser = argparse.ArgumentParser(
        prog="python -m k3ckpt.testing.hub",
        description="Serve local checkpoint directories over the Hugging Face and ModelScope APIs on loopback.",
    )
    parser.add_argument("dirs", nargs="+", type=Path, help="directory to serve (one per --repo)")
    parser.add_argument("--repo", action="append", default=None,
                        help="repo id for the matching DIR (default moonshotai/Kimi-K3 for a single DIR)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=None, help="require this bearer token")
    parser.add_argument("--commit", default=None, help="pin the commit sha (single repo only)")
    parser.add_argument("--page-size", type=int, default=1000)
    parser.add_argument("--cache-dir", type=Path, default=None, help="hash cache directory")
    parser.add_argument("--xet", action="store_true",
                        help="present LFS files as Xet-backed: resolve redirects to a signed URL on a bridge port")
    parser.add_argument("--xet-url-ttl", type=float, default=XET_URL_TTL, metavar="SECONDS",
                        help=f"lifetime of the signed bridge URLs (default {XET_URL_TTL:g})")
    args = parser.parse_args(argv)

    repos_ids = args.repo or (["moonshotai/Kimi-K3"] if len(args.dirs) == 1 else [])
    if len(repos_ids) != len(args.dirs):
        parser.error("give one --repo per DIR")
    if args.commit and len(args.dirs) != 1:
        parser.error("--commit needs exactly one DIR")
    repos = {rid: RepoSpec(d, commit=args.commit) for rid, d in zip(repos_ids, args.dirs)}
    hub = LoopbackHub(repos, host=args.host, port=args.port, cache_dir=args.cache_dir, token=args.token,
                      page_size=args.page_size, xet=args.xet, xet_url_ttl=args.xet_url_ttl)
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    hub.start()
    try:
        print(f"Serving on {hub.url}", flush=True)
        if args.xet:
            print(f"Xet bridge on {hub.bridge_url}", flush=True)
        for rid in repos:
            snap = hub.snapshot(rid)
            total = sum(e.size for e in snap.files.values())
            print(f"  {rid} @ {snap.commit} ({len(snap.files)} files, {total} bytes) from {snap.spec.path}")
        print("Export:")
        for k, v in hub.env_vars().items():
            print(f"  export {k}={v}")
        print("Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        hub.stop()
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
