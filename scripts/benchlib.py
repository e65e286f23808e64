"""The method every ``scripts/bench_*.py`` shares (issue #16): data, cache, timing, machine, report.

- **Data**: the shapes are built with ``k3ckpt synth`` into ``--work`` once and reused
  (``k3-8shard`` and ``k3-small`` by default, see :data:`SHAPES`); ``--data DIR`` names a
  directory holding shapes built earlier (read only; e.g. /work/wt/perf-data).
- **Rounds**: contenders are interleaved round by round, each round starting one contender
  further on, so a slow spell of a shared disk or CPU hits every contender alike; medians.
- **Cache**: ``sync`` before every run; then, ``--cache warm``, the run's inputs are evicted
  and read once (page cache warm, and filled the same way every time: by the kernel's readahead,
  as after reading the files from disk - how a file entered the cache decides the size of its
  pages there, which moves the cost of reading it through a mapping by ~0.1 CPU-s per GB, see
  BENCHMARKS.md); ``--cache cold``, the page cache is dropped - ``/proc/sys/vm/drop_caches``
  when writable (root), else ``POSIX_FADV_DONTNEED`` on each input file - and the report says
  which was used.
- **Timing**: each run is a fresh process; wall from spawn to exit, plus a ``sync`` for writers
  (inside their wall: their bytes must be on disk, as k3ckpt's are when it exits); CPU-s =
  user + sys of the child and its waited-for descendants, peak RSS = the largest of them
  (``os.wait4``). ``cores`` pins a run to that many CPUs (``sched_setaffinity``).
- **Report**: a machine line (CPU model, nproc, RAM, kernel, Python, filesystem and disk,
  ``openssl speed -evp sha256`` per core, load, date, git rev) and tables printed as Markdown
  and written as ``REPORT/<bench>.md`` and ``REPORT/<bench>.json`` for BENCHMARKS.md to quote.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
K3 = [sys.executable, "-m", "k3ckpt"]
GB = 1e9  # decimal, as every rate in BENCHMARKS.md

# name -> `k3ckpt synth` arguments. The first two are issue #16's shapes, run by default.
SHAPES: dict[str, list[str]] = {
    "k3-8shard": ["--preset", "k3-small", "--experts", "160", "--layers", "12", "--shards", "8"],
    "k3-small": ["--preset", "k3-small"],
    # ~1.15 MB per tensor, nearer real K3's 3.1 MB (bench_verify's and bench_fetch's earlier data)
    "k3-density": ["--preset", "k3-small", "--layers", "10", "--experts", "48", "--moe-intermediate", "2048",
                   "--expert-hidden", "2048"],
    # #28's large judged shape: K3's own expert tensor shapes (3072 x 3584 MXFP4, ~2.8 MB per tensor,
    # 355 tensors per GB; K3 319) in two ~4 GB shards, 8.13 GB, 2,887 tensors (~3 min to build)
    "k3-8gb": ["--preset", "k3-small", "--layers", "10", "--experts", "48", "--moe-intermediate", "3072",
               "--expert-hidden", "3584", "--shards", "2"],
    # 4x the experts of k3-8shard (3.29 GB, 16 shards, 42,591 tensors): a third of the fixed cost per GB
    "k3-3gb": ["--preset", "k3-small", "--experts", "640", "--layers", "12", "--shards", "16"],
    "dense": ["--preset", "k3-small", "--layers", "24"],  # 83 KB per tensor: the fixed-cost worst case
    "k3-tiny": ["--preset", "k3-tiny"],  # 6 MB: smoke runs, and bench_cost's fixed costs
    "k3-tiny-wide": ["--preset", "k3-tiny", "--experts", "64", "--layers", "8"],  # 14 MB: smoke runs
}
DEFAULT_SHAPES = ("k3-8shard", "k3-small")
INDEX = "model.safetensors.index.json"


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """A built checkpoint: where it is, its files and bytes, and its manifest when asked for."""

    name: str
    path: Path
    files: tuple[Path, ...]
    nbytes: int
    manifest: Path | None = None

    def describe(self) -> str:
        synth = " ".join(SHAPES.get(self.name, []))
        return f"**{self.name}**: `k3ckpt synth {synth}`, {len(self.files)} files, {self.nbytes:,} B ({self.nbytes / GB:.2f} GB)"


def k3_full(work: Path) -> Path:
    """``k3-full --headers-only`` in ``work`` (96 sparse shards, K3's 497,385 tensors, 1.56 TB
    apparent, ~130 MB on disk), synthesized once (7 s) and reused: its files' times must stay, as
    the loopback hub's digests of them are cached by size and mtime (~8 min for 1.56 TB)."""
    full = work / "k3-full"
    if not (full / INDEX).is_file():
        subprocess.run([*K3, "synth", str(full), "--preset", "k3-full", "--headers-only", "--force"], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
    return full


def top_files(path: Path) -> tuple[Path, ...]:
    """The regular files directly in ``path``, sorted (a synthetic checkpoint is flat)."""
    return tuple(sorted(p for p in path.iterdir() if p.is_file()))


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``; a fetch's hidden ``.cache`` records left out."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*")
               if p.is_file() and ".cache" not in p.relative_to(path).parts)


def build_shape(name: str, work: Path, data: Path | None = None, manifest: bool = False) -> Shape:
    """The shape ``name``, from ``data`` if built there, else from ``work`` (synthesized when missing).

    With ``manifest``, ``NAME.manifest.json`` beside it (built into ``work`` when ``data`` has none).
    """
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    src = next((base / name for base in (data, work) if base and (base / name / INDEX).is_file()), None)
    if src is None:
        src = work / name
        print(f"building {name}: k3ckpt synth {' '.join(SHAPES[name])}", flush=True)
        subprocess.run([*K3, "synth", str(src), "--force", *SHAPES[name]], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
    mpath = None
    if manifest:
        mpath = next((p for p in (src.parent / f"{name}.manifest.json", work / f"{name}.manifest.json") if p.is_file()),
                     work / f"{name}.manifest.json")
        if not mpath.is_file():
            subprocess.run([*K3, "manifest", "build", str(src), "-o", str(mpath)], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
    files = top_files(src)
    return Shape(name, src, files, sum(f.stat().st_size for f in files), mpath)


# --------------------------------------------------------------------------------------------
# page cache
# --------------------------------------------------------------------------------------------

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def files_of(paths: Sequence[Path]) -> Iterator[Path]:
    """The files of ``paths``: a file itself, a directory's files below it."""
    for p in paths:
        yield from (sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p])


def read_into_cache(inputs: Sequence[Path], *, evict_first: bool = False) -> None:
    """Read ``inputs`` (files, or directories whose files are taken) once, so the page cache
    holds them. ``evict_first``: each file is dropped from the cache before it is read - a file
    left there by its writer keeps the page sizes of its writes (4 KiB for small ones), one read
    back from disk gets the readahead's large folios: the same state before every run."""
    buf = bytearray(1 << 20)
    for f in files_of(inputs):
        with open(f, "rb", buffering=0) as fh:
            if evict_first and hasattr(os, "posix_fadvise"):  # (Linux; elsewhere the cache stays as it is)
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            while fh.readinto(buf):
                pass  # reading is the point: it puts the file in the page cache


class CacheControl:
    """Puts the page cache in the same state before every run: warm or cold (see the module doc)."""

    def __init__(self, mode: str = "warm", drop: str = "auto") -> None:
        if mode not in ("warm", "cold") or drop not in ("auto", "proc", "fadvise"):
            raise ValueError(f"cache mode {mode!r} / drop method {drop!r}")
        self.mode = mode
        self.method = "read" if mode == "warm" else drop
        if self.method == "auto":
            self.method = "proc" if os.access(DROP_CACHES, os.W_OK) else "fadvise"

    def describe(self) -> str:
        if self.mode == "warm":
            return "warm page cache (every input evicted, then read once, before each run)"
        how = ("`echo 3 > /proc/sys/vm/drop_caches` (root)" if self.method == "proc"
               else "`POSIX_FADV_DONTNEED` on every input file (not root, or asked: the rest of the cache stays)")
        return f"cold: page cache dropped before each run by {how}"

    def prepare(self, inputs: Sequence[Path]) -> None:
        """``sync``, then warm or evict ``inputs`` (files, or directories whose files are taken)."""
        os.sync()
        files = list(files_of(inputs))
        if self.mode == "warm":
            read_into_cache(files, evict_first=True)
        elif self.method == "proc":
            try:
                DROP_CACHES.write_text("3\n")
            except OSError as exc:  # a read-only /proc/sys (container): say so, evict per file from now on
                print(f"note: cannot write {DROP_CACHES} ({exc.strerror}); using POSIX_FADV_DONTNEED per file", flush=True)
                self.method = "fadvise"
                self.prepare(inputs)
        else:
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


# --------------------------------------------------------------------------------------------
# guest memory (a virtual machine's free page reporting)
# --------------------------------------------------------------------------------------------

#: virtio_balloon's free page reporting (Linux ``mm/page_reporting.c``): free blocks of this order
#: and above are handed back to the host, which discards them.
PAGE_REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
#: An order above any free block's (x86's largest is 10): nothing is reported while it is set.
NO_REPORTING_ORDER = 11
#: Free memory left unbacked by :func:`back_free_memory` (what the kernel keeps in reserve, and room).
BACKING_MARGIN = 2 << 30


class GuestMemory:
    """Pauses a virtual machine's free page reporting for the benchmark and backs its free memory
    once, so that a run does not pay the host for memory an earlier run freed.

    Why (BENCHMARKS.md, "How to reproduce"): on a VM with free page reporting, memory the kernel
    frees - the page cache ``drop_caches`` empties, a finished run's buffers - goes back to the host
    within seconds, and the next first touch of it is a host page fault: ~10 s per GB on the
    firecracker VMs these benchmarks run on, more than all of k3ckpt's hashing, charged as *sys*
    time to whoever allocates the page cache (a writer's ``copy_file_range``, ``cp -r``, a
    download's writes), and varying with how much of the free memory the host took back. Paused
    (``page_reporting_order`` above any free block's order; restored when the benchmark exits),
    the memory backed once stays backed, as on a real node. Not root, or no such parameter: the
    machine line says reporting was left as it is."""

    def __init__(self) -> None:
        self.original: str | None = None
        self.backed_gib = 0.0
        self.backing_s = 0.0

    def pause(self) -> None:
        try:
            self.original = PAGE_REPORTING_ORDER.read_text().strip()
            PAGE_REPORTING_ORDER.write_text(f"{NO_REPORTING_ORDER}\n")
        except OSError:
            self.original = None
            return
        self.backed_gib, self.backing_s = back_free_memory()

    def restore(self) -> None:
        if self.original is not None:
            try:
                PAGE_REPORTING_ORDER.write_text(f"{self.original}\n")
            except OSError as exc:
                print(f"note: could not restore {PAGE_REPORTING_ORDER} to {self.original} ({exc.strerror})")
            self.original = None

    def describe(self) -> str:
        if self.original is None:
            state = "left as it is" if PAGE_REPORTING_ORDER.exists() else "none"
            return f"free page reporting: {state}"
        return (f"free page reporting paused for the run (page_reporting_order {self.original} -> "
                f"{NO_REPORTING_ORDER}), {self.backed_gib:.1f} GiB of free memory backed first "
                f"({self.backing_s:.0f} s)")


def back_free_memory(margin: int = BACKING_MARGIN) -> tuple[float, float]:
    """Touch all free memory but ``margin`` once, in a child that then exits (the pages return to
    the free lists, now backed by the host): ``(GiB touched, seconds)``."""
    free = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemFree:"):
                free = int(line.split()[1]) * 1024
    size = max(0, free - margin) & ~((1 << 21) - 1)
    if not size:
        return 0.0, 0.0
    t0 = time.perf_counter()
    # held all at once (distinct pages), written 2 MiB at a time
    touch = ("import mmap, sys\n"
             "left, held, chunk = int(sys.argv[1]), [], b'\\1' * (1 << 21)\n"
             "while left > 0:\n"
             "    size = min(1 << 30, left); left -= size; held.append(mmap.mmap(-1, size))\n"
             "    for off in range(0, size, len(chunk)): held[-1][off:off + len(chunk)] = chunk\n")
    subprocess.run([sys.executable, "-c", touch, str(size)], check=True)
    return size / 2**30, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# runs
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Timing:
    wall_s: float
    cpu_s: float
    peak_rss: int  # bytes, the largest process of the tree
    stdout: str = ""


def run_timed(cmd: Sequence[str] | str, *, env: dict[str, str] | None = None, sync_after: bool = False,
              cores: int | None = None, ok_codes: tuple[int, ...] = (0,), capture: bool = False) -> Timing:
    """Run ``cmd`` (a list, or a shell string) after a ``sync``; wall includes ``sync_after``."""
    pin = None
    if cores:
        cpus = sorted(os.sched_getaffinity(0))[:cores]

        def pin() -> None:
            os.sched_setaffinity(0, cpus)

    os.sync()  # no earlier run's writeback on this run's time
    with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, shell=isinstance(cmd, str), cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                             stdout=out if capture else subprocess.DEVNULL, stderr=err, preexec_fn=pin)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        if sync_after:
            os.sync()
        wall = time.perf_counter() - t0
        if p.returncode not in ok_codes:
            err.seek(0)
            shown = cmd if isinstance(cmd, str) else " ".join(cmd)
            raise SystemExit(f"benchmark command failed ({p.returncode}): {shown}\n"
                             f"{err.read().decode(errors='replace')[-3000:]}")
        out.seek(0)
        text = out.read().decode(errors="replace") if capture else ""
    return Timing(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024, text)


@dataclass
class Contender:
    """One command of a benchmark round.

    ``out``: its output directory, removed before and after each run; when set, the run's bytes
    are what it wrote there (unless ``count`` says otherwise). ``nbytes``: the bytes a reader's
    rate is of. ``count``: the bytes, from the run's stdout (then stdout is captured); 0 or None
    falls back to the two above.
    ``inputs``: what it reads, warmed or evicted per the cache mode. ``sync``: a writer.
    """

    label: str
    cmd: Sequence[str] | str
    out: Path | None = None
    sync: bool = False
    nbytes: int = 0
    inputs: Sequence[Path] = ()
    env: dict[str, str] | None = None
    cores: int | None = None
    ok_codes: tuple[int, ...] = (0,)
    count: Callable[[str], int | None] | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # for the caller's tables (e.g. shape, workers)


@dataclass(frozen=True)
class Run:
    wall_s: float
    cpu_s: float
    peak_rss: int
    nbytes: int
    server_cpu_s: float = 0.0  # the loopback hub's CPU during the run, when one serves it


def round_order(n: int, round_index: int) -> list[int]:
    """Contender indices for one round: all ``n``, starting ``round_index`` further on."""
    start = round_index % n if n else 0
    return [(start + i) % n for i in range(n)]


def interleave(contenders: Sequence[Contender], rounds: int, cache: CacheControl,
               server: Hub | None = None, quiet: bool = False) -> dict[str, list[Run]]:
    """Every contender ``rounds`` times, round by round; the runs per label."""
    labels = [c.label for c in contenders]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate contender labels: {labels}")
    results: dict[str, list[Run]] = {c.label: [] for c in contenders}
    for r in range(rounds):
        for i in round_order(len(contenders), r):
            run = run_one(contenders[i], cache, server)
            results[contenders[i].label].append(run)
            if not quiet:
                print(f"  round {r + 1}: {contenders[i].label:58s} {run.nbytes / GB:7.3f} GB {run.wall_s:7.2f} s "
                      f"{run.cpu_s:7.2f} CPU-s {run.peak_rss / 2**20:6.0f} MiB", flush=True)
    return results


def run_one(c: Contender, cache: CacheControl, server: Hub | None = None) -> Run:
    if c.out is not None:
        shutil.rmtree(c.out, ignore_errors=True)
    cache.prepare(c.inputs)
    before = server.cpu_s() if server else 0.0
    t = run_timed(c.cmd, env=c.env, sync_after=c.sync, cores=c.cores, ok_codes=c.ok_codes, capture=c.count is not None)
    server_cpu = server.cpu_s() - before if server else 0.0
    nbytes = c.count(t.stdout) if c.count is not None else 0
    if not nbytes:  # no count asked for, or none found in the output
        nbytes = tree_bytes(c.out) if c.out is not None else c.nbytes
    if c.out is not None:
        shutil.rmtree(c.out, ignore_errors=True)
    return Run(t.wall_s, t.cpu_s, t.peak_rss, nbytes, server_cpu)


@dataclass(frozen=True)
class Summary:
    """Medians of a contender's runs (peak RSS: the largest)."""

    label: str
    runs: int
    wall_s: float
    cpu_s: float
    peak_rss: int
    nbytes: int
    walls: tuple[float, ...]
    server_cpu_s: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.wall_s / GB if self.wall_s else 0.0

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.nbytes / GB) if self.nbytes else 0.0

    def as_row(self) -> dict[str, Any]:
        return {"label": self.label, "runs": self.runs, "bytes": self.nbytes, "wall_s": round(self.wall_s, 4),
                "cpu_s": round(self.cpu_s, 4), "cpu_per_wall": round(self.cpu_s / self.wall_s, 3) if self.wall_s else None,
                "gb_per_s": round(self.gb_per_s, 4), "cpu_s_per_gb": round(self.cpu_s_per_gb, 4),
                "peak_rss_mib": round(self.peak_rss / 2**20, 1), "walls_s": [round(w, 3) for w in self.walls],
                "server_cpu_s": round(self.server_cpu_s, 4)}


def summarize(label: str, runs: Sequence[Run]) -> Summary:
    if not runs:
        raise ValueError(f"no runs of {label}")
    return Summary(label, len(runs), statistics.median(r.wall_s for r in runs), statistics.median(r.cpu_s for r in runs),
                   max(r.peak_rss for r in runs), int(statistics.median(r.nbytes for r in runs)),
                   tuple(r.wall_s for r in runs), statistics.median(r.server_cpu_s for r in runs))


def summarize_all(results: dict[str, list[Run]]) -> dict[str, Summary]:
    return {label: summarize(label, runs) for label, runs in results.items()}


def json_value(text: str, key: str) -> Any:
    """The first value of ``key`` anywhere in the JSON document ``text`` (None if absent)."""
    stack: list[Any] = [json.loads(text)]
    while stack:
        node = stack.pop(0)
        if isinstance(node, dict):
            if key in node:
                return node[key]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


# --------------------------------------------------------------------------------------------
# the loopback hub, in its own process
# --------------------------------------------------------------------------------------------

class Hub:
    """``python -m k3ckpt.testing.hub`` serving ``repos`` (id -> directory) from another process,
    so its CPU is neither the benchmark's nor a contender's (:meth:`cpu_s` reads it)."""

    def __init__(self, repos: dict[str, Path], work: Path, cpus: Sequence[int] | None = None) -> None:
        self.repos = repos
        self.work = work
        self.cpus = list(cpus) if cpus else None  # pinned there (apart from the client's) when given
        self.url = ""
        self.commits: dict[str, str] = {}
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Hub:
        log = self.work / "hub.log"
        cmd = [sys.executable, "-m", "k3ckpt.testing.hub", *map(str, self.repos.values()), "--port", "0",
               "--cache-dir", str(self.work / "hub-cache")]
        for rid in self.repos:
            cmd += ["--repo", rid]
        cpus = self.cpus

        def pin() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(log, "wb") as fh:
            self._proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, preexec_fn=pin)
        deadline = time.monotonic() + 600  # it hashes every served file on start (cached across runs)
        while "Ctrl-C" not in log.read_text():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise SystemExit(f"the loopback hub did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)
        for line in log.read_text().splitlines():
            if line.startswith("Serving on "):
                self.url = line.split()[2]
            elif " @ " in line and line.strip().split(" @ ")[0] in self.repos:
                rid, rest = line.strip().split(" @ ", 1)
                self.commits[rid] = rest.split()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None

    def env(self, **extra: str) -> dict[str, str]:
        """A client's environment: this hub for both clients, no Xet, no progress bars."""
        return {**os.environ, "HF_ENDPOINT": self.url, "MODELSCOPE_ENDPOINT": self.url, "HF_HUB_DISABLE_XET": "1",
                "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **extra}

    def resolve_url(self, repo: str, path: str) -> str:
        return f"{self.url}/{repo}/resolve/{self.commits.get(repo, 'main')}/{quote(path)}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def cpu_s(self) -> float:
        """User + sys seconds the hub process has used so far (``/proc/PID/stat``)."""
        if self._proc is None:
            return 0.0
        fields = Path(f"/proc/{self._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def curl_cmd(urls: Sequence[str], dest: Path, parallel: int = 8, sync: bool = False) -> str:
    """``xargs -P N curl -O`` of ``urls`` into ``dest`` (a shell string), optionally then ``sync``."""
    listing = " ".join(f"'{u}'" for u in urls)
    return (f"mkdir -p '{dest}' && cd '{dest}' && printf '%s\\n' {listing} | xargs -P{parallel} -n1 curl -s -f -O"
            + (" && sync" if sync else ""))


# --------------------------------------------------------------------------------------------
# the machine
# --------------------------------------------------------------------------------------------

def openssl_sha256_speed(seconds: int = 2) -> float:
    """OpenSSL's single-core SHA-256 speed in bytes/s (``openssl speed -evp sha256``, 16 KiB blocks)."""
    out = subprocess.run(["openssl", "speed", "-seconds", str(seconds), "-evp", "sha256", "-bytes", "16384"],
                         capture_output=True, text=True, check=True).stdout
    last = [ln for ln in out.splitlines() if ln.lower().startswith("sha256")][-1]
    return float(last.split()[-1].rstrip("k")) * 1000


def _cmd_out(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def filesystem(path: Path) -> str:
    """``ext4 on /dev/vda (rotational)``: the filesystem holding ``path`` and its disk."""
    fs = _cmd_out(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", str(path)]).split()
    if len(fs) < 2:
        return "?"
    dev = Path(fs[1]).name
    rot = ""
    for name in (dev, dev.rstrip("0123456789").removesuffix("p") if dev[-1:].isdigit() else dev):
        flag = Path(f"/sys/block/{name}/queue/rotational")
        if flag.is_file():
            rot = " (rotational)" if flag.read_text().strip() == "1" else " (non-rotational)"
            break
    return f"{fs[0]} on {fs[1]}{rot}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # no /proc (not Linux): the platform module's answer below
    return platform.processor() or platform.machine()


def git_rev() -> str:
    rev = _cmd_out(["git", "rev-parse", "--short", "HEAD"]) or "?"
    dirty = _cmd_out(["git", "status", "--porcelain", "--untracked-files=no"])
    return rev + ("-dirty" if dirty else "")


def physical_memory() -> int:
    """This machine's bytes of RAM."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine(work: Path, sha_seconds: int = 2) -> dict[str, Any]:
    """What a reader needs to compare two runs of a benchmark."""
    return {
        "cpu": cpu_model(), "nproc": os.cpu_count(), "arch": platform.machine(),
        "ram_gib": round(physical_memory() / 2**30, 1),
        "kernel": platform.release(), "python": platform.python_version(), "filesystem": filesystem(work),
        "openssl_sha256_gb_per_s_per_core": round(openssl_sha256_speed(sha_seconds) / GB, 4),
        "load_avg_1min": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "git_rev": git_rev(),
    }


def machine_line(m: dict[str, Any]) -> str:
    return (f"machine: {m['cpu']}, nproc {m['nproc']}, {m['ram_gib']:g} GiB, kernel {m['kernel']}, "
            f"Python {m['python']}, {m['filesystem']}; openssl speed -evp sha256: "
            f"{m['openssl_sha256_gb_per_s_per_core']:.2f} GB/s per core; load {m['load_avg_1min']} at start; "
            f"{m['date']}; git {m['git_rev']}" + (f"; {m['guest_memory']}" if m.get("guest_memory") else ""))


# --------------------------------------------------------------------------------------------
# arguments and the report
# --------------------------------------------------------------------------------------------

def add_common_args(ap: argparse.ArgumentParser, bench: str, runs: int = 3, cache: str = "warm") -> None:
    ap.add_argument("--work", type=Path, default=ROOT / "work" / bench,
                    help="built data and scratch outputs (data reused across runs) [default: work/%(prog)s]")
    ap.add_argument("--data", type=Path, default=None,
                    help="a directory holding shapes built earlier (read only), e.g. /work/wt/perf-data")
    ap.add_argument("--runs", type=int, default=runs, help=f"interleaved rounds; medians reported [default: {runs}]")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--cache", choices=("warm", "cold"), default=cache, help=f"page cache before each run [default: {cache}]")
    ap.add_argument("--drop", choices=("auto", "proc", "fadvise"), default="auto",
                    help="how --cache cold drops: /proc/sys/vm/drop_caches (root) or fadvise per input file [default: auto]")
    ap.add_argument("--report", type=Path, default=None, help="where BENCH.md and BENCH.json go [default: --work]")
    ap.add_argument("--page-reporting", choices=("pause", "leave"), default="pause",
                    help="a VM's free page reporting during the run: paused, memory backed once (root), "
                         "or left as it is (benchlib.GuestMemory) [default: pause]")


@dataclass
class Setup:
    """What ``start`` hands a benchmark: its work directory, shapes, cache control and machine."""

    bench: str
    args: argparse.Namespace
    work: Path
    shapes: list[str]
    cache: CacheControl
    machine: dict[str, Any]

    def shape(self, name: str, manifest: bool = False) -> Shape:
        return build_shape(name, self.work, self.args.data, manifest=manifest)

    def method(self) -> str:
        return (f"{self.args.runs} interleaved rounds, medians; {self.cache.describe()}; `sync` before every run "
                f"and inside writers' wall; CPU-s = user+sys of the process tree, peak RSS = its largest process "
                f"(`wait4`)")


def start(bench: str, args: argparse.Namespace) -> Setup:
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    memory = GuestMemory()
    if getattr(args, "page_reporting", "leave") == "pause":
        memory.pause()
        atexit.register(memory.restore)
        # a kill (or Ctrl-C in a shell's background job, which ignores SIGINT) restores it too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    m = machine(work)
    m["guest_memory"] = memory.describe()
    print(machine_line(m), flush=True)
    return Setup(bench, args, work, shapes, CacheControl(args.cache, args.drop), m)


@dataclass
class Table:
    """Rows (dicts of raw values, kept as they are in the JSON) and how to show them in Markdown:
    ``columns`` = (header, key, format), e.g. ``("wall (s)", "wall_s", "{:.2f}")``."""

    title: str
    columns: list[tuple[str, str, str]]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: str = ""

    def markdown(self) -> str:
        head = "| " + " | ".join(h for h, _, _ in self.columns) + " |"
        align = "|" + "|".join("---" if fmt in ("{}", "`{}`") else "---:" for _, _, fmt in self.columns) + "|"
        lines = [head, align]
        for row in self.rows:
            cells = [fmt.format(row[key]) if row.get(key) is not None else "" for _, key, fmt in self.columns]
            lines.append("| " + " | ".join(cells) + " |")
        text = f"{self.title}\n\n" + "\n".join(lines)
        return text + (f"\n\n{self.notes}" if self.notes else "")


def render(bench: str, m: dict[str, Any], method: str, tables: Sequence[Table]) -> str:
    command = " ".join([".venv/bin/python", f"scripts/{bench}.py", *sys.argv[1:]])
    parts = [f"### `{bench}` ({m['date']})", f"Command: `{command}`", method + ".", machine_line(m) + "."]
    return "\n\n".join(parts + [t.markdown() for t in tables]) + "\n"


def write_report(setup: Setup, tables: Sequence[Table], extra: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Print the Markdown and write ``<bench>.md`` and ``<bench>.json`` into ``--report``."""
    out: Path = (setup.args.report or setup.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    md = render(setup.bench, setup.machine, setup.method(), tables)
    doc = {"bench": setup.bench, "command": [f"scripts/{setup.bench}.py", *sys.argv[1:]], "machine": setup.machine,
           "method": setup.method(), "tables": [{"title": t.title, "rows": t.rows} for t in tables], **(extra or {})}
    md_path, json_path = out / f"{setup.bench}.md", out / f"{setup.bench}.json"
    md_path.write_text(md)
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    print("\n" + md)
    print(f"report: {md_path} and {json_path}")
    return md_path, json_path


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a k3ckpt run: this one, plus ``extra``."""
    return {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def row(s: Summary, peer: Summary | None = None, **extra: Any) -> dict[str, Any]:
    """A table row of ``s``; against ``peer``: rate ratio (bytes per wall second, ours over the
    peer's; > 1 is faster) and CPU ratio (the peer's CPU-s per byte over ours; > 1 is cheaper)."""
    r = s.as_row()
    if peer is not None and peer is not s:
        r["peer"] = peer.label
        r["vs_wall"] = round(s.gb_per_s / peer.gb_per_s, 3) if peer.gb_per_s else None
        r["vs_cpu"] = round(peer.cpu_s_per_gb / s.cpu_s_per_gb, 3) if s.cpu_s_per_gb else None
        r["vs_wall_rounds"] = round_ratios(s, peer)
    r.update(extra)
    return r


def round_ratios(s: Summary, peer: Summary) -> list[float] | None:
    """The lowest and the highest wall ratio (rate, ours over the peer's) that any one round
    gave: round ``i``'s runs are each contender's ``i``-th, side by side in time, so the spread
    shows how far the machine's noise moves the median ratio. ``None`` without paired runs."""
    if len(s.walls) != len(peer.walls) or not s.walls or not s.nbytes or not peer.nbytes:
        return None
    ratios = [(s.nbytes / w) / (peer.nbytes / pw) for w, pw in zip(s.walls, peer.walls) if w and pw]
    return [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None


# The usual columns of a timing table (a row from `row`).
COLUMNS: list[tuple[str, str, str]] = [
    ("command", "label", "`{}`"), ("bytes", "bytes", "{:,}"), ("wall (s)", "wall_s", "{:.2f}"),
    ("CPU-s", "cpu_s", "{:.2f}"), ("CPU/wall", "cpu_per_wall", "{:.2f}"), ("GB/s", "gb_per_s", "{:.2f}"),
    ("vs peer (wall)", "vs_wall", "{:.2f}x"), ("by round (wall)", "vs_wall_rounds", "{0[0]:.2f}-{0[1]:.2f}x"),
    ("vs peer (CPU)", "vs_cpu", "{:.2f}x"), ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"),
]


# The topologies of issue #16's profile: 8 ranks; the rank layout EP8 x TP2, and the engine node
# format vLLM TP2 x DP4 on two 4-GPU nodes (node 0 holds half the experts).
RANK_LAYOUT = ["--format", "rank", "--ep", "8", "--tp", "2"]
NODE_LAYOUT = ["--tp", "2", "--dp", "4", "--gpus-per-node", "4"]
