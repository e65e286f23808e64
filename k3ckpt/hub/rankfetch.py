"""Rank-aware fetch: download only the tensors that some ranks of a TP/EP topology need.

This module writes ``--format partial`` (the hub's shards, each with only the selected tensors);
:mod:`k3ckpt.hub.nodefetch` writes ``--format node`` (``reshard``'s node directory) with the same
download machinery. Where each part lives:

- :mod:`k3ckpt.hub._rankplan`: planning (:func:`plan_rank_fetch`, :class:`ShardPlan`);
- :mod:`k3ckpt.hub._remote`: what planning reads of the hub, and the manifest checks;
- :mod:`k3ckpt.hub._pieces`: pieces, tasks, the ``.part`` and its journal;
- :mod:`k3ckpt.hub._workers`: the workers that fill the ``.part`` files, and the run around them;
- :mod:`k3ckpt.hub._result`: :class:`RankFetchResult` and the text both fetches print;
- here: the run of a partial fetch (:func:`run_rank_fetch`: its index and marker) and its text.

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
  selected tensors (see :mod:`k3ckpt.hub._rankplan`);
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
from pathlib import Path
from typing import Any

from ..errors import K3ckptError, RankFetchError
from ..format.checkpoint import INDEX_NAME
from ..format.layout import PARTIAL_MARKER
from ..format.topology import RankSelection
from ..integrity.hashing import HashError, Span, hash_file
from ..integrity.manifest import Manifest
from ..integrity.share import share_reference_key
from ..integrity.statcache import record_verified, record_written
from ..utils import format_ranges, human_bytes, write_atomic
from . import _dest
from ._pieces import looks_complete, tensor_spans
from ._rankplan import RankFetchPlan, ShardPlan, plan_rank_fetch, plan_shard, select_tensors
from ._result import RankFetchResult, dry_run_total, fetch_summary
from ._workers import fetch_outputs, fetch_run, load_shard_record, open_jobs
from .client import RetryPolicy, default_requests
from .fetch import LISTING_RECORD, OfflineCheck, hub_origin, manifest_origin, record_source, source_text, write_fetch_record

__all__ = [
    "PARTIAL_NAME",
    "RankFetchError",
    "RankFetchPlan",
    "RankFetchResult",
    "ShardPlan",
    "check_rank_offline",
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
#: What the offline check needs of a partial marker.
_PARTIAL_KEYS: dict[str, type] = {"topology": dict, "ranks": list}


def _complete(sp: ShardPlan, final: str, manifest: Manifest | None, written_from: str | None) -> bool:
    """Whether ``final`` already is this shard: size, header bytes, and then with a manifest every
    tensor's sha256 (read locally; nothing is downloaded for a complete shard), without one the
    record that it was written from this very source content (``written_from``)."""
    if not looks_complete(sp, final):
        return False
    if manifest is None:
        return written_from == sp.content_key()
    try:
        digest = hash_file(final, spans=tensor_spans(sp), whole=False)  # (the tensors are what is checked)
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
    workers: int | None = None,
    token: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    retry: RetryPolicy | None = None,
    check_space: bool = True,
) -> RankFetchResult:
    """Download ``plan`` into its destination: resumable, parallel, checked (see the module doc).

    Args:
        plan (`RankFetchPlan`): From :func:`plan_rank_fetch`.
        workers (`int`, *optional*): Concurrent requests [default: :func:`~k3ckpt.hub.client.default_requests`].
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
    workers = default_requests() if workers is None else workers
    with fetch_run(plan, workers, retry, names) as (result, dest_real, policy):
        if os.path.isfile(os.path.join(dest_real, INDEX_NAME)) and not os.path.lexists(os.path.join(dest_real, PARTIAL_NAME)):
            # an index without our marker: a whole checkpoint (or another tool's), whose shards
            # this run would replace with subsets
            raise RankFetchError(f"{dest_real} holds a checkpoint that is not a rank-aware fetch ({INDEX_NAME} and no "
                                 f"{PARTIAL_NAME}); its shards would be replaced by subsets: fetch into another --local-dir")
        # Until this run succeeds the destination must not look like a complete checkpoint.
        for name in (PARTIAL_NAME, INDEX_NAME):
            _dest.unlink(os.path.join(dest_real, name))
        _write_record(plan, dest_real)
        record = load_shard_record(dest_real)
        jobs, _ = open_jobs(dest_real, (sp for sp in plan.shards if not sp.whole),
                            lambda sp, final: _complete(sp, final, plan.manifest, record.get(sp.path)), result, workers)
        result.resumed = sorted(job.plan.path for job in jobs if job.done)  # (written ones are reported)
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
            # what proved the files fetched whole (the hub's sha256: docs/trust.md); a rewritten
            # shard, the manifest each of its tensors was hashed against as it arrived (without
            # one, nothing: verify against a tensor-hash manifest or the hub proves it later)
            files = plan.listing.files
            whole = [f for f in plan.files + [sp.path for sp in plan.shards if sp.whole] if f in files]
            record_verified(dest_real, {f: (files[f].sha256, files[f].git_sha1) for f in whole},
                            origin=hub_origin(plan.listing))
            if plan.manifest is not None:
                record_rewritten_proofs(dest_real, [sp.path for sp in plan.shards if not sp.whole],
                                        plan.manifest_label)
    return result


def record_rewritten_proofs(dest_real: str, shards: list[str], manifest_label: str | None) -> None:
    """Tell the stat cache that the rewritten ``shards`` of the partial copy at ``dest_real`` were
    just checked tensor by tensor against the manifest named ``manifest_label``: ``verify --quick``
    and ``preflight`` then carry that proof while their stat is unchanged (docs/trust.md)."""
    key = share_reference_key(0)  # a partial's marker lists no tensors
    record_written(dest_real, {p: {"share_ref": key, "share_issues": [], "proven": manifest_origin(manifest_label)}
                               for p in shards})


def _write_record(plan: RankFetchPlan, dest_real: str) -> None:
    """The record an offline re-run checks against: the files fetched whole (the hub's sha256),
    and per rewritten shard what a re-run online checks of it - its size, the sha256 of its
    header bytes and the content key :data:`SHARD_RECORD` holds once it is written."""
    rewritten = {sp.path: {"size": sp.size, "header_size": len(sp.prefix), "key": sp.content_key(),
                           "header_sha256": hashlib.sha256(sp.prefix).hexdigest()}
                 for sp in plan.shards if not sp.whole}
    write_fetch_record(Path(dest_real, LISTING_RECORD), plan.listing, plan.revision,
                       plan.files + [sp.path for sp in plan.shards if sp.whole], layout="partial",
                       extra={"rewritten": rewritten})


# ---------------------------------------------------------------------------------------------
# Offline (``HF_HUB_OFFLINE=1 k3ckpt fetch --ranks``)


def check_rank_offline(hub: str, repo: str, dest: str | os.PathLike[str] | None, selection: RankSelection, *,
                       cache_dir: str | os.PathLike[str] | None = None, revision: str | None = None,
                       manifest: Manifest | str | os.PathLike[str] | None = None, include: tuple[str, ...] = (),
                       exclude: tuple[str, ...] = (), jobs: int = 8) -> OfflineCheck:
    """Check, without contacting the hub, the partial checkpoint an earlier ``fetch --ranks``
    wrote in ``dest`` for ``selection``: :data:`PARTIAL_NAME` there and written for these ranks of
    this topology, the files fetched whole of the hub's sha256 (the record the fetch wrote before
    its first byte), each rewritten shard of its size and header and recorded as written from the
    source content it was planned from - with ``manifest``, every tensor of it hashed against the
    manifest instead - and the index listing the tensors of the shards. What a re-run online
    would skip, minus the hub. ``dest`` None: the fetch into the hub cache at ``cache_dir``,
    whose partial checkpoint is found by its selection and must be published
    (:func:`k3ckpt.hub.cache.unpublished`).

    Raises:
        OfflineNoRecordError: No record of a rank-aware fetch of ``repo`` (at ``revision``) in
            ``dest``, or its marker is of other ranks or another topology.
        TopologyError: ``selection`` means no topology (as online).
        ManifestError, RankFetchError: ``manifest`` unreadable, or without tensor hashes.
    """
    if dest is None:
        assert cache_dir is not None
        return _check_cached_offline(hub, repo, Path(cache_dir), selection, revision=revision, manifest=manifest,
                                     include=include, exclude=exclude, jobs=jobs)
    from concurrent.futures import ThreadPoolExecutor

    from . import _offline
    from .fetch import recorded_files

    sc = _offline.start_check(hub, repo, Path(dest), revision, layout="partial", marker_name=PARTIAL_NAME,
                              done_name=PARTIAL_NAME, marker_keys=_PARTIAL_KEYS,
                              selected=lambda m: (_requested_ranks(selection, m), _marker_ranks(m)),
                              other="other ranks", manifest=manifest, include=include, exclude=exclude, jobs=jobs)
    out, doc, man, label = sc.out, sc.doc, sc.manifest, sc.label
    if sc.marker is None:
        return out
    rewritten = {p: r for p, r in (doc.get("rewritten") or {}).items() if isinstance(r, dict)}
    real = os.path.realpath(out.dest)
    shard_record = load_shard_record(real)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        found = list(pool.map(lambda p: _offline_shard(real, p, rewritten[p], shard_record.get(p), man, label),
                              sorted(rewritten)))
    for p, why in zip(sorted(rewritten), found):
        if why is None:
            out.verified.append(p)
            if man is None:
                out.trusted.append(p)
        else:
            out.failed[p] = why
    if rewritten:
        out.detail = (f"{len(rewritten)} rewritten shards: " + ("every tensor hashed against the manifest"
                      if man is not None else "size, header and the record of what they were written from"))
        if man is None:
            out.unproven = ("no --manifest: the rewritten shards were checked for size, header and the record of the "
                            "source content they were written from, as a re-run online checks them, not read "
                            "(docs/trust.md); pass --manifest to hash every tensor")
    index_why = _offline_index(real, sorted(rewritten) + [p for p in sc.whole if p.endswith(".safetensors")])
    if index_why is not None:
        out.failed[INDEX_NAME] = index_why
    sc.check_whole(jobs)
    if out.ok:  # what proved the files fetched whole, as the fetch records it
        files = recorded_files(doc)
        record_verified(real, {f: (files[f].sha256, files[f].git_sha1) for f in sc.whole if f in files},
                        origin=hub_origin(sc.listing))
        if man is not None:  # every tensor of the rewritten shards was hashed against it just now
            record_rewritten_proofs(real, sorted(rewritten), label)
    return out


def _check_cached_offline(hub: str, repo: str, root: Path, selection: RankSelection, **kw: Any) -> OfflineCheck:
    """:func:`check_rank_offline` of a fetch into the cache at ``root``: the staged partial
    checkpoint of this selection (the staging folder is named by its key, which needs the
    expert count: each staged marker gives one), then its published snapshot."""
    from ..errors import OfflineNoRecordError
    from . import cache as hc
    from ._offline import read_marker

    include, exclude = kw["include"], kw["exclude"]
    staged = hc.repo_dir(hub, root, repo) / hc.RECORDS_DIR / "partial"  # partial_staging's folders
    for folder in sorted(staged.iterdir()) if staged.is_dir() else []:
        marker = read_marker(folder / PARTIAL_NAME, _PARTIAL_KEYS)
        if marker is None:
            continue
        selection.check()
        topo = selection.topology(int(marker["topology"].get("num_experts") or 1))
        if hc.partial_key(topo.to_json(), selection.select(topo), include, exclude) == folder.name:
            break
    else:
        raise OfflineNoRecordError(f"HF_HUB_OFFLINE is set and {hc.repo_dir(hub, root, repo)} holds no complete "
                                   f"rank-aware fetch of {hub}:{repo} for this selection (under {staged}): nothing to "
                                   "verify against (unset HF_HUB_OFFLINE to fetch)", path=staged)
    out = check_rank_offline(hub, repo, folder, selection, **kw)
    layout = hc.partial_layout(hub, root, repo, out.commit, folder.name)
    paths = sorted({*out.verified, *out.failed, PARTIAL_NAME} | ({INDEX_NAME} if (folder / INDEX_NAME).is_file() else set()))
    out.failed.update(hc.unpublished(layout, folder, paths))
    out.notes.append(f"snapshot: {layout.snapshot} (revision {layout.revision})")
    return out


def _requested_ranks(selection: RankSelection, marker: dict[str, Any]) -> str:
    """The ranks ``selection`` names, over the marker's expert count, in the words of :func:`ranks_text`."""
    selection.check()
    topo = selection.topology(int(marker["topology"].get("num_experts") or 1))
    return ranks_text(selection.select(topo), topo.ep, topo.tp, topo.world_size, topo.placement)


def _marker_ranks(marker: dict[str, Any]) -> str:
    t = marker["topology"]
    try:
        return ranks_text([int(r) for r in marker["ranks"]], int(t["ep"]), int(t["tp"]), int(t["world_size"]),
                          str(t["expert_placement"]))
    except (KeyError, TypeError, ValueError):
        return "a partial checkpoint whose marker names no topology"


def _offline_shard(dest_real: str, path: str, rec: dict[str, Any], written_from: str | None,
                   manifest: Manifest | None, label: str | None) -> str | None:
    """Why the rewritten shard ``path`` is not the one recorded, or None: a regular file of the
    recorded size and header bytes, recorded in :data:`SHARD_RECORD` as written from the planned
    source content; with a manifest, every tensor its header lists hashed to the manifest's."""
    final = os.path.join(dest_real, path)
    if not os.path.lexists(final):
        return "missing"
    if os.path.islink(final) or not os.path.isfile(final):
        return "not a regular file"
    try:
        size = os.path.getsize(final)
        with open(final, "rb") as f:
            head = f.read(int(rec.get("header_size") or 0))
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if size != rec.get("size"):
        return f"size {size} != recorded {rec.get('size')}"
    if hashlib.sha256(head).hexdigest() != rec.get("header_sha256"):
        return "its header is not the one the fetch wrote"
    if manifest is None:
        return None if written_from == rec.get("key") else "not recorded as complete (the fetch did not finish it)"
    from ..format.header import read_header

    try:
        header = read_header(final, path)
        spans = [Span(name, *header.absolute_range(name)) for name in header.tensors]
        digest = hash_file(final, spans=spans, whole=False)  # (the tensors are what is checked)
    except (HashError, K3ckptError, OSError) as e:
        return f"unreadable ({e})"
    for name, got in sorted((digest.spans or {}).items()):
        m = manifest.tensors.get(name)
        if m is None or m.sha256 != got:
            return (f"tensor {name!r} is not in the manifest {label}" if m is None else
                    f"tensor {name!r}: sha256 {got}, the manifest {label} says {m.sha256}")
    return None


def _offline_index(dest_real: str, shards: list[str]) -> str | None:
    """Why the index does not list exactly the tensors of ``shards`` (their headers), or None."""
    from ..format.header import read_header

    try:
        weight_map = json.loads(Path(dest_real, INDEX_NAME).read_bytes()).get("weight_map")
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError, AttributeError) as e:
        return f"unreadable ({e})"
    want: dict[str, str] = {}
    for p in shards:
        try:
            want.update(dict.fromkeys(read_header(Path(dest_real, p), p).tensors, p))
        except (K3ckptError, OSError):
            return None  # the shard itself is reported
    return None if weight_map == want else "does not list exactly the tensors of the shards"


# ---------------------------------------------------------------------------------------------
# Rendering (``k3ckpt fetch`` with --ranks or --node)


def _selection_text(plan: RankFetchPlan) -> str:
    t = plan.topology
    return ranks_text(plan.ranks, t.ep, t.tp, t.world_size, t.placement)


def ranks_text(ranks: list[int], ep: int, tp: int, world_size: int, placement: str) -> str:
    """``ranks A-B of ep E x tp T (world size W, P placement)``, as the summaries name ranks."""
    return (f"rank{'s' if len(ranks) > 1 else ''} {format_ranges(ranks)} of ep {ep} x tp {tp} "
            f"(world size {world_size}, {placement} placement)")


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
