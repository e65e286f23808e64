"""``k3ckpt unshard``: reassemble a standard local-dir checkpoint from a per-rank layout.

The inverse of ``k3ckpt reshard``: it reads ``OUT/topology.json`` and every rank's
``rank-manifest.json`` (headers only), checks that they describe one complete layout, and
writes ``DIR/model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json`` + the
layout's non-weight files (config, tokenizer, LICENSE, ...). Every tensor comes out
byte-identical to the source; the files themselves need not be (tensor order and sharding are
this module's, see below).

Checks, each a one-line :class:`UnshardError` naming the rank, file or tensor:

- every rank ``0..W-1`` has a directory, ``READY``, a manifest and every file it lists, with
  the listed size; manifests agree with ``topology.json`` (rank coordinates, expert lists,
  source digest) and with the file headers (names, dtypes, shapes);
- every tensor is held by exactly the ranks the topology places it on (dense tensors on every
  rank, a routed expert's tensors on its owners), its parts tile the source shape (every index
  ``0..k-1`` of a split, every ep_rank's experts of a stacked tensor), and copies of the same
  slice on several ranks (replicas, dp copies of a TP slice) have the same sha256;
- each slice read is hashed while it is copied (no second read) and must match its manifest
  digest.

Decisions:

- output order: tensors in natural name order (``layers.2`` before ``layers.10``, experts by
  number), packed greedily into shards of at most ``max_shard_size`` (a larger tensor gets a
  shard of its own); headers 8-byte aligned like ``safetensors``' own writer;
- a replicated slice is read from the lowest rank that holds it;
- split parts are reassembled by concatenation along ``dim``: dim 0 (and any split whose
  leading dims are all 1) is a contiguous kernel-side copy per part, a later dim interleaves
  rows through bounded buffers (:meth:`~k3ckpt.bytecopy.Copier.interleave`);
- atomicity: shards are written under temporary names, fsync'd and renamed only after every
  shard is complete and verified; the index is written last, so a directory without
  ``model.safetensors.index.json`` is never a finished checkpoint. The output must be new, empty
  or an earlier unshard's (:func:`k3ckpt.utils.ownership.claim_output_dir`: files k3ckpt did
  not write are refused, ``force`` included); it is locked (``.k3ckpt-output.lock``) for the
  run and its free space checked first. One that already has an index is refused without
  ``force``; shards and temporary files of an earlier unfinished run are replaced. On ENOSPC
  the temporary shards are removed and the shortfall is named.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from ..env import K3CKPT_HASH_BUFFER
from ..errors import UnshardError
from ..faults import pause_point
from ..format.checkpoint import INDEX_NAME, is_working_file, iter_checkpoint_files
from ..format.header import DTYPE_BITS, TensorSpec, build_header, read_header
from ..format.layout import FORMAT, MANIFEST_NAME, READY_NAME, TOPOLOGY_NAME, hf_shard_name, rank_dir_name
from ..format.loadable import require_config
from ..format.roles import classify
from ..format.topology import Topology, TopologyError
from ..integrity.statcache import joined_origin, record_written, recorded_proofs
from ..utils import copy_files, fsync_dir, human_bytes, is_within, load_json, write_atomic
from ..utils.ownership import claim_output_dir, locked_output_dir
from ..utils.space import free_bytes, require_free_space, space_margin
from .bytecopy import NO_SPACE, Copier, FdCache, output_lock, tmp_name

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
#: Shard names of the Hugging Face convention.
SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def natural_key(name: str) -> tuple:
    """Sort key putting ``layers.2`` before ``layers.10`` (digit runs compare as numbers)."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name)))


# ---------------------------------------------------------------------------------------------
# Reading the layout


@dataclass(slots=True)
class _Slice:
    """One distinct slice of a tensor, as held by the rank it is read from."""

    file: str  # relative to the layout root: rank-NNNNN/model-rank-R-part-K.safetensors
    offset: int  # absolute offset of its data in that file
    nbytes: int
    sha256: str
    rank: int


@dataclass(slots=True)
class _Gathered:
    """Everything the layout says about one source tensor."""

    dtype: str
    source_shape: tuple[int, ...]
    kind: str  # "whole" | "split" | "experts"
    dim: int  # split dim (kind "split"), inner split dim (kind "experts", -1 when none)
    parts: int  # split parts, or inner parts of each expert (1 when none)
    slices: dict[Any, _Slice] = field(default_factory=dict)  # index | (ep_rank, inner index) | 0
    holders: int = 0  # bit mask of the ranks holding (part of) it


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_field(d: Mapping[str, Any], key: str, where: str, what: str, minimum: int = 0) -> int:
    """``d[key]``, which must be an int >= ``minimum``; else a one-line error naming ``what``."""
    v = d.get(key)
    if not _is_int(v) or v < minimum:
        raise UnshardError(f"{where}: {what} {key} is {json.dumps(v)}, not an integer >= {minimum}")
    return v


def _split_kind(split: Any, where: str) -> tuple[str, int, int]:
    """``(kind, dim, parts)`` of a manifest ``split`` entry (its field types checked)."""
    if split is None:
        return "whole", -1, 1
    if isinstance(split, dict) and "experts" in split:
        experts = split["experts"]
        if not isinstance(experts, list) or not all(_is_int(e) for e in experts):
            raise UnshardError(f"{where}: split experts is {json.dumps(experts)}, not a list of integers")
        if "split" not in split:
            raise UnshardError(f"{where}: split of stacked experts has no field 'split'")
        inner = split["split"]
        if inner is None:
            return "experts", -1, 1
        if not isinstance(inner, dict):
            raise UnshardError(f"{where}: split split is {json.dumps(inner)}, not null or an object")
        _int_field(inner, "index", where, "split split")
        return "experts", _int_field(inner, "dim", where, "split split"), _int_field(inner, "parts", where, "split split", 1)
    if isinstance(split, dict) and {"dim", "index", "parts"} <= split.keys():
        _int_field(split, "index", where, "split")
        return "split", _int_field(split, "dim", where, "split"), _int_field(split, "parts", where, "split", 2)
    raise UnshardError(f"{where}: split {json.dumps(split)} is not a split this tool knows")


def _check_file_name(fname: str, where: str) -> None:
    """A manifest's file names are plain names inside the rank directory: no separators, no
    leading dot (``..``, hidden or temporary files), no NUL."""
    if not fname or "/" in fname or "\\" in fname or "\0" in fname or fname.startswith("."):
        raise UnshardError(f"{where}: refuses file name {fname!r} (not a plain file name in the rank directory)")


def _sliced(shape: tuple[int, ...], dim: int, parts: int) -> tuple[int, ...]:
    s = list(shape)
    s[dim] //= parts
    return tuple(s)


@dataclass
class UnshardPlan:
    """A checked layout: what every output tensor is made of."""

    root: Path
    topology: dict[str, Any]
    topo: Topology
    tensors: dict[str, _Gathered]
    extra_files: list[str]

    @property
    def total_size(self) -> int:
        return sum(_nbytes(g) for g in self.tensors.values())


def _nbytes(g: _Gathered) -> int:
    return DTYPE_BITS[g.dtype] * math.prod(g.source_shape) // 8


def _load_topology(root: Path) -> tuple[dict[str, Any], Topology]:
    tj, _ = load_json(root / TOPOLOGY_NAME, UnshardError)
    where = root / TOPOLOGY_NAME
    if not isinstance(tj, dict) or tj.get("format") != FORMAT:
        raise UnshardError(f"{where}: not a k3ckpt rank layout (format is not {FORMAT!r})")
    if tj.get("version") != 1:
        raise UnshardError(f"{where}: layout version {tj.get('version')!r} is not supported (1 is)")
    try:
        topo = Topology.make(ep=tj["ep"], tp=tj["tp"], world_size=tj["world_size"],
                             placement=tj["expert_placement"], num_experts=tj["num_experts"])
    except KeyError as e:
        raise UnshardError(f"{where}: field {e.args[0]!r} missing") from None
    except TopologyError as e:
        raise UnshardError(f"{where}: {e}") from None
    if tj.get("moe_tp") != topo.moe_tp or tj.get("experts_by_rank") != topo.experts_by_ep_rank():
        raise UnshardError(f"{where}: moe_tp or experts_by_rank disagree with ep {topo.ep}, world size "
                           f"{topo.world_size}, {topo.num_experts} experts placed {topo.placement}")
    return tj, topo


def _check_rank(root: Path, rank: int, topo: Topology, source_digest: str | None) -> dict[str, Any]:
    rdir = root / rank_dir_name(rank)
    if not rdir.is_dir():
        raise UnshardError(f"{rdir}: missing (the layout has world size {topo.world_size})")
    if not (rdir / READY_NAME).is_file():
        raise UnshardError(f"{rdir}: no READY - the rank was never finished; re-run k3ckpt reshard")
    m, _ = load_json(rdir / MANIFEST_NAME, UnshardError)
    mpath = rdir / MANIFEST_NAME
    if not isinstance(m, dict) or not isinstance(m.get("tensors"), dict) or not isinstance(m.get("files"), dict):
        raise UnshardError(f"{mpath}: not a rank manifest (no tensors/files)")
    info = topo.rank_info(rank)
    for k in ("rank", "ep_rank", "tp_rank", "moe_tp_rank"):
        if m.get(k) != getattr(info, k):
            raise UnshardError(f"{mpath}: {k} is {m.get(k)!r} but topology.json makes it {getattr(info, k)}")
    got = m.get("source_index_sha256")
    if got is not None and not isinstance(got, str):
        raise UnshardError(f"{mpath}: source_index_sha256 is {json.dumps(got)}, not a string")
    if source_digest and got is not None and got != source_digest:
        raise UnshardError(f"{mpath}: written from another source (index sha256 {got[:12]}..., "
                           f"topology.json says {source_digest[:12]}...)")
    return m


def _fold_rank(root: Path, rank: int, m: dict[str, Any], topo: Topology, tensors: dict[str, _Gathered],
               experts_by_rank: list[list[int]]) -> None:
    """Check one rank's files against its manifest and record what it holds."""
    rdir = rank_dir_name(rank)
    ep_rank = topo.rank_info(rank).ep_rank
    mpath = root / rdir / MANIFEST_NAME
    for fname, fmeta in m["files"].items():
        _check_file_name(fname, f"{mpath}: files")
        if not isinstance(fmeta, dict):
            raise UnshardError(f"{mpath}: file {fname!r}: entry is {json.dumps(fmeta)}, not an object")
    by_file: dict[str, list[str]] = {}
    for name, t in m["tensors"].items():
        if not isinstance(t, dict) or not isinstance(t.get("file"), str) or t["file"] not in m["files"]:
            raise UnshardError(f"{mpath}: tensor {name!r} names no listed file")
        by_file.setdefault(t["file"], []).append(name)
    bit = 1 << rank
    for fname, fmeta in m["files"].items():
        rel = f"{rdir}/{fname}"
        path = root / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise UnshardError(f"{path}: missing (listed in {rdir}/{MANIFEST_NAME})") from None
        if size != fmeta.get("size"):
            raise UnshardError(f"{path}: {size} bytes, the manifest says {fmeta.get('size')}")
        hdr = read_header(path, rel)
        names = by_file.get(fname, [])
        if set(names) != hdr.tensors.keys():
            odd = sorted(set(names) ^ hdr.tensors.keys())[0]
            raise UnshardError(f"{path}: tensor {odd!r} is in only one of the header and the manifest")
        for name in names:
            t = m["tensors"][name]
            h = hdr.tensors[name]
            where = f"{path}: tensor {name!r}"
            if h.dtype != t.get("dtype") or list(h.shape) != t.get("shape"):
                raise UnshardError(f"{where}: header says {h.dtype} {list(h.shape)}, "
                                   f"the manifest {t.get('dtype')} {t.get('shape')}")
            if not isinstance(t.get("sha256"), str):
                raise UnshardError(f"{mpath}: tensor {name!r}: no sha256 in the manifest")
            mwhere = f"{mpath}: tensor {name!r}"  # errors in the manifest's own fields
            kind, dim, parts = _split_kind(t.get("split"), mwhere)
            src = t.get("source_shape")
            if not isinstance(src, list) or not all(_is_int(d) and d >= 0 for d in src):
                raise UnshardError(f"{mwhere}: source_shape is {json.dumps(src)}, not a list of integers >= 0")
            src_shape = tuple(src)
            g = tensors.get(name)
            if g is None:
                g = tensors[name] = _Gathered(h.dtype, src_shape, kind, dim, parts)
            elif (g.dtype, g.source_shape, g.kind, g.dim, g.parts) != (h.dtype, src_shape, kind, dim, parts):
                other = (g.holders & -g.holders).bit_length() - 1
                raise UnshardError(f"{where}: rank {rank} and rank {other} disagree on its dtype, source "
                                   f"shape or split")
            key, want_shape = _slice_key(g, t["split"], ep_rank, experts_by_rank, where)
            if tuple(h.shape) != want_shape:
                raise UnshardError(f"{where}: shape {list(h.shape)} does not tile source shape "
                                   f"{list(g.source_shape)} as split {json.dumps(t['split'])}")
            s = g.slices.get(key)
            if s is None:
                g.slices[key] = _Slice(rel, hdr.data_start + h.begin, h.end - h.begin, t["sha256"], rank)
            elif s.sha256 != t["sha256"]:
                raise UnshardError(f"{where}: sha256 differs from the same slice on rank {s.rank} "
                                   f"({t['sha256'][:12]}... vs {s.sha256[:12]}...)")
            g.holders |= bit


def _slice_key(g: _Gathered, split: Any, ep_rank: int, experts_by_rank: list[list[int]],
               where: str) -> tuple[Any, tuple[int, ...]]:
    """Which slice of the tensor this entry is, and the shape it must have."""
    if g.kind == "whole":
        return 0, g.source_shape
    if g.kind == "split":
        i = split["index"]
        if not (isinstance(i, int) and 0 <= i < g.parts) or g.dim >= len(g.source_shape) \
                or g.source_shape[g.dim] % g.parts:
            raise UnshardError(f"{where}: split {json.dumps(split)} does not tile source shape {list(g.source_shape)}")
        return i, _sliced(g.source_shape, g.dim, g.parts)
    experts = split["experts"]
    if experts != experts_by_rank[ep_rank]:
        raise UnshardError(f"{where}: holds experts {experts} but topology.json gives ep rank {ep_rank} "
                           f"{experts_by_rank[ep_rank]}")
    shape = (len(experts),) + g.source_shape[1:]
    inner = split["split"]
    if inner is None:
        return (ep_rank, 0), shape
    i = inner["index"]  # checked by _split_kind
    if not (isinstance(i, int) and 0 <= i < g.parts) or not 0 < g.dim < len(shape) or shape[g.dim] % g.parts:
        raise UnshardError(f"{where}: split {json.dumps(split)} does not tile source shape {list(g.source_shape)}")
    return (ep_rank, i), _sliced(shape, g.dim, g.parts)


def _check_coverage(tensors: dict[str, _Gathered], topo: Topology) -> None:
    """Every tensor on exactly the ranks its placement names, every slice present."""
    everyone = (1 << topo.world_size) - 1
    owners: dict[int, int] = {}
    # a tensor its only owner dropped is on no rank at all: its siblings in the other experts say so
    siblings: dict[str, set[int]] = {}
    for name, g in tensors.items():
        expert = classify(name).expert
        if expert is None:
            want = everyone
        else:
            siblings.setdefault(name.replace(f".experts.{expert}.", ".experts.{}.", 1), set()).add(expert)
            if expert not in owners:
                if not 0 <= expert < topo.num_experts:
                    raise UnshardError(f"tensor {name!r}: expert {expert} is not among the layout's "
                                       f"{topo.num_experts} experts")
                owners[expert] = sum(1 << r for r in topo.owner_ranks(expert))
            want = owners[expert]
        if g.holders != want:
            lacking = [r for r in range(topo.world_size) if want >> r & 1 and not g.holders >> r & 1]
            extra = [r for r in range(topo.world_size) if g.holders >> r & 1 and not want >> r & 1]
            what = f"missing on rank {lacking[0]}" if lacking else f"on rank {extra[0]}, which topology.json does not place it on"
            raise UnshardError(f"tensor {name!r}: {what}")
        if g.kind == "split":
            want_keys: set[Any] = set(range(g.parts))
        elif g.kind == "experts":
            want_keys = {(e, i) for e in range(topo.ep) for i in range(g.parts)}
        else:
            want_keys = {0}
        if g.slices.keys() != want_keys:
            raise UnshardError(f"tensor {name!r}: parts {sorted(want_keys - g.slices.keys())} missing")
        if g.kind == "experts" and g.source_shape[:1] != (topo.num_experts,):
            raise UnshardError(f"tensor {name!r}: stacked source shape {list(g.source_shape)} does not "
                               f"have the layout's {topo.num_experts} experts in dim 0")
    for template, experts in siblings.items():
        if len(experts) != topo.num_experts:
            e = min(set(range(topo.num_experts)) - experts)
            owner = topo.owner_ranks(e)[0]
            raise UnshardError(f"tensor {template.format(e)!r}: on no rank (rank {owner} should hold it; "
                               f"{len(experts)} of {topo.num_experts} experts have it)")


def plan_unshard(layout: str | os.PathLike[str]) -> UnshardPlan:
    """Read and check a rank layout (headers and manifests only; no tensor data).

    Raises:
        UnshardError: a rank, READY, manifest or file is missing, a manifest disagrees with
            topology.json or with a header, or a tensor's parts do not tile it.
        ConfigError: the layout's ``config.json`` is missing or invalid.
    """

    root = Path(layout)
    if not root.is_dir():
        raise UnshardError(f"{root}: {'not a directory' if root.exists() else 'no such directory'}", path=root)
    tj, topo = _load_topology(root)
    # the checkpoint written is loaded by an engine: its config (copied from here) must parse
    require_config(root)
    source = tj.get("source")
    source_digest = source.get("index_sha256") if isinstance(source, dict) else None
    if source_digest is not None and not isinstance(source_digest, str):
        raise UnshardError(f"{root / TOPOLOGY_NAME}: source index_sha256 is {json.dumps(source_digest)}, not a string")
    experts_by_rank = topo.experts_by_ep_rank()
    tensors: dict[str, _Gathered] = {}
    for r in range(topo.world_size):
        m = _check_rank(root, r, topo, source_digest)
        _fold_rank(root, r, m, topo, tensors, experts_by_rank)
        del m  # one manifest in memory at a time
    _check_coverage(tensors, topo)
    return UnshardPlan(root, tj, topo, tensors, _extra_files(root))


def _extra_files(root: Path) -> list[str]:
    """The layout's copies of the source's non-weight files (config, tokenizer, LICENSE, ...)."""
    def keep(rel: str) -> bool:
        base = rel.rsplit("/", 1)[-1]
        return not (rel == TOPOLOGY_NAME or rel.startswith(("rank-", "node-")) or base.endswith(".safetensors")
                    or base == INDEX_NAME or is_working_file(rel))
    return [f for f in iter_checkpoint_files(root) if keep(f)]


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class _OutShard:
    name: str
    tensors: list[str]
    prefix: bytes = b""
    offsets: list[tuple[int, int]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.prefix) + (self.offsets[-1][1] if self.offsets else 0)


def _pack(plan: UnshardPlan, max_shard_size: int) -> list[_OutShard]:
    groups: list[list[str]] = []
    size = 0
    for name in sorted(plan.tensors, key=natural_key):
        n = _nbytes(plan.tensors[name])
        if not groups or (groups[-1] and size + n > max_shard_size):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    shards = [_OutShard(hf_shard_name(i, len(groups)), g) for i, g in enumerate(groups)]
    for s in shards:
        specs = [TensorSpec(n, plan.tensors[n].dtype, plan.tensors[n].source_shape) for n in s.tensors]
        s.prefix, s.offsets = build_header(specs, {"format": "pt"})
    return shards


class _Verifier:
    """sha256 of one slice as it is read, checked against its manifest digest at the end."""

    def __init__(self, root: Path, name: str, s: _Slice) -> None:
        self.root = root
        self.name = name
        self.slice = s
        self.h = hashlib.sha256()
        self.seen = 0

    def __call__(self, data: memoryview) -> None:
        self.h.update(data)
        self.seen += len(data)

    def check(self) -> None:
        s = self.slice
        if self.seen != s.nbytes or self.h.hexdigest() != s.sha256:
            raise UnshardError(f"{self.root / s.file}: tensor {self.name!r}: sha256 {self.h.hexdigest()[:12]}... does not "
                               f"match the rank manifest ({s.sha256[:12]}...): the rank's data changed")


def _copy_tensor(root: Path, name: str, g: _Gathered, copier: Copier, fds: FdCache, dst: int, do: int,
                 progress: Callable[[int], None] | None, topo: Topology) -> None:
    """Reassemble one tensor at offset ``do`` of ``dst``, verifying every slice read."""
    def sink(v: _Verifier) -> Callable[[memoryview], None]:
        if progress is None:
            return v

        def both(data: memoryview) -> None:
            v(data)
            progress(len(data))
        return both

    verifiers: list[_Verifier] = []

    def verifier(key: Any) -> _Verifier:
        v = _Verifier(root, name, g.slices[key])
        verifiers.append(v)
        return v

    item = DTYPE_BITS[g.dtype]
    if g.kind == "whole":
        v = verifier(0)
        copier.contiguous(fds.get(v.slice.file), dst, v.slice.offset, do, v.slice.nbytes, sink(v))
    elif g.kind == "split":
        _join(g.source_shape, g.dim, item, [verifier(i) for i in range(g.parts)], [0] * g.parts,
              copier, fds, dst, do, sink)
    else:
        per_expert = g.source_shape[1:]
        ebytes = item * math.prod(per_expert) // 8
        for ep_rank, experts in enumerate(topo.experts_by_ep_rank()):
            vs = [verifier((ep_rank, i)) for i in range(g.parts)]
            for q, e in enumerate(experts):
                if g.parts == 1:
                    v = vs[0]
                    copier.contiguous(fds.get(v.slice.file), dst, v.slice.offset + q * ebytes, do + e * ebytes,
                                      ebytes, sink(v))
                else:
                    part_bytes = ebytes // g.parts
                    _join(per_expert, g.dim - 1, item, vs, [q * part_bytes] * g.parts, copier, fds, dst,
                          do + e * ebytes, sink)
    for v in verifiers:
        v.check()


def _join(shape: tuple[int, ...], dim: int, item_bits: int, vs: list[_Verifier], skips: list[int],
          copier: Copier, fds: FdCache, dst: int, do: int, sink: Callable) -> None:
    """Concatenate the parts ``vs`` (each starting ``skips[p]`` bytes into its slice) along
    ``dim`` of a tensor of ``shape``, writing it at ``do``."""
    k = len(vs)
    outer = math.prod(shape[:dim])
    part_row = (shape[dim] // k) * item_bits * math.prod(shape[dim + 1:]) // 8
    if outer == 1:  # each part is one contiguous block of the result
        for p, v in enumerate(vs):
            copier.contiguous(fds.get(v.slice.file), dst, v.slice.offset + skips[p], do + p * part_row, part_row,
                              sink(v))
        return
    srcs = [(fds.get(v.slice.file), v.slice.offset + skips[p]) for p, v in enumerate(vs)]
    copier.interleave(srcs, dst, do, outer, part_row, [sink(v) for v in vs])


class _OutOfSpace(UnshardError):
    """A write found the filesystem full; :func:`run_unshard` removes the temporary shards and
    replaces the message with the shortfall."""

    def __init__(self, path: Path, err: OSError) -> None:
        super().__init__(f"writing {path}: {err.strerror or err}", path=path)
        self.where = path
        self.strerror = err.strerror or str(err)


def _write_shard(plan: UnshardPlan, topo: Topology, shard: _OutShard, dest: Path, mode: str,
                 progress: Callable[[int], None] | None, hash_step: int) -> None:
    """Write one output shard under its temporary name and fsync it.

    Raises:
        _OutOfSpace: the filesystem is full (naming the shard).
    """
    fds = FdCache(lambda rel: plan.root / rel)
    copier = Copier(mode, fds, hash_step)
    try:
        dst = os.open(tmp_name(dest), os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            os.pwrite(dst, shard.prefix, 0)
            base = len(shard.prefix)
            if shard.size > base:
                os.ftruncate(dst, shard.size)
            for name, (begin, _) in zip(shard.tensors, shard.offsets):
                _copy_tensor(plan.root, name, plan.tensors[name], copier, fds, dst, base + begin, progress, topo)
            os.fsync(dst)
        finally:
            os.close(dst)
    except OSError as e:
        if e.errno in NO_SPACE:
            raise _OutOfSpace(dest, e) from None
        raise
    finally:
        fds.close()


@dataclass
class UnshardResult:
    out: Path
    shards: list[str]
    tensors: int
    total_size: int
    seconds: float
    files_copied: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"out": str(self.out), "shards": self.shards, "tensors": self.tensors,
                "total_size": self.total_size, "seconds": round(self.seconds, 3),
                "files_copied": self.files_copied}


def render_unshard(plan: UnshardPlan, res: UnshardResult) -> str:
    """What ``k3ckpt unshard`` prints: what was written, from which topology, in one line."""
    from ..utils import human_bytes

    t = plan.topology
    return (f"ok: {res.out}: {res.tensors} tensors ({human_bytes(res.total_size)}) in {len(res.shards)} shards, "
            f"from ep {t['ep']} x tp {t['tp']}, world size {t['world_size']}")


def _prepare_out(out: Path, layout: Path, force: bool, check_space: bool, needed: int) -> None:
    """Refuse an output holding a finished checkpoint (without ``force``) or too little space,
    then remove the index (first: a run killed after this leaves no index over mixed shards),
    the shards and the temporary files of an earlier run - all this command's own (the caller
    claimed ``out``)."""
    index = out / INDEX_NAME
    if index.exists() and not force:
        raise UnshardError(f"{out} already holds a checkpoint ({INDEX_NAME}); use another directory or --force")
    old = [p for p in out.iterdir()
           if SHARD_PATTERN.fullmatch(p.name) or (p.name.startswith(".") and p.name.endswith(".tmp"))]
    if check_space:
        reclaim = sum(p.lstat().st_blocks * 512 for p in old)
        require_free_space(out, max(0, needed + space_margin(needed) - reclaim),
                           f"for the checkpoint ({human_bytes(needed)} to write, with a margin)")
    if index.exists():
        index.unlink()
        fsync_dir(out)
    for p in old:  # shards and temporaries of an earlier run; nothing else is touched
        p.unlink()


def run_unshard(
    plan: UnshardPlan,
    out: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    jobs: int | None = None,
    force: bool = False,
    mode: str = "kernel",
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    check_space: bool = True,
) -> UnshardResult:
    """Write the checkpoint ``plan`` describes to ``out``.

    ``out`` must be new, empty, or an earlier unshard's output holding nothing else
    (:func:`k3ckpt.utils.ownership.claim_output_dir`); the run holds ``out``'s lock throughout.

    Args:
        max_shard_size: bytes of tensor data per output shard (a larger tensor gets its own).
        jobs: shards written in parallel [default: min(CPUs, 8)].
        force: replace a checkpoint already in ``out`` (one this command wrote).
        mode: ``kernel`` (copy_file_range where possible) or ``buffered``.
        check_space: refuse up front when the filesystem has less free space than the output
            plus a margin.

    Raises:
        UnshardError: ``out`` already holds a checkpoint (without ``force``), a slice read
            does not match its manifest digest (nothing is left under a final name), or the
            disk filled up (temporary shards removed, the shortfall named).
        OutputNotOwnedError: ``out`` holds files k3ckpt did not write, or another command's.
        OutputLockedError: another reshard or unshard is writing into ``out``.
        DiskSpaceError: not enough free space (checked before any byte is written).
    """
    t0 = time.perf_counter()
    hash_step = K3CKPT_HASH_BUFFER.get()  # a bad value is refused before OUT is made
    if max_shard_size < 1:
        raise UnshardError(f"--max-shard-size {max_shard_size} must be positive")
    outp = Path(out)
    if is_within(outp, plan.root):
        raise UnshardError(f"{outp}: the output must not be inside the rank layout {plan.root}")
    if outp.exists() and not outp.is_dir():
        raise UnshardError(f"{outp}: exists and is not a directory")
    shards = _pack(plan, max_shard_size)
    with locked_output_dir(outp, output_lock(outp, "unshard")):  # a refusal leaves no directory it made
        claim_output_dir(outp, "unshard", [INDEX_NAME, *(s.name for s in shards), *plan.extra_files])
        needed = sum(s.size for s in shards) + sum((plan.root / f).stat().st_size for f in plan.extra_files)
        _prepare_out(outp, plan.root, force, check_space, needed)
        if on_plan is not None:
            on_plan(plan.total_size)
        proofs = _source_proofs(plan)  # before the first read: what vouches for the bytes to be read
        try:
            _write_all(plan, outp, shards, jobs, mode, progress, hash_step)
        except _OutOfSpace as e:
            raise _no_space_error(outp, e.where, e.strerror, needed) from None
        except OSError as e:
            if e.errno not in NO_SPACE:
                raise
            raise _no_space_error(outp, Path(e.filename or outp), e.strerror or str(e), needed) from None
        _record_proofs(plan, outp, shards, proofs)
    return UnshardResult(outp, [s.name for s in shards], len(plan.tensors), plan.total_size,
                         time.perf_counter() - t0, list(plan.extra_files))


def _source_proofs(plan: UnshardPlan) -> dict[str, str | None]:
    """The layout's file (relative to its root) -> the origin that proved its bytes, as ``reshard``
    recorded it (docs/trust.md; None: never proven, or changed since): a rank's parts in its
    directory's stat cache, the non-weight files in the layout root's."""
    by_dir: dict[str, set[str]] = {}
    for g in plan.tensors.values():
        for s in g.slices.values():
            rank_dir, _, name = s.file.partition("/")
            by_dir.setdefault(rank_dir, set()).add(name)
    proofs = recorded_proofs(plan.root, list(plan.extra_files))
    for rank_dir, names in by_dir.items():
        proofs.update({f"{rank_dir}/{n}": o for n, o in recorded_proofs(plan.root / rank_dir, sorted(names)).items()})
    return proofs


def _record_proofs(plan: UnshardPlan, outp: Path, shards: list[_OutShard], proofs: dict[str, str | None]) -> None:
    """Tell the output's stat cache what vouches for what was just written: a shard is proven by
    the origins of every rank part it was read from - each slice was hashed as it was copied and
    matched the digest ``reshard`` recorded from those proven bytes -, a non-weight file by its
    source's. A part nothing proved leaves its shards unproven (verify and preflight say so)."""
    shard_proofs = {s.name: joined_origin([proofs.get(sl.file) for n in s.tensors for sl in plan.tensors[n].slices.values()])
                    for s in shards}
    entries: dict[str, dict[str, Any]] = {name: {"proven": o} for name, o in shard_proofs.items()}
    entries.update({rel: {"proven": proofs.get(rel)} for rel in plan.extra_files})
    # the index lists exactly the shards' tensors (verify's structure checks hold it to their
    # headers): proven as they are
    entries[INDEX_NAME] = {"proven": joined_origin(list(shard_proofs.values()))}
    record_written(outp, entries)


def _no_space_error(outp: Path, where: Path, why: str, needed: int) -> UnshardError:
    """The disk filled up: the temporary shards are gone by now (:func:`_write_all`); say how
    much more free space the whole output needs (nothing of it is final yet)."""
    for p in outp.glob(".*.tmp"):  # a non-weight file's copy cut short
        p.unlink(missing_ok=True)
    needed += space_margin(needed)
    free = free_bytes(outp)
    if needed > free:
        tail = (f"{outp} needs {needed - free} bytes ({human_bytes(needed - free)}) more free space "
                f"({needed} bytes needed, {free} free; temporary files removed)")
    else:
        tail = f"the checkpoint needs {needed} bytes, {free} are free now (temporary files removed)"
    return UnshardError(f"writing {where}: {why}; {tail}: free space and re-run", path=where)


def _write_all(plan: UnshardPlan, outp: Path, shards: list[_OutShard], jobs: int | None, mode: str,
               progress: Callable[[int], None] | None, hash_step: int) -> None:
    """The non-weight files, then every shard under its temporary name (in parallel), then the
    renames and the index: a failure leaves no temporary shard and no index."""
    copy_files(plan.root, plan.extra_files, outp)
    workers = jobs or min(8, os.cpu_count() or 1)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="unshard")
    try:
        futures = [pool.submit(_write_shard, plan, plan.topo, s, outp / s.name, mode, progress, hash_step)
                   for s in sorted(shards, key=lambda s: -s.size)]
        for n, fu in enumerate(futures, 1):
            fu.result()
            pause_point("unshard_shard", n)  # test hook: the n-th shard written (not yet renamed)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        for s in shards:
            tmp_name(outp / s.name).unlink(missing_ok=True)
        raise
    finally:
        pool.shutdown(wait=True)
    for s in shards:
        os.replace(tmp_name(outp / s.name), outp / s.name)
    fsync_dir(outp)
    weight_map = {n: s.name for s in shards for n in s.tensors}
    index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(outp / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
    fsync_dir(outp)


def unshard(
    layout: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    jobs: int | None = None,
    force: bool = False,
    mode: str = "kernel",
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    check_space: bool = True,
) -> UnshardResult:
    """Check a rank layout and reassemble it: :func:`plan_unshard` then :func:`run_unshard`."""
    plan = plan_unshard(layout)
    return run_unshard(plan, out, max_shard_size=max_shard_size, jobs=jobs, force=force, mode=mode,
                       progress=progress, on_plan=on_plan, check_space=check_space)
