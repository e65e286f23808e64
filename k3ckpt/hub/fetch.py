"""``k3ckpt fetch``: download a checkpoint from Hugging Face or ModelScope, resumably, verified.

Metadata (file list, sizes, sha256, the resolved commit) comes through the real client
libraries (:mod:`k3ckpt.hub.client`); bytes come through our own parallel ranged downloader
(:mod:`k3ckpt.hub.download`). Not because the clients lack resume or checks - ``modelscope_hub``
resumes a partial file across runs, splits large files into parallel ranges and checks the
sha256; ``huggingface_hub`` resumes within a run and checks the size (its HTTP path writes a
process-unique ``.incomplete`` file, so a new run starts over; Xet has its own) - but because
both hubs get one behaviour here: a resume that trusts only chunks journaled after their bytes
were ``fdatasync``-ed (a SIGKILL or power loss costs the chunks in flight, never a silently
short or stale prefix), the sha256 checked before the final name appears, one lock and
ownership record per destination, and the same reader for the rank-aware fetch, which needs the
byte ranges of single tensors composed into rewritten shards. The destination is a plain
local-dir checkpoint the other commands accept (``--local-dir``), or a hub cache in the layout
the hub's own client reads (``--cache-dir``, :mod:`k3ckpt.hub.cache`).

Every fetch first records the listing it fetches against (:data:`LISTING_RECORD` in a local dir,
``.k3ckpt/<snapshot>.json`` in a cache): under ``HF_HUB_OFFLINE=1`` :func:`check_offline` verifies
what is there against it without contacting the hub.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EmptySelectionError, EntryNotFoundError
from .cache import CacheLayout
from .client import HubFile, HubListing, default_requests, list_repo

#: The listing a local-dir fetch fetched against (for ``fetch`` under ``HF_HUB_OFFLINE=1``).
LISTING_RECORD = ".cache/k3ckpt/listing.json"
_RECORD_FORMAT = "k3ckpt-fetch-listing"


@dataclass
class FetchPlan:
    listing: HubListing
    dest: Path  # the local dir, or the snapshot directory in a hub cache
    paths: list[str]  # what will be fetched (or checked and skipped), sorted
    excluded: list[str] = field(default_factory=list)
    revision: str | None = None  # as requested (None: the hub's default branch)
    cache: CacheLayout | None = None  # set for a fetch into a hub cache

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


def hub_origin(listing: HubListing) -> str:
    """The named origin of the digests a fetch checks (docs/trust.md): the hub's own, for that
    revision (an LFS file's sha256, a small file's git blob id)."""
    return f"hub sha256 of {source_text(listing)}"


def manifest_origin(label: str | None) -> str:
    """The named origin of tensor digests a fetch checked against a manifest (docs/trust.md)."""
    return f"manifest {label or '(given)'}"


def pull_command(source: HubListing | str) -> str:
    """The ``k3ckpt manifest pull`` of the tensor-hash manifest of exactly this commit (a listing,
    or its :func:`source_text`), as messages suggest it: its file named after the repo
    (``kimi-k3.tensors.json``)."""
    import shlex

    text = source if isinstance(source, str) else source_text(source)
    hub, _, rest = text.partition(":")
    repo, _, revision = rest.rpartition("@")
    args = ["k3ckpt", "manifest", "pull", repo] + (["--source", hub] if hub != "hf" else [])
    name = repo.rsplit("/", 1)[-1].lower()
    return shlex.join([*args, "--revision", revision, "--tensor-hashes", "-o", f"{name}.tensors.json"])


def plan_fetch(
    hub: str,
    repo: str,
    dest: str | os.PathLike[str] | None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    include: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    endpoint: str | None = None,
    token: str | None = None,
    files: tuple[str, ...] = (),
) -> FetchPlan:
    """List the repo (pinned to its resolved commit) and choose the files to fetch: ``files``
    (paths, globs or ``dir/``, as ``hf download REPO FILE...``; not with ``include``/``exclude``),
    else those ``include``/``exclude`` select (:func:`select_paths`), else all; into the local
    directory ``dest``, or (``dest`` None) into the hub cache at ``cache_dir``.

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
    if dest is None:
        if cache_dir is None:
            raise ValueError("plan_fetch needs dest or cache_dir")
        layout = CacheLayout.of(listing, cache_dir, revision)
        return FetchPlan(listing, layout.snapshot, paths, excluded, revision, layout)
    return FetchPlan(listing, Path(dest), paths, excluded, revision)


def run_fetch(
    plan: FetchPlan,
    *,
    workers: int | None = None,
    chunk_size: int | None = None,
    token: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> Any:
    """Download ``plan`` (see :func:`k3ckpt.download.fetch_files`); returns its ``FetchResult``."""
    from ..integrity.verify import record_verified
    from ..utils.ownership import locked_output_dir
    from . import _dest
    from .download import DEFAULT_CHUNK, fetch_files

    workers = default_requests() if workers is None else workers
    if plan.cache is not None:
        return _run_cache_fetch(plan, plan.cache, workers=workers, chunk_size=chunk_size or DEFAULT_CHUNK,
                                token=token, progress=progress, on_plan=on_plan)
    lock = _dest.DestLock(os.path.realpath(plan.dest))
    with locked_output_dir(plan.dest, lock):  # a refusal (disk space) leaves no directory it made
        # never into a directory holding files k3ckpt did not write (fetch would replace
        # same-named ones); a resumed fetch's own destination is accepted
        _dest.claim_dest(os.path.dirname(lock.path), plan.paths)
        _forget_partial(plan)
        write_listing_record(plan.dest / LISTING_RECORD, plan)
        result = fetch_files(plan.listing, plan.dest, plan.paths, workers=workers,
                             chunk_size=chunk_size or DEFAULT_CHUNK, token=token, progress=progress,
                             on_plan=on_plan, take_lock=False)
    # Every file fetched or skipped had its digest checked against the hub's: let a later
    # ``verify --quick`` trust it while its stat is unchanged, instead of checking sizes only.
    files = plan.listing.files
    record_verified(plan.dest, {p: (files[p].sha256, files[p].git_sha1) for p in result.fetched + result.skipped},
                    origin=hub_origin(plan.listing))
    if result.ok:
        try:
            record_source(plan.dest, plan.listing)
        except OSError as e:  # every file is in place and verified: not a reason to fail the fetch
            result.notes.append(f"could not record the source revision in {plan.dest}: {e.strerror or e}")
    return result


def check_destination(dest: str | os.PathLike[str]) -> None:
    """Refuse a local destination the way a fetch into it would (``fetch``, ``fetch --ranks``,
    ``fetch --node`` all claim it before writing), creating and writing nothing: a dry run
    says up front what the run would say.

    Raises:
        OutputNotOwnedError: ``dest`` holds files k3ckpt did not write, or another command's
            output (exit 2).
    """
    from . import _dest

    _dest.check_dest(dest)


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
    lines = []
    if verbose:
        lines += [f"fetched  {p}" for p in result.fetched]
        lines += [f"verified {p} (already present)" for p in result.skipped]
    lines.append(f"{'ok' if result.ok else 'FAILED'}: {plan.listing.hub}:{plan.listing.repo}@{plan.listing.revision} "
                 f"-> {plan.dest}: {len(result.fetched)} fetched{resumed_text(result.resumed)}, "
                 f"{len(result.skipped)} already present and verified, {len(result.failed)} failed; "
                 f"{moved_text(result.bytes_downloaded, result.seconds)}")
    lines += [f"  could not fetch {p}: {why}" for p, why in sorted(result.failed.items())]
    return "\n".join(lines)


def resumed_text(resumed: list[str]) -> str:
    """`` (N resumed)`` after a count of files, when some continued an earlier run's ``.part``."""
    return f" ({len(resumed)} resumed from an earlier run)" if resumed else ""


def moved_text(nbytes: int, seconds: float) -> str:
    """What a run moved: ``6.25 MB downloaded at 37.99 MB/s`` - this run's bytes, apart from
    the file counts (a resumed or already present file moves few or none)."""
    from ..utils import human_bytes

    rate = f" at {human_bytes(nbytes / seconds)}/s" if seconds and nbytes else ""
    return f"{human_bytes(nbytes)} downloaded this run{rate}"


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
                          "shards to it: fetch into another --local-dir")
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


def record_manifest(dest: str | os.PathLike[str], manifest: str | os.PathLike[str]) -> None:
    """Add to ``dest``'s source record (:func:`record_source`, written by the fetch that just
    finished) the tensor-hash manifest it verified against, as an absolute path: a command
    that fetches more of the same source (preflight's fix) carries it as ``--manifest``. The
    next fetch's record replaces it (a fetch without one leaves none)."""
    from ..format.checkpoint import SOURCE_RECORD
    from ..utils import write_atomic

    path = Path(dest) / SOURCE_RECORD
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # no record: nothing says where the files came from, so nothing to add to
    if isinstance(doc, dict):
        doc["manifest"] = os.path.abspath(manifest)
        write_atomic(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


# ----------------------------------------------------------------------------------------------
# Into a hub cache
# ----------------------------------------------------------------------------------------------


def _run_cache_fetch(plan: FetchPlan, layout: CacheLayout, *, workers: int, chunk_size: int, token: str | None,
                     progress: Callable[[int], None] | None, on_plan: Callable[[int], None] | None) -> Any:
    """``run_fetch`` into a hub cache (see :mod:`k3ckpt.hub.cache`), under k3ckpt's own lock in
    the repo folder's ``.k3ckpt/``; no ownership claim: the cache is shared with the clients."""
    from ..integrity.verify import record_verified
    from ..utils.ownership import locked_output_dir
    from . import _dest
    from .cache import RECORDS_DIR
    from .download import fetch_files

    # a refusal (disk space) leaves no folder it made in the cache
    with locked_output_dir(layout.repo_dir, _dest.DestLock(os.path.realpath(layout.records)), records=RECORDS_DIR):
        write_listing_record(layout.records / f"{layout.snapshot.name}.json", plan)
        if layout.hub == "hf":
            result = _fetch_blobs(plan, layout, workers=workers, chunk_size=chunk_size, token=token,
                                  progress=progress, on_plan=on_plan)
        else:
            # snapshots/<revision>/ is named by the branch: a new commit's files replace the old ones
            was = {p: _other_content(layout.snapshot / p, plan.listing.files[p]) for p in plan.paths}
            result = fetch_files(plan.listing, layout.snapshot, plan.paths, workers=workers, chunk_size=chunk_size,
                                 token=token, progress=progress, on_plan=on_plan, take_lock=False)
            result.notes += [f"replaced {layout.snapshot.name}/{p}, whose content was not the listed one ({was[p]})"
                             for p in result.fetched if was[p] is not None]
            legacy = layout.legacy_dir()
            if legacy is not None:
                result.notes.append(f"the ModelScope client returns the older SDK's folder {legacy} before this "
                                    "snapshot: move it away for the client to use what fetch wrote")
        if result.ok:
            # last, and only now: a failed fetch of a new commit must not move the branch away
            # from the complete snapshot of the previous one
            from .cache import write_ref

            write_ref(layout)
    files = plan.listing.files
    record_verified(plan.dest, {p: (files[p].sha256, files[p].git_sha1) for p in result.fetched + result.skipped},
                    origin=hub_origin(plan.listing))
    result.dest = plan.dest
    return result


def _fetch_blobs(plan: FetchPlan, layout: CacheLayout, **kw: Any) -> Any:
    """The Hugging Face cache: each distinct content once, as ``blobs/<etag>`` (verified before
    it takes the name), then every path's snapshot link, with the commit's tree listing written
    first so the client's offline completeness check sees what is still missing."""
    from .cache import blob_name, link_snapshot, write_tree_cache
    from .download import fetch_files

    files = plan.listing.files
    groups: dict[str, list[str]] = {}
    unnamed: dict[str, str] = {}
    for p in plan.paths:
        blob = blob_name(files[p])
        if blob is None:
            unnamed[p] = "the listing gives neither its sha256 nor its git blob id: no blob name for the cache"
        else:
            groups.setdefault(blob, []).append(p)

    def place(entry: HubFile) -> str:
        return f"blobs/{blob_name(entry)}"

    # A blob is named by its content and shared by every snapshot linking it: one whose bytes are
    # not its name's (huggingface_hub never checks a blob it finds) serves no snapshot. It is
    # replaced as any blob is written - a verified .part renamed over the name, never written in
    # place (a hard link to the old bytes keeps them) - and the result says so.
    damaged = {blob: _other_content(layout.repo_dir / place(files[ps[0]]), files[ps[0]]) for blob, ps in groups.items()}
    result = fetch_files(plan.listing, layout.repo_dir, [ps[0] for ps in groups.values()], place=place,
                         take_lock=False, **kw)
    result.notes += [f"replaced damaged blob blobs/{blob} ({damaged[blob]}) with the hub's verified bytes "
                     f"(the content of {', '.join(ps)})"
                     for blob, ps in groups.items() if damaged[blob] is not None and ps[0] in result.fetched]
    result.failed.update(unnamed)
    write_tree_cache(layout, plan.listing)
    for paths in groups.values():
        first = paths[0]
        if first in result.failed:
            result.failed.update({p: f"same content as {first}: {result.failed[first]}" for p in paths[1:]})
            continue
        result.skipped.extend(paths[1:])  # the same blob, just verified
        for p in paths:
            why = link_snapshot(layout, files[p])
            if why is not None:
                result.failed[p] = why
                for done in (result.fetched, result.skipped, result.resumed):
                    if p in done:
                        done.remove(p)
    result.fetched.sort()
    result.skipped.sort()
    return result


def _other_content(path: Path, entry: HubFile) -> str | None:
    """Why the file at ``path`` is not ``entry``'s content if it holds something under that name
    (what a fetch that then downloads it replaced), or None when nothing is there; read before
    the fetch verifies it (a file of the listed size then differs in its digest)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size != entry.size:
        return f"size {st.st_size} != listed {entry.size}"
    return "sha256 mismatch" if entry.sha256 is not None else "git blob id mismatch"


# ----------------------------------------------------------------------------------------------
# The listing record, and the offline check against it
# ----------------------------------------------------------------------------------------------


def write_listing_record(path: Path, plan: FetchPlan) -> None:
    """Record the listing ``plan`` fetches against (every file's size and digests, and which
    were selected), before the first byte: an interrupted fetch's record then lets the offline
    check say which files are still missing."""
    write_fetch_record(path, plan.listing, plan.revision, plan.paths)


def write_fetch_record(path: Path, listing: HubListing, revision: str | None, selected: list[str], *,
                       layout: str | None = None, extra: dict[str, Any] | None = None) -> None:
    """The record :func:`write_listing_record` writes, for any fetch: ``selected`` are the files
    fetched whole (checked offline against the listing's digests), ``layout`` the rank-aware
    fetch that wrote the rest (``"node"``, ``"partial"``; None for a whole fetch), whose offline
    check reads what it adds in ``extra``."""
    from ..utils import write_atomic

    doc: dict[str, Any] = {
        "format": _RECORD_FORMAT, "version": 1, "hub": listing.hub, "repo": listing.repo, "revision": revision,
        "commit": listing.revision, "selected": selected,
        "files": {p: {"size": f.size, "sha256": f.sha256, "git_sha1": f.git_sha1} for p, f in listing.files.items()}}
    if layout is not None:
        doc["layout"] = layout
    doc.update(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())


#: How the offline check names what a record's ``layout`` says was fetched.
_LAYOUT_TEXT = {None: "a whole fetch", "node": "a node fetch (--node, --format node)",
                "partial": "a rank-aware fetch (--ranks, --format partial)"}


def read_fetch_record(dest: Path, record: Path, hub: str, repo: str, revision: str | None, *,
                      layout: str | None = None) -> dict[str, Any]:
    """The record of an earlier fetch of ``repo`` into ``dest`` (:func:`write_fetch_record`),
    for the offline check: of this ``layout``, and of ``revision`` (as requested, or its commit)
    when one is given.

    Raises:
        OfflineNoRecordError: No such record, one of another repo, revision or layout.
    """
    from ..errors import OfflineNoRecordError

    doc = _read_record(record)
    if doc is None or doc.get("hub") != hub or doc.get("repo") != repo:
        raise OfflineNoRecordError(f"HF_HUB_OFFLINE is set and {dest} holds no record of a k3ckpt fetch of "
                                   f"{hub}:{repo}: nothing to verify against (unset HF_HUB_OFFLINE to fetch)",
                                   path=record)
    if doc.get("layout") != layout:
        raise OfflineNoRecordError(f"HF_HUB_OFFLINE is set and {dest} holds {_LAYOUT_TEXT.get(doc.get('layout'))} of "
                                   f"{hub}:{repo}, not {_LAYOUT_TEXT[layout]}: check it offline with the options "
                                   "that fetched it (unset HF_HUB_OFFLINE to fetch this one)", path=record)
    if revision is not None and revision not in (doc["revision"], doc["commit"]):
        raise OfflineNoRecordError(f"HF_HUB_OFFLINE is set and {dest} holds {hub}:{repo}@{doc['commit']} "
                                   f"(fetched as {doc['revision'] or 'the default branch'}), not {revision}",
                                   path=record)
    return doc


def recorded_files(doc: dict[str, Any]) -> dict[str, HubFile]:
    """The listing a fetch record holds, path -> entry."""
    return {p: HubFile(p, f["size"], f["sha256"], f["git_sha1"]) for p, f in doc["files"].items()}


def check_whole(out: OfflineCheck, files: dict[str, HubFile], paths: list[str], jobs: int) -> None:
    """Add each of ``paths`` to ``out.verified`` when ``out.dest/<path>`` holds its entry in
    ``files`` (size and digest, hashed in parallel), else to ``out.failed`` with why not."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        problems = list(pool.map(lambda p: _offline_problem(out.dest, files[p]), paths))
    for p, why in zip(paths, problems):
        if why is None:
            out.verified.append(p)
        else:
            out.failed[p] = why


@dataclass
class OfflineCheck:
    """What ``fetch`` found under ``HF_HUB_OFFLINE=1``: the recorded source and, for each
    selected file, whether the copy there matches it. A rank-aware fetch's check names its
    ``selection``, what its files were checked ``against`` (its marker) and how (``detail``);
    ``trusted`` are the verified files whose bytes were not read (a stat unchanged since k3ckpt
    hashed them, or a rewritten shard's size and header); ``unproven`` why not every file was
    found equal to a digest of named origin (docs/trust.md: the hub's sha256, a tensor-hash
    manifest), None when each was; ``notes``, anything else to know."""

    hub: str
    repo: str
    commit: str
    dest: Path
    verified: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    layout: str | None = None
    selection: str | None = None
    against: str = "the recorded listing"
    trusted: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    detail: str | None = None
    unproven: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def proven(self) -> bool:
        return self.ok and self.unproven is None

    @property
    def verdict(self) -> str:
        return "FAILED" if not self.ok else "ok" if self.proven else "not proven"

    def render(self) -> str:
        how = f" ({self.detail})" if self.detail else ""
        head = (f"{self.verdict} (offline, HF_HUB_OFFLINE is set): {self.hub}:{self.repo}@{self.commit}"
                f" -> {self.dest}: {self.selection + ': ' if self.selection else ''}{len(self.verified)} verified "
                f"against {self.against}{how}, {len(self.failed)} missing or damaged; the hub was not contacted")
        lines = [head] + [f"  {p}: {why}" for p, why in sorted(self.failed.items())]
        if self.failed:
            lines.append("  fix: unset HF_HUB_OFFLINE and run the same fetch again (nothing is fetched offline)")
        elif self.unproven is not None:
            lines.append(f"not proven: {self.unproven}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        d = {"ok": self.ok, "proven": self.proven, "offline": True, "hub": self.hub, "repo": self.repo,
             "revision": self.commit, "dest": str(self.dest), "verified": sorted(self.verified),
             "failed": dict(sorted(self.failed.items()))}
        if self.layout is not None:
            d.update(format=self.layout, selection=self.selection, trusted=sorted(self.trusted),
                     unproven=self.unproven, notes=self.notes)
        return d


def check_offline(hub: str, repo: str, *, local_dir: str | os.PathLike[str] | None = None,
                  cache_dir: str | os.PathLike[str] | None = None, revision: str | None = None,
                  include: tuple[str, ...] = (), exclude: tuple[str, ...] = (), jobs: int = 8) -> OfflineCheck:
    """Verify, without contacting the hub, what an earlier fetch put in ``local_dir`` or in the
    hub cache at ``cache_dir``, against the listing it recorded: every selected file (that run's
    selection, or ``include``/``exclude`` applied to the recorded listing) must be there with the
    recorded size and digest (in a cache: as the snapshot the client would return).

    Raises:
        OfflineNoRecordError: No record of an earlier fetch of ``repo`` (at ``revision``) there,
            or the record of a rank-aware fetch (checked by its own offline check).
        EmptySelectionError: ``include``/``exclude`` leave no recorded file.
    """
    wanted = revision or ("main" if hub == "hf" else "master")
    if local_dir is not None:
        dest = Path(local_dir)
        record = dest / LISTING_RECORD
    else:
        assert cache_dir is not None
        layout = CacheLayout(hub, Path(cache_dir), repo, wanted, _cached_commit(hub, Path(cache_dir), repo, wanted))
        dest, record = layout.snapshot, layout.records / f"{layout.snapshot.name}.json"
    # in a cache the revision picked the snapshot (and its record) already
    doc = read_fetch_record(dest, record, hub, repo, revision if local_dir is not None else None)
    files = recorded_files(doc)
    paths = (select_paths(list(files), include, exclude, what=f"recorded files of {hub}:{repo}@{doc['commit']}")[0]
             if include or exclude else list(doc["selected"]))
    out = OfflineCheck(hub, repo, doc["commit"], dest)
    check_whole(out, files, paths, jobs)
    # what proved them, in the stat cache (outside the checkpoint), as the fetch records it
    from ..integrity.verify import record_verified

    if out.verified:
        record_verified(dest, {p: (files[p].sha256, files[p].git_sha1) for p in out.verified},
                        origin=hub_origin(HubListing(hub, repo, doc["commit"], "", files)))
    return out


def _cached_commit(hub: str, root: Path, repo: str, revision: str) -> str:
    """The commit a cache's ``refs/<revision>`` names (Hugging Face), else ``revision`` itself
    (a commit, or ModelScope's snapshot name)."""
    if hub != "hf":
        return revision
    layout = CacheLayout(hub, root, repo, revision, revision)
    with contextlib.suppress(OSError):  # no ref yet: see below
        return (layout.repo_dir / "refs" / revision).read_text().strip() or revision
    # No ref: the ref is written only once a fetch completes. The latest record of a fetch of
    # this revision then names its commit, so the check can say what that fetch still lacks.
    records = sorted(layout.records.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for rec in records:
        doc = _read_record(rec)
        if doc is not None and (doc.get("revision") or "main") == revision and rec.stem == doc.get("commit"):
            return str(doc["commit"])
    return revision


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != _RECORD_FORMAT:
        return None
    return doc


def _offline_problem(dest: Path, entry: HubFile) -> str | None:
    """Why ``dest/<path>`` does not hold the recorded content, or None when it does."""
    from ..integrity.hashing import HashError, hash_file

    path = dest / entry.path
    if not path.exists():
        return "missing" + (" (a dangling link)" if path.is_symlink() else "")
    try:
        digest = hash_file(path, git_sha1=entry.sha256 is None and entry.git_sha1 is not None)
    except (HashError, OSError) as e:
        return f"unreadable ({e})"
    if digest.size != entry.size:
        return f"size {digest.size} != recorded {entry.size}"
    if entry.sha256 is not None and digest.sha256 != entry.sha256:
        return f"sha256 mismatch: recorded {entry.sha256}, found {digest.sha256}"
    if entry.sha256 is None and entry.git_sha1 is not None and digest.git_sha1 != entry.git_sha1:
        return f"git blob id mismatch: recorded {entry.git_sha1}, found {digest.git_sha1}"
    return None
