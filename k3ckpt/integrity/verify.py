"""``k3ckpt verify``: prove a checkpoint intact, and say exactly what is wrong.

Three layers, each reported by kind with file, tensor, expected and actual:

- **structure** (always): every shard header by the strict parser's rules; the index and the
  headers agree; no weight_map path that escapes the directory (absolute, ``..``, or a symlink
  leading out); config and tensors agree (every MoE layer has all its experts with all their
  tensors, shapes consistent with the config); MXFP4 pairs agree; no NaN scale bytes (0xFF in
  an E8M0 ``weight_scale``) unless ``scan=False``;
- **content** (against a manifest or a hub listing): the set of files, each file's size and
  sha256 - and with a manifest that has tensor hashes, exactly which tensors differ;
- **quick** mode: sizes and structure, plus a stat cache (path, size, mtime, inode -> verified
  digest) so re-verifying an unchanged directory takes seconds. A full run refreshes the cache.

Hashing runs in threads across files (see :mod:`k3ckpt.hashing`); the scale scan and the tensor
hashes ride along in the same read. Given the manifest as a file (``manifest_path``, what the CLI
does), hashing starts as soon as the files are listed and the manifest and the headers are
parsed meanwhile: each thread scans by its own file's header, and the manifest then decides
which files and tensors the run wants.

This module runs the checks (:func:`verify_checkpoint`); the pieces live beside it:

- :mod:`~k3ckpt.integrity.report`: the report, its issues and what the command prints;
- :mod:`~k3ckpt.integrity.statcache`: the stat cache and the files' stat;
- :mod:`~k3ckpt.integrity.structure`: the structure layer;
- :mod:`~k3ckpt.integrity.scales`: the NaN-scale scan;
- :mod:`~k3ckpt.integrity.background`: the hashing threads;
- :mod:`~k3ckpt.integrity.share`: a share, checked tensor by tensor.

The names this module had before they moved there (the report types, the stat cache, the
structure and scale checks) are still importable from here.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import ParamSpec, TypeVar

from ..errors import CheckpointNotFoundError, K3ckptError
from ..format.checkpoint import (
    INDEX_NAME,
    SINGLE_NAME,
    Checkpoint,
    SharedHeaders,
    bulk_allocation,
    is_working_file,
    open_checkpoint,
    resolve_root,
)
from .background import BackgroundHashing, HashPlan
from .hashing import FileDigest, Span, hash_files
from .manifest import Manifest
from .report import (
    KINDS,
    WARNING_KINDS,
    Expected,
    Issue,
    VerifyReport,
    content_issue,
    nan_issues,
    render_verify,
    summarize_counts,
)
from .scales import manifest_scale_files, rescan_scales, scale_spans, scan_files, shard_scale_spans
from .share import share_marker, verify_share
from .statcache import (
    StatCache,
    cache_dir,
    cached_digest_known,
    cached_digest_matches,
    record_verified,
    settle_proofs,
    stat_key,
    stat_present,
)
from .structure import layout_matches, structure_issues

__all__ = [
    "KINDS",
    "WARNING_KINDS",
    "Expected",
    "Issue",
    "StatCache",
    "VerifyReport",
    "cache_dir",
    "record_verified",
    "render_verify",
    "rescan_scales",
    "scale_spans",
    "scan_files",
    "shard_scale_spans",
    "stat_present",
    "structure_issues",
    "summarize_counts",
    "verify_checkpoint",
]


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _manifest_and_share(path: str | os.PathLike[str], root: Path, jobs: int | None) -> tuple[Manifest, Checkpoint]:
    """The manifest at ``path`` and the share at ``root`` opened meanwhile: its headers are read
    (in forked workers at scale) in another thread while this one parses the manifest - at K3's
    497k tensors 3.8-4.2 s instead of 5.1 in turn, on two cores. A bad manifest is said first,
    as when it is loaded first."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        opening = pool.submit(open_checkpoint, root, jobs=jobs, strict=False)
        try:
            manifest = Manifest.load(path)
        except BaseException:
            opening.cancel()  # if it has not started; else the pool's exit waits for it
            raise
        return manifest, opening.result()


def _cyclic_gc_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` with the cyclic GC paused while it runs (:func:`bulk_allocation`) and resumed
    after its frame - and the headers, manifest and checkpoint model it held - is gone: a verify
    run builds ~10^5 acyclic objects per GB of checkpoint (1 GB of K3-like shards), and the
    collections that walked them again and again took 25-50 ms of its CPU."""
    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with bulk_allocation():
            return fn(*args, **kwargs)

    return paused


@_cyclic_gc_paused
def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    manifest: Manifest | None = None,
    manifest_path: str | os.PathLike[str] | None = None,
    manifest_label: str | None = None,
    expected_files: dict[str, Expected] | None = None,
    reference: str | None = None,
    quick: bool = False,
    scan: bool = True,
    jobs: int | None = None,
    use_cache: bool = True,
    cache_directory: Path | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Verify the checkpoint at ``path``.

    Args:
        manifest: expected files and tensors (with tensor hashes when it has them).
        manifest_path: the manifest as a file, loaded here (instead of ``manifest``): a full run
            starts hashing before it is parsed, and the report is the same as with ``manifest``.
        expected_files: expected files from elsewhere (a hub listing); ignored with ``manifest``.
        reference: how to name the reference in the report.
        quick: sizes and structure only; content comes from the stat cache where it can.
        scan: look for NaN (0xFF) scale bytes in E8M0 ``weight_scale`` tensors.
        progress: called with byte counts as files are hashed; ``on_plan`` first with the total.

    A *share* (a node directory or a rank-aware fetch's copy, by its marker) is checked by what
    it holds, tensor by tensor: see :mod:`k3ckpt.integrity.share`.

    Raises:
        CheckpointNotFoundError, IndexFileError: there is no checkpoint to verify (exit 2).
        ManifestError: ``manifest_path`` is not a readable manifest (exit 2; said before a
            missing checkpoint is, as when the caller loads it first).
        ShareReferenceError: a share's rewritten shards, and a reference without tensor hashes (exit 2).
    """
    t0 = time.perf_counter()
    if manifest is not None and manifest_path is not None:
        raise ValueError("give manifest or manifest_path, not both")
    try:
        root, _ = resolve_root(path)
        _refuse_unfinished_fetch(root)
    except K3ckptError:
        if manifest_path is not None:
            Manifest.load(manifest_path)  # a bad manifest is named first, as when the caller loads it
        raise
    if manifest_path is not None:
        manifest_label = manifest_label or os.fspath(manifest_path)
    if manifest is not None or manifest_path is not None:
        ref = reference or f"manifest {manifest_label or ''}".strip()
    elif expected_files is not None:
        ref = reference or "hub listing"
    else:
        ref = "none (structure only)"
    report = VerifyReport(str(root), "quick" if quick else "full", ref)
    cache = StatCache(root, cache_directory) if use_cache else None
    issues = report.issues

    share = share_marker(root)
    manifest_file = manifest_path
    opened: Checkpoint | None = None
    if manifest_path is not None and share is not None:
        manifest, opened = _manifest_and_share(manifest_path, root, jobs)
        manifest_path = None
    elif manifest_path is not None and quick:  # nothing to start before it
        manifest, manifest_path = Manifest.load(manifest_path), None
    if share is not None:
        verify_share(root, *share, report, manifest=manifest, expected=_expected(manifest, expected_files),
                     quick=quick, scan=scan, jobs=jobs, cache=cache, progress=progress, on_plan=on_plan,
                     ckpt=opened)
        if cache is not None and manifest_file is not None and not quick and any(report.proofs.values()):
            cache.note_manifest(manifest_file)  # reshard of the share takes its tensor digests (docs/trust.md)
        return _finish(report, cache, t0)

    present, stats = stat_present(root, report)
    headers = SharedHeaders(root)
    cancel = threading.Event()
    hashing: BackgroundHashing | None = None
    if manifest_path is not None:
        # Hash from the moment the files are listed: the manifest (and the headers) are parsed
        # while the hashing threads read; the files the manifest does not ask for are skipped
        # from then on, and any hashed before it said so are left out of the report.
        hashing = BackgroundHashing(root, stats, jobs=jobs, headers=headers if scan else None, progress=progress,
                           cancel=cancel)
        try:
            manifest = Manifest.load(manifest_path)
        except BaseException:
            hashing.stop()
            raise
    try:  # (an error or Ctrl-C from here on also stops the hashing that may have started)
        expected = _expected(manifest, expected_files)
        hits = {f: cache.lookup(f, st) for f, st in stats.items()} if cache is not None else {}
        checked: dict[str, str] = {}  # file -> the reference it was found equal to in this run

        # In quick mode an unchanged directory (same stat for every file) keeps its previous
        # structure verdict and scan results, so the headers need not even be parsed.
        structure_key = _structure_key(stats, manifest, scan)
        reuse = (quick and cache is not None and cache.structure.get("key") == structure_key
                 and (not scan or all(h is not None and h.get("scan_ok") is not None for h in hits.values())))

        # -- file set and sizes -----------------------------------------------------------------------
        if expected:
            for f in sorted(expected.keys() - set(present)):
                issues.append(Issue("missing-file", f, "listed in the reference but not present"))
            for f in sorted(set(present) - expected.keys()):
                issues.append(Issue("extra-file", f, "present but not in the reference"))
        size_bad = set()
        for f in sorted(expected.keys() & stats.keys()):
            if stats[f].st_size != expected[f].size:
                size_bad.add(f)
                issues.append(Issue("size", f, "size differs", expected=str(expected[f].size), actual=str(stats[f].st_size)))
        tensor_spans = manifest.spans_by_file() if manifest is not None and manifest.tensor_hashes else {}

        def checkable(f: str) -> bool:
            exp = expected.get(f)
            return bool(exp is not None and (exp.sha256 or exp.git_sha1) and (f not in size_bad or f in tensor_spans))

        # -- full mode: hash in the background while the structure is checked -------------------------
        ckpt: Checkpoint | None = None
        if not quick:
            if scan and manifest is not None:
                # Which files the manifest says hold scales: hashed for the scan even when there is
                # no digest to check (none when every file has one: nothing to look up then).
                unchecked = any(not checkable(f) for f in stats)
                scan_files = manifest_scale_files(manifest) if unchecked else set()
            elif scan:
                ckpt = open_checkpoint(root, jobs=jobs, strict=False, headers=headers)
                scan_files = {f for f, h in ckpt.shards.items() if shard_scale_spans(h)}
            else:
                scan_files = set()
            to_hash = [f for f in sorted(stats) if checkable(f) or f in scan_files]
            plan = HashPlan(set(to_hash),
                         spans={f: tensor_spans[f] for f in to_hash if f in tensor_spans},
                         git_sha1={f for f in to_hash if (e := expected.get(f)) and not e.sha256 and e.git_sha1})
            if hashing is not None:
                hashing.decide(plan)  # before the total is announced: no unplanned byte is counted after it
            if on_plan is not None and to_hash:
                on_plan(sum(stats[f].st_size for f in to_hash))
            if hashing is None and to_hash:
                hashing = BackgroundHashing(root, stats, jobs=jobs, headers=headers if scan else None, progress=progress,
                                   cancel=cancel, plan=plan)

        # -- structure: reuse the previous verdict when nothing it depends on changed ---------------
        same_layout = False
        if reuse:
            assert cache is not None
            structure = [Issue(**i) for i in cache.structure.get("issues", [])]
            for f, h in sorted(hits.items()):
                structure += nan_issues(f, (h or {}).get("flagged") or [])
            report.structure_cached = True
        else:
            # While threads hash, the headers are parsed here, not in forked worker processes:
            # the cores are busy hashing already (workers cost ~0.15 CPU-s more on 16 shards of
            # 3 GB for no wall time), and forking a process with running threads risks a child
            # that inherits a lock held by one of them.
            ckpt = ckpt or open_checkpoint(root, jobs=1 if hashing is not None else jobs, strict=False,
                                           headers=headers)
            same_layout = manifest is not None and layout_matches(ckpt, manifest)
            structure = structure_issues(ckpt, manifest, same_layout=same_layout)
            if cache is not None:
                cache.structure = {"key": structure_key, "issues": [asdict(i) for i in structure]}
        named = {i.file for i in structure if i.kind == "missing-file"}  # the index check named them once
        issues[:] = [i for i in issues if not (i.kind == "missing-file" and i.file in named)] + structure
        digests, errors = hashing.result() if hashing is not None else ({}, {})
        header_scan_spans = _header_scale_spans(ckpt, hashing) if scan and ckpt is not None else {}
        rescan: list[str] = []
        unscanned: set[str] = set()
        if hashing is not None:
            # The hashing read scanned each file by the spans of the header it read itself: keep
            # that verdict where they are the structure check's spans, else scan by the latter.
            disagree = {f for f in header_scan_spans.keys() - digests.keys() if f not in errors}
            disagree |= {f for f, d in digests.items() if hashing.scanned[f] != header_scan_spans.get(f, [])}
            rescan = sorted(disagree & header_scan_spans.keys())  # unreadable headers: nothing to scan by
            unscanned = disagree - header_scan_spans.keys()
            # (a manifest's tensor digests are checked even where the file digest matches: reshard
            # trusts them only for files whose tensors verify found equal to them)
            redo = {f: tensor_spans[f] for f, d in digests.items() if f in tensor_spans and d.spans is None}
            if redo:  # hashed to the end before the manifest said it has tensor hashes: read again
                again, failed = hash_files(root, sorted(redo), jobs=jobs, spans=redo, cancel=cancel)
                for f, d in again.items():
                    digests[f].spans = d.spans
                errors.update(failed)
        elif scan and ckpt is not None and not quick:
            rescan = sorted(header_scan_spans)  # (nothing was hashed: no reference, no scale spans expected)

        # -- quick mode: trust the stat cache ---------------------------------------------------------
        to_scan: list[str] = list(rescan)
        if quick:
            for f in sorted(stats):
                hit = hits.get(f)
                exp = expected.get(f)
                if checkable(f):
                    assert exp is not None
                    if hit and cached_digest_matches(hit, exp):
                        report.files_trusted.append(f)
                        checked[f] = report.reference
                    elif hit and cached_digest_known(hit, exp):
                        issues.append(content_issue(f, exp, hit))  # known bad, from the last full run
                        for name, got in sorted((hit.get("bad_tensors") or {}).items()):
                            want = manifest.tensors[name].sha256 if manifest and name in manifest.tensors else None
                            issues.append(Issue("tensor-sha256", f, "tensor bytes differ", tensor=name, expected=want,
                                                actual=got))
                    else:
                        report.files_size_only.append(f)
                if ckpt is not None and scan:
                    if f in header_scan_spans and not (hit and hit.get("scan_ok") is True):
                        to_scan.append(f)
                    elif f not in header_scan_spans and cache is not None:
                        cache.record(f, stats[f], scan_ok=True, flagged=[])  # nothing to scan in it

        for f, err in sorted(errors.items()):
            issues.append(Issue("unreadable", f, str(err.strerror)))
        for f, d in sorted(digests.items()):
            report.files_hashed += 1
            report.bytes_hashed += d.size
            exp = expected.get(f)
            tensor_issues = _tensor_hash_issues(f, d, manifest) if d.spans and manifest is not None else []
            # Tensors wholly beyond the end of a short file: its size issue says it. (tensor_issues
            # come from the manifest and name their tensor; the checks only narrow the types.)
            if f in size_bad and manifest is not None:
                tensor_issues = [i for i in tensor_issues
                                 if i.tensor is not None and manifest.tensors[i.tensor].offsets[0] < d.size]
            matched = exp is not None and _digest_matches(d, exp) and f not in size_bad and not tensor_issues
            if matched:
                checked[f] = report.reference
            if exp is not None and not _digest_matches(d, exp) and f not in size_bad:
                issue = content_issue(f, exp, {"sha256": d.sha256, "git_sha1": d.git_sha1})
                if d.spans and not tensor_issues:  # every tensor matched: the header or padding changed
                    issue = Issue(issue.kind, f, "content differs outside the tensor data (header or padding)",
                                  expected=issue.expected, actual=issue.actual)
                issues.append(issue)
            issues += tensor_issues
            scanned = scan and f not in rescan and f not in unscanned  # else the rescan decides
            if scanned:
                issues += nan_issues(f, d.flagged or [])
            if cache is not None:
                cache.record(f, stats[f], sha256=d.sha256, git_sha1=d.git_sha1,
                             bad_tensors={i.tensor: i.actual for i in tensor_issues},
                             **({"proven": report.reference} if matched else {}),
                             **({"scan_ok": not d.flagged, "flagged": d.flagged or []} if scanned else {}))
    except BaseException:
        cancel.set()  # stop the background hashing too: an error or Ctrl-C ends the run now
        if hashing is not None:
            hashing.stop(wait=False)
        raise
    issues += rescan_scales(root, to_scan, header_scan_spans, jobs, stats, cache)
    settle_proofs(report, stats, hits, checked)
    if cache is not None and manifest_path is not None and checked:
        cache.note_manifest(manifest_path)  # reshard takes tensor digests from it (docs/trust.md)
    return _finish(report, cache, t0)


def _refuse_unfinished_fetch(root: Path) -> None:
    """A directory a fetch is still writing (or was killed writing) has its working files and no
    index yet (the index and a share's marker are written last): say so, not "no checkpoint".

    Raises:
        CheckpointNotFoundError: exit 2; nothing there can be verified yet.
    """
    if (root / INDEX_NAME).exists() or (root / SINGLE_NAME).exists():
        return
    working = sorted(f for f in os.listdir(root) if is_working_file(f))
    if working:
        raise CheckpointNotFoundError(
            f"{root}: an unfinished fetch ({len(working)} working file{'s' if len(working) != 1 else ''} such as "
            f"{working[0]}, no {INDEX_NAME} yet): run the same fetch again to resume it, then verify")


def _finish(report: VerifyReport, cache: StatCache | None, t0: float) -> VerifyReport:
    """Save the stat cache, order the issues by kind, time the run."""
    if cache is not None:
        cache.save()
    order = {k: i for i, k in enumerate(KINDS)}
    report.issues = sorted(report.issues, key=lambda i: (order.get(i.kind, 99), i.file or "", i.tensor or ""))
    report.seconds = round(time.perf_counter() - t0, 3)
    return report


def _structure_key(stats: dict[str, os.stat_result], manifest: Manifest | None, scan: bool) -> str:
    h = hashlib.sha256()
    for f in sorted(stats):
        h.update(f"{f}\0{stat_key(stats[f])}\n".encode())
    if manifest is not None:
        h.update(manifest.fingerprint().encode())
    h.update(b"scan" if scan else b"noscan")
    return h.hexdigest()


def _header_scale_spans(ckpt: Checkpoint, hashing: BackgroundHashing | None) -> dict[str, list[Span]]:
    """:func:`scale_spans` of ``ckpt``, taking the spans a hashing thread derived from the very
    same header object instead of deriving them again."""
    out: dict[str, list[Span]] = {}
    for file, h in ckpt.shards.items():
        spans = hashing.spans_of(file, h) if hashing is not None else None
        if spans is None:
            spans = shard_scale_spans(h)
        if spans:
            out[file] = spans
    return out


def _expected(manifest: Manifest | None, expected_files: dict[str, Expected] | None) -> dict[str, Expected]:
    """What each file should be: the manifest's files, else the hub listing's, else nothing."""
    if manifest is not None:
        return {f: Expected(e.size, e.sha256) for f, e in manifest.files.items()}
    return dict(expected_files) if expected_files is not None else {}


def _digest_matches(d: FileDigest, exp: Expected) -> bool:
    if exp.sha256:
        return d.sha256 == exp.sha256
    return exp.git_sha1 is None or d.git_sha1 == exp.git_sha1


def _tensor_hash_issues(f: str, d: FileDigest, manifest: Manifest) -> list[Issue]:
    out = []
    for name, got in sorted((d.spans or {}).items()):
        want = manifest.tensors[name].sha256
        if want and got != want:
            out.append(Issue("tensor-sha256", f, "tensor bytes differ", tensor=name, expected=want, actual=got))
    return out

