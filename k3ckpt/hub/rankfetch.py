"""Rank-aware fetch: download only the tensors that some ranks of a TP/EP topology need.

This module writes ``--format partial`` (the hub's shards, each with only the selected tensors);
:mod:`k3ckpt.hub.nodefetch` writes ``--format node`` (``reshard``'s node directory) with the same
download machinery. Where each part lives:

- :mod:`k3ckpt.hub._remote`: what planning reads of the hub, and the manifest checks;
- :mod:`k3ckpt.hub._pieces`: pieces, tasks, the ``.part`` and its journal;
- :mod:`k3ckpt.hub._workers`: the workers that fill the ``.part`` files, and the run around them;
- :mod:`k3ckpt.hub._result`: :class:`RankFetchResult` and the text both fetches print;
- here: planning a partial fetch (:func:`plan_rank_fetch`), its run (:func:`run_rank_fetch`: its
  index and marker) and its text.

``k3ckpt fetch --ep 8 --tp 2 --node 0 --gpus-per-node 4`` reads the config, the index and every
shard's header with Range requests (about 60 MB for the full K3), works out with
:func:`k3ckpt.format.topology.tensors_for_ranks` which tensors the selected ranks hold, and
downloads only their byte ranges. A node of an 8-way expert-parallel deployment so stores about
1/8 of the routed experts instead of 1.56 TB. Tensors are fetched *whole* (``reshard`` slices the
dense ones later); the saving is the routed experts these ranks do not own.

Output: a plain local-dir checkpoint of the selected tensors that ``reshard`` and ``verify``
accept:

- every source shard holding a selected tensor keeps its file name. If it holds only selected
  tensors it is downloaded whole by :func:`k3ckpt.hub.download.fetch_files` (so the hub's sha256
  verifies it); otherwise it is rewritten as a valid safetensors file holding just the
  selected tensors: a new header (the source's ``__metadata__``, the source's tensor order,
  offsets recomputed back to back, data buffer 8-byte aligned as
  :func:`~k3ckpt.format.header.build_header` pads) followed by the tensors' bytes;
- ``model.safetensors.index.json`` lists exactly the tensors present, ``metadata.total_size``
  their bytes;
- every non-weight file (config, tokenizer, LICENSE, code) is fetched whole, as a full fetch
  does (``--include``/``--exclude`` filter these);
- ``k3ckpt-partial.json`` (:data:`PARTIAL_NAME`), written last, says what was selected:
  source, topology, ranks, ``experts`` (the routed experts every MoE layer holds, as in the
  ``k3ckpt-node.json`` of ``reshard --format hf-node``) and how the bytes were verified.
  ``verify`` requires only those experts; a later run can tell a partial checkpoint from a
  broken one. Its presence means the run completed.

Verification. The hub's sha256 covers whole files, so a rewritten shard cannot be checked
against it. With a tensor-hash manifest (``k3ckpt manifest pull|build --tensor-hashes``) each
tensor is hashed while its bytes stream in (no second read) and compared with the manifest; a
mismatch re-fetches that task once, then fails the shard naming the tensor. The manifest must
describe the hub's headers exactly (file, dtype, shape, offsets) or the run is refused before
any byte moves. Without a manifest only structure (the header written) and sizes are checked,
and the result says so.

Crash safety (SIGKILL at any moment) follows the downloader's design (:mod:`k3ckpt.hub._pieces`
and :mod:`k3ckpt.hub._workers` say how); a complete ``.part`` is checked (size, header bytes) and
renamed into place; the index and the marker are removed at the start of a run and written only
when everything succeeded. The destination lock is the downloader's.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RankFetchError
from ..format.checkpoint import INDEX_NAME, bulk_allocation
from ..format.config import ModelConfig
from ..format.header import ShardHeader, TensorInfo, TensorSpec, build_header
from ..format.layout import PARTIAL_MARKER
from ..format.topology import RankSelection, Topology, build_index, fp8_block_of, tensors_for_ranks
from ..integrity.hashing import HashError, hash_file
from ..integrity.manifest import Manifest
from ..utils import format_ranges, human_bytes, write_atomic
from . import _dest, download
from ._pieces import Piece, Task, looks_complete, pieces_and_tasks, tensor_spans
from ._remote import check_manifest, check_manifest_files, load_manifest, other_files, read_source
from ._result import VERIFIED_FILES, VERIFIED_STRUCTURE, VERIFIED_TENSORS, RankFetchResult, dry_run_total, fetch_summary
from ._workers import fetch_outputs, fetch_run, load_shard_record, open_jobs
from .client import HubFile, HubListing, RetryPolicy
from .fetch import record_source, source_text

__all__ = [
    "PARTIAL_NAME",
    "RankFetchError",
    "RankFetchPlan",
    "RankFetchResult",
    "ShardPlan",
    "plan_rank_fetch",
    "plan_shard",
    "rank_fetch_json",
    "render_rank_fetch",
    "render_rank_fetch_plan",
    "run_rank_fetch",
    "select_tensors",
]

#: The marker written last into a rank-aware fetch's destination.
PARTIAL_NAME = PARTIAL_MARKER
PARTIAL_FORMAT = "k3ckpt-partial"
PARTIAL_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Planning: which bytes go where


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
        source_index_sha256=index_sha, manifest=manifest, manifest_label=label,
    )


# ---------------------------------------------------------------------------------------------
# Running


def _complete(sp: ShardPlan, final: str, manifest: Manifest | None, written_from: str | None) -> bool:
    """Whether ``final`` already is this shard: size, header bytes, and then with a manifest every
    tensor's sha256 (read locally; nothing is downloaded for a complete shard), without one the
    record that it was written from this very source content (``written_from``)."""
    if not looks_complete(sp, final):
        return False
    if manifest is None:
        return written_from == sp.content_key()
    try:
        digest = hash_file(final, spans=tensor_spans(sp))
    except HashError:
        return False
    return all(manifest.tensors[n].sha256 == d for n, d in (digest.spans or {}).items())


def _index_json(plan: RankFetchPlan) -> bytes:
    """``model.safetensors.index.json`` of the output: exactly the tensors present."""
    weight_map = {name: sp.path for sp in plan.shards for name in sp.names}
    total = sum(sp.tensor_bytes for sp in plan.shards)
    return json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                      indent=2).encode() + b"\n"


def _marker_json(plan: RankFetchPlan) -> bytes:
    doc = {
        "format": PARTIAL_FORMAT, "version": PARTIAL_VERSION, "source": plan.source_json(),
        "topology": plan.topology.to_json(), "ranks": plan.ranks, "node": plan.node,
        "gpus_per_node": plan.gpus_per_node,
        "experts": plan.experts,
        "tensors": plan.tensors, "verification": plan.verification,
        "manifest_sha256": plan.manifest.fingerprint() if plan.manifest is not None else None,
    }
    if plan.excluded:  # what --include/--exclude left out: verify does not call it missing
        doc["excluded"] = sorted(plan.excluded)
    # one key a line, each value on its line: readable and diffable, and short for the full K3
    return ("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items()) + "\n}\n").encode()


def run_rank_fetch(
    plan: RankFetchPlan,
    *,
    workers: int = 8,
    token: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    retry: RetryPolicy | None = None,
    check_space: bool = True,
) -> RankFetchResult:
    """Download ``plan`` into its destination: resumable, parallel, checked (see the module doc).

    Args:
        plan (`RankFetchPlan`): From :func:`plan_rank_fetch`.
        workers (`int`): Concurrent requests.
        token (`str`, *optional*): See :func:`k3ckpt.hubclient.auth_headers`.
        progress (`Callable[[int], None]`, *optional*): Called with body byte counts as they arrive
            (from worker threads).
        on_plan (`Callable[[int], None]`, *optional*): Called once with the bytes this run will
            download (complete shards, present files and journaled pieces excluded).
        retry (`RetryPolicy`, *optional*): Per-request retries; defaults to
            :data:`k3ckpt.download.FETCH_RETRY`.
        check_space (`bool`): Refuse to start when the filesystem has too little free space.

    Returns:
        `RankFetchResult`: ``ok`` only if everything selected is present and checked; the index
        and :data:`PARTIAL_NAME` are written only then.

    Raises:
        FetchLockedError: Another live fetch holds the destination's lock.
        DiskSpaceError: Not enough free space for the rewritten shards.
        KeyboardInterrupt: Passed through after the workers stopped; re-run to resume.
    """
    names = [sp.path for sp in plan.shards] + list(plan.files) + [PARTIAL_NAME, INDEX_NAME]
    with fetch_run(plan, workers, retry, names) as (result, dest_real, policy):
        if os.path.isfile(os.path.join(dest_real, INDEX_NAME)) and not os.path.lexists(os.path.join(dest_real, PARTIAL_NAME)):
            # an index without our marker: a whole checkpoint (or another tool's), whose shards
            # this run would replace with subsets
            raise RankFetchError(f"{dest_real} holds a checkpoint that is not a rank-aware fetch ({INDEX_NAME} and no "
                                 f"{PARTIAL_NAME}); its shards would be replaced by subsets: fetch into another --dest")
        # Until this run succeeds the destination must not look like a complete checkpoint.
        for name in (PARTIAL_NAME, INDEX_NAME):
            _dest.unlink(os.path.join(dest_real, name))
        record = load_shard_record(dest_real)
        jobs, _ = open_jobs(dest_real, (sp for sp in plan.shards if not sp.whole),
                            lambda sp, final: _complete(sp, final, plan.manifest, record.get(sp.path)), result, workers)
        fetch_outputs(plan, result, dest_real, jobs, plan.files + [sp.path for sp in plan.shards if sp.whole],
                      "rewritten shard(s)", workers=workers, token=token, progress=progress, on_plan=on_plan,
                      policy=policy, check_space=check_space)
        if result.ok:
            write_atomic(os.path.join(dest_real, INDEX_NAME), _index_json(plan))
            write_atomic(os.path.join(dest_real, PARTIAL_NAME), _marker_json(plan))
            try:
                record_source(dest_real, plan.listing)
            except OSError:
                pass  # provenance only: the marker names the source revision too
    return result


# ---------------------------------------------------------------------------------------------
# Rendering (``k3ckpt fetch`` with --ranks or --node)


def _selection_text(plan: RankFetchPlan) -> str:
    t = plan.topology
    return (f"rank{'s' if len(plan.ranks) > 1 else ''} {format_ranges(plan.ranks)} of ep {t.ep} x tp {t.tp} "
            f"(world size {t.world_size}, {t.placement} placement)")


def render_rank_fetch_plan(plan: RankFetchPlan) -> str:
    """What a dry run prints: per shard the bytes to fetch and how, the other files, the total."""
    lines = []
    for sp in plan.shards:
        how = ("whole" if sp.whole else
               f"{len(sp.names)} of {sp.source_tensors} tensors, {len(sp.pieces)} request{'s' if len(sp.pieces) != 1 else ''}")
        lines.append(f"{human_bytes(sp.download_bytes):>10} of {human_bytes(sp.source.size):>10}  {sp.path}  ({how})")
    for f in plan.files:
        lines.append(f"{human_bytes(plan.listing.files[f].size):>10}{'':14}  {f}")
    lines += dry_run_total(plan, _selection_text(plan),
                           f"{len(plan.shards)} shards ({sum(not s.whole for s in plan.shards)} rewritten)")
    return "\n".join(lines)


def render_rank_fetch(plan: RankFetchPlan, res: RankFetchResult, *, verbose: bool = False) -> str:
    """The summary of a rank-aware fetch; ``verbose`` names every file first."""
    return fetch_summary(res, source=source_text(plan.listing), dest=plan.dest, selection=_selection_text(plan),
                         written="shards rewritten", wrote_note=" (selected tensors)", whole="the selection",
                         bytes_total=plan.bytes_total, source_bytes=plan.source_bytes,
                         manifest=plan.manifest is not None, verbose=verbose)


def rank_fetch_json(plan: RankFetchPlan, res: RankFetchResult) -> dict[str, Any]:
    """``fetch --json``'s document: the result with the source, the ranks and the topology."""
    d = res.to_json()
    d.update(hub=plan.listing.hub, repo=plan.listing.repo, revision=plan.listing.revision, ranks=plan.ranks,
             topology=plan.topology.to_json(), source_bytes=plan.source_bytes)
    return d
