"""Rank-aware fetch: download only the tensors that some ranks of a TP/EP topology need.

This module writes ``--format partial`` (the hub's shards, each with only the selected tensors)
and holds the download machinery (pieces, tasks, journals, workers) that
:mod:`k3ckpt.hub.nodefetch` shares to write ``--format node`` (``reshard``'s node directory).

``k3ckpt fetch --ep 8 --tp 2 --node 0 --gpus-per-node 4`` reads the config, the index and every
shard's header with Range requests (about 60 MB for the full K3), works out with
:func:`k3ckpt.topology.tensors_for_ranks` which tensors the selected ranks hold, and downloads
only their byte ranges. A node of an 8-way expert-parallel deployment so stores about 1/8 of the
routed experts instead of 1.56 TB. Tensors are fetched *whole* (``reshard`` slices the dense
ones later); the saving is the routed experts these ranks do not own.

Output: a plain local-dir checkpoint of the selected tensors that ``reshard`` and ``verify``
accept:

- every source shard holding a selected tensor keeps its file name. If it holds only selected
  tensors it is downloaded whole by :func:`k3ckpt.download.fetch_files` (so the hub's sha256
  verifies it); otherwise it is rewritten as a valid safetensors file holding just the
  selected tensors: a new header (the source's ``__metadata__``, the source's tensor order,
  offsets recomputed back to back, data buffer 8-byte aligned as
  :func:`~k3ckpt.safetensors_header.build_header` pads) followed by the tensors' bytes;
- ``model.safetensors.index.json`` lists exactly the tensors present, ``metadata.total_size``
  their bytes;
- every non-weight file (config, tokenizer, LICENSE, code) is fetched whole, as a full fetch
  does (``--include``/``--exclude`` filter these);
- ``k3ckpt-partial.json`` (:data:`PARTIAL_NAME`), written last, says what was selected:
  source, topology, ranks, ``experts`` (the routed experts every MoE layer holds, as in the
  ``k3ckpt-node.json`` of ``reshard --format hf-node``) and how the bytes were verified.
  ``verify`` requires only those experts; a later run can tell a partial checkpoint from a
  broken one. Its presence means the run completed.

How bytes move. Tensors adjacent in the source (an expert's six tensors; a rank's run of
experts) are coalesced into one Range request of at most ``chunk_size`` bytes, so requests are
parallel and a crash loses little; a tensor larger than a chunk gets a sequence of requests.
Each response streams into a preallocated ``<shard>.part`` at the tensor's *new* offset
(the package's streaming code, shared with the downloader: its response checks and retry rules).
Requests are grouped into *tasks*, the unit of hashing: one request of whole tensors, or the
requests of one large tensor, fetched in order by one worker.

Verification. The hub's sha256 covers whole files, so a rewritten shard cannot be checked
against it. With a tensor-hash manifest (``k3ckpt manifest pull|build --tensor-hashes``) each
tensor is hashed while its bytes stream in (no second read) and compared with the manifest; a
mismatch re-fetches that task once, then fails the shard naming the tensor. The manifest must
describe the hub's headers exactly (file, dtype, shape, offsets) or the run is refused before
any byte moves. Without a manifest only structure (the header written) and sizes are checked,
and the result says so.

Crash safety (SIGKILL at any moment) follows the downloader's design: the ``.part`` is
preallocated and its new header written and ``fsync``-ed before a journal
(``<shard>.part.journal``) exists; a request's bytes are ``fdatasync``-ed before its index is
added to the journal (rewritten atomically); the journal records a fingerprint of the exact
selection (source file, new header, request layout), so a journal of another selection or
chunk size is discarded. A task whose every request is journaled was verified (its last
request is journaled only after the tensor hashes matched); a large tensor's earlier requests
are re-read from the ``.part`` on resume to rebuild its hash. A complete ``.part`` is checked
(size, header bytes) and renamed into place; the index and the marker are removed at the start
of a run and written only when everything succeeded. The destination lock is the downloader's.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError, K3ckptError, RankFetchError
from ..format.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, bulk_allocation
from ..format.config import ModelConfig, parse_config
from ..format.header import ShardHeader, TensorInfo, TensorSpec, build_header, parse_header_bytes
from ..format.layout import PARTIAL_MARKER
from ..format.topology import RankSelection, Topology, build_index, fp8_block_of, tensors_for_ranks
from ..integrity.hashing import HashError, Span, hash_file
from ..integrity.manifest import Manifest, tensors_from_headers
from ..utils import format_ranges, fsync_dir, human_bytes, write_atomic
from ..utils.space import require_free_space
from . import _dest, _http, _transfer, download
from . import client as hubclient
from .client import HubFile, HubListing, RetryPolicy
from .fetch import record_source, select_paths, source_text

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
#: ``verification`` values of the result and the marker: every rewritten shard's tensors were
#: checked against a manifest; or only their structure and sizes; or no shard was rewritten (every
#: file was checked against the hub's sha256).
VERIFIED_TENSORS = "tensor-sha256"
VERIFIED_STRUCTURE = "structure-and-sizes"
VERIFIED_FILES = "file-sha256"
#: Said plainly whenever no manifest was given.
STRUCTURE_ONLY_NOTE = ("no --manifest: the files assembled from tensors were checked for structure and sizes only (the hub's "
                       "sha256 covers whole files); pass a tensor-hash manifest (k3ckpt manifest pull "
                       "--tensor-hashes, before the download, or manifest build --tensor-hashes) to verify every tensor")

_JOURNAL_VERSION = 1
_READ_BACK = 1 << 20  # bytes per pread when re-hashing a resumed large tensor


# ---------------------------------------------------------------------------------------------
# Planning: which bytes go where


@dataclass(frozen=True)
class Piece:
    """One ranged GET: ``length`` bytes at absolute offset ``src`` of the source shard, written
    at absolute offset ``dst`` of the output file. ``file``: the source shard's path when the
    output gathers from several (a node directory's files); empty when the output has one source
    (a rewritten shard), so a rewritten shard's fingerprint is what it always was."""

    src: int
    dst: int
    length: int
    file: str = ""


@dataclass(frozen=True)
class Task:
    """The unit of hashing: whole tensors adjacent in the source fetched by one piece, or one
    tensor larger than a chunk fetched by several pieces in order.

    Attributes:
        tensors: ``(name, start, stop)`` of each tensor, absolute offsets in the output shard.
        pieces: Indices into :attr:`ShardPlan.pieces`, in output order.
    """

    tensors: tuple[tuple[str, int, int], ...]
    pieces: tuple[int, ...]


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


class OutputPlan(Protocol):
    """What the download machinery needs of an output file: a rewritten shard
    (:class:`ShardPlan`) or a node directory's file (:class:`k3ckpt.hub.nodefetch.NodeFilePlan`)."""

    path: str
    names: list[str]
    prefix: bytes
    size: int
    pieces: list[Piece]
    tasks: list[Task]

    def fingerprint(self) -> str: ...

    def content_key(self) -> str: ...

    def source_of(self, piece: Piece) -> HubFile: ...


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
    pieces, tasks = _pieces_and_tasks(spans, chunk_size)
    size = base + (offsets[-1][1] if offsets else 0)
    return ShardPlan(source.path, source, len(header.tensors), [t.name for t in kept], prefix, size, nbytes, False,
                     pieces, tasks)


#: ``(name, source file, src_start, dst_start, dst_stop)`` of one tensor to fetch.
Span5 = tuple[str, str, int, int, int]


def _pieces_and_tasks(spans: list[Span5], chunk_size: int) -> tuple[list[Piece], list[Task]]:
    """Coalesce ``(name, file, src_start, dst_start, dst_stop)`` spans (in output order) into
    pieces of at most ``chunk_size`` bytes and group them into tasks (see :class:`Task`). Spans
    are coalesced only when adjacent in the same source file *and* in the output: one Range
    request reads one file."""
    pieces: list[Piece] = []
    tasks: list[Task] = []
    group: list[Span5] = []

    def flush() -> None:
        if not group:
            return
        file, src, dst, stop = group[0][1], group[0][2], group[0][3], group[-1][4]
        ids: tuple[int, ...] = ()
        if stop > dst:  # a group of zero-byte tensors needs no request
            pieces.append(Piece(src, dst, stop - dst, file))
            ids = (len(pieces) - 1,)
        tasks.append(Task(tuple((n, b, e) for n, _, _, b, e in group), ids))
        group.clear()

    for span in spans:
        name, file, src, dst, stop = span
        nbytes = stop - dst
        if nbytes > chunk_size:
            flush()
            first = len(pieces)
            pieces.extend(Piece(src + off, dst + off, min(chunk_size, nbytes - off), file)
                          for off in range(0, nbytes, chunk_size))
            tasks.append(Task(((name, dst, stop),), tuple(range(first, len(pieces)))))
            continue
        if group:
            last = group[-1]
            adjacent = last[1] == file and last[2] + (last[4] - last[3]) == src and last[4] == dst
            if not adjacent or stop - group[0][3] > chunk_size:
                flush()
        group.append(span)
    flush()
    return pieces, tasks


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


def _read_small(listing: HubListing, path: str, token: str | None) -> bytes:
    return hubclient.read_range(listing, path, 0, listing.files[path].size, token=token)


def _label(listing: HubListing, path: str) -> str:
    return f"{listing.hub}:{listing.repo}@{listing.revision}/{path}"


def _remote_index(listing: HubListing, token: str | None) -> tuple[dict[str, str] | None, list[str], str | None]:
    """``(weight_map, shard paths, index sha256)`` from the repo's index, or its single file."""
    if INDEX_NAME not in listing.files:
        if SINGLE_NAME in listing.files:
            return None, [SINGLE_NAME], None
        raise RankFetchError(f"{listing.hub}:{listing.repo}@{listing.revision}: no {INDEX_NAME} and no {SINGLE_NAME}; "
                             "is this a safetensors checkpoint?")
    raw = _read_small(listing, INDEX_NAME, token)
    where = _label(listing, INDEX_NAME)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RankFetchError(f"{where}: not valid JSON ({e})") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
        raise RankFetchError(f"{where}: no weight_map of tensor names to file names")
    shards = sorted(set(wm.values()))
    for f in shards:
        if f not in listing.files:
            raise RankFetchError(f"{where}: names the shard {f!r}, which the repo does not have")
    return wm, shards, hashlib.sha256(raw).hexdigest()


def _remote_config(listing: HubListing, token: str | None) -> ModelConfig | None:
    if CONFIG_NAME not in listing.files:
        return None
    where = _label(listing, CONFIG_NAME)
    try:
        raw = json.loads(_read_small(listing, CONFIG_NAME, token))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: not a JSON object")
    return parse_config(raw, where)


def _check_headers(headers: list[ShardHeader], weight_map: dict[str, str] | None, listing: HubListing) -> None:
    """Refuse a repo whose headers repeat a tensor or disagree with its index."""
    seen: dict[str, str] = {}
    for h in headers:
        for name in h.tensors:
            prev = seen.setdefault(name, h.file)
            if prev != h.file:
                raise RankFetchError(f"{_label(listing, h.file)}: tensor {name!r} is also in {prev}")
    if weight_map is None or weight_map == seen:
        return
    where = _label(listing, INDEX_NAME)
    for name, file in sorted(weight_map.items()):
        if seen.get(name) != file:
            actual = f"is in {seen[name]}" if name in seen else "is in no shard header"
            raise RankFetchError(f"{where}: tensor {name!r} is listed under {file} but {actual}")
    extra = sorted(seen.keys() - weight_map.keys())[0]
    raise RankFetchError(f"{where}: tensor {extra!r} is in {seen[extra]} but not listed in the index")


def _check_manifest(manifest: Manifest, label: str, headers: list[ShardHeader], wanted: set[str],
                    listing: HubListing) -> None:
    """The manifest must describe the hub's headers exactly and hash every wanted tensor."""
    where = f"manifest {label}"
    if not manifest.tensor_hashes:
        raise RankFetchError(f"{where} has no tensor hashes; pull one with `k3ckpt manifest pull --tensor-hashes` "
                             "(or build it from a full copy with `k3ckpt manifest build --tensor-hashes`)")
    unhashed = next((n for n in sorted(wanted) if n in manifest.tensors and not manifest.tensors[n].sha256), None)
    if unhashed is not None:
        raise RankFetchError(f"{where}: tensor {unhashed!r} has no sha256")
    actual = tensors_from_headers(headers)
    if actual == {n: t._replace(sha256=None) for n, t in manifest.tensors.items()}:
        return  # compared in C: the common case costs no per-tensor Python
    hub = f"{listing.hub}:{listing.repo}@{listing.revision}"
    for name, a in sorted(actual.items()):
        m = manifest.tensors.get(name)
        if m is None:
            raise RankFetchError(f"{where}: tensor {name!r} ({a.file} on {hub}) is not in the manifest; "
                                 "it describes another checkpoint or revision")
        for what in ("file", "dtype", "shape", "offsets"):
            if getattr(m, what) != getattr(a, what):
                raise RankFetchError(f"{where}: tensor {name!r}: {what} {_show(getattr(m, what))} in the manifest, "
                                     f"{_show(getattr(a, what))} on {hub}; it describes another checkpoint or revision")
    missing = sorted(manifest.tensors.keys() - actual.keys())
    raise RankFetchError(f"{where}: tensor {missing[0]!r} is in no shard header on {hub} "
                         f"({len(missing)} such); it describes another checkpoint or revision")


def _check_manifest_files(manifest: Manifest, label: str, listing: HubListing, whole: list[str]) -> None:
    """Files fetched whole are checked against the hub listing's sha256 by the downloader; with a
    manifest the listing itself must agree with it, or a hub could serve other bytes under a
    listing that vouches for them (the manifest is what the operator trusts, not the hub)."""
    hub = f"{listing.hub}:{listing.repo}@{listing.revision}"
    for path in sorted(whole):
        entry, pinned = listing.files[path], manifest.files.get(path)
        if pinned is None:
            raise RankFetchError(f"manifest {label}: {path} (on {hub}) is not in the manifest, so nothing the "
                                 "manifest vouches for covers it; exclude it (--exclude) or use a manifest that lists it")
        # (a small file the hub lists by git blob id only is checked against the manifest's
        # sha256 after the download: _check_against_manifest)
        if pinned.size != entry.size or (entry.sha256 is not None and pinned.sha256 != entry.sha256):
            listed = f"{entry.size} bytes, sha256 {entry.sha256}"
            raise RankFetchError(f"manifest {label}: {path}: {pinned.size} bytes, sha256 {pinned.sha256} in the "
                                 f"manifest, {listed} on {hub}; it describes another checkpoint or revision")


def _check_against_manifest(manifest: Manifest, listing: HubListing, dest_real: str,
                            paths: list[str]) -> dict[str, str]:
    """Whole files the hub lists without a sha256 (small files: git blob id only) were checked by
    the downloader against that id; hash them here against the manifest's sha256. A mismatch is
    removed and reported: the manifest, not the hub, is what vouches for the bytes."""
    failed: dict[str, str] = {}
    for path in paths:
        want = manifest.files[path].sha256
        if listing.files[path].sha256 is not None or want is None:
            continue  # the listing's sha256 was compared with the manifest's at plan time
        final = os.path.join(dest_real, path)
        try:
            got = hash_file(final).sha256
        except (HashError, OSError) as e:
            failed[path] = f"cannot hash it to compare with the manifest: {e}"
            continue
        if got != want:
            _dest.unlink(final)
            failed[path] = (f"sha256 {got} differs from the manifest's {want} (the hub's git blob id matched: "
                            "the hub serves other content than the manifest vouches for); removed")
    return failed


def _show(v: Any) -> str:
    return json.dumps(list(v)) if isinstance(v, tuple) else str(v)


@dataclass
class RemoteSource:
    """A hub checkpoint as planning sees it: listing, index, config and every shard's header.

    Attributes:
        index_sha256: sha256 of the index file; for a single-file checkpoint, of its header
            prefix (the 8-byte length and the JSON), as ``reshard`` records a local source.
    """

    listing: HubListing
    weight_map: dict[str, str] | None
    shard_paths: list[str]
    index_sha256: str | None
    config: ModelConfig | None
    headers: list[ShardHeader]
    tensors: dict[str, TensorInfo]


def read_source(hub: str, repo: str, revision: str | None, *, endpoint: str | None, token: str | None,
                jobs: int, on_listing: Callable[[HubListing], object] | None = None) -> RemoteSource:
    """Read what planning needs from the hub (listing, index, config, headers; no tensor data).
    ``on_listing`` sees the listing before anything else is read, and may refuse it by raising.

    Raises:
        RankFetchError: No checkpoint in the repo, or headers that disagree with the index.
    """
    listing = hubclient.list_repo(hub, repo, revision, endpoint=endpoint, token=token)
    if on_listing is not None:
        on_listing(listing)
    weight_map, shard_paths, index_sha = _remote_index(listing, token)
    cfg = _remote_config(listing, token)
    headers = [c.to_header() for c in hubclient.fetch_headers(listing, shard_paths, token=token, jobs=jobs)]
    _check_headers(headers, weight_map, listing)
    tensors = {name: t for h in headers for name, t in h.tensors.items()}
    if not tensors:
        raise RankFetchError(f"{listing.hub}:{listing.repo}@{listing.revision}: the shards hold no tensors")
    return RemoteSource(listing, weight_map, shard_paths, index_sha, cfg, headers, tensors)


def other_files(listing: HubListing, include: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
                *, skip: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """``(files, excluded)``: the non-weight files of ``listing`` a rank-aware or node fetch
    downloads whole (every ``.safetensors`` file, the index, the markers and ``skip`` are
    planned apart), filtered by ``--include``/``--exclude``.

    Raises:
        EmptySelectionError: the globs leave none of them (:func:`~k3ckpt.hub.fetch.select_paths`).
    """
    drop = {INDEX_NAME, PARTIAL_NAME, *skip}
    others = [f for f in listing.files if f not in drop and not f.endswith(".safetensors")]
    return select_paths(others, include, exclude, what=f"non-weight files of {source_text(listing)} (a rank-aware "
                                                       "fetch takes the weights its ranks need; the globs filter the rest)")


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
            _check_manifest(manifest, label or "(given)", headers, wanted, listing)
        shards = [sp for h in headers if (sp := plan_shard(h, listing.files[h.file], wanted, chunk_size)) is not None]
    files, excluded = other_files(listing, include, exclude, skip=frozenset(shard_paths))
    if manifest is not None:
        _check_manifest_files(manifest, label or "(given)", listing, files + [sp.path for sp in shards if sp.whole])
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


@dataclass
class RankFetchResult:
    """What one :func:`run_rank_fetch` did.

    Attributes:
        dest: The destination directory.
        written: Rewritten shards downloaded (fully or resumed) and checked this run.
        skipped: Rewritten shards already complete (size, header and, with a manifest, tensor hashes).
        fetched: Whole files (non-weight files and whole shards) downloaded and sha256-verified.
        files_skipped: Whole files already present and verified.
        failed: Path -> one-line reason, for everything that could not be fetched.
        bytes_downloaded: Body bytes received this run (retries included; planning headers not).
        bytes_total: Bytes of the whole selection (see :attr:`RankFetchPlan.bytes_total`).
        tensors_verified: Tensors whose sha256 was checked against the manifest this run.
        verification: :data:`VERIFIED_TENSORS` or :data:`VERIFIED_STRUCTURE`.
        seconds: Wall time of the run.
    """

    dest: Path
    verification: str
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    fetched: list[str] = field(default_factory=list)
    files_skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    bytes_downloaded: int = 0
    bytes_total: int = 0
    tensors_verified: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True only if every selected shard and file is present and checked."""
        return not self.failed

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "dest": str(self.dest), "ok": self.ok, "written": sorted(self.written), "skipped": sorted(self.skipped),
            "fetched": sorted(self.fetched), "files_skipped": sorted(self.files_skipped),
            "failed": dict(sorted(self.failed.items())), "bytes_downloaded": self.bytes_downloaded,
            "bytes_total": self.bytes_total, "tensors_verified": self.tensors_verified,
            "verification": self.verification, "seconds": round(self.seconds, 3),
        }
        if self.verification == VERIFIED_STRUCTURE:
            d["note"] = STRUCTURE_ONLY_NOTE
        return d


class _PieceFailed(Exception):
    pass


class _TensorHasher:
    """sha256 of each tensor of a task, fed the task's bytes in output order."""

    def __init__(self, tensors: tuple[tuple[str, int, int], ...]) -> None:
        self.tensors = tensors
        self.i = 0
        self.pos = tensors[0][1] if tensors else 0
        self.h = hashlib.sha256()
        self.digests: dict[str, str] = {}
        self._close_finished()

    def _close_finished(self) -> None:
        while self.i < len(self.tensors) and self.pos == self.tensors[self.i][2]:
            self.digests[self.tensors[self.i][0]] = self.h.hexdigest()
            self.h = hashlib.sha256()
            self.i += 1

    def feed(self, data: memoryview) -> None:
        while data:
            take = min(len(data), self.tensors[self.i][2] - self.pos)
            self.h.update(data[:take])
            self.pos += take
            data = data[take:]
            self._close_finished()

    def snapshot(self) -> tuple[int, int, Any, dict[str, str]]:
        return self.i, self.pos, self.h.copy(), dict(self.digests)

    def restore(self, snap: tuple[int, int, Any, dict[str, str]]) -> None:
        self.i, self.pos, h, digests = snap
        self.h, self.digests = h.copy(), dict(digests)


class _ShardJob:
    """One output file being written (a rewritten shard, a node directory's file): its
    ``.part``, journal and outstanding tasks."""

    def __init__(self, plan: OutputPlan, final: str, dest_real: str) -> None:
        self.plan = plan
        self.final = final
        self.dest_real = dest_real
        self.part = final + ".part"
        self.journal = self.part + ".journal"
        self.fingerprint = plan.fingerprint()
        self.done: set[int] = set()
        self.lock = threading.Lock()
        # The .part's descriptor: set by open() before the first piece, None again after
        # close(). Calls made while the job runs pass it with "type: ignore[arg-type]".
        self.fd: int | None = None
        self.remaining = len(plan.tasks)
        self.failed: str | None = None

    def load_resume(self) -> None:
        """Adopt a ``.part`` + journal of this exact selection; otherwise forget them."""
        self.done = _dest.resumable(self.journal, self.part, self.plan.size,
                                    {"version": _JOURNAL_VERSION, "fingerprint": self.fingerprint},
                                    len(self.plan.pieces))

    def todo_bytes(self) -> int:
        return sum(p.length for i, p in enumerate(self.plan.pieces) if i not in self.done)

    def open(self) -> None:
        """Resume the ``.part``, or create it: preallocate, write the new header, sync, journal."""
        try:
            self.fd = _dest.open_part(self.part, self.final, self.dest_real, self.plan.path, self.plan.size,
                                      self.plan.prefix, resume=bool(self.done))
        except ValueError as e:  # its directory resolves outside the destination
            raise _PieceFailed(str(e)) from None
        if not self.done:
            self.write_journal()

    def write_journal(self) -> None:
        doc = {"version": _JOURNAL_VERSION, "path": self.plan.path, "fingerprint": self.fingerprint,
               "size": self.plan.size, "done": sorted(self.done)}
        write_atomic(self.journal, json.dumps(doc).encode(), reuse_temp=True)  # as the downloader's journal

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


#: Which source content each rewritten shard of the destination was written from
#: (:meth:`ShardPlan.content_key`), updated after each shard's rename. Size and header say
#: nothing about the tensor bytes: without a manifest, this record is what tells a shard of the
#: hub's current revision from one of an earlier revision with the same header.
SHARD_RECORD = ".cache/k3ckpt/rank-shards.json"


def _load_shard_record(dest_real: str) -> dict[str, str]:
    try:
        doc = json.loads(Path(dest_real, SHARD_RECORD).read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)}


def _complete(sp: ShardPlan, final: str, manifest: Manifest | None, written_from: str | None) -> bool:
    """Whether ``final`` already is this shard: size, header bytes, and then with a manifest every
    tensor's sha256 (read locally; nothing is downloaded for a complete shard), without one the
    record that it was written from this very source content (``written_from``)."""
    try:
        if os.path.islink(final) or not os.path.isfile(final) or os.path.getsize(final) != sp.size:
            return False
        with open(final, "rb") as f:
            if f.read(len(sp.prefix)) != sp.prefix:
                return False
    except OSError:
        return False
    if manifest is None:
        return written_from == sp.content_key()
    spans = [Span(name, start, stop) for task in sp.tasks for name, start, stop in task.tensors]
    try:
        digest = hash_file(final, spans=spans)
    except HashError:
        return False
    return all(manifest.tensors[n].sha256 == d for n, d in (digest.spans or {}).items())


class _Run:
    """Shared state of the output files' download: a task queue and ``workers`` threads.

    ``before_rename(job)``, when given, runs once a ``.part`` is complete and checked, before its
    rename (a node directory's writer hashes the file there: raising :class:`_PieceFailed` fails
    the file, which then never gets its final name)."""

    def __init__(self, listing: HubListing, manifest: Manifest | None, dest: Path, result: RankFetchResult,
                 headers: dict[str, str], retry: RetryPolicy, progress: Callable[[int], None] | None,
                 before_rename: Callable[[_ShardJob], None] | None = None) -> None:
        self.listing = listing
        self.manifest = manifest
        self.before_rename = before_rename
        self.result = result
        self.headers = headers
        self.retry = retry
        self.progress = progress
        self.cancel = threading.Event()
        self.cond = threading.Condition()
        self.queue: collections.deque[tuple[_ShardJob, Task]] = collections.deque()
        self.pending = 0
        self.count_lock = threading.Lock()
        self.pieces_journaled = 0
        self.record_lock = threading.Lock()
        self.dest_real = os.path.realpath(dest)

    def count(self, n: int) -> None:
        with self.count_lock:
            self.result.bytes_downloaded += n
        if self.progress is not None:
            self.progress(n)

    def fail(self, job: _ShardJob, reason: str) -> None:
        with job.lock:
            if job.failed is None:
                job.failed = reason
                with self.cond:
                    self.result.failed[job.plan.path] = reason

    # -- one task --------------------------------------------------------------------------------

    def run_task(self, job: _ShardJob, task: Task) -> None:
        with job.lock:
            if job.failed is not None:
                return
            if job.fd is None:
                job.open()
        manifest = self.manifest
        for attempt in (1, 2):
            hasher = _TensorHasher(task.tensors) if manifest is not None else None
            for k, i in enumerate(task.pieces):
                last = k == len(task.pieces) - 1
                if i in job.done:
                    if hasher is not None:
                        self._rehash(job, self.plan_piece(job, i), hasher)
                    continue
                self._fetch_piece(job, self.plan_piece(job, i), hasher)
                os.fdatasync(job.fd) if hasattr(os, "fdatasync") else os.fsync(job.fd)  # type: ignore[arg-type]  # fd is open here
                if not (last and hasher is not None):  # a task's last piece is journaled once verified
                    self._journal(job, [i])
            if hasher is None or manifest is None:  # (one is None exactly when the other is)
                return
            bad = [(n, d) for n, d in hasher.digests.items() if manifest.tensors[n].sha256 != d]
            if not bad:
                with self.count_lock:
                    self.result.tensors_verified += len(hasher.digests)
                if task.pieces and task.pieces[-1] not in job.done:
                    self._journal(job, [task.pieces[-1]])
                return
            with job.lock:  # un-journal the task: its bytes are not what the manifest says
                job.done.difference_update(task.pieces)
                job.write_journal()
            if attempt == 2:
                name, got = bad[0]
                more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
                raise _PieceFailed(f"tensor {name!r}: sha256 {got} but the manifest says "
                                   f"{manifest.tensors[name].sha256}{more}, also after re-fetching its bytes")

    @staticmethod
    def plan_piece(job: _ShardJob, i: int) -> Piece:
        return job.plan.pieces[i]

    def _journal(self, job: _ShardJob, pieces: list[int]) -> None:
        with job.lock:
            if self.cancel.is_set() or job.failed is not None:
                return
            job.done.update(pieces)
            job.write_journal()
        with self.count_lock:
            self.pieces_journaled += 1
            n = self.pieces_journaled
        _transfer.pause_point("after_piece", n)  # test hook: the n-th piece of the run journaled

    @staticmethod
    def _rehash(job: _ShardJob, piece: Piece, hasher: _TensorHasher) -> None:
        """Feed a resumed piece's bytes from the ``.part`` (a large tensor cut by a crash)."""
        off, end = piece.dst, piece.dst + piece.length
        while off < end:
            data = os.pread(job.fd, min(_READ_BACK, end - off), off)  # type: ignore[arg-type]  # fd is open here
            if not data:
                raise _PieceFailed(f"{job.part}: short read at {off} while re-hashing resumed bytes")
            hasher.feed(memoryview(data))
            off += len(data)

    def _fetch_piece(self, job: _ShardJob, piece: Piece, hasher: _TensorHasher | None) -> None:
        failures = 0
        where = f"bytes {piece.src}+{piece.length}"
        while True:
            if self.cancel.is_set():
                raise _transfer.Cancelled()
            snap = hasher.snapshot() if hasher is not None else None
            try:
                _transfer.stream_range(self.listing, job.plan.source_of(piece), piece.src, piece.length, job.fd,  # type: ignore[arg-type]  # fd is open here
                                       piece.dst, self.headers, download.TIMEOUT, self.cancel, self.count,
                                       sink=hasher.feed if hasher is not None else None)
                return
            except _transfer.Fatal as e:
                raise _PieceFailed(f"{e} ({where})") from None
            except _transfer.Retryable as e:
                failures += 1
                if hasher is not None and snap is not None:
                    hasher.restore(snap)  # what the failed response fed is void
                if failures >= self.retry.attempts:
                    raise _PieceFailed(f"{e}; gave up after {failures} attempts ({where})") from None
                _transfer.back_off(self.retry, failures, e.retry_after)

    # -- finishing a shard -----------------------------------------------------------------------

    def finish(self, job: _ShardJob) -> None:
        """Check the complete ``.part`` (size, header) and rename it into place."""
        sp = job.plan
        assert job.fd is not None
        os.fsync(job.fd)
        if os.fstat(job.fd).st_size != sp.size:
            raise _PieceFailed(f"{job.part} is {os.fstat(job.fd).st_size} bytes, expected {sp.size}")
        head = os.pread(job.fd, len(sp.prefix), 0)
        if head != sp.prefix:
            raise _PieceFailed(f"{job.part}: the header on disk is not the one written")
        parse_header_bytes(head[8:], file=sp.path, path=job.part, file_size=sp.size)  # valid safetensors
        if self.before_rename is not None:
            self.before_rename(job)
        _transfer.pause_point("before_shard_rename")  # test hook
        with job.lock:
            job.close()
            os.replace(job.part, job.final)
            fsync_dir(os.path.dirname(job.final))
            _dest.unlink(job.journal)
        self.record_written(sp)
        with self.cond:
            self.result.written.append(sp.path)

    def record_written(self, sp: OutputPlan) -> None:
        """Add ``sp`` to :data:`SHARD_RECORD` (after its rename: a crash in between only costs a
        re-fetch of that shard)."""
        with self.record_lock:
            path = Path(self.dest_real, SHARD_RECORD)
            record = _load_shard_record(self.dest_real)
            record[sp.path] = sp.content_key()
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, (json.dumps(dict(sorted(record.items())), indent=1) + "\n").encode())

    # -- workers ---------------------------------------------------------------------------------

    def submit(self, job: _ShardJob) -> None:
        with self.cond:
            for task in job.plan.tasks:
                self.queue.append((job, task))
                self.pending += 1
            if not job.plan.tasks:
                self.queue.append((job, Task((), ())))  # nothing to fetch: just finish
                self.pending += 1
                job.remaining = 1
            self.cond.notify_all()

    def worker(self) -> None:
        while (item := _transfer.next_task(self.cond, self.queue, lambda: self.pending > 0, self.cancel)) is not None:
            job, task = item
            try:
                self.run_task(job, task)
                with job.lock:
                    job.remaining -= 1
                    last = job.remaining == 0 and job.failed is None
                if last:
                    self.finish(job)
            except _transfer.Cancelled:
                pass
            except _PieceFailed as e:
                self.fail(job, str(e))
            except K3ckptError as e:
                self.fail(job, str(e))
            except Exception as e:  # noqa: BLE001 - never lose a worker silently: fail the shard, keep going
                self.fail(job, f"{type(e).__name__}: {_http.one_line(str(e))[:300]}")
            finally:
                with self.cond:
                    self.pending -= 1
                    self.cond.notify_all()

    def run(self, workers: int) -> None:
        _transfer.run_workers(self.worker, workers, "k3ckpt-rankfetch", self.cond, lambda: self.pending > 0,
                              self.cancel)


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
    if workers < 1:
        raise ValueError("workers must be >= 1")
    t0 = time.monotonic()
    policy = retry or download.FETCH_RETRY
    result = RankFetchResult(dest=plan.dest, verification=plan.verification, bytes_total=plan.bytes_total)
    os.makedirs(plan.dest, exist_ok=True)
    dest_real = os.path.realpath(plan.dest)
    lock = _dest.DestLock(dest_real)
    lock.acquire()
    try:
        _dest.claim_dest(dest_real, [sp.path for sp in plan.shards] + list(plan.files) + [PARTIAL_NAME, INDEX_NAME])
        if os.path.isfile(os.path.join(dest_real, INDEX_NAME)) and not os.path.lexists(os.path.join(dest_real, PARTIAL_NAME)):
            # an index without our marker: a whole checkpoint (or another tool's), whose shards
            # this run would replace with subsets
            raise RankFetchError(f"{dest_real} holds a checkpoint that is not a rank-aware fetch ({INDEX_NAME} and no "
                                 f"{PARTIAL_NAME}); its shards would be replaced by subsets: fetch into another --dest")
        # Until this run succeeds the destination must not look like a complete checkpoint.
        for name in (PARTIAL_NAME, INDEX_NAME):
            _dest.unlink(os.path.join(dest_real, name))
        targets: list[tuple[ShardPlan, str]] = []
        for sp in plan.shards:
            if sp.whole:
                continue
            try:
                targets.append((sp, _dest.target(dest_real, sp.path)))
            except ValueError as e:
                result.failed[sp.path] = str(e)
        record = _load_shard_record(dest_real)
        # with a manifest this reads every present shard: in parallel, as the downloader does
        with ThreadPoolExecutor(max_workers=workers) as pool:
            complete = list(pool.map(lambda t: _complete(t[0], t[1], plan.manifest, record.get(t[0].path)),
                                     targets))
        jobs: list[_ShardJob] = []
        for (sp, final), done in zip(targets, complete):
            if done:
                result.skipped.append(sp.path)
                _dest.unlink(final + ".part.journal")
                continue
            job = _ShardJob(sp, final, dest_real)
            job.load_resume()
            jobs.append(job)
        partial_todo = sum(job.todo_bytes() for job in jobs)
        whole = plan.files + [sp.path for sp in plan.shards if sp.whole]
        if check_space:
            # before any byte moves, for both stages together (the downloader checks its own
            # stage again, exactly); whole files not there at all are what they will take
            absent = [f for f in whole if not os.path.lexists(os.path.join(dest_real, f))]
            needed = (sum(job.plan.size for job in jobs if not job.done)
                      + sum(plan.listing.files[f].size for f in absent))
            require_free_space(dest_real, needed, f"for {len(jobs)} rewritten shard(s) and {len(absent)} file(s)")

        report = (lambda n: on_plan(n + partial_todo)) if on_plan is not None else None
        if whole:
            fr = download.fetch_files(plan.listing, plan.dest, whole, workers=workers, chunk_size=plan.chunk_size,
                                      token=token, progress=progress, on_plan=report, retry=policy,
                                      check_space=check_space, take_lock=False)
            result.fetched, result.files_skipped = list(fr.fetched), list(fr.skipped)
            result.failed.update(fr.failed)
            result.bytes_downloaded += fr.bytes_downloaded
            if plan.manifest is not None:
                result.failed.update(_check_against_manifest(plan.manifest, plan.listing, dest_real,
                                                             fr.fetched + fr.skipped))
        elif report is not None:
            report(0)

        hubclient.load_client(plan.listing.hub)  # before the workers: see load_client
        run = _Run(plan.listing, plan.manifest, plan.dest, result, hubclient.auth_headers(plan.listing, token), policy,
                   progress)
        for job in jobs:
            run.submit(job)
        try:
            if jobs:
                run.run(workers)
        finally:
            for job in jobs:
                job.close()
        for job in jobs:  # nothing may end neither written nor failed
            if job.plan.path not in result.written and job.plan.path not in result.failed:
                result.failed[job.plan.path] = "not completed"
        if result.ok:
            write_atomic(os.path.join(dest_real, INDEX_NAME), _index_json(plan))
            write_atomic(os.path.join(dest_real, PARTIAL_NAME), _marker_json(plan))
            try:
                record_source(dest_real, plan.listing)
            except OSError:
                pass  # provenance only: the marker names the source revision too
    finally:
        lock.release()
    result.written.sort()
    result.skipped.sort()
    result.seconds = time.monotonic() - t0
    return result


# ---------------------------------------------------------------------------------------------
# Rendering (``k3ckpt fetch`` with --ranks or --node)


def _selection_text(plan: RankFetchPlan) -> str:
    t = plan.topology
    return (f"rank{'s' if len(plan.ranks) > 1 else ''} {format_ranges(plan.ranks)} of ep {t.ep} x tp {t.tp} "
            f"(world size {t.world_size}, {t.placement} placement)")


def _source_text(plan: RankFetchPlan) -> str:
    return source_text(plan.listing)


def load_manifest(manifest: str | os.PathLike[str] | Manifest | None) -> tuple[Manifest | None, str | None]:
    """A ``--manifest`` given as a path (loaded; the path is its label) or as a Manifest."""
    if manifest is None or isinstance(manifest, Manifest):
        return manifest, None
    return Manifest.load(manifest), os.fspath(manifest)


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


class FetchPlanTotals(Protocol):
    """What a rank-aware or a node fetch plan both tell about the whole run."""

    @property
    def listing(self) -> HubListing: ...
    @property
    def dest(self) -> Path: ...
    @property
    def files(self) -> list[str]: ...
    @property
    def header_bytes(self) -> int: ...
    @property
    def source_bytes(self) -> int: ...
    @property
    def bytes_total(self) -> int: ...
    @property
    def tensors(self) -> int: ...
    @property
    def verification(self) -> str: ...


def dry_run_total(plan: FetchPlanTotals, selection: str, written: str) -> list[str]:
    """The last lines of a rank-aware or node fetch's dry run: what would be fetched of the
    whole, into what (``written``: the weight files), and the structure-only note."""
    share = plan.bytes_total / plan.source_bytes if plan.source_bytes else 1.0
    lines = [f"would fetch {human_bytes(plan.bytes_total)} of {human_bytes(plan.source_bytes)} ({share:.1%}) "
             f"from {source_text(plan.listing)} into {plan.dest} for {selection}: {plan.tensors:,} tensors "
             f"in {written} and {len(plan.files)} other files; headers read: {human_bytes(plan.header_bytes)}"]
    if plan.verification == VERIFIED_STRUCTURE:
        lines.append(f"note: {STRUCTURE_ONLY_NOTE}")
    return lines


def render_rank_fetch(plan: RankFetchPlan, res: RankFetchResult, *, verbose: bool = False) -> str:
    """The summary of a rank-aware fetch; ``verbose`` names every file first."""
    return fetch_summary(res, source=_source_text(plan), dest=plan.dest, selection=_selection_text(plan),
                         written="shards rewritten", wrote_note=" (selected tensors)", whole="the selection",
                         bytes_total=plan.bytes_total, source_bytes=plan.source_bytes,
                         manifest=plan.manifest is not None, verbose=verbose)


def fetch_summary(res: RankFetchResult, *, source: str, dest: Path, selection: str, written: str, wrote_note: str,
                  whole: str, bytes_total: int, source_bytes: int, manifest: bool, verbose: bool) -> str:
    """The summary line (and failures, and the structure-only note) of a fetch that writes files of
    its own from selected tensors: the rank-aware fetch (``written`` "shards rewritten") and the
    node fetch ("node files written") say the same things in the same order."""
    lines = []
    if verbose:
        lines += [f"wrote    {p}{wrote_note}" for p in res.written]
        lines += [f"fetched  {p}" for p in res.fetched]
        lines += [f"verified {p} (already present)" for p in res.skipped + res.files_skipped]
    rate = f" at {human_bytes(res.bytes_downloaded / res.seconds)}/s" if res.seconds and res.bytes_downloaded else ""
    checked = f", {res.tensors_verified:,} tensors verified against the manifest" if manifest else ""
    lines.append(f"{'ok' if res.ok else 'FAILED'}: {source} -> {dest}: {selection}: "
                 f"{len(res.written)} {written}, {len(res.fetched)} files fetched "
                 f"({human_bytes(res.bytes_downloaded)}{rate}; {whole} is {human_bytes(bytes_total)} of "
                 f"{human_bytes(source_bytes)}), {len(res.skipped) + len(res.files_skipped)} already present"
                 f"{checked}, {len(res.failed)} failed")
    lines += [f"  could not fetch {p}: {why}" for p, why in sorted(res.failed.items())]
    if res.verification == VERIFIED_STRUCTURE:
        lines.append(f"note: {STRUCTURE_ONLY_NOTE}")
    return "\n".join(lines)


def rank_fetch_json(plan: RankFetchPlan, res: RankFetchResult) -> dict[str, Any]:
    """``fetch --json``'s document: the result with the source, the ranks and the topology."""
    d = res.to_json()
    d.update(hub=plan.listing.hub, repo=plan.listing.repo, revision=plan.listing.revision, ranks=plan.ranks,
             topology=plan.topology.to_json(), source_bytes=plan.source_bytes)
    return d
