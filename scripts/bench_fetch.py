#!/usr/bin/env python3
"""Benchmark: `k3ckpt fetch` against the hub clients and the machine's no-verification limit.

Serves a multi-GB synthetic K3-shaped checkpoint on the loopback hub emulator (127.0.0.1) and
downloads it, in one run on the same files, each contender a fresh process into a fresh
directory (deleted between runs), median of N:
  - `k3ckpt fetch --source hf` (parallel ranged chunks, sha256 of every file verified);
  - `huggingface_hub.snapshot_download(local_dir=...)` (the real client; verifies nothing);
  - `modelscope.snapshot_download(local_dir=...)` (the real client; checks sha256 itself);
  - the limit: `xargs -P <workers> curl -s -o` of the same files (no verification), and the
    durable limit: the same followed by `sync` (k3ckpt fsyncs every file before its rename,
    so its files are on disk when it exits; curl's are still dirty page cache).
Every run starts after a `sync`, so no run pays for an earlier one's writeback.

Usage: .venv/bin/python scripts/bench_fetch.py [--work work/bench] [--runs 3] [--workers 8]
Prints Markdown to paste into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = "bench/k3"

HF = """
import sys
from huggingface_hub import snapshot_download
snapshot_download(sys.argv[1], local_dir=sys.argv[2], max_workers=int(sys.argv[3]))
"""

MS = """
import sys
from modelscope import snapshot_download
snapshot_download(sys.argv[1], local_dir=sys.argv[2], max_workers=int(sys.argv[3]))
"""


def timed(make_cmd, dest: Path, runs: int, env: dict[str, str]) -> list[float]:
    out = []
    for _ in range(runs):
        shutil.rmtree(dest, ignore_errors=True)
        os.sync()  # start clean: no earlier run's dirty pages flushed on this run's time
        cmd = make_cmd(dest)
        t = time.perf_counter()
        p = subprocess.run(cmd, shell=isinstance(cmd, str), env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        out.append(time.perf_counter() - t)
        if p.returncode != 0:
            raise SystemExit(f"benchmark command failed ({p.returncode}): {cmd}\n{p.stderr[-2000:]}")
    shutil.rmtree(dest, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="work/bench")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    src = work / "verify-k3-density"  # shared with bench_verify.py
    if not (src / "model.safetensors.index.json").is_file():
        subprocess.run([py, "-m", "k3ckpt", "synth", str(src), "--force", "--preset", "k3-small", "--layers", "10",
                        "--experts", "48", "--moe-intermediate", "2048", "--expert-hidden", "2048"], check=True)
    files = sorted(p.name for p in src.iterdir() if p.is_file())
    total = sum((src / f).stat().st_size for f in files)
    subprocess.run(["cat", *(str(src / f) for f in files)], stdout=subprocess.DEVNULL, check=True)  # warm

    from k3ckpt.testing.hub import LoopbackHub

    dest = work / "fetch-dest"
    w = str(args.workers)
    with LoopbackHub({REPO: src}, cache_dir=work / "hub-cache") as hub:
        hub.files(REPO)  # hash once for the listing before timing
        env = dict(hub.client_env(), HF_HUB_DISABLE_PROGRESS_BARS="1", K3CKPT_CACHE_DIR=str(work / "cache"),
                   MODELSCOPE_CACHE=str(work / "ms-cache"), HF_HOME=str(work / "hf-home"))
        urls = " ".join(hub.resolve_url(REPO, f, hub.commit(REPO)) for f in files)
        rows = [
            ("k3ckpt fetch (verifies every sha256)",
             timed(lambda d: [py, "-m", "k3ckpt", "fetch", "--source", "hf", "--repo", REPO, "--dest", str(d),
                              "--workers", w], dest, args.runs, env)),
            ("huggingface_hub snapshot_download (no verification)",
             timed(lambda d: [py, "-c", HF, REPO, str(d), w], dest, args.runs, env)),
            ("modelscope snapshot_download",
             timed(lambda d: [py, "-c", MS, REPO, str(d), w], dest, args.runs, env)),
            (f"limit: xargs -P{w} curl -o (no verification)",
             timed(lambda d: f"mkdir -p '{d}' && cd '{d}' && printf '%s\\n' {urls} | "
                             f"xargs -P{w} -n1 curl -s -f -O", dest, args.runs, env)),
            # k3ckpt's files are on disk when it exits (fsync before each rename); curl's are
            # still dirty page cache. The durable limit adds the flush.
            (f"durable limit: xargs -P{w} curl -o, then sync",
             timed(lambda d: f"mkdir -p '{d}' && cd '{d}' && printf '%s\\n' {urls} | "
                             f"xargs -P{w} -n1 curl -s -f -O && sync", dest, args.runs, env)),
        ]

    print(f"machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
          f"{platform.system()}; date {time.strftime('%Y-%m-%d')}; runs {args.runs}; workers {w}")
    print(f"data: {len(files)} files, {total / 1e9:.2f} GB served from the page cache by the loopback hub\n")
    print("| contender | median (s) | MB/s | vs huggingface_hub | vs ModelScope | vs curl limit | vs durable limit |")
    print("|---|---|---|---|---|---|---|")
    rate = {name: total / statistics.median(ts) for name, ts in rows}
    hf, ms, limit, durable = (rate[rows[i][0]] for i in (1, 2, 3, 4))
    for name, ts in rows:
        r = rate[name]
        print(f"| {name} | {statistics.median(ts):.2f} | {r / 1e6:.0f} | {r / hf:.2f}x | {r / ms:.2f}x "
              f"| {r / limit:.2f}x | {r / durable:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
