#!/usr/bin/env python3
"""Benchmark: `k3ckpt inspect` on the full-size K3 inventory (headers only), against peers.

Synthesizes `k3-full --headers-only` (96 sparse shards, ~497k tensors, 1.56 TB apparent) once,
then times, each as a fresh process, best and median of N runs:
  - `k3ckpt inspect DIR --json` (config + index + every header, roles, parameter counts);
  - peer: a straightforward `safetensors` script a user would write - `safe_open` each shard
    listed in the index and read every tensor's dtype/shape via `get_slice` (the library's
    public metadata API) - which lists tensors but computes nothing;
  - peer: `json.load` of `model.safetensors.index.json` alone (the floor for anything that
    looks at the index).

Usage: .venv/bin/python scripts/bench_inspect.py [--work work/bench] [--runs 5]
Prints a Markdown table row block to paste into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PEER_SAFETENSORS = r"""
import json, sys
from safetensors import safe_open
root = sys.argv[1]
wm = json.load(open(f"{root}/model.safetensors.index.json"))["weight_map"]
n = 0
for f in sorted(set(wm.values())):
    with safe_open(f"{root}/{f}", framework="numpy") as sf:
        for k in sf.keys():
            s = sf.get_slice(k)
            s.get_dtype(); s.get_shape()
            n += 1
print(n)
"""

PEER_INDEX = r"""
import json, sys
print(len(json.load(open(sys.argv[1] + "/model.safetensors.index.json"))["weight_map"]))
"""


def timed(cmd: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="work/bench")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    full = Path(args.work) / "k3-full"
    py = sys.executable
    k3 = [py, "-m", "k3ckpt"]
    if not (full / "model.safetensors.index.json").is_file():
        subprocess.run(k3 + ["synth", str(full), "--preset", "k3-full", "--headers-only", "--force"], check=True)
    # Warm the page cache once so every contender reads headers from memory, as on a node
    # that has just downloaded the checkpoint.
    subprocess.run(k3 + ["inspect", str(full)], check=True, stdout=subprocess.DEVNULL)

    rows = [
        ("k3ckpt inspect --json", timed(k3 + ["inspect", str(full), "--json"], args.runs)),
        ("safetensors safe_open + get_slice (peer)", timed([py, "-c", PEER_SAFETENSORS, str(full)], args.runs)),
        ("json.load of the index only (floor)", timed([py, "-c", PEER_INDEX, str(full)], args.runs)),
    ]
    cpu = platform.processor() or platform.machine()
    print(f"machine: {os.cpu_count()} cores, {cpu}, Python {platform.python_version()}, {platform.system()}")
    print(f"date: {time.strftime('%Y-%m-%d')}, runs: {args.runs}\n")
    print("| command | best (s) | median (s) | vs k3ckpt |")
    print("|---|---|---|---|")
    base = statistics.median(rows[0][1])
    for name, ts in rows:
        med = statistics.median(ts)
        print(f"| {name} | {min(ts):.2f} | {med:.2f} | {med / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
