"""The checkpoint model: a directory of safetensors shards, opened from headers alone.

Accepted layouts:
- a plain directory, as ``hf download --local-dir`` or ``k3ckpt fetch`` leaves it;
- a Hugging Face cache snapshot (``.../models--org--name/snapshots/<commit>``) or the repo's
  cache folder itself (``.../models--org--name``, resolved through ``refs/main``);
- either with ``model.safetensors.index.json`` or a single ``model.safetensors``.

Opening reads ``config.json``, the index and every shard's header - never tensor data. Problems
that do not stop us from describing the checkpoint (the index and the headers disagree, the
config contradicts the tensors) are collected in :attr:`Checkpoint.problems`; problems that do
(a missing shard, a malformed header) raise a :class:`~k3ckpt.errors.K3ckptError`.
"""

from __future__ import annotations

import errno
import gc
import json
import operator
import os
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import Future, ProcessPoolExecutor

    import numpy as np


from ..errors import CheckpointNotFoundError, ConfigError, IndexFileError, SafetensorsHeaderError
from ..utils import load_json
from ..utils.lock import is_lock_file
from .config import ModelConfig, load_config
from .header import HeaderColumns, ShardHeader, TensorInfo, read_header, read_header_columns
from .roles import Kind, Role, classify

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class Problem:
    """Something wrong that does not stop us from describing the checkpoint."""

    where: str  # a file or tensor name
    message: str
    kind: str = "index"  # "index" (index vs headers), "header" (malformed shard), "missing-file", "path", "config"

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Source:
    """Where the checkpoint came from, when the layout tells us."""

    layout: str  # "local-dir" or "hf-cache"
    repo: str | None = None
    revision: str | None = None
    hub: str | None = None
    #: The tensor-hash manifest the last rank-aware fetch into the directory verified against
    #: (its path, as recorded), so that a fix re-fetching from the same source proves as much.
    manifest: str | None = None


Signature = tuple  # (layer, kind, part, proj, dtype, shape, nbytes)
_LAYER, _EXPERT, _KIND, _PART, _PROJ = (operator.itemgetter(i) for i in (2, 3, 0, 5, 4))


@dataclass
class InventoryStats:
    """Counts that summarize an inventory: ~497k tensors collapse to a few thousand distinct
    signatures, so summaries cost per signature, not per tensor."""

    signatures: Counter  # Signature -> number of tensors
    expert_parts: Counter  # (layer, expert) -> number of tensors of that routed expert

    def merge(self, other: InventoryStats) -> None:
        self.signatures.update(other.signatures)
        self.expert_parts.update(other.expert_parts)


def inventory_stats(
    roles: list[Role], dtypes: list[str], shapes: list[tuple[int, ...]], nbytes: list[int]
) -> InventoryStats:
    """Count signatures with C-level loops (``Counter`` over ``zip`` of ``map``s)."""
    sig = Counter(zip(map(_LAYER, roles), map(_KIND, roles), map(_PART, roles), map(_PROJ, roles),
                      dtypes, shapes, nbytes))
    parts = Counter(zip(map(_LAYER, roles), map(_EXPERT, roles)))
    for key in [k for k in parts if k[1] is None]:
        del parts[key]
    return InventoryStats(sig, parts)


@dataclass
class Checkpoint:
    root: Path
    config: ModelConfig | None
    shards: dict[str, ShardHeader]
    tensors: dict[str, TensorInfo]
    index_file: str | None
    source: Source
    problems: list[Problem] = field(default_factory=list)
    _roles: dict[str, Role] | None = field(default=None, repr=False)
    _stats: InventoryStats | None = field(default=None, repr=False)

    # -- queries -----------------------------------------------------------------------------

    @property
    def roles(self) -> dict[str, Role]:
        """Role of every tensor, computed on first use."""
        if self._roles is None:
            with bulk_allocation():
                self._roles = dict(zip(self.tensors, map(classify, self.tensors)))
        return self._roles

    @property
    def stats(self) -> InventoryStats:
        """:class:`InventoryStats` of every tensor, computed on first use (or by the workers
        that read the headers)."""
        if self._stats is None:
            infos = list(self.tensors.values())
            with bulk_allocation():
                self._stats = inventory_stats(
                    list(map(self.roles.__getitem__, self.tensors)), [t.dtype for t in infos],
                    [t.shape for t in infos], [t.end - t.begin for t in infos])
        return self._stats

    @property
    def total_bytes(self) -> int:
        """Bytes of all shard files (headers included), as a download would move them."""
        return sum(h.file_size for h in self.shards.values())

    def unknown_tensors(self) -> list[str]:
        """Names no role rule describes (cheap when there are none: the stats say so)."""
        if not any(sig[1] == Kind.UNKNOWN for sig in self.stats.signatures):
            return []
        return [n for n, r in self.roles.items() if r.kind == Kind.UNKNOWN]

    def path_of(self, file: str) -> Path:
        return self.root / file

    def iter_files(self) -> Iterator[str]:
        """Every file of the checkpoint: see :func:`iter_checkpoint_files`."""
        return iter_checkpoint_files(self.root)

    # -- data --------------------------------------------------------------------------------

    def read_tensor(self, name: str) -> np.ndarray:
        """Read one tensor's data (only its bytes) as a numpy array of its dtype."""
        import numpy as np

        info = self.tensors[name]
        header = self.shards[info.file]
        raw = np.fromfile(
            self.path_of(info.file), dtype=np.uint8, count=info.nbytes, offset=header.data_start + info.begin
        )
        if raw.size != info.nbytes:
            raise IndexFileError(f"{info.file}: tensor {name!r}: file is truncated ({raw.size} of {info.nbytes} bytes)")
        return raw.view(numpy_dtype(info.dtype)).reshape(info.shape)


def iter_checkpoint_files(root: Path) -> Iterator[str]:
    """Every file under ``root`` as a sorted relative posix path. Hidden directories (a local
    dir's ``.cache/huggingface`` download metadata) are not part of the checkpoint; hidden files
    such as ``.gitattributes`` are."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = Path(dirpath).relative_to(root)
        for fn in sorted(filenames):
            yield (rel / fn).as_posix() if rel.parts else fn


#: Working files of an unfinished or running fetch (``download.py``: ``<file>.part``, its
#: ``.part.journal``, temporary ``*.tmp`` files, the ``.k3ckpt-fetch.lock`` and its ``.break``)
#: and of our own atomic writes (``.<file>.<...>.tmp``).
_WORK_SUFFIXES = (".part", ".part.journal", ".tmp")
_FETCH_LOCK = ".k3ckpt-fetch.lock"


def is_working_file(rel: str) -> bool:
    """True for a file that is a tool's temporary working state, not part of the checkpoint
    (a fetch's ``*.part``/``*.part.journal``/lock, reshard's and unshard's output lock, any
    ``*.tmp``): never copied as one of the
    checkpoint's files."""
    base = rel.rsplit("/", 1)[-1]
    return base.endswith(_WORK_SUFFIXES) or base.startswith(_FETCH_LOCK) or is_lock_file(base)


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype for a safetensors dtype (ml_dtypes for BF16 and the FP8 family)."""
    import ml_dtypes
    import numpy as np

    table = {
        "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
        "I32": np.int32, "U32": np.uint32, "I64": np.int64, "U64": np.uint64,
        "F16": np.float16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
        "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    }
    if dtype not in table:
        raise ValueError(f"no numpy dtype for {dtype}; read it as raw bytes")
    return np.dtype(table[dtype])


# -- opening ---------------------------------------------------------------------------------


def resolve_root(path: str | os.PathLike[str]) -> tuple[Path, Source]:
    """Find the directory holding the files, and what the layout says about its origin."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointNotFoundError(f"{p}: no such directory", path=p)
    if p.is_file():
        raise CheckpointNotFoundError(f"{p}: is a file; pass the checkpoint directory", path=p)
    p = p.resolve()
    # The repo folder of an HF cache: models--org--name/{refs,snapshots,blobs}
    if p.name.startswith("models--") and (p / "snapshots").is_dir():
        ref = p / "refs" / "main"
        snaps = sorted((p / "snapshots").iterdir())
        if ref.is_file():
            rev = ref.read_text().strip()
            p = p / "snapshots" / rev
        elif len(snaps) == 1:
            p = snaps[0]
        else:
            raise CheckpointNotFoundError(
                f"{p}: HF cache repo with {len(snaps)} snapshots and no refs/main; pass one snapshots/<commit> folder",
                path=p)
    if _is_hf_snapshot(p):
        repo_dir = p.parent.parent.name  # models--org--name
        repo = "/".join(repo_dir.split("--")[1:])
        return p, Source("hf-cache", repo=repo, revision=p.name, hub="hf")
    return p, _local_dir_source(p)


def _is_hf_snapshot(p: Path) -> bool:
    return p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--")


#: Where ``k3ckpt fetch`` records the hub, repo and resolved commit a local dir came from
#: (hidden, so not part of the checkpoint; beside huggingface_hub's own ``.cache/huggingface``).
SOURCE_RECORD = ".cache/k3ckpt/source.json"


def _local_dir_source(root: Path) -> Source:
    """A local dir's origin: ``k3ckpt fetch``'s record, else the commit ``hf download
    --local-dir`` left in its metadata, else unknown."""
    try:
        rec = json.loads((root / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        rec = None
    if isinstance(rec, dict) and all(isinstance(rec.get(k), str) and rec[k] for k in ("hub", "repo", "revision")):
        manifest = rec.get("manifest")
        return Source("local-dir", repo=rec["repo"], revision=rec["revision"], hub=rec["hub"],
                      manifest=manifest if isinstance(manifest, str) and manifest else None)
    return Source("local-dir", revision=_local_dir_revision(root))


def _local_dir_revision(root: Path) -> str | None:
    # `hf download --local-dir` records "<commit>\n<etag>\n<timestamp>" per file here.
    meta = root / ".cache" / "huggingface" / "download" / (CONFIG_NAME + ".metadata")
    try:
        first = meta.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None
    return first if len(first) == 40 else None


def _safe_relpath(root: Path, rel: str, what: str) -> str:
    pp = PurePosixPath(rel)
    if not rel or pp.is_absolute() or ".." in pp.parts or "\\" in rel:
        raise IndexFileError(f"{what}: refuses shard path {rel!r} (absolute or outside the checkpoint)")
    return pp.as_posix()


def read_index(root: Path, unsafe: list[str] | None = None) -> tuple[dict[str, str], str]:
    """``weight_map`` of ``model.safetensors.index.json``, or the single file's implied map.

    Returns ``(weight_map, index_file)``; for a single file the map is empty and filled from
    its header by the caller. A shard path that is absolute or climbs out of ``root`` raises
    :class:`IndexFileError` - or, given an ``unsafe`` list, is appended there and its tensors left
    out of the map.
    """
    index_path = root / INDEX_NAME
    if index_path.is_file():
        data, _ = load_json(index_path, IndexFileError)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise IndexFileError(f"{index_path}: no weight_map (or it is empty)", path=index_path)
        for name, file in wm.items():
            if not isinstance(file, str):
                raise IndexFileError(f"{index_path}: tensor {name!r} maps to {file!r}, not a file name", path=index_path)
        files: dict[str, str | None] = {}
        for f in set(wm.values()):
            try:
                files[f] = _safe_relpath(root, f, str(index_path))
            except IndexFileError:
                if unsafe is None:
                    raise
                unsafe.append(f)
                files[f] = None
        if any(f != norm for f, norm in files.items()):  # e.g. "./model-1.safetensors", or unsafe
            wm = {n: files[f] for n, f in wm.items() if files[f] is not None}
        return wm, INDEX_NAME
    if (root / SINGLE_NAME).is_file():
        return {}, SINGLE_NAME
    raise CheckpointNotFoundError(
        f"{root}: no {INDEX_NAME} and no {SINGLE_NAME}; is this a safetensors checkpoint?", path=root)


@contextmanager
def bulk_allocation() -> Iterator[None]:
    """Pause the cyclic GC while building ~10^6 acyclic objects: otherwise every generation-2
    pass re-walks all headers parsed so far and opening the full K3 inventory takes 3x longer."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def not_a_file(path: Path) -> str:
    """What stands at ``path`` instead of a regular file, in the words of an error message:
    ``missing``, ``is a directory, not a file``, ``is a symlink loop (to X)``, ``is a broken
    symlink (to X)``, or ``is not a regular file (a socket)``. A shard name that is a directory or a link to
    nowhere is not "missing": saying what it is sends the user to the right fix."""
    try:
        st = path.lstat()
    except OSError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        try:
            os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"is a symlink loop (to {target})"
            return f"is a broken symlink (to {target})"
        return not_a_file(Path(os.path.realpath(path)))
    if stat.S_ISDIR(st.st_mode):
        return "is a directory, not a file"
    kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device",
             stat.S_ISBLK: "a block device"}
    return "is not a regular file (" + next((k for test, k in kinds.items() if test(st.st_mode)), "unknown kind") + ")"


def open_checkpoint(
    path: str | os.PathLike[str], *, jobs: int | None = None, require_config: bool = False, strict: bool = True,
    progress: Callable[[int], None] | None = None, on_plan: Callable[[int], None] | None = None,
    headers: SharedHeaders | None = None,
) -> Checkpoint:
    """Open the checkpoint at ``path`` from its config, index and shard headers.

    Args:
        path: a checkpoint directory, an HF cache snapshot, or an HF cache repo folder.
        jobs: processes reading headers (parsing is CPU-bound).
        require_config: raise :class:`ConfigError` when ``config.json`` is missing.
        strict: raise on the first missing or malformed shard. ``False`` (what ``verify``
            uses, to report everything at once) records them in :attr:`Checkpoint.problems`
            with kind ``missing-file`` / ``header`` and opens the rest.
        progress, on_plan: called with the number of shard headers to read, then with 1 as
            each is read (``inspect``'s progress bar: 96 headers, 497k tensors for K3).
        headers: headers shared with other threads (``verify``'s hashing threads take each
            shard's scale spans from it): each is parsed once, by whichever asks first.

    Raises:
        CheckpointNotFoundError, IndexFileError, SafetensorsHeaderError, ConfigError.
    """
    with bulk_allocation():
        return _open(path, jobs, require_config, strict, progress, on_plan, headers)


def _open(path: str | os.PathLike[str], jobs: int | None, require_config: bool, strict: bool = True,
          progress: Callable[[int], None] | None = None, on_plan: Callable[[int], None] | None = None,
          shared: SharedHeaders | None = None) -> Checkpoint:
    root, source = resolve_root(path)
    config: ModelConfig | None = None
    config_problem: Problem | None = None
    if (root / CONFIG_NAME).is_file():
        try:
            config = load_config(root / CONFIG_NAME)
        except ConfigError as e:
            if strict:
                raise
            config_problem = Problem(CONFIG_NAME, str(e).split(": ", 1)[-1], "config")
    elif require_config:
        raise ConfigError(f"{root / CONFIG_NAME}: not found")

    reader = HeaderReader(root, jobs, tolerant=not strict, shared=shared)
    unsafe: list[str] | None = None if strict else []
    try:
        index_digests = reader.index_digests(unsafe)
        if index_digests is not None:
            weight_map: dict[str, str] | None = None
            index_file = INDEX_NAME
            files = sorted(index_digests)
        else:
            weight_map, index_file = read_index(root, unsafe)
            files = sorted(set(weight_map.values())) if weight_map else [SINGLE_NAME]
        problems: list[Problem] = [
            Problem(f, f"{INDEX_NAME} names a shard path that is absolute or outside the checkpoint", "path")
            for f in sorted(unsafe or [])
        ] + ([config_problem] if config_problem else [])
        for f in list(files):
            if not (root / f).is_file():
                what = not_a_file(root / f)
                if strict:
                    raise IndexFileError(f"{root / f}: listed in {index_file} but {what}", path=root / f)
                problems.append(Problem(f, f"listed in {index_file} but {what}", "missing-file"))
                files.remove(f)
    except BaseException:
        reader.close()
        raise
    bad_files: dict[str, SafetensorsHeaderError] | None = None if strict else {}
    if on_plan is not None:
        on_plan(len(files))
    headers, stats, header_digests = reader.collect(files, bad_files, progress)
    for f, err in (bad_files or {}).items():
        problems.append(Problem(f, err.problem if err.tensor is None else f"tensor {err.tensor!r}: {err.problem}", "header"))
    shards = {h.file: h for h in headers}

    tensors: dict[str, TensorInfo] = {}
    for h in headers:
        tensors.update(h.tensors)
    if len(tensors) != sum(len(h.tensors) for h in headers):
        problems.extend(_duplicate_problems(headers))
        tensors = {}
        for h in reversed(headers):  # the first shard holding a name wins, as in the loop above
            tensors.update(h.tensors)
    has_index = index_file == INDEX_NAME
    if has_index and (index_digests is None or index_digests != header_digests):
        if weight_map is None:  # the digests disagree: parse here to say exactly where
            weight_map, _ = read_index(root, None if strict else [])
        skip = {p.where for p in problems if p.kind in ("header", "missing-file")}
        if skip:  # a shard we could not read is reported once, not once per tensor in it
            weight_map = {n: f for n, f in weight_map.items() if f not in skip}
        problems.extend(_index_problems(weight_map, tensors, headers, index_file))
    if stats is not None and sum(stats.signatures.values()) != len(tensors):
        stats = None  # duplicates across shards: recompute from what was kept
    return Checkpoint(root, config, shards, tensors, index_file if has_index else None, source, problems,
                      _stats=stats)


def names_digest(names: Iterable[str]) -> tuple[int, int]:
    """Order-independent fingerprint of a set of names: ``(count, sum of str hashes mod 2**64)``.

    Computed in C (``sum(map(hash, ...))``). ``str`` hashes are salted per process, so digests
    are only comparable within one process and its forked workers - which is how they are used.
    """
    names = list(names)
    return len(names), sum(map(hash, names)) & 0xFFFF_FFFF_FFFF_FFFF


#: Below this many shards, starting worker processes costs more than it saves.
PARALLEL_HEADER_MIN_FILES = 16


def header_pool(files: int, jobs: int | None = None) -> ProcessPoolExecutor | None:
    """Forked worker processes to parse ``files`` shard headers in (JSON decoding holds the GIL),
    one per core up to ``jobs`` and ``files``; ``None`` below :data:`PARALLEL_HEADER_MIN_FILES`
    files, on one core, or where ``fork`` is not available. The workers are forked lazily, at
    the first job submitted."""
    workers = min(jobs or os.cpu_count() or 1, files)
    if workers <= 1 or files < PARALLEL_HEADER_MIN_FILES:
        return None
    # imported here: a small checkpoint (and every command that never opens a large one)
    # does not pay for loading multiprocessing
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    if "fork" not in mp.get_all_start_methods():
        return None
    return ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork"))


class HeaderReader:
    """Reads and validates shard headers, in worker processes for large checkpoints.

    JSON decoding holds the GIL, so with many shards the headers are parsed in forked workers
    that send back compact columns rather than pickled objects. Work starts at construction on
    the ``*.safetensors`` files seen on disk, so it overlaps the parent's parse of the (60 MB,
    for K3) index; :meth:`collect` then returns exactly the files the index names.
    """

    def __init__(self, root: Path, jobs: int | None = None, tolerant: bool = False,
                 shared: SharedHeaders | None = None) -> None:
        self.root = root
        self._shared = shared
        self._futures: dict[str, Future] = {}
        try:
            seen = sorted(e.name for e in os.scandir(root) if e.name.endswith(".safetensors") and e.is_file())
        except OSError:
            seen = []
        self._index: Future | None = None
        self._pool: ProcessPoolExecutor | None = header_pool(len(seen), jobs)
        if self._pool is not None:
            if (root / INDEX_NAME).is_file():
                self._index = self._pool.submit(_index_digests_job, str(root), tolerant)
            for f in seen:
                self._futures[f] = self._pool.submit(header_columns_job, (str(root / f), f))

    def index_digests(self, unsafe: list[str] | None = None) -> dict[str, tuple[int, int]] | None:
        """``{shard: names_digest}`` of the index, parsed by a worker; ``None`` when the index is
        read in this process instead. Raises the worker's :class:`IndexFileError`; in tolerant
        mode unsafe shard paths are appended to ``unsafe`` instead."""
        if self._index is None:
            return None
        digests, bad = self._index.result()
        if unsafe is not None:
            unsafe.extend(bad)
        return digests

    def collect(
        self, files: list[str], errors: dict[str, SafetensorsHeaderError] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> tuple[list[ShardHeader], InventoryStats | None, dict[str, tuple[int, int]]]:
        """Headers of ``files`` in order; when workers read every one of them, the
        :class:`InventoryStats` of their tensors (``None`` otherwise: computed on demand); and
        the :func:`names_digest` of each file. With ``errors``, a malformed shard is recorded
        there and skipped instead of raising. ``progress(1)`` follows each file."""
        try:
            out = []
            stats: InventoryStats | None = InventoryStats(Counter(), Counter())
            digests: dict[str, tuple[int, int]] = {}
            tick = progress or (lambda n: None)
            for f in files:
                fut = self._futures.get(f)
                try:
                    if fut is None:
                        h = self._shared.get(f) if self._shared is not None else read_header(self.root / f, file=f)
                        out.append(h)
                        digests[f] = names_digest(h.tensors)
                        stats = None
                        tick(1)
                        continue
                    cols, shard_stats, digests[f] = fut.result()
                except SafetensorsHeaderError as e:
                    if errors is None:
                        raise
                    errors[f] = e
                    tick(1)
                    continue
                out.append(cols.to_header())
                if self._shared is not None:
                    self._shared.offer(f, out[-1])
                if stats is not None:
                    stats.merge(shard_stats)
                tick(1)
            return out, stats, digests
        finally:
            self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class SharedHeaders:
    """Shard headers of one directory, each parsed once for every thread that asks: the first to
    ask parses it (a thread never waits on another to start), the others wait for that parse.

    ``verify`` hashes from the moment the directory is listed; each hashing thread needs its
    file's header for the scale spans it scans (it looks between chunks whether the structure
    check parsed it already, :meth:`parsed`, and parses it itself only if the file ends first),
    and the structure check needs all of them. The same :class:`ShardHeader` object serves both,
    so the two also agree on what they saw.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._parsed: dict[str, _HeaderSlot] = {}

    def get(self, file: str) -> ShardHeader:
        """The header of ``file`` (relative to the root).

        Raises:
            SafetensorsHeaderError: as :func:`read_header` (to every caller that asks for it).
        """
        with self._lock:
            slot = self._parsed.get(file)
            mine = slot is None
            if slot is None:
                slot = self._parsed[file] = _HeaderSlot()
        if mine:
            try:
                slot.header = read_header(self.root / file, file=file)
            except BaseException as e:  # the waiters get it too; this thread raises it below
                slot.error = e
            finally:
                slot.done.set()
        else:
            slot.done.wait()
        if slot.error is not None:
            raise slot.error
        assert slot.header is not None
        return slot.header

    def offer(self, file: str, header: ShardHeader) -> None:
        """``header`` of ``file``, parsed elsewhere (a worker process): kept unless a thread
        claimed ``file`` already."""
        with self._lock:
            if file not in self._parsed:
                slot = self._parsed[file] = _HeaderSlot()
                slot.header = header
                slot.done.set()

    def parsed(self, file: str) -> ShardHeader | None:
        """The header of ``file`` if a thread parsed it without error, else ``None``."""
        slot = self._parsed.get(file)
        return slot.header if slot is not None and slot.done.is_set() else None


class _HeaderSlot:
    """One header of :class:`SharedHeaders`: set once (``header`` or ``error``), then ``done``."""

    __slots__ = ("done", "error", "header")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.header: ShardHeader | None = None
        self.error: BaseException | None = None


def header_columns_job(args: tuple[str, str]) -> tuple[HeaderColumns, InventoryStats, tuple[int, int]]:
    """Parse one header, classify its tensors and count their signatures: the CPU-bound part of
    opening a checkpoint, shared out to the workers."""
    path, file = args
    gc.disable()  # the worker only allocates acyclic objects; see bulk_allocation
    cols = read_header_columns(path, file=file)
    roles = list(map(classify, cols.names))
    stats = inventory_stats(roles, cols.dtypes, cols.shapes, list(map(operator.sub, cols.ends, cols.begins)))
    return cols, stats, names_digest(cols.names)


def _index_digests_job(root: str, tolerant: bool) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Parse the index in a worker and send back only a fingerprint of each shard's names (and
    the unsafe shard paths, in tolerant mode), so the parent can prove agreement with the
    headers without re-parsing 60 MB of JSON."""
    gc.disable()
    unsafe: list[str] | None = [] if tolerant else None
    weight_map, _ = read_index(Path(root), unsafe)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    return {f: names_digest(ns) for f, ns in by_file.items()}, unsafe or []




def _duplicate_problems(headers: list[ShardHeader]) -> list[Problem]:
    first: dict[str, str] = {}
    out: list[Problem] = []
    for h in headers:
        for name in h.tensors:
            prev = first.setdefault(name, h.file)
            if prev != h.file:
                out.append(Problem(name, f"tensor appears in both {prev} and {h.file}"))
    return out


def _index_problems(
    weight_map: dict[str, str], tensors: dict[str, TensorInfo], headers: list[ShardHeader], index_file: str
) -> list[Problem]:
    # Fast proof of agreement (C-level loops): same names, and each shard's names all map to it.
    if weight_map.keys() == tensors.keys() and all(
        set(map(weight_map.__getitem__, h.tensors)) <= {h.file} for h in headers
    ):
        return []
    out: list[Problem] = []
    for name, file in weight_map.items():
        info = tensors.get(name)
        if info is None:
            out.append(Problem(name, f"listed in {index_file} under {file} but in no shard header"))
        elif info.file != file:
            out.append(Problem(name, f"{index_file} says {file} but the tensor is in {info.file}"))
    if len(tensors) != len(weight_map) or out:
        for name, info in tensors.items():
            if name not in weight_map:
                out.append(Problem(name, f"in {info.file} but not listed in {index_file}"))
    return out
