#!/usr/bin/env python
"""Where the time goes: wall, CPU-seconds and a profile breakdown of verify and reshard (issue #16).

    .venv/bin/python scripts/bench_profile.py [--work work/bench-profile] [--runs 3] [--shapes k3-8shard,k3-small]

Builds the two shapes of issue #16 when missing (``k3-8shard``: ``k3ckpt synth --preset k3-small
--experts 160 --layers 12 --shards 8``, 8 shards of ~133 MB, 1.07 GB; ``k3-small``: ``--preset
k3-small``, 12 shards, 1.1 GB), warms the page cache and, per shape, times in interleaved rounds
(each a fresh process; wall from spawn to exit, then ``sync`` for the writers; CPU = user+sys of
the child and its waited-for descendants from ``wait4``):
  - ``k3ckpt verify DIR --manifest M --no-cache`` against ``xargs -P2 -n1 openssl dgst -sha256``;
  - ``k3ckpt reshard --format rank --ep 8 --tp 2`` and the default node format ``reshard --tp 2
    --dp 4 --gpus-per-node 4``, against ``cp -r`` (all followed by ``sync``).
Then, once each, the k3ckpt commands under a profiler that covers every thread (cProfile in the
main thread and in each worker thread, merged) and under ``strace -c -f`` (syscall time), and
prints the buckets: hashing, reads, copies, fsync, fadvise, header parse, planning, structure and
scale checks, waits (idle threads), other Python. OpenSSL's single-core SHA-256 speed is printed
as the hashing floor. The page cache stays warm (nothing is dropped) so that disk speed is not
what is measured; the writers' ``sync`` is inside their wall time.
"""

from __future__ import annotations

import argparse
import os
import platform
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
K3 = [sys.executable, "-m", "k3ckpt"]
SHAPES = {
    "k3-8shard": ["--preset", "k3-small", "--experts", "160", "--layers", "12", "--shards", "8"],
    "k3-small": ["--preset", "k3-small"],
}
# Buckets of the merged profile, first match wins: (bucket, regex over "file:function").
BUCKETS = [
    ("hashing (sha256/sha1 update)", r"_hashlib\.HASH|openssl_sha|hexdigest"),
    ("fsync", r"posix\.fsync|fsync_dir|fdatasync"),
    ("fadvise (cache eviction)", r"posix_fadvise"),
    ("copies (copy_file_range/sendfile/write)", r"copy_file_range|posix\.sendfile|posix\.write|posix\.pwrite|writelines"),
    ("reads (pread/readinto)", r"posix\.pread|posix\.read|readinto|preadv"),
    ("NaN-scale scan", r"scan_file|scan_files|rescan_scales|_nan_issues|count_nonzero|\.find'|bytes\.find|bytes\.count"),
    ("waits (idle threads, pool)",
     r"lock' objects>|acquire|Condition\.wait|_thread\.|SimpleQueue|as_completed|result'|futures/|select|poll"),
    ("header parse (json, header)", r"json/|format/header\.py|format/checkpoint\.py|integrity/manifest\.py"),
    ("planning (plan, layout, topology)",
     r"deploy/plan\.py|format/layout\.py|format/topology\.py|format/nodedir\.py|deploy/reshard\.py:.*plan"),
    ("structure checks", r"integrity/verify\.py|format/roles\.py|format/config\.py"),
    ("span hashing bookkeeping (Python)", r"integrity/hashing\.py"),
    ("copy bookkeeping (Python)", r"deploy/bytecopy\.py|deploy/reshard\.py"),
]

# The child: run the CLI with cProfile in every thread; merge and dump at exit.
CHILD = r'''
import cProfile, sys, threading, atexit, pstats, runpy
out = sys.argv[1]
sys.argv = ["k3ckpt", *sys.argv[2:]]
profs = []
run = threading.Thread.run
def profiled(self):
    p = cProfile.Profile(); profs.append(p)
    p.enable()
    try:
        run(self)
    finally:
        p.disable()
threading.Thread.run = profiled
main = cProfile.Profile(); profs.append(main)
def dump():
    main.disable()
    st = pstats.Stats(profs[0])
    for p in profs[1:]:
        try:
            st.add(p)
        except TypeError:
            pass  # a profile with no calls
    st.dump_stats(out)
atexit.register(dump)
main.enable()
runpy.run_module("k3ckpt", run_name="__main__")
'''


def run_timed(cmd: list[str] | str, sync: bool) -> tuple[float, float]:
    """(wall seconds incl. a following sync, CPU seconds user+sys of the child tree)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, shell=isinstance(cmd, str), cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    if sync:
        subprocess.run(["sync"], check=True)
    dt = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code not in (0,):
        raise SystemExit(f"failed ({code}): {cmd}\n{p.stderr.read().decode() if p.stderr else ''}")
    return dt, ru.ru_utime + ru.ru_stime


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bucketize(stats_file: Path) -> tuple[list[tuple[str, float]], float, list[str]]:
    """Thread-seconds per bucket (tottime summed over threads), the total, the top functions."""
    st = pstats.Stats(str(stats_file))
    sums: dict[str, float] = {}
    total = 0.0
    rows = []
    for (fname, _line, func), (_cc, _nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        key = f"{fname}:{func}"
        if "Thread.run" in func or func == "profiled":
            continue
        total += tt
        rows.append((tt, key))
        bucket = next((b for b, rx in BUCKETS if re.search(rx, key)), "other Python")
        sums[bucket] = sums.get(bucket, 0.0) + tt
    rows.sort(reverse=True)
    top = [f"{tt:6.2f}s {k.replace(str(ROOT) + '/', '')[-90:]}" for tt, k in rows[:12]]
    return sorted(sums.items(), key=lambda kv: -kv[1]), total, top


def strace_summary(cmd: list[str], out: Path) -> list[tuple[str, float, int]]:
    """(syscall, seconds, calls) of the busiest syscalls, all threads (strace -c -f)."""
    if not shutil.which("strace"):
        return []
    log = out.with_suffix(".strace")
    subprocess.run(["strace", "-c", "-f", "-o", str(log), *cmd], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and re.match(r"^\d", parts[0]) and not line.lstrip().startswith("100.00"):
            try:
                rows.append((parts[-1], float(parts[1]), int(parts[3])))
            except ValueError:
                continue
    return sorted(rows, key=lambda r: -r[1])[:8]


def openssl_speed() -> float:
    """OpenSSL single-core SHA-256 bytes/s at 16 KiB blocks."""
    out = subprocess.run(["openssl", "speed", "-seconds", "2", "-evp", "sha256", "-bytes", "16384"],
                         capture_output=True, text=True, check=True).stdout
    last = [ln for ln in out.splitlines() if ln.lower().startswith("sha256")][-1]
    return float(last.split()[-1].rstrip("k")) * 1000


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu if ln.startswith("Model name")), "?")
    return (f"{os.cpu_count()} cores ({model}), {platform.machine()}, kernel {platform.release()}, "
            f"Python {platform.python_version()}, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "bench-profile")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-profile", action="store_true", help="timings only")
    ap.add_argument("--jobs-one", action="store_true",
                    help="also time and profile each k3ckpt command with --jobs 1 (scaling: CPU-s per GB at 1 vs 2 workers)")
    args = ap.parse_args()
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    child = work / "profiled_cli.py"
    child.write_text(CHILD)
    ncpu = os.cpu_count() or 1
    print(f"machine: {machine()}; date {time.strftime('%Y-%m-%d %H:%M')}; runs {args.runs}; warm page cache")
    speed = openssl_speed()
    print(f"openssl speed -evp sha256 -bytes 16384 (one core): {speed / 1e9:.3f} GB/s")
    for shape in args.shapes.split(","):
        src = work / shape
        if not (src / "model.safetensors.index.json").exists():
            subprocess.run([*K3, "synth", str(src), "--force", *SHAPES[shape]], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
        manifest = work / f"{shape}.manifest.json"
        if not manifest.exists():
            subprocess.run([*K3, "manifest", "build", str(src), "-o", str(manifest)], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
        files = sorted(str(p) for p in src.iterdir() if p.is_file())
        total = sum(os.path.getsize(f) for f in files)
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm
        listing = " ".join(f"'{f}'" for f in files)
        out = work / "out"
        contenders: dict[str, tuple[list[str] | str, bool, bool]] = {  # cmd, sync, is a writer
            "verify --manifest M --no-cache": (
                [*K3, "verify", str(src), "--manifest", str(manifest), "--no-cache"], False, False),
            f"xargs -P{ncpu} -n1 openssl dgst -sha256": (
                f"printf '%s\\n' {listing} | xargs -P{ncpu} -n1 openssl dgst -sha256", False, False),
            "cp -r + sync": (["cp", "-r", str(src), str(out)], True, True),
            "reshard --format rank --ep 8 --tp 2": (
                [*K3, "reshard", str(src), "-o", str(out), "--format", "rank", "--ep", "8", "--tp", "2"], True, True),
            "reshard --tp 2 --dp 4 --gpus-per-node 4 (node)": (
                [*K3, "reshard", str(src), "-o", str(out), "--tp", "2", "--dp", "4", "--gpus-per-node", "4"], True, True),
        }
        if args.jobs_one:
            for label, (cmd, sync, writer) in list(contenders.items()):
                if isinstance(cmd, list) and cmd[:3] == K3:
                    contenders[f"{label} --jobs 1"] = ([*cmd, "--jobs", "1"], sync, writer)
        res: dict[str, list[tuple[float, float, int]]] = {k: [] for k in contenders}
        for _ in range(args.runs):  # interleaved
            for label, (cmd, sync, writer) in contenders.items():
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                wall, cpu = run_timed(cmd, sync)
                nbytes = tree_bytes(out) if writer else total
                res[label].append((wall, cpu, nbytes))
                shutil.rmtree(out, ignore_errors=True)
        print(f"\n### {shape}: `k3ckpt synth {' '.join(SHAPES[shape])}`, {len(files)} files, {total / 1e9:.2f} GB\n")
        print("| command | bytes | wall (s) | CPU-s | CPU/wall | GB/s | vs peer (wall) | vs peer (CPU) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v), v[0][2]) for k, v in res.items()}
        peers = {"verify --manifest M --no-cache": f"xargs -P{ncpu} -n1 openssl dgst -sha256"}
        for label, (wall, cpu, nbytes) in med.items():
            peer = "cp -r + sync" if label.startswith("reshard") else peers.get(label.removesuffix(" --jobs 1"))
            vs_w = vs_c = ""
            if peer:
                pw, pc, pb = med[peer]
                vs_w = f"{(nbytes / wall) / (pb / pw):.2f}x"
                vs_c = f"{(pc / pb) / (cpu / nbytes):.2f}x"
            print(f"| `{label}` | {nbytes:,} | {wall:.2f} | {cpu:.2f} | {cpu / wall:.2f} | "
                  f"{nbytes / wall / 1e9:.2f} | {vs_w} | {vs_c} |")
        if args.no_profile:
            continue
        for label, (cmd, sync, writer) in contenders.items():
            if not isinstance(cmd, list) or cmd[:3] != K3:
                continue
            shutil.rmtree(out, ignore_errors=True)
            prof = Path(tempfile.mkstemp(suffix=".pstats", dir=work)[1])
            pcmd = [sys.executable, str(child), str(prof), *cmd[3:]]
            wall, cpu = run_timed(pcmd, sync)
            buckets, tt_total, top = bucketize(prof)
            shutil.rmtree(out, ignore_errors=True)
            sys_rows = strace_summary(cmd, prof)
            shutil.rmtree(out, ignore_errors=True)
            print(f"\n`{label}` on {shape}, profiled (all threads; {wall:.2f} s wall, {cpu:.2f} CPU-s under the "
                  f"profiler; {tt_total:.2f} thread-s in Python functions and the C calls they make):\n")
            print("| bucket | thread-s | share |")
            print("|---|---:|---:|")
            for b, s in buckets:
                if s >= 0.005:
                    print(f"| {b} | {s:.2f} | {100 * s / tt_total:.0f}% |")
            if "hashing (sha256/sha1 update)" in dict(buckets):
                # Thread-seconds: with more runnable threads than cores they include time spent
                # descheduled, so the rate is a floor of the per-core rate unless --jobs 1.
                h = dict(buckets)["hashing (sha256/sha1 update)"]
                nbytes = res[label][0][2]
                print(f"\n{'output' if writer else 'source'} bytes / hashing thread-s: {nbytes / h / 1e9:.3f} GB/s "
                      f"({nbytes / h / speed:.0%} of openssl speed one core; hashes at least these bytes once)")
            print("\ntop functions by own time:\n```\n" + "\n".join(top) + "\n```")
            if sys_rows:
                print("\nstrace -c -f (syscall seconds, all threads; strace slows the run): "
                      + ", ".join(f"{n} {s:.2f} s/{c}" for n, s, c in sys_rows))
            prof.unlink(missing_ok=True)
            prof.with_suffix(".strace").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
