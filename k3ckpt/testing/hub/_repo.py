"""The repository model: which files a served directory holds, their hashes, the commit and refs.

Each repo id (``owner/name``) maps to a directory; its files are every regular file below it
(symlinks to regular files are followed, so an HF cache snapshot folder can be served), minus
``.git/`` and ``.cache/huggingface/`` (see ``exclude``).  Files of at least 1 MiB and every
``*.safetensors`` are "LFS" files: listed with ``lfs: {oid: sha256, size, pointerSize}``, a
``blobId`` that is the git oid of their LFS pointer, and ETag = sha256.  Other files carry the
git blob oid (sha1 of ``"blob <size>\\0" + content``) as blobId and ETag.  The commit sha is a
deterministic 40-hex digest of the (path, size, oid) listing; the branches ``main`` (Hugging
Face default) and ``master`` (ModelScope default) resolve to it, as do ``refs/heads/<b>``,
extra tags from :class:`RepoSpec` and the commit sha itself.  The listing is taken at
:meth:`LoopbackHub.start` (or :meth:`LoopbackHub.rescan`) by :func:`scan_repo`; hashes are
cached across runs in a JSON file per served directory keyed by (path, size, mtime_ns).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import fnmatch
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ...utils import write_atomic

#: Files at least this large are reported as LFS files (``*.safetensors`` always are).
LFS_THRESHOLD = 1 << 20
#: Block size used to hash files and to stream bodies that are modified on the fly.
HASH_BLOCK = 8 << 20
#: Glob patterns (on repo-relative posix paths) never served.
DEFAULT_EXCLUDE: tuple[str, ...] = (".git/*", ".cache/huggingface/*")

_HASH_CACHE_VERSION = 1
_SHA40 = re.compile(r"[0-9a-f]{40}")


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
        xet: Whether the repo's LFS files are Xet-backed (see ``_xet``); None follows the
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


def repo_key(repo_id: str) -> str:
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


def scan_repo(repo_id: str, spec: RepoSpec, cache_dir: Path, stats: HashStats) -> RepoSnapshot:
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
