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

import json
import os
from collections.abc import Callable
from typing import Any

from ..errors import RankFetchError
from ..format.checkpoint import INDEX_NAME
from ..format.layout import PARTIAL_MARKER
from ..integrity.hashing import HashError, hash_file
from ..integrity.manifest import Manifest
from ..integrity.statcache import record_verified
from ..utils import format_ranges, human_bytes, write_atomic
from . import _dest
from ._pieces import looks_complete, tensor_spans
from ._rankplan import RankFetchPlan, ShardPlan, plan_rank_fetch, plan_shard, select_tensors
from ._result import RankFetchResult, dry_run_total, fetch_summary
from ._workers import fetch_outputs, fetch_run, load_shard_record, open_jobs
from .client import RetryPolicy
from .fetch import hub_origin, record_source, source_text

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
                                 f"{PARTIAL_NAME}); its shards would be replaced by subsets: fetch into another --local-dir")
        # Until this run succeeds the destination must not look like a complete checkpoint.
        for name in (PARTIAL_NAME, INDEX_NAME):
            _dest.unlink(os.path.join(dest_real, name))
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
            # shard is proven once verify checks it against a tensor-hash manifest
            files = plan.listing.files
            whole = [f for f in plan.files + [sp.path for sp in plan.shards if sp.whole] if f in files]
            record_verified(dest_real, {f: (files[f].sha256, files[f].git_sha1) for f in whole},
                            origin=hub_origin(plan.listing))
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
