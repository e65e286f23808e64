"""The file plan of a node directory: which tensors go in which file, in which order, under which
name, and the exact header of every file.

A node directory (``reshard``'s default format) is an ordinary checkpoint directory that vLLM
loads with ``--enable-expert-parallel --enable-ep-weight-filter``: every dense tensor whole,
plus the routed experts of the node's ranks, whole. The plan is a pure function of format-level
inputs (tensor infos, a :class:`~k3ckpt.format.topology.Topology`, the node) so that every
producer - ``reshard`` from a local checkpoint, a rank-aware ``fetch`` from a hub - writes the
same files with the same bytes: the plan fixes each file's header bytes and each tensor's data
offsets, and a writer only has to copy each tensor's source bytes to its offset.

Decisions:

- **File names say what they hold.** ``model-dense-00001-of-00003.safetensors`` holds only
  non-expert tensors (and gpt-oss stacked expert tensors, which cannot be filtered by name and
  stay whole); ``model-rank-00005-experts-00001-of-00002.safetensors`` holds only rank 5's
  routed experts. Loaders read the index, not the names (vLLM keeps exactly the files the
  index names), so names are free to be informative: ``ls`` shows which rank reads which file.
- **One rank's experts per file, in order.** A rank's expert tensors are sorted by (layer,
  expert, source position): per layer its experts ascending, each expert's tensors adjacent.
  A rank's expert bytes are one sequential run of its own files - no other rank's bytes in
  between - and, for K3 (whose shards hold one layer's experts in order), a linear-placement
  rank's experts of one layer are one contiguous source run, so a writer copies them in one
  kernel-side call.
- **Dense tensors in source order** (by source file, then offset), so they are copied in long
  runs too.
- **Every file at most ``max_file_size`` bytes, header included.** Packing is greedy and
  counts a safe upper bound of each tensor's header entry; a tensor that does not fit in a file
  of its own with its header is the only exception (it gets a file by itself).
- **Headers**: metadata ``{"format": "pt"}`` (what ``transformers`` writes), tensors in data
  order, the data buffer starting at a multiple of :data:`NODE_ALIGN`.
- **A file's digest is built from its segments** (:func:`segments_sha256`): the sha256 of its
  header's sha256 followed by each tensor's, in file order. A safetensors file is exactly its
  header and its tensors' bytes (the buffer has no holes), so this covers every byte, and a
  producer that hashes each tensor as it copies it - the marker records those digests anyway -
  gets the file's digest without hashing any byte a second time (docs/trust.md).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from ..errors import TopologyError
from .filedigest import SEGMENTS_KEY, segments_sha256
from .header import TensorInfo, header_prefix
from .jsontext import JsonStr, ShapeJson, json_records, json_str, json_strings, plain
from .layout import NODE_FORMAT, NODE_MARKER_VERSION
from .roles import Role, classify
from .topology import InventoryIndex, Topology, index_of, ranks_of_node

#: Alignment of each file's data buffer (the rank layout's too; BENCHMARKS.md has the measurement).
NODE_ALIGN = 4096
#: ``--max-shard-size``'s default for node files (``reshard`` and a node ``fetch`` share it, so
#: both plan the same files).
NODE_MAX_FILE_SIZE = 5 * 1024**3
#: The safetensors ``__metadata__`` of every node file.
NODE_METADATA = {"format": "pt"}
# Header bytes a tensor entry can need beyond its name, dtype and shape (JSON punctuation, the
# keys, and two data offsets of up to 20 digits each): an upper bound, so packing never overshoots.
_ENTRY_OVERHEAD = 96
_HEADER_OVERHEAD = 8 + 2 + len(json.dumps({"__metadata__": NODE_METADATA}, separators=(",", ":"))) + 1


def dense_file_name(k: int, n: int) -> str:
    """``model-dense-00001-of-00003.safetensors`` (``k`` counts from 0)."""
    return f"model-dense-{k + 1:05d}-of-{n:05d}.safetensors"


def rank_file_name(rank: int, k: int, n: int) -> str:
    """``model-rank-00005-experts-00001-of-00002.safetensors``: file ``k`` (from 0) of ``n`` of
    rank ``rank``'s routed experts."""
    return f"model-rank-{rank:05d}-experts-{k + 1:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class NodeFile:
    """One file of a node directory: its name, whose experts it holds (``rank`` None: dense
    tensors), the source tensors in write order, its header bytes (``prefix``: the 8-byte length
    and the padded JSON) and each tensor's ``(begin, end)`` in its data buffer."""

    name: str
    rank: int | None
    tensors: tuple[TensorInfo, ...]
    prefix: bytes
    offsets: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return len(self.prefix) + (self.offsets[-1][1] if self.offsets else 0)

    def segments_sha256(self, tensor_sha256: Mapping[str, str]) -> str:
        """The file's digest (:func:`segments_sha256`) from its tensors' sha256 by name."""
        base = len(self.prefix)
        return segments_sha256(self.prefix, ((base + b, base + e, tensor_sha256[t.name]) for t, (b, e) in
                                             zip(self.tensors, self.offsets)))


@dataclass(frozen=True)
class NodeDir:
    """The plan of node ``node``'s directory: its ranks, their experts and its files (dense
    files first, then each rank's, in rank order)."""

    node: int
    gpus_per_node: int
    ranks: tuple[int, ...]
    experts_by_rank: dict[int, tuple[int, ...]]
    topology: Topology
    files: tuple[NodeFile, ...]

    @property
    def experts(self) -> list[int]:
        """Every routed expert of the node's ranks, ascending."""
        return sorted({e for ex in self.experts_by_rank.values() for e in ex})

    @property
    def total_size(self) -> int:
        """Tensor bytes (the index's ``metadata.total_size``)."""
        return sum(t.nbytes for f in self.files for t in f.tensors)

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name, sorted by name."""
        return dict(sorted((t.name, f.name) for f in self.files for t in f.tensors))

    def index_json(self) -> dict[str, Any]:
        """``model.safetensors.index.json``: exactly the tensors and files present."""
        return {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map()}

    def index_bytes(self) -> bytes:
        """The index file's bytes, as every producer writes them (indent 2, as ``save_pretrained``)."""
        return (json.dumps(self.index_json(), indent=2) + "\n").encode()

    def segments_sha256(self, tensor_sha256: Mapping[str, str]) -> dict[str, str]:
        """Each file's digest (:meth:`NodeFile.segments_sha256`) by name, from every tensor's sha256."""
        return {f.name: f.segments_sha256(tensor_sha256) for f in self.files}

    def marker_bytes(self, source_index_sha256: str, tensor_sha256: Mapping[str, str],
                     excluded: Sequence[str] = (), *, file_digests: Mapping[str, str] | None = None) -> bytes:
        """``k3ckpt-node.json``'s bytes, as every producer writes them: :meth:`marker_json` plus
        the sha256 of the source's index and of every tensor (which the writer computes while
        copying, or takes from digests already proven), each file's digest built from them
        (:meth:`NodeFile.segments_sha256`; ``file_digests``: those the writer built already, by
        file name), and the source's non-weight files ``excluded`` by a fetch's
        ``--include``/``--exclude`` (the key only when there are some: a whole node's marker is
        the same from every producer). One line, no indent (a full K3 node lists ~500k tensors):
        ``json.dumps``' text, its tensor entries written by :func:`json_records`."""
        head = self._marker_head()
        digests = file_digests if file_digests is not None else self.segments_sha256(tensor_sha256)
        tail: dict[str, Any] = {"files": {f.name: {"size": f.size, "rank": f.rank, SEGMENTS_KEY: digests[f.name]}
                                          for f in self.files},
                                "source_index_sha256": source_index_sha256}
        if excluded:
            tail["excluded"] = sorted(excluded)
        # json.dumps({**head, "tensors": ..., **tail})'s text
        names: list[str] = []
        files: list[str] = []
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        for f in self.files:
            names += map(_NAME, f.tensors)
            files += repeat(json_str(f.name), len(f.tensors))
            dtypes += map(_DTYPE, f.tensors)
            shapes += map(_SHAPE, f.tensors)
        fields = [("file", files), ("dtype", map(JsonStr().__getitem__, dtypes)),
                  ("shape", map(ShapeJson().__getitem__, shapes)),
                  ("sha256", json_strings(list(map(tensor_sha256.__getitem__, names))))]
        text = (json.dumps(head)[:-1] + ', "tensors": ' + json_records(names, fields) + ", " + json.dumps(tail)[1:])
        return (text + "\n").encode()

    def _marker_head(self) -> dict[str, Any]:
        """The keys of :meth:`marker_json` before ``tensors``."""
        return {
            "format": NODE_FORMAT, "version": NODE_MARKER_VERSION, "node": self.node, "gpus_per_node": self.gpus_per_node,
            "ranks": list(self.ranks), "experts": self.experts,
            "experts_by_rank": {str(r): list(e) for r, e in self.experts_by_rank.items()},
            "topology": self.topology.to_json(),
        }

    def marker_json(self) -> dict[str, Any]:
        """``k3ckpt-node.json`` without digests and source: :meth:`marker_bytes` adds them."""
        return {
            **self._marker_head(),
            "tensors": {t.name: {"file": f.name, "dtype": t.dtype, "shape": list(t.shape)}
                        for f in self.files for t in f.tensors},
            "files": {f.name: {"size": f.size, "rank": f.rank} for f in self.files},
        }


def plan_node_dir(
    tensors: Mapping[str, TensorInfo],
    topo: Topology,
    node: int,
    gpus_per_node: int,
    *,
    max_file_size: int,
    roles: Mapping[str, Role] | None = None,
    index: InventoryIndex | None = None,
    align: int = NODE_ALIGN,
) -> NodeDir:
    """Plan node ``node``'s directory over the source ``tensors`` (name -> info; a checkpoint's
    or a manifest's inventory). ``roles`` (classified here when not given) and ``index``
    (:func:`~k3ckpt.format.topology.index_of`, built here when not given) save the work when
    the caller has them. Experts the inventory lacks are simply absent (a caller that needs
    them refuses first).

    Raises:
        TopologyError: the topology cuts experts (ep below the world size), or the node is out
            of range.
    """
    if topo.moe_tp != 1:
        raise TopologyError(f"a node directory holds whole experts: ep {topo.ep} must equal the world size "
                            f"{topo.world_size}")
    if max_file_size < 1:
        raise TopologyError(f"--max-shard-size {max_file_size} must be positive")
    ranks = ranks_of_node(node, gpus_per_node, topo.world_size)
    idx = index if index is not None else index_of((tensors, roles or {n: classify(n) for n in tensors}))
    by_rank = {r: topo.rank_info(r).experts for r in ranks}
    dense = _source_sorted([tensors[n] for n in idx.dense_names])
    files = _files(dense, None, max_file_size, align, dense_file_name)
    for r, experts in by_rank.items():
        own = [tensors[n] for e in experts for n in idx.expert_names.get(e, ())]
        own = _expert_sorted(own, roles)

        def name_of(k: int, n: int, r: int = r) -> str:  # a def: mypy cannot type a defaulted lambda
            return rank_file_name(r, k, n)

        files += _files(own, r, max_file_size, align, name_of)
    return NodeDir(node, gpus_per_node, tuple(ranks), by_rank, topo, tuple(files))


def _source_sorted(tensors: list[TensorInfo]) -> list[TensorInfo]:
    """``tensors`` by (source file, offset, name)."""
    return list(map(_LAST, sorted(zip(map(_FILE, tensors), map(_BEGIN, tensors), map(_NAME, tensors), tensors))))


def _expert_sorted(tensors: list[TensorInfo], roles: Mapping[str, Role] | None) -> list[TensorInfo]:
    """``tensors`` (routed experts) by (layer, expert, source file, offset, name), the keys
    built in C-level loops (a K3 node holds ~10^5 expert tensors)."""
    names = list(map(_NAME, tensors))
    role_list = list(map(roles.__getitem__, names)) if roles is not None else list(map(classify, names))
    layers = list(map(_LAYER, role_list))
    experts = list(map(_EXPERT, role_list))
    if None in layers or None in experts:  # never for a routed expert's role; kept exact all the same
        layers = [-1 if v is None else v for v in layers]
        experts = [v or 0 for v in experts]
    keyed = sorted(zip(layers, experts, map(_FILE, tensors), map(_BEGIN, tensors), names, tensors))
    return list(map(_LAST, keyed))


_NAME, _DTYPE, _SHAPE, _BEGIN, _END, _FILE = (operator.itemgetter(i) for i in range(6))  # TensorInfo fields
_LAYER, _EXPERT = operator.itemgetter(2), operator.itemgetter(3)  # Role fields
_LAST = operator.itemgetter(-1)


def _entry_bounds(names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]]) -> list[int]:
    """Header bytes each entry needs at most. Cheap (no JSON encoding: the full K3 inventory
    has ~497k entries): ``str`` of the shape tuple is never shorter than its compact JSON list,
    and a name needing escapes is counted at the worst case of six bytes a character."""
    if plain("".join(names)):
        name_bytes: Iterable[int] = map(len, names)  # every name plain: its JSON is itself in quotes
    else:
        name_bytes = map(_name_bound, names)
    shape_len = _ShapeLen()
    return list(map(sum, zip(name_bytes, map(len, dtypes), map(shape_len.__getitem__, shapes),
                             repeat(2 + _ENTRY_OVERHEAD))))


def _name_bound(name: str) -> int:
    return len(name) if plain(name) else 6 * len(name)


class _ShapeLen(dict[tuple[int, ...], int]):
    """shape -> ``len(str(shape))``, once per distinct shape."""

    def __missing__(self, key: tuple[int, ...]) -> int:
        v = self[key] = len(str(key))
        return v


def _files(tensors: list[TensorInfo], rank: int | None, max_file_size: int, align: int,
           name_of: Any) -> list[NodeFile]:
    """Pack ``tensors`` (in order) greedily into files of at most ``max_file_size`` bytes, header
    included; ``name_of(k, n)`` names file ``k`` of ``n``."""
    names = list(map(_NAME, tensors))
    dtypes = list(map(_DTYPE, tensors))
    shapes = list(map(_SHAPE, tensors))
    sizes = list(map(operator.sub, map(_END, tensors), map(_BEGIN, tensors)))
    bounds = _entry_bounds(names, dtypes, shapes)
    cuts = _pack(sizes, bounds, max_file_size, align)
    out = []
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        prefix, offsets = header_prefix(names[a:b], dtypes[a:b], shapes[a:b], NODE_METADATA, align=align)
        if list(map(operator.sub, map(_SECOND, offsets), map(_FIRST, offsets))) != sizes[a:b]:
            for t, (lo, hi) in zip(tensors[a:b], offsets):
                if hi - lo != t.nbytes:  # a header's size disagrees with its dtype and shape: never ours to fix
                    raise TopologyError(f"tensor {t.name!r} in {t.file}: {t.nbytes} bytes, but {t.dtype} "
                                        f"{list(t.shape)} needs {hi - lo}")
        out.append(NodeFile(name_of(k, len(cuts) - 1), rank, tuple(tensors[a:b]), prefix, tuple(offsets)))
    return out


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _pack(sizes: list[int], bounds: list[int], max_file_size: int, align: int) -> list[int]:
    """Where greedy packing cuts: ``[0, ..., len(sizes)]``, file ``k`` holding ``[cuts[k],
    cuts[k+1])``. A new file starts when the next tensor's data and header entry would take the
    file past ``max_file_size``. Totals only grow, so when everything fits there is one file."""
    n = len(sizes)
    if not n:
        return [0]
    if sum(sizes) + _aligned(_HEADER_OVERHEAD + sum(bounds), align) <= max_file_size:
        return [0, n]
    cuts = [0]
    data, header = sizes[0], _HEADER_OVERHEAD + bounds[0]
    for i in range(1, n):
        size, entry = sizes[i], bounds[i]
        if data + size + _aligned(header + entry, align) > max_file_size:
            cuts.append(i)
            data, header = 0, _HEADER_OVERHEAD
        data += size
        header += entry
    cuts.append(n)
    return cuts


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align
