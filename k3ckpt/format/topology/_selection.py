"""Which ranks an operation works on: :class:`RankSelection` (the ``--ep/--tp/--dp/--world-size/
--placement/--ranks/--node/--gpus-per-node`` options as given, before they meet a checkpoint),
``--ranks`` parsing (:func:`parse_ranks`, :func:`select_ranks`), the expert count a topology
places (:func:`num_experts_of`, :func:`require_expert_count`), the attention-head check of
``--tp`` (:func:`check_heads`) and the placement vLLM can serve (:func:`require_engine_placement`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError, TopologyError
from ...utils import format_ranges
from ._ranks import Topology, is_int, ranks_of_node, require_engine_nodes

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ._index import InventoryIndex

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


def require_engine_placement(cfg: ModelConfig | None, topo: Topology) -> None:
    """Refuse a node directory with round_robin placement for a model whose router has one
    expert group: vLLM (0.32, 0.33) then places its experts linearly while its expert-parallel
    weight filter keeps round_robin's, so all but about 1 in ep of each rank's expert slots are
    never loaded (half at ep 2) and the server answers wrong with no error
    (``tests/test_engine_run.py`` pins it). Without a config the group count is unknown, and
    ``preflight`` judges the directory later.

    Raises:
        TopologyError: naming the config's group entry and the placement that works.
    """
    if cfg is None or topo.placement != "round_robin" or topo.world_size < 2 or cfg.expert_groups > 1:
        return
    raise TopologyError(f"{cfg.source}: round_robin placement needs a model with several expert groups, but it "
                        f"has {cfg.describe_expert_groups()}: vLLM would place the experts linearly and leave all but "
                        f"about 1 in ep of each rank's expert slots unloaded, with no error; use --placement linear")


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


def require_expert_count(idx: InventoryIndex, cfg: ModelConfig | None) -> None:
    """Refuse a config that does not say how many routed experts there are while the tensors
    hold some: written with it, every output reads as a dense model (``inspect``, ``verify`` and
    ``preflight`` flag each MoE layer, an engine builds none), so a command that would copy it
    refuses before writing anything. No config (a plan from a manifest) is not this case.

    Raises:
        ConfigError: naming the config, the key it lacks (``text_config.num_experts`` for K3)
            and what the tensors show.
    """
    if cfg is None or cfg.num_experts or idx.max_expert < 0:
        return
    key = cfg.experts_key
    section = cfg.raw.get("text_config") if key.startswith("text_config.") else cfg.raw
    present = isinstance(section, dict) and section.get(key.rsplit(".", 1)[-1]) is not None
    found = sorted(idx.expert_names)
    example = idx.expert_names[found[0]][0]
    raise ConfigError(f"{cfg.source}: {key} is {'0' if present else 'missing'}, but the tensors hold "
                      f"{len(found)} routed experts ({format_ranges(found)}, e.g. {example}): written with this "
                      f"config every output would read as a dense model; set {key} to {idx.max_expert + 1}",
                      path=cfg.source)


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
        if engine:
            self._check_nodes(topo)
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
        if not (is_int(tp) and (self.ep is None or is_int(self.ep))):
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
        if not is_int(self.dp) or self.dp < 1:
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
        """The topology over an inventory's routed experts (:func:`num_experts_of`; a config that
        does not count the experts the tensors hold is refused, :func:`require_expert_count`),
        its ``tp`` checked against the config's attention heads (:func:`check_heads`); ``engine``:
        see :meth:`topology`, and the nodes of ``gpus_per_node`` GPUs must be ones its launch
        runs (:func:`~k3ckpt.format.topology.require_engine_nodes`). What every command that
        writes a topology's files (``plan``, ``reshard``, a rank-aware ``fetch``) asks first.

        Raises:
            TopologyError: an impossible topology, experts beyond the config's count, or nodes
                the engine launch cannot run.
            ConfigError: a config without the count of the routed experts the tensors hold.
        """
        require_expert_count(idx, cfg)
        topo = self.topology(num_experts_of(idx, cfg.num_experts if cfg else None), engine=engine)
        if cfg is not None:
            check_heads(cfg, topo.tp, [])
        if engine:
            self._check_nodes(topo)
            require_engine_placement(cfg, topo)
        return topo

    def _check_nodes(self, topo: Topology) -> None:
        """:func:`~k3ckpt.format.topology.require_engine_nodes` for ``gpus_per_node`` (not given:
        one node, which always runs), naming the topology in the options the user gave."""
        if self.gpus_per_node is None:
            return
        if self.dp is not None:
            launch = f"--tp {topo.tp} --dp {topo.dp}"
        else:
            launch = " ".join(f"{flag} {v}" for flag, v in (("--ep", self.ep), ("--tp", self.tp),
                                                            ("--world-size", self.world_size)) if v is not None)
        require_engine_nodes(topo.tp, topo.world_size, self.gpus_per_node, launch)

    def select(self, topo: Topology) -> list[int]:
        """The selected ranks of ``topo``: see :func:`select_ranks`."""
        return select_ranks(topo, ranks=self.ranks, node=self.node, gpus_per_node=self.gpus_per_node)

