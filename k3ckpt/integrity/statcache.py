"""The stat cache of ``verify --quick``, and the stat of the files it is keyed by.

A file whose stat (path, size, mtime, inode, device) is unchanged since a full run verified it
is trusted without being read again: :class:`StatCache` keeps its verified digests and scan
verdicts outside the checkpoint (one JSON file per checkpoint path, under :func:`cache_dir`), and
:func:`record_verified` lets another command that checked every byte (``fetch``) vouch for files
too. :func:`stat_present` lists a checkpoint's files with their stat;
:func:`cached_digest_known` and :func:`cached_digest_matches` compare a cached digest with
what the reference expects.
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
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


class StatCache:
    """Verified digests and scan verdicts keyed by (path, size, mtime, inode, device).

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

    def lookup(self, rel: str, st: os.stat_result) -> dict[str, Any] | None:
        e = self.files.get(rel)
        return e if e is not None and e.get("stat") == stat_key(st) else None

    def record(self, rel: str, st: os.stat_result, **facts: Any) -> None:
        prev = self.lookup(rel, st) or {}
        self.files[rel] = {**prev, **facts, "stat": stat_key(st)}

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps({"root": self.root, "files": self.files,
                                                "structure": self.structure}).encode())
        except OSError:
            pass  # a cache that cannot be written only costs speed next time


def record_verified(path: str | os.PathLike[str], digests: dict[str, tuple[str | None, str | None]],
                    cache_directory: Path | None = None) -> None:
    """Tell the stat cache that files of the checkpoint at ``path`` were just verified by
    someone else (``k3ckpt fetch`` checks every sha256 it downloads): ``digests`` maps a
    relative path to ``(sha256, git blob id)``. A later ``verify --quick`` then trusts them
    while their stat is unchanged, exactly as after a full ``verify``."""
    root, _ = resolve_root(path)
    cache = StatCache(root, cache_directory)
    for rel, (sha256, git_sha1) in digests.items():
        try:
            st = os.stat(root / rel)
        except OSError:
            continue
        facts = {k: v for k, v in (("sha256", sha256), ("git_sha1", git_sha1)) if v}
        if facts:
            cache.record(rel, st, **facts)
    cache.save()


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
