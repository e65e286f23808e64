"""What planning a rank-aware or node fetch reads of the hub, and the manifest checks around it.

:func:`read_source` reads the listing, ``config.json``, the index and every shard's header with
Range requests (about 60 MB for the full K3; no tensor data) and refuses headers that repeat a
tensor or disagree with the index. :func:`other_files` picks the non-weight files a fetch takes
whole.

A tensor-hash manifest (``k3ckpt manifest pull|build --tensor-hashes``) must describe the hub's
headers exactly (file, dtype, shape, offsets) and list every file fetched whole, or the run is
refused before any byte moves (:func:`check_manifest`, :func:`check_manifest_files`); a small
file the hub lists by git blob id only is hashed against the manifest once it arrived
(:func:`check_against_manifest`).
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, K3ckptError, RankFetchError
from ..format.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, bulk_allocation
from ..format.config import ModelConfig, parse_config
from ..format.header import ShardHeader, TensorInfo
from ..format.layout import PARTIAL_MARKER
from ..integrity.hashing import HashError, hash_file
from ..integrity.manifest import Manifest, tensors_from_headers
from ..integrity.structure import headers_match
from . import _dest
from . import client as hubclient
from .client import HubListing
from .fetch import pull_command, select_paths, source_text


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


def check_manifest(manifest: Manifest, label: str, headers: list[ShardHeader], wanted: set[str],
                    listing: HubListing) -> None:
    """The manifest must describe the hub's headers exactly and hash every wanted tensor."""
    where = f"manifest {label}"
    require_tensor_hashes(manifest, label, listing)
    known = manifest.tensors
    unhashed = None
    if not all(map(_ENTRY_SHA256, filter(None, map(known.get, wanted)))):  # C-level loops; sorted only to name one
        unhashed = next(n for n in sorted(wanted) if n in known and not known[n].sha256)
    if unhashed is not None:
        raise RankFetchError(f"{where}: tensor {unhashed!r} has no sha256")
    if headers_match(headers, manifest):  # no name is in two headers: _check_headers refused that
        return
    actual = tensors_from_headers(headers)
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


# TensorEntry fields: file, dtype, shape, offsets, sha256
_ENTRY_SHA256 = operator.itemgetter(4)


def require_tensor_hashes(manifest: Manifest, label: str, source: HubListing | str) -> None:
    """Raises:
        RankFetchError: ``manifest`` (named ``label``) has no tensor hashes: it cannot check a
            file assembled from tensors (the message names the pull of ``source``'s).
    """
    if not manifest.tensor_hashes:
        raise RankFetchError(f"manifest {label} has no tensor hashes (a plain manifest); pull one with "
                             f"`{pull_command(source)}` (or build it from a full copy with `k3ckpt manifest build "
                             "DIR --tensor-hashes -o M`)")


def check_manifest_files(manifest: Manifest, label: str, listing: HubListing, whole: list[str]) -> None:
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
        # sha256 after the download: check_against_manifest)
        if pinned.size != entry.size or (entry.sha256 is not None and pinned.sha256 != entry.sha256):
            listed = f"{entry.size} bytes, sha256 {entry.sha256}"
            raise RankFetchError(f"manifest {label}: {path}: {pinned.size} bytes, sha256 {pinned.sha256} in the "
                                 f"manifest, {listed} on {hub}; it describes another checkpoint or revision")


def check_against_manifest(manifest: Manifest, listing: HubListing, dest_real: str,
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
    # The index names the shards; in practice they are the repo's top-level .safetensors files,
    # whose headers are read while the index and the config arrive (one the index names
    # elsewhere is read after it). At K3's scale the index alone is ~45 MB of JSON (~500k names)
    # and the headers 96 x 2 requests: the plan waited for both in turn. A guessed file the
    # index does not name costs its header's bytes, and its failure is not the plan's.
    # The parsed index and headers are ~10^6 acyclic objects at K3's scale, and the cyclic GC
    # would re-walk all of them at each pass: paused, a node fetch's plan of k3-full took ~7 s
    # here instead of 10.5 (fetch_headers_each, run inside, sees it paused and leaves it so).
    with bulk_allocation(), ThreadPoolExecutor(max_workers=1) as pool:
        early = pool.submit(hubclient.fetch_headers_each, listing, _likely_shards(listing), token=token, jobs=jobs)
        weight_map, shard_paths, index_sha = _remote_index(listing, token)
        cfg = _remote_config(listing, token)
        read = early.result()
        missing = [p for p in shard_paths if p not in read]
        if missing:
            read.update(hubclient.fetch_headers_each(listing, missing, token=token, jobs=jobs))
        headers = []
        for path in shard_paths:  # the first failing shard in the index's order, as one pass would
            got = read[path]
            if isinstance(got, K3ckptError):
                raise got
            headers.append(got.to_header())
        _check_headers(headers, weight_map, listing)
        tensors = {name: t for h in headers for name, t in h.tensors.items()}
    if not tensors:
        raise RankFetchError(f"{listing.hub}:{listing.repo}@{listing.revision}: the shards hold no tensors")
    return RemoteSource(listing, weight_map, shard_paths, index_sha, cfg, headers, tensors)


def _likely_shards(listing: HubListing) -> list[str]:
    """The files whose headers :func:`read_source` reads before the index says which are the
    shards: the top-level ``.safetensors`` files (an index names its shards relative to its own,
    top-level, directory)."""
    return [p for p in listing.files if p.endswith(".safetensors") and "/" not in p]


def other_files(listing: HubListing, include: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
                *, skip: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """``(files, excluded)``: the non-weight files of ``listing`` a rank-aware or node fetch
    downloads whole (every ``.safetensors`` file, the index, the markers and ``skip`` are
    planned apart), filtered by ``--include``/``--exclude``.

    Raises:
        EmptySelectionError: the globs leave none of them (:func:`~k3ckpt.hub.fetch.select_paths`).
    """
    drop = {INDEX_NAME, PARTIAL_MARKER, *skip}
    others = [f for f in listing.files if f not in drop and not f.endswith(".safetensors")]
    return select_paths(others, include, exclude, what=f"non-weight files of {source_text(listing)} (a rank-aware "
                                                       "fetch takes the weights its ranks need; the globs filter the rest)")


def load_manifest(manifest: str | os.PathLike[str] | Manifest | None) -> tuple[Manifest | None, str | None]:
    """A ``--manifest`` given as a path (loaded; the path is its label) or as a Manifest."""
    if manifest is None or isinstance(manifest, Manifest):
        return manifest, None
    return Manifest.load(manifest), os.fspath(manifest)
