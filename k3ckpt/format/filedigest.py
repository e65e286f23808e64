"""A node or rank file's digest from its segments - its header, then each tensor's data - and
which digest a node marker (or a rank manifest) records of a file. Pure functions of bytes and
digests (``hashlib`` only), so ``verify`` uses them without loading the node-directory planner.

Why segments: a safetensors file is exactly its header followed by its tensors' bytes (the data
buffer has no holes), so a digest over the header's sha256 and each tensor's sha256 in file
order covers every byte. A producer that hashes each tensor as it copies or receives it - the
marker records those digests anyway - gets the file's digest without hashing any byte twice,
in whatever order the tensors arrive (docs/trust.md has the scheme).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

__all__ = ["SEGMENTS_KEY", "SHA256_HEX", "recorded_digest", "segments_sha256"]

#: The key of a file's digest in ``k3ckpt-node.json``'s and ``rank-manifest.json``'s ``files``
#: (:func:`segments_sha256`; node markers of version 1, and rank manifests written before
#: 2026-12-06, recorded the file's plain sha256 under ``sha256`` instead).
SEGMENTS_KEY = "segments_sha256"
#: A sha256 as every digest here is written: 64 lowercase hex digits (``hexdigest()``'s form).
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def segments_sha256(prefix: bytes, tensors: Iterable[tuple[int, int, str]]) -> str:
    """The digest of a safetensors file from its segments: the sha256 of the 32-byte sha256 of
    its header (``prefix``: the 8-byte length and the JSON, padding included) followed by the
    32-byte sha256 of each tensor's data, in file order. ``tensors``: ``(start, stop, sha256
    hex)`` of every tensor, as absolute offsets in the file, in any order. (The caller checks
    that the file ends where the last tensor does: its size.)

    Raises:
        ValueError: the tensors do not tile the file from the header's end (a gap or an
            overlap): bytes the digest would not cover. (A parsed header's tensors tile it.)
    """
    out = hashlib.sha256(hashlib.sha256(prefix).digest())
    pos = len(prefix)
    for start, stop, digest in sorted(tensors):
        if start != pos or stop < start:
            raise ValueError(f"tensor bytes [{start}, {stop}) do not start where the previous segment ends ({pos})")
        out.update(bytes.fromhex(digest))
        pos = stop
    return out.hexdigest()


def recorded_digest(entry: object) -> tuple[str, str] | None:
    """``(key, digest)`` of what a ``k3ckpt-node.json`` (or ``rank-manifest.json``) ``files`` entry
    records of its file's bytes: ``(SEGMENTS_KEY, ...)`` (:func:`segments_sha256`) or
    ``("sha256", ...)`` (a node marker of version 1, a rank manifest before 2026-12-06: the plain
    sha256 of the file); None when it records neither."""
    if not isinstance(entry, dict):
        return None
    for key in (SEGMENTS_KEY, "sha256"):
        value = entry.get(key)
        if isinstance(value, str) and value:
            return key, value
    return None
