"""The hubs' own caches: ``k3ckpt fetch --cache-dir`` writes what their clients (and the engines
calling them) find there offline.

Hugging Face (the layout of ``huggingface_hub.snapshot_download(cache_dir=...)``)::

    CACHE/models--org--name/blobs/<etag>                 the bytes; etag = sha256 of an LFS file,
                                                         git blob id of a small one
    CACHE/models--org--name/snapshots/<commit>/<path>    -> ../../blobs/<etag> (relative symlink)
    CACHE/models--org--name/refs/<revision>              the commit (no newline), for a branch/tag
    CACHE/models--org--name/trees/<commit>.json          the commit's file listing: the client's
                                                         offline completeness check reads it

ModelScope (``modelscope_hub``'s ``DownloadManager``; the ``modelscope`` package delegates to it)::

    CACHE/models/org--name/snapshots/<revision>/<path>   plain files; <revision> as requested
                                                         (``master`` by default), not the commit

The cache is shared with the real clients, so nothing of k3ckpt's lives where they look: no
ownership record (the clients write there too), our lock and records in the repo folder's
``.k3ckpt/`` (neither client reads it; ``huggingface_hub``'s cache scan only reads ``blobs``,
``snapshots`` and ``refs``), our working files ``blobs/<etag>.part`` + ``.part.journal`` (the
client's own are ``<etag>.incomplete``). Crash safety is the downloader's (journaled chunks,
sha256 checked before a blob takes its name); then each snapshot link is made under a temporary
name and renamed over (never a half-made link); the ref is moved last, and only when every file
is in place, so a failed fetch of a new commit never takes ``main`` away from a complete snapshot
of the previous one. A blob already there is verified like any file present; one whose bytes are
not its name's (damaged: content-addressed, it serves no snapshot) is replaced the way every blob
is written, a verified ``.part`` renamed over it, and the result's notes say so. A foreign
regular file in a snapshot, where the client puts a link, with other content is never replaced.

A rank-aware fetch's rewritten shards are not the hub's files: they are published as a snapshot
of their own under the ref ``k3ckpt-partial-<key>`` with blobs named by their own sha256
(:func:`publish_partial`), never under the hub's names or revisions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..utils import fsync_dir, write_atomic
from .client import HubFile, HubListing

__all__ = ["PARTIAL_REF_PREFIX", "RECORDS_DIR", "CacheLayout", "blob_name", "default_cache_dir", "link_snapshot",
           "partial_key", "partial_layout", "partial_staging", "publish_partial", "repo_dir", "unpublished",
           "write_ref", "write_tree_cache"]

#: k3ckpt's own folder inside a cached repo's folder (lock, fetch records): no client reads it.
RECORDS_DIR = ".k3ckpt"
#: A rank-aware fetch's snapshot is published under ``refs/`` (and on ModelScope ``snapshots/``)
#: as this prefix + :func:`partial_key`: never a name the hub has.
PARTIAL_REF_PREFIX = "k3ckpt-partial-"
#: Suffix of a snapshot link being made (renamed over the final name at once).
_LINK_TMP = ".k3ckpt-link"
#: ``huggingface_hub``'s tree cache format (``_tree_cache.TREE_CACHE_FORMAT_VERSION``).
_TREE_FORMAT = 1


def default_cache_dir(hub: str) -> Path:
    """The hub client's own cache location, read now from the client (so ``HF_HUB_CACHE``,
    ``HF_HOME`` or ``MODELSCOPE_CACHE`` apply exactly as they do for the client)."""
    if hub == "hf":
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    from modelscope_hub.config import get_default_config

    return Path(get_default_config().cache_dir)  # what the client's downloads use (MODELSCOPE_CACHE)


def repo_dir(hub: str, root: Path, repo: str) -> Path:
    """The folder of ``repo`` in the cache at ``root``, named as the hub's client names it."""
    if hub == "hf":
        from huggingface_hub.file_download import repo_folder_name

        return root / repo_folder_name(repo_id=repo, repo_type="model")
    # modelscope_hub DownloadManager._repo_cache_dir_path
    return root / "models" / repo.replace("/", "--")


@dataclass(frozen=True)
class CacheLayout:
    """Where one repo's snapshot lives in a hub cache.

    Attributes:
        hub: ``"hf"`` or ``"modelscope"``.
        root: The cache directory (``--cache-dir``).
        repo: The repo id.
        revision: The revision as requested (the hub's default branch when none was given).
        commit: The resolved commit.
    """

    hub: str
    root: Path
    repo: str
    revision: str
    commit: str

    @classmethod
    def of(cls, listing: HubListing, root: str | os.PathLike[str], revision: str | None) -> CacheLayout:
        default = "main" if listing.hub == "hf" else "master"
        return cls(listing.hub, Path(root), listing.repo, revision or default, listing.revision)

    @property
    def repo_dir(self) -> Path:
        return repo_dir(self.hub, self.root, self.repo)

    @property
    def snapshot(self) -> Path:
        """The directory the client returns: by commit on Hugging Face, by the requested
        revision's name on ModelScope."""
        return self.repo_dir / "snapshots" / (self.commit if self.hub == "hf" else self.revision)

    @property
    def records(self) -> Path:
        """k3ckpt's lock and records for this repo."""
        return self.repo_dir / RECORDS_DIR

    def legacy_dir(self) -> Path | None:
        """An older ModelScope SDK's folder for this repo, which the client returns before ours
        (``DownloadManager._find_legacy_repo_dir``), or None."""
        if self.hub != "modelscope":
            return None
        owner, _, name = self.repo.partition("/")
        for cand in (self.root / "models" / owner / name.replace(".", "___"),
                     self.root / "hub" / "models" / owner / name.replace(".", "___")):
            if cand.is_dir() and any(cand.iterdir()):
                return cand
        return None


def blob_name(entry: HubFile) -> str | None:
    """The name ``huggingface_hub`` gives a file's blob: its ETag, i.e. the sha256 of an LFS file
    and the git blob id of a small one (None when the listing gives neither)."""
    return entry.sha256 or entry.git_sha1


def link_snapshot(layout: CacheLayout, entry: HubFile) -> str | None:
    """Point ``snapshots/<commit>/<path>`` at the file's blob (relative symlink, as the client
    makes it); None when done, else why not. A link is made under a temporary name and renamed
    over: a crash leaves the old pointer or the new one, never none. An existing correct link is
    kept; a wrong link is replaced (it holds no data); a regular file (the client's copy where
    symlinks are unsupported) is kept when its content matches, and never deleted."""
    from ..integrity.hashing import HashError, hash_file
    from ..utils import is_within
    from . import _dest

    blob = blob_name(entry)
    assert blob is not None
    reason = _dest.unsafe_reason(entry.path)
    if reason is not None:
        return f"refusing the path {entry.path!r} from the listing: it {reason}"
    snap = layout.snapshot
    os.makedirs(snap, exist_ok=True)
    final = os.path.join(snap, *entry.path.split("/"))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    # the link itself points outside (into blobs/); its directory must not
    if not is_within(os.path.dirname(final), os.path.realpath(snap)):
        return f"refusing {entry.path!r}: its directory resolves outside {snap}"
    want = os.path.relpath(layout.repo_dir / "blobs" / blob, os.path.dirname(final))
    if os.path.islink(final):
        if os.readlink(final) == want:
            return None
    elif os.path.lexists(final):
        try:
            digest = hash_file(final, git_sha1=entry.sha256 is None)
        except (HashError, OSError) as e:
            return f"{final} is there and unreadable ({e}); not replaced"
        ok = digest.size == entry.size and (digest.sha256 == entry.sha256 if entry.sha256 else
                                             digest.git_sha1 == entry.git_sha1)
        return None if ok else f"{final} is a file with other content, not written by k3ckpt: not replaced"
    tmp = final + _LINK_TMP
    _dest.unlink(tmp)  # our own leftover from a killed run
    os.symlink(want, tmp)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))
    return None


def write_ref(layout: CacheLayout) -> None:
    """``refs/<revision>`` = the commit, as the client writes it (no newline; atomically; left
    alone when already right). Nothing for a revision that is the commit itself."""
    if layout.hub != "hf" or layout.revision == layout.commit:
        return
    path = layout.repo_dir / "refs" / layout.revision
    with contextlib.suppress(OSError):  # no ref (or an unreadable one): write it
        if path.read_text() == layout.commit:
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, layout.commit.encode())


def write_tree_cache(layout: CacheLayout, listing: HubListing) -> bool:
    """Record the commit's whole file listing where ``huggingface_hub`` reads it
    (``trees/<commit>.json``): its offline ``snapshot_download`` then refuses a snapshot that
    misses a requested file, instead of returning it. False (nothing written) when the listing
    lacks a file's git blob id, the one field we could not fill truthfully."""
    files: dict[str, Any] = {}
    for p, f in sorted(listing.files.items()):
        if f.blob_id is None:
            return False
        info: dict[str, Any] = {"size": f.size, "blob_id": f.blob_id}
        if f.sha256 is not None:
            info.update(lfs_sha256=f.sha256, lfs_size=f.size)
        files[p] = info
    _write_tree(layout, files)
    return True


def _write_tree(layout: CacheLayout, files: dict[str, Any]) -> None:
    path = layout.repo_dir / "trees" / f"{layout.commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"format_version": _TREE_FORMAT, "files": files}, indent=1).encode())


# ----------------------------------------------------------------------------------------------
# A rank-aware fetch's partial checkpoint, published as a k3ckpt-named snapshot
# ----------------------------------------------------------------------------------------------


def partial_key(topology: dict[str, Any], ranks: list[int], include: tuple[str, ...] = (),
                exclude: tuple[str, ...] = ()) -> str:
    """A short stable name for a rank-aware selection - the resolved topology (its
    ``to_json()``), the ranks and the file filters, however they were spelled - naming its staging
    folder and its ref."""
    doc = json.dumps({"topology": topology, "ranks": sorted(ranks), "include": sorted(include),
                      "exclude": sorted(exclude)}, sort_keys=True)
    return hashlib.sha1(doc.encode()).hexdigest()[:12]


def partial_staging(hub: str, root: Path, repo: str, key: str) -> Path:
    """Where a rank-aware fetch into the cache writes its partial checkpoint first: a k3ckpt
    output directory like any other (its lock, ownership record, journals), in ``.k3ckpt/``."""
    return repo_dir(hub, root, repo) / RECORDS_DIR / "partial" / key


def publish_partial(hub: str, root: Path, repo: str, commit: str, key: str, staging: Path,
                    paths: list[str]) -> tuple[CacheLayout, dict[str, str]]:
    """Publish the partial checkpoint in ``staging`` (its files ``paths``) as a snapshot of its
    own, under the ref ``k3ckpt-partial-<key>`` - never under the hub's names: its shards are
    rewritten, so they are stored as blobs named by their own sha256 (content-addressed: a blob
    of that name holds exactly those bytes, whoever asks), linked from
    ``snapshots/<id>/`` where ``<id>`` is derived from the commit and the selection (Hugging Face),
    or copied as hard links into ``snapshots/k3ckpt-partial-<key>/`` (ModelScope). The files
    are hard links to the staged ones (no second copy on disk); the tree listing and the ref
    come last, only when every file is in place. Returns the layout and path -> why for failures.
    """
    from ..integrity.hashing import HashError, hash_file

    layout = partial_layout(hub, root, repo, commit, key)
    failed: dict[str, str] = {}
    tree: dict[str, Any] = {}
    for p in paths:
        src = staging / p
        try:
            if hub == "hf":
                digest = hash_file(src, git_sha1=True)
                _hard_link(src, layout.repo_dir / "blobs" / digest.sha256)
                why = link_snapshot(layout, HubFile(p, digest.size, digest.sha256, None))
                if why is not None:
                    failed[p] = why
                tree[p] = {"size": digest.size, "blob_id": digest.git_sha1}
            else:
                _hard_link(src, layout.snapshot / p, replace=True)
        except (HashError, OSError) as e:
            failed[p] = f"cannot publish {src}: {e}"
    if not failed and hub == "hf":
        _write_tree(layout, tree)
        write_ref(layout)
    return layout, failed


def partial_layout(hub: str, root: Path, repo: str, commit: str, key: str) -> CacheLayout:
    """Where :func:`publish_partial` publishes the selection ``key`` of ``commit``: the ref
    ``k3ckpt-partial-<key>``, and on Hugging Face a snapshot id derived from both."""
    ref = PARTIAL_REF_PREFIX + key
    if hub == "hf":
        return CacheLayout(hub, root, repo, ref, hashlib.sha1(f"k3ckpt-partial\0{commit}\0{key}".encode()).hexdigest())
    return CacheLayout(hub, root, repo, ref, commit)


def unpublished(layout: CacheLayout, staging: Path, paths: list[str]) -> dict[str, str]:
    """Path -> why, for each of ``paths`` that the snapshot of ``layout`` does not serve as the
    very file staged in ``staging`` (:func:`publish_partial` links each one), and for a missing ref;
    what ``fetch`` checks offline of a published partial checkpoint, reading no bytes."""
    out: dict[str, str] = {}
    if layout.hub == "hf":
        try:
            ok = (layout.repo_dir / "refs" / layout.revision).read_text() == layout.commit
        except OSError:
            ok = False
        if not ok:
            out[f"refs/{layout.revision}"] = f"missing or not {layout.commit}: the snapshot was not published"
    for p in paths:
        try:
            same = os.path.samefile(layout.snapshot / p, staging / p)
        except OSError:
            same = False
        if not same:
            out[f"snapshot {p}"] = f"{layout.snapshot / p} is not the file fetched into {staging}"
    return out


def _hard_link(src: Path, dst: Path, *, replace: bool = False) -> None:
    """``dst`` becomes a hard link to ``src`` (made under a temporary name, renamed into place);
    an existing ``dst`` is kept unless ``replace`` (a content-addressed blob is the same bytes)."""
    if dst.exists() and (not replace or os.path.samefile(src, dst)):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + _LINK_TMP)
    tmp.unlink(missing_ok=True)
    os.link(src, tmp)
    os.replace(tmp, dst)
    fsync_dir(dst.parent)
