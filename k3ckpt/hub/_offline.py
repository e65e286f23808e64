"""What the offline checks of a rank-aware fetch share (``fetch --node`` and ``fetch --ranks``
under ``HF_HUB_OFFLINE=1``): the record the earlier run wrote before its first byte, the files it
fetched whole, its marker, and the refusal of another selection. Each layout's own checks are in
:mod:`k3ckpt.hub.nodefetch` (:func:`~k3ckpt.hub.nodefetch.check_node_offline`) and
:mod:`k3ckpt.hub.rankfetch` (:func:`~k3ckpt.hub.rankfetch.check_rank_offline`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OfflineNoRecordError
from ..format.layout import NODE_MARKER, READY_NAME
from ..integrity.manifest import Manifest
from ._remote import load_manifest, other_files, require_tensor_hashes
from .client import HubListing
from .fetch import LISTING_RECORD, OfflineCheck, check_whole, read_fetch_record, recorded_files


@dataclass
class ShareCheck:
    """What :func:`start_check` found: the check so far, the record, the files fetched whole,
    the marker (None: the fetch did not complete, and the check says so) and the manifest."""

    out: OfflineCheck
    doc: dict[str, Any]
    whole: list[str]
    marker: dict[str, Any] | None
    manifest: Manifest | None = None
    label: str = "(given)"

    @property
    def listing(self) -> HubListing:
        """The recorded listing (its endpoint unknown offline)."""
        return HubListing(self.out.hub, self.out.repo, self.out.commit, "", recorded_files(self.doc))

    def check_whole(self, jobs: int) -> None:
        """The files fetched whole, against the recorded listing."""
        check_whole(self.out, recorded_files(self.doc), self.whole, jobs)


def start_check(hub: str, repo: str, dest: Path, revision: str | None, *, layout: str, marker_name: str,
                done_name: str, marker_keys: dict[str, type], selected: Callable[[dict[str, Any]], tuple[str, str]],
                other: str, manifest: Manifest | str | os.PathLike[str] | None, include: tuple[str, ...],
                exclude: tuple[str, ...], jobs: int) -> ShareCheck:
    """The start of the offline check of the earlier ``layout`` fetch into ``dest``: its record;
    the files it fetched whole (or ``include``/``exclude`` applied to the recorded listing, as
    online); its marker - None when the run did not complete (no ``done_name``, or no marker
    holding ``marker_keys`` of their types: :func:`read_marker`), which the check then fails,
    with the whole files checked; else the marker must be for the selection: ``selected(marker)``
    gives ``(requested, recorded)`` in words, which must be equal; then the ``manifest``, which
    must have tensor hashes.

    Raises:
        OfflineNoRecordError: As :func:`~k3ckpt.hub.fetch.read_fetch_record`, or a marker of
            another selection (``other``: what cannot be fetched offline).
        RankFetchError: A manifest without tensor hashes.
    """
    doc = read_fetch_record(dest, dest / LISTING_RECORD, hub, repo, revision, layout=layout)
    whole = list(doc["selected"])
    if include or exclude:
        whole = [p for p in whole if p.endswith(".safetensors")] + other_files(
            HubListing(hub, repo, doc["commit"], "", recorded_files(doc)), include, exclude,
            skip=frozenset({NODE_MARKER, READY_NAME}))[0]
    out = OfflineCheck(hub, repo, doc["commit"], dest, layout=layout, against=f"{marker_name} and the recorded listing")
    marker = read_marker(dest / marker_name, marker_keys) if (dest / done_name).is_file() else None
    found = ShareCheck(out, doc, whole, marker)
    if marker is None:
        why = f"no readable {marker_name}" if done_name == marker_name else f"no {done_name}, or no readable {marker_name}"
        out.failed[done_name] = f"missing: the fetch of {doc['commit']} into {dest} did not complete ({why})"
        found.check_whole(jobs)
        return found
    want, have = selected(marker)
    require_same(dest / marker_name, have, want, other)
    out.selection = want
    found.manifest, label = load_manifest(manifest)
    found.label = label or found.label
    if found.manifest is not None:
        require_tensor_hashes(found.manifest, found.label, found.listing)
    return found


def read_marker(path: Path, keys: dict[str, type]) -> dict[str, Any] | None:
    """The JSON object at ``path`` when it is readable and holds each of ``keys`` with a value
    of its type, else None."""
    try:
        marker = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    ok = isinstance(marker, dict) and all(isinstance(marker.get(k), t) for k, t in keys.items())
    return marker if ok else None


def require_same(marker_path: Path, have: str, want: str, other: str) -> None:
    """Refuse a check of ``want`` where the marker at ``marker_path`` is for ``have``.

    Raises:
        OfflineNoRecordError: ``have`` is not ``want`` (``other``: what cannot be fetched offline).
    """
    if have != want:
        raise OfflineNoRecordError(f"HF_HUB_OFFLINE is set and {marker_path} is for {have}, not {want}: {other} "
                                   "cannot be fetched offline (unset HF_HUB_OFFLINE to fetch)", path=marker_path)
