"""Preflight's report: the rows (:class:`Check`), what the read test and the GPU query found, the
report itself, and its text table."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..format.checkpoint import Checkpoint
from ..format.topology import (
    Topology,
)
from ..utils import format_ranges
from .serve import UNGUARDED

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"

@dataclass
class Check:
    """One row of the report."""

    name: str
    status: str  # PASS / WARN / FAIL
    reason: str
    fix: str | None = None  # the command that fixes a FAIL (or a WARN, when there is one)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "reason": self.reason, "fix": self.fix,
                "details": self.details}


@dataclass
class ReadSpeed:
    """What ``--io-test`` measured."""

    bytes_read: int
    seconds: float
    readers: int
    direct: bool  # O_DIRECT throughout; False: buffered reads after POSIX_FADV_DONTNEED
    files: int
    note: str = ""

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"bytes_read": self.bytes_read, "seconds": round(self.seconds, 3), "readers": self.readers,
                "direct": self.direct, "files": self.files, "note": self.note,
                "bytes_per_second": int(self.bytes_per_second)}


@dataclass
class GpuDevice:
    index: int  # as the tool numbers it
    name: str
    total: int  # bytes
    used: int

    @property
    def free(self) -> int:
        return max(self.total - self.used, 0)


@dataclass
class PreflightReport:
    path: str
    layout: str  # "rank-layout" or "checkpoint"
    topology: dict[str, Any] | None
    ranks: list[int]
    selection: str  # how the ranks were chosen
    checks: list[Check] = field(default_factory=list)
    read_speed: ReadSpeed | None = None
    #: What this node loads: the weight files to read for ``--io-test`` and their bytes.
    load_files: list[Path] = field(default_factory=list, repr=False)
    node_bytes: int = 0
    fix_all: str | None = None  # one command for every broken rank, when several are
    engine: str | None = None  # the engine whose launch was checked (--engine)
    serve: list[str] | None = None  # that launch's command line for this node (:func:`serve_command`)
    guarded: bool = False  # the serve line loads with --load-format k3ckpt (vLLM's k3ckpt plugin)

    @property
    def ok(self) -> bool:
        """Nothing FAILs (WARNs allowed)."""
        return not any(c.status == FAIL for c in self.checks)

    @property
    def proven(self) -> bool:
        """The ``proof`` row passed: every byte this node loads is proven (docs/trust.md)."""
        return any(c.name == "proof" and c.status == PASS for c in self.checks)

    @property
    def verdict(self) -> str:
        """"ready to load" only when nothing FAILs and the bytes are proven."""
        return "not ready" if not self.ok else "ready to load" if self.proven else "loadable, not proven"

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (FAIL, WARN, PASS)}

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "layout": self.layout, "topology": self.topology, "ranks": self.ranks,
                "selection": self.selection, "ok": self.ok, "proven": self.proven, "verdict": self.verdict,
                "counts": self.counts(),
                "checks": [c.to_json() for c in self.checks], "fix_all": self.fix_all,
                "engine": self.engine, "serve": self.serve, "guarded": self.guarded,
                "read_speed": self.read_speed.to_json() if self.read_speed else None}


# ---------------------------------------------------------------------------------------------
# Fix commands


def describe_topology(topo: Topology) -> str:
    return (f"ep {topo.ep} x tp {topo.tp}, world size {topo.world_size} (moe_tp {topo.moe_tp}), "
            f"{topo.num_experts} experts {topo.placement}")


def reshard_command(src: str | None, out: Path, topo: Topology | None, ranks: list[int], *, force: bool) -> str:
    """The ``k3ckpt reshard`` invocation that (re)writes ``ranks`` of ``topo`` into ``out``.
    ``SRC`` stands for the source checkpoint when its path is unknown."""
    args = ["k3ckpt", "reshard", src or "SRC", "-o", str(out), "--format", "rank"]
    if topo is None:
        args += ["--ep", "E", "--tp", "T"]
    else:
        args += ["--ep", str(topo.ep), "--tp", str(topo.tp)]
        if topo.world_size != max(topo.ep, topo.tp):
            args += ["--world-size", str(topo.world_size)]
        if topo.placement != "linear":
            args += ["--placement", topo.placement]
        if ranks and len(ranks) < topo.world_size:
            args += ["--ranks", format_ranges(ranks)]
    if force:
        args.append("--force")
    placeholders = {"SRC", "E", "T"}
    return " ".join(a if a in placeholders else shlex.quote(a) for a in args)


def _fetch_head(hub: str | None, repo: str | None, revision: str | None, dest: Path) -> list[str]:
    """``k3ckpt fetch REPO_ID [--source S] [--revision R] --local-dir DEST``, in today's words
    (the positional repo, ``--local-dir``; ``--source`` only when it is not the default)."""
    args = ["k3ckpt", "fetch", repo or "REPO"]
    if hub and hub != "hf":
        args += ["--source", hub]
    if revision:
        args += ["--revision", revision]
    return args + ["--local-dir", str(dest)]


def _manifest_args(manifest: str | None) -> list[str]:
    """``--manifest M`` when the directory's last fetch verified against ``M`` and it is still
    there: the fix proves its bytes as that fetch did."""
    return ["--manifest", manifest] if manifest and Path(manifest).is_file() else []


def fetch_command(ckpt: Checkpoint, dest: Path, files: list[str], topo: Topology | None = None,
                  ranks: list[int] | None = None) -> str:
    """The ``k3ckpt fetch`` that restores ``files`` (every file when empty) of ``ckpt`` into
    ``dest`` - with ``topo`` and ``ranks``, the rank-aware fetch of just those ranks' tensors
    (with the manifest its last fetch used); ``REPO`` stands for the repository when the layout
    does not say."""
    src = ckpt.source
    args = _fetch_head(src.hub, src.repo, src.revision, dest)
    if topo is not None and ranks:
        args += ["--ep", str(topo.ep), "--tp", str(topo.tp)]
        if topo.world_size != max(topo.ep, topo.tp):
            args += ["--world-size", str(topo.world_size)]
        if topo.placement != "linear":
            args += ["--placement", topo.placement]
        args += ["--ranks", format_ranges(ranks), *_manifest_args(src.manifest)]
    for f in files:
        args += ["--include", f]
    return " ".join(a if a == "REPO" else shlex.quote(a) for a in args)


def hf_cache_repo(path: Path) -> Path | None:
    """The Hugging Face cache repo folder (``.../models--org--name``, holding ``blobs/``,
    ``snapshots/``, ``refs/``) that ``path`` is or lies in, else ``None``. Only the cache's own
    client writes there: a fix command never names it (or a snapshot) as an output."""
    for p in (path, *path.parents):
        if p.name.startswith(("models--", "datasets--", "spaces--")) and (p / "snapshots").is_dir():
            return p
    return None


def unused_sibling(path: Path, suffix: str) -> Path:
    """``<path>-<suffix>``, or ``-2``, ``-3``... after it: a directory that does not exist yet, so
    that a command writing there can overwrite nothing."""
    candidate = path.with_name(f"{path.name}-{suffix}")
    n = 2
    while candidate.exists() or candidate.is_symlink():
        candidate = path.with_name(f"{path.name}-{suffix}-{n}")
        n += 1
    return candidate


def new_output_dir(root: Path, suffix: str) -> Path:
    """Where a fix writes what ``root`` is not: a directory that does not exist yet, beside
    ``root`` (:func:`unused_sibling`) - or, when ``root`` is in a Hugging Face cache, beside the
    cache directory, never inside it (``<cache>-<name>-<suffix>``)."""
    cache = hf_cache_repo(root)
    if cache is not None:
        return unused_sibling(cache.parent, f"{cache.name.split('--')[-1]}-{suffix}")
    return unused_sibling(root, suffix)


def topology_suffix(topo: Topology) -> str:
    """A directory-name suffix naming ``topo`` (the options that differ from the defaults)."""
    parts = [f"ep{topo.ep}", f"tp{topo.tp}"]
    if topo.world_size != max(topo.ep, topo.tp):
        parts.append(f"ws{topo.world_size}")
    if topo.placement != "linear":
        parts.append(topo.placement.replace("_", "-"))
    return "-".join(parts)


def hf_download_command(repo: str | None, revision: str | None, files: list[str], *, cache_dir: Path | None = None,
                        local_dir: Path | None = None) -> str:
    """The Hugging Face client's own command that adds ``files`` (every missing file when empty)
    to a cache (``cache_dir``: it writes blobs and symlinks the cache's way and never replaces a
    file it has) or to a directory the client downloaded, or k3ckpt did not write
    (``local_dir``: only the named files, which are missing): k3ckpt writes into neither."""
    args = ["hf", "download", repo or "REPO", *files]
    if revision:
        args += ["--revision", revision]
    args += ["--cache-dir", str(cache_dir)] if cache_dir is not None else ["--local-dir", str(local_dir)]
    return " ".join(a if a == "REPO" else shlex.quote(a) for a in args)


def restore_command(ckpt: Checkpoint, root: Path, files: list[str]) -> str:
    """The command that adds the missing ``files`` (every missing file when empty) to the
    checkpoint at ``root``: ``hf download`` into a Hugging Face cache; :func:`fetch_command` into
    a directory k3ckpt fetched (a fetch adds what is missing and keeps what verifies); into any
    other directory (``hf download --local-dir``'s, a copy), which k3ckpt never writes, the
    client's ``hf download`` of just those files - or, for the whole checkpoint, a fetch into a
    new directory beside it."""
    from ..errors import OutputNotOwnedError
    from ..hub.fetch import check_destination

    cache = hf_cache_repo(root)
    if cache is not None:
        return hf_download_command(ckpt.source.repo, ckpt.source.revision, files, cache_dir=cache.parent)
    try:
        check_destination(root)
    except OutputNotOwnedError:
        if files:
            return hf_download_command(ckpt.source.repo, ckpt.source.revision, files, local_dir=root)
        return fetch_command(ckpt, new_output_dir(root, "fetched"), [])
    return fetch_command(ckpt, root, files)


def copy_command(source_dir: str | None, files: list[str], dest: Path) -> str:
    """``cp -n`` of ``files`` from the source checkpoint into ``dest`` (``-n``: never replaces a
    file already there); ``SRC`` stands for the source when its path is unknown."""
    src = [f"{source_dir}/{f}" if source_dir else f"SRC/{f}" for f in files]
    return " ".join(["cp", "-n", *(a if a.startswith("SRC/") else shlex.quote(a) for a in src),
                     shlex.quote(str(dest)) + "/"])


def node_reshard_command(src: str | None, out: Path, topo: Topology, node: int, gpus_per_node: int, *,
                         force: bool) -> str:
    """The ``k3ckpt reshard`` (node format, in vLLM's --tp/--dp vocabulary) that writes node
    ``node`` of ``topo`` under ``out``; ``force`` (only for ``out`` holding this very topology)
    rewrites the node even where sizes match. ``SRC`` stands for the source checkpoint when its
    path is unknown."""
    args = ["k3ckpt", "reshard", src or "SRC", "-o", str(out), "--tp", str(topo.tp), "--dp", str(topo.dp)]
    if topo.placement != "linear":
        args += ["--placement", topo.placement]
    args += ["--gpus-per-node", str(gpus_per_node), "--node", str(node)]
    if force:
        args.append("--force")
    return " ".join(a if a == "SRC" else shlex.quote(a) for a in args)


def node_fetch_command(source: dict[str, Any], dest: Path, topo: Topology, node: int, gpus_per_node: int) -> str:
    """The rank-aware ``k3ckpt fetch --node`` that turns ``dest`` into node ``node``'s share of
    ``topo``, in the node format's words (``--tp/--dp``: ep = tp x dp), verified against the
    manifest ``source`` records (it rewrites the files that differ and keeps the rest); ``REPO``
    stands for the repository when ``source`` does not name it."""
    def text(key: str) -> str | None:
        value = source.get(key)
        return value if isinstance(value, str) and value else None

    args = _fetch_head(text("hub"), text("repo"), text("revision"), dest)
    args += ["--tp", str(topo.tp), "--dp", str(topo.world_size // topo.tp)]
    if topo.placement != "linear":
        args += ["--placement", topo.placement]
    args += ["--node", str(node), "--gpus-per-node", str(gpus_per_node), *_manifest_args(text("manifest"))]
    return " ".join(a if a == "REPO" else shlex.quote(a) for a in args)


def preflight_command(root: Path, topo: Topology, *, engine: str | None = None, node: int | None = None,
                      gpus_per_node: int | None = None, ranks: list[int] | None = None) -> str:
    """The ``k3ckpt preflight`` of ``root`` for vLLM's expert-parallel launch of ``topo``
    (``--tp/--dp``: ep = tp x dp) - the check to run instead of one the launch cannot be."""
    args = ["k3ckpt", "preflight", str(root)] + (["--engine", engine] if engine else [])
    args += ["--tp", str(topo.tp), "--dp", str(topo.world_size // topo.tp)]
    if topo.placement != "linear":
        args += ["--placement", topo.placement]
    if node is not None and gpus_per_node is not None:
        args += ["--node", str(node), "--gpus-per-node", str(gpus_per_node)]
    elif ranks:
        args += ["--ranks", format_ranges(ranks)]
    return shlex.join(args)


def environment_fix(problem: str) -> str:
    """What to do about a launcher variable that disagrees (``problem`` starts with its name)."""
    var = problem.split("=", 1)[0].split()[0]
    return (f"correct {var} (the launcher's) or the option or directory it contradicts - the engine will follow "
            f"the launcher; --no-env only if these variables describe the allocation, not this job")


# ---------------------------------------------------------------------------------------------
# Text output


def render_preflight(rep: PreflightReport) -> str:
    """The table: one row per check, and under each FAIL (or WARN with one) its fix."""
    t = rep.topology
    what = {"rank-layout": "rank layout", "node-dir": "node directory"}.get(rep.layout, "checkpoint")
    topo = (f", ep {t['ep']} x tp {t['tp']}, world size {t['world_size']}" if t else "")
    ranks = f"ranks {format_ranges(rep.ranks)} ({rep.selection})" if rep.ranks else rep.selection
    lines = [f"preflight  {rep.path}", f"layout     {what}{topo}; {ranks}", ""]
    width = max((len(c.name) for c in rep.checks), default=8)
    for c in rep.checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.reason}")
        if c.fix and c.status != PASS:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    n = rep.counts()
    if rep.fix_all:
        lines += ["", f"fix all    {rep.fix_all}"]
    lines += ["", f"result     {n[FAIL]} FAIL, {n[WARN]} WARN, {n[PASS]} PASS: {rep.verdict}"]
    if rep.serve and rep.engine == "vllm" and not rep.guarded:
        lines.append(f"note       {UNGUARDED}")
    if rep.serve:  # last, so that a script can take it with tail -n 1
        lines.append(f"serve      {shlex.join(rep.serve)}")
    return "\n".join(lines)
