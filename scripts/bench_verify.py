#!/usr/bin/env python3
"""Benchmark: `k3ckpt verify` hashing throughput against its peers, on the same warm files.

Synthesizes two multi-GB K3-shaped checkpoints once and, for each, builds its manifest, warms
the page cache, then times in one run, each as a fresh process:
  - `k3ckpt verify DIR --manifest M --no-cache` (full: structure + every file's sha256 + scale scan);
  - the physical limit: `ls FILES | xargs -P$(nproc) -n1 openssl dgst -sha256` (OpenSSL SHA-256,
    all cores, no structure checks);
  - `sha256sum` over the files, sequential (coreutils; slower per core than OpenSSL);
  - `hf cache verify REPO --local-dir DIR` against the loopback hub serving the same files (the
    real huggingface_hub CLI; sha256 per file in one thread);
and a `--quick` re-verify of an unchanged `k3-full --headers-only` checkpoint (the stat cache
warm from a previous quick run).

The two data sets differ in bytes per tensor, which sets how much the fixed per-tensor work
(parsing headers and the manifest, structure checks) weighs against hashing:
  - "k3-density": ~1 MB per tensor (real K3: 1.56 TB / 497k tensors = 3.1 MB per tensor);
  - "dense": k3-small widened to 24 layers, ~83 KB per tensor (a worst case).

Usage: .venv/bin/python scripts/bench_verify.py [--work work/bench] [--runs 3]
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
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str] | str, runs: int, env: dict[str, str] | None = None, ok_codes: tuple[int, ...] = (0,)) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.run(cmd, shell=isinstance(cmd, str), env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
        if p.returncode not in ok_codes:
            raise SystemExit(f"benchmark command failed ({p.returncode}): {cmd}\n{p.stderr}")
        out.append(time.perf_counter() - t)
    return out


def bench_one(k3: list[str], py: str, work: Path, ckpt: Path, runs: int) -> tuple[int, int, int, list]:
    """Time k3ckpt and its peers on the warm files of ``ckpt``."""
    manifest = ckpt.with_suffix(".manifest.json")
    subprocess.run(k3 + ["manifest", "build", str(ckpt), "-o", str(manifest)], check=True)
    files = sorted(str(p) for p in ckpt.iterdir() if p.is_file())
    total = sum(os.path.getsize(f) for f in files)
    tensors = sum(1 for line in manifest.read_text().splitlines() if '"offsets"' in line)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    env = dict(os.environ, K3CKPT_CACHE_DIR=str(work / "cache"))
    listing = " ".join(f"'{f}'" for f in files)
    rows = [
        ("k3ckpt verify --manifest (full, --no-cache)",
         timed(k3 + ["verify", str(ckpt), "--manifest", str(manifest), "--no-cache"], runs, env)),
        (f"limit: xargs -P{os.cpu_count()} openssl dgst -sha256",
         timed(f"printf '%s\\n' {listing} | xargs -P{os.cpu_count()} -n1 openssl dgst -sha256", runs)),
        ("sha256sum (sequential)", timed(["sha256sum", *files], runs)),
    ]
    # The real huggingface_hub CLI against the loopback hub serving the same directory.
    from k3ckpt.testing.hub import LoopbackHub

    hf = shutil.which("hf", path=str(Path(py).parent)) or shutil.which("hf")
    if hf:
        with LoopbackHub({"bench/ckpt": ckpt}, cache_dir=work / "hub-cache") as hub:
            hub.files("bench/ckpt")  # hash once for the listing before timing
            rows.append(("hf cache verify --local-dir (loopback hub)",
                         timed([hf, "cache", "verify", "bench/ckpt", "--local-dir", str(ckpt)], runs,
                               hub.client_env())))
    return len(files), tensors, total, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="work/bench")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    k3 = [py, "-m", "k3ckpt"]
    datasets = {
        "k3-density": ["--preset", "k3-small", "--layers", "10", "--experts", "48",
                       "--moe-intermediate", "2048", "--expert-hidden", "2048"],
        "dense": ["--preset", "k3-small", "--layers", "24"],
    }
    tables = []
    for label, synth_args in datasets.items():
        ckpt = work / f"verify-{label}"
        if not (ckpt / "model.safetensors.index.json").is_file():
            subprocess.run(k3 + ["synth", str(ckpt), "--force", *synth_args], check=True)
        tables.append((label, synth_args, bench_one(k3, py, work, ckpt, args.runs)))

    print(f"machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
          f"{platform.system()}; date {time.strftime('%Y-%m-%d')}; runs {args.runs}")
    for label, synth_args, (files, tensors, total, rows) in tables:
        print(f"\n{label}: `k3ckpt synth {' '.join(synth_args)}` - {files} files, {tensors:,} tensors, "
              f"{total / 1e9:.2f} GB ({total / tensors / 1e6:.2f} MB per tensor), warm page cache\n")
        print("| command | median (s) | GB/s | vs limit |")
        print("|---|---|---|---|")
        limit = total / statistics.median(rows[1][1])
        for name, ts in rows:
            rate = total / statistics.median(ts)
            print(f"| {name} | {statistics.median(ts):.2f} | {rate / 1e9:.2f} | {rate / limit:.2f}x |")

    full = work / "k3-full"
    if not (full / "model.safetensors.index.json").is_file():
        subprocess.run(k3 + ["synth", str(full), "--preset", "k3-full", "--headers-only", "--force"], check=True)
    qenv = dict(os.environ, K3CKPT_CACHE_DIR=tempfile.mkdtemp(prefix="k3ckpt-bench-cache-"))
    first = timed(k3 + ["verify", str(full), "--quick"], 1, qenv)
    quick = timed(k3 + ["verify", str(full), "--quick"], args.runs, qenv)

    print(f"\n`k3ckpt verify --quick` on k3-full --headers-only (96 shards, 1.56 TB apparent): "
          f"first run {first[0]:.2f} s, unchanged re-verify median {statistics.median(quick):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
