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

Usage: .venv/bin/python scripts/bench_inspect.py [--work work/bench_inspect] [--runs 5]
The shared method of scripts/benchlib.py (interleaved rounds, medians, machine line, report).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import benchlib as bl

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_inspect", runs=5)
    args = ap.parse_args()
    setup = bl.start("bench_inspect", args)
    full = bl.k3_full(setup.work)
    py = sys.executable
    # Warm the page cache once with a first inspect (the headers only: the shards are sparse,
    # 1.56 TB apparent, so the shared cache control - which reads inputs - is given none), as on
    # a node that has just downloaded the checkpoint.
    subprocess.run([*bl.K3, "inspect", str(full)], check=True, stdout=subprocess.DEVNULL)
    cs = [
        bl.Contender("k3ckpt inspect --json", [*bl.K3, "inspect", str(full), "--json"]),
        bl.Contender("safetensors safe_open + get_slice (peer)", [py, "-c", PEER_SAFETENSORS, str(full)]),
        bl.Contender("json.load of the index only (floor)", [py, "-c", PEER_INDEX, str(full)]),
    ]
    res = bl.summarize_all(bl.interleave(cs, args.runs, setup.cache))
    base = res[cs[0].label]
    rows = [{"label": s.label, "best_s": min(s.walls), "wall_s": s.wall_s, "cpu_s": s.cpu_s,
             "vs_k3ckpt": s.wall_s / base.wall_s, "peak_rss_mib": s.peak_rss / 2**20} for s in res.values()]
    table = bl.Table("`k3-full --headers-only`: 96 shards, ~497k tensors, 1.56 TB apparent",
                     [("command", "label", "{}"), ("best (s)", "best_s", "{:.2f}"), ("median (s)", "wall_s", "{:.2f}"),
                      ("CPU-s", "cpu_s", "{:.2f}"), ("vs k3ckpt", "vs_k3ckpt", "{:.2f}x"),
                      ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}")], rows)
    bl.write_report(setup, [table])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
