"""Planning a rank-aware fetch (``--format partial``): which tensors the selected ranks hold, and
what each source shard holding one becomes - fetched whole, or rewritten with a new header and the
Range requests that fill it. Decided from the hub's metadata and shard headers alone.

:func:`plan_rank_fetch` reads the source (:func:`k3ckpt.hub._remote.read_source`), works out with
:func:`k3ckpt.format.topology.tensors_for_ranks` which tensors the selected ranks hold
(:func:`select_tensors`) and plans each shard (:func:`plan_shard`). A shard holding only selected
tensors is downloaded whole (so the hub's sha256 verifies it); otherwise it is rewritten as a valid
safetensors file holding just the selected tensors: a new header (the source's ``__metadata__``,
the source's tensor order, offsets recomputed back to back, data buffer 8-byte aligned as
:func:`~k3ckpt.format.header.build_header` pads) followed by the tensors' bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RankFetchError
from ..format.checkpoint import INDEX_NAME, bulk_allocation
from ..format.config import ModelConfig
from ..format.header import ShardHeader, TensorInfo, TensorSpec, build_header
from ..format.topology import RankSelection, Topology, build_index, fp8_block_of, tensors_for_ranks
from ..integrity.manifest import Manifest
from . import download
from ._pieces import Piece, Task, pieces_and_tasks
from ._remote import check_manifest, check_manifest_files, load_manifest, other_files, read_source
from ._result import VERIFIED_FILES, VERIFIED_STRUCTURE, VERIFIED_TENSORS
from .client import HubFile, HubListing


@dataclass
class ShardPlan:
    """What one source shard contributes to the output.

    Attributes:
        path: Repo-relative path; also the output file's name.
        source: The hub's entry for the source shard.
        source_tensors: Number of tensors in the source shard.
        names: The selected tensors, in source order.
        prefix: The output's 8-byte length and header (empty for a whole shard: the source's is kept).
        size: Size of the output file.
        tensor_bytes: Bytes of the selected tensors' data.
        whole: Every tensor is selected: the shard is fetched whole and sha256-verified.
        pieces: The ranged GETs (empty for a whole shard).
        tasks: The hashing units over :attr:`pieces` (empty for a whole shard).
    """

    path: str
    source: HubFile
    source_tensors: int
    names: list[str]
    prefix: bytes
    size: int
    tensor_bytes: int
    whole: bool
    pieces: list[Piece] = field(default_factory=list)
    tasks: list[Task] = field(default_factory=list)

    @property
    def download_bytes(self) -> int:
        """Bytes the fetch moves for this shard (a whole shard comes with its header)."""
        return self.source.size if self.whole else self.tensor_bytes

    def content_key(self) -> str:
        """Identifies the *content* of the rewritten shard: the source file (path, size, digest)
        and the new header. Two runs with equal keys write byte-identical files; a new hub
        revision changes the source digest, so a shard written from the old one is not kept."""
        h = hashlib.sha256()
        h.update(json.dumps([self.path, self.source.size, self.source.sha256, self.source.git_sha1]).encode())
        h.update(self.prefix)
        return h.hexdigest()

    def fingerprint(self) -> str:
        """Identifies the exact ``.part`` this plan writes: source content, new header and the
        request layout (so a journal of another selection or chunk size is never adopted)."""
        h = hashlib.sha256()
        h.update(json.dumps([self.path, self.source.size, self.source.sha256, self.source.git_sha1]).encode())
        h.update(self.prefix)
        h.update(json.dumps([[p.src, p.dst, p.length] for p in self.pieces]).encode())
        return h.hexdigest()

    def source_of(self, piece: Piece) -> HubFile:
        """The hub file ``piece`` reads: this shard's one source."""
        return self.source


def plan_shard(header: ShardHeader, source: HubFile, wanted: set[str] | frozenset[str], chunk_size: int) -> ShardPlan | None:
    """The output of one source shard for the ``wanted`` tensors, or ``None`` if it holds none.

    Args:
        header: The source shard's parsed header.
        source: Its hub entry (size and digests).
        wanted: Names of the tensors to keep (names of other shards are ignored).
        chunk_size: Largest ranged GET, in bytes.
    """
    kept = sorted((t for n, t in header.tensors.items() if n in wanted), key=lambda t: t.begin)
    if not kept:
        return None
    nbytes = sum(t.end - t.begin for t in kept)
    if len(kept) == len(header.tensors):
        return ShardPlan(source.path, source, len(header.tensors), [t.name for t in kept], b"", source.size, nbytes,
                         True)
    prefix, offsets = build_header([TensorSpec(t.name, t.dtype, t.shape) for t in kept], header.metadata)
    base = len(prefix)
    spans = [(t.name, "", header.data_start + t.begin, base + b, base + e) for t, (b, e) in zip(kept, offsets)]
    pieces, tasks = pieces_and_tasks(spans, chunk_size)
    size = base + (offsets[-1][1] if offsets else 0)
    return ShardPlan(source.path, source, len(header.tensors), [t.name for t in kept], prefix, size, nbytes, False,
                     pieces, tasks)


@dataclass
class RankFetchPlan:
    """Everything a rank-aware fetch will do, decided from hub metadata and headers alone.

    Attributes:
        listing: The hub listing (pinned to the resolved commit).
        dest: Destination directory.
        topology: The topology the ranks belong to.
        ranks: The selected global ranks.
        node: ``--node`` when the ranks came from it.
        gpus_per_node: ``--gpus-per-node`` when given.
        chunk_size: Largest ranged GET.
        shards: One plan per source shard holding a selected tensor, by path.
        files: Non-weight files fetched whole.
        excluded: Non-weight files left out by ``--include``/``--exclude``.
        experts: The routed experts the selected ranks hold (in every MoE layer).
        header_bytes: Bytes read to plan (length prefixes and headers of every shard).
        source_bytes: Bytes a full fetch would move (every shard, the index, every non-weight file).
        source_index_sha256: sha256 of the source's index file (``None`` for a single file).
        manifest: The tensor-hash manifest to verify against, if any.
        manifest_label: How to name it in messages.
        revision: The revision as requested (None: the hub's default branch), for the record an
            offline re-run checks against.
    """

    listing: HubListing
    dest: Path
    topology: Topology
    ranks: list[int]
    node: int | None
    gpus_per_node: int | None
    chunk_size: int
    shards: list[ShardPlan]
    files: list[str]
    excluded: list[str]
    experts: list[int]
    header_bytes: int
    source_bytes: int
    source_index_sha256: str | None
    manifest: Manifest | None = None
    manifest_label: str | None = None
    revision: str | None = None

    @property
    def bytes_total(self) -> int:
        """Bytes the fetch moves when nothing is present yet (planning headers excluded)."""
        return sum(s.download_bytes for s in self.shards) + sum(self.listing.files[f].size for f in self.files)

    @property
    def verification(self) -> str:
        if all(s.whole for s in self.shards):
            return VERIFIED_FILES
        return VERIFIED_TENSORS if self.manifest is not None else VERIFIED_STRUCTURE

    @property
    def tensors(self) -> int:
        return sum(len(s.names) for s in self.shards)

    def source_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hub": self.listing.hub, "repo": self.listing.repo, "revision": self.listing.revision}
        if self.source_index_sha256 is not None:
            out["index_sha256"] = self.source_index_sha256
        return out

    def to_json(self) -> dict[str, Any]:
        """The ``--dry-run --json`` output."""
        return {
            "hub": self.listing.hub, "repo": self.listing.repo, "revision": self.listing.revision,
            "dest": str(self.dest), "topology": self.topology.to_json(), "ranks": self.ranks, "node": self.node,
            "gpus_per_node": self.gpus_per_node,
            "shards": {s.path: {"tensors": len(s.names), "source_tensors": s.source_tensors, "whole": s.whole,
                                "bytes": s.download_bytes, "source_bytes": s.source.size, "size": s.size,
                                "requests": 1 if s.whole else len(s.pieces)} for s in self.shards},
            "files": {f: self.listing.files[f].size for f in self.files}, "excluded": self.excluded,
            "bytes_total": self.bytes_total, "source_bytes": self.source_bytes, "header_bytes": self.header_bytes,
            "tensors": self.tensors, "verification": self.verification,
            "experts": self.experts,
        }


def select_tensors(
    tensors: dict[str, TensorInfo],
    cfg: ModelConfig | None,
    selection: RankSelection = RankSelection(),
) -> tuple[Topology, list[int], set[str], set[int]]:
    """``(topology, ranks, tensor names, routed experts)`` the selected ranks hold, from an
    inventory and its config (the expert count comes from the config when it has one).

    Raises:
        TopologyError, SplitError: An impossible topology or rank selection.
    """
    idx = build_index(tensors, fp8_block=fp8_block_of(cfg))
    topo = selection.topology_for(idx, cfg)
    selected = selection.select(topo)
    per_rank = tensors_for_ranks(idx, topo, selected, gpus_per_node=selection.gpus_per_node)
    wanted: set[str] = set()
    for rt in per_rank.values():
        wanted.update(rt.tensors)
    return topo, selected, wanted, {e for rt in per_rank.values() for e in rt.rank.experts}


def plan_rank_fetch(
    hub: str,
    repo: str,
    dest: str | os.PathLike[str],
    selection: RankSelection = RankSelection(),
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    manifest: Manifest | str | os.PathLike[str] | None = None,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    chunk_size: int = download.DEFAULT_CHUNK,
    jobs: int = 8,
) -> RankFetchPlan:
    """Decide what a rank-aware fetch downloads, from the hub's metadata and shard headers.

    Reads the listing (through the real client), ``config.json``, the index and every shard's
    header (two Range requests each); no tensor data.

    Args:
        hub (`str`): ``"hf"`` or ``"modelscope"``.
        repo (`str`): Repository id.
        dest (`str` or `os.PathLike`): Destination directory.
        revision (`str`, *optional*): Branch, tag or commit; the plan pins the resolved commit.
        selection (`RankSelection`): The topology and the ranks to fetch for.
        endpoint (`str`, *optional*), token (`str`, *optional*): As :func:`k3ckpt.hubclient.list_repo`.
        manifest (`Manifest` or path, *optional*): A tensor-hash manifest to verify against.
        include, exclude (`tuple[str, ...]`): Globs filtering the non-weight files.
        chunk_size (`int`): Largest ranged GET, in bytes.
        jobs (`int`): Concurrent header requests.

    Returns:
        `RankFetchPlan`.

    Raises:
        RankFetchError: No checkpoint in the repo, headers that disagree with the index, or a
            manifest that does not describe the hub's headers.
        TopologyError, SplitError: An impossible topology or rank selection.
        HubError, SafetensorsHeaderError, ConfigError: As the hub client and parsers raise them.
    """
    if chunk_size < 1:
        raise RankFetchError(f"chunk size {chunk_size} must be positive")
    selection.check()  # before any request: a selection that means nothing must not cost a byte
    manifest, label = load_manifest(manifest)
    src = read_source(hub, repo, revision, endpoint=endpoint, token=token, jobs=jobs,
                      on_listing=lambda listing: other_files(listing, include, exclude))
    listing, weight_map, shard_paths, index_sha = src.listing, src.weight_map, src.shard_paths, src.index_sha256
    cfg, headers, tensors = src.config, src.headers, src.tensors

    # ~10^6 fresh acyclic tuples at the full K3 scale: without pausing the cyclic GC this
    # takes 2-3x longer (see checkpoint.bulk_allocation)
    with bulk_allocation():
        topo, selected, wanted, experts = select_tensors(tensors, cfg, selection)
        if manifest is not None:
            check_manifest(manifest, label or "(given)", headers, wanted, listing)
        shards = [sp for h in headers if (sp := plan_shard(h, listing.files[h.file], wanted, chunk_size)) is not None]
    files, excluded = other_files(listing, include, exclude, skip=frozenset(shard_paths))
    if manifest is not None:
        check_manifest_files(manifest, label or "(given)", listing, files + [sp.path for sp in shards if sp.whole])
    return RankFetchPlan(
        listing=listing, dest=Path(dest), topology=topo, ranks=selected, node=selection.node,
        gpus_per_node=selection.gpus_per_node,
        chunk_size=chunk_size, shards=shards, files=files, excluded=excluded,
        experts=sorted(experts),
        header_bytes=sum(h.data_start for h in headers),
        source_bytes=sum(listing.files[p].size for p in shard_paths + files + excluded + ([INDEX_NAME] if weight_map else [])),
        source_index_sha256=index_sha, manifest=manifest, manifest_label=label, revision=revision,
    )
