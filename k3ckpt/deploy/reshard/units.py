"""A unit of output (a rank or a node directory) on disk: finishing it, and trusting it on a
re-run.

Files are written under temporary names (``.*.tmp``) and renamed after ``fsync``; the manifest
(a node's index and marker) is renamed into place after its files, the stat record after the
manifest, ``READY`` last, each followed by an ``fsync`` of the directory (:func:`_finish_rank`).

Resuming: a rank whose ``READY`` exists, whose manifest matches what this run would write (same
tensors, shapes, splits, files and sizes, same source index digest) and whose files still have
the stat recorded when they were written (size, mtime, inode, ctime in
``OUT/.cache/k3ckpt/units/rank-NNNNN.json``: a byte changed in place shows in the ctime even
when the mtime is put back, and nothing is re-hashed) is skipped (:func:`_manifest_matches`);
any other rank directory is cleared and rewritten. A layout of another topology or source
(``--force``) loses its unit directories, ``READY`` first (:func:`_clear_old_layout`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ...format.checkpoint import INDEX_NAME
from ...format.filedigest import SEGMENTS_KEY
from ...format.layout import MANIFEST_NAME, NODE_MARKER, READY_NAME
from ...utils import fsync_dir, write_atomic
from ..bytecopy import tmp_name
from .plan import NodePlan, RankPlan

#: Where a run records, per unit directory, the stat of each file it wrote (the re-run check).
STAT_RECORD_DIR = ".cache/k3ckpt/units"


def _finish_rank(outp: Path, rp: RankPlan | NodePlan, results: list[dict[str, Any]], source: dict[str, Any]) -> None:
    """Rename the rank's (or node's) files into place, then its index (a node's), its manifest
    (a node's marker), then the stat record of all of them (what a re-run trusts instead of
    re-hashing), then READY - each durable first (the weight files' data is synced here, not by
    their writers: see :func:`~k3ckpt.deploy.reshard.write._write_file`).

    A failure after the renames (a limit or a full disk met by a later step) puts the weights
    back under their temporary names and removes READY if its rename got through: a unit this
    run could not finish holds no weight file under a final name, as when a writer fails.
    Renames and unlinks need no descriptor, so this works at the open-files limit too. (A kill
    in between leaves complete weight files under final names and no READY: a re-run redoes
    the unit.)"""
    rdir = outp / rp.dir_name
    for f in rp.files:
        _fsync_file(tmp_name(rdir / f.name))
    renamed: list[Path] = []
    try:
        for f in rp.files:
            os.replace(tmp_name(rdir / f.name), rdir / f.name)
            renamed.append(rdir / f.name)
        fsync_dir(rdir)
        for name, data in rp.final_files(results, source).items():
            write_atomic(rdir / name, data)
        fsync_dir(rdir)
        record = _stat_record(outp, rp)
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, json.dumps({n: _stat_key(rdir / n) for n in _unit_names(rp)}).encode())
        write_atomic(rdir / READY_NAME, b"")
        fsync_dir(rdir)
    except BaseException:
        with contextlib.suppress(OSError):  # (the error being raised is the one to report)
            (rdir / READY_NAME).unlink(missing_ok=True)
        for final in renamed:
            with contextlib.suppress(OSError):
                os.replace(final, tmp_name(final))
        raise


def _record_proofs(outp: Path, rp: RankPlan | NodePlan, results: list[dict[str, Any]],
                   proofs: dict[str, str | None], extra_files: list[str]) -> None:
    """Tell the output's stat cache what vouches for the unit just finished: each file carries
    the proof of the source bytes it was copied from (docs/trust.md); a node directory's weight
    files also their digest and the key under which ``verify --quick`` trusts them against the
    marker, and its copies of the source's other files their proof. A source file nothing proved
    gives its copies no proof; ``verify`` and ``preflight`` then say "not proven"."""
    from ...integrity.share import share_reference_key
    from ...integrity.statcache import joined_origin, record_written

    node = isinstance(rp, NodePlan)
    key = share_reference_key(sum(len(f.tensors) for f in rp.files)) if node else None
    # a file's digest is its segments' (never a plain sha256: the stat cache's "sha256" is one)
    entries: dict[str, dict[str, Any]] = {
        f.name: {SEGMENTS_KEY: res[SEGMENTS_KEY], "share_ref": key, "share_issues": [] if node else None,
                 "proven": joined_origin([proofs.get(t.src_file) for t in f.tensors])}
        for f, res in zip(rp.files, results)}
    if node:
        entries.update({rel: {"proven": proofs.get(rel)} for rel in extra_files})
    record_written(outp / rp.dir_name, entries)


def _fsync_file(path: Path) -> None:
    """Make ``path``'s data durable (fsync through a fresh descriptor: the writer's is closed;
    Linux syncs the inode's dirty pages whichever descriptor asks). An error names the file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def _stat_key(path: Path) -> list[int]:
    """What identifies a file's bytes without reading them: size, mtime, inode and ctime (ns).
    Rewriting bytes in place changes mtime and ctime; ``os.utime`` can put mtime back, not
    ctime; replacing the file changes the inode."""
    st = os.stat(path, follow_symlinks=False)
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def _unit_names(rp: RankPlan | NodePlan) -> list[str]:
    """The files of a unit directory whose stat the run records: its weight files, then what
    is written after them (manifest; a node's index and marker)."""
    return [f.name for f in rp.files] + ([INDEX_NAME, NODE_MARKER] if isinstance(rp, NodePlan) else [MANIFEST_NAME])


def _stat_record(outp: Path, rp: RankPlan | NodePlan) -> Path:
    return outp / STAT_RECORD_DIR / f"{rp.dir_name}.json"


def _stats_unchanged(outp: Path, rp: RankPlan | NodePlan) -> bool:
    """Every file of the unit has the stat recorded when this tool wrote it: none was changed,
    replaced or touched since (a flipped byte of the right size included)."""
    try:
        rec = json.loads(_stat_record(outp, rp).read_bytes())
        return isinstance(rec, dict) and all(rec.get(n) == _stat_key(outp / rp.dir_name / n) for n in _unit_names(rp))
    except (OSError, ValueError):
        return False


def _manifest_matches(rdir: Path, rp: RankPlan | NodePlan, source: dict[str, Any]) -> bool:
    if not (rdir / READY_NAME).is_file():
        return False
    try:
        m = json.loads((rdir / rp.manifest_name).read_text())
    except (OSError, ValueError):
        return False
    want = rp.layout()
    if not isinstance(m, dict) or m.get("source_index_sha256") != source["index_sha256"]:
        return False
    for k, v in want.items():  # rank coordinates, or node, ranks, experts and topology
        if k not in ("tensors", "files") and m.get(k) != v:
            return False
    tensors = m.get("tensors")
    if not isinstance(tensors, dict) or tensors.keys() != want["tensors"].keys():
        return False
    for name, w in want["tensors"].items():
        got = tensors[name]
        if not isinstance(got, dict) or any(got.get(k) != v for k, v in w.items()):
            return False
    files = m.get("files")
    if not isinstance(files, dict) or files.keys() != want["files"].keys():
        return False
    for name, w in want["files"].items():
        p = rdir / name
        if files[name].get("size") != w["size"] or not p.is_file() or p.stat().st_size != w["size"]:
            return False
    return _stats_unchanged(rdir.parent, rp)


#: The unit directories a layout may hold (``rank-NNNNN``, ``node-NNNNN`` with ``--format node``).
_UNIT_DIR = re.compile(r"(rank|node)-\d{5,}")


def _old_units(outp: Path) -> list[Path]:
    """The rank/node directories of the layout ``outp`` holds."""
    return sorted(p for p in outp.iterdir() if _UNIT_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def _clear_old_layout(outp: Path, dirs: list[Path]) -> None:
    """Remove every rank/node directory (``dirs``: :func:`_old_units`) of the layout ``outp``
    held before (``--force`` with another topology or source): they belong to that topology,
    whatever this run selects. Every ``READY`` goes first (and durably), so a run killed mid-way
    never leaves a ``READY`` of the old layout under the new ``topology.json`` (written only
    after this returns)."""
    for d in dirs:
        ready = d / READY_NAME
        if ready.exists() or ready.is_symlink():
            ready.unlink()
            fsync_dir(d)
    for d in dirs:
        shutil.rmtree(d)
    fsync_dir(outp)
