"""The NaN-scale scan: which tensors are E8M0 scales and which of their bytes are 0xFF.

An E8M0 ``weight_scale`` (or gpt-oss ``*_scales``) byte 0xFF is NaN: every weight of its
32-block decodes to NaN. :func:`scale_spans` and :func:`shard_scale_spans` find the scale
tensors by the headers, :func:`manifest_scale_files` the files that hold them by a manifest;
the hashing read scans them as it goes (:mod:`k3ckpt.integrity.background`), and
:func:`scan_files` / :func:`rescan_scales` scan what it could not cover.
"""

from __future__ import annotations

import operator
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..format.checkpoint import Checkpoint
from .hashing import HashError, Progress, Span, _span_start, scan_file
from .manifest import Manifest
from .report import Issue, nan_issues
from .statcache import StatCache

if TYPE_CHECKING:
    from ..format.header import ShardHeader

_E8M0_DTYPES = ("U8", "F8_E8M0")
_SCALE_SUFFIXES = (".weight_scale", "_scales")
_is_scale_name = operator.methodcaller("endswith", _SCALE_SUFFIXES)  # filters names in C
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


def manifest_scale_files(manifest: Manifest) -> set[str]:
    """The files that hold E8M0 scale tensors, as the manifest describes them."""
    tensors = manifest.tensors
    return {t.file for n in filter(_is_scale_name, tensors) if (t := tensors[n]).dtype in _E8M0_DTYPES}


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
        issues += nan_issues(f, flagged)
        if cache is not None:
            cache.record(f, stats[f], scan_ok=not flagged, flagged=flagged)
    return issues

