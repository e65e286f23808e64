"""The stat cache of ``verify --quick``, and the stat of the files it is keyed by.

A file whose stat (path, size, mtime, inode, device, ctime) is unchanged since a full run verified it
is trusted without being read again: :class:`StatCache` keeps its verified digests and scan
verdicts outside the checkpoint (one JSON file per checkpoint path, under :func:`cache_dir`), and
:func:`record_verified` lets another command that checked every byte (``fetch``) vouch for files
too. :func:`stat_present` lists a checkpoint's files with their stat;
:func:`cached_digest_known` and :func:`cached_digest_matches` compare a cached digest with
what the reference expects.

Proofs (docs/trust.md). An entry may carry ``proven``: the named origin (a manifest, a signed
manifest, the hub's sha256 of a repo revision) of the digest the file's bytes were found equal
to, by ``verify`` against that reference or by the command that wrote the file (``fetch``
checking the hub's sha256; ``reshard`` and ``fetch --node`` carrying their source's proof to the
files they write). A later command that finds the stat unchanged takes the proof from here
(:func:`carried_proof`): the bytes are those that were proven. No entry, or a changed stat (an
edited file, a copy elsewhere), carries no proof.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..env import K3CKPT_CACHE_DIR
from ..format.checkpoint import iter_checkpoint_files, resolve_root
from ..utils import write_atomic
from .report import Expected, Issue, VerifyReport


def cache_dir() -> Path:
    """``$K3CKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/k3ckpt``, else ``~/.cache/k3ckpt``."""
    env = K3CKPT_CACHE_DIR.get()
    if env is not None:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "k3ckpt"


def stat_key(st: os.stat_result) -> list[int]:
    """What identifies a file's bytes without reading them. The ctime too: bytes rewritten in
    place change it even when ``os.utime`` puts the mtime back (a proof must not survive that)."""
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns]


class StatCache:
    """Verified digests and scan verdicts keyed by (path, size, mtime, inode, device, ctime).

    A file whose stat is unchanged since a full run had verified it is trusted without being
    read again. The cache lives outside the checkpoint (one JSON file per checkpoint path) so
    verifying never writes into what it verifies.
    """

    def __init__(self, root: Path, directory: Path | None = None) -> None:
        key = hashlib.sha256(str(root).encode()).hexdigest()[:20]
        self.path = (directory or cache_dir()) / "verify" / f"{key}.json"
        self.root = str(root)
        try:
            data = json.loads(self.path.read_text())
            ok = isinstance(data, dict) and data.get("root") == self.root
        except (OSError, ValueError):
            ok = False
        self.files: dict[str, dict[str, Any]] = data.get("files", {}) if ok else {}
        self.structure: dict[str, Any] = data.get("structure", {}) if ok else {}
        #: Manifest files a full ``verify --manifest`` of this checkpoint found files equal to:
        #: absolute path -> the sha256 of the manifest file then (:meth:`note_manifest`).
        self.manifests: dict[str, str] = data.get("manifests", {}) if ok else {}

    def lookup(self, rel: str, st: os.stat_result) -> dict[str, Any] | None:
        e = self.files.get(rel)
        return e if e is not None and e.get("stat") == stat_key(st) else None

    def record(self, rel: str, st: os.stat_result, **facts: Any) -> None:
        prev = self.lookup(rel, st) or {}
        self.files[rel] = {**prev, **facts, "stat": stat_key(st)}

    def note_manifest(self, path: str | os.PathLike[str]) -> None:
        """Remember that files were verified against the manifest file ``path`` (with its sha256
        now): a later ``reshard`` of this checkpoint takes tensor digests from it without being
        told (:func:`verified_manifests`), for the files whose entries still match."""
        real = os.path.realpath(path)
        try:
            self.manifests[real] = _file_sha256(real)
        except OSError:
            pass

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps({"root": self.root, "files": self.files,
                                                "structure": self.structure, "manifests": self.manifests}).encode())
        except OSError:
            pass  # a cache that cannot be written only costs speed next time


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verified_manifests(root: str | os.PathLike[str], cache_directory: Path | None = None) -> list[Path]:
    """The manifest files a full ``verify --manifest`` of the checkpoint at ``root`` used that
    are still the bytes it used (same sha256 now), most recent last. Which of the checkpoint's
    files they vouch for is each file's own stat-cache entry: its digest, with its stat."""
    cache = StatCache(resolve_root(root)[0], cache_directory)
    out = []
    for path, sha in cache.manifests.items():
        try:
            if _file_sha256(path) == sha:
                out.append(Path(path))
        except OSError:
            continue
    return out


def record_verified(path: str | os.PathLike[str], digests: dict[str, tuple[str | None, str | None]],
                    cache_directory: Path | None = None, *, origin: str | None = None) -> None:
    """Tell the stat cache that files of the checkpoint at ``path`` were just verified by
    someone else (``k3ckpt fetch`` checks every sha256 it downloads): ``digests`` maps a
    relative path to ``(sha256, git blob id)``; ``origin`` names whose digests they were checked
    against (``hub sha256 of hf:REPO@REV``). A later ``verify --quick`` then trusts them while
    their stat is unchanged, exactly as after a full ``verify``, and takes the proof along."""
    root, _ = resolve_root(path)
    record_written(root, {rel: {"sha256": sha256, "git_sha1": git_sha1, "proven": origin}
                          for rel, (sha256, git_sha1) in digests.items() if sha256 or git_sha1}, cache_directory)


def record_written(path: str | os.PathLike[str], entries: dict[str, dict[str, Any]],
                   cache_directory: Path | None = None) -> None:
    """Tell the stat cache what a command knows of the files it just wrote under ``path``:
    ``entries`` maps a relative path to its facts (``sha256``; ``proven``, the origin its source
    was proven by; a share's ``share_ref``). Their stat is taken now, so the record vouches only
    for these bytes: a file changed or copied later carries none of it."""
    root = Path(os.path.realpath(path))  # the key verify uses (its resolved root)
    cache = StatCache(root, cache_directory)
    for rel, facts in entries.items():
        try:
            st = os.stat(root / rel)
        except OSError:
            continue
        cache.record(rel, st, **{k: v for k, v in facts.items() if v})
    cache.save()


def carried_proof(hit: dict[str, Any] | None) -> str | None:
    """The origin a stat-cache entry (found with the file's current stat) says proved its bytes."""
    origin = hit.get("proven") if hit else None
    return origin if isinstance(origin, str) and origin else None


def cached_digest_known(hit: dict[str, Any], exp: Expected) -> bool:
    return bool((exp.sha256 and hit.get("sha256")) or (not exp.sha256 and exp.git_sha1 and hit.get("git_sha1")))


def cached_digest_matches(hit: dict[str, Any], exp: Expected) -> bool:
    if exp.sha256:
        return hit.get("sha256") == exp.sha256
    return bool(exp.git_sha1) and hit.get("git_sha1") == exp.git_sha1


def stat_present(root: Path, report: VerifyReport) -> tuple[list[str], dict[str, os.stat_result]]:
    """The checkpoint's files (``report.files`` set to their count) and the stat of each; a file
    that cannot be stat-ed is an ``unreadable`` issue of the report and has no stat."""
    present = list(iter_checkpoint_files(root))
    report.files = len(present)
    stats: dict[str, os.stat_result] = {}
    for f in present:
        try:
            stats[f] = os.stat(root / f)
        except OSError as e:
            report.issues.append(Issue("unreadable", f, f"cannot stat ({e.strerror})"))
    return present, stats


def settle_proofs(report: VerifyReport, stats: dict[str, os.stat_result], hits: dict[str, dict[str, Any] | None],
                  checked: dict[str, str], skip: frozenset[str] = frozenset()) -> None:
    """Fill ``report.proofs`` for every file in ``stats`` (but ``skip``): the reference this run
    found it equal to (``checked``), else the proof its unchanged stat-cache entry carries, else
    none. A file with an issue is never proven."""
    bad = {i.file for i in report.problems}
    # a file the reference does not list is reported as such (extra-file); no engine reads it
    extra = {i.file for i in report.issues if i.kind == "extra-file"}
    for f in sorted(stats):
        if f in skip or f in extra:
            continue
        report.proofs[f] = None if f in bad else checked.get(f) or carried_proof(hits.get(f))


def recorded_proofs(root: Path, rels: list[str], cache_directory: Path | None = None) -> dict[str, str | None]:
    """``rel`` -> the origin that proved the bytes of each file of the checkpoint at ``root``, as
    the stat cache recorded it (None: never proven, or changed since): what a command that
    copies them (``reshard``) carries over to what it writes."""
    cache = StatCache(Path(os.path.realpath(root)), cache_directory)
    out: dict[str, str | None] = {}
    for rel in rels:
        try:
            out[rel] = carried_proof(cache.lookup(rel, os.stat(root / rel)))
        except OSError:
            out[rel] = None
    return out


def joined_origin(origins: list[str | None]) -> str | None:
    """One origin for bytes derived from several proven ones (None if any is unproven)."""
    if not origins or any(o is None for o in origins):
        return None
    return "; ".join(sorted({o for o in origins if o is not None}))
