"""Writing a reshard's files: a pool of writers (``--jobs``; :func:`_write_units`) writes each
output file under its temporary name (:func:`_write_file`), hashing it in the same pass, and
hands each unit to its finisher (:func:`~k3ckpt.deploy.reshard.units._finish_rank`) as soon as
its last file is written.

How bytes move (streaming; memory is a few bounded buffers per worker, whatever the size):

- adjacent contiguous runs (a rank's experts: their six tensors are adjacent in the shard) are
  coalesced and copied kernel-side with ``os.copy_file_range`` (falling back to ``os.sendfile``,
  then to a bounded ``pread``/``pwrite``), in chunks of :data:`~k3ckpt.deploy.bytecopy.CHUNK`
  bytes;
- strided runs are gathered through bounded buffers (whole rows read, columns cut row by row);
- output files are written in parallel by a thread pool (``--jobs``), largest first.

Hashing. Per-tensor sha256 are computed while writing, in the same pass: each kernel-side chunk
is read from the *source* into a small buffer and hashed there (in the CPU's cache; the copy that
follows finds the source's pages hot: nothing is read back from the output, and no byte is read
from disk twice), and buffered chunks are hashed from the buffer they are written from. A file's
digest must cover every output byte: a rank file's, as a node file's, is built from its header's
and tensors' sha256 (:func:`~k3ckpt.format.filedigest.segments_sha256`), so each byte is hashed
once, for its tensor, and a file whose tensors' digests are all known is copied kernel-side and
not hashed at all. (A rank file's plain sha256, recorded until 2026-12-06, hashed every output
byte once more - 1.5x the source's bytes in the rank format: side by side, cold, a rank-format
reshard of k3-density after verify took 3.4 CPU-s instead of 5.8, and 3.4 s instead of 4.1.)
A tensor slice's digest is computed once per run, fed from that same read, and reused wherever
several ranks or nodes hold the same slice (replicated tensors, TP slices across dp ranks); a
file byte-identical to another of the run (a twin: a node's dense files, a rank's dense parts)
takes its digests from that one and is only copied, as soon as that one is written. With
``--manifest`` (:func:`manifest_digests`) whole tensors of source files that ``verify`` or
``fetch`` last found unchanged and equal to the manifest (by the file's sha256, or tensor by
tensor for a share's rewritten shard) take their digest from it and are not hashed at all; every
other tensor is hashed as above, so a source that does not match the manifest never gets its
digests.

A full disk raises :class:`_OutOfSpace` (the run turns it into the shortfall); any other
``OSError`` becomes a one-line error naming the file (:func:`_write_error`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import K3ckptError, ReshardError
from ...faults import fault_point, pause_point
from ...format.checkpoint import Checkpoint
from ...format.filedigest import SEGMENTS_KEY, segments_sha256
from ...integrity.statcache import recorded_proofs, verified_manifests
from ..bytecopy import NO_SPACE, Copier, FdCache, tmp_name
from .plan import _T_RUNS, _T_SRC, NodePlan, OutFile, RankPlan, ReshardPlan
from .units import _finish_rank, _record_proofs

if TYPE_CHECKING:
    from ...integrity.manifest import Manifest


#: Writers ``reshard`` runs without ``--jobs``: one per core, at most this many.
MAX_DEFAULT_WRITERS = 16


def _write_units(plan: ReshardPlan, outp: Path, todo: list[RankPlan | NodePlan], *, jobs: int | None, mode: str,
                 progress: Callable[[int], None] | None, known: dict[str, str], hash_step: int,
                 meanwhile: Callable[[], None] = lambda: None) -> int:
    """Write every file of ``todo`` in parallel and finish each unit as its last file lands;
    the bytes of the finished units. ``known``: whole-tensor digests not to compute;
    ``hash_step``: bytes read and hashed at a time (``$K3CKPT_HASH_BUFFER``, read before the
    run's first byte); ``meanwhile``: run once the writers have started, before any unit is
    finished."""
    cache = _DigestCache(known)
    # what proved each source file (the stat cache of a verify or fetch): its copies carry it
    proofs = recorded_proofs(plan.ckpt.root, sorted({*plan.ckpt.shards, *plan.extra_files}))
    # One writer per core: each chunk is hashed from the source and copied in one pass,
    # so a writer keeps its core busy. Measured on 2 cores (k3-8shard and k3-small, rank and node
    # formats, medians of 3): warm cache, 2 writers vs 4 took 2-23 % less wall and 1-9 % fewer
    # CPU-seconds (fewer GIL hand-offs); cold cache, the same wall within noise and 3-5 % fewer
    # CPU-seconds. (Two per core paid off while each chunk was read back from the output.)
    workers = jobs or min(MAX_DEFAULT_WRITERS, os.cpu_count() or 1)
    written = 0
    files_done = 0
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reshard")
    queue = _WriteQueue(pool)
    try:
        # largest files first within the whole job keeps the pool busy to the end
        order = sorted(((f.size, rp.unit, k) for rp in todo for k, f in enumerate(rp.files)), reverse=True)
        by_unit = {rp.unit: rp for rp in todo}
        slots: dict[tuple[int, int], Future] = {}
        firsts: dict[tuple, Future] = {}  # the writer of each distinct file content
        for _, r, k in order:
            f = by_unit[r].files[k]
            dest = outp / by_unit[r].dir_name / f.name
            first = firsts.get(key := _twin_key(f))
            if first is None:
                slots[(r, k)] = firsts[key] = queue.put(partial(_write_file, plan, f, dest, mode, cache, progress,
                                                                hash_step=hash_step))
            else:
                def submit(twin: dict[str, Any] | None, f: OutFile = f, dest: Path = dest) -> Future:
                    return queue.put(partial(_write_file, plan, f, dest, mode, cache, progress, twin,
                                             hash_step=hash_step), front=twin is not None)

                slots[(r, k)] = _after(first, submit)
        # A unit is finished (manifest, READY) as soon as its last file is written, whatever
        # order files complete in: a failed file costs only its own unit, and the first error
        # is raised once every other file is done ("completed ranks are kept").
        unit_of = {fu: r for (r, _), fu in slots.items()}
        left = {rp.unit: len(rp.files) for rp in todo}
        failed: set[int] = set()
        first_error: BaseException | None = None

        def finish(rp: RankPlan | NodePlan) -> None:
            nonlocal written, first_error
            results = [slots[(rp.unit, k)].result() for k in range(len(rp.files))]
            try:
                _finish_rank(outp, rp, results, plan.source_json)
                _record_proofs(outp, rp, results, proofs, plan.extra_files)
            except OSError as e:
                if e.errno in NO_SPACE:
                    first_error = first_error or _OutOfSpace(Path(e.filename or outp / rp.dir_name), e)
                else:  # (the same words as a writer's: which thread meets a limit first is chance)
                    first_error = first_error or _write_error(outp / rp.dir_name, e)
                return
            written += rp.nbytes

        meanwhile()
        for rp in todo:
            if not rp.files:
                finish(rp)
        for fu in as_completed(unit_of):
            r = unit_of[fu]
            if fu.exception() is not None:
                first_error = first_error or fu.exception()
                failed.add(r)
                continue
            files_done += 1
            pause_point("reshard_file", files_done)  # test hook: the N-th file of the run written
            left[r] -= 1
            if left[r] == 0 and r not in failed:
                finish(by_unit[r])
        if first_error is not None:
            raise first_error
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)
    return written


def verified_manifest_digests(ckpt: Checkpoint, cache_directory: Path | None = None) -> tuple[str | None, dict[str, str]]:
    """``(path, digests)``: the whole-tensor digests :func:`manifest_digests` takes from the
    manifest a full ``verify --manifest`` of ``ckpt`` last used - still the same bytes, with tensor
    hashes (:func:`~k3ckpt.integrity.statcache.verified_manifests`) - so the documented flow
    (verify, then reshard) hashes each tensor once without a flag; ``(None, {})`` when there is
    none. The same rules as an explicit ``--manifest``: only files whose stat-cache entry, with
    their current stat, holds the sha256 the manifest lists give their tensors' digests."""
    from ...integrity.manifest import Manifest

    for path in reversed(verified_manifests(ckpt.root, cache_directory)):
        try:
            manifest = Manifest.load(path)
        except K3ckptError:  # unreadable now: hash as without one
            continue
        if manifest.tensor_hashes:
            return str(path), manifest_digests(ckpt, manifest, cache_directory)
    return None, {}


def manifest_digests(ckpt: Checkpoint, manifest: Manifest, cache_directory: Path | None = None) -> dict[str, str]:
    """The whole-tensor sha256 ``reshard --manifest`` takes from ``manifest`` instead of
    hashing the bytes again: those of the source files whose current bytes are known to be the
    manifest's. The verify stat cache (what ``k3ckpt verify`` and ``k3ckpt fetch`` record,
    :class:`~k3ckpt.integrity.verify.StatCache`) holds the file with its stat unchanged (size,
    mtime, inode, device, ctime) and either

    - the sha256 the manifest lists for it, and no tensor that verify found differing from its
      manifest - and the tensor's entry in the manifest has the source header's dtype, shape and
      byte range: the file digest ties the manifest to the bytes, its tensor digests are taken
      as the manifest states them; or
    - (a share's rewritten shard, whose file digest no manifest lists: ``fetch --format partial``,
      a node directory) the fingerprint of this manifest as the one every tensor of the file was
      found equal to, tensor by tensor, by ``verify``'s share check - and the tensor's entry has
      the header's dtype and shape (its byte range is the share's own).

    Every other tensor (a file never verified, changed since, or listed with another digest) is
    hashed as without a manifest: a source that does not match the manifest never gets the
    manifest's digests.

    Raises:
        ReshardError: the manifest has no tensor hashes (nothing to take from it).
    """
    from ...integrity.verify import StatCache

    if not manifest.tensor_hashes:
        name = ckpt.root.name.lower()
        raise ReshardError(f"the --manifest has no tensor hashes (build one with `k3ckpt manifest build {ckpt.root} "
                           f"--tensor-hashes -o {name}.tensors.json`)")
    cache = StatCache(ckpt.root, cache_directory)
    by_file: set[str] = set()  # equal to the manifest's file digest
    by_tensor: set[str] = set()  # every tensor equal to the manifest's
    for f in ckpt.shards:
        listed = manifest.files.get(f)
        try:
            hit = cache.lookup(f, os.stat(ckpt.root / f))
        except OSError:
            continue
        if hit is None or hit.get("bad_tensors"):  # tensors a verify found differing: not trusted
            continue
        if listed is not None and listed.sha256 and hit.get("sha256") == listed.sha256:
            by_file.add(f)
        elif hit.get("tensors_match_manifest") == manifest.fingerprint():
            by_tensor.add(f)
    out: dict[str, str] = {}
    for name, info in ckpt.tensors.items():
        entry = manifest.tensors.get(name)
        if entry is None or entry.sha256 is None or (entry.dtype, tuple(entry.shape)) != (info.dtype, tuple(info.shape)):
            continue
        start = ckpt.shards[info.file].data_start
        if info.file in by_tensor or (info.file in by_file and (entry.file, tuple(entry.offsets)) == (
                info.file, (start + info.begin, start + info.end))):
            out[name] = entry.sha256
    return out


class _OutOfSpace(ReshardError):
    """A write found the filesystem full (``ENOSPC``/``EDQUOT``);
    :func:`~k3ckpt.deploy.reshard.run.run_reshard` removes its temporary files and replaces the
    message with the shortfall."""

    def __init__(self, path: Path, err: OSError) -> None:
        super().__init__(f"writing {path}: {err.strerror or err}", path=path)
        self.where = path
        self.strerror = err.strerror or str(err)


class _DigestCache:
    """Digests of byte slices several ranks hold identically, computed once per run; ``known``:
    whole-tensor digests taken from a verified source manifest (:func:`manifest_digests`),
    which are never computed."""

    def __init__(self, known: dict[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        # a whole tensor's key is (name, None) in both formats (see _tensor_plan and _node_plan)
        self._done: dict[tuple, str] = {(name, None): d for name, d in (known or {}).items()}

    def get(self, key: tuple) -> str | None:
        with self._lock:
            return self._done.get(key)

    def put(self, key: tuple, digest: str) -> None:
        with self._lock:
            self._done.setdefault(key, digest)


def _write_file(plan: ReshardPlan, f: OutFile, dest: Path, mode: str, cache: _DigestCache,
                progress: Callable[[int], None] | None, twin: dict[str, Any] | None = None, *,
                hash_step: int) -> dict[str, Any]:
    """Write one output file under its temporary name; return its digests (the unit's finisher,
    :func:`~k3ckpt.deploy.reshard.units._finish_rank`, fsyncs it before the rename, so the writer
    goes on to its next file while the disk catches up instead of waiting for it: 0.06-0.14 s per
    run here). ``twin``: the digests of a byte-identical file of this run (same header, same
    source runs: a dense file every node holds) - the bytes are then copied, not hashed again.

    Raises:
        ReshardError: the file cannot be written (disk full, file too large, ...), naming it;
            ranks already complete stay, and a re-run redoes only the others.
    """
    fds = FdCache(plan.ckpt.path_of)
    try:
        return _write_file_with(plan, f, dest, mode, cache, progress, fds, twin, hash_step)
    except OSError as e:
        if e.errno in NO_SPACE:
            raise _OutOfSpace(dest, e) from None
        raise _write_error(dest, e) from None
    finally:
        fds.close()


def _write_error(dest: Path, e: OSError) -> ReshardError:
    """``e`` (not ENOSPC: :class:`_OutOfSpace`) raised while writing ``dest`` - a weight file, or
    a unit its finisher syncs and completes - as one line naming it, with what to do about a
    limit. copy_file_range/pwrite errors carry no file name; without it "File too large" is a
    riddle."""
    hint = ("; free space (or raise the limit) and re-run: completed ranks are kept"
            if e.errno == errno.EFBIG else "")
    if e.errno in (errno.EMFILE, errno.ENFILE):
        hint = "; raise the open-files limit (ulimit -n) or use fewer --jobs"
    what = f"{e.filename}: " if e.filename else ""
    return ReshardError(f"writing {dest}: {what}{e.strerror or e}{hint}")


def _write_file_with(plan: ReshardPlan, f: OutFile, dest: Path, mode: str, cache: _DigestCache,
                     progress: Callable[[int], None] | None, fds: FdCache, twin: dict[str, Any] | None,
                     hash_step: int) -> dict[str, Any]:
    copier = Copier(mode, fds, hash_step)
    tmp = tmp_name(dest)
    digests: dict[str, str] = {}
    # O_NOFOLLOW: a symlink planted at the temporary name must not redirect the write.
    dst = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.pwrite(dst, f.prefix, 0)
        base = len(f.prefix)
        if f.size > base:
            os.ftruncate(dst, f.size)
        ts = f.tensors
        if twin is not None:  # its digests are known: copy only
            _copy_unhashed(f, base, dst, copier, fds, progress)
            ts = []
        # coalesce: consecutive tensors whose single contiguous runs are adjacent in one source file
        i = 0
        while i < len(ts):
            t = ts[i]
            t_do = base + f.offsets[i][0]
            if len(t.runs) == 1 and t.runs[0].count == 1:
                j = i + 1
                end = t.runs[0].offset + t.runs[0].length
                while (j < len(ts) and ts[j].src_file == t.src_file and len(ts[j].runs) == 1
                       and ts[j].runs[0].count == 1 and ts[j].runs[0].offset == end):
                    end += ts[j].runs[0].length
                    j += 1
                group = ts[i:j]
                hashers = [None if cache.get(g.key) else hashlib.sha256() for g in group]
                src = fds.get(t.src_file)
                if not any(hashers):  # every digest known: a plain kernel-side copy
                    copier.contiguous(src, dst, t.runs[0].offset, t_do, end - t.runs[0].offset, None)
                    if progress is not None:
                        progress(end - t.runs[0].offset)
                else:
                    copier.contiguous(src, dst, t.runs[0].offset, t_do, end - t.runs[0].offset,
                                      _group_sink(hashers, [g.nbytes for g in group], progress))
                for g, h in zip(group, hashers):
                    if h is None:
                        known = cache.get(g.key)
                        assert known is not None  # no hasher: the cache had its digest, and entries stay
                        digests[g.name] = known
                    else:
                        digests[g.name] = h.hexdigest()
                        cache.put(g.key, digests[g.name])
                # zero-length tensors in the group have their (empty) digest already
                i = j
                continue
            cached = cache.get(t.key)
            th = None if cached else hashlib.sha256()
            src = fds.get(t.src_file)
            do = t_do
            for run in t.runs:
                sink = _tensor_sink(th, progress)
                if run.count == 1:
                    copier.contiguous(src, dst, run.offset, do, run.length, sink)
                else:
                    copier.strided(src, dst, run, do, sink)
                if sink is None and progress is not None:
                    progress(run.nbytes)
                do += run.nbytes
            if th is not None:
                digests[t.name] = th.hexdigest()
                cache.put(t.key, digests[t.name])
            else:
                assert cached  # th is None only for a cached digest
                digests[t.name] = cached
            i += 1
        fault_point("reshard.file_written", f.name)  # test seam (k3ckpt.faults): the file's bytes are written
    finally:
        os.close(dst)
    if twin is not None:
        return {**twin, "tensors": dict(twin["tensors"])}
    base = len(f.prefix)
    return {SEGMENTS_KEY: segments_sha256(f.prefix, ((base + b, base + e, digests[t.name]) for t, (b, e) in
                                                     zip(f.tensors, f.offsets))),
            "size": f.size, "tensors": digests}


def _group_sink(hashers: list[Any], bounds: list[int],
                progress: Callable[[int], None] | None) -> Callable[[memoryview], None]:
    """What a coalesced run of adjacent tensors (``bounds``: their sizes) is fed to as it is
    copied: each tensor's hasher (None: its digest is known)."""
    state = [0, 0]  # index in the group, bytes consumed of it

    def sinks(data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            gi, used = state
            take = min(bounds[gi] - used, len(data) - pos)
            h = hashers[gi]
            if h is not None and take:
                h.update(data[pos:pos + take])
            pos += take
            used += take
            if used == bounds[gi] and gi + 1 < len(bounds):
                gi, used = gi + 1, 0
            state[0], state[1] = gi, used
        if progress is not None:
            progress(len(data))
    return sinks


def _tensor_sink(th: Any, progress: Callable[[int], None] | None) -> Callable[[memoryview], None] | None:
    """What one tensor's run is fed to as it is copied: the tensor's hasher and the progress;
    None when its digest is known (a plain kernel-side copy)."""
    if th is None:
        return None

    def sink(data: memoryview) -> None:
        th.update(data)
        if progress is not None:
            progress(len(data))
    return sink


def _copy_unhashed(f: OutFile, base: int, dst: int, copier: Copier, fds: FdCache,
                   progress: Callable[[int], None] | None) -> None:
    """Copy every tensor of ``f`` (data buffer at ``base``) without hashing: contiguous runs
    adjacent in one source file and in ``f`` are merged into one kernel-side copy."""
    pending: tuple[str, int, int, int] | None = None  # source file, source offset, length, output offset

    def flush() -> None:
        if pending is not None:
            copier.contiguous(fds.get(pending[0]), dst, pending[1], pending[3], pending[2], None)
            if progress is not None:
                progress(pending[2])

    for t, (b, _e) in zip(f.tensors, f.offsets):
        do = base + b
        for run in t.runs:
            if run.count != 1:
                flush()
                pending = None
                copier.strided(fds.get(t.src_file), dst, run, do, None)
                if progress is not None:
                    progress(run.nbytes)
            elif (pending is not None and pending[0] == t.src_file and pending[1] + pending[2] == run.offset
                  and pending[3] + pending[2] == do):
                pending = (pending[0], pending[1], pending[2] + run.length, pending[3])
            else:
                flush()
                pending = (t.src_file, run.offset, run.length, do)
            do += run.nbytes
    flush()


def _twin_key(f: OutFile) -> tuple:
    """What fixes every byte of an output file: its header and the source runs of its tensors.
    Files with equal keys are byte-identical (the dense files of every node)."""
    return f.prefix, tuple(zip(map(_T_SRC, f.tensors), map(_T_RUNS, f.tensors)))


class _WriteQueue:
    """The files of a run, each taken by a pool worker at the moment it starts one, in the
    queue's order then - not in the order they were submitted. A twin (its digests known: a
    copy only, bound by the disk) is released when its first is written and goes to the front,
    so it is copied while the cores still hash the files queued behind it; queued at the back
    it ran last, one writer copying (a node's 270 MiB dense twin) while the other core idled."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._jobs: deque[tuple[Future, Callable[[], dict[str, Any]]]] = deque()

    def put(self, job: Callable[[], dict[str, Any]], *, front: bool = False) -> Future:
        """A future for ``job()``, run by the next free worker (``front``: before the others
        waiting). Raises RuntimeError once the pool is shut down (an error or Ctrl-C)."""
        fut: Future = Future()
        with self._lock:
            (self._jobs.appendleft if front else self._jobs.append)((fut, job))
        self._pool.submit(self._run_next)  # one worker turn per job: every job is taken once
        return fut

    def _run_next(self) -> None:
        with self._lock:
            fut, job = self._jobs.popleft()
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(job())
        except BaseException as e:  # the caller sees it through the future, as with pool.submit
            fut.set_exception(e)


def _after(first: Future, submit: Callable[[dict[str, Any] | None], Future]) -> Future:
    """A future for ``submit(twin)``, called once ``first`` (a byte-identical file's writer) is
    done, with its digests (``None`` if it failed: the file is then hashed as any other).
    Submitting then, not waiting in a worker, keeps every worker copying meanwhile."""
    out: Future = Future()

    def relay(inner: Future) -> None:
        if inner.cancelled():
            out.set_exception(ReshardError("cancelled"))
        elif inner.exception() is not None:
            out.set_exception(inner.exception())
        else:
            out.set_result(inner.result())

    def go(done: Future) -> None:
        twin = None if done.cancelled() or done.exception() is not None else done.result()
        try:
            inner = submit(twin)
        except RuntimeError as e:  # the pool is shutting down: an error or Ctrl-C ends the run
            out.set_exception(e)
            return
        inner.add_done_callback(relay)

    first.add_done_callback(go)
    return out
