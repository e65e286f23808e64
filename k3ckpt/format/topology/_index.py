"""What each rank holds: an inventory indexed once (:func:`build_index`, :func:`index_of`:
tensors grouped by the signature that decides their split), then per rank every tensor it
holds and the bytes it needs (:func:`tensors_for_rank`, :func:`tensors_for_ranks`,
:class:`RankTensors`); the FP8 block size a config declares (:func:`fp8_block_of`).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

from ...errors import TopologyError
from ..checkpoint import bulk_allocation
from ..header import TensorInfo
from ..roles import Kind, Role, classify
from ._ranks import RankInfo, Topology
from ._splits import ExpertSlice, Placement, is_mxfp4, tensor_split

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint
    from ..config import ModelConfig

#: FP8 block size when a block-quantized checkpoint's config does not say (DeepSeek-V3 / K2).
DEFAULT_FP8_BLOCK = (128, 128)
_FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})


@dataclass(frozen=True)
class _Sig:
    """What decides a tensor's split and size: its role minus layer/expert, dtype and shape."""

    kind: str
    tp: str
    proj: str | None
    part: str
    stacked: bool
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    fp8_block: tuple[int, ...] | None
    example: str  # a tensor with this signature, for error messages


@dataclass
class InventoryIndex:
    """An inventory grouped for per-rank questions: built once (one pass over the names),
    then each rank costs one dict insertion per tensor it holds and one split computation
    per distinct signature (a few hundred on the full K3 inventory)."""

    sigs: list[_Sig]
    dense_names: list[str]  # every tensor that is not a per-expert routed tensor
    dense_sigs: list[int]
    dense_counts: Counter  # sig -> tensors
    expert_names: dict[int, list[str]]  # expert id -> its tensors across all layers
    expert_sigs: dict[int, list[int]]
    expert_counts: dict[int, Counter]
    num_tensors: int

    @property
    def max_expert(self) -> int:
        return max(self.expert_names, default=-1)


class _Interner(dict[tuple[Any, ...], int]):
    """key -> dense id, assigned on first sight; used through ``map`` so hits stay in C."""

    def __missing__(self, key: tuple) -> int:
        v = self[key] = len(self)
        return v


# Role and TensorInfo are named tuples: itemgetter columns keep the per-tensor work in C.
_KIND, _TPF, _PROJ, _PART, _EXPERT = (operator.itemgetter(i) for i in (0, 1, 4, 5, 3))
_DTYPE, _SHAPE, _BEGIN, _END = (operator.itemgetter(i) for i in (1, 2, 3, 4))


def build_index(
    tensors: Mapping[str, TensorInfo],
    roles: Mapping[str, Role] | None = None,
    *,
    fp8_block: tuple[int, ...] = DEFAULT_FP8_BLOCK,
) -> InventoryIndex:
    """Group ``tensors`` (with their ``roles``; classified here when not given) for
    :func:`tensors_for_rank`. ``fp8_block``: the block size of FP8 weights that have a
    ``weight_scale_inv`` (from the config's ``weight_block_size`` when known)."""
    # The cyclic GC would re-walk the ~10^6 fresh tuples of the full inventory at every
    # generation-2 pass; they are acyclic, so pausing it is safe and halves the time.
    with bulk_allocation():
        return _build_index(tensors, roles, fp8_block)


def _build_index(
    tensors: Mapping[str, TensorInfo], roles: Mapping[str, Role] | None, fp8_block: tuple[int, ...]
) -> InventoryIndex:
    names = list(tensors)
    infos = list(tensors.values())
    role_list = list(map(roles.__getitem__, names)) if roles is not None else list(map(classify, names))
    experts = list(map(_EXPERT, role_list))
    kinds = list(map(_KIND, role_list))
    parts = list(map(_PART, role_list))
    dtypes = list(map(_DTYPE, infos))
    # FP8 block rule: only a weight with a sibling weight_scale_inv is block-quantized.
    blocked: list[tuple[int, ...] | None] = [None] * len(names)
    if not _FP8_DTYPES.isdisjoint(dtypes):
        for i, (d, p) in enumerate(zip(dtypes, parts)):
            if d in _FP8_DTYPES and p == "weight" and names[i].endswith(".weight") and names[i] + "_scale_inv" in tensors:
                blocked[i] = fp8_block
    no_expert = list(map(operator.is_, experts, repeat(None)))
    keys = zip(kinds, map(_TPF, role_list), map(_PROJ, role_list), parts, no_expert,
               dtypes, map(_SHAPE, infos), map(operator.sub, map(_END, infos), map(_BEGIN, infos)), blocked)
    interner = _Interner()
    sig_ids = list(map(interner.__getitem__, keys))
    examples: dict[int, str] = {}
    for i, s in enumerate(sig_ids):
        if s not in examples:
            examples[s] = names[i]
            if len(examples) == len(interner):
                break
    # the key's "no expert id" flag means "stacked" for routed experts and nothing otherwise
    sigs = [_Sig(k[0], k[1], k[2], k[3], k[4] and k[0] == Kind.ROUTED_EXPERT, k[5], k[6], k[7], k[8], example=examples[i])
            for k, i in interner.items()]

    dense_names: list[str] = []
    dense_sigs: list[int] = []
    expert_names: dict[int, list[str]] = {}
    expert_sigs: dict[int, list[int]] = {}
    for name, e, k, s in zip(names, experts, kinds, sig_ids):
        if e is None or k != Kind.ROUTED_EXPERT:  # only routed experts carry an expert id today
            dense_names.append(name)
            dense_sigs.append(s)
        else:
            try:
                expert_names[e].append(name)
                expert_sigs[e].append(s)
            except KeyError:
                expert_names[e] = [name]
                expert_sigs[e] = [s]
    return InventoryIndex(
        sigs=sigs, dense_names=dense_names, dense_sigs=dense_sigs, dense_counts=Counter(dense_sigs),
        expert_names=expert_names, expert_sigs=expert_sigs,
        expert_counts={e: Counter(v) for e, v in expert_sigs.items()}, num_tensors=len(names),
    )


def index_of(source: Checkpoint | InventoryIndex | tuple) -> InventoryIndex:
    """An :class:`InventoryIndex` of a Checkpoint, a ``(tensors, roles)`` pair, or an index
    (returned as is). Build it once when asking about many ranks."""
    if isinstance(source, InventoryIndex):
        return source
    if isinstance(source, tuple):
        tensors, roles = source
        return build_index(tensors, roles)
    return build_index(source.tensors, source.roles, fp8_block=fp8_block_of(getattr(source, "config", None)))


def fp8_block_of(cfg: ModelConfig | None) -> tuple[int, ...]:
    """The FP8 scale block size the config declares (``weight_block_size``), else the default."""
    if cfg is not None and cfg.quantization.get("weight_block_size"):
        return tuple(int(b) for b in cfg.quantization["weight_block_size"])
    return DEFAULT_FP8_BLOCK


@dataclass
class RankTensors:
    """Every tensor one rank holds and the bytes it needs, split by why it holds them."""

    rank: RankInfo
    tensors: dict[str, Placement]  # name -> None (whole) | Split | ExpertSlice
    routed_bytes: int  # its share of routed experts
    split_bytes: int  # its slices of TP-split dense tensors
    replicated_bytes: int  # tensors every rank holds whole

    @property
    def total_bytes(self) -> int:
        return self.routed_bytes + self.split_bytes + self.replicated_bytes


def _sig_placement(sig: _Sig, topo: Topology, rank: RankInfo) -> tuple[Placement, int]:
    """A signature's placement on ``rank`` and the bytes one such tensor costs there."""
    per_expert = sig.kind == Kind.ROUTED_EXPERT and not sig.stacked
    role = Role(sig.kind, sig.tp, None, 0 if per_expert else None, sig.proj, sig.part)  # expert id is irrelevant
    p = tensor_split(sig.example, role, sig.shape, topo, rank,
                     mxfp4=is_mxfp4(sig.dtype, sig.part), fp8_block=sig.fp8_block)
    if p is None:
        return p, sig.nbytes
    if isinstance(p, ExpertSlice):
        expert_bytes = sig.nbytes // topo.num_experts
        return p, expert_bytes * len(p.experts) // (p.split.parts if p.split else 1)
    return p, sig.nbytes // p.parts


def tensors_for_rank(
    source: Checkpoint | InventoryIndex | tuple, topo: Topology, rank: int, *, gpus_per_node: int | None = None,
) -> RankTensors:
    """Every tensor global rank ``rank`` holds: all non-expert tensors (split or whole), the
    per-expert tensors of its experts (moe_tp-split when ``moe_tp > 1``), and stacked expert
    tensors as :class:`ExpertSlice` - with the bytes each group needs.

    ``source``: a Checkpoint, ``(tensors, roles)`` or an :func:`index_of` result (pass the
    latter when asking about many ranks; building it is the expensive part).

    Raises:
        TopologyError: the inventory has experts the topology does not place.
        SplitError: some tensor cannot be split as the topology asks.
    """
    idx = index_of(source)
    if idx.max_expert >= topo.num_experts:
        raise TopologyError(
            f"the checkpoint has expert {idx.max_expert} but the topology places {topo.num_experts} experts "
            f"(0..{topo.num_experts - 1})")
    info = topo.rank_info(rank, gpus_per_node)
    placed = [_sig_placement(s, topo, info) for s in idx.sigs]
    placements = [p for p, _ in placed]
    routed = split = replicated = 0
    for s, n in idx.dense_counts.items():
        p, size = placed[s]
        if idx.sigs[s].kind == Kind.ROUTED_EXPERT:
            routed += n * size
        elif p is None:
            replicated += n * size
        else:
            split += n * size
    out = dict(zip(idx.dense_names, map(placements.__getitem__, idx.dense_sigs)))
    for e in info.experts:
        names = idx.expert_names.get(e)
        if names is None:
            continue  # an expert with no tensors (a partial inventory): nothing to hold
        out.update(zip(names, map(placements.__getitem__, idx.expert_sigs[e])))
        routed += sum(n * placed[s][1] for s, n in idx.expert_counts[e].items())
    return RankTensors(info, out, routed, split, replicated)


def tensors_for_ranks(
    source: Checkpoint | InventoryIndex | tuple, topo: Topology, ranks: list[int] | None = None,
    *, gpus_per_node: int | None = None,
) -> dict[int, RankTensors]:
    """:func:`tensors_for_rank` for several ranks (default: all), indexing the inventory once."""
    idx = index_of(source)
    return {r: tensors_for_rank(idx, topo, r, gpus_per_node=gpus_per_node)
            for r in (range(topo.world_size) if ranks is None else ranks)}
