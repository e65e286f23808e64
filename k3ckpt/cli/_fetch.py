"""``k3ckpt fetch``: download a checkpoint, whole or only what some ranks need."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from ..errors import EXIT_PROBLEMS
from ..format.topology import RankSelection
from ._options import (
    CONTEXT,
    aliased_option,
    handle_errors,
    jobs_option,
    json_option,
    max_shard_size_option,
    repo_id_of,
    revision_option,
    size_option,
    token_option,
    topology_options,
)
from ._output import ByteProgress, emit_json


@click.command(context_settings=CONTEXT)
@click.argument("repo_id", required=False, metavar="REPO_ID")
@click.argument("files", nargs=-1, metavar="[FILES]...")
@click.option("--source", "hub", type=click.Choice(["hf", "modelscope"]), default="hf", show_default=True,
              help="Which hub.")
@click.option("--repo", "repo_option", hidden=True, help="REPO_ID (the name in 0.1, kept for a release).")
@revision_option("the download is pinned to the resolved commit")
@aliased_option("--local-dir", "dest", aliases=("--dest",), type=click.Path(file_okay=False, path_type=str),
                help="Download into this directory: the repo's files at their paths (a plain checkpoint directory "
                     "the other commands read) [default: the hub's cache, see --cache-dir].")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=str),
              help="Write the hub's cache layout here, which its client and the engines read offline [default "
                   "without --local-dir: the hub's own cache: HF_HUB_CACHE / HF_HOME/hub / ~/.cache/huggingface/hub, "
                   "MODELSCOPE_CACHE / ~/.cache/modelscope].")
@click.option("--include", multiple=True, help="Only files matching this pattern (repeatable; rank-aware: filters the "
                                               "non-weight files). As hf download: fnmatch on the whole path, `*` "
                                               "crosses `/`, `dir/` is everything under dir. Patterns leaving no file "
                                               "are refused.")
@click.option("--exclude", multiple=True, help="Skip files matching this pattern (repeatable; as --include).")
@token_option()
@jobs_option("Concurrent requests (files and chunks of large files) [default: one per two cores, at least 8, at "
             "most 32].", show_max_workers=True)
@size_option("--chunk-size", default="256MiB", help="Large files are fetched in chunks of this size, in parallel.")
@click.option("--endpoint", help="Hub endpoint [default: HF_ENDPOINT / MODELSCOPE_ENDPOINT, else the public hub].")
@topology_options(ep="Rank-aware: expert-parallel degree (--format node: the world size, its default).",
                  tp="Rank-aware: tensor-parallel degree of dense weights.",
                  dp="Rank-aware: data-parallel degree: world size = tp x dp (vLLM's expert parallel: ep = tp x dp).",
                  world_size="Rank-aware: ranks in all [default: tp x dp with --dp, else max(ep, tp)].",
                  placement="Rank-aware: expert placement [default: linear].",
                  ranks="Rank-aware: fetch only what these ranks need, e.g. 0-3,8.",
                  node="Rank-aware: fetch only what this node's ranks need.",
                  gpus_per_node="Rank-aware: ranks per node (for --node) [default with --format node: the world "
                                "size, one node].")
@click.option("--format", "layout", type=click.Choice(["node", "partial"]),
              help="Rank-aware: node: write the node directory reshard writes (its node-NNNNN/: same files, same "
                   "bytes) [default with --node]; partial: the hub's shards with only the selected tensors, plus "
                   "k3ckpt-partial.json [default with --ranks].")
@max_shard_size_option("--format node: node files of at most this size, header included (reshard's default, so "
                       "both write the same files).")
@click.option("--manifest", "manifest_path", type=click.Path(dir_okay=False, path_type=str),
              help="Rank-aware: verify every fetched tensor against this tensor-hash manifest.")
@click.option("--require-proof", is_flag=True,
              help="Refuse (before any byte) a rank-aware fetch that could not prove its bytes: one without --manifest.")
@click.option("--dry-run", is_flag=True, help="List what would be downloaded and how many bytes; download nothing "
              "(a destination the run would refuse is refused the same way).")
@json_option("Machine-readable summary.")
@click.option("-v", "--verbose", is_flag=True, help="Name every file as it completes.")
@handle_errors
def fetch(repo_id: str | None, files: tuple[str, ...], hub: str, repo_option: str | None, revision: str | None,
          dest: str | None, cache_dir: str | None, include: tuple[str, ...], exclude: tuple[str, ...],
          token: str | None, jobs: int | None, chunk_size: int, endpoint: str | None, selection: RankSelection,
          layout: str | None, max_shard_size: int, manifest_path: str | None, require_proof: bool, dry_run: bool,
          as_json: bool, verbose: bool) -> None:
    """Download a checkpoint from Hugging Face or ModelScope: resumable, parallel, verified.

    The vocabulary of `hf download` (and `modelscope download`): REPO_ID, then optionally
    FILES - paths, globs or directories ending in `/`, fetched instead of the whole repo (each
    must match a file) - and --local-dir, --revision, --include/--exclude (huggingface_hub's
    pattern rules), --token, --max-workers. --source defaults to hf. --repo, --dest and
    --workers, the names of k3ckpt 0.1, still work.

    Metadata comes through the real client (HF_ENDPOINT, HF_TOKEN or a saved login,
    MODELSCOPE_ENDPOINT / MODELSCOPE_DOMAIN and MODELSCOPE_API_TOKEN are honoured; --token
    overrides the token); bytes come through k3ckpt's own ranged downloader: several files at
    once, large files in parallel chunks written in place, a journal of finished chunks so an
    interrupted run resumes where it stopped, every file's sha256 checked before it is renamed
    into place. Files already present and verified are skipped. Exits 1 and lists every file
    it could not fetch.

    Where: by default into the hub's own cache, in its layout (Hugging Face:
    models--org--name/ with blobs/, snapshots/<commit>/ links and refs/<revision>; ModelScope:
    models/org--name/snapshots/<revision>/), so that the hub's client - and vLLM, SGLang and
    transformers through it - finds the files offline; --cache-dir names another cache;
    --local-dir (alias --dest) writes a plain directory instead. With HF_HUB_OFFLINE=1 nothing
    is fetched: what an earlier run of the same fetch put there is verified against what it
    recorded - the hub's listing; for --node, k3ckpt-node.json too; for --ranks, the rewritten
    shards' records - without contacting the hub (exit 0 when complete, 1 naming what is
    missing or damaged, 2 when there is no such record).

    Rank-aware (--node or --ranks with --tp/--dp/--ep; --ranks or --node without a topology
    is refused, not read as one rank holding everything): reads every shard's header, then
    downloads only the tensors those ranks need (whole tensors; the saving is the routed
    experts other ranks own). --format node (the default with --node) writes the --local-dir
    as the node directory `reshard --node N` writes as OUT/node-NNNNN/ - same files, same
    bytes: dense files, each rank's expert files, the index, the non-weight files,
    k3ckpt-node.json and READY last - ready for vLLM --enable-expert-parallel
    --enable-ep-weight-filter, with the topology read as vLLM's expert parallel (ep = tp x dp).
    --format partial (the default with --ranks) rewrites each hub shard with just the selected
    tensors under its own name, plus a matching index, the non-weight files and
    k3ckpt-partial.json (written last); reshard and verify accept it. The hub's sha256 covers
    whole files, so new files are verified tensor by tensor against --manifest (a tensor-hash
    manifest: `k3ckpt manifest pull REPO_ID --tensor-hashes -o M`, before the download; a plain
    manifest has no tensor hashes and is refused); without it only structure and sizes are
    checked, and it says so.

    \b
    Examples:
      k3ckpt fetch moonshotai/Kimi-K3 --cache-dir /nvme/hf-cache
      k3ckpt fetch moonshotai/Kimi-K3 --local-dir /nvme/Kimi-K3
      k3ckpt fetch moonshotai/Kimi-K3 config.json tokenizer_config.json --local-dir ./k3
      k3ckpt fetch moonshotai/Kimi-K3 --source modelscope --local-dir /nvme/Kimi-K3 --max-workers 16
      k3ckpt fetch moonshotai/Kimi-K3 --local-dir ./k3 --include '*.json' --include 'tokenizer*'
      k3ckpt fetch moonshotai/Kimi-K3 --local-dir ./k3 --dry-run
      k3ckpt manifest pull moonshotai/Kimi-K3 --tensor-hashes -o kimi-k3.tensors.json
      k3ckpt fetch moonshotai/Kimi-K3 --local-dir /nvme/k3-node1 --tp 8 --dp 2 --node 1 --gpus-per-node 8 \\
          --manifest kimi-k3.tensors.json
      k3ckpt fetch moonshotai/Kimi-K3 --local-dir ./k3-r0 --ep 8 --ranks 0 --manifest kimi-k3.tensors.json
    """
    from ..hub.client import default_requests
    from ..hub.fetch import check_destination, fetch_json, plan_fetch, render_fetch, render_fetch_plan, run_fetch

    repo = repo_id_of(repo_id, repo_option)
    jobs = default_requests() if jobs is None else jobs
    if files and (include or exclude):
        # hf download warns and ignores the patterns; a selection half-applied is not ours to guess
        raise click.UsageError("FILES and --include/--exclude both select files: give one of them")
    sel = selection
    rank_aware = sel.names_topology or sel.ranks is not None or sel.node is not None
    if dest is not None and cache_dir is not None:
        raise click.UsageError("--local-dir and --cache-dir name two destinations: give one")
    offline = _offline()
    if offline and not rank_aware:
        # FILES select as patterns do here: the recorded listing is checked, not the hub asked
        _check_offline(hub, repo, revision, dest, cache_dir, include or files, exclude, jobs, as_json)
        return
    if rank_aware and require_proof and manifest_path is None:
        raise click.UsageError("--require-proof: a rank-aware fetch without --manifest checks the files it assembles "
                               "from tensors for structure and sizes only (docs/trust.md); give a tensor-hash "
                               "manifest (k3ckpt manifest pull REPO_ID --tensor-hashes -o M, then --manifest M)")
    if rank_aware:
        if sel.ranks is None and sel.node is None:
            raise click.UsageError("rank-aware fetch needs --ranks or --node (all ranks need the whole checkpoint: "
                                   "drop --ep/--tp/--world-size for a full fetch)")
        if files:
            raise click.UsageError("FILES is for a plain fetch; a rank-aware fetch takes the weights its ranks need "
                                   "(--include/--exclude filter the other files)")
        layout = layout or ("partial" if sel.ranks is not None else "node")
        run = _Run(hub, repo, revision, dest, include, exclude, token, jobs, chunk_size, endpoint, sel, manifest_path,
                   dry_run, as_json, verbose)
        if layout == "node":
            if sel.ranks is not None:
                raise click.UsageError("--format node writes whole nodes: give --node N (or --format partial for "
                                       "--ranks)")
            if dest is None:
                # its files are renamed and regrouped (dense, per-rank experts): not a snapshot of the repo
                raise click.UsageError("a node directory (--format node) is not a snapshot of the repo, so it is not "
                                       "written into a hub cache: give --local-dir DIR, or --format partial to "
                                       "publish the ranks' share in the cache under a k3ckpt revision")
            if offline:
                _check_share_offline(run, "node", None)
            else:
                _fetch_node(run, max_shard_size)
            return
        if offline:
            _check_share_offline(run, "partial", cache_dir)
        elif dest is None:
            _fetch_ranks_to_cache(run, cache_dir)
        else:
            _fetch_ranks(run)
        return
    for flag, given in (("--placement", sel.placement), ("--gpus-per-node", sel.gpus_per_node),
                        ("--manifest", manifest_path), ("--format", layout)):
        if given is not None:
            raise click.UsageError(f"{flag} is for a rank-aware fetch: add --ranks or --node with --ep/--tp")

    from ..hub.cache import default_cache_dir

    if dest is None and cache_dir is None:
        cache_dir = str(default_cache_dir(hub))
    plan = plan_fetch(hub, repo, dest, cache_dir=cache_dir, revision=revision, include=include, exclude=exclude,
                      endpoint=endpoint, token=token, files=files)
    if dry_run:
        if plan.cache is None:  # a cache is shared with the hub clients: no claim on it
            check_destination(plan.dest)
        if as_json:
            emit_json(plan.to_json())
        else:
            click.echo(render_fetch_plan(plan))
        return
    with ByteProgress(not as_json, "fetching") as bar:
        res = run_fetch(plan, workers=jobs, chunk_size=chunk_size, token=token, progress=bar, on_plan=bar.plan)
    if as_json:
        emit_json(fetch_json(plan, res))
    else:
        click.echo(render_fetch(plan, res, verbose=verbose))
        for note in res.notes:  # about the run, not the files: on stderr, like the progress bar
            click.echo(f"  note: {note}", err=True)
    if not res.ok:
        sys.exit(EXIT_PROBLEMS)


def _offline() -> bool:
    """``HF_HUB_OFFLINE`` as the Hugging Face client read it. The ModelScope client has no offline
    switch of its own; vLLM passes ``HF_HUB_OFFLINE`` to it as ``local_files_only``, so it applies
    to both sources here."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _check_offline(hub: str, repo: str, revision: str | None, dest: str | None, cache_dir: str | None,
                   include: tuple[str, ...], exclude: tuple[str, ...], workers: int, as_json: bool) -> None:
    """``fetch`` under ``HF_HUB_OFFLINE=1``: verify what is there against the recorded listing,
    never contacting the hub; exit 1 when a file is missing or damaged."""
    from ..hub.cache import default_cache_dir
    from ..hub.fetch import check_offline

    if dest is None and cache_dir is None:
        cache_dir = str(default_cache_dir(hub))
    _emit_offline(check_offline(hub, repo, local_dir=dest, cache_dir=cache_dir, revision=revision, include=include,
                                exclude=exclude, jobs=workers), as_json)


def _check_share_offline(r: _Run, layout: str, cache_dir: str | None) -> None:
    """A rank-aware ``fetch`` under ``HF_HUB_OFFLINE=1``: check the node directory or partial
    checkpoint an earlier run of the same command wrote (:func:`k3ckpt.hub.nodefetch.check_node_offline`,
    :func:`k3ckpt.hub.rankfetch.check_rank_offline`), never contacting the hub."""
    kw: dict[str, Any] = dict(revision=r.revision, manifest=r.manifest_path, include=r.include, exclude=r.exclude,
                              jobs=r.jobs)
    if layout == "node":
        from ..hub.nodefetch import check_node_offline

        assert r.dest is not None
        res = check_node_offline(r.hub, r.repo, r.dest, r.selection, **kw)
    else:
        from ..hub.cache import default_cache_dir
        from ..hub.rankfetch import check_rank_offline

        root = cache_dir if cache_dir is not None or r.dest is not None else str(default_cache_dir(r.hub))
        res = check_rank_offline(r.hub, r.repo, r.dest, r.selection, cache_dir=root, **kw)
    _emit_offline(res, r.as_json)


def _emit_offline(res: Any, as_json: bool) -> None:
    """An offline check's result (text or JSON; its notes on stderr); exit 1 when it failed."""
    if as_json:
        emit_json(res.to_json())
    else:
        click.echo(res.render())
        for note in res.notes:
            click.echo(f"  note: {note}", err=True)
    if not res.ok:
        sys.exit(EXIT_PROBLEMS)


@dataclass(frozen=True)
class _Run:
    """What the rank-aware and node fetches are asked, as the command received it."""

    hub: str
    repo: str
    revision: str | None
    dest: str | None  # None: into a hub cache
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    token: str | None
    jobs: int
    chunk_size: int
    endpoint: str | None
    selection: RankSelection
    manifest_path: str | None
    dry_run: bool
    as_json: bool
    verbose: bool


def _fetch_ranks(r: _Run) -> None:
    """``k3ckpt fetch`` with a rank selection: see :mod:`k3ckpt.hub.rankfetch`."""
    from ..hub import rankfetch as rf

    assert r.dest is not None  # a fetch into a cache goes to _fetch_ranks_to_cache
    plan = rf.plan_rank_fetch(r.hub, r.repo, r.dest, r.selection, revision=r.revision, endpoint=r.endpoint,
                              token=r.token, manifest=r.manifest_path, include=r.include, exclude=r.exclude,
                              chunk_size=r.chunk_size, jobs=r.jobs)
    _run_planned(r, plan, rf.render_rank_fetch_plan, rf.run_rank_fetch, rf.render_rank_fetch, rf.rank_fetch_json)


def _fetch_ranks_to_cache(r: _Run, cache_dir: str | None) -> None:
    """``k3ckpt fetch --ranks ... --cache-dir C`` (``--format partial``): the partial checkpoint
    is fetched into a k3ckpt folder of the cache, then published as a snapshot of its own under
    the ref ``k3ckpt-partial-<key>`` (:func:`k3ckpt.hub.cache.publish_partial`)."""
    from pathlib import Path

    from ..format.checkpoint import INDEX_NAME
    from ..format.layout import PARTIAL_MARKER
    from ..hub import cache as hc
    from ..hub import rankfetch as rf

    root = Path(cache_dir) if cache_dir is not None else hc.default_cache_dir(r.hub)
    plan = rf.plan_rank_fetch(r.hub, r.repo, root, r.selection, revision=r.revision, endpoint=r.endpoint,
                              token=r.token, manifest=r.manifest_path, include=r.include, exclude=r.exclude,
                              chunk_size=r.chunk_size, jobs=r.jobs)
    # named after the resolved selection (--ranks 0-3 and 0,1,2,3 are one snapshot)
    key = hc.partial_key(plan.topology.to_json(), plan.ranks, r.include, r.exclude)
    staging = plan.dest = hc.partial_staging(r.hub, root, r.repo, key)
    if r.dry_run:
        if r.as_json:
            emit_json(plan.to_json())
        else:
            click.echo(rf.render_rank_fetch_plan(plan))
        return
    with ByteProgress(not r.as_json, "fetching") as bar:
        res = rf.run_rank_fetch(plan, workers=r.jobs, token=r.token, progress=bar, on_plan=bar.plan)
    published = None
    if res.ok:
        paths = [s.path for s in plan.shards] + list(plan.files) + [PARTIAL_MARKER]
        paths += [INDEX_NAME] if (staging / INDEX_NAME).is_file() and INDEX_NAME not in paths else []
        published, failed = hc.publish_partial(r.hub, root, r.repo, plan.listing.revision, key, staging,
                                               sorted(set(paths)))
        res.failed.update(failed)
    if r.as_json:
        doc = rf.rank_fetch_json(plan, res)
        if published is not None:
            doc.update(snapshot=str(published.snapshot), snapshot_revision=published.revision)
        emit_json(doc)
    else:
        click.echo(rf.render_rank_fetch(plan, res, verbose=r.verbose))
        if published is not None and res.ok:
            click.echo(f"snapshot: {published.snapshot} (revision {published.revision}: pass it as --revision to the "
                       "engine or snapshot_download; the hub's own revisions are untouched)")
    if not res.ok:
        sys.exit(EXIT_PROBLEMS)


def _fetch_node(r: _Run, max_shard_size: int) -> None:
    """``k3ckpt fetch --node N`` (``--format node``): see :mod:`k3ckpt.hub.nodefetch`."""
    from ..hub import nodefetch as nf

    assert r.dest is not None  # refused into a cache by the caller
    plan = nf.plan_node_fetch(r.hub, r.repo, r.dest, r.selection, revision=r.revision, endpoint=r.endpoint,
                              token=r.token, manifest=r.manifest_path, include=r.include, exclude=r.exclude,
                              chunk_size=r.chunk_size, max_file_size=max_shard_size, jobs=r.jobs)
    _run_planned(r, plan, nf.render_node_fetch_plan, nf.run_node_fetch, nf.render_node_fetch, nf.node_fetch_json)


def _run_planned(r: _Run, plan: Any, render_plan: Callable[[Any], str], run: Callable[..., Any],
                 render: Callable[..., str], to_json: Callable[[Any, Any], dict[str, Any]]) -> None:
    """The rank-aware and node fetches once planned: the dry run's plan, or the run with a
    progress bar, then its summary (text or JSON); exit 1 when a file failed."""
    if r.dry_run:
        from ..hub.fetch import check_destination

        check_destination(plan.dest)
        if r.as_json:
            emit_json(plan.to_json())
        else:
            click.echo(render_plan(plan))
        return
    with ByteProgress(not r.as_json, "fetching") as bar:
        res = run(plan, workers=r.jobs, token=r.token, progress=bar, on_plan=bar.plan)
    if res.ok and r.manifest_path is not None:
        from ..hub.fetch import record_manifest

        record_manifest(plan.dest, r.manifest_path)  # for the commands that fetch more of it
    if r.as_json:
        emit_json(to_json(plan, res))
    else:
        click.echo(render(plan, res, verbose=r.verbose))
    if not res.ok:
        sys.exit(EXIT_PROBLEMS)


COMMANDS = [fetch]
