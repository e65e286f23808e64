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
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from ..env import K3CKPT_CACHE_DIR, K3CKPT_HASH_BUFFER
from ..errors import CheckpointNotFoundError, K3ckptError
from ..format.checkpoint import (
    INDEX_NAME,
    SINGLE_NAME,
    Checkpoint,
    SharedHeaders,
    bulk_allocation,
    is_working_file,
    iter_checkpoint_files,
    open_checkpoint,
    resolve_root,
)
from ..utils import write_atomic
from . import hashing as _hashing  # (hash_file looked up at call time: tests and profiles replace it)
from .hashing import FileDigest, HashError, Progress, Span, _span_start, hash_files, scan_file
from .manifest import Manifest, tensors_from_headers

if TYPE_CHECKING:
    from ..format.header import ShardHeader
    from .share import ShareFacts

#: Order in which kinds are reported (most fundamental first).
KINDS = (
    "missing-file", "missing-tensor", "unreadable", "size", "sha256", "tensor-sha256", "tensor-layout", "header",
    "index", "path", "config", "mxfp4", "nan-scale", "extra-file",
)
#: Kinds that are warnings: reported, but do not fail verification.
WARNING_KINDS = frozenset({"extra-file"})


@dataclass(frozen=True)
class Issue:
    kind: str
    file: str | None
    message: str
    tensor: str | None = None
    expected: str | None = None
    actual: str | None = None

    @property
    def is_warning(self) -> bool:
        return self.kind in WARNING_KINDS

    def __str__(self) -> str:
        where = self.file or ""
        if self.tensor:
            where += f" tensor {self.tensor}" if where else f"tensor {self.tensor}"
        exp = f" (expected {self.expected}, got {self.actual})" if self.expected is not None else ""
        return f"{where}: {self.message}{exp}" if where else f"{self.message}{exp}"


@dataclass(frozen=True)
class Expected:
    """What a file should be, from a manifest or a hub listing."""

    size: int
    sha256: str | None = None
    git_sha1: str | None = None


@dataclass
class VerifyReport:
    root: str
    mode: str  # "full" | "quick"
    reference: str  # "manifest <path>", "hf:<repo>@<rev>", or "none (structure only)"
    files: int = 0
    files_hashed: int = 0
    bytes_hashed: int = 0
    files_trusted: list[str] = field(default_factory=list)  # content trusted from the stat cache
    files_size_only: list[str] = field(default_factory=list)  # quick mode, no cached digest
    structure_cached: bool = False
    seconds: float = 0.0
    issues: list[Issue] = field(default_factory=list)
    share: ShareFacts | None = None  # a node directory or rank-aware copy: what it holds, what was checked

    @property
    def problems(self) -> list[Issue]:
        return [i for i in self.issues if not i.is_warning]

    @property
    def ok(self) -> bool:
        return not self.problems

    def grouped(self) -> dict[str, list[Issue]]:
        out: dict[str, list[Issue]] = {}
        for kind in KINDS:
            got = [i for i in self.issues if i.kind == kind]
            if got:
                out[kind] = got
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["issues"] = {k: [asdict(i) for i in v] for k, v in self.grouped().items()}
        return d


# -- the stat cache ---------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$K3CKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/k3ckpt``, else ``~/.cache/k3ckpt``."""
    env = K3CKPT_CACHE_DIR.get()
    if env is not None:
        return env
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "k3ckpt"


def _stat_key(st: os.stat_result) -> list[int]:
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
        return e if e is not None and e.get("stat") == _stat_key(st) else None

    def record(self, rel: str, st: os.stat_result, **facts: Any) -> None:
        prev = self.lookup(rel, st) or {}
        self.files[rel] = {**prev, **facts, "stat": _stat_key(st)}

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


# -- verification -----------------------------------------------------------------------------


_P = ParamSpec("_P")
_R = TypeVar("_R")


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
    from .share import share_marker, verify_share

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
    if manifest_path is not None and (quick or share is not None):  # nothing to start before it
        manifest, manifest_path = Manifest.load(manifest_path), None
    if share is not None:
        verify_share(root, *share, report, manifest=manifest, expected=_expected(manifest, expected_files),
                     quick=quick, scan=scan, jobs=jobs, cache=cache, progress=progress, on_plan=on_plan)
        return _finish(report, cache, t0)

    present, stats = stat_present(root, report)
    headers = SharedHeaders(root)
    cancel = threading.Event()
    hashing: _Hashing | None = None
    if manifest_path is not None:
        # Hash from the moment the files are listed: the manifest (and the headers) are parsed
        # while the hashing threads read; the files the manifest does not ask for are skipped
        # from then on, and any hashed before it said so are left out of the report.
        hashing = _Hashing(root, stats, jobs=jobs, headers=headers if scan else None, progress=progress,
                           cancel=cancel)
        try:
            manifest = Manifest.load(manifest_path)
        except BaseException:
            hashing.stop()
            raise
    try:  # (an error or Ctrl-C from here on also stops the hashing that may have started)
        expected = _expected(manifest, expected_files)
        hits = {f: cache.lookup(f, st) for f, st in stats.items()} if cache is not None else {}

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
                scan_files = _manifest_scale_files(manifest) if unchecked else set()
            elif scan:
                ckpt = open_checkpoint(root, jobs=jobs, strict=False, headers=headers)
                scan_files = {f for f, h in ckpt.shards.items() if shard_scale_spans(h)}
            else:
                scan_files = set()
            to_hash = [f for f in sorted(stats) if checkable(f) or f in scan_files]
            if on_plan is not None and to_hash:
                on_plan(sum(stats[f].st_size for f in to_hash))
            plan = _Plan(set(to_hash),
                         spans={f: tensor_spans[f] for f in to_hash if f in tensor_spans},
                         git_sha1={f for f in to_hash if (e := expected.get(f)) and not e.sha256 and e.git_sha1})
            if hashing is None and to_hash:
                hashing = _Hashing(root, stats, jobs=jobs, headers=headers if scan else None, progress=progress,
                                   cancel=cancel, plan=plan)
            elif hashing is not None:
                hashing.decide(plan)

        # -- structure: reuse the previous verdict when nothing it depends on changed ---------------
        same_layout = False
        if reuse:
            assert cache is not None
            structure = [Issue(**i) for i in cache.structure.get("issues", [])]
            for f, h in sorted(hits.items()):
                structure += _nan_issues(f, (h or {}).get("flagged") or [])
            report.structure_cached = True
        else:
            # While threads hash, the headers are parsed here, not in forked worker processes:
            # the cores are busy hashing already (workers cost ~0.15 CPU-s more on 16 shards of
            # 3 GB for no wall time), and forking a process with running threads risks a child
            # that inherits a lock held by one of them.
            ckpt = ckpt or open_checkpoint(root, jobs=1 if hashing is not None else jobs, strict=False,
                                           headers=headers)
            same_layout = manifest is not None and _same_layout(ckpt, manifest)
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
                    if hit and _cached_digest_matches(hit, exp):
                        report.files_trusted.append(f)
                    elif hit and _cached_digest_known(hit, exp):
                        issues.append(_content_issue(f, exp, hit))  # known bad, from the last full run
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
            if exp is not None and not _digest_matches(d, exp) and f not in size_bad:
                issue = _content_issue(f, exp, {"sha256": d.sha256, "git_sha1": d.git_sha1})
                if d.spans and not tensor_issues:  # every tensor matched: the header or padding changed
                    issue = Issue(issue.kind, f, "content differs outside the tensor data (header or padding)",
                                  expected=issue.expected, actual=issue.actual)
                issues.append(issue)
            issues += tensor_issues
            scanned = scan and f not in rescan and f not in unscanned  # else the rescan decides
            if scanned:
                issues += _nan_issues(f, d.flagged or [])
            if cache is not None:
                cache.record(f, stats[f], sha256=d.sha256, git_sha1=d.git_sha1,
                             bad_tensors={i.tensor: i.actual for i in tensor_issues},
                             **({"scan_ok": not d.flagged, "flagged": d.flagged or []} if scanned else {}))
    except BaseException:
        cancel.set()  # stop the background hashing too: an error or Ctrl-C ends the run now
        if hashing is not None:
            hashing.stop(wait=False)
        raise
    issues += rescan_scales(root, to_scan, header_scan_spans, jobs, stats, cache)

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


def rescan_scales(root: Path, files: list[str], spans: dict[str, list[Span]], jobs: int | None,
                  stats: dict[str, os.stat_result], cache: StatCache | None) -> list[Issue]:
    """The NaN-scale scan of ``files`` that the hashing read could not cover (the stat cache's
    verdict was stale, or the manifest's spans disagreed with the headers), recorded in the cache."""
    issues: list[Issue] = []
    if not files:
        return issues
    for f, flagged in scan_files(root, files, spans, jobs).items():
        if isinstance(flagged, HashError):
            issues.append(Issue("unreadable", f, str(flagged.strerror)))
            continue
        issues += _nan_issues(f, flagged)
        if cache is not None:
            cache.record(f, stats[f], scan_ok=not flagged, flagged=flagged)
    return issues


def _structure_key(stats: dict[str, os.stat_result], manifest: Manifest | None, scan: bool) -> str:
    h = hashlib.sha256()
    for f in sorted(stats):
        h.update(f"{f}\0{_stat_key(stats[f])}\n".encode())
    if manifest is not None:
        h.update(manifest.fingerprint().encode())
    h.update(b"scan" if scan else b"noscan")
    return h.hexdigest()


def structure_issues(ckpt: Checkpoint, manifest: Manifest | None, *, same_layout: bool | None = None) -> list[Issue]:
    """The structure problems of ``ckpt`` (and, with ``manifest``, where its layout differs from
    the headers'); ``same_layout``: :func:`_same_layout` of the two when the caller has it."""
    from ..format.inspect import inspect_checkpoint
    from ..format.layout import NODE_MARKER, LayoutError, read_node_marker

    out = [Issue(p.kind, p.where if p.kind != "index" else None, p.message,
                 tensor=p.where if p.kind == "index" else None) for p in ckpt.problems]
    out += _path_issues(ckpt)
    # a `reshard --format hf-node` directory holds only its node's experts, which its marker lists
    try:
        marker = read_node_marker(ckpt.root)
    except LayoutError as e:
        marker = None
        out.append(Issue("config", os.path.basename(str(e).split(": ", 1)[0]) or NODE_MARKER, str(e).split(": ", 1)[-1]))
    experts = marker["experts"] if marker is not None else None
    for f in inspect_checkpoint(ckpt, experts=experts).findings:
        if f.severity != "error" or any(f.message == p.message for p in ckpt.problems):
            continue
        mx = any(w in f.where or w in f.message for w in ("weight_packed", "weight_scale", "_blocks", "_scales"))
        kind = "mxfp4" if mx else "config"
        t = ckpt.tensors.get(f.where)
        if t is not None:  # the finding names one tensor: say which file holds it
            out.append(Issue(kind, t.file, f.message, tensor=f.where))
        else:
            out.append(Issue(kind, None, f"{f.where}: {f.message}"))
    if manifest is not None:
        out += _layout_issues(ckpt, manifest, same_layout)
    return out


def _path_issues(ckpt: Checkpoint) -> list[Issue]:
    """Files that are symlinks leading out of the checkpoint (an HF cache snapshot's links into
    its own ``blobs/`` are how the cache is built, and allowed)."""
    out = []
    root = ckpt.root.resolve()
    allowed = [root]
    if ckpt.source.layout == "hf-cache":
        allowed.append((ckpt.root.parent.parent / "blobs").resolve())
    for f in ckpt.iter_files():
        p = ckpt.root / f
        if not p.is_symlink():
            continue
        target = p.resolve()
        if not any(target == a or a in target.parents for a in allowed):
            out.append(Issue("path", f, f"is a symlink leading out of the checkpoint, to {target}"))
    return out


def _layout_issues(ckpt: Checkpoint, manifest: Manifest, same: bool | None = None) -> list[Issue]:
    """Tensors the manifest describes differently from the headers (or not at all); ``same``:
    :func:`_same_layout`, when known."""
    if same if same is not None else _same_layout(ckpt, manifest):
        return []
    actual = tensors_from_headers(ckpt.shards.values())
    bad_files = {p.where for p in ckpt.problems if p.kind in ("header", "missing-file")}
    out = []
    for name in sorted(manifest.tensors.keys() - actual.keys()):
        if manifest.tensors[name].file not in bad_files:
            out.append(Issue("tensor-layout", manifest.tensors[name].file, "in the manifest but in no header", tensor=name))
    for name in sorted(actual.keys() - manifest.tensors.keys()):
        out.append(Issue("tensor-layout", actual[name].file, "in a header but not in the manifest", tensor=name))
    for name in sorted(actual.keys() & manifest.tensors.keys()):
        a, m = actual[name], manifest.tensors[name]
        for attr in ("file", "dtype", "shape", "offsets"):
            if getattr(a, attr) != getattr(m, attr):
                out.append(Issue("tensor-layout", a.file, f"{attr} differs", tensor=name,
                                 expected=str(getattr(m, attr)), actual=str(getattr(a, attr))))
    return out


def _same_layout(ckpt: Checkpoint, manifest: Manifest) -> bool:
    """Do the headers hold exactly the manifest's tensors, each in the same file with the same
    dtype, shape and offsets? The common case, decided shard by shard on columns compared in C
    (``map`` and list equality): building a :class:`TensorEntry` per tensor took verify's main
    thread longer than the rest of its structure check. ``False`` is not a verdict: the caller
    then compares tensor by tensor (and so does any checkpoint with a name in two shards)."""
    m = manifest.tensors
    if not len(ckpt.tensors) == sum(len(h.tensors) for h in ckpt.shards.values()) == len(m):
        return False
    for h in ckpt.shards.values():
        infos = list(h.tensors.values())  # TensorInfo: name, dtype, shape, begin, end, file
        entries: list[Any] = list(map(m.get, h.tensors))  # TensorEntry: file, dtype, shape, offsets, sha256
        if None in entries:
            return False
        ds = h.data_start
        offsets = list(zip(map(ds.__add__, map(_BEGIN, infos)), map(ds.__add__, map(_END, infos))))
        if (set(map(_FILE, entries)) != {h.file} or list(map(_DTYPE, infos)) != list(map(_DTYPE, entries))
                or list(map(_SHAPE, infos)) != list(map(_SHAPE, entries)) or offsets != list(map(_OFFSETS, entries))):
            return False
    return True  # as many names as the manifest has, each found in it: the same set


_FILE, _DTYPE, _SHAPE, _OFFSETS = (operator.itemgetter(i) for i in range(4))  # of a TensorEntry (and 1, 2 of a TensorInfo)
_BEGIN, _END = operator.itemgetter(3), operator.itemgetter(4)  # of a TensorInfo


def scale_spans(ckpt: Checkpoint) -> dict[str, list[Span]]:
    """E8M0 scale tensors (one byte per scale: 0xFF is NaN) by file."""
    out: dict[str, list[Span]] = {}
    for file, h in ckpt.shards.items():
        spans = shard_scale_spans(h)
        if spans:
            out[file] = spans
    return out


def shard_scale_spans(h: ShardHeader) -> list[Span]:
    """:func:`scale_spans` of one shard, in file order (built in C-level loops: half of a K3
    shard's tensors are scales)."""
    ds, tensors = h.data_start, h.tensors
    infos = [t for t in map(tensors.__getitem__, filter(_is_scale_name, tensors)) if t.dtype in _E8M0_DTYPES]
    starts = list(map(ds.__add__, map(_BEGIN, infos)))
    spans = list(map(_new_span, zip(map(_NAME, infos), starts, map(ds.__add__, map(_END, infos)))))
    return spans if starts == sorted(starts) else sorted(spans, key=_span_start)


_new_span = partial(tuple.__new__, Span)
_NAME = operator.itemgetter(0)  # of a TensorInfo


def _header_scale_spans(ckpt: Checkpoint, hashing: _Hashing | None) -> dict[str, list[Span]]:
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


def _manifest_scale_files(manifest: Manifest) -> set[str]:
    """The files that hold E8M0 scale tensors, as the manifest describes them."""
    tensors = manifest.tensors
    return {t.file for n in filter(_is_scale_name, tensors) if (t := tensors[n]).dtype in _E8M0_DTYPES}


def _expected(manifest: Manifest | None, expected_files: dict[str, Expected] | None) -> dict[str, Expected]:
    """What each file should be: the manifest's files, else the hub listing's, else nothing."""
    if manifest is not None:
        return {f: Expected(e.size, e.sha256) for f, e in manifest.files.items()}
    return dict(expected_files) if expected_files is not None else {}


@dataclass
class _Plan:
    """Which files a verify run hashes (``files``), which tensors' digests it takes in the same
    read (``spans``), and which files also get a git blob id (``git_sha1``)."""

    files: set[str]
    spans: dict[str, list[Span]] = field(default_factory=dict)
    git_sha1: set[str] = field(default_factory=set)


class _ShortTurns:
    """While hashing threads run, the GIL changes hands every 0.5 ms instead of Python's 5: a
    thread that has hashed its chunk needs the GIL for a moment to begin the next, and while the
    main thread runs Python (the structure check) it waited up to 5 ms for it - at times both
    threads at once, leaving a core idle (2 files hashed next to 0.12 s of Python: 0.31 -> 0.25 s).
    Counted, so that overlapping runs restore the interval once, when the last one ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = sys.getswitchinterval()

    def enter(self) -> None:
        with self._lock:
            if not self._users:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, 0.0005))
            self._users += 1

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            if not self._users:
                sys.setswitchinterval(self._saved)


_SHORT_TURNS = _ShortTurns()


class _Hashing:
    """Files hashed in background threads, largest first, each scanned for NaN scale bytes by
    the spans of its own header in the same read.

    Started with a :class:`_Plan`, or without one to start at once - before the manifest is
    parsed - over every file listed; :meth:`decide` then says which files the run wants: files
    not yet begun that it does not want are skipped, any finished before it said so are left out
    of :meth:`result`.
    """

    def __init__(self, root: Path, stats: dict[str, os.stat_result], *, jobs: int | None,
                 headers: SharedHeaders | None, progress: Progress | None, cancel: threading.Event,
                 plan: _Plan | None = None) -> None:
        self._root, self._headers, self._progress, self._cancel = root, headers, progress, cancel
        self._plan = plan
        files = sorted(plan.files if plan is not None else stats, key=lambda f: -stats[f].st_size)
        self._todo = iter(files)  # big files first: the last thread to finish idles least
        self._lock = threading.Lock()
        self._chunk = K3CKPT_HASH_BUFFER.get()  # here, not in the threads: a bad value stops the run once
        self.digests: dict[str, FileDigest] = {}
        self.errors: dict[str, HashError] = {}
        self.scanned: dict[str, list[Span]] = {}  # the spans each file was scanned by
        self._header_of: dict[str, ShardHeader] = {}  # the header those spans came from
        self._unplanned: dict[str, threading.Event] = {}  # files begun before the plan: their own cancel
        self._failed: list[BaseException] = []  # what a thread raised other than a file's HashError (a bug)
        workers = self._running = max(1, min(jobs or os.cpu_count() or 1, len(files)))
        _SHORT_TURNS.enter()  # until the last thread is done (see _work)
        # Plain threads, not a ThreadPoolExecutor: concurrent.futures (with logging) is 6 ms of
        # imports before the first hashed byte.
        self._threads = [threading.Thread(target=self._work, name=f"k3ckpt-hash-{i}") for i in range(workers)]
        for t in self._threads:
            t.start()

    def decide(self, plan: _Plan) -> None:
        """From now on hash what ``plan`` says; a file being hashed that it does not want stops
        at its next chunk (a large stray file would otherwise be read to its end for nothing)."""
        with self._lock:
            self._plan = plan
            for f, stop in self._unplanned.items():
                if f not in plan.files:
                    stop.set()

    def stop(self, wait: bool = True) -> None:
        """Cancel every thread at its next chunk, and wait for them (``wait``)."""
        with self._lock:
            self._cancel.set()
            for stop in self._unplanned.values():
                stop.set()
        if wait:
            for t in self._threads:
                t.join()

    def result(self) -> tuple[dict[str, FileDigest], dict[str, HashError]]:
        """Digests and errors of the planned files, once every thread is done."""
        for t in self._threads:
            t.join()
        if self._failed:
            raise self._failed[0]
        files = self._plan.files if self._plan is not None else set()
        return ({f: d for f, d in self.digests.items() if f in files},
                {f: e for f, e in self.errors.items() if f in files})

    def spans_of(self, file: str, header: ShardHeader) -> list[Span] | None:
        """The scale spans a thread derived from ``header`` (this very object), else ``None``."""
        return self.scanned.get(file) if self._header_of.get(file) is header else None

    def _spans_decided(self, f: str) -> Sequence[Span] | None:
        """The tensor spans of ``f`` once the plan is decided (``None`` until then)."""
        plan = self._plan
        return plan.spans.get(f, ()) if plan is not None else None

    def _progress_if_wanted(self, f: str, progress: Progress, n: int) -> None:
        """``progress(n)`` unless the plan, decided since ``f`` was begun, does not want ``f``
        (its bytes are not in the total the plan announced)."""
        plan = self._plan
        if plan is None or f in plan.files:
            progress(n)

    def _work(self) -> None:
        try:
            while True:
                with self._lock:
                    f = next(self._todo, None)
                if f is None:
                    return
                plan = self._plan  # (read once: the main thread may decide meanwhile)
                if plan is None or f in plan.files:
                    self._one(f, plan)
        except BaseException as e:  # raised in the main thread by result()
            self._failed.append(e)
        finally:
            with self._lock:
                self._running -= 1
                last = not self._running
            if last:
                _SHORT_TURNS.leave()

    def _one(self, f: str, plan: _Plan | None) -> None:
        path = self._root / f
        if self._cancel.is_set():
            with self._lock:
                self.errors[f] = HashError(0, "cancelled", str(path))
            return
        scan: list[Span] = []

        def scale_spans_once_parsed(now: bool) -> list[Span] | None:
            # Not parsed here before hashing: a parse holds the GIL (JSON), and so would keep
            # this thread from starting while the main thread parses the manifest. The main
            # thread's structure check parses the headers; the spans follow once it did.
            assert self._headers is not None
            try:
                header = self._headers.get(f) if now else self._headers.parsed(f)
            except K3ckptError:
                return []  # the structure check reports it; without spans the file is not scanned here
            if header is None:
                return None
            scan[:] = shard_scale_spans(header)
            with self._lock:
                self._header_of[f] = header
            return scan

        progress, cancel = self._progress, self._cancel
        if plan is None:
            if progress is not None:
                progress = partial(self._progress_if_wanted, f, progress)
            with self._lock:
                cancel = self._unplanned[f] = threading.Event()
                if self._cancel.is_set() or (self._plan is not None and f not in self._plan.files):
                    cancel.set()  # (stopped, or decided, since this thread looked)
        scanning = self._headers is not None and f.endswith(".safetensors")
        try:
            d = _hashing.hash_file(path, rel=f, spans=plan.spans.get(f, ()) if plan is not None else (),
                                   git_sha1=plan is not None and f in plan.git_sha1, progress=progress,
                                   chunk_bytes=self._chunk, cancel=cancel,
                                   late_spans=partial(self._spans_decided, f) if plan is None else None,
                                   late_scan=scale_spans_once_parsed if scanning else None)
        except HashError as e:
            with self._lock:
                self.errors[f] = e
            return
        with self._lock:
            self.digests[f], self.scanned[f] = d, scan


_E8M0_DTYPES = ("U8", "F8_E8M0")
_SCALE_SUFFIXES = (".weight_scale", "_scales")
_is_scale_name = operator.methodcaller("endswith", _SCALE_SUFFIXES)  # filters names in C


def scan_files(root: Path, files: list[str], spans: dict[str, list[Span]], jobs: int | None,
               progress: Progress | None = None) -> dict[str, Any]:
    """``{file: names of its spans holding a NaN scale byte, or the HashError}``; ``progress``
    gets each file's span bytes once it is scanned."""
    def one(f: str) -> tuple[str, Any]:
        try:
            return f, scan_file(root / f, spans[f])
        except HashError as e:
            return f, e
        finally:
            if progress is not None:
                progress(sum(s.stop - s.start for s in spans[f]))

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(jobs or os.cpu_count() or 1, len(files)))) as ex:
        return dict(ex.map(one, files))


def _nan_issues(file: str, names: list[str]) -> list[Issue]:
    return [Issue("nan-scale", file, "E8M0 scale byte 0xFF (NaN): every weight of its 32-block decodes to NaN",
                  tensor=n) for n in names]


def _digest_matches(d: FileDigest, exp: Expected) -> bool:
    if exp.sha256:
        return d.sha256 == exp.sha256
    return exp.git_sha1 is None or d.git_sha1 == exp.git_sha1


def _cached_digest_known(hit: dict[str, Any], exp: Expected) -> bool:
    return bool((exp.sha256 and hit.get("sha256")) or (not exp.sha256 and exp.git_sha1 and hit.get("git_sha1")))


def _cached_digest_matches(hit: dict[str, Any], exp: Expected) -> bool:
    if exp.sha256:
        return hit.get("sha256") == exp.sha256
    return bool(exp.git_sha1) and hit.get("git_sha1") == exp.git_sha1


def _content_issue(f: str, exp: Expected, got: dict[str, Any]) -> Issue:
    if exp.sha256:
        return Issue("sha256", f, "content differs", expected=exp.sha256, actual=str(got.get("sha256")))
    return Issue("sha256", f, "content differs (git blob id)", expected=exp.git_sha1, actual=str(got.get("git_sha1")))


def _tensor_hash_issues(f: str, d: FileDigest, manifest: Manifest) -> list[Issue]:
    out = []
    for name, got in sorted((d.spans or {}).items()):
        want = manifest.tensors[name].sha256
        if want and got != want:
            out.append(Issue("tensor-sha256", f, "tensor bytes differ", tensor=name, expected=want, actual=got))
    return out


def summarize_counts(report: VerifyReport) -> str:
    counts = Counter(i.kind for i in report.problems)
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def render_verify(rep: VerifyReport) -> str:
    """What ``k3ckpt verify`` prints: one summary line, then the issues grouped by kind (at most
    200 a kind; ``--json`` lists all)."""
    from ..utils import human_bytes

    rate = f" at {human_bytes(rep.bytes_hashed / rep.seconds)}/s" if rep.bytes_hashed and rep.seconds else ""
    head = (f"{'ok' if rep.ok else 'FAILED'}: {rep.root} ({rep.mode}; reference: {rep.reference}): "
            f"{rep.files} files, {rep.files_hashed} hashed ({human_bytes(rep.bytes_hashed)}{rate})")
    if rep.files_trusted:
        head += f", {len(rep.files_trusted)} trusted from the stat cache"
    if rep.files_size_only:
        head += f", {len(rep.files_size_only)} checked by size only (no cached digest)"
    if rep.structure_cached:
        head += ", structure unchanged since the last check"
    head += f", {rep.seconds:.1f} s"
    lines = [head]
    if rep.share is not None:
        lines.append(rep.share.summary())
    for kind, items in rep.grouped().items():
        label = "warning" if items[0].is_warning else "problem"
        lines.append(f"[{kind}] {len(items)} {label}{'s' if len(items) != 1 else ''}")
        lines += [f"  {i}" for i in items[:200]]
        if len(items) > 200:
            lines.append(f"  ... and {len(items) - 200} more (--json lists all)")
    return "\n".join(lines)
