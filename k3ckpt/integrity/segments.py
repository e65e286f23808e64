"""A node or rank file's digest computed from the file on disk: its header's bytes and each
tensor's sha256, in one read of the tensors' bytes
(:func:`~k3ckpt.format.filedigest.segments_sha256`).

``k3ckpt-node.json`` (version 2) records that digest for every node file, and a rank's
``rank-manifest.json`` for every rank file, with the tensors' sha256 beside it: hashing each
byte once gives both. ``verify`` of a share, the offline check of a node fetch, a node fetch
resuming over complete files and ``preflight --full`` of a rank layout check a file this way.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from ..format.filedigest import segments_sha256
from ..format.header import read_header
from .hashing import HashError, Span, hash_file

__all__ = ["SegmentsDigest", "hash_segments", "read_prefix", "segments_of"]

_EMPTY = hashlib.sha256().hexdigest()


@dataclass(frozen=True)
class SegmentsDigest:
    """What :func:`hash_segments` found: the file's size, its segments' digest and each tensor's
    sha256 by name."""

    size: int
    segments_sha256: str
    tensors: dict[str, str]


def read_prefix(path: str | os.PathLike[str], data_start: int) -> bytes:
    """The first ``data_start`` bytes of the file at ``path``: its header as stored (the 8-byte
    length, the JSON and its padding).

    Raises:
        HashError: the file is shorter (changed since its header was read).
    """
    p = os.fspath(path)
    with open(p, "rb") as f:
        prefix = f.read(data_start)
    if len(prefix) != data_start:
        raise HashError(0, f"read {len(prefix)} header bytes, expected {data_start} (changed while hashing?)", p)
    return prefix


def segments_of(prefix: bytes, spans: list[Span], digests: dict[str, str]) -> str:
    """The segments' digest of a file whose header is ``prefix``, from the ``digests`` (by name)
    of its tensors' ``spans`` (absolute offsets; a zero-byte tensor may be absent: its digest is
    the empty one).

    Raises:
        ValueError: the spans do not tile the file after its header.
    """
    return segments_sha256(prefix, ((s.start, s.stop, digests.get(s.name, _EMPTY)) for s in spans))


def hash_segments(path: str | os.PathLike[str], rel: str | None = None) -> SegmentsDigest:
    """Hash the safetensors file at ``path`` by its segments: its header is read and validated,
    then each tensor's bytes are hashed in one read (not the file whole).

    Raises:
        SafetensorsHeaderError: the header is not valid safetensors.
        HashError: the file cannot be read, or changed while it was read.
    """
    p = os.fspath(path)
    header = read_header(p, rel)
    spans = [Span(name, *header.absolute_range(name)) for name in header.tensors]
    digest = hash_file(p, rel=rel, spans=spans, whole=False)
    if digest.size != header.file_size:
        raise HashError(0, f"read {digest.size} bytes but the header was read from a {header.file_size}-byte file "
                           "(changed while hashing?)", p)
    tensors = {s.name: (digest.spans or {}).get(s.name, _EMPTY) for s in spans}
    return SegmentsDigest(digest.size, segments_of(read_prefix(p, header.data_start), spans, tensors), tensors)
