"""``k3ckpt fetch``: download a checkpoint from Hugging Face or ModelScope, resumably, verified.

Metadata (file list, sizes, sha256, the resolved commit) comes through the real client
libraries (:mod:`k3ckpt.hubclient`); bytes come through our own parallel ranged downloader
(:mod:`k3ckpt.download`), because none of the clients resumes across runs, verifies what it
wrote, and fetches byte ranges of tensors. The destination is a plain local-dir checkpoint the
other commands accept.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EmptySelectionError, EntryNotFoundError
from .client import HubListing, list_repo


@dataclass
class FetchPlan:
    listing: HubListing
    dest: Path
    paths: list[str]  # what will be fetched (or checked and skipped), sorted
    excluded: list[str] = field(default_factory=list)

    @property
    def bytes_total(self) -> int:
        return sum(self.listing.files[p].size for p in self.paths)

    def present(self) -> list[str]:
        """Files already at the destination with the listed size (they will be verified, and
        skipped when their digest matches)."""
        out = []
        for p in self.paths:
            try:
                if (self.dest / p).stat().st_size == self.listing.files[p].size:
                    out.append(p)
            except OSError:
                continue
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "hub": self.listing.hub, "repo": self.listing.repo, "revision": self.listing.revision,
            "dest": str(self.dest), "files": {p: self.listing.files[p].size for p in self.paths},
            "bytes_total": self.bytes_total, "excluded": self.excluded, "present": self.present(),
        }


def select_paths(files: list[str], include: tuple[str, ...] = (), exclude: tuple[str, ...] = (), *,
                 what: str = "files") -> tuple[list[str], list[str]]:
    """``(selected, excluded)``: files matching any ``include`` pattern (all when none is given)
    and no ``exclude`` pattern, with ``hf download``'s semantics because it is
    ``huggingface_hub.utils.filter_repo_objects`` doing the matching: ``fnmatch`` on the whole
    posix path, case-sensitive, ``*`` crossing ``/`` (``*.json`` matches ``sub/a.json``), and a
    pattern ending in ``/`` matching everything under that directory (``sub/`` is ``sub/*``).

    Raises:
        EmptySelectionError: patterns were given and leave none of the files (``what`` names
            them in the message): a typo'd ``--include '*.gguf'`` must not "succeed" having
            fetched nothing.
    """
    from huggingface_hub.utils import filter_repo_objects

    ordered = sorted(files)
    # None, not (): an empty allow list would allow nothing
    kept = set(filter_repo_objects(ordered, allow_patterns=list(include) or None,
                                   ignore_patterns=list(exclude) or None))
    selected = [f for f in ordered if f in kept]
    dropped = [f for f in ordered if f not in kept]
    if not selected and (include or exclude):
        globs = " ".join([f"--include {g!r}" for g in include] + [f"--exclude {g!r}" for g in exclude])
        raise EmptySelectionError(f"{globs} leave{'s' if len(include) + len(exclude) == 1 else ''} none of the "
                                  f"{len(files)} {what}: nothing to fetch")
    return selected, dropped


def select_named(listing: HubListing, names: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """``(selected, excluded)`` for ``hf download REPO FILE...``: each name is a file's path, or
    else a pattern as :func:`select_paths` matches ``--include`` (``dir/`` is everything under
    dir; ``hf download`` matches several names that way, and one name as a path only).

    Raises:
        EntryNotFoundError: a name matches no file of the repo (``hf download`` of one missing
            file fails the same way; a file quietly not fetched would be found missing later).
    """
    from huggingface_hub.utils import filter_repo_objects

    chosen: set[str] = set()
    missing = []
    for name in names:
        # a path first: "w[1].bin" is a file's name before it is a pattern matching "w1.bin"
        found = [name] if name in listing.files else list(filter_repo_objects(listing.files, allow_patterns=[name]))
        chosen.update(found)
        if not found:
            missing.append(name)
    if missing:
        raise EntryNotFoundError(f"{', '.join(map(repr, missing))}: no such file in the repo (FILES are paths, "
                                 "patterns or directories ending in '/')", hub=listing.hub, repo=listing.repo,
                                 revision=listing.revision, endpoint=listing.endpoint)
    ordered = sorted(listing.files)
    return [f for f in ordered if f in chosen], [f for f in ordered if f not in chosen]


def source_text(listing: HubListing) -> str:
    """``hub:repo@revision``, as the fetch summaries name their source."""
    return f"{listing.hub}:{listing.repo}@{listing.revision}"


def plan_fetch(
    hub: str,
    repo: str,
    dest: str | os.PathLike[str],
    *,
    revision: str | None = None,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    endpoint: str | None = None,
    token: str | None = None,
    files: tuple[str, ...] = (),
) -> FetchPlan:
    """List the repo (pinned to its resolved commit) and choose the files to fetch: ``files``
    (paths, globs or ``dir/``, as ``hf download REPO FILE...``; not with ``include``/``exclude``),
    else those ``include``/``exclude`` select (:func:`select_paths`), else all.

    Raises:
        EmptySelectionError: ``include``/``exclude`` leave no file (refused before any download).
        EntryNotFoundError: one of ``files`` matches no file of the repo.
        HubError: As :func:`~k3ckpt.hub.client.list_repo` raises it.
    """
    if files and (include or exclude):
        raise ValueError("files and include/exclude select the same thing: give one")
    listing = list_repo(hub, repo, revision, endpoint=endpoint, token=token)
    if files:
        paths, excluded = select_named(listing, files)
    else:
        paths, excluded = select_paths(list(listing.files), include, exclude, what=f"files of {source_text(listing)}")
    return FetchPlan(listing, Path(dest), paths, excluded)


def run_fetch(
    plan: FetchPlan,
    *,
    workers: int = 8,
    chunk_size: int | None = None,
    token: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> Any:
    """Download ``plan`` (see :func:`k3ckpt.download.fetch_files`); returns its ``FetchResult``."""
    from ..integrity.verify import record_verified
    from . import _dest
    from .download import DEFAULT_CHUNK, fetch_files

    os.makedirs(plan.dest, exist_ok=True)
    with _dest.DestLock(os.path.realpath(plan.dest)) as lock:
        # never into a directory holding files k3ckpt did not write (fetch would replace
        # same-named ones); a resumed fetch's own destination is accepted
        _dest.claim_dest(os.path.dirname(lock.path), plan.paths)
        _forget_partial(plan)
        result = fetch_files(plan.listing, plan.dest, plan.paths, workers=workers,
                             chunk_size=chunk_size or DEFAULT_CHUNK, token=token, progress=progress,
                             on_plan=on_plan, take_lock=False)
    # Every file fetched or skipped had its digest checked against the hub's: let a later
    # ``verify --quick`` trust it while its stat is unchanged, instead of checking sizes only.
    files = plan.listing.files
    record_verified(plan.dest, {p: (files[p].sha256, files[p].git_sha1) for p in result.fetched + result.skipped})
    if result.ok:
        try:
            record_source(plan.dest, plan.listing)
        except OSError as e:  # every file is in place and verified: not a reason to fail the fetch
            result.notes.append(f"could not record the source revision in {plan.dest}: {e.strerror or e}")
    return result


def render_fetch_plan(plan: FetchPlan) -> str:
    """What a dry run prints: each file's size (and whether it is present), then the total."""
    from ..utils import human_bytes

    present = set(plan.present())
    lines = []
    for p in plan.paths:
        note = "  (present, will be verified)" if p in present else ""
        lines.append(f"{human_bytes(plan.listing.files[p].size):>10}  {p}{note}")
    lines.append(f"would fetch {len(plan.paths)} files, {human_bytes(plan.bytes_total)} from "
                 f"{plan.listing.hub}:{plan.listing.repo}@{plan.listing.revision} into {plan.dest}")
    return "\n".join(lines)


def render_fetch(plan: FetchPlan, result: Any, *, verbose: bool = False) -> str:
    """The summary of a fetch (``result`` from :func:`run_fetch`); ``verbose`` names every file
    first. The result's ``notes`` are not part of it: the CLI prints them on stderr."""
    from ..utils import human_bytes

    lines = []
    if verbose:
        lines += [f"fetched  {p}" for p in result.fetched]
        lines += [f"verified {p} (already present)" for p in result.skipped]
    rate = (f" at {human_bytes(result.bytes_downloaded / result.seconds)}/s"
            if result.seconds and result.bytes_downloaded else "")
    lines.append(f"{'ok' if result.ok else 'FAILED'}: {plan.listing.hub}:{plan.listing.repo}@{plan.listing.revision} "
                 f"-> {plan.dest}: {len(result.fetched)} fetched ({human_bytes(result.bytes_downloaded)}{rate}), "
                 f"{len(result.skipped)} already present and verified, {len(result.failed)} failed")
    lines += [f"  could not fetch {p}: {why}" for p, why in sorted(result.failed.items())]
    return "\n".join(lines)


def fetch_json(plan: FetchPlan, result: Any) -> dict[str, Any]:
    """``fetch --json``'s document: the result with the hub, repo and resolved revision."""
    d: dict[str, Any] = result.to_json()
    d.update(hub=plan.listing.hub, repo=plan.listing.repo, revision=plan.listing.revision)
    return d


def _forget_partial(plan: FetchPlan) -> None:
    """A whole fetch into a former rank-aware fetch's directory makes it whole again: its marker
    (which tells ``verify`` and ``inspect`` to require only some experts) must go first, so that
    the directory is never whole-but-marked-partial, nor partial-and-unmarked after a failure of
    this run (then ``verify`` reports the experts still missing, which is the truth)."""
    from ..errors import LayoutError
    from ..format.layout import NODE_MARKER, PARTIAL_MARKER

    shards = {p for p in plan.listing.files if p.endswith(".safetensors")}
    if shards & set(plan.paths) and (plan.dest / NODE_MARKER).exists():
        # a node directory's files are not the hub's shards: mixing both would leave tensors twice
        raise LayoutError(f"{plan.dest} is a node directory ({NODE_MARKER}); a whole fetch would add the hub's "
                          "shards to it: fetch into another --dest")
    marker = plan.dest / PARTIAL_MARKER
    if shards and shards <= set(plan.paths) and marker.is_file():
        marker.unlink()


def record_source(dest: str | os.PathLike[str], listing: HubListing) -> None:
    """Record in ``dest`` (:data:`k3ckpt.checkpoint.SOURCE_RECORD`) which hub, repo and commit its
    files came from, so ``reshard``'s ``topology.json`` and ``preflight`` can name the revision."""
    from ..format.checkpoint import SOURCE_RECORD
    from ..utils import write_atomic

    path = Path(dest) / SOURCE_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"hub": listing.hub, "repo": listing.repo, "revision": listing.revision}
    write_atomic(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
