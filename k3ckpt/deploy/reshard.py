"""``k3ckpt reshard``: write a checkpoint as the directories each node (``--format node``, the
default) or each rank (``--format rank``) of a topology loads.

``--format rank`` is the rank-layout contract (``docs/layout.md``): ``OUT/topology.json``, the
source's non-weight files, and ``OUT/rank-NNNNN/{model-rank-R-part-K.safetensors,
rank-manifest.json, READY}``. What each rank holds comes from
:func:`k3ckpt.format.topology.tensors_for_ranks`. The node format is described below.

How bytes move (streaming; memory is a few bounded buffers per worker, whatever the size):

- each rank's tensors are grouped per source file and sorted by source offset, then packed
  into parts of at most ``--max-shard-size``: its dense tensors (whole, or its tp_rank's cut)
  first, in parts of their own, then its experts - so a dense part is byte-identical on every
  rank of the same tp_rank, and is hashed once per run;
- every tensor becomes a list of *byte runs* ``(offset, length, count, stride)`` in the source:
  a whole tensor, a dim-0 split and a run of consecutive whole experts are one contiguous run;
  a split of a later dim is ``count`` rows of ``length`` bytes ``stride`` apart;
- adjacent contiguous runs (a rank's experts: their six tensors are adjacent in the shard) are
  coalesced and copied kernel-side with ``os.copy_file_range`` (falling back to ``os.sendfile``,
  then to a bounded ``pread``/``pwrite``), in chunks of :data:`CHUNK` bytes;
- strided runs are gathered through bounded buffers (whole rows read, columns cut row by row);
- output files are written in parallel by a thread pool (``--jobs``).

Hashing. Per-tensor and per-file sha256 are computed while writing, in the same pass: each
kernel-side chunk is hashed from the *source's* pages through a bounded read-only mapping (hot
pages: the copy that follows reads the same ones; nothing is read back from the output, and no
byte is read from disk twice), and buffered chunks are hashed from the buffer they are written
from. The file digest must cover every output byte, so it is always computed. A tensor slice's
digest is computed once per run, fed from that same read, and reused wherever several ranks or
nodes hold the same slice (replicated tensors, TP slices across dp ranks); a file byte-identical
to another of the run (a twin: a node's dense files, a rank's dense parts) takes its digests
from that one and is only copied, as soon as that one is written. With ``--manifest``
(:func:`manifest_digests`) whole tensors of source files that ``verify`` or ``fetch`` last found
unchanged and equal to the manifest take their digest from it and are not hashed at all; every
other tensor is hashed as above, so a source that does not match the manifest never gets its
digests.

Decisions the contract leaves open:

- data offsets: the data buffer of every output file starts at a multiple of :data:`ALIGN`
  (see BENCHMARKS.md for the 16 B vs 4 KiB measurement); tensors follow back to back, as the
  safetensors format requires (no gaps), in source order;
- stacked expert tensors (gpt-oss ``mlp.experts.*``, :class:`~k3ckpt.topology.ExpertSlice`) are
  written with the rank's experts stacked in dim 0 in the order of ``topology.json``'s
  ``experts_by_rank`` (so a round_robin rank gathers rows ``r, r+ep, ...``), and ``split`` is
  ``{"dim": 0, "experts": [...], "split": null | {"dim", "index", "parts"}}`` (the extra keys
  are allowed by the contract; no ``parts`` key, because the slice is not an even split);
- ``source.index_sha256`` of a single-file checkpoint is the sha256 of its header prefix (the
  8-byte length and the JSON header);
- non-weight files: every file of the source except ``*.safetensors``,
  ``model.safetensors.index.json`` (a stray safetensors file not in the index is not copied) and
  working files (:func:`~k3ckpt.checkpoint.is_working_file`: a fetch's ``*.part``, journals,
  lock, ``*.tmp``), copied in bounded chunks;
- resuming: a rank whose ``READY`` exists, whose manifest matches what this run would write
  (same tensors, shapes, splits, files and sizes, same source index digest) and whose files
  still have the stat recorded when they were written (size, mtime, inode, ctime in
  ``OUT/.cache/k3ckpt/units/rank-NNNNN.json``: a byte changed in place shows in the ctime even
  when the mtime is put back, and nothing is re-hashed) is skipped; any other rank directory is
  cleared and rewritten. Files are written under temporary names (``.*.tmp``) and renamed after
  ``fsync``; the manifest is renamed into place after its files, the stat record after the
  manifest, ``READY`` last, each followed by an ``fsync`` of the directory;
- the output: new, empty or an earlier reshard's (:func:`k3ckpt.utils.ownership.claim_output_dir`;
  files k3ckpt did not write are refused, ``--force`` included), under ``OUT/.k3ckpt-output.lock``
  for the whole run, with free space for the bytes still to write checked first; on ENOSPC the
  run's temporary files are removed and the shortfall is named;
- ``OUT/topology.json`` of a different topology or source is refused (exit 2) unless ``--force``.

``--format node`` (the CLI's default; ``hf-node`` is its older name) writes node directories
for engines that read ordinary checkpoints and filter experts themselves (vLLM
``--enable-expert-parallel --enable-ep-weight-filter``): per node of ``--gpus-per-node`` GPUs
(all nodes, or ``--node N``; without ``--gpus-per-node`` one node holds the whole world),
``OUT/node-NNNNN/`` holds every non-expert tensor whole plus the routed experts of the node's
ranks, whole, under their source names, in the files :mod:`k3ckpt.format.nodedir` plans
(dense files, then per rank files holding only that rank's experts), a
``model.safetensors.index.json`` listing exactly those tensors, and the source's non-weight
files. The topology has vLLM's expert-parallel meaning (``ep = tp x dp`` = the world size,
experts never cut; anything else is refused with the nearest valid command). Whole tensors are
contiguous runs, so everything is copied kernel-side. ``k3ckpt-node.json`` (the plan's marker
plus per-tensor and per-file sha256) is written after the index and ``READY`` last; the marker
plays the rank manifest's part for resuming, and ``k3ckpt verify`` checks the node's experts
against it instead of the config's full count. ``OUT/topology.json`` then has format
``k3ckpt-node-layout`` (plus ``dp`` and ``gpus_per_node``), so neither a rank-layout run into
the same directory nor ``unshard`` mistakes it for a rank layout.

The copying machinery (kernel-side copies, strided gathers, fd caches, atomic files) lives in
:mod:`k3ckpt.bytecopy`, shared with ``unshard``.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import math
import operator
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import partial
from itertools import compress, repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import ReshardError
from ..faults import fault_point, pause_point
from ..format.checkpoint import INDEX_NAME, Checkpoint, bulk_allocation, is_working_file, open_checkpoint
from ..format.header import DTYPE_BITS, TensorInfo, header_prefix
from ..format.jsontext import JsonStr, ShapeJson, json_records, json_strings
from ..format.layout import (
    FORMAT,
    LAYOUT_ALIASES,
    LAYOUTS,
    MANIFEST_NAME,
    NODE_LAYOUT_FORMAT,
    NODE_MARKER,
    PARTIAL_MARKER,
    READY_NAME,
    TOPOLOGY_NAME,
    VERSION,
    node_dir_name,
    part_name,
    rank_dir_name,
)
from ..format.loadable import require_loadable
from ..format.nodedir import NODE_MAX_FILE_SIZE, NodeDir, plan_node_dir
from ..format.topology import (
    ExpertSlice,
    InventoryIndex,
    RankSelection,
    Split,
    Topology,
    TopologyError,
    index_of,
    num_nodes,
    tensors_for_ranks,
)
from ..utils import copy_files, fsync_dir, human_bytes, is_within, write_atomic
from ..utils.ownership import claim_output_dir
from ..utils.space import free_bytes, require_free_space, space_margin
from .bytecopy import CHUNK, NO_SPACE, Copier, FdCache, Run, map_window, output_lock, tmp_name

if TYPE_CHECKING:
    from ..integrity.manifest import Manifest

#: Alignment of each output file's data buffer.
ALIGN = 4096
DEFAULT_MAX_FILE_SIZE = NODE_MAX_FILE_SIZE


# ---------------------------------------------------------------------------------------------
# Planning: what goes where


#: Writers ``reshard`` runs without ``--jobs``: one per core, at most this many.
MAX_DEFAULT_WRITERS = 16

class OutTensor(NamedTuple):
    """One tensor of an output file and its source byte runs. A named tuple: a K3 reshard plans
    one per tensor (~497k), and whole tensors are built in C-level loops (:func:`_whole_tensors`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source_shape: tuple[int, ...]
    split: dict | None
    src_file: str
    runs: tuple[Run, ...]
    nbytes: int
    key: tuple  # identifies the bytes (name + slice): equal keys have equal digests

    @property
    def src_start(self) -> int:
        return self.runs[0].offset if self.runs else 0


@dataclass
class OutFile:
    rank: int
    name: str
    tensors: list[OutTensor]
    prefix: bytes = b""
    offsets: list[tuple[int, int]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.prefix) + (self.offsets[-1][1] if self.offsets else 0)


def _row_bytes(dtype: str, dims: tuple[int, ...], name: str) -> int:
    bits = DTYPE_BITS[dtype] * math.prod(dims)
    if bits % 8:
        raise TopologyError(f"tensor {name!r}: a {dtype} slice of {list(dims)} does not fill whole bytes")
    return bits // 8


def _split_runs(base: int, shape: tuple[int, ...], dtype: str, split: Split | None, name: str) -> list[Run]:
    """Runs of ``split`` of a tensor of ``shape`` stored at absolute offset ``base``."""
    if split is None:
        return [Run(base, _row_bytes(dtype, shape, name))]
    d = split.dim
    inner = _row_bytes(dtype, shape[d + 1:], name)
    outer = math.prod(shape[:d])
    a, b = split.range(shape)
    length = (b - a) * inner
    stride = shape[d] * inner
    if outer == 1:
        return [Run(base + a * inner, length)]
    return [Run(base + a * inner, length, outer, stride)]


def _tensor_plan(name: str, info: Any, data_start: int, placement: Any) -> OutTensor:
    base = data_start + info.begin
    shape = tuple(info.shape)
    if isinstance(placement, ExpertSlice):
        per_expert = shape[1:]
        ebytes = _row_bytes(info.dtype, per_expert, name)
        inner = placement.split
        # the inner split's dim counts in the stacked tensor; per expert it is one less
        sub = Split(inner.dim - 1, inner.index, inner.parts) if inner is not None else None
        runs: list[Run] = []
        for e in placement.experts:
            for r in _split_runs(base + e * ebytes, per_expert, info.dtype, sub, name):
                last = runs[-1] if runs else None
                if last is not None and last.count == 1 and r.count == 1 and last.offset + last.length == r.offset:
                    runs[-1] = Run(last.offset, last.length + r.length)
                else:
                    runs.append(r)
        out_shape = placement.shape(shape)
        split_json: dict | None = placement.to_json()
        key: tuple[Any, ...] = (name, "experts", placement.experts, inner)
    else:
        runs = _split_runs(base, shape, info.dtype, placement, name)
        out_shape = placement.shape(shape) if placement is not None else shape
        split_json = placement.to_json() if placement is not None else None
        key = (name, placement)
    nbytes = sum(r.nbytes for r in runs)
    return OutTensor(name, info.dtype, out_shape, shape, split_json, info.file, tuple(runs), nbytes, key)


_new_run = partial(tuple.__new__, Run)
_new_out = partial(tuple.__new__, OutTensor)
# TensorInfo and OutTensor columns
_I_NAME, _I_DTYPE, _I_SHAPE, _I_BEGIN, _I_END, _I_FILE = (operator.itemgetter(i) for i in range(6))
_T_NAME, _T_DTYPE, _T_SHAPE, _T_SOURCE_SHAPE, _T_SRC, _T_RUNS, _T_NBYTES, _T_KEY = (
    operator.itemgetter(i) for i in (0, 1, 2, 3, 5, 6, 7, 8))
_LAST = operator.itemgetter(-1)


def _whole_tensors(infos: list[TensorInfo], starts: dict[str, int]) -> list[OutTensor]:
    """What :func:`_tensor_plan` makes of tensors placed whole (one contiguous run each, key
    ``(name, None)``), built in C-level loops: every tensor of a node directory, and a rank's
    experts and replicated tensors. ``starts``: each source file's data offset."""
    names = list(map(_I_NAME, infos))
    files = list(map(_I_FILE, infos))
    shapes = list(map(_I_SHAPE, infos))
    begins = list(map(_I_BEGIN, infos))
    nbytes = list(map(operator.sub, map(_I_END, infos), begins))  # the header's dtype x shape (validated)
    runs = map(_new_run, zip(map(operator.add, map(starts.__getitem__, files), begins), nbytes, repeat(1), repeat(0)))
    return list(map(_new_out, zip(names, map(_I_DTYPE, infos), shapes, shapes, repeat(None), files, zip(runs), nbytes,
                                  zip(names, repeat(None)))))


def _pack_files(unit: int, tensors: list[OutTensor], max_file_size: int, align: int,
                name_of: Callable[[int, int], str], *, apart: list[bool] | None = None) -> list[OutFile]:
    """Greedy packing in the given order; a tensor larger than ``max_file_size`` gets a file of
    its own. ``name_of(k, n)`` names file ``k`` of ``n``. ``apart``: a flag per tensor; the
    flagged tensors are packed in files of their own, before the others."""
    if apart is None:
        runs = [tensors]
    else:
        runs = [list(compress(tensors, apart)), list(compress(tensors, map(operator.not_, apart)))]
    groups: list[list[OutTensor]] = []
    for run in runs:
        groups += _greedy(run, list(map(_T_NBYTES, run)), max_file_size)
    groups = groups or [[]]
    files = []
    for k, g in enumerate(groups):
        prefix, offsets = header_prefix(list(map(_T_NAME, g)), list(map(_T_DTYPE, g)), list(map(_T_SHAPE, g)),
                                        {"format": "pt"}, align=align)
        if list(map(operator.sub, map(_LAST, offsets), map(_FIRST, offsets))) != list(map(_T_NBYTES, g)):
            for t, (b, e) in zip(g, offsets):
                if e - b != t.nbytes:  # a planning bug, never a user error
                    raise AssertionError(f"{t.name}: planned {t.nbytes} bytes, header says {e - b}")
        files.append(OutFile(unit, name_of(k, len(groups)), g, prefix, offsets))
    return files


_FIRST = operator.itemgetter(0)


def _greedy(items: list[OutTensor], sizes: list[int], max_file_size: int) -> list[list[OutTensor]]:
    """``items`` cut in order into groups of at most ``max_file_size`` bytes (a larger item
    alone); none for no items."""
    if not items:
        return []
    if sum(sizes) <= max_file_size:
        return [items]
    groups: list[list[OutTensor]] = []
    size = 0
    for k, (t, n) in enumerate(zip(items, sizes)):
        if not k or size + n > max_file_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


@dataclass
class RankPlan:
    rank: int
    ep_rank: int
    tp_rank: int
    moe_tp_rank: int
    files: list[OutFile]

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def layout(self) -> dict[str, Any]:
        """The manifest without digests: what a re-run compares to decide to skip a rank."""
        tensors = {}
        for f in self.files:
            for t in f.tensors:
                tensors[t.name] = {"file": f.name, "dtype": t.dtype, "shape": list(t.shape),
                                   "source_shape": list(t.source_shape), "split": t.split}
        return {"rank": self.rank, "ep_rank": self.ep_rank, "tp_rank": self.tp_rank,
                "moe_tp_rank": self.moe_tp_rank, "tensors": tensors,
                "files": {f.name: {"size": f.size} for f in self.files}}

    # what run_reshard needs of a unit of output (a rank here, a node with --format node)
    @property
    def unit(self) -> int:
        return self.rank

    @property
    def dir_name(self) -> str:
        return rank_dir_name(self.rank)

    manifest_name = MANIFEST_NAME

    def final_files(self, results: list[dict[str, Any]], source: dict[str, Any]) -> dict[str, bytes]:
        """What is written after the weights, in order: the manifest, with the digests of
        ``results`` (one per file)."""
        # json.dumps of layout() with the digests added (each tensor's and file's "sha256" last,
        # "source_index_sha256" after "files"); the tensor entries written in C-level loops
        # (a K3 rank lists ~60k; one dict each through the encoder cost ~2 us apiece). No indent.
        names: list[str] = []
        files: list[str] = []
        cols: list[OutTensor] = []
        digests: dict[str, str] = {}
        for f, res in zip(self.files, results):
            names += map(_T_NAME, f.tensors)
            files += repeat(json.dumps(f.name), len(f.tensors))
            cols += f.tensors
            digests.update(res["tensors"])
        shape_json = ShapeJson()
        fields = [("file", files), ("dtype", map(JsonStr().__getitem__, map(_T_DTYPE, cols))),
                  ("shape", map(shape_json.__getitem__, map(_T_SHAPE, cols))),
                  ("source_shape", map(shape_json.__getitem__, map(_T_SOURCE_SHAPE, cols))),
                  ("split", ["null" if t.split is None else json.dumps(t.split) for t in cols]),
                  ("sha256", json_strings(list(map(digests.__getitem__, names))))]
        head = {"rank": self.rank, "ep_rank": self.ep_rank, "tp_rank": self.tp_rank, "moe_tp_rank": self.moe_tp_rank}
        tail = {"files": {f.name: {"size": res["size"], "sha256": res["sha256"]} for f, res in zip(self.files, results)},
                "source_index_sha256": source["index_sha256"]}
        text = json.dumps(head)[:-1] + ', "tensors": ' + json_records(names, fields) + ", " + json.dumps(tail)[1:]
        return {MANIFEST_NAME: (text + "\n").encode()}


@dataclass
class NodePlan:
    """One node directory (``--format node``): the :class:`~k3ckpt.format.nodedir.NodeDir` file
    plan, with each tensor's source byte runs."""

    plan: NodeDir
    files: list[OutFile]

    @property
    def node(self) -> int:
        return self.plan.node

    @property
    def ranks(self) -> list[int]:
        return list(self.plan.ranks)

    @property
    def experts(self) -> list[int]:
        return self.plan.experts

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def unit(self) -> int:
        return self.plan.node

    @property
    def dir_name(self) -> str:
        return node_dir_name(self.plan.node)

    manifest_name = NODE_MARKER

    def layout(self) -> dict[str, Any]:
        """The node marker without digests (what a re-run compares to decide to skip a node)."""
        return self.plan.marker_json()

    def final_files(self, results: list[dict[str, Any]], source: dict[str, Any]) -> dict[str, bytes]:
        """The index, then the marker: the bytes :class:`~k3ckpt.format.nodedir.NodeDir` gives
        every producer of a node directory."""
        tensors = {name: digest for res in results for name, digest in res["tensors"].items()}
        files = {f.name: res["sha256"] for f, res in zip(self.files, results)}
        return {INDEX_NAME: self.plan.index_bytes(),
                NODE_MARKER: self.plan.marker_bytes(source["index_sha256"], tensors, files)}


@dataclass
class ReshardPlan:
    ckpt: Checkpoint
    topo: Topology
    ranks: list[RankPlan]
    source_json: dict[str, Any]
    gpus_per_node: int | None
    extra_files: list[str]
    nodes: list[NodePlan] = field(default_factory=list)
    layout: str = "rank"

    @property
    def units(self) -> list[RankPlan] | list[NodePlan]:
        """The directories to write: ranks, or nodes with ``--format node``."""
        return self.nodes if self.layout == "node" else self.ranks

    def topology_json(self) -> dict[str, Any]:
        if self.layout == "node":
            return {"format": NODE_LAYOUT_FORMAT, "version": VERSION, **self.topo.to_json(), "dp": self.topo.dp,
                    "gpus_per_node": self.gpus_per_node, "source": self.source_json}
        return {"format": FORMAT, "version": VERSION, **self.topo.to_json(), "source": self.source_json}


def _source_json(ckpt: Checkpoint) -> dict[str, Any]:
    if ckpt.index_file is not None:
        digest = hashlib.sha256((ckpt.root / ckpt.index_file).read_bytes()).hexdigest()
    else:
        (hdr,) = ckpt.shards.values()
        with open(hdr.path, "rb") as fh:
            digest = hashlib.sha256(fh.read(hdr.data_start)).hexdigest()
    out: dict[str, Any] = {"index_sha256": digest, "path": str(ckpt.root)}
    if ckpt.source.repo:
        out["repo"] = ckpt.source.repo
    if ckpt.source.revision:
        out["revision"] = ckpt.source.revision
    return out


def plan_reshard(
    source: str | os.PathLike[str] | Checkpoint,
    selection: RankSelection = RankSelection(),
    *,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    align: int = ALIGN,
    layout: str = "node",
) -> ReshardPlan:
    """Decide every output file of the selected nodes or ranks (no data is read).

    Args:
        selection: The topology and the ranks to write (default: every rank of ep 1 x tp 1).
        layout: ``rank`` (the rank-layout contract) or ``node`` (``hf-node`` is accepted too): per
            node (``selection.node``, or every node of ``selection.gpus_per_node`` GPUs; without
            it, one node holding the whole world) a local-dir checkpoint holding every non-expert
            tensor whole plus the routed experts of the node's ranks, whole, in the files
            :func:`~k3ckpt.format.nodedir.plan_node_dir` plans. The topology then has vLLM's
            expert-parallel meaning (:meth:`RankSelection.topology` with ``engine=True``).

    Raises:
        TopologyError / SplitError: impossible topology or rank selection, uneven split.
        ConfigError / EngineFilesError: the source lacks a readable ``config.json``, a tokenizer
            file or its licence (:func:`~k3ckpt.format.loadable.require_loadable`).
    """

    # The plan is ~10^5 acyclic tuples per 10^4 tensors: the cyclic GC's passes over them (and
    # over everything imported) cost ~0.05 CPU-s per 1 GB test shape and find nothing to free.
    with bulk_allocation():
        return _plan(source, selection, max_file_size, align, layout)


def _plan(source: str | os.PathLike[str] | Checkpoint, selection: RankSelection, max_file_size: int, align: int,
          layout: str) -> ReshardPlan:
    ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    if not ckpt.tensors:
        raise ReshardError(f"{ckpt.root}: no tensors to reshard")
    # Every output directory carries the source's config, tokenizer and licence: a source an
    # engine could not load would give outputs that preflight fails, so refuse it up front.
    require_loadable(ckpt.root)
    if max_file_size < 1:
        raise ReshardError(f"--max-shard-size {max_file_size} must be positive")
    if align < 8 or align & (align - 1):
        raise ReshardError(f"alignment {align} must be a power of two >= 8")
    layout = LAYOUT_ALIASES.get(layout, layout)
    if layout not in LAYOUTS:
        raise ReshardError(f"unknown --format {layout!r}; choose {' or '.join(LAYOUTS)}")
    idx = index_of(ckpt)
    topo = selection.topology_for(idx, ckpt.config, engine=layout == "node")
    ranks, node, gpus_per_node = selection.ranks, selection.node, selection.gpus_per_node
    if node is not None and ranks is not None:
        raise TopologyError("give --ranks or --node, not both")
    # a partial source's marker describes the source, not the output (the output has its own)
    skip = set(ckpt.shards) | {INDEX_NAME, NODE_MARKER, PARTIAL_MARKER}
    extra = [f for f in ckpt.iter_files()
             if f not in skip and not f.endswith(".safetensors") and not is_working_file(f)]
    if layout == "node":
        if ranks is not None:
            raise TopologyError("--format node writes whole nodes: give --node N (or nothing: every node), not "
                                "--ranks (or --format rank for per-rank directories)")
        if gpus_per_node is None:  # one node holding the whole world, the single-box case
            gpus_per_node = topo.world_size
        nodes = [node] if node is not None else list(range(num_nodes(gpus_per_node, topo.world_size)))
        node_plans = [_node_plan(ckpt, idx, topo, n, gpus_per_node, max_file_size, align) for n in nodes]
        return ReshardPlan(ckpt, topo, [], _source_json(ckpt), gpus_per_node, extra, node_plans, layout)
    selected = selection.select(topo)
    per_rank = tensors_for_ranks(idx, topo, selected, gpus_per_node=gpus_per_node)
    _require_experts(ckpt.root, idx, [(f"rank {r}", rt.rank.experts) for r, rt in sorted(per_rank.items())])
    # A rank's dense tensors (whole, or its tp_rank's cut) go in parts of their own, before its
    # experts: those parts are then byte-identical on every rank of the same tp_rank, and a run
    # hashes each distinct part once (_twin_key, as the dense files of a node layout's nodes).
    dense = frozenset(idx.dense_names)
    starts = {name: hdr.data_start for name, hdr in ckpt.shards.items()}
    cut: dict[tuple, OutTensor] = {}  # (name, placement) -> its plan: the ranks of a tp_rank share their cuts
    plans = []
    for r in selected:
        rt = per_rank[r]
        names = list(rt.tensors)
        places = list(rt.tensors.values())
        is_whole = list(map(operator.is_, places, repeat(None)))
        outs = _whole_tensors(list(map(ckpt.tensors.__getitem__, compress(names, is_whole))), starts)
        for name, p in zip(compress(names, map(operator.not_, is_whole)), compress(places, map(operator.not_, is_whole))):
            t = cut.get((name, p))
            if t is None:
                info = ckpt.tensors[name]
                t = cut[(name, p)] = _tensor_plan(name, info, starts[info.file], p)
            outs.append(t)
        src_starts = [t.src_start for t in outs]
        outs = list(map(_LAST, sorted(zip(map(_T_SRC, outs), src_starts, map(_T_NAME, outs), outs))))
        # (stacked experts, in dense_names, are the rank's own slice: not shared)
        shared = [n in dense and k[1] != "experts" for n, k in zip(map(_T_NAME, outs), map(_T_KEY, outs))]
        rank_info = rt.rank

        # a def, not a lambda: mypy cannot type a lambda with a default argument as Callable[[int, int], str]
        def name_of(k: int, _n: int, r: int = r) -> str:
            return part_name(r, k)

        plans.append(RankPlan(r, rank_info.ep_rank, rank_info.tp_rank, rank_info.moe_tp_rank,
                              _pack_files(r, outs, max_file_size, align, name_of, apart=shared)))
    return ReshardPlan(ckpt, topo, plans, _source_json(ckpt), gpus_per_node, extra)


def _require_experts(root: Path, idx: Any, needs: list[tuple[str, Sequence[int]]]) -> None:
    """Refuse ranks (or nodes) whose routed experts the checkpoint lacks entirely - a partial
    checkpoint (``k3ckpt fetch --ranks``) holds only its ranks' experts - rather than write them
    without. ``needs``: ``(who, experts)`` pairs such as ``("rank 4", [8, 9])``."""
    if not idx.expert_names:
        return  # no per-expert tensors at all (a dense model, or gpt-oss stacked experts)
    for who, experts in needs:
        missing = [e for e in experts if e not in idx.expert_names]
        if missing:
            from ..utils import format_ranges

            raise ReshardError(f"{root}: {who} needs routed experts {format_ranges(missing)}, which this checkpoint "
                               "does not hold (a partial checkpoint? its k3ckpt-partial.json says which ranks it has)")


def _node_plan(ckpt: Checkpoint, idx: InventoryIndex, topo: Topology, node: int, gpus_per_node: int,
               max_file_size: int, align: int) -> NodePlan:
    """The node's file plan (:func:`~k3ckpt.format.nodedir.plan_node_dir`, which a rank-aware
    fetch shares, so both write the same bytes) with each tensor's source runs: every tensor is
    whole, one contiguous run, copied kernel-side."""
    nd = plan_node_dir(ckpt.tensors, topo, node, gpus_per_node, max_file_size=max_file_size, roles=ckpt.roles,
                       index=idx, align=align)
    _require_experts(ckpt.root, idx, [(f"node {node}", nd.experts)])
    starts = {name: hdr.data_start for name, hdr in ckpt.shards.items()}
    # whole tensors: one run each (the full K3 inventory is ~497k tensors)
    files = [OutFile(node, f.name, _whole_tensors(list(f.tensors), starts), f.prefix, list(f.offsets)) for f in nd.files]
    return NodePlan(nd, files)


def manifest_digests(ckpt: Checkpoint, manifest: Manifest, cache_directory: Path | None = None) -> dict[str, str]:
    """The whole-tensor sha256 ``reshard --manifest`` takes from ``manifest`` instead of
    hashing the bytes again: those of the source files whose current bytes are known to be the
    manifest's - the verify stat cache (what ``k3ckpt verify`` and ``k3ckpt fetch`` record,
    :class:`~k3ckpt.integrity.verify.StatCache`) holds the file with its stat unchanged
    (size, mtime, inode, device) and the sha256 the manifest lists for it, and no tensor that
    verify found differing from its manifest - and whose entry in the manifest has the source
    header's dtype, shape and byte range. The file digest is what ties the manifest to the
    bytes; its tensor digests are taken as the manifest states them. Every other tensor
    (a file never verified, changed since, or listed with another digest) is hashed as without
    a manifest: a source that does not match the manifest never gets the manifest's digests.

    Raises:
        ReshardError: the manifest has no tensor hashes (nothing to take from it).
    """
    from ..integrity.verify import StatCache

    if not manifest.tensor_hashes:
        raise ReshardError("the --manifest has no tensor hashes (build one with `k3ckpt manifest build "
                           "--tensor-hashes`)")
    cache = StatCache(ckpt.root, cache_directory)
    trusted: set[str] = set()
    for f in ckpt.shards:
        listed = manifest.files.get(f)
        try:
            hit = cache.lookup(f, os.stat(ckpt.root / f))
        except OSError:
            continue
        # a file whose last verify found tensors differing from its manifest is not trusted either
        if (listed is not None and listed.sha256 and hit is not None and hit.get("sha256") == listed.sha256
                and not hit.get("bad_tensors")):
            trusted.add(f)
    out: dict[str, str] = {}
    for name, info in ckpt.tensors.items():
        entry = manifest.tensors.get(name)
        if info.file not in trusted or entry is None or entry.sha256 is None:
            continue
        start = ckpt.shards[info.file].data_start
        if (entry.file, entry.dtype, tuple(entry.shape), tuple(entry.offsets)) == (
                info.file, info.dtype, tuple(info.shape), (start + info.begin, start + info.end)):
            out[name] = entry.sha256
    return out


class _OutOfSpace(ReshardError):
    """A write found the filesystem full (``ENOSPC``/``EDQUOT``); :func:`run_reshard` removes
    its temporary files and replaces the message with the shortfall."""

    def __init__(self, path: Path, err: OSError) -> None:
        super().__init__(f"writing {path}: {err.strerror or err}", path=path)
        self.where = path
        self.strerror = err.strerror or str(err)


class _DigestCache:
    """Digests of byte slices several ranks hold identically, computed once per run; ``known``:
    whole-tensor digests taken from a verified source manifest (:func:`manifest_digests`),
    which are never computed."""

    def __init__(self, known: dict[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        # a whole tensor's key is (name, None) in both formats (see _tensor_plan and _node_plan)
        self._done: dict[tuple, str] = {(name, None): d for name, d in (known or {}).items()}

    def get(self, key: tuple) -> str | None:
        with self._lock:
            return self._done.get(key)

    def put(self, key: tuple, digest: str) -> None:
        with self._lock:
            self._done.setdefault(key, digest)


def _write_file(plan: ReshardPlan, f: OutFile, dest: Path, mode: str, cache: _DigestCache,
                progress: Callable[[int], None] | None, twin: dict[str, Any] | None = None, *,
                window: int = CHUNK) -> dict[str, Any]:
    """Write one output file under its temporary name; return its digests (the unit's finisher,
    :func:`_finish_rank`, fsyncs it before the rename, so the writer goes on to its next file
    while the disk catches up instead of waiting for it: 0.06-0.14 s per run here). ``twin``:
    the digests of a byte-identical file of this run (same header, same source runs: a dense
    file every node holds) - the bytes are then copied, not hashed again.

    Raises:
        ReshardError: the file cannot be written (disk full, file too large, ...), naming it;
            ranks already complete stay, and a re-run redoes only the others.
    """
    fds = FdCache(plan.ckpt.path_of)
    try:
        return _write_file_with(plan, f, dest, mode, cache, progress, fds, twin, window)
    except OSError as e:
        if e.errno in NO_SPACE:
            raise _OutOfSpace(dest, e) from None
        raise _write_error(dest, e) from None
    finally:
        fds.close()


def _write_error(dest: Path, e: OSError) -> ReshardError:
    """``e`` (not ENOSPC: :class:`_OutOfSpace`) raised while writing ``dest`` - a weight file, or
    a unit its finisher syncs and completes - as one line naming it, with what to do about a
    limit. copy_file_range/pwrite errors carry no file name; without it "File too large" is a
    riddle."""
    hint = ("; free space (or raise the limit) and re-run: completed ranks are kept"
            if e.errno == errno.EFBIG else "")
    if e.errno in (errno.EMFILE, errno.ENFILE):
        hint = "; raise the open-files limit (ulimit -n) or use fewer --jobs"
    what = f"{e.filename}: " if e.filename else ""
    return ReshardError(f"writing {dest}: {what}{e.strerror or e}{hint}")


def _write_file_with(plan: ReshardPlan, f: OutFile, dest: Path, mode: str, cache: _DigestCache,
                     progress: Callable[[int], None] | None, fds: FdCache, twin: dict[str, Any] | None,
                     window: int) -> dict[str, Any]:
    copier = Copier(mode, fds, window)
    tmp = tmp_name(dest)
    fh = hashlib.sha256(f.prefix if twin is None else b"")  # a twin is not hashed at all
    digests: dict[str, str] = {}
    # O_NOFOLLOW: a symlink planted at the temporary name must not redirect the write.
    dst = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.pwrite(dst, f.prefix, 0)
        base = len(f.prefix)
        if f.size > base:
            os.ftruncate(dst, f.size)
        ts = f.tensors
        if twin is not None:  # its digests are known: copy only
            _copy_unhashed(f, base, dst, copier, fds, progress)
            ts = []
        # coalesce: consecutive tensors whose single contiguous runs are adjacent in one source file
        i = 0
        while i < len(ts):
            t = ts[i]
            t_do = base + f.offsets[i][0]
            if len(t.runs) == 1 and t.runs[0].count == 1:
                j = i + 1
                end = t.runs[0].offset + t.runs[0].length
                while (j < len(ts) and ts[j].src_file == t.src_file and len(ts[j].runs) == 1
                       and ts[j].runs[0].count == 1 and ts[j].runs[0].offset == end):
                    end += ts[j].runs[0].length
                    j += 1
                group = ts[i:j]
                hashers = [None if cache.get(g.key) else hashlib.sha256() for g in group]
                bounds = [g.nbytes for g in group]
                state = [0, 0]  # index in group, bytes consumed of it

                def sinks(data: memoryview, group=group, hashers=hashers, bounds=bounds, state=state) -> None:
                    fh.update(data)
                    pos = 0
                    while pos < len(data):
                        gi, used = state
                        take = min(bounds[gi] - used, len(data) - pos)
                        h = hashers[gi]
                        if h is not None and take:
                            h.update(data[pos:pos + take])
                        pos += take
                        used += take
                        if used == bounds[gi] and gi + 1 < len(bounds):
                            gi, used = gi + 1, 0
                        state[0], state[1] = gi, used
                    if progress is not None:
                        progress(len(data))

                src = fds.get(t.src_file)
                copier.contiguous(src, dst, t.runs[0].offset, t_do, end - t.runs[0].offset, sinks)
                for g, h in zip(group, hashers):
                    if h is None:
                        known = cache.get(g.key)
                        assert known is not None  # no hasher: the cache had its digest, and entries stay
                        digests[g.name] = known
                    else:
                        digests[g.name] = h.hexdigest()
                        cache.put(g.key, digests[g.name])
                # zero-length tensors in the group have their (empty) digest already
                i = j
                continue
            cached = cache.get(t.key)
            th = None if cached else hashlib.sha256()

            def sink(data: memoryview, th=th) -> None:
                fh.update(data)
                if th is not None:
                    th.update(data)
                if progress is not None:
                    progress(len(data))

            src = fds.get(t.src_file)
            do = t_do
            for run in t.runs:
                if run.count == 1:
                    copier.contiguous(src, dst, run.offset, do, run.length, sink)
                else:
                    copier.strided(src, dst, run, do, sink)
                do += run.nbytes
            if th is not None:
                digests[t.name] = th.hexdigest()
                cache.put(t.key, digests[t.name])
            else:
                assert cached  # th is None only for a cached digest
                digests[t.name] = cached
            i += 1
        fault_point("reshard.file_written", f.name)  # test seam (k3ckpt.faults): the file's bytes are written
    finally:
        os.close(dst)
    if twin is not None:
        return {"sha256": twin["sha256"], "size": f.size, "tensors": dict(twin["tensors"])}
    return {"sha256": fh.hexdigest(), "size": f.size, "tensors": digests}


def _copy_unhashed(f: OutFile, base: int, dst: int, copier: Copier, fds: FdCache,
                   progress: Callable[[int], None] | None) -> None:
    """Copy every tensor of ``f`` (data buffer at ``base``) without hashing: contiguous runs
    adjacent in one source file and in ``f`` are merged into one kernel-side copy."""
    pending: tuple[str, int, int, int] | None = None  # source file, source offset, length, output offset

    def flush() -> None:
        if pending is not None:
            copier.contiguous(fds.get(pending[0]), dst, pending[1], pending[3], pending[2], None)
            if progress is not None:
                progress(pending[2])

    for t, (b, _e) in zip(f.tensors, f.offsets):
        do = base + b
        for run in t.runs:
            if run.count != 1:
                flush()
                pending = None
                copier.strided(fds.get(t.src_file), dst, run, do, None)
                if progress is not None:
                    progress(run.nbytes)
            elif (pending is not None and pending[0] == t.src_file and pending[1] + pending[2] == run.offset
                  and pending[3] + pending[2] == do):
                pending = (pending[0], pending[1], pending[2] + run.length, pending[3])
            else:
                flush()
                pending = (t.src_file, run.offset, run.length, do)
            do += run.nbytes
    flush()


def _twin_key(f: OutFile) -> tuple:
    """What fixes every byte of an output file: its header and the source runs of its tensors.
    Files with equal keys are byte-identical (the dense files of every node)."""
    return f.prefix, tuple(zip(map(_T_SRC, f.tensors), map(_T_RUNS, f.tensors)))


class _WriteQueue:
    """The files of a run, each taken by a pool worker at the moment it starts one, in the
    queue's order then - not in the order they were submitted. A twin (its digests known: a
    copy only, bound by the disk) is released when its first is written and goes to the front,
    so it is copied while the cores still hash the files queued behind it; queued at the back
    it ran last, one writer copying (a node's 270 MiB dense twin) while the other core idled."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._jobs: deque[tuple[Future, Callable[[], dict[str, Any]]]] = deque()

    def put(self, job: Callable[[], dict[str, Any]], *, front: bool = False) -> Future:
        """A future for ``job()``, run by the next free worker (``front``: before the others
        waiting). Raises RuntimeError once the pool is shut down (an error or Ctrl-C)."""
        fut: Future = Future()
        with self._lock:
            (self._jobs.appendleft if front else self._jobs.append)((fut, job))
        self._pool.submit(self._run_next)  # one worker turn per job: every job is taken once
        return fut

    def _run_next(self) -> None:
        with self._lock:
            fut, job = self._jobs.popleft()
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(job())
        except BaseException as e:  # the caller sees it through the future, as with pool.submit
            fut.set_exception(e)


def _after(first: Future, submit: Callable[[dict[str, Any] | None], Future]) -> Future:
    """A future for ``submit(twin)``, called once ``first`` (a byte-identical file's writer) is
    done, with its digests (``None`` if it failed: the file is then hashed as any other).
    Submitting then, not waiting in a worker, keeps every worker copying meanwhile."""
    out: Future = Future()

    def relay(inner: Future) -> None:
        if inner.cancelled():
            out.set_exception(ReshardError("cancelled"))
        elif inner.exception() is not None:
            out.set_exception(inner.exception())
        else:
            out.set_result(inner.result())

    def go(done: Future) -> None:
        twin = None if done.cancelled() or done.exception() is not None else done.result()
        try:
            inner = submit(twin)
        except RuntimeError as e:  # the pool is shutting down: an error or Ctrl-C ends the run
            out.set_exception(e)
            return
        inner.add_done_callback(relay)

    first.add_done_callback(go)
    return out


# ---------------------------------------------------------------------------------------------
# Running


@dataclass
class ReshardResult:
    out: Path
    topology: dict[str, Any]
    written: list[int]
    skipped: list[int]
    bytes_written: int
    seconds: float
    files_copied: list[str]
    layout: str = "rank"
    digests_from_manifest: int = 0  # tensors whose sha256 came from --manifest, not from hashing

    def to_json(self) -> dict[str, Any]:
        unit = "nodes" if self.layout == "node" else "ranks"
        return {"out": str(self.out), "format": self.layout, "topology": self.topology, f"{unit}_written": self.written,
                f"{unit}_skipped": self.skipped, "bytes_written": self.bytes_written,
                "seconds": round(self.seconds, 3), "files_copied": self.files_copied,
                "tensor_digests_from_manifest": self.digests_from_manifest,
                "bytes_per_second": int(self.bytes_written / self.seconds) if self.seconds else None}


def render_reshard(res: ReshardResult) -> str:
    """What ``k3ckpt reshard`` prints: the topology and what was written, in one line."""
    from ..utils import human_bytes

    rate = f" at {human_bytes(res.bytes_written / res.seconds)}/s" if res.seconds and res.bytes_written else ""
    skipped = f", {len(res.skipped)} already complete (skipped)" if res.skipped else ""
    if res.digests_from_manifest:
        skipped += f", {res.digests_from_manifest} tensor digests from the manifest"
    t = res.topology
    unit = "nodes" if res.layout == "node" else "ranks"
    shape = (f"ep {t['ep']} = tp {t['tp']} x dp {t['dp']}" if res.layout == "node"
             else f"ep {t['ep']} x tp {t['tp']}")
    return (f"ok: {res.out}: {shape}, world size {t['world_size']}: "
            f"{len(res.written)} {unit} written ({human_bytes(res.bytes_written)}{rate}){skipped}")


#: Where a run records, per unit directory, the stat of each file it wrote (the re-run check).
STAT_RECORD_DIR = ".cache/k3ckpt/units"


def _stat_key(path: Path) -> list[int]:
    """What identifies a file's bytes without reading them: size, mtime, inode and ctime (ns).
    Rewriting bytes in place changes mtime and ctime; ``os.utime`` can put mtime back, not
    ctime; replacing the file changes the inode."""
    st = os.stat(path, follow_symlinks=False)
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def _unit_names(rp: RankPlan | NodePlan) -> list[str]:
    """The files of a unit directory whose stat the run records: its weight files, then what
    is written after them (manifest; a node's index and marker)."""
    return [f.name for f in rp.files] + ([INDEX_NAME, NODE_MARKER] if isinstance(rp, NodePlan) else [MANIFEST_NAME])


def _stat_record(outp: Path, rp: RankPlan | NodePlan) -> Path:
    return outp / STAT_RECORD_DIR / f"{rp.dir_name}.json"


def _stats_unchanged(outp: Path, rp: RankPlan | NodePlan) -> bool:
    """Every file of the unit has the stat recorded when this tool wrote it: none was changed,
    replaced or touched since (a flipped byte of the right size included)."""
    try:
        rec = json.loads(_stat_record(outp, rp).read_bytes())
        return isinstance(rec, dict) and all(rec.get(n) == _stat_key(outp / rp.dir_name / n) for n in _unit_names(rp))
    except (OSError, ValueError):
        return False


def _manifest_matches(rdir: Path, rp: RankPlan | NodePlan, source: dict[str, Any]) -> bool:
    if not (rdir / READY_NAME).is_file():
        return False
    try:
        m = json.loads((rdir / rp.manifest_name).read_text())
    except (OSError, ValueError):
        return False
    want = rp.layout()
    if not isinstance(m, dict) or m.get("source_index_sha256") != source["index_sha256"]:
        return False
    for k, v in want.items():  # rank coordinates, or node, ranks, experts and topology
        if k not in ("tensors", "files") and m.get(k) != v:
            return False
    tensors = m.get("tensors")
    if not isinstance(tensors, dict) or tensors.keys() != want["tensors"].keys():
        return False
    for name, w in want["tensors"].items():
        got = tensors[name]
        if not isinstance(got, dict) or any(got.get(k) != v for k, v in w.items()):
            return False
    files = m.get("files")
    if not isinstance(files, dict) or files.keys() != want["files"].keys():
        return False
    for name, w in want["files"].items():
        p = rdir / name
        if files[name].get("size") != w["size"] or not p.is_file() or p.stat().st_size != w["size"]:
            return False
    return _stats_unchanged(rdir.parent, rp)


def run_reshard(
    plan: ReshardPlan,
    out: str | os.PathLike[str],
    *,
    jobs: int | None = None,
    force: bool = False,
    mode: str = "kernel",
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    check_space: bool = True,
    manifest: Manifest | None = None,
) -> ReshardResult:
    """Write the ranks (or nodes, with ``--format node``) of ``plan`` under ``out``.
    ``mode``: ``kernel`` (copy_file_range for contiguous runs, falling back as needed) or
    ``buffered`` (pread/pwrite only). ``check_space``: refuse up front when the filesystem has
    less free space than the bytes still to write plus a margin. ``manifest``: a source
    manifest with tensor hashes; whole tensors of source files verified against it take their
    digests from it instead of being hashed (:func:`manifest_digests`).

    ``out`` must be new, empty, or an earlier reshard's output holding nothing else
    (:func:`k3ckpt.utils.ownership.claim_output_dir`); the run holds ``out``'s lock throughout.

    Raises:
        ReshardError: ``out`` holds another topology or source (without ``force``); a write
            failed (disk full: the temporary files are removed and the shortfall named);
            ``manifest`` has no tensor hashes.
        OutputNotOwnedError: ``out`` holds files k3ckpt did not write, or another command's.
        OutputLockedError: another reshard or unshard is writing into ``out``.
        DiskSpaceError: not enough free space (checked before any byte is written).
    """
    t0 = time.perf_counter()
    # before anything is written: a manifest without tensor hashes is refused with OUT untouched
    known = manifest_digests(plan.ckpt, manifest) if manifest is not None else {}
    outp = Path(out)
    src = plan.ckpt.root
    if is_within(outp, src):
        what = "is" if outp.resolve() == src.resolve() else "is inside"
        raise ReshardError(f"{outp}: the output directory {what} the source checkpoint {src}")
    if is_within(src, outp):
        raise ReshardError(f"{outp}: the output directory contains the source checkpoint {src}")
    if outp.exists() and not outp.is_dir():
        raise ReshardError(f"{outp}: exists and is not a directory")
    outp.mkdir(parents=True, exist_ok=True)
    with output_lock(outp, "reshard"), _gc_frozen():
        entries = [TOPOLOGY_NAME, *(rp.dir_name for rp in plan.units)]
        if plan.layout == "rank":
            entries += plan.extra_files
        claim_output_dir(outp, "reshard", entries)
        return _run_locked(plan, outp, t0, jobs=jobs, force=force, mode=mode, progress=progress, on_plan=on_plan,
                           check_space=check_space, known=known)


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Keep every object that exists now (the plan: ~10^5 acyclic tuples per 10^4 tensors,
    made while the GC was paused, so all still in its youngest generation) out of the cyclic
    GC's passes while the files are written, and hand them back to it afterwards. Without this
    the first passes of the run re-walk the whole plan, on the thread that finishes units:
    ~0.06 CPU-s per 1 GB test shape. A program that froze objects itself (say, before forking)
    keeps its freeze: then nothing is done (unfreezing would hand its objects back too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run_locked(plan: ReshardPlan, outp: Path, t0: float, *, jobs: int | None, force: bool, mode: str,
                progress: Callable[[int], None] | None, on_plan: Callable[[int], None] | None, check_space: bool,
                known: dict[str, str]) -> ReshardResult:
    topo_json = plan.topology_json()
    tpath = outp / TOPOLOGY_NAME
    old_units: list[Path] | None = None  # the unit directories of another layout, to replace (--force)
    if tpath.exists():
        try:
            old = json.loads(tpath.read_text())
        except (OSError, ValueError):
            old = None
        keys = ("format", "world_size", "ep", "tp", "moe_tp", "expert_placement", "num_experts", "experts_by_rank",
                "gpus_per_node")
        if (not isinstance(old, dict) or any(old.get(k) != topo_json.get(k) for k in keys)
                or (old.get("source") or {}).get("index_sha256") != topo_json["source"]["index_sha256"]):
            if not force:
                raise ReshardError(f"{outp} holds a different topology or source ({TOPOLOGY_NAME}); "
                                   f"use another directory or --force")
            old_units = _old_units(outp)

    todo: list[RankPlan | NodePlan] = []
    skipped: list[int] = []
    for rp in plan.units:
        if old_units is None and not force and _manifest_matches(outp / rp.dir_name, rp, plan.source_json):
            skipped.append(rp.unit)
        else:
            todo.append(rp)
    total = sum(f.size for rp in todo for f in rp.files)
    if check_space:  # before the old layout goes: a refused run keeps it
        freed = old_units if old_units is not None else [outp / rp.dir_name for rp in todo]
        _check_space(plan, outp, todo, sum(_allocated(d) for d in freed))
    if old_units is not None:
        _clear_old_layout(outp, old_units)

    try:
        write_atomic(tpath, (json.dumps(topo_json, indent=2) + "\n").encode())
        if plan.layout == "rank":  # (in OUT itself, which a re-run does not clear: before any writer)
            copy_files(plan.ckpt.root, plan.extra_files, outp)
        for rp in todo:
            rdir = outp / rp.dir_name
            if rdir.exists():
                shutil.rmtree(rdir)  # an incomplete or stale rank is rewritten from scratch
            rdir.mkdir(parents=True)

        def copy_extra_files() -> None:
            # Each node directory is a checkpoint of its own: its config, tokenizer and licence
            # (each copy fsync'd with its directory, ~20 ms for two nodes) are copied while the
            # writers start on the weights, not before. Before any node is finished, so a node
            # with READY has them; a node without is cleared by the re-run, temporaries and all.
            if plan.layout == "node":
                for rp in todo:
                    copy_files(plan.ckpt.root, plan.extra_files, outp / rp.dir_name)

        if on_plan is not None:
            on_plan(total)
        written = _write_units(plan, outp, todo, jobs=jobs, mode=mode, progress=progress, known=known,
                               meanwhile=copy_extra_files)
    except _OutOfSpace as e:
        raise _out_of_space(plan, outp, todo, e.where, e.strerror) from None
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        raise _out_of_space(plan, outp, todo, Path(e.filename or outp), e.strerror or str(e)) from None
    fsync_dir(outp)
    from_manifest = len({t.name for rp in todo for f in rp.files for t in f.tensors if t.key == (t.name, None)}
                        & known.keys())
    return ReshardResult(outp, topo_json, [rp.unit for rp in todo], skipped, written,
                         time.perf_counter() - t0, list(plan.extra_files), plan.layout, from_manifest)


def _extra_bytes(plan: ReshardPlan) -> int:
    return sum(plan.ckpt.path_of(f).stat().st_size for f in plan.extra_files)


def _allocated(path: Path) -> int:
    """Bytes the files under ``path`` occupy (what removing them gives back)."""
    n = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return n


def _to_write(plan: ReshardPlan, todo: Sequence[RankPlan | NodePlan]) -> int:
    """Bytes the ``todo`` units (and the non-weight files) take once written."""
    extra = _extra_bytes(plan)
    return sum(rp.nbytes for rp in todo) + (extra * len(todo) if plan.layout == "node" else extra)


def _check_space(plan: ReshardPlan, outp: Path, todo: Sequence[RankPlan | NodePlan], reclaim: int) -> None:
    """Refuse before any byte is written when the units to write (less ``reclaim``, what removing
    the directories they replace frees) do not fit, with :func:`~k3ckpt.utils.space.space_margin`
    to spare."""
    if not todo:
        return
    needed = _to_write(plan, todo)
    unit = "node" if plan.layout == "node" else "rank"
    require_free_space(outp, max(0, needed + space_margin(needed) - reclaim),
                       f"for {len(todo)} {unit} director{'y' if len(todo) == 1 else 'ies'} "
                       f"({human_bytes(needed)} to write, with a margin)")


def _out_of_space(plan: ReshardPlan, outp: Path, todo: Sequence[RankPlan | NodePlan], where: Path,
                  why: str) -> ReshardError:
    """The disk filled up mid-run: remove this run's temporary files (they would keep it full),
    then say how much more space the unfinished units need."""
    unfinished = [rp for rp in todo if not (outp / rp.dir_name / READY_NAME).exists()]
    for rp in unfinished:
        for f in rp.files:
            tmp_name(outp / rp.dir_name / f.name).unlink(missing_ok=True)
    for p in outp.glob(".*.tmp"):  # a non-weight file's copy cut short
        p.unlink(missing_ok=True)
    needed = _to_write(plan, unfinished) - sum(_allocated(outp / rp.dir_name) for rp in unfinished)
    needed += space_margin(needed)
    free = free_bytes(outp)
    unit = "nodes" if plan.layout == "node" else "ranks"
    what = f"the {len(unfinished)} unfinished {unit}"
    if needed > free:
        tail = (f"{outp} needs {needed - free} bytes ({human_bytes(needed - free)}) more free space for {what} "
                f"({needed} bytes needed, {free} free; temporary files removed)")
    else:
        tail = f"{what} need {needed} bytes, {free} are free now (temporary files removed)"
    return ReshardError(f"writing {where}: {why}; {tail}: free space and re-run: completed {unit} are kept",
                        path=where)


def _write_units(plan: ReshardPlan, outp: Path, todo: list[RankPlan | NodePlan], *, jobs: int | None, mode: str,
                 progress: Callable[[int], None] | None, known: dict[str, str],
                 meanwhile: Callable[[], None] = lambda: None) -> int:
    """Write every file of ``todo`` in parallel and finish each unit as its last file lands;
    the bytes of the finished units. ``known``: whole-tensor digests not to compute;
    ``meanwhile``: run once the writers have started, before any unit is finished."""
    cache = _DigestCache(known)
    # One writer per core: each chunk is hashed from the source's mapping and copied in one pass,
    # so a writer keeps its core busy. Measured on 2 cores (k3-8shard and k3-small, rank and node
    # formats, medians of 3): warm cache, 2 writers vs 4 took 2-23 % less wall and 1-9 % fewer
    # CPU-seconds (fewer GIL hand-offs); cold cache, the same wall within noise and 3-5 % fewer
    # CPU-seconds. (Two per core paid off while each chunk was read back from the output.)
    workers = jobs or min(MAX_DEFAULT_WRITERS, os.cpu_count() or 1)
    window = map_window(workers)  # the run's mapped source bytes stay within MAP_BUDGET (or a chunk per writer)
    written = 0
    files_done = 0
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reshard")
    queue = _WriteQueue(pool)
    try:
        # largest files first within the whole job keeps the pool busy to the end
        order = sorted(((f.size, rp.unit, k) for rp in todo for k, f in enumerate(rp.files)), reverse=True)
        by_unit = {rp.unit: rp for rp in todo}
        slots: dict[tuple[int, int], Future] = {}
        firsts: dict[tuple, Future] = {}  # the writer of each distinct file content
        for _, r, k in order:
            f = by_unit[r].files[k]
            dest = outp / by_unit[r].dir_name / f.name
            first = firsts.get(key := _twin_key(f))
            if first is None:
                slots[(r, k)] = firsts[key] = queue.put(partial(_write_file, plan, f, dest, mode, cache, progress,
                                                                window=window))
            else:
                def submit(twin: dict[str, Any] | None, f: OutFile = f, dest: Path = dest) -> Future:
                    return queue.put(partial(_write_file, plan, f, dest, mode, cache, progress, twin,
                                             window=window), front=twin is not None)

                slots[(r, k)] = _after(first, submit)
        # A unit is finished (manifest, READY) as soon as its last file is written, whatever
        # order files complete in: a failed file costs only its own unit, and the first error
        # is raised once every other file is done ("completed ranks are kept").
        unit_of = {fu: r for (r, _), fu in slots.items()}
        left = {rp.unit: len(rp.files) for rp in todo}
        failed: set[int] = set()
        first_error: BaseException | None = None

        def finish(rp: RankPlan | NodePlan) -> None:
            nonlocal written, first_error
            results = [slots[(rp.unit, k)].result() for k in range(len(rp.files))]
            try:
                _finish_rank(outp, rp, results, plan.source_json)
            except OSError as e:
                if e.errno in NO_SPACE:
                    first_error = first_error or _OutOfSpace(Path(e.filename or outp / rp.dir_name), e)
                else:  # (the same words as a writer's: which thread meets a limit first is chance)
                    first_error = first_error or _write_error(outp / rp.dir_name, e)
                return
            written += rp.nbytes

        meanwhile()
        for rp in todo:
            if not rp.files:
                finish(rp)
        for fu in as_completed(unit_of):
            r = unit_of[fu]
            if fu.exception() is not None:
                first_error = first_error or fu.exception()
                failed.add(r)
                continue
            files_done += 1
            pause_point("reshard_file", files_done)  # test hook: the N-th file of the run written
            left[r] -= 1
            if left[r] == 0 and r not in failed:
                finish(by_unit[r])
        if first_error is not None:
            raise first_error
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)
    return written


#: The unit directories a layout may hold (``rank-NNNNN``, ``node-NNNNN`` with ``--format node``).
_UNIT_DIR = re.compile(r"(rank|node)-\d{5,}")


def _old_units(outp: Path) -> list[Path]:
    """The rank/node directories of the layout ``outp`` holds."""
    return sorted(p for p in outp.iterdir() if _UNIT_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def _clear_old_layout(outp: Path, dirs: list[Path]) -> None:
    """Remove every rank/node directory (``dirs``: :func:`_old_units`) of the layout ``outp``
    held before (``--force`` with another topology or source): they belong to that topology,
    whatever this run selects. Every ``READY`` goes first (and durably), so a run killed mid-way
    never leaves a ``READY`` of the old layout under the new ``topology.json`` (written only
    after this returns)."""
    for d in dirs:
        ready = d / READY_NAME
        if ready.exists() or ready.is_symlink():
            ready.unlink()
            fsync_dir(d)
    for d in dirs:
        shutil.rmtree(d)
    fsync_dir(outp)


def _fsync_file(path: Path) -> None:
    """Make ``path``'s data durable (fsync through a fresh descriptor: the writer's is closed;
    Linux syncs the inode's dirty pages whichever descriptor asks). An error names the file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def _finish_rank(outp: Path, rp: RankPlan | NodePlan, results: list[dict[str, Any]], source: dict[str, Any]) -> None:
    """Rename the rank's (or node's) files into place, then its index (a node's), its manifest
    (a node's marker), then the stat record of all of them (what a re-run trusts instead of
    re-hashing), then READY - each durable first (the weight files' data is synced here, not by
    their writers: see :func:`_write_file`).

    A failure after the renames (a limit or a full disk met by a later step) puts the weights
    back under their temporary names and removes READY if its rename got through: a unit this
    run could not finish holds no weight file under a final name, as when a writer fails.
    Renames and unlinks need no descriptor, so this works at the open-files limit too. (A kill
    in between leaves complete weight files under final names and no READY: a re-run redoes
    the unit.)"""
    rdir = outp / rp.dir_name
    for f in rp.files:
        _fsync_file(tmp_name(rdir / f.name))
    renamed: list[Path] = []
    try:
        for f in rp.files:
            os.replace(tmp_name(rdir / f.name), rdir / f.name)
            renamed.append(rdir / f.name)
        fsync_dir(rdir)
        for name, data in rp.final_files(results, source).items():
            write_atomic(rdir / name, data)
        fsync_dir(rdir)
        record = _stat_record(outp, rp)
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, json.dumps({n: _stat_key(rdir / n) for n in _unit_names(rp)}).encode())
        write_atomic(rdir / READY_NAME, b"")
        fsync_dir(rdir)
    except BaseException:
        with contextlib.suppress(OSError):  # (the error being raised is the one to report)
            (rdir / READY_NAME).unlink(missing_ok=True)
        for final in renamed:
            with contextlib.suppress(OSError):
                os.replace(final, tmp_name(final))
        raise


def reshard(
    source: str | os.PathLike[str] | Checkpoint,
    out: str | os.PathLike[str],
    selection: RankSelection = RankSelection(),
    *,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    jobs: int | None = None,
    force: bool = False,
    align: int = ALIGN,
    mode: str = "kernel",
    layout: str = "node",
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    check_space: bool = True,
    manifest: Manifest | None = None,
) -> ReshardResult:
    """Plan and write: :func:`plan_reshard` then :func:`run_reshard`."""
    plan = plan_reshard(source, selection, max_file_size=max_file_size, align=align, layout=layout)
    return run_reshard(plan, out, jobs=jobs, force=force, mode=mode, progress=progress, on_plan=on_plan,
                       check_space=check_space, manifest=manifest)
