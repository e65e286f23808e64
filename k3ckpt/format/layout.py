"""File and directory names of the layouts k3ckpt writes: the per-rank layout (``rank-NNNNN/``,
``topology.json``, ``rank-manifest.json``, ``READY``), the node directory (``k3ckpt-node.json``) and a
rank-aware fetch's copy (``k3ckpt-partial.json``). One home, so every reader agrees with the writer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import LayoutError
from ..utils import load_json

FORMAT = "k3ckpt-rank-layout"
VERSION = 1
MANIFEST_NAME = "rank-manifest.json"
READY_NAME = "READY"
TOPOLOGY_NAME = "topology.json"
#: Marker of a node directory (``reshard --format node``): topology, node, its experts, digests.
NODE_MARKER = "k3ckpt-node.json"
#: The marker of a rank-aware fetch (``k3ckpt fetch --ranks/--node``; ``rankfetch.PARTIAL_NAME``):
#: the same ``experts`` list, so verify reads either through :func:`read_node_marker`.
PARTIAL_MARKER = "k3ckpt-partial.json"
NODE_FORMAT = "k3ckpt-node"
#: ``k3ckpt-node.json``'s version: 2 records each file's digest as ``segments_sha256`` (built from
#: its header's and tensors' sha256, :func:`~k3ckpt.format.filedigest.segments_sha256`); version 1
#: recorded the file's plain sha256 as ``sha256``. Readers accept both.
NODE_MARKER_VERSION = 2
#: ``topology.json``'s format of a node-directory output (not the rank-layout contract's).
NODE_LAYOUT_FORMAT = "k3ckpt-node-layout"
#: ``reshard --format`` values: ``node`` (the default: node directories an engine loads) and
#: ``rank`` (pre-split tensors for custom loaders).
LAYOUTS = ("node", "rank")
#: Other spellings ``--format`` accepts: ``hf-node`` was the node format's first name.
LAYOUT_ALIASES = {"hf-node": "node"}


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def part_name(rank: int, part: int) -> str:
    return f"model-rank-{rank}-part-{part}.safetensors"


def node_dir_name(node: int) -> str:
    return f"node-{node:05d}"


def hf_shard_name(k: int, n: int) -> str:
    """``model-00001-of-00004.safetensors`` (``k`` counts from 0), as ``save_pretrained`` names them."""
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def read_node_marker(root: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``k3ckpt-node.json`` of a node directory (or the ``k3ckpt-partial.json``
    of a rank-aware fetch), or None when there is none.

    Raises:
        LayoutError: the marker exists but is unreadable or lists no experts.
    """
    path = next((Path(root) / m for m in (NODE_MARKER, PARTIAL_MARKER) if (Path(root) / m).exists()), None)
    if path is None:
        return None
    marker, _ = load_json(path, LayoutError)
    experts = marker.get("experts") if isinstance(marker, dict) else None
    if not isinstance(experts, list) or not all(isinstance(e, int) for e in experts):
        raise LayoutError(f"{path}: no list of experts")
    return marker
