"""The topology itself: (ep, tp, world size, placement) over the routed experts, validated so
that an invalid :class:`Topology` cannot exist, where each global rank sits in it
(:class:`RankInfo`: ep/moe_tp/tp/dp rank, node, experts), the expert placements
(:data:`PLACEMENTS`), how ranks group into nodes (:func:`num_nodes`, :func:`ranks_of_node`), and
which groupings an engine launch of the node format can run (:func:`require_engine_nodes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeGuard

from ...errors import TopologyError

PLACEMENTS = ("linear", "round_robin")


def is_int(x: object) -> TypeGuard[int]:
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
        if defaulted and is_int(ep) and is_int(tp):
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
        if not is_int(rank) or not 0 <= rank < self.world_size:
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
        if not is_int(v):
            raise TopologyError(f"{flag} {v!r} is not an integer")
        if v < 1:
            raise TopologyError(f"{flag} {v} must be at least 1")
    if placement not in PLACEMENTS:
        raise TopologyError(f"unknown expert placement {placement!r}; choose {' or '.join(PLACEMENTS)}")
    if not is_int(n):
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
    if not is_int(g) or g < 1:
        raise TopologyError(f"--gpus-per-node {g!r} must be a positive integer")


def num_nodes(gpus_per_node: int, world_size: int) -> int:
    """Nodes needed for ``world_size`` ranks; the last one may be partial."""
    _check_gpus_per_node(gpus_per_node)
    return -(-world_size // gpus_per_node)


def ranks_of_node(node: int, gpus_per_node: int, world_size: int) -> list[int]:
    """Ranks ``[n*G, min((n+1)*G, W))`` of node ``n``. ``G`` need not divide ``W``: the last
    node is then partial (a 4-rank job on one 8-GPU node is ordinary)."""
    nodes = num_nodes(gpus_per_node, world_size)
    if not is_int(node) or not 0 <= node < nodes:
        raise TopologyError(
            f"--node {node} out of range: world size {world_size} with {gpus_per_node} GPUs per node "
            f"has node{'s 0..' + str(nodes - 1) if nodes > 1 else ' 0'}"
        )
    return list(range(node * gpus_per_node, min((node + 1) * gpus_per_node, world_size)))


def require_engine_nodes(tp: int, world_size: int, gpus_per_node: int, launch: str) -> None:
    """Refuse nodes the node format's engine launch cannot run - the one rule ``plan``,
    ``reshard``, ``fetch --node`` and ``preflight`` (through :func:`k3ckpt.deploy.serve.serve_command`)
    share, so that nothing is written for a launch that cannot start.

    One node holding the whole world (``gpus_per_node >= world_size``; ``--tp 4`` on an 8-GPU
    box) always runs. Over several nodes, vLLM's multi-node data parallelism runs the same whole
    number of TP groups on every node (``--data-parallel-size-local``): ``gpus_per_node`` must be
    a multiple of ``tp`` (a tensor-parallel group never spans two nodes) and divide the world
    size (no partial last node). ``launch`` is the topology's options as the user gave them
    (``--tp 4 --dp 2``): the refusal names the nearest command that runs - the same options with
    the largest GPUs per node that works and is no more than the given one (else the smallest).

    Raises:
        TopologyError: with the reason and that command.
    """
    _check_gpus_per_node(gpus_per_node)
    if num_nodes(gpus_per_node, world_size) == 1:
        return
    fits = [g for g in range(tp, world_size + 1, tp) if world_size % g == 0]  # world_size itself: one node
    if gpus_per_node in fits:
        return
    best = max((g for g in fits if g <= gpus_per_node), default=fits[0])
    others = [str(g) for g in fits if g != best]
    if gpus_per_node % tp:
        why = (f"a tensor-parallel group would span two nodes ({gpus_per_node} is not a multiple of --tp {tp}), "
               f"which vLLM cannot launch")
    else:
        why = (f"the last node would run {world_size % gpus_per_node} of its {gpus_per_node} GPUs, and vLLM runs "
               f"the same number of data-parallel ranks on every node (--data-parallel-size-local)")
    raise TopologyError(f"--gpus-per-node {gpus_per_node} with {launch}: {why}; use {launch} --gpus-per-node {best}"
                        + (f" (or {', '.join(others)})" if others else ""))
