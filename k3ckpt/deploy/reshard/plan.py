"""Planning a reshard: what goes where (:func:`plan_reshard`; no data is read). The plan is
every output file of the selected ranks (:class:`RankPlan`) or nodes (:class:`NodePlan`), each
tensor in it with the source bytes it is copied from.

- each rank's tensors are grouped per source file and sorted by source offset, then packed
  into parts of at most ``--max-shard-size``: its dense tensors (whole, or its tp_rank's cut)
  first, in parts of their own, then its experts - so a dense part is byte-identical on every
  rank of the same tp_rank, and is hashed once per run;
- every tensor becomes a list of *byte runs* ``(offset, length, count, stride)`` in the source:
  a whole tensor, a dim-0 split and a run of consecutive whole experts are one contiguous run;
  a split of a later dim is ``count`` rows of ``length`` bytes ``stride`` apart;
- a node directory's files are the ones :func:`k3ckpt.format.nodedir.plan_node_dir` plans,
  every tensor whole (one contiguous run).

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
  lock, ``*.tmp``), copied in bounded chunks.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import compress, repeat
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import ReshardError
from ...format.checkpoint import INDEX_NAME, Checkpoint, bulk_allocation, is_working_file, open_checkpoint
from ...format.filedigest import SEGMENTS_KEY
from ...format.header import DTYPE_BITS, TensorInfo, header_prefix
from ...format.jsontext import JsonStr, ShapeJson, json_records, json_strings
from ...format.layout import (
    FORMAT,
    LAYOUT_ALIASES,
    LAYOUTS,
    MANIFEST_NAME,
    NODE_LAYOUT_FORMAT,
    NODE_MARKER,
    PARTIAL_MARKER,
    VERSION,
    node_dir_name,
    part_name,
    rank_dir_name,
)
from ...format.loadable import require_loadable
from ...format.nodedir import NODE_MAX_FILE_SIZE, NodeDir, plan_node_dir
from ...format.topology import (
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
from ..bytecopy import Run

#: Alignment of each output file's data buffer.
ALIGN = 4096
DEFAULT_MAX_FILE_SIZE = NODE_MAX_FILE_SIZE


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
    """One output file: its header bytes, its tensors (in write order) and their ``(begin, end)``
    in its data buffer. Its digest, a rank file's as a node file's, is built from its header's
    and tensors' sha256 (:func:`~k3ckpt.format.filedigest.segments_sha256`), so no byte of it
    is hashed whole."""

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
        # json.dumps of layout() with the digests added (each tensor's "sha256" and each file's
        # "segments_sha256" last, "source_index_sha256" after "files"); the tensor entries written
        # in C-level loops (a K3 rank lists ~60k; one dict each through the encoder cost ~2 us
        # apiece). No indent.
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
        tail = {"files": {f.name: {"size": res["size"], SEGMENTS_KEY: res[SEGMENTS_KEY]}
                          for f, res in zip(self.files, results)},
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
        files = {f.name: res[SEGMENTS_KEY] for f, res in zip(self.files, results)}  # the writers built them
        return {INDEX_NAME: self.plan.index_bytes(),
                NODE_MARKER: self.plan.marker_bytes(source["index_sha256"], tensors, file_digests=files)}


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
            from ...utils import format_ranges

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
    files = [OutFile(node, f.name, _whole_tensors(list(f.tensors), starts), f.prefix, list(f.offsets))
             for f in nd.files]
    return NodePlan(nd, files)
