"""A strict reader and a streaming writer for the safetensors container format.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length ``N``,
``N`` bytes of UTF-8 JSON (``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{str: str}}``, right-padded with spaces), then the data buffer. Offsets are relative to the
start of the data buffer.

We parse headers ourselves rather than through ``safetensors.safe_open``: its Python API hands
back tensors, not the byte offsets that verify, reshard and the rank-aware fetch work with (and a
hub shard's header must be parsed from bytes read by a Range request, with no file to open); an
error must name the file and the tensor that is wrong; and what a hostile header can make us
allocate is bounded by ``K3CKPT_MAX_HEADER_BYTES`` (the library's cap is a fixed 100 MB). Tensor
data is read with ``numpy.fromfile`` at the tensor's offset when asked (:mod:`k3ckpt.format.checkpoint`).
"""

from __future__ import annotations

import json
import math
import operator
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate, chain, repeat
from typing import Any, BinaryIO, NamedTuple

from ..env import K3CKPT_MAX_HEADER_BYTES
from ..errors import SafetensorsHeaderError
from .jsontext import ShapeJson, json_str

#: dtype name -> size in bits, as defined by the safetensors ``Dtype`` enum.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

_HEADER_KEYS = frozenset(("dtype", "shape", "data_offsets"))


class TensorInfo(NamedTuple):
    """Where one tensor lives. ``begin``/``end`` are relative to the file's data buffer.

    A named tuple rather than a dataclass: the full K3 inventory has ~497k of these and
    creating them must cost well under a microsecond each.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    file: str  # file name relative to the checkpoint root

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(slots=True)
class ShardHeader:
    """A parsed safetensors header. ``data_start`` is the absolute file offset of the buffer."""

    file: str
    path: str
    file_size: int
    header_len: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        return self.file_size - self.data_start

    def absolute_range(self, name: str) -> tuple[int, int]:
        """Absolute ``[start, stop)`` file offsets of tensor ``name``."""
        t = self.tensors[name]
        return self.data_start + t.begin, self.data_start + t.end


class HeaderColumns(NamedTuple):
    """A validated header as columns: what the parser produces, cheap to pickle between
    processes, and turned into a :class:`ShardHeader` with C-level loops."""

    file: str
    path: str
    file_size: int
    header_len: int
    metadata: dict[str, str]
    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    begins: list[int]
    ends: list[int]

    def to_header(self) -> ShardHeader:
        make = partial(tuple.__new__, TensorInfo)
        infos = map(make, zip(self.names, self.dtypes, self.shapes, self.begins, self.ends, repeat(self.file)))
        return ShardHeader(self.file, self.path, self.file_size, self.header_len, self.metadata,
                           dict(zip(self.names, infos)))


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes a tensor of ``dtype`` and ``shape`` occupies; sub-byte dtypes must fill whole bytes."""
    bits = DTYPE_BITS[dtype] * math.prod(shape)
    if bits % 8:
        raise ValueError(f"{dtype} tensor of shape {list(shape)} does not fill whole bytes")
    return bits // 8


class _Duplicate:
    """Returned (not raised) by the hook for an object with a repeated key, so the enclosing
    object's hook can say *which* entry it was in."""

    def __init__(self, key: str) -> None:
        self.key = key


class _DuplicateKey(Exception):
    def __init__(self, where: str | None, key: str) -> None:
        self.where, self.key = where, key


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> Any:
    d = dict(pairs)
    for k, v in pairs:
        if isinstance(v, _Duplicate):
            raise _DuplicateKey(k, v.key)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                return _Duplicate(k)
            seen.add(k)
    return d


def _is_int(x: Any) -> bool:
    # bool is an int subclass; a header saying "shape": [true] is malformed, not [1].
    return type(x) is int


def parse_header_bytes(raw: bytes, *, file: str, path: str, file_size: int) -> ShardHeader:
    """:func:`parse_header_columns` as a :class:`ShardHeader`."""
    return parse_header_columns(raw, file=file, path=path, file_size=file_size).to_header()


def parse_header_columns(raw: bytes, *, file: str, path: str, file_size: int) -> HeaderColumns:
    """Validate header JSON ``raw`` (the ``N`` bytes after the length prefix) of a file of
    ``file_size`` bytes and return its :class:`ShardHeader`.

    Checks: UTF-8, a JSON object, no duplicate keys, ``__metadata__`` maps str to str, every
    entry has exactly ``dtype``/``shape``/``data_offsets``, a known dtype, non-negative integer
    dims and offsets, ``dtype size x shape == end - begin``, and the entries tile the data
    buffer exactly (no overlap, no gap, nothing past the end).

    Raises:
        SafetensorsHeaderError: on any violation, naming ``path`` and the tensor.
    """
    header_len = len(raw)
    data_len = file_size - 8 - header_len
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsHeaderError(path, f"header is not valid UTF-8 (byte {e.start})") from None
    if not text.startswith("{"):
        raise SafetensorsHeaderError(path, "header does not start with '{'")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and ints over 4300 digits
        raise SafetensorsHeaderError(path, f"header is not valid JSON ({e})") from None
    if "\\u" in text:
        _reject_surrogates(obj, path)

    had_metadata = "__metadata__" in obj
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SafetensorsHeaderError(path, "__metadata__ must map strings to strings")

    cols = _entries_fast(obj, data_len)
    # json.loads keeps the last of duplicate keys, silently. Every pair but the first of an
    # object, and every element but the first of an array, is preceded by a comma, so the raw
    # text has exactly as many commas as the parsed structure implies - more when a key was
    # repeated anywhere (or a comma sits inside a string: then the exact check decides).
    if cols is not None and text.count(",") != _implied_commas(len(obj), metadata, cols[1], had_metadata):
        cols = None
    if cols is None:
        _reject_duplicate_keys(text, path)
        cols = _entries_exact(obj, path, data_len)
    names = list(obj)
    _check_tiling(names, cols[2], cols[3], path, data_len)
    return HeaderColumns(file, path, file_size, header_len, metadata, names, *cols)


_Columns = tuple[list[str], list[tuple[int, ...]], list[int], list[int]]  # dtypes, shapes, begins, ends


def _entries_fast(obj: dict[str, Any], data_len: int) -> _Columns | None:
    """The common case, validated column by column in C-level loops (``map``, ``zip``, list
    comparisons) because the full K3 inventory has ~497k entries. Returns ``None`` at the first
    irregularity: the exact validator then finds it and words the error; it also checks the
    tiling itself, so a ``None`` is never a silent acceptance."""
    entries = list(obj.values())
    if not entries:
        return [], [], [], []
    try:
        if set(map(type, entries)) != {dict} or set(map(len, entries)) != {3}:
            return None
        dtypes = list(map(_DTYPE, entries))
        dims = list(map(_SHAPE, entries))
        offsets = list(map(_OFFSETS, entries))
        if set(map(type, dims)) != {list} or set(map(type, offsets)) != {list}:
            return None
        if set(map(len, offsets)) != {2}:
            return None
        numbers = list(chain(chain.from_iterable(dims), chain.from_iterable(offsets)))
        # bool and float compare equal to ints ([true] == [1]); only real ints are valid.
        if set(map(type, numbers)) != {int} or min(numbers) < 0:
            return None
        shapes = list(map(tuple, dims))
        keys = list(zip(dtypes, shapes))
        sizes: dict[tuple[str, tuple[int, ...]], int] = {}
        canonical: dict[tuple[int, ...], tuple[int, ...]] = {}
        for dtype, shape in set(keys):
            bits = DTYPE_BITS.get(dtype) if type(dtype) is str else None
            if bits is None or (bits * math.prod(shape)) % 8:
                return None
            sizes[(dtype, shape)] = bits * math.prod(shape) // 8
            canonical.setdefault(shape, shape)
        begins = list(map(_FIRST, offsets))
        ends = list(map(_SECOND, offsets))
        if list(map(operator.sub, ends, begins)) != list(map(sizes.__getitem__, keys)):
            return None
    except (KeyError, TypeError):
        return None
    if max(ends) > data_len:
        return None
    shapes = list(map(canonical.__getitem__, shapes))  # share one tuple per distinct shape
    return dtypes, shapes, begins, ends


_DTYPE = operator.itemgetter("dtype")
_SHAPE = operator.itemgetter("shape")
_OFFSETS = operator.itemgetter("data_offsets")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


def _implied_commas(entries: int, metadata: dict[str, str], shapes: list[tuple[int, ...]], had_metadata: bool) -> int:
    top = entries + had_metadata
    dims = sum(map(len, shapes)) - (len(shapes) - shapes.count(()))  # (len - 1) per non-empty shape
    return (max(top - 1, 0) + max(len(metadata) - 1, 0) + 3 * entries + dims)


def _reject_duplicate_keys(text: str, path: str) -> None:
    try:
        top = json.loads(text, object_pairs_hook=_reject_duplicates)
    except _DuplicateKey as e:
        raise SafetensorsHeaderError(path, f"duplicate key {e.key!r}", tensor=e.where) from None
    if isinstance(top, _Duplicate):
        raise SafetensorsHeaderError(path, "duplicate key in header", tensor=top.key)


def _reject_surrogates(obj: dict[str, Any], path: str) -> None:
    """``\\ud800`` escapes decode to lone surrogates: not Unicode, and unencodable later."""
    strings = list(obj)
    metadata = obj.get("__metadata__")
    if isinstance(metadata, dict):
        strings += [x for pair in metadata.items() for x in pair if isinstance(x, str)]
    strings += [e["dtype"] for e in obj.values() if isinstance(e, dict) and isinstance(e.get("dtype"), str)]
    for s in strings:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise SafetensorsHeaderError(path, f"name {s!r} is not valid Unicode (lone surrogate escape)") from None


def _entries_exact(obj: dict[str, Any], path: str, data_len: int) -> _Columns:
    cols: _Columns = ([], [], [], [])
    dtypes, shapes, begins, ends = cols  # appended to by name: each column has its own type
    for name, entry in obj.items():
        if not isinstance(entry, dict):
            raise SafetensorsHeaderError(path, "entry is not an object", name)
        if entry.keys() != _HEADER_KEYS:
            extra = sorted(set(entry) - _HEADER_KEYS)
            missing = sorted(_HEADER_KEYS - set(entry))
            what = f"missing {missing}" if missing else f"unexpected keys {extra}"
            raise SafetensorsHeaderError(path, what, name)
        dtype = entry["dtype"]
        bits = DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
        if bits is None:
            raise SafetensorsHeaderError(path, f"unknown dtype {dtype!r}", name)
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise SafetensorsHeaderError(path, f"shape {shape!r} is not a list of non-negative integers", name)
        offsets = entry["data_offsets"]
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)
        ):
            raise SafetensorsHeaderError(path, f"data_offsets {offsets!r} is not [begin, end]", name)
        begin, end = offsets
        if end < begin:
            raise SafetensorsHeaderError(path, f"data_offsets [{begin}, {end}] end before begin", name)
        nbits = bits * math.prod(shape)
        if nbits % 8 or nbits // 8 != end - begin:
            # Exact decimal (no float: a hostile shape can be 10**400 elements).
            need = f"{nbits // 8}" + (f".{nbits % 8 * 125:03d}".rstrip("0") if nbits % 8 else "")
            raise SafetensorsHeaderError(
                path, f"{dtype} {shape} needs {need} bytes but data_offsets span {end - begin}", name
            )
        if end > data_len:
            raise SafetensorsHeaderError(
                path, f"data_offsets end {end} is past the data buffer ({data_len} bytes)", name
            )
        dtypes.append(dtype)
        shapes.append(tuple(shape))
        begins.append(begin)
        ends.append(end)
    return cols


def _check_tiling(names: list[str], begins: list[int], ends: list[int], path: str, data_len: int) -> None:
    """The buffer must be tiled exactly: no overlaps (two tensors sharing bytes) and no gaps
    (unaccounted bytes could hide anything)."""
    spans = sorted(zip(begins, ends))
    starts = [b for b, _ in spans]
    stops = [e for _, e in spans]
    if spans and starts[0] == 0 and starts[1:] == stops[:-1] and stops[-1] == data_len:
        return
    if not spans and data_len == 0:
        return
    by_span = dict(zip(zip(begins, ends), names))
    pos = 0
    for begin, end in spans:
        name = by_span[(begin, end)]
        if begin < pos:
            raise SafetensorsHeaderError(
                path, f"overlaps the previous tensor (begins at {begin}, previous ends at {pos})", name
            )
        if begin > pos:
            raise SafetensorsHeaderError(path, f"gap of {begin - pos} bytes before this tensor (at {pos})", name)
        pos = end
    raise SafetensorsHeaderError(path, f"tensors cover {pos} bytes but the data buffer is {data_len} bytes")




def read_header(path: str | os.PathLike[str], file: str | None = None) -> ShardHeader:
    """Read and validate the header of the safetensors file at ``path`` (header bytes only).

    Args:
        path: the file.
        file: its name relative to the checkpoint root (defaults to the base name).

    Raises:
        SafetensorsHeaderError: naming the file (and tensor) and what is wrong.
    """
    return read_header_columns(path, file).to_header()


def read_header_columns(path: str | os.PathLike[str], file: str | None = None) -> HeaderColumns:
    """:func:`read_header` as :class:`HeaderColumns`."""
    p = os.fspath(path)
    file = file if file is not None else os.path.basename(p)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return _read_header_from(f, size, p, file)
    except FileNotFoundError:
        raise SafetensorsHeaderError(p, "file not found") from None
    except IsADirectoryError:
        raise SafetensorsHeaderError(p, "is a directory, not a safetensors file") from None
    except PermissionError:
        raise SafetensorsHeaderError(p, "permission denied") from None
    except OSError as e:
        raise SafetensorsHeaderError(p, f"cannot read ({e.strerror or e})") from None


def _read_header_from(f: BinaryIO, size: int, path: str, file: str) -> HeaderColumns:
    if size < 8:
        raise SafetensorsHeaderError(path, f"file is {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", f.read(8))
    limit = K3CKPT_MAX_HEADER_BYTES.get()  # at call time: overridable for exotic checkpoints
    if n > limit:
        raise SafetensorsHeaderError(path, f"header length {n} exceeds the {limit}-byte limit")
    if 8 + n > size:
        raise SafetensorsHeaderError(path, f"header length {n} runs past the end of the {size}-byte file (truncated?)")
    raw = f.read(n)
    if len(raw) != n:
        raise SafetensorsHeaderError(path, f"short read: header is {n} bytes, got {len(raw)}")
    return parse_header_columns(raw, file=file, path=path, file_size=size)


# --------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor to be written: its name, dtype and shape (bytes come later, in this order)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


def build_header(
    specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None, align: int = 8
) -> tuple[bytes, list[tuple[int, int]]]:
    """Serialize a header for ``specs`` laid out back to back in the given order.

    Returns the full prefix (8-byte length + JSON padded with spaces so that the data buffer
    starts at a multiple of ``align``) and the ``(begin, end)`` of each tensor.
    """
    specs = list(specs)
    return header_prefix([s.name for s in specs], [s.dtype for s in specs], [tuple(s.shape) for s in specs],
                         metadata, align)


def header_prefix(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]],
    metadata: dict[str, str] | None = None, align: int = 8,
) -> tuple[bytes, list[tuple[int, int]]]:
    """:func:`build_header` over columns (a tensor's name, dtype and shape at the same index):
    the same bytes, built in C-level loops. A node or rank file of the full K3 inventory lists
    ~10^4-10^5 tensors, and building one dict per entry for ``json.dumps`` cost ~6 us each.

    Each entry is written as ``json.dumps(entries, separators=(",", ":"))`` would: keys and
    dtypes through the encoder's own string escaper, shapes and offsets as its integer lists.

    Raises:
        ValueError: a duplicate name (``__metadata__`` included, with metadata), or a dtype and
            shape that do not fill whole bytes; KeyError: an unknown dtype - the first in order.
    """
    sizes = _SizeOf()
    unique = set(names)
    if len(unique) != len(names) or (metadata and "__metadata__" in unique):
        seen = {"__metadata__"} if metadata else set()
        for i, name in enumerate(names):
            if name in seen:
                list(map(sizes.__getitem__, zip(dtypes[:i], shapes[:i])))  # an earlier bad size is raised first
                raise ValueError(f"duplicate tensor name {name!r}")
            seen.add(name)
    ends = list(accumulate(map(sizes.__getitem__, zip(dtypes, shapes))))
    begins = [0, *ends[:-1]] if ends else []
    entries = ",".join(map(_ENTRY.format, map(json_str, names), map(json_str, dtypes),
                           map(ShapeJson(compact=True).__getitem__, shapes), begins, ends))
    head = json.dumps({"__metadata__": dict(metadata)}, separators=(",", ":"))[:-1] if metadata else "{"
    text = head + ("," if metadata and entries else "") + entries + "}"
    raw = text.encode("utf-8")  # ASCII: the escaper leaves nothing else
    raw += b" " * ((-(8 + len(raw))) % align)
    return struct.pack("<Q", len(raw)) + raw, list(zip(begins, ends))


#: One header entry, as ``json.dumps(..., separators=(",", ":"))`` writes it.
_ENTRY = '{}:{{"dtype":{},"shape":{},"data_offsets":[{},{}]}}'


class _SizeOf(dict[tuple[str, tuple[int, ...]], int]):
    """(dtype, shape) -> bytes, computed once per distinct pair (hits stay in C via ``map``)."""

    def __missing__(self, key: tuple[str, tuple[int, ...]]) -> int:
        v = self[key] = tensor_nbytes(*key)
        return v
