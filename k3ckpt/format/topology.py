"""Topology math shared by ``plan``, ``reshard``, rank-aware ``fetch`` and ``preflight``.

Pure functions of numbers, names and roles - no I/O - so every command that reasons about ranks
gives the same answer. The contract is ``rank-layout.md``:

- ``--ep E`` / ``--tp T`` / ``--world-size W`` (default ``max(E, T)``; ``E`` and ``T`` divide
  ``W``), ``moe_tp = W // E``;
- global rank ``r``: ``ep_rank = r // moe_tp``, ``moe_tp_rank = r % moe_tp``,
  ``tp_rank = r % T``, ``dp_rank = r // T``;
- experts placed per ep_rank ``linear`` (vLLM's ``determine_expert_map``) or ``round_robin``;
- a split of a dimension of size ``n`` into ``k`` parts gives part ``i`` the range
  ``[i*n/k, (i+1)*n/k)``; ``n % k != 0`` is an error naming the tensor.

Decisions this module makes (and the contract leaves open):

- ``ep > num_experts`` is an error, not a warning: the ep_ranks past the last expert would hold
  no experts and a reshard would write empty expert shards that no engine expects.
- ``--gpus-per-node G`` need not divide ``W``: the last node is then partial (``--tp 4`` on one
  8-GPU box is normal). A node index past the last rank is an error.
- Stacked expert tensors (gpt-oss ``mlp.experts.*`` with all experts in dim 0) are described by
  :class:`ExpertSlice`: the rank's experts along dim 0 (contiguous only for ``linear``
  placement) plus, when ``moe_tp > 1``, a :class:`Split` of each expert. The contract's manifest
  ``split`` covers only :class:`Split`; ``reshard`` decides how to record an ExpertSlice.
- A tensor with no dimension to split (a per-tensor scalar scale) and a per-channel scale whose
  split dimension has size 1 are replicated whole: they broadcast along that dimension.
"""

from __future__ import annotations

import math
import operator
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeGuard

from ..errors import SplitError, TopologyError
from .checkpoint import bulk_allocation
from .header import TensorInfo
from .roles import TP, Kind, Role, classify

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .config import ModelConfig

PLACEMENTS = ("linear", "round_robin")

#: FP8 block size when a block-quantized checkpoint's config does not say (DeepSeek-V3 / K2).
DEFAULT_FP8_BLOCK = (128, 128)
#: Elements per MXFP4 block (OCP MX): one E8M0 scale per 32 values, two values per byte.
MX_BLOCK = 32

# Per-tensor (scalar) quantization parameters: identical for every slice of the weight.
_WHOLE_PARTS = frozenset({"input_scale", "weight_global_scale", "input_global_scale"})
_MX_SCALE_DTYPES = frozenset({"U8", "F8_E8M0"})
_FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})


# ---------------------------------------------------------------------------------------------
# Topology and ranks


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


@lru_cache(maxsize=256)
def _placement(num_experts: int, ep: int, placement: str) -> tuple[tuple[int, ...], ...]:
    """Experts of each ep_rank. Cached: the full K3 plan asks for it once per rank."""
    if placement == "linear":
        # vLLM determine_expert_map: the first ``rem`` ep_ranks get one extra expert.
        base, rem = divmod(num_experts, ep)
        out = []
        for e in range(ep):
            start = e * base + min(e, rem)
            out.append(tuple(range(start, start + base + (e < rem))))
        return tuple(out)
    return tuple(tuple(range(e, num_experts, ep)) for e in range(ep))


@dataclass(frozen=True)
class RankInfo:
    """Where global rank ``rank`` sits in the topology."""

    rank: int
    ep_rank: int
    moe_tp_rank: int
    tp_rank: int
    dp_rank: int
    node: int | None  # None when no --gpus-per-node was given
    experts: tuple[int, ...]  # the routed experts of its ep_rank (shared by its moe_tp ranks)


@dataclass(frozen=True)
class Topology:
    """An (ep, tp, world size, placement) layout over ``num_experts`` routed experts.

    Construct with :meth:`make` (which fills the world size default); direct construction
    validates too, so an invalid Topology cannot exist.
    """

    ep: int
    tp: int
    world_size: int
    placement: str
    num_experts: int

    def __post_init__(self) -> None:
        _validate(self.ep, self.tp, self.world_size, self.placement, self.num_experts, defaulted=False)

    @classmethod
    def make(
        cls,
        ep: int = 1,
        tp: int = 1,
        world_size: int | None = None,
        placement: str = "linear",
        *,
        num_experts: int,
    ) -> Topology:
        """Validate and build. ``world_size`` defaults to ``max(ep, tp)``.

        Raises:
            TopologyError: with a one-line reason (``--ep 3 does not divide world size 8``).
        """
        defaulted = world_size is None
        if defaulted and _is_int(ep) and _is_int(tp):
            world_size = max(ep, tp)
        _validate(ep, tp, world_size, placement, num_experts, defaulted=defaulted)
        assert world_size is not None  # _validate refuses a world size that is not an int
        return cls(ep, tp, world_size, placement, num_experts)

    @property
    def moe_tp(self) -> int:
        """How many ways each routed expert is split (``W // ep``; 1 in the common case)."""
        return self.world_size // self.ep

    @property
    def dp(self) -> int:
        """How many times each dense TP slice is replicated (``W // tp``)."""
        return self.world_size // self.tp

    def experts_by_ep_rank(self) -> list[list[int]]:
        """One list of expert ids per ep_rank (length ``ep``): ``topology.json``'s
        ``experts_by_rank``. A fresh list each call, so callers may keep or change it."""
        return [list(x) for x in _placement(self.num_experts, self.ep, self.placement)]

    def experts_of_ep_rank(self, ep_rank: int) -> tuple[int, ...]:
        if not 0 <= ep_rank < self.ep:
            raise TopologyError(f"ep rank {ep_rank} out of range 0..{self.ep - 1}")
        return _placement(self.num_experts, self.ep, self.placement)[ep_rank]

    def owner_ep_ranks(self, expert: int) -> list[int]:
        """The ep_ranks holding ``expert``. Always one today; a list so that redundant
        placements (EPLB replicas) need no API change."""
        if not 0 <= expert < self.num_experts:
            raise TopologyError(f"expert {expert} out of range 0..{self.num_experts - 1}")
        if self.placement == "round_robin":
            return [expert % self.ep]
        base, rem = divmod(self.num_experts, self.ep)
        big = rem * (base + 1)  # experts held by the first rem ep_ranks, base + 1 each
        return [expert // (base + 1) if expert < big else rem + (expert - big) // base]

    def owner_ranks(self, expert: int) -> list[int]:
        """The global ranks holding (a moe_tp slice of) ``expert``."""
        m = self.moe_tp
        return [e * m + i for e in self.owner_ep_ranks(expert) for i in range(m)]

    def rank_info(self, rank: int, gpus_per_node: int | None = None) -> RankInfo:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} out of range 0..{self.world_size - 1}")
        if gpus_per_node is not None:
            _check_gpus_per_node(gpus_per_node)
        ep_rank = rank // self.moe_tp
        return RankInfo(
            rank=rank,
            ep_rank=ep_rank,
            moe_tp_rank=rank % self.moe_tp,
            tp_rank=rank % self.tp,
            dp_rank=rank // self.tp,
            node=None if gpus_per_node is None else rank // gpus_per_node,
            experts=_placement(self.num_experts, self.ep, self.placement)[ep_rank],
        )

    def ranks(self, gpus_per_node: int | None = None) -> list[RankInfo]:
        return [self.rank_info(r, gpus_per_node) for r in range(self.world_size)]

    def to_json(self) -> dict:
        """The topology fields of ``topology.json`` (the caller adds ``format``, ``version``
        and ``source``)."""
        return {
            "world_size": self.world_size,
            "ep": self.ep,
            "tp": self.tp,
            "moe_tp": self.moe_tp,
            "expert_placement": self.placement,
            "num_experts": self.num_experts,
            "experts_by_rank": self.experts_by_ep_rank(),
        }


def _validate(ep: object, tp: object, w: object, placement: object, n: object, *, defaulted: bool) -> None:
    for flag, v in (("--ep", ep), ("--tp", tp), ("--world-size", w)):
        if not _is_int(v):
            raise TopologyError(f"{flag} {v!r} is not an integer")
        if v < 1:
            raise TopologyError(f"{flag} {v} must be at least 1")
    if placement not in PLACEMENTS:
        raise TopologyError(f"unknown expert placement {placement!r}; choose {' or '.join(PLACEMENTS)}")
    if not _is_int(n):
        raise TopologyError(f"num_experts {n!r} is not an integer")
    if n < 1:
        raise TopologyError(f"num_experts {n} must be at least 1: a model without routed experts has nothing to place")
    assert isinstance(ep, int) and isinstance(tp, int) and isinstance(w, int) and isinstance(n, int)
    for flag, v in (("--ep", ep), ("--tp", tp)):
        if w % v:
            hint = f" (the default max(ep, tp)); --world-size {math.lcm(ep, tp)} would work" if defaulted else ""
            raise TopologyError(f"{flag} {v} does not divide world size {w}{hint}")
    if ep > n:
        raise TopologyError(f"ep {ep} exceeds {n} experts: ep ranks {n}..{ep - 1} would hold no experts")


def _check_gpus_per_node(g: object) -> None:
    if not _is_int(g) or g < 1:
        raise TopologyError(f"--gpus-per-node {g!r} must be a positive integer")


# ---------------------------------------------------------------------------------------------
# Rank selection

_RANK_ITEM = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", re.ASCII)


def check_heads(cfg: ModelConfig | None, tp: int, notes: list[str]) -> None:
    """Refuse a ``tp`` that does not divide the attention heads (MHA/MLA, KDA, GQA KV heads);
    without a config, say in ``notes`` that this was not checked."""
    if cfg is None:
        notes.append("no config.json: attention-head divisibility by --tp was not checked")
        return
    text_config = cfg.raw.get("text_config")  # a local, so that the isinstance check narrows its type
    text: dict[str, Any] = text_config if isinstance(text_config, dict) else cfg.raw
    checks = [("num_attention_heads", cfg.num_attention_heads)]
    lac = text.get("linear_attn_config") if isinstance(text, dict) else None
    if isinstance(lac, dict) and lac.get("num_heads"):
        checks.append(("linear_attn_config.num_heads", int(lac["num_heads"])))
    kv = text.get("num_key_value_heads") if isinstance(text, dict) else None
    if kv and not text.get("kv_lora_rank"):
        checks.append(("num_key_value_heads", int(kv)))
    for what, heads in checks:
        if heads and heads % tp:
            raise TopologyError(f"--tp {tp} does not divide {what} {heads}: attention heads cannot be split evenly")


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``: sorted, without duplicates, each in ``0..W-1``.

    Raises:
        TopologyError: for an empty spec, an item that is not ``a`` or ``a-b``, a reversed
            range, or a rank outside the world.
    """
    if not spec.strip():
        raise TopologyError("--ranks is empty; give ranks like 0-3,8")
    out: set[int] = set()
    for item in spec.split(","):
        m = _RANK_ITEM.fullmatch(item)
        if m is None:
            raise TopologyError(f"--ranks {spec!r}: {item.strip()!r} is not a rank or a range a-b")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise TopologyError(f"--ranks {spec!r}: range {lo}-{hi} is reversed")
        if hi >= world_size:  # checked before expanding, so "0-99999999" costs nothing
            raise TopologyError(f"--ranks {spec!r}: rank {hi} out of range 0..{world_size - 1} (world size {world_size})")
        out.update(range(lo, hi + 1))
    return sorted(out)


def select_ranks(
    topo: Topology, *, ranks: str | Sequence[int] | None = None, node: int | None = None,
    gpus_per_node: int | None = None,
) -> list[int]:
    """The ranks a command works on: ``--ranks`` (``"0-3,8"`` or a list), ``--node N`` with
    ``--gpus-per-node G``, or every rank when neither is given. Sorted, without duplicates.

    Raises:
        TopologyError: both or an invalid selection given, ``--node`` without ``--gpus-per-node``,
            or an empty list.
    """
    if node is not None and ranks is not None:
        raise TopologyError("give --ranks or --node, not both")
    if node is not None:
        if gpus_per_node is None:
            raise TopologyError("--node needs --gpus-per-node")
        return ranks_of_node(node, gpus_per_node, topo.world_size)
    if isinstance(ranks, str):
        return parse_ranks(ranks, topo.world_size)
    if ranks is not None:
        if not ranks:
            raise TopologyError("no ranks selected")
        return parse_ranks(",".join(map(str, ranks)), topo.world_size)
    return list(range(topo.world_size))


def num_experts_of(idx: InventoryIndex, config_experts: int | None) -> int:
    """How many routed experts a topology places: the config's count, else one more than the
    highest expert id in the tensor names (1 for a model without routed experts).

    Raises:
        TopologyError: the tensors name an expert beyond the config's count.
    """
    found = idx.max_expert + 1 if idx.max_expert >= 0 else 0
    num_experts = config_experts or found or 1
    if found > num_experts:
        raise TopologyError(f"the checkpoint has expert {found - 1} but config.json says {num_experts} experts")
    return num_experts


def num_nodes(gpus_per_node: int, world_size: int) -> int:
    """Nodes needed for ``world_size`` ranks; the last one may be partial."""
    _check_gpus_per_node(gpus_per_node)
    return -(-world_size // gpus_per_node)


def ranks_of_node(node: int, gpus_per_node: int, world_size: int) -> list[int]:
    """Ranks ``[n*G, min((n+1)*G, W))`` of node ``n``. ``G`` need not divide ``W``: the last
    node is then partial (a 4-rank job on one 8-GPU node is ordinary)."""
    nodes = num_nodes(gpus_per_node, world_size)
    if not _is_int(node) or not 0 <= node < nodes:
        raise TopologyError(
            f"--node {node} out of range: world size {world_size} with {gpus_per_node} GPUs per node "
            f"has node{'s 0..' + str(nodes - 1) if nodes > 1 else ' 0'}"
        )
    return list(range(node * gpus_per_node, min((node + 1) * gpus_per_node, world_size)))


# more routed experts than any topology places: lets RankSelection.check validate the options
# before the checkpoint (and its expert count) is read
_ANY_EXPERTS = 1 << 40


@dataclass(frozen=True)
class RankSelection:
    """Which topology, and which of its ranks, an operation works on: the ``--ep``, ``--tp``,
    ``--world-size``, ``--placement``, ``--ranks``, ``--node`` and ``--gpus-per-node`` options as
    the user gave them, before they meet a checkpoint.

    ``None`` means "not given": it resolves to ep 1, tp 1, world size ``max(ep, tp)`` (``tp x dp``
    when ``dp`` is given), linear placement and every rank, as every command has always read
    them. With ``engine=True`` (:meth:`topology`) the options mean what vLLM's
    ``--enable-expert-parallel`` makes of them: ``ep = tp x dp`` = the world size. Keeping "not given" apart
    from the default lets ``preflight`` tell a requested topology from the one it finds on disk,
    and ``fetch`` tell a rank-aware request from a whole one.

    Attributes:
        ep, tp, world_size, placement: The topology (``layout.md``).
        dp: Data-parallel degree (vLLM's ``--data-parallel-size``): the world size is ``tp x dp``.
        ranks: ``"0-3,8"`` or a sequence of global ranks (kept as a tuple); exclusive with ``node``.
        node: The ranks of node ``node`` (needs ``gpus_per_node``).
        gpus_per_node: Ranks per node: groups ranks into nodes.

    Example::

        plan = plan_reshard("./Kimi-K3", RankSelection(ep=8, tp=2, node=0, gpus_per_node=4))
    """

    ep: int | None = None
    tp: int | None = None
    world_size: int | None = None
    placement: str | None = None
    ranks: str | Sequence[int] | None = None
    node: int | None = None
    gpus_per_node: int | None = None
    dp: int | None = None  # last, so that positional construction keeps its meaning

    def __post_init__(self) -> None:
        # a list would make the value unhashable and mutable behind the frozen dataclass
        if self.ranks is not None and not isinstance(self.ranks, str):
            object.__setattr__(self, "ranks", tuple(self.ranks))

    @property
    def names_topology(self) -> bool:
        """Whether ``ep``, ``tp``, ``dp`` or ``world_size`` was given."""
        return any(v is not None for v in (self.ep, self.tp, self.dp, self.world_size))

    def check(self, *, engine: bool = False) -> None:
        """Refuse, before any checkpoint or hub is read, a selection that cannot mean what it
        says: ``ranks`` or ``node`` without a topology, both of them, an impossible topology,
        ranks outside the world, a node past the last. ``engine``: the node directory's reading
        (:meth:`topology`), where GPUs per node default to the world size (one node).

        Raises:
            TopologyError: with the one-line reason.
        """
        self._require_topology()
        if self.ranks is not None and self.node is not None:
            raise TopologyError("give --ranks or --node, not both")
        if not self.names_topology:
            return
        # The expert count is not known before the checkpoint is: with "more than any topology
        # places", only the checks that do not depend on it run (no placement is computed).
        topo = self.topology(_ANY_EXPERTS, engine=engine)
        if engine and self.node is not None and self.gpus_per_node is None:
            ranks_of_node(self.node, topo.world_size, topo.world_size)
        else:
            self.select(topo)

    def _require_topology(self) -> None:
        """``--ranks``/``--node`` name ranks of a topology; without ``ep``/``tp``/``dp``/
        ``world_size`` the world is one rank holding everything, so ``--ranks 0`` would quietly
        mean "the whole checkpoint" (1.56 TB for K3): refused rather than guessed."""
        if self.names_topology or (self.ranks is None and self.node is None):
            return
        if self.node is not None:
            flag = f"--node {self.node}"
        else:
            spec = self.ranks if isinstance(self.ranks, str) else ",".join(map(str, self.ranks or ()))
            flag = f"--ranks {spec}"
        raise TopologyError(f"{flag} selects ranks of a topology but none was given: add --tp/--dp or "
                            f"--ep/--world-size (without them one rank holds the whole checkpoint; drop "
                            f"{flag.split()[0]} for all of it)")

    def topology(self, num_experts: int, *, engine: bool = False) -> Topology:
        """The :class:`Topology` over ``num_experts`` routed experts, defaults filled in.

        ``engine=False`` (the rank layout): ``ep`` defaults to 1 - experts cut over every rank,
        as vLLM does without expert parallelism. ``engine=True`` (the node directory): vLLM's
        ``--enable-expert-parallel``, which always uses ``ep = tp x dp`` = the world size and
        never cuts an expert; ``ep`` defaults to that, and any other ``ep`` is refused with the
        nearest command the engine can run.

        Raises:
            TopologyError: an impossible topology, or ranks or a node selected without one
                (:meth:`check`), with a one-line reason.
        """
        self._require_topology()
        tp = 1 if self.tp is None else self.tp
        world_size = self._world_size(tp)
        if not engine:
            return Topology.make(1 if self.ep is None else self.ep, tp, world_size, self.placement or "linear",
                                 num_experts=num_experts)
        if not (_is_int(tp) and (self.ep is None or _is_int(self.ep))):
            return Topology.make(self.ep or 1, tp, world_size, num_experts=num_experts)  # raises, naming the flag
        if world_size is None:  # neither --world-size nor --dp: the ranks are --ep's, else --tp's
            world_size = max(tp, 1 if self.ep is None else self.ep)
        ep = world_size if self.ep is None else self.ep
        if ep != world_size:
            raise TopologyError(self._engine_refusal(ep, tp, world_size))
        return Topology.make(ep, tp, world_size, self.placement or "linear", num_experts=num_experts)

    def _world_size(self, tp: int) -> int | None:
        """``--world-size``, else ``tp x dp`` when ``--dp`` is given, else None (the default)."""
        if self.dp is None:
            return self.world_size
        if not _is_int(self.dp) or self.dp < 1:
            raise TopologyError(f"--dp {self.dp!r} must be a positive integer")
        if self.world_size is not None and self.world_size != tp * self.dp:
            raise TopologyError(f"--world-size {self.world_size} is not tp x dp = {tp} x {self.dp} = {tp * self.dp}")
        return tp * self.dp

    def _engine_refusal(self, ep: int, tp: int, world_size: int) -> str:
        """Why the engine format cannot take ``ep``, and the nearest command it can: the same GPUs
        (world size) and tp, in the vocabulary the user spoke (``--dp`` or ``--ep``)."""
        if world_size % tp:
            return f"--tp {tp} does not divide world size {world_size}"
        fix = f"--tp {tp} --dp {world_size // tp}" if self.dp is not None else f"--ep {world_size} --tp {tp}"
        if world_size % ep == 0:  # experts cut moe_tp ways: the rank layout can hold that
            other = ", or --format rank for pre-split experts"
        elif ep % tp == 0:  # more expert groups than ranks: the world they need
            other = f", or --tp {tp} --dp {ep // tp} for ep {ep}" if self.dp is not None else (
                f", or --ep {ep} --tp {tp} --world-size {ep} for ep {ep}")
        else:
            other = ""
        return (f"the engine format needs --ep equal to the world size (vLLM's expert parallel uses "
                f"ep = tp x dp = {world_size}, not {ep}); use {fix}{other}")

    def topology_for(self, idx: InventoryIndex, cfg: ModelConfig | None, *, engine: bool = False) -> Topology:
        """The topology over an inventory's routed experts (:func:`num_experts_of`), its ``tp``
        checked against the config's attention heads (:func:`check_heads`); ``engine``: see
        :meth:`topology`.

        Raises:
            TopologyError: an impossible topology, or experts beyond the config's count.
        """
        topo = self.topology(num_experts_of(idx, cfg.num_experts if cfg else None), engine=engine)
        if cfg is not None:
            check_heads(cfg, topo.tp, [])
        return topo

    def select(self, topo: Topology) -> list[int]:
        """The selected ranks of ``topo``: see :func:`select_ranks`."""
        return select_ranks(topo, ranks=self.ranks, node=self.node, gpus_per_node=self.gpus_per_node)


# ---------------------------------------------------------------------------------------------
# Splits


@dataclass(frozen=True)
class Split:
    """Part ``index`` of ``parts`` of dimension ``dim`` (``parts > 1`` always: a whole tensor
    is ``None``, never ``Split(parts=1)``)."""

    dim: int
    index: int
    parts: int

    def range(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``(start, stop)`` along :attr:`dim` of a tensor of ``shape``."""
        return split_range(shape[self.dim], self.parts, self.index, dim=self.dim)

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The sliced shape."""
        s = list(shape)
        s[self.dim] //= self.parts
        return tuple(s)

    def to_json(self) -> dict:
        return {"dim": self.dim, "index": self.index, "parts": self.parts}


@dataclass(frozen=True)
class ExpertSlice:
    """A stacked expert tensor (all experts along dim 0, gpt-oss): the rank keeps the rows of
    :attr:`experts` (contiguous only for ``linear`` placement), each further cut by
    :attr:`split` when ``moe_tp > 1`` (its ``dim`` counts in the stacked tensor's dims)."""

    experts: tuple[int, ...]
    split: Split | None = None
    dim: int = field(default=0, init=False)

    @property
    def contiguous(self) -> bool:
        e = self.experts
        return bool(e) and e[-1] - e[0] == len(e) - 1

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        s = (len(self.experts),) + tuple(shape[1:])
        return self.split.shape(s) if self.split else s

    def to_json(self) -> dict:
        return {"dim": 0, "experts": list(self.experts), "split": self.split.to_json() if self.split else None}


Placement = Split | ExpertSlice | None


def split_range(n: int, parts: int, index: int, *, name: str | None = None, dim: int | None = None) -> tuple[int, int]:
    """``[index*n/parts, (index+1)*n/parts)``. Uneven splits are errors (no padding, no silent
    unevenness), naming ``name`` when given."""
    if not _is_int(parts) or parts < 1:
        raise TopologyError(f"split into {parts!r} parts: must be a positive integer")
    if not 0 <= index < parts:
        raise TopologyError(f"split index {index} out of range 0..{parts - 1}")
    if n % parts:
        where = f"dim {dim} " if dim is not None else "dimension "
        raise SplitError(name, f"{where}of size {n} does not split {parts} ways evenly")
    step = n // parts
    return index * step, (index + 1) * step


def is_mxfp4(dtype: str, part: str) -> bool:
    """Whether a tensor is the packed data or E8M0 scales of an MXFP4 weight (K3's
    ``weight_packed`` U8 [out, in/2] / ``weight_scale`` U8 [out, in/32]). An int4
    ``pack-quantized`` I32 ``weight_packed`` or a float per-channel scale is not."""
    return (part == "weight_packed" and dtype in ("U8", "I8")) or (part == "weight_scale" and dtype in _MX_SCALE_DTYPES)


def _dim_split(
    name: str, part: str, shape: tuple[int, ...], dim: int, parts: int, index: int,
    mxfp4: bool, fp8_block: tuple[int, ...] | None,
) -> Split | None:
    """Split ``dim`` of a tensor ``parts`` ways, with the block rules of its quantization."""
    if parts == 1 or part in _WHOLE_PARTS or dim >= len(shape):
        return None  # scalars and per-tensor parameters are the same for every slice
    n = shape[dim]
    last = dim == len(shape) - 1  # the input dim of a 2-D [out, in] weight and its scales
    if part == "weight_scale" and not mxfp4 and n == 1:
        return None  # a per-channel scale broadcasts along the input dim
    if mxfp4 and last and dim > 0:
        if part == "weight_packed" and n % (parts * (MX_BLOCK // 2)):
            raise SplitError(name, (
                f"MXFP4 packed dim {dim} of {n} bytes ({2 * n} values) does not split {parts} ways on "
                f"{MX_BLOCK}-element block boundaries: needs a multiple of {parts * MX_BLOCK // 2} bytes"))
        if part == "weight_scale" and n % parts:
            raise SplitError(name, (
                f"MXFP4 scale dim {dim} of {n} blocks does not split {parts} ways: "
                f"{MX_BLOCK}-element blocks must stay whole"))
    if part == "weight_scale_inv" and n % parts:
        raise SplitError(name, (
            f"FP8 block scale dim {dim} of {n} blocks does not split {parts} ways: "
            f"the weight's scale blocks must stay whole"))
    split_range(n, parts, index, name=name, dim=dim)
    if fp8_block and part == "weight" and dim < len(fp8_block) and (n // parts) % fp8_block[dim]:
        raise SplitError(name, (
            f"FP8 block-quantized dim {dim} of size {n} split {parts} ways gives parts of {n // parts}, "
            f"not a multiple of the {fp8_block[dim]}-element scale block"))
    return Split(dim, index, parts)


# gpt-oss stacked tensors: blocks [E, out, in/32, 16], scales [E, out, in/32], bias [E, out],
# plain weight [E, in, out] (transposed, as transformers stores it).
_STACKED_TP_DIM: dict[tuple[str | None, str], int | None] = {
    ("gate_up", "blocks"): 1, ("gate_up", "scales"): 1, ("gate_up", "bias"): 1, ("gate_up", "weight"): 2,
    ("down", "blocks"): 2, ("down", "scales"): 2, ("down", "bias"): None, ("down", "weight"): 1,
}


def tensor_split(
    name: str,
    role: Role,
    shape: tuple[int, ...],
    topo: Topology,
    rank: RankInfo,
    *,
    mxfp4: bool = False,
    fp8_block: tuple[int, ...] | None = None,
) -> Placement:
    """How rank ``rank`` holds tensor ``name`` (assuming it holds it at all - routed experts
    live only on their owners; :func:`tensors_for_rank` decides that).

    Args:
        mxfp4: the tensor is MXFP4 packed data / E8M0 scales (see :func:`is_mxfp4`), so a split
            of its input dim must keep 32-element blocks whole.
        fp8_block: the (out, in) block size of a block-quantized FP8 weight (one that has a
            ``weight_scale_inv``), whose split boundaries must fall on block boundaries.

    Returns:
        ``None`` for a whole tensor, a :class:`Split`, or an :class:`ExpertSlice` for a stacked
        expert tensor.

    Raises:
        SplitError: the split is uneven or would cut a quantization block.
    """
    if role.kind == Kind.ROUTED_EXPERT:
        if role.expert is None:
            return _stacked_split(name, role, shape, topo, rank)
        if topo.moe_tp == 1:
            return None
        if role.proj == "down":
            if role.part == "bias":
                return None  # row-parallel: added once after the reduction
            dim = 1
        else:  # gate / up / fused gate_up: output rows
            dim = 0
        return _dim_split(name, role.part, shape, dim, topo.moe_tp, rank.moe_tp_rank, mxfp4, fp8_block)
    if topo.tp == 1 or role.tp not in (TP.COLUMN, TP.ROW, TP.VOCAB):
        return None
    dim = 1 if role.tp == TP.ROW else 0
    return _dim_split(name, role.part, shape, dim, topo.tp, rank.tp_rank, mxfp4, fp8_block)


def _stacked_split(name: str, role: Role, shape: tuple[int, ...], topo: Topology, rank: RankInfo) -> Placement:
    if not shape or shape[0] != topo.num_experts:
        raise SplitError(name, f"stacked expert tensor of shape {list(shape)} does not have {topo.num_experts} experts in dim 0")
    inner = None
    if topo.moe_tp > 1:
        dim = _STACKED_TP_DIM.get((role.proj, role.part))
        if dim is not None:
            # blocks/scales count whole 32-element blocks, so an even split keeps blocks whole
            inner = _dim_split(name, role.part, shape, dim, topo.moe_tp, rank.moe_tp_rank, False, None)
    if inner is None and len(rank.experts) == topo.num_experts:
        return None
    return ExpertSlice(rank.experts, inner)


# ---------------------------------------------------------------------------------------------
# What each rank holds


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


# ---------------------------------------------------------------------------------------------
# Orchestration environment

#: field -> variables that carry it, highest priority first. torchrun (and most launchers built
#: on torch.distributed) set RANK & co.; Slurm's srun sets SLURM_*; Open MPI's mpirun (TRT-LLM)
#: sets OMPI_COMM_WORLD_*; a Kubernetes Indexed Job gives each pod (one per node) its index.
ENV_VARIABLES: dict[str, tuple[str, ...]] = {
    "rank": ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"),
    "world_size": ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"),
    "local_rank": ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "local_world_size": ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "node": ("GROUP_RANK", "SLURM_NODEID", "JOB_COMPLETION_INDEX"),
}


@dataclass(frozen=True)
class RankEnv:
    """What the launcher's environment says about this process. Each field is the value of its
    highest-priority variable that is set and valid (``None`` if none is); ``sources`` names
    that variable and ``candidates`` keeps every variable seen, so preflight can check them
    against each other and against the topology.

    Candidates may legitimately differ: torchrun started once per node under ``sbatch`` sees
    SLURM_PROCID = node index while RANK is the worker's rank. So differences are data here,
    not errors.
    """

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    node: int | None = None
    sources: dict[str, str] = field(default_factory=dict)  # field -> variable it came from
    candidates: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()  # malformed values, rank >= world size, ...

    @property
    def found(self) -> bool:
        return bool(self.sources)


def rank_from_env(environ: Mapping[str, str]) -> RankEnv:
    """Read rank, world size, local rank, ranks per node and node index from ``environ``
    (``os.environ`` or a dict) - see :data:`ENV_VARIABLES`. Never raises: problems are
    collected in :attr:`RankEnv.problems` for preflight to report."""
    values: dict[str, int | None] = {}
    sources: dict[str, str] = {}
    candidates: dict[str, tuple[tuple[str, int], ...]] = {}
    problems: list[str] = []
    for fld, variables in ENV_VARIABLES.items():
        seen: list[tuple[str, int]] = []
        for var in variables:
            raw = environ.get(var)
            if raw is None or raw.strip() == "":
                continue
            text = raw.strip()
            if not (text.isascii() and text.isdigit()):
                problems.append(f"{var}={raw!r} is not a non-negative integer")
                continue
            seen.append((var, int(text)))
        if seen:
            sources[fld] = seen[0][0]
            candidates[fld] = tuple(seen)
        values[fld] = seen[0][1] if seen else None
    rank, world, local, local_world = (values[k] for k in ("rank", "world_size", "local_rank", "local_world_size"))
    if world is not None and world < 1:
        problems.append(f"{sources['world_size']}={world}: world size must be at least 1")
    elif rank is not None and world is not None and rank >= world:
        problems.append(f"{sources['rank']}={rank} is not below {sources['world_size']}={world}")
    if local_world is not None and local_world < 1:
        problems.append(f"{sources['local_world_size']}={local_world}: ranks per node must be at least 1")
    elif local is not None and local_world is not None and local >= local_world:
        problems.append(f"{sources['local_rank']}={local} is not below {sources['local_world_size']}={local_world}")
    return RankEnv(rank, world, local, local_world, values["node"], sources, candidates, tuple(problems))
