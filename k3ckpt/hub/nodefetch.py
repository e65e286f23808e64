"""Node fetch: ``k3ckpt fetch --node N --gpus-per-node G`` writes node N's directory straight
from the hub - the same directory ``k3ckpt reshard`` writes as ``OUT/node-0000N/``.

Both producers follow one plan, :func:`k3ckpt.format.nodedir.plan_node_dir`: it fixes every
file's name, header bytes and tensor offsets, the index and the marker. ``reshard`` copies each
tensor from a local shard; this module fetches it by HTTP Range from the hub's shard (source
offset = the shard's data start + the tensor's begin) into its planned offset. So a node goes
from hub to servable in one command, without a second write of the whole checkpoint.

What is written, in order:

- every planned file (dense files, then each rank's expert files) as a ``.part``: the planned
  header first, then the tensors' bytes. Tensors adjacent in one source shard *and* in the
  output are coalesced into one request of at most ``chunk_size`` bytes, never across source
  shards (:func:`k3ckpt.hub._pieces.pieces_and_tasks`). Journaling, resume and retries are
  the rank-aware fetch's (:mod:`k3ckpt.hub._pieces`, :mod:`k3ckpt.hub._workers`); with
  ``--manifest`` every tensor's sha256 is checked while it streams;
- each tensor's sha256 (the marker records them, as ``reshard``'s does) is computed from the
  bytes as they are received and written, by the task that receives them, in whatever order
  tasks complete - never by reading the finished file back. The file's digest is built from
  them and its planned header (:func:`k3ckpt.format.filedigest.segments_sha256`), so every byte is
  hashed once. With a manifest each task's tensors match it before the task is journaled, so
  only verified bytes get the final name. The digests are kept in :data:`DIGEST_DIR` so a
  resumed run need not read complete files again;
- the non-weight files (config, tokenizer, licence, code), fetched whole and checked against
  the hub's sha256 by the downloader;
- ``model.safetensors.index.json``, ``k3ckpt-node.json`` and ``READY``, in that order, only
  when everything else succeeded: the bytes :meth:`NodeDir.index_bytes` and
  :meth:`NodeDir.marker_bytes` give every producer (``source_index_sha256`` is the sha256 of
  the hub's index file, which is the local index ``reshard`` hashes).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import K3ckptError, RankFetchError
from ..format.checkpoint import INDEX_NAME, SINGLE_NAME, bulk_allocation
from ..format.filedigest import SEGMENTS_KEY, recorded_digest
from ..format.header import read_header
from ..format.layout import NODE_MARKER, PARTIAL_MARKER, READY_NAME
from ..format.nodedir import NODE_ALIGN, NODE_MAX_FILE_SIZE, NodeDir, NodeFile, plan_node_dir
from ..format.roles import classify
from ..format.topology import RankSelection, Topology, build_index, fp8_block_of, ranks_of_node
from ..integrity.hashing import HashError, Span, hash_file
from ..integrity.manifest import Manifest
from ..integrity.segments import hash_segments
from ..integrity.share import share_reference_key
from ..integrity.statcache import StatCache, record_written
from ..utils import format_ranges, human_bytes, write_atomic
from . import _dest, download
from . import client as hubclient
from ._pieces import OutputJob, Piece, PieceFailed, Task, looks_complete, pieces_and_tasks, tensor_spans
from ._remote import check_manifest, check_manifest_files, load_manifest, other_files, read_source
from ._result import VERIFIED_STRUCTURE, VERIFIED_TENSORS, RankFetchResult, dry_run_total, fetch_summary
from ._workers import fetch_outputs, fetch_run, open_jobs
from .client import HubFile, HubListing, RetryPolicy, default_requests
from .fetch import LISTING_RECORD, OfflineCheck, hub_origin, manifest_origin, record_source, source_text, write_fetch_record

__all__ = [
    "DIGEST_DIR",
    "NodeFetchPlan",
    "NodeFilePlan",
    "check_node_offline",
    "node_fetch_json",
    "plan_node_fetch",
    "render_node_fetch",
    "render_node_fetch_plan",
    "run_node_fetch",
]

#: Per output file, the sha256 of its tensors, with the content key they were computed for:
#: ``<DIGEST_DIR>/<file>.json``. The marker needs them (the file's digest is built from them);
#: without them a resumed run would read every complete file again. Hidden, like every working
#: record of a fetch.
DIGEST_DIR = ".cache/k3ckpt/node-digests"


@dataclass
class NodeFilePlan:
    """One planned file of the node directory and the Range requests that fill it.

    Attributes:
        path: The file's name (:class:`~k3ckpt.format.nodedir.NodeFile`'s).
        rank: Whose experts it holds (None: dense tensors).
        sources: The hub entries of the source shards its tensors come from, by path.
        names: Its tensors, in file order.
        prefix: Its header bytes, as planned.
        size: Its size.
        tensor_bytes: Bytes of its tensors' data.
        pieces, tasks: The ranged GETs and their hashing units (see :class:`~k3ckpt.hub._pieces.Task`).
    """

    path: str
    rank: int | None
    sources: dict[str, HubFile]
    names: list[str]
    prefix: bytes
    size: int
    tensor_bytes: int
    pieces: list[Piece] = field(default_factory=list)
    tasks: list[Task] = field(default_factory=list)

    def source_of(self, piece: Piece) -> HubFile:
        return self.sources[piece.file]

    def _sources_json(self) -> bytes:
        return json.dumps([[p, f.size, f.sha256, f.git_sha1] for p, f in sorted(self.sources.items())]).encode()

    def content_key(self) -> str:
        """Identifies the file's content: its sources (path, size, digests), its header and where
        each byte comes from. A new hub revision changes a source digest, so a file written from
        the old one is not kept."""
        h = hashlib.sha256(self.path.encode() + b"\0" + self._sources_json())
        h.update(self.prefix)
        h.update(json.dumps([[p.file, p.src, p.length] for p in self.pieces]).encode())
        return h.hexdigest()

    def fingerprint(self) -> str:
        """Identifies the exact ``.part`` (content and request layout: a journal of another
        chunk size is never adopted)."""
        h = hashlib.sha256(self.content_key().encode())
        h.update(json.dumps([[p.file, p.src, p.dst, p.length] for p in self.pieces]).encode())
        return h.hexdigest()

    def spans(self) -> list[Span]:
        """Each tensor's absolute ``[start, stop)`` in the file."""
        return tensor_spans(self)


def plan_file(f: NodeFile, sources: dict[str, HubFile], data_start: dict[str, int], chunk_size: int) -> NodeFilePlan:
    """The requests that fill the planned file ``f``: each tensor's bytes from its source shard
    (``data_start`` of its shard + its begin) to ``len(prefix)`` + its planned offset."""
    base = len(f.prefix)
    spans = [(t.name, t.file, data_start[t.file] + t.begin, base + b, base + e) for t, (b, e) in zip(f.tensors, f.offsets)]
    pieces, tasks = pieces_and_tasks(spans, chunk_size)
    used = {t.file for t in f.tensors}
    return NodeFilePlan(f.name, f.rank, {p: sources[p] for p in sorted(used)}, [t.name for t in f.tensors], f.prefix,
                        f.size, sum(t.nbytes for t in f.tensors), pieces, tasks)


@dataclass
class NodeFetchPlan:
    """Everything a node fetch will do, decided from hub metadata and headers alone.

    Attributes:
        listing: The hub listing (pinned to the resolved commit).
        dest: Destination directory (the node directory itself).
        nd: The node directory's plan (files, index, marker).
        outputs: One request plan per planned file, in the plan's order.
        files: Non-weight files fetched whole; excluded: those ``--include``/``--exclude`` left out.
        chunk_size: Largest ranged GET.
        header_bytes: Bytes read to plan (every shard's header).
        source_bytes: Bytes a full fetch would move.
        source_index_sha256: What the marker records as ``source_index_sha256``.
        manifest, manifest_label: The tensor-hash manifest to verify against, if any.
        revision: The revision as requested (None: the hub's default branch), for the record an
            offline re-run checks against.
    """

    listing: HubListing
    dest: Path
    nd: NodeDir
    outputs: list[NodeFilePlan]
    files: list[str]
    excluded: list[str]
    chunk_size: int
    header_bytes: int
    source_bytes: int
    source_index_sha256: str
    manifest: Manifest | None = None
    manifest_label: str | None = None
    revision: str | None = None

    @property
    def topology(self) -> Topology:
        return self.nd.topology

    @property
    def tensors(self) -> int:
        return sum(len(o.names) for o in self.outputs)

    @property
    def bytes_total(self) -> int:
        """Bytes the fetch moves when nothing is present yet (planning headers excluded)."""
        return sum(o.tensor_bytes for o in self.outputs) + sum(self.listing.files[f].size for f in self.files)

    @property
    def verification(self) -> str:
        return VERIFIED_TENSORS if self.manifest is not None else VERIFIED_STRUCTURE

    def to_json(self) -> dict[str, Any]:
        """The ``--dry-run --json`` output."""
        return {
            "hub": self.listing.hub, "repo": self.listing.repo, "revision": self.listing.revision,
            "dest": str(self.dest), "format": "node", "topology": self.topology.to_json(), "dp": self.topology.dp,
            "node": self.nd.node, "gpus_per_node": self.nd.gpus_per_node, "ranks": list(self.nd.ranks),
            "experts": self.nd.experts,
            "node_files": {o.path: {"rank": o.rank, "tensors": len(o.names), "size": o.size, "bytes": o.tensor_bytes,
                                    "sources": sorted(o.sources), "requests": len(o.pieces)} for o in self.outputs},
            "files": {f: self.listing.files[f].size for f in self.files}, "excluded": self.excluded,
            "bytes_total": self.bytes_total, "source_bytes": self.source_bytes, "header_bytes": self.header_bytes,
            "tensors": self.tensors, "verification": self.verification,
        }


def plan_node_fetch(
    hub: str,
    repo: str,
    dest: str | os.PathLike[str],
    selection: RankSelection,
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    manifest: Manifest | str | os.PathLike[str] | None = None,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    chunk_size: int = download.DEFAULT_CHUNK,
    max_file_size: int = NODE_MAX_FILE_SIZE,
    jobs: int = 8,
) -> NodeFetchPlan:
    """Plan node ``selection.node``'s directory from the hub's headers (no tensor data): the
    topology in vLLM's expert-parallel reading (``ep = tp x dp``, as ``reshard``'s node format),
    :func:`~k3ckpt.format.nodedir.plan_node_dir` with ``reshard``'s defaults, and the requests.

    Raises:
        RankFetchError: No checkpoint, headers that disagree with the index, a manifest of other
            headers, experts the hub's checkpoint lacks.
        TopologyError: An impossible topology, or one the engine format refuses.
    """
    if chunk_size < 1:
        raise RankFetchError(f"chunk size {chunk_size} must be positive")
    if selection.node is None or selection.ranks is not None:
        raise RankFetchError("the node format writes whole nodes: give --node N (--format partial for --ranks)")
    selection.check(engine=True)  # before any request: a selection that means nothing must not cost a byte
    marked = frozenset({NODE_MARKER, READY_NAME})  # the node directory's own files, written by this fetch
    manifest, label = load_manifest(manifest)
    src = read_source(hub, repo, revision, endpoint=endpoint, token=token, jobs=jobs,
                      on_listing=lambda listing: other_files(listing, include, exclude, skip=marked))
    listing = src.listing
    with bulk_allocation():  # ~10^6 fresh acyclic tuples at the full K3 scale
        # classified once for both: the index and the sorting of the node's experts
        roles = dict(zip(src.tensors, map(classify, src.tensors)))
        idx = build_index(src.tensors, roles, fp8_block=fp8_block_of(src.config))
        topo = selection.topology_for(idx, src.config, engine=True)
        # without --gpus-per-node one node holds the whole world, as reshard reads it
        gpn = selection.gpus_per_node if selection.gpus_per_node is not None else topo.world_size
        nd = plan_node_dir(src.tensors, topo, selection.node, gpn, max_file_size=max_file_size, roles=roles,
                           index=idx, align=NODE_ALIGN)
        _require_experts(listing, idx.expert_names, nd)
        wanted = {t.name for f in nd.files for t in f.tensors}
        if manifest is not None:
            check_manifest(manifest, label or "(given)", src.headers, wanted, listing)
        starts = {h.file: h.data_start for h in src.headers}
        outputs = [plan_file(f, {p: listing.files[p] for p in starts}, starts, chunk_size) for f in nd.files]
    files, excluded = other_files(listing, include, exclude, skip=marked | frozenset(src.shard_paths))
    if manifest is not None:
        check_manifest_files(manifest, label or "(given)", listing, files)
    index_sha = src.index_sha256 or _single_header_sha(listing, src.headers[0].data_start, token)
    return NodeFetchPlan(
        listing=listing, dest=Path(dest), nd=nd, outputs=outputs, files=files, excluded=excluded,
        chunk_size=chunk_size, header_bytes=sum(h.data_start for h in src.headers),
        source_bytes=sum(listing.files[p].size for p in src.shard_paths + files + excluded
                         + ([INDEX_NAME] if src.weight_map else [])),
        source_index_sha256=index_sha, manifest=manifest, manifest_label=label, revision=revision)


def _single_header_sha(listing: HubListing, data_start: int, token: str | None) -> str:
    """A single-file checkpoint has no index: ``reshard`` records the sha256 of its header
    prefix instead, so this does too."""
    return hashlib.sha256(hubclient.read_range(listing, SINGLE_NAME, 0, data_start, token=token)).hexdigest()


def _require_experts(listing: HubListing, expert_names: dict[int, Any], nd: NodeDir) -> None:
    """Refuse a node whose routed experts the hub's checkpoint lacks entirely (a partial
    checkpoint uploaded as a repo), as ``reshard`` refuses it, rather than write it without."""
    if not expert_names:
        return  # a dense model, or gpt-oss stacked experts
    missing = [e for e in nd.experts if e not in expert_names]
    if missing:
        raise RankFetchError(f"{listing.hub}:{listing.repo}@{listing.revision}: node {nd.node} needs routed experts "
                             f"{format_ranges(missing)}, which this checkpoint does not hold")


# ---------------------------------------------------------------------------------------------
# Running


def _digest_path(dest_real: str, name: str) -> Path:
    return Path(dest_real, DIGEST_DIR, name + ".json")


def _read_back(op: NodeFilePlan, path: str, manifest: Manifest | None) -> dict[str, Any]:
    """The sha256 of each tensor of the file at ``path`` (whose header is the planned one), in one
    read of their bytes; with a manifest every tensor digest must match it.

    Raises:
        PieceFailed: unreadable, or a tensor whose bytes are not the manifest's.
    """
    try:
        d = hash_file(path, spans=op.spans(), whole=False)
    except (HashError, OSError) as e:
        raise PieceFailed(f"{path}: cannot hash it: {e}") from None
    tensors = dict(d.spans or {})
    for name in op.names:  # zero-byte tensors: no span bytes, the empty digest
        tensors.setdefault(name, hashlib.sha256().hexdigest())
    if manifest is not None:
        bad = next((n for n in op.names if manifest.tensors[n].sha256 != tensors[n]), None)
        if bad is not None:
            raise PieceFailed(f"tensor {bad!r}: sha256 {tensors[bad]} on disk but the manifest says "
                              f"{manifest.tensors[bad].sha256}")
    return {"key": op.content_key(), "tensors": tensors}


def _complete(op: NodeFilePlan, final: str, manifest: Manifest | None, dest_real: str) -> dict[str, Any] | None:
    """The digests of ``final`` if it already is this file - size and header bytes, then with a
    manifest every tensor's sha256 (read locally), without one the digest record written for this
    very content - else None."""
    if not looks_complete(op, final):
        return None
    if manifest is not None:
        try:
            return _read_back(op, final, manifest)
        except PieceFailed:
            return None
    try:
        rec = json.loads(_digest_path(dest_real, op.path).read_bytes())
    except (OSError, ValueError):
        return None
    ok = (isinstance(rec, dict) and rec.get("key") == op.content_key()
          and isinstance(rec.get("tensors"), dict) and set(rec["tensors"]) == set(op.names)
          and all(isinstance(d, str) for d in rec["tensors"].values()))
    return rec if ok else None


def _prepare_dest(dest_real: str, plan: NodeFetchPlan) -> None:
    """Refuse a destination holding another kind of checkpoint; then make sure it cannot look
    complete until this run succeeds (READY first), and remove the files of an earlier node
    fetch of another plan (another topology or node), which the new index would not name."""
    has_index = os.path.isfile(os.path.join(dest_real, INDEX_NAME))
    if os.path.lexists(os.path.join(dest_real, PARTIAL_MARKER)) or (
            has_index and not os.path.lexists(os.path.join(dest_real, NODE_MARKER))):
        raise RankFetchError(f"{dest_real} holds a checkpoint that is not a node directory ({INDEX_NAME} without "
                             f"{NODE_MARKER}, or a {PARTIAL_MARKER}); fetch into another --local-dir")
    planned = {o.path for o in plan.outputs}
    try:
        old = json.loads(Path(dest_real, NODE_MARKER).read_bytes()).get("files", {})
    except (OSError, ValueError, AttributeError):
        old = {}
    for name in (READY_NAME, NODE_MARKER, INDEX_NAME):
        _dest.unlink(os.path.join(dest_real, name))
    for name in old if isinstance(old, dict) else ():
        if isinstance(name, str) and name not in planned and name.endswith(".safetensors") and "/" not in name:
            _dest.unlink(os.path.join(dest_real, name))


def run_node_fetch(
    plan: NodeFetchPlan,
    *,
    workers: int | None = None,
    token: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    retry: RetryPolicy | None = None,
    check_space: bool = True,
) -> RankFetchResult:
    """Write ``plan``'s node directory into its destination: resumable, parallel, checked (see
    the module doc). Arguments as :func:`k3ckpt.hub.rankfetch.run_rank_fetch`.

    Returns:
        `RankFetchResult`: ``ok`` only if every file is present and checked; the index, the
        marker and ``READY`` are written only then.

    Raises:
        FetchLockedError: Another live fetch holds the destination's lock.
        DiskSpaceError: Not enough free space.
        RankFetchError: The destination holds another kind of checkpoint.
    """
    names = [o.path for o in plan.outputs] + list(plan.files) + [NODE_MARKER, INDEX_NAME, READY_NAME]
    workers = default_requests() if workers is None else workers
    with fetch_run(plan, workers, retry, names) as (result, dest_real, policy):
        _prepare_dest(dest_real, plan)
        # what an offline re-run checks the non-weight files against (the marker has the rest)
        write_fetch_record(Path(dest_real, LISTING_RECORD), plan.listing, plan.revision, plan.files, layout="node")
        digests = _fetch_node_files(plan, result, dest_real, workers, token, progress, on_plan, policy, check_space)
        if result.ok:
            _finish_node(plan, dest_real, digests)
    return result


def _fetch_node_files(plan: NodeFetchPlan, result: RankFetchResult, dest_real: str, workers: int, token: str | None,
                      progress: Callable[[int], None] | None, on_plan: Callable[[int], None] | None,
                      policy: RetryPolicy, check_space: bool) -> dict[str, dict[str, Any]]:
    """Fetch the planned files and the non-weight files into ``dest_real``, recording failures in
    ``result``; returns the digests of every planned file present and checked."""
    jobs, digests = open_jobs(dest_real, plan.outputs, lambda op, final: _complete(op, final, plan.manifest, dest_real),
                              result, workers)

    def before_rename(job: OutputJob, tensors: dict[str, str] | None) -> None:
        # the marker's digests, computed from the bytes as they were written (each tensor's
        # matched the manifest, where there is one, before its task was journaled)
        op = job.plan
        assert isinstance(op, NodeFilePlan) and tensors is not None
        for name in op.names:  # zero-byte tensors: no bytes, the empty digest
            tensors.setdefault(name, hashlib.sha256().hexdigest())
        rec = {"key": op.content_key(), "tensors": {n: tensors[n] for n in op.names}}
        path = _digest_path(dest_real, op.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(rec).encode())
        digests[op.path] = rec

    fetch_outputs(plan, result, dest_real, jobs, plan.files, "node file(s)", workers=workers, token=token,
                  progress=progress, on_plan=on_plan, policy=policy, check_space=check_space,
                  before_rename=before_rename, stream_digests=True)
    return digests


def _finish_node(plan: NodeFetchPlan, dest_real: str, digests: dict[str, dict[str, Any]]) -> None:
    """The index, the marker, then READY (as ``reshard`` finishes a node), each durable."""
    tensor_sha = {name: d for rec in digests.values() for name, d in rec["tensors"].items()}
    segments = plan.nd.segments_sha256(tensor_sha)
    file_digests = {name: (SEGMENTS_KEY, d) for name, d in segments.items()}
    write_atomic(os.path.join(dest_real, INDEX_NAME), plan.nd.index_bytes())
    write_atomic(os.path.join(dest_real, NODE_MARKER),
                 plan.nd.marker_bytes(plan.source_index_sha256, tensor_sha, plan.excluded, file_digests=segments))
    write_atomic(os.path.join(dest_real, READY_NAME), b"")
    try:
        record_source(dest_real, plan.listing)
    except OSError:
        pass  # provenance only
    origin = manifest_origin(plan.manifest_label) if plan.manifest is not None else None
    record_proofs(dest_real, file_digests, len(tensor_sha), origin, plan.listing, plan.files)


def record_proofs(dest_real: str, file_digests: dict[str, tuple[str, str]], tensors: int, origin: str | None,
                  listing: HubListing, whole: list[str]) -> None:
    """Tell the directory's stat cache what proved its bytes (docs/trust.md): the files fetched
    whole (``whole``), the hub's sha256 in ``listing``; the node files (``file_digests``: name ->
    the marker's ``(key, digest)``, :func:`~k3ckpt.format.filedigest.recorded_digest`; holding
    ``tensors`` tensors), ``origin`` - the tensor-hash manifest every tensor was checked against
    - or nothing, without one (their structure and sizes only). After a fetch, and after an
    offline check that hashed them."""
    key = share_reference_key(tensors)
    entries: dict[str, dict[str, Any]] = {
        name: {kind: digest, "share_ref": key, "share_issues": [], "proven": origin}
        for name, (kind, digest) in file_digests.items()}
    files = listing.files
    entries.update({f: {"sha256": files[f].sha256, "git_sha1": files[f].git_sha1, "proven": hub_origin(listing)}
                    for f in whole if f in files})
    record_written(dest_real, entries)


# ---------------------------------------------------------------------------------------------
# Offline (``HF_HUB_OFFLINE=1 k3ckpt fetch --node``)


def check_node_offline(hub: str, repo: str, dest: str | os.PathLike[str], selection: RankSelection, *,
                       revision: str | None = None, manifest: Manifest | str | os.PathLike[str] | None = None,
                       include: tuple[str, ...] = (), exclude: tuple[str, ...] = (), jobs: int = 8) -> OfflineCheck:
    """Check, without contacting the hub, the node directory an earlier ``fetch --node`` wrote in
    ``dest`` for ``selection``: ``READY`` there, ``k3ckpt-node.json`` written for this very node
    and topology, every node file of its size and of the digest it records (trusted without a
    read while its stat is the one recorded right after k3ckpt hashed it, else hashed now), the
    index listing its tensors, the non-weight files of the sha256 the hub's listing gave (the
    record the fetch wrote before its first byte); with ``manifest`` the marker's tensor digests
    must be the manifest's. What a re-run online would skip, minus the hub.

    Returns:
        `OfflineCheck`: ``ok`` when all of it holds; else what is missing or damaged, by file.

    Raises:
        OfflineNoRecordError: No record of a node fetch of ``repo`` (at ``revision``) in
            ``dest``, or its marker is of another node or topology.
        TopologyError: ``selection`` means no topology (as online).
        ManifestError, RankFetchError: ``manifest`` unreadable, or without tensor hashes.
    """
    from concurrent.futures import ThreadPoolExecutor

    from . import _offline

    sc = _offline.start_check(hub, repo, Path(dest), revision, layout="node", marker_name=NODE_MARKER,
                              done_name=READY_NAME, marker_keys={"files": dict, "tensors": dict, "topology": dict},
                              selected=lambda m: (_requested_node(selection, m), _marker_node(m)),
                              other="another node", manifest=manifest, include=include, exclude=exclude, jobs=jobs)
    out, marker = sc.out, sc.marker
    if marker is None:
        return out
    if sc.manifest is None:
        out.unproven = (f"no --manifest: the node files were checked against the digests {NODE_MARKER} recorded when "
                        "they were written, from bytes checked for structure and sizes only (docs/trust.md); pass "
                        "--manifest to hash every tensor against a tensor-hash manifest")
    tensors_of: dict[str, dict[str, str | None]] = {}
    for name, t in marker["tensors"].items():
        if isinstance(t, dict):
            tensors_of.setdefault(str(t.get("file")), {})[name] = t.get("sha256")
    node_files = {n: f for n, f in marker["files"].items() if isinstance(f, dict)}
    real = os.path.realpath(out.dest)
    cache = StatCache(Path(real))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        found = list(pool.map(lambda n: _offline_node_file(real, n, node_files[n], tensors_of.get(n, {}), cache,
                                                           sc.manifest, sc.label), sorted(node_files)))
    for name, (why, trusted) in zip(sorted(node_files), found):
        if why is not None:
            out.failed[name] = why
        else:
            out.verified.append(name)
            if trusted:
                out.trusted.append(name)
    how = "every tensor hashed against the manifest" if sc.manifest is not None else (
        f"{len(out.trusted)} of them not read, unchanged since k3ckpt recorded their digests in the stat cache")
    out.detail = f"{len(node_files)} node files, {how}"
    index_why = _offline_index(out.dest, marker)
    if index_why is not None:
        out.failed[INDEX_NAME] = index_why
    sc.check_whole(jobs)
    if out.ok:
        origin = f"manifest {sc.label}" if sc.manifest is not None else None
        file_digests = {n: d for n in node_files if (d := recorded_digest(node_files[n])) is not None}
        record_proofs(real, file_digests, sum(map(len, tensors_of.values())), origin, sc.listing, sc.whole)
    return out


def _requested_node(selection: RankSelection, marker: dict[str, Any]) -> str:
    """The node ``selection`` names, over the marker's expert count, in the words of :func:`node_text`
    (the topology, placement and GPUs per node all show in it)."""
    selection.check(engine=True)
    topo = selection.topology(int(marker["topology"].get("num_experts") or 1), engine=True)
    gpn = selection.gpus_per_node if selection.gpus_per_node is not None else topo.world_size
    node = selection.node if selection.node is not None else 0
    return node_text(node, ranks_of_node(node, gpn, topo.world_size), topo.ep, topo.tp, topo.placement)


def _marker_node(marker: dict[str, Any]) -> str:
    t = marker["topology"]
    try:
        return node_text(int(marker["node"]), [int(r) for r in marker["ranks"]], int(t["ep"]), int(t["tp"]),
                         str(t["expert_placement"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return "a node directory whose marker names no topology"


def _offline_node_file(dest_real: str, name: str, want: dict[str, Any], tensors: dict[str, str | None],
                       cache: StatCache, manifest: Manifest | None, label: str) -> tuple[str | None, bool]:
    """``(why not, trusted)`` for the node file ``name`` against its marker entry ``want`` and
    its ``tensors`` (name -> the marker's sha256): a regular file of its size and of the digest
    the marker records (:func:`~k3ckpt.format.filedigest.recorded_digest`: its segments', or an older
    marker's plain sha256). With a manifest every tensor its header lists (exactly the marker's)
    is hashed against the manifest too; without one a file the stat cache holds with the marker's
    digest and its current stat is trusted without being read (``trusted``)."""
    path = os.path.join(dest_real, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing", False
    except OSError as e:
        return f"unreadable ({e.strerror or e})", False
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else ""), False
    if st.st_size != want.get("size"):
        return f"size {st.st_size} != {want.get('size')} in {NODE_MARKER}", False
    recorded = recorded_digest(want)
    if recorded is None:
        return f"{NODE_MARKER} records no digest for it", False
    kind, digest = recorded
    if manifest is None:
        hit = cache.lookup(name, st)
        if hit is not None and hit.get(kind) == digest:
            return None, True
    try:
        got, found = _node_file_digests(path, name, kind, tensors, manifest is not None)
    except (HashError, K3ckptError, OSError, ValueError) as e:
        return f"unreadable ({e})", False
    if found is None:
        return f"its header does not hold the tensors {NODE_MARKER} lists for it", False
    if got != digest and kind != SEGMENTS_KEY:
        return f"{kind} mismatch: {NODE_MARKER} records {digest}, found {got}", False
    for t in sorted(tensors) if manifest is not None or kind == SEGMENTS_KEY else ():
        sha = found.get(t, hashlib.sha256().hexdigest())  # a zero-byte tensor: no span bytes
        if tensors[t] != sha:
            return f"tensor {t!r}: sha256 {sha}, {NODE_MARKER} records {tensors[t]}", False
        if manifest is not None and ((m := manifest.tensors.get(t)) is None or m.sha256 != sha):
            return (f"tensor {t!r} is not in the manifest {label}" if m is None else
                    f"tensor {t!r}: sha256 {sha}, the manifest {label} says {m.sha256}"), False
    if got != digest:  # every tensor as recorded (the loop above names a changed one): the header differs
        return f"{kind} mismatch: {NODE_MARKER} records {digest}, found {got}", False
    return None, False


def _node_file_digests(path: str, name: str, kind: str, tensors: dict[str, str | None],
                       with_tensors: bool) -> tuple[str, dict[str, str] | None]:
    """The digest of kind ``kind`` of the node file at ``path`` and (by its segments, or when
    ``with_tensors``) its tensors' sha256 - ``None`` when its header holds other tensors than
    ``tensors`` - in one read."""
    if kind == SEGMENTS_KEY:
        seg = hash_segments(path, name)
        return seg.segments_sha256, seg.tensors if set(seg.tensors) == set(tensors) else None
    spans: list[Span] = []
    if with_tensors:
        header = read_header(path, name)
        if set(header.tensors) != set(tensors):
            return "", None
        spans = [Span(t, *header.absolute_range(t)) for t in header.tensors]
    d = hash_file(path, spans=spans)
    return d.sha256, dict(d.spans or {})


def _offline_index(dest: Path, marker: dict[str, Any]) -> str | None:
    """Why the index does not map the marker's tensors to their files, or None."""
    try:
        weight_map = json.loads((dest / INDEX_NAME).read_bytes()).get("weight_map")
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError, AttributeError) as e:
        return f"unreadable ({e})"
    want = {n: t.get("file") for n, t in marker["tensors"].items() if isinstance(t, dict)}
    return None if weight_map == want else f"does not list the tensors {NODE_MARKER} records, in their files"


# ---------------------------------------------------------------------------------------------
# Rendering (``k3ckpt fetch --node``)


def _selection_text(plan: NodeFetchPlan) -> str:
    t = plan.topology
    return node_text(plan.nd.node, list(plan.nd.ranks), t.ep, t.tp, t.placement)


def node_text(node: int, ranks: list[int], ep: int, tp: int, placement: str) -> str:
    """``node N (ranks A-B of ep E = tp T x dp D, P placement)``, as the summaries name a node."""
    return (f"node {node} (rank{'s' if len(ranks) > 1 else ''} {format_ranges(ranks)} of ep {ep} = "
            f"tp {tp} x dp {ep // tp}, {placement} placement)")


def render_node_fetch_plan(plan: NodeFetchPlan) -> str:
    """What a dry run prints: per node file its bytes, sources and requests; the other files; the total."""
    lines = []
    for o in plan.outputs:
        n = len(o.sources)
        lines.append(f"{human_bytes(o.tensor_bytes):>10}  {o.path}  ({len(o.names)} tensors from {n} shard"
                     f"{'s' if n != 1 else ''}, {len(o.pieces)} request{'s' if len(o.pieces) != 1 else ''})")
    for f in plan.files:
        lines.append(f"{human_bytes(plan.listing.files[f].size):>10}  {f}")
    lines += dry_run_total(plan, _selection_text(plan), f"{len(plan.outputs)} node files")
    return "\n".join(lines)


def render_node_fetch(plan: NodeFetchPlan, res: RankFetchResult, *, verbose: bool = False) -> str:
    """The summary of a node fetch; ``verbose`` names every file first."""
    return fetch_summary(res, source=source_text(plan.listing), dest=plan.dest, selection=_selection_text(plan),
                         written="node files written", wrote_note="", whole="the node", bytes_total=plan.bytes_total,
                         source_bytes=plan.source_bytes, manifest=plan.manifest is not None, verbose=verbose)


def node_fetch_json(plan: NodeFetchPlan, res: RankFetchResult) -> dict[str, Any]:
    """``fetch --json``'s document for a node fetch."""
    d = res.to_json()
    d.update(hub=plan.listing.hub, repo=plan.listing.repo, revision=plan.listing.revision, format="node",
             node=plan.nd.node, ranks=list(plan.nd.ranks), topology=plan.topology.to_json(),
             source_bytes=plan.source_bytes)
    return d

