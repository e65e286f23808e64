"""Manifests: a committed, diffable statement of exactly what a checkpoint is.

A manifest lists every file (path, size, sha256) and every tensor (file, dtype, shape, absolute
byte offsets, and with ``tensor_hashes`` its own sha256). It is deterministic JSON - keys
sorted, one file or tensor per line - so it can be committed, reviewed and diffed, and a fleet
can verify against a manifest its operators trust rather than whatever the network served.

Format ``k3ckpt-manifest`` version 1::

    {
     "files": {
      "config.json": {"sha256": "...", "size": 3197},
      "model-00001-of-000096.safetensors": {"data_start": 8, "sha256": "...", "size": 123}
     },
     "format": "k3ckpt-manifest",
     "source": {"hub": "hf", "repo": "moonshotai/Kimi-K3", "revision": "f831ab66..."},
     "tensor_hashes": true,
     "tensors": {
      "language_model.model.embed_tokens.weight": {"dtype": "BF16", "file": "...", "offsets": [s, e],
                                                   "sha256": "...", "shape": [163840, 7168]}
     },
     "version": 1
    }

``offsets`` are absolute file offsets ``[start, stop)`` (``data_start`` + the header's relative
``data_offsets``), so a tensor can be fetched or hashed with one ranged read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from ..errors import ManifestError, ManifestHashError
from ..format.checkpoint import Checkpoint, bulk_allocation, open_checkpoint
from ..format.header import ShardHeader
from ..utils import load_json, write_atomic
from ..utils.ownership import refuse_foreign_file
from .hashing import Span, hash_files

FORMAT = "k3ckpt-manifest"
VERSION = 1


class FileEntry(NamedTuple):
    # Named tuples, not dataclasses: a K3 manifest has ~497k tensors, and tuples are built and
    # compared in C.
    size: int
    sha256: str | None  # None only in manifests pulled from a hub that does not publish it
    data_start: int | None = None  # safetensors files: where the data buffer begins


class TensorEntry(NamedTuple):
    file: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # absolute [start, stop) in the file
    sha256: str | None = None




def is_manifest_file(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a regular file holding a k3ckpt manifest (any version): the only
    kind of file ``manifest build``/``pull`` replace."""
    p = Path(path)
    if p.is_symlink() or not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT

@dataclass
class Manifest:
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    source: dict[str, str] = field(default_factory=dict)
    tensor_hashes: bool = False
    _fingerprint: str | None = field(default=None, repr=False, compare=False)

    def fingerprint(self) -> str:
        """sha256 of the serialized manifest (of the file's bytes, when it was loaded)."""
        if self._fingerprint is None:
            self._fingerprint = hashlib.sha256(self.to_json().encode()).hexdigest()
        return self._fingerprint

    # -- (de)serialization ----------------------------------------------------------------

    def to_json(self) -> str:
        """Deterministic JSON: sorted keys, one file / tensor per line, trailing newline."""

        def line(obj: dict[str, Any]) -> str:
            return json.dumps(obj, sort_keys=True, separators=(", ", ": "))

        def block(name: str, items: dict[str, dict[str, Any]]) -> str:
            if not items:
                return f' "{name}": {{}}'
            body = ",\n".join(f"  {json.dumps(k)}: {line(v)}" for k, v in sorted(items.items()))
            return f' "{name}": {{\n{body}\n }}'

        files = {k: _file_json(v) for k, v in self.files.items()}
        tensors = {k: _tensor_json(v) for k, v in self.tensors.items()}
        parts = [
            block("files", files),
            f' "format": {json.dumps(FORMAT)}',
            f' "source": {line(dict(sorted(self.source.items())))}',
            f' "tensor_hashes": {json.dumps(self.tensor_hashes)}',
            block("tensors", tensors),
            f' "version": {VERSION}',
        ]
        return "{\n" + ",\n".join(parts) + "\n}\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically: a reader never sees a half-written manifest under the final name.

        Raises:
            OutputNotOwnedError: ``path`` exists and is not a k3ckpt manifest (only a manifest
                is ever replaced: :func:`k3ckpt.utils.ownership.refuse_foreign_file`).
        """
        refuse_foreign_file(path, is_manifest_file(path), "manifest")
        write_atomic(Path(path), self.to_json().encode("utf-8"))

    @classmethod
    def from_json(cls, data: Any, where: str = "manifest") -> Manifest:
        """Parse and validate; refuses other formats, newer versions and unsafe paths."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ManifestError(f"{where}: not a {FORMAT} file")
        if type(data.get("version")) is not int or data.get("version") != VERSION:
            raise ManifestError(f"{where}: version {data.get('version')!r} is not supported (this k3ckpt reads {VERSION})")
        try:
            files = {_safe_path(k, where): _parse_file(v) for k, v in data["files"].items()}
            tensors = {str(k): _parse_tensor(v) for k, v in data["tensors"].items()}
            source = {str(k): str(v) for k, v in (data.get("source") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise ManifestError(f"{where}: malformed ({type(e).__name__}: {e})") from None
        for name, t in tensors.items():
            if t.file not in files:
                raise ManifestError(f"{where}: tensor {name!r} is in {t.file!r}, which the manifest does not list")
        return cls(files, tensors, source, bool(data.get("tensor_hashes")))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Manifest:
        p = Path(path)
        with bulk_allocation():  # a tuple per tensor, ~497k for K3: no GC passes over them meanwhile
            data, raw = load_json(p, ManifestError)
            m = cls.from_json(data, str(p))
        m._fingerprint = hashlib.sha256(raw).hexdigest()
        return m

    @classmethod
    def loads(cls, raw: bytes, where: str = "manifest") -> Manifest:
        """Parse a manifest from bytes already read (e.g. the exact bytes a signature covers)."""
        with bulk_allocation():  # as in load
            try:
                data = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise ManifestError(f"{where}: not valid JSON ({e})") from None
            except RecursionError:
                raise ManifestError(f"{where}: not valid JSON (nested too deeply)") from None
            m = cls.from_json(data, where)
        m._fingerprint = hashlib.sha256(raw).hexdigest()
        return m

    # -- queries --------------------------------------------------------------------------

    def spans_by_file(self) -> dict[str, list[Span]]:
        """Tensor byte ranges grouped by file, for hashing them in the file's read pass."""
        out: dict[str, list[Span]] = {}
        for name, t in self.tensors.items():
            out.setdefault(t.file, []).append(Span(name, t.offsets[0], t.offsets[1]))
        return out

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def _file_json(f: FileEntry) -> dict[str, Any]:
    d: dict[str, Any] = {"size": f.size, "sha256": f.sha256}
    if f.data_start is not None:
        d["data_start"] = f.data_start
    return d


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    d: dict[str, Any] = {"file": t.file, "dtype": t.dtype, "shape": list(t.shape), "offsets": list(t.offsets)}
    if t.sha256 is not None:
        d["sha256"] = t.sha256
    return d


def _parse_file(v: dict[str, Any]) -> FileEntry:
    size = v["size"]
    if type(size) is not int or size < 0:
        raise ValueError(f"bad size {size!r}")
    sha = v.get("sha256")
    if sha is not None and (not isinstance(sha, str) or len(sha) != 64):
        raise ValueError(f"bad sha256 {sha!r}")
    ds = v.get("data_start")
    return FileEntry(size, sha, int(ds) if ds is not None else None)


def _parse_tensor(v: dict[str, Any]) -> TensorEntry:
    start, stop = v["offsets"]
    if not (type(start) is int and type(stop) is int and 0 <= start <= stop):
        raise ValueError(f"bad offsets {v['offsets']!r}")
    return TensorEntry(str(v["file"]), str(v["dtype"]), tuple(map(int, v["shape"])), (start, stop),
                       v.get("sha256"))


def _safe_path(rel: str, where: str) -> str:
    pp = PurePosixPath(rel)
    if not rel or pp.is_absolute() or ".." in pp.parts or "\\" in rel or "\0" in rel:
        raise ManifestError(f"{where}: refuses file path {rel!r} (absolute or outside the checkpoint)")
    return pp.as_posix()


# -- building ---------------------------------------------------------------------------------


def tensors_from_headers(shards: Iterable[ShardHeader]) -> dict[str, TensorEntry]:
    """Tensor entries (no hashes) from parsed headers."""
    out: dict[str, TensorEntry] = {}
    for h in shards:
        ds = h.data_start
        for name, t in h.tensors.items():
            out[name] = TensorEntry(h.file, t.dtype, t.shape, (ds + t.begin, ds + t.end))
    return out


def build_manifest(
    path: str | os.PathLike[str] | Checkpoint,
    *,
    tensor_hashes: bool = False,
    jobs: int | None = None,
    progress: Callable[[int], None] | None = None,
    source: dict[str, str] | None = None,
) -> Manifest:
    """Hash every file of a checkpoint (and, with ``tensor_hashes``, every tensor in the same
    read) and describe it as a :class:`Manifest`.

    Raises:
        ManifestHashError: a file could not be read.
    """
    ckpt = path if isinstance(path, Checkpoint) else open_checkpoint(path, jobs=jobs)
    tensors = tensors_from_headers(ckpt.shards.values())
    files = list(ckpt.iter_files())
    spans: dict[str, list[Span]] = {}
    if tensor_hashes:
        for name, t in tensors.items():
            spans.setdefault(t.file, []).append(Span(name, *t.offsets))
    digests, errors = hash_files(ckpt.root, files, jobs=jobs, spans=spans, progress=progress)
    if errors:
        first = sorted(errors)[0]
        raise ManifestHashError(f"{ckpt.root / first}: {errors[first].strerror}"
                                + (f" (and {len(errors) - 1} more files)" if len(errors) > 1 else ""))
    if tensor_hashes:
        tensors = {n: t._replace(sha256=(digests[t.file].spans or {})[n]) for n, t in tensors.items()}
    entries = {
        f: FileEntry(d.size, d.sha256, ckpt.shards[f].data_start if f in ckpt.shards else None)
        for f, d in digests.items()
    }
    src = dict(source) if source else {k: v for k, v in vars(ckpt.source).items() if v is not None and k != "layout"}
    return Manifest(entries, tensors, src, tensor_hashes)


# -- diff -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    what: str  # "file" | "tensor" | "source"
    name: str
    kind: str  # "added" | "removed" | "changed"
    detail: str = ""

    def __str__(self) -> str:
        sign = {"added": "+", "removed": "-", "changed": "~"}[self.kind]
        return f"{sign} {self.what} {self.name}" + (f": {self.detail}" if self.detail else "")


def diff_manifests(a: Manifest, b: Manifest) -> list[Change]:
    """What changed from ``a`` to ``b``, files first, then tensors, each sorted by name."""
    out: list[Change] = []
    for k in sorted(set(a.source) | set(b.source)):
        if a.source.get(k) != b.source.get(k):
            out.append(Change("source", k, "changed", f"{a.source.get(k)} -> {b.source.get(k)}"))
    out += _diff_maps("file", a.files, b.files, _file_changes)
    out += _diff_maps("tensor", a.tensors, b.tensors, _tensor_changes)
    return out


def _diff_maps(what: str, a: dict, b: dict, describe: Callable[[Any, Any], str]) -> list[Change]:
    out = [Change(what, k, "removed") for k in sorted(a.keys() - b.keys())]
    out += [Change(what, k, "added") for k in sorted(b.keys() - a.keys())]
    for k in sorted(a.keys() & b.keys()):
        if a[k] != b[k]:
            detail = describe(a[k], b[k])
            if detail:
                out.append(Change(what, k, "changed", detail))
    out.sort(key=lambda c: c.name)
    return out


def _short(h: str | None) -> str:
    return h[:12] if h else "unknown"


def _file_changes(x: FileEntry, y: FileEntry) -> str:
    parts = []
    if x.size != y.size:
        parts.append(f"size {x.size} -> {y.size}")
    if x.sha256 != y.sha256 and x.sha256 and y.sha256:
        parts.append(f"sha256 {_short(x.sha256)} -> {_short(y.sha256)}")
    if x.data_start != y.data_start and x.data_start is not None and y.data_start is not None:
        parts.append(f"data_start {x.data_start} -> {y.data_start}")
    return ", ".join(parts)


def _tensor_changes(x: TensorEntry, y: TensorEntry) -> str:
    parts = []
    for attr in ("file", "dtype", "shape", "offsets"):
        if getattr(x, attr) != getattr(y, attr):
            parts.append(f"{attr} {_fmt(getattr(x, attr))} -> {_fmt(getattr(y, attr))}")
    if x.sha256 and y.sha256 and x.sha256 != y.sha256:
        parts.append(f"sha256 {_short(x.sha256)} -> {_short(y.sha256)}")
    return ", ".join(parts)


def _fmt(v: Any) -> str:
    return json.dumps(list(v)) if isinstance(v, tuple) else str(v)
