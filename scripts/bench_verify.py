#!/usr/bin/env python3
"""Benchmark: `k3ckpt verify` hashing throughput against its peers, on the same files.

    .venv/bin/python scripts/bench_verify.py [--work work/bench_verify] [--runs 3] [--shapes k3-8shard,k3-small]

Per shape (default: issue #16's ``k3-8shard`` and ``k3-small``; ``k3-density``, ~1.15 MB per
tensor, and ``dense``, 83 KB per tensor, the earlier data sets, on request), builds the
checkpoint and its manifest once, then times in interleaved rounds (the shared method of
scripts/benchlib.py; warm page cache by default):
  - `k3ckpt verify DIR --manifest M --no-cache` (structure + every file's sha256 + scale scan);
  - the limit: `xargs -P$(nproc) -n1 openssl dgst -sha256` over the files (OpenSSL SHA-256, all
    cores, no structure checks);
  - `sha256sum` over the files, sequential (coreutils; slower per core than OpenSSL);
  - `hf cache verify REPO --local-dir DIR` against the loopback hub serving the same files (the
    real huggingface_hub CLI; sha256 per file in one thread);
and (unless ``--skip-quick``) a `--quick` re-verify of an unchanged `k3-full --headers-only`
checkpoint (the stat cache warm from a first quick run).

Bytes per tensor set how much the fixed per-tensor work (parsing headers and the manifest,
structure checks) weighs against hashing: real K3 has 3.1 MB per tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import benchlib as bl


def contenders(setup: bl.Setup, shape: bl.Shape, hub: bl.Hub | None) -> list[bl.Contender]:
    files = [str(f) for f in shape.files]
    listing = " ".join(f"'{f}'" for f in files)
    nproc = setup.machine["nproc"]
    common: dict[str, Any] = {"nbytes": shape.nbytes, "inputs": shape.files}
    out = [
        bl.Contender("k3ckpt verify --manifest M --no-cache",
                     [*bl.K3, "verify", str(shape.path), "--manifest", str(shape.manifest), "--no-cache"],
                     env=bl.child_env(K3CKPT_CACHE_DIR=str(setup.work / "cache")), **common),
        bl.Contender(f"limit: xargs -P{nproc} -n1 openssl dgst -sha256",
                     f"printf '%s\\n' {listing} | xargs -P{nproc} -n1 openssl dgst -sha256", **common),
        bl.Contender("sha256sum (sequential)", ["sha256sum", *files], **common),
    ]
    hf = shutil.which("hf", path=str(Path(sys.executable).parent)) or shutil.which("hf")
    if hub is not None and hf:
        out.append(bl.Contender("hf cache verify --local-dir (loopback hub)",
                                [hf, "cache", "verify", f"bench/{shape.name}", "--local-dir", str(shape.path)],
                                env=hub.env(), **common))
    return out


def quick_reverify(setup: bl.Setup) -> bl.Table:
    full = bl.k3_full(setup.work)
    env = bl.child_env(K3CKPT_CACHE_DIR=str(setup.work / "quick-cache"))
    shutil.rmtree(setup.work / "quick-cache", ignore_errors=True)
    cmd = [*bl.K3, "verify", str(full), "--quick"]
    first = bl.run_timed(cmd, env=env)
    again = [bl.run_timed(cmd, env=env) for _ in range(setup.args.runs)]
    table = bl.Table("`k3ckpt verify --quick` on `k3-full --headers-only` (96 shards, 1.56 TB apparent)",
                     [("run", "label", "{}"), ("wall (s)", "wall_s", "{:.2f}"), ("CPU-s", "cpu_s", "{:.2f}")])
    table.rows = [{"label": "first (fills the stat cache)", "wall_s": first.wall_s, "cpu_s": first.cpu_s},
                  {"label": f"unchanged re-verify (median of {len(again)})",
                   "wall_s": statistics.median(t.wall_s for t in again), "cpu_s": statistics.median(t.cpu_s for t in again)}]
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_verify")
    ap.add_argument("--skip-quick", action="store_true", help="skip the --quick re-verify of k3-full --headers-only")
    ap.add_argument("--skip-hf", action="store_true", help="skip `hf cache verify` (and the loopback hub)")
    args = ap.parse_args()
    setup = bl.start("bench_verify", args)
    shapes = {name: setup.shape(name, manifest=True) for name in setup.shapes}
    tables = []
    hub = None if args.skip_hf else bl.Hub({f"bench/{n}": s.path for n, s in shapes.items()}, setup.work)
    with hub or contextlib.nullcontext():
        for shape in shapes.values():
            print(f"\n{shape.name}", flush=True)
            cs = contenders(setup, shape, hub)
            res = bl.summarize_all(bl.interleave(cs, args.runs, setup.cache, server=hub))
            limit = res[cs[1].label]
            tensors = len(json.loads(shape.manifest.read_text())["tensors"]) if shape.manifest else 0
            per = f", {tensors:,} tensors ({shape.nbytes / tensors / 1e6:.2f} MB per tensor)" if tensors else ""
            tables.append(bl.Table(shape.describe() + per, bl.COLUMNS,
                                   [bl.row(s, limit, shape=shape.name) for s in res.values()]))
    if not args.skip_quick:
        tables.append(quick_reverify(setup))
    bl.write_report(setup, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
