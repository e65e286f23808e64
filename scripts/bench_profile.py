#!/usr/bin/env python
"""Where the time goes: wall, CPU-seconds and a profile breakdown of verify and reshard (issue #16).

    .venv/bin/python scripts/bench_profile.py [--work work/bench_profile] [--runs 3] [--shapes k3-8shard,k3-small] [--jobs-one]

Builds the two shapes of issue #16 when missing (``k3-8shard``: ``k3ckpt synth --preset k3-small
--experts 160 --layers 12 --shards 8``, 8 shards of ~133 MB, 1.07 GB; ``k3-small``: ``--preset
k3-small``, 12 shards, 1.1 GB) and, per shape, times in interleaved rounds with the shared method
of scripts/benchlib.py (each a fresh process; wall from spawn to exit, then ``sync`` for the
writers; CPU = user+sys of the child and its waited-for descendants from ``wait4``):
  - ``k3ckpt verify DIR --manifest M --no-cache`` against ``xargs -P2 -n1 openssl dgst -sha256``;
  - ``k3ckpt reshard --format rank --ep 8 --tp 2`` and the default node format ``reshard --tp 2
    --dp 4 --gpus-per-node 4``, against ``cp -r`` (all followed by ``sync``).
Then, once each, the k3ckpt commands under a profiler that covers every thread (cProfile in the
main thread and in each worker thread, merged) and under ``strace -c -f`` (syscall time), and
prints the buckets: hashing, reads, copies, fsync, fadvise, header parse, planning, structure and
scale checks, waits (idle threads), other Python. OpenSSL's single-core SHA-256 speed is printed
as the hashing floor. The page cache is warm by default (``--cache cold`` drops it) so that disk
speed is not what is measured; the writers' ``sync`` is inside their wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import benchlib as bl

ROOT = bl.ROOT
# Buckets of the merged profile, first match wins: (bucket, regex over "file:function").
BUCKETS = [
    ("hashing (sha256/sha1 update)", r"_hashlib\.HASH|openssl_sha|hexdigest"),
    ("fsync", r"posix\.fsync|fsync_dir|fdatasync"),
    ("fadvise (cache eviction)", r"posix_fadvise"),
    ("copies (copy_file_range/sendfile/write)", r"copy_file_range|posix\.sendfile|posix\.write|posix\.pwrite|writelines"),
    ("reads (pread/readinto)", r"posix\.pread|posix\.read|readinto|preadv"),
    ("NaN-scale scan", r"scan_file|scan_files|rescan_scales|nan_issues|count_nonzero|\.find'|bytes\.find|bytes\.count"),
    ("waits (idle threads, pool)",
     r"lock' objects>|acquire|Condition\.wait|_thread\.|SimpleQueue|as_completed|result'|futures/|select|poll"),
    ("header parse (json, header)", r"json/|format/header\.py|format/checkpoint\.py|integrity/manifest\.py"),
    ("planning (plan, layout, topology)",
     r"deploy/plan\.py|format/layout\.py|format/topology/|format/nodedir\.py|deploy/reshard/plan\.py"),
    ("structure checks",
     r"integrity/(verify|report|statcache|structure|scales|background)\.py|format/roles\.py|format/config\.py"),
    ("span hashing bookkeeping (Python)", r"integrity/hashing\.py"),
    ("copy bookkeeping (Python)", r"deploy/bytecopy\.py|deploy/reshard/"),
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


def contenders(shape: bl.Shape, out: Path, ncpu: int, jobs_one: bool) -> list[bl.Contender]:
    src = str(shape.path)
    listing = " ".join(f"'{f}'" for f in shape.files)
    reader: dict[str, Any] = {"nbytes": shape.nbytes, "inputs": shape.files}
    writer: dict[str, Any] = {"out": out, "sync": True, "inputs": shape.files}
    cs = [
        bl.Contender("verify --manifest M --no-cache",
                     [*bl.K3, "verify", src, "--manifest", str(shape.manifest), "--no-cache"], **reader),
        bl.Contender(f"xargs -P{ncpu} -n1 openssl dgst -sha256",
                     f"printf '%s\\n' {listing} | xargs -P{ncpu} -n1 openssl dgst -sha256", **reader),
        bl.Contender("cp -r + sync", ["cp", "-r", src, str(out)], **writer),
        bl.Contender("reshard --format rank --ep 8 --tp 2", [*bl.K3, "reshard", src, "-o", str(out), *bl.RANK_LAYOUT],
                     **writer),
        bl.Contender("reshard --tp 2 --dp 4 --gpus-per-node 4 (node)",
                     [*bl.K3, "reshard", src, "-o", str(out), *bl.NODE_LAYOUT], **writer),
    ]
    if jobs_one:
        for c in list(cs):
            if isinstance(c.cmd, list) and c.cmd[:3] == bl.K3:
                cs.append(dataclasses.replace(c, label=f"{c.label} --jobs 1", cmd=[*c.cmd, "--jobs", "1"]))
    return cs


def peer_of(label: str, ncpu: int) -> str | None:
    if label.startswith("reshard"):
        return "cp -r + sync"
    if label.startswith("verify"):
        return f"xargs -P{ncpu} -n1 openssl dgst -sha256"
    return None


def profile(setup: bl.Setup, c: bl.Contender, child: Path, nbytes: int) -> list[str]:
    """One run of ``c`` under the all-thread profiler, one under strace: the report's lines."""
    assert isinstance(c.cmd, list)
    work = setup.work
    if c.out is not None:
        shutil.rmtree(c.out, ignore_errors=True)
    setup.cache.prepare(c.inputs)
    prof = Path(tempfile.mkstemp(suffix=".pstats", dir=work)[1])
    t = bl.run_timed([sys.executable, str(child), str(prof), *c.cmd[3:]], sync_after=c.sync)
    buckets, tt_total, top = bucketize(prof)
    if c.out is not None:
        shutil.rmtree(c.out, ignore_errors=True)
    sys_rows = strace_summary(c.cmd, prof)
    if c.out is not None:
        shutil.rmtree(c.out, ignore_errors=True)
    lines = [f"`{c.label}`, profiled (all threads; {t.wall_s:.2f} s wall, {t.cpu_s:.2f} CPU-s under the "
             f"profiler; {tt_total:.2f} thread-s in Python functions and the C calls they make):\n",
             "| bucket | thread-s | share |", "|---|---:|---:|"]
    lines += [f"| {b} | {s:.2f} | {100 * s / tt_total:.0f}% |" for b, s in buckets if s >= 0.005]
    speed = setup.machine["openssl_sha256_gb_per_s_per_core"] * bl.GB
    h = dict(buckets).get("hashing (sha256/sha1 update)")
    if h:
        # Thread-seconds: with more runnable threads than cores they include time spent
        # descheduled, so the rate is a floor of the per-core rate unless --jobs 1.
        lines.append(f"\n{'output' if c.sync else 'source'} bytes / hashing thread-s: {nbytes / h / 1e9:.3f} GB/s "
                     f"({nbytes / h / speed:.0%} of openssl speed one core; hashes at least these bytes once)")
    lines.append("\ntop functions by own time:\n```\n" + "\n".join(top) + "\n```")
    if sys_rows:
        lines.append("\nstrace -c -f (syscall seconds, all threads; strace slows the run): "
                     + ", ".join(f"{n} {s:.2f} s/{k}" for n, s, k in sys_rows))
    prof.unlink(missing_ok=True)
    prof.with_suffix(".strace").unlink(missing_ok=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_profile")
    ap.add_argument("--no-profile", action="store_true", help="timings only")
    ap.add_argument("--jobs-one", action="store_true",
                    help="also time and profile each k3ckpt command with --jobs 1 (scaling: CPU-s per GB at 1 vs 2 workers)")
    args = ap.parse_args()
    setup = bl.start("bench_profile", args)
    child = setup.work / "profiled_cli.py"
    child.write_text(CHILD)
    ncpu = setup.machine["nproc"]
    out = setup.work / "out"
    tables = []
    for name in setup.shapes:
        shape = setup.shape(name, manifest=True)
        print(f"\n{shape.name}", flush=True)
        cs = contenders(shape, out, ncpu, args.jobs_one)
        res = bl.summarize_all(bl.interleave(cs, args.runs, setup.cache))
        rows = []
        for label, s in res.items():
            peer = peer_of(label, ncpu)
            rows.append(bl.row(s, res[peer] if peer else None, shape=shape.name))
        notes = ""
        if not args.no_profile:
            notes = "\n\n".join("\n".join(profile(setup, c, child, res[c.label].nbytes)) for c in cs
                                if isinstance(c.cmd, list) and c.cmd[:3] == bl.K3)
        tables.append(bl.Table(shape.describe(), bl.COLUMNS, rows, notes))
    bl.write_report(setup, tables)


if __name__ == "__main__":
    main()
