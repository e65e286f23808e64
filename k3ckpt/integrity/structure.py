"""The structure layer of ``verify``: what is wrong with a checkpoint by its headers alone.

:func:`structure_issues` turns the checkpoint model's problems (headers by the strict parser's
rules, the index against the headers), symlinks leading out of the directory, the inspect
report's errors (config against tensors, MoE layers complete, MXFP4 pairs) and - with a
manifest - where its tensor layout differs from the headers' into issues
(:class:`~k3ckpt.integrity.report.Issue`). :func:`layout_matches` (:func:`headers_match`, which a node
fetch's plan uses too) decides the common case (the manifest and the headers agree) in C-level
column compares.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any

from ..format.checkpoint import Checkpoint
from ..format.header import ShardHeader
from .manifest import Manifest, tensors_from_headers
from .report import Issue


def structure_issues(ckpt: Checkpoint, manifest: Manifest | None, *, same_layout: bool | None = None) -> list[Issue]:
    """The structure problems of ``ckpt`` (and, with ``manifest``, where its layout differs from
    the headers'); ``same_layout``: :func:`layout_matches` of the two when the caller has it."""
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
        # realpath, not Path.resolve: a symlink loop must be reported (the checkpoint's opening
        # named it), not raise RuntimeError here (Python < 3.13)
        target = Path(os.path.realpath(p))
        if not any(target == a or a in target.parents for a in allowed):
            out.append(Issue("path", f, f"is a symlink leading out of the checkpoint, to {target}"))
    return out


def _layout_issues(ckpt: Checkpoint, manifest: Manifest, same: bool | None = None) -> list[Issue]:
    """Tensors the manifest describes differently from the headers (or not at all); ``same``:
    :func:`layout_matches`, when known."""
    if same if same is not None else layout_matches(ckpt, manifest):
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


def layout_matches(ckpt: Checkpoint, manifest: Manifest) -> bool:
    """Do the headers hold exactly the manifest's tensors, each in the same file with the same
    dtype, shape and offsets? The common case, decided by :func:`headers_match`. ``False`` is
    not a verdict: the caller then compares tensor by tensor (and so does any checkpoint with a
    name in two shards)."""
    if len(ckpt.tensors) != sum(len(h.tensors) for h in ckpt.shards.values()):
        return False  # a name in two shards
    return headers_match(list(ckpt.shards.values()), manifest)


def headers_match(headers: list[ShardHeader], manifest: Manifest) -> bool:
    """Do ``headers`` (no name in two of them) hold exactly the manifest's tensors, each in the
    same file with the same dtype, shape and absolute offsets? Decided shard by shard on columns
    compared in C (``map`` and list equality), with no object made per tensor: building a
    :class:`TensorEntry` per tensor took verify's main thread longer than the rest of its
    structure check, and a node fetch's plan 2.5 s at K3's 497k tensors."""
    m = manifest.tensors
    if sum(len(h.tensors) for h in headers) != len(m):
        return False
    for h in headers:
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
