"""Running a reshard: :func:`run_reshard` writes a plan's units under ``OUT`` (:func:`reshard`
plans, then runs). This is where a run starts and ends:

- the output: new, empty or an earlier reshard's (:func:`k3ckpt.utils.ownership.claim_output_dir`;
  files k3ckpt did not write are refused, ``--force`` included), under ``OUT/.k3ckpt-output.lock``
  for the whole run, with free space for the bytes still to write checked first; on ENOSPC the
  run's temporary files are removed and the shortfall is named;
- ``OUT/topology.json`` of a different topology or source is refused (exit 2) unless ``--force``;
- the units already complete are skipped (:mod:`~k3ckpt.deploy.reshard.units`), the others
  cleared and handed to the writers (:mod:`~k3ckpt.deploy.reshard.write`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ...env import K3CKPT_HASH_BUFFER
from ...errors import ReshardError
from ...format.checkpoint import Checkpoint
from ...format.layout import READY_NAME, TOPOLOGY_NAME
from ...format.topology import RankSelection
from ...integrity.statcache import record_written, recorded_proofs
from ...utils import copy_files, fsync_dir, human_bytes, is_within, write_atomic
from ...utils.ownership import claim_output_dir, locked_output_dir
from ...utils.space import free_bytes, require_free_space, space_margin
from ..bytecopy import NO_SPACE, output_lock, tmp_name
from .plan import ALIGN, DEFAULT_MAX_FILE_SIZE, NodePlan, RankPlan, ReshardPlan, plan_reshard
from .result import ReshardResult
from .units import _clear_old_layout, _manifest_matches, _old_units
from .write import _OutOfSpace, _write_units, manifest_digests, verified_manifest_digests

if TYPE_CHECKING:
    from ...integrity.manifest import Manifest


def run_reshard(
    plan: ReshardPlan,
    out: str | os.PathLike[str],
    *,
    jobs: int | None = None,
    force: bool = False,
    mode: str = "kernel",
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    check_space: bool = True,
    manifest: Manifest | None = None,
) -> ReshardResult:
    """Write the ranks (or nodes, with ``--format node``) of ``plan`` under ``out``.
    ``mode``: ``kernel`` (copy_file_range for contiguous runs, falling back as needed) or
    ``buffered`` (pread/pwrite only). ``check_space``: refuse up front when the filesystem has
    less free space than the bytes still to write plus a margin. ``manifest``: a source
    manifest with tensor hashes; whole tensors of source files verified against it take their
    digests from it instead of being hashed (:func:`~k3ckpt.deploy.reshard.write.manifest_digests`).
    Without it, the manifest a full ``verify --manifest`` of the source last used, when it is
    still those bytes (:func:`~k3ckpt.deploy.reshard.write.verified_manifest_digests`).

    ``out`` must be new, empty, or an earlier reshard's output holding nothing else
    (:func:`k3ckpt.utils.ownership.claim_output_dir`); the run holds ``out``'s lock throughout.

    Raises:
        ReshardError: ``out`` holds another topology or source (without ``force``); a write
            failed (disk full: the temporary files are removed and the shortfall named);
            ``manifest`` has no tensor hashes.
        OutputNotOwnedError: ``out`` holds files k3ckpt did not write, or another command's.
        OutputLockedError: another reshard or unshard is writing into ``out``.
        DiskSpaceError: not enough free space (checked before any byte is written).
    """
    t0 = time.perf_counter()
    hash_step = K3CKPT_HASH_BUFFER.get()  # a bad value is refused before OUT is made
    # before anything is written: a manifest without tensor hashes is refused with OUT untouched
    known = manifest_digests(plan.ckpt, manifest) if manifest is not None else {}
    used = "--manifest" if manifest is not None else None
    if manifest is None:  # the documented flow (verify --manifest, then reshard) needs no flag
        used, known = verified_manifest_digests(plan.ckpt)
    outp = Path(out)
    src = plan.ckpt.root
    if is_within(outp, src):
        what = "is" if outp.resolve() == src.resolve() else "is inside"
        raise ReshardError(f"{outp}: the output directory {what} the source checkpoint {src}")
    if is_within(src, outp):
        raise ReshardError(f"{outp}: the output directory contains the source checkpoint {src}")
    if outp.exists() and not outp.is_dir():
        raise ReshardError(f"{outp}: exists and is not a directory")
    # (a refusal before the first byte - disk space, another topology - leaves no directory it made)
    with locked_output_dir(outp, output_lock(outp, "reshard")), _gc_frozen():
        entries = [TOPOLOGY_NAME, *(rp.dir_name for rp in plan.units)]
        if plan.layout == "rank":
            entries += plan.extra_files
        claim_output_dir(outp, "reshard", entries)
        res = _run_locked(plan, outp, t0, jobs=jobs, force=force, mode=mode, progress=progress, on_plan=on_plan,
                          check_space=check_space, known=known, hash_step=hash_step)
    if res.digests_from_manifest:
        res.digests_manifest = used
    return res


def reshard(
    source: str | os.PathLike[str] | Checkpoint,
    out: str | os.PathLike[str],
    selection: RankSelection = RankSelection(),
    *,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    jobs: int | None = None,
    force: bool = False,
    align: int = ALIGN,
    mode: str = "kernel",
    layout: str = "node",
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
    check_space: bool = True,
    manifest: Manifest | None = None,
) -> ReshardResult:
    """Plan and write: :func:`~k3ckpt.deploy.reshard.plan.plan_reshard` then :func:`run_reshard`."""
    plan = plan_reshard(source, selection, max_file_size=max_file_size, align=align, layout=layout)
    return run_reshard(plan, out, jobs=jobs, force=force, mode=mode, progress=progress, on_plan=on_plan,
                       check_space=check_space, manifest=manifest)


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Keep every object that exists now (the plan: ~10^5 acyclic tuples per 10^4 tensors,
    made while the GC was paused, so all still in its youngest generation) out of the cyclic
    GC's passes while the files are written, and hand them back to it afterwards. Without this
    the first passes of the run re-walk the whole plan, on the thread that finishes units:
    ~0.06 CPU-s per 1 GB test shape. A program that froze objects itself (say, before forking)
    keeps its freeze: then nothing is done (unfreezing would hand its objects back too)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run_locked(plan: ReshardPlan, outp: Path, t0: float, *, jobs: int | None, force: bool, mode: str,
                progress: Callable[[int], None] | None, on_plan: Callable[[int], None] | None, check_space: bool,
                known: dict[str, str], hash_step: int) -> ReshardResult:
    topo_json = plan.topology_json()
    tpath = outp / TOPOLOGY_NAME
    old_units: list[Path] | None = None  # the unit directories of another layout, to replace (--force)
    if tpath.exists():
        try:
            old = json.loads(tpath.read_text())
        except (OSError, ValueError):
            old = None
        keys = ("format", "world_size", "ep", "tp", "moe_tp", "expert_placement", "num_experts", "experts_by_rank",
                "gpus_per_node")
        if (not isinstance(old, dict) or any(old.get(k) != topo_json.get(k) for k in keys)
                or (old.get("source") or {}).get("index_sha256") != topo_json["source"]["index_sha256"]):
            if not force:
                raise ReshardError(f"{outp} holds a different topology or source ({TOPOLOGY_NAME}); "
                                   f"use another directory or --force")
            old_units = _old_units(outp)

    todo: list[RankPlan | NodePlan] = []
    skipped: list[int] = []
    for rp in plan.units:
        if old_units is None and not force and _manifest_matches(outp / rp.dir_name, rp, plan.source_json):
            skipped.append(rp.unit)
        else:
            todo.append(rp)
    total = sum(f.size for rp in todo for f in rp.files)
    if check_space:  # before the old layout goes: a refused run keeps it
        freed = old_units if old_units is not None else [outp / rp.dir_name for rp in todo]
        _check_space(plan, outp, todo, sum(_allocated(d) for d in freed))
    if old_units is not None:
        _clear_old_layout(outp, old_units)

    try:
        write_atomic(tpath, (json.dumps(topo_json, indent=2) + "\n").encode())
        if plan.layout == "rank":  # (in OUT itself, which a re-run does not clear: before any writer)
            copy_files(plan.ckpt.root, plan.extra_files, outp)
            # each copy carries its source's proof (a node directory's copies get theirs with the unit)
            record_written(outp, {rel: {"proven": o} for rel, o in recorded_proofs(plan.ckpt.root, plan.extra_files).items()})
        for rp in todo:
            rdir = outp / rp.dir_name
            if rdir.exists():
                shutil.rmtree(rdir)  # an incomplete or stale rank is rewritten from scratch
            rdir.mkdir(parents=True)

        def copy_extra_files() -> None:
            # Each node directory is a checkpoint of its own: its config, tokenizer and licence
            # (each copy fsync'd with its directory, ~20 ms for two nodes) are copied while the
            # writers start on the weights, not before. Before any node is finished, so a node
            # with READY has them; a node without is cleared by the re-run, temporaries and all.
            if plan.layout == "node":
                for rp in todo:
                    copy_files(plan.ckpt.root, plan.extra_files, outp / rp.dir_name)

        if on_plan is not None:
            on_plan(total)
        written = _write_units(plan, outp, todo, jobs=jobs, mode=mode, progress=progress, known=known,
                               hash_step=hash_step, meanwhile=copy_extra_files)
    except _OutOfSpace as e:
        raise _out_of_space(plan, outp, todo, e.where, e.strerror) from None
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        raise _out_of_space(plan, outp, todo, Path(e.filename or outp), e.strerror or str(e)) from None
    fsync_dir(outp)
    from_manifest = len({t.name for rp in todo for f in rp.files for t in f.tensors if t.key == (t.name, None)}
                        & known.keys())
    return ReshardResult(outp, topo_json, [rp.unit for rp in todo], skipped, written,
                         time.perf_counter() - t0, list(plan.extra_files), plan.layout, from_manifest)


def _extra_bytes(plan: ReshardPlan) -> int:
    return sum(plan.ckpt.path_of(f).stat().st_size for f in plan.extra_files)


def _allocated(path: Path) -> int:
    """Bytes the files under ``path`` occupy (what removing them gives back)."""
    n = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return n


def _to_write(plan: ReshardPlan, todo: Sequence[RankPlan | NodePlan]) -> int:
    """Bytes the ``todo`` units (and the non-weight files) take once written."""
    extra = _extra_bytes(plan)
    return sum(rp.nbytes for rp in todo) + (extra * len(todo) if plan.layout == "node" else extra)


def _check_space(plan: ReshardPlan, outp: Path, todo: Sequence[RankPlan | NodePlan], reclaim: int) -> None:
    """Refuse before any byte is written when the units to write (less ``reclaim``, what removing
    the directories they replace frees) do not fit, with :func:`~k3ckpt.utils.space.space_margin`
    to spare."""
    if not todo:
        return
    needed = _to_write(plan, todo)
    unit = "node" if plan.layout == "node" else "rank"
    require_free_space(outp, max(0, needed + space_margin(needed) - reclaim),
                       f"for {len(todo)} {unit} director{'y' if len(todo) == 1 else 'ies'} "
                       f"({human_bytes(needed)} to write, with a margin)")


def _out_of_space(plan: ReshardPlan, outp: Path, todo: Sequence[RankPlan | NodePlan], where: Path,
                  why: str) -> ReshardError:
    """The disk filled up mid-run: remove this run's temporary files (they would keep it full),
    then say how much more space the unfinished units need."""
    unfinished = [rp for rp in todo if not (outp / rp.dir_name / READY_NAME).exists()]
    for rp in unfinished:
        for f in rp.files:
            tmp_name(outp / rp.dir_name / f.name).unlink(missing_ok=True)
    for p in outp.glob(".*.tmp"):  # a non-weight file's copy cut short
        p.unlink(missing_ok=True)
    needed = _to_write(plan, unfinished) - sum(_allocated(outp / rp.dir_name) for rp in unfinished)
    needed += space_margin(needed)
    free = free_bytes(outp)
    unit = "nodes" if plan.layout == "node" else "ranks"
    what = f"the {len(unfinished)} unfinished {unit}"
    if needed > free:
        tail = (f"{outp} needs {needed - free} bytes ({human_bytes(needed - free)}) more free space for {what} "
                f"({needed} bytes needed, {free} free; temporary files removed)")
    else:
        tail = f"{what} need {needed} bytes, {free} are free now (temporary files removed)"
    return ReshardError(f"writing {where}: {why}; {tail}: free space and re-run: completed {unit} are kept",
                        path=where)
