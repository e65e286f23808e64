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
  8-GPU box is normal). A node index past the last rank is an error. The node format's engine
  launch is stricter over several nodes (:func:`require_engine_nodes`): ``G`` a multiple of
  ``T`` that divides ``W``.
- Stacked expert tensors (gpt-oss ``mlp.experts.*`` with all experts in dim 0) are described by
  :class:`ExpertSlice`: the rank's experts along dim 0 (contiguous only for ``linear``
  placement) plus, when ``moe_tp > 1``, a :class:`Split` of each expert. The contract's manifest
  ``split`` covers only :class:`Split`; ``reshard`` decides how to record an ExpertSlice.
- A tensor with no dimension to split (a per-tensor scalar scale) and a per-channel scale whose
  split dimension has size 1 are replicated whole: they broadcast along that dimension.

Where it lives (every name is importable from here):

- ``_ranks``: :class:`Topology`, :class:`RankInfo`, placements and nodes;
- ``_selection``: :class:`RankSelection`, ``--ranks`` parsing, the expert count, the head check;
- ``_splits``: :class:`Split`, :class:`ExpertSlice`, :func:`tensor_split` and the block rules;
- ``_index``: :class:`InventoryIndex`, :func:`tensors_for_rank` / :func:`tensors_for_ranks`;
- ``_env``: :func:`rank_from_env`, what the launcher's environment says.
"""

from ...errors import SplitError, TopologyError
from ._env import ENV_VARIABLES, RankEnv, rank_from_env
from ._index import (
    DEFAULT_FP8_BLOCK,
    InventoryIndex,
    RankTensors,
    build_index,
    fp8_block_of,
    index_of,
    tensors_for_rank,
    tensors_for_ranks,
)
from ._ranks import PLACEMENTS, RankInfo, Topology, num_nodes, ranks_of_node, require_engine_nodes
from ._selection import (
    RankSelection,
    check_heads,
    num_experts_of,
    parse_ranks,
    require_engine_placement,
    require_expert_count,
    select_ranks,
)
from ._splits import MX_BLOCK, ExpertSlice, Placement, Split, is_mxfp4, split_range, tensor_split

__all__ = [
    "DEFAULT_FP8_BLOCK",
    "ENV_VARIABLES",
    "MX_BLOCK",
    "PLACEMENTS",
    "ExpertSlice",
    "InventoryIndex",
    "Placement",
    "RankEnv",
    "RankInfo",
    "RankSelection",
    "RankTensors",
    "Split",
    "SplitError",
    "Topology",
    "TopologyError",
    "build_index",
    "check_heads",
    "fp8_block_of",
    "index_of",
    "is_mxfp4",
    "num_experts_of",
    "num_nodes",
    "parse_ranks",
    "rank_from_env",
    "ranks_of_node",
    "require_engine_nodes",
    "require_engine_placement",
    "require_expert_count",
    "select_ranks",
    "split_range",
    "tensor_split",
    "tensors_for_rank",
    "tensors_for_ranks",
]
