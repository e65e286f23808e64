"""Finding MXFP4 tensors in a checkpoint (or one safetensors file) and reading them in row chunks.

A quantized weight is a *pair* of stored tensors, in one of two explicit layouts - never
guessed from shapes alone:

- ``compressed-tensors`` (K3): ``<base>.weight_packed`` [out, in/2] U8 + ``<base>.weight_scale``
  [out, in/32] U8 (E8M0); the dequantized tensor is ``<base>.weight`` [out, in].
- ``gpt-oss``: ``<base>_blocks`` [E, out, G, 16] U8 + ``<base>_scales`` [E, out, G] U8; the
  dequantized tensor is ``<base>`` [E, out, G*32].

Rows are read with ``os.pread`` straight from the file - a chunk of rows of the packed tensor
and the matching rows of its scales - so memory stays bounded by the chunk whatever the tensor
or layer size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..env import K3CKPT_MX_CHUNK_BYTES
from ..errors import MxSelectionError
from ..format.checkpoint import Checkpoint, open_checkpoint
from ..format.header import ShardHeader, read_header
from ..format.roles import Role, classify

#: Built-in default bytes of packed data per chunk (the float output of a chunk is 8x this for
#: fp32); ``$K3CKPT_MX_CHUNK_BYTES``, read at call time, overrides it.
CHUNK_BYTES = K3CKPT_MX_CHUNK_BYTES.default


@dataclass(frozen=True)
class MxTensor:
    """One quantized weight: its packed data and its scales, where they live, and what it is."""

    base: str
    layout: str  # "compressed-tensors" | "gpt-oss"
    data_name: str
    scale_name: str
    data_path: Path
    data_offset: int  # absolute file offset of the packed bytes
    data_shape: tuple[int, ...]
    scale_path: Path
    scale_offset: int
    scale_shape: tuple[int, ...]
    role: Role

    @property
    def weight_name(self) -> str:
        """The name of the dequantized tensor (the pair mapped to one weight)."""
        return self.base + ".weight" if self.layout == "compressed-tensors" else self.base

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical (dequantized) shape."""
        if self.layout == "compressed-tensors":
            return (*self.data_shape[:-1], self.data_shape[-1] * 2)
        return (*self.data_shape[:-2], self.data_shape[-2] * 32)

    @property
    def rows(self) -> int:
        """Rows of the flattened [rows, in] view (for gpt-oss: experts x out)."""
        return math.prod(self.shape[:-1])

    @property
    def row_elements(self) -> int:
        return self.shape[-1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def packed_bytes(self) -> int:
        return self.numel // 2

    def rows_per_chunk(self, chunk_bytes: int | None = None) -> int:
        if chunk_bytes is None:
            chunk_bytes = K3CKPT_MX_CHUNK_BYTES.get()
        return max(1, chunk_bytes // max(1, self.row_elements // 2))

    def read_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Packed bytes [n, in/2] and scale bytes [n, in/32] of rows ``[start, stop)``."""
        n = stop - start
        row_packed, row_scales = self.row_elements // 2, self.row_elements // 32
        packed = _pread(self.data_path, self.data_offset + start * row_packed, n * row_packed)
        scales = _pread(self.scale_path, self.scale_offset + start * row_scales, n * row_scales)
        return packed.reshape(n, row_packed), scales.reshape(n, row_scales)

    def iter_rows(self, chunk_bytes: int | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(first_row, packed, scales)`` chunks covering every row, in order."""
        step = self.rows_per_chunk(chunk_bytes)
        for start in range(0, self.rows, step):
            stop = min(self.rows, start + step)
            packed, scales = self.read_rows(start, stop)
            yield start, packed, scales


def _pread(path: Path, offset: int, n: int) -> np.ndarray:
    with open(path, "rb", buffering=0) as f:
        data = os.pread(f.fileno(), n, offset)
    if len(data) != n:
        raise MxSelectionError(f"{path}: short read at offset {offset} ({len(data)} of {n} bytes; truncated?)")
    return np.frombuffer(data, dtype=np.uint8)


@dataclass
class MxSource:
    """Where to look: a checkpoint directory, or a single safetensors file."""

    root: Path
    shards: dict[str, ShardHeader]
    checkpoint: Checkpoint | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> MxSource:
        p = Path(path)
        if p.is_file():
            h = read_header(p, file=p.name)
            return cls(p.parent, {p.name: h})
        ckpt = open_checkpoint(p)
        return cls(ckpt.root, ckpt.shards, ckpt)

    def tensor_names(self) -> Iterator[tuple[str, ShardHeader]]:
        for h in self.shards.values():
            for name in h.tensors:
                yield name, h


def find_mx_tensors(
    source: MxSource, *, tensor: str | None = None, layer: int | None = None, expert: int | None = None
) -> list[MxTensor]:
    """Every quantized pair in ``source`` matching the selection, in name order.

    ``tensor`` matches the dequantized name (``...w1.weight``), the base (``...w1``) or either
    stored name; ``layer``/``expert`` filter by role.

    Raises:
        MxSelectionError: nothing matches, or a packed tensor has no (well-shaped) scales.
    """
    where: dict[str, ShardHeader] = {}
    for name, h in source.tensor_names():
        where[name] = h
    out = []
    for name, h in where.items():
        if name.endswith(".weight_packed"):
            base, layout, scale_name = name[: -len(".weight_packed")], "compressed-tensors", None
            scale_name = base + ".weight_scale"
        elif name.endswith("_blocks"):
            base, layout = name[: -len("_blocks")], "gpt-oss"
            scale_name = base + "_scales"
        else:
            continue
        if tensor is not None and tensor not in (base, base + ".weight", name, scale_name):
            continue
        role = classify(name)
        if layer is not None and role.layer != layer:
            continue
        if expert is not None and role.expert != expert:
            continue
        sh = where.get(scale_name)
        if sh is None:
            raise MxSelectionError(f"{h.path}: {name} has no {scale_name}")
        d, s = h.tensors[name], sh.tensors[scale_name]
        _check_pair(layout, name, d.dtype, d.shape, s.dtype, s.shape, h.path)
        out.append(MxTensor(
            base=base, layout=layout, data_name=name, scale_name=scale_name,
            data_path=Path(h.path), data_offset=h.data_start + d.begin, data_shape=d.shape,
            scale_path=Path(sh.path), scale_offset=sh.data_start + s.begin, scale_shape=s.shape,
            role=role,
        ))
    if not out:
        what = " ".join(f"--{k} {v}" for k, v in (("tensor", tensor), ("layer", layer), ("expert", expert)) if v is not None)
        raise MxSelectionError(f"{source.root}: no MXFP4 tensor matches{' ' + what if what else ''}")
    return sorted(out, key=lambda m: (m.role.layer if m.role.layer is not None else -1,
                                      m.role.expert if m.role.expert is not None else -1, m.base))


def _check_pair(layout: str, name: str, ddt: str, dshape: tuple[int, ...], sdt: str, sshape: tuple[int, ...],
                path: str) -> None:
    if ddt != "U8" or sdt not in ("U8", "F8_E8M0"):
        raise MxSelectionError(f"{path}: {name}: dtypes {ddt}/{sdt}, expected U8 packed data and U8 (E8M0) scales")
    if layout == "compressed-tensors":
        ok = len(dshape) >= 2 and dshape[-1] % 16 == 0 and sshape == (*dshape[:-1], dshape[-1] // 16)
        want = "[out, in/2] + [out, in/32]"
    else:
        ok = len(dshape) >= 3 and dshape[-1] == 16 and sshape == dshape[:-1]
        want = "[..., G, 16] + [..., G]"
    if not ok:
        raise MxSelectionError(f"{path}: {name}: shapes {list(dshape)} and {list(sshape)} do not pair as {want}")
