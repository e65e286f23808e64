#!/usr/bin/env python3
"""Benchmark: `k3ckpt fetch` against the hub clients and the machine's no-verification limit.

    .venv/bin/python scripts/bench_fetch.py [--work work/bench_fetch] [--runs 3] [--workers 8] [--shapes k3-8shard,k3-small]

Serves the shapes (default: issue #16's ``k3-8shard`` and ``k3-small``; ``k3-density``, the
3.33 GB set of the earlier measurements, on request) from the page cache with the loopback hub
emulator (``k3ckpt.testing.hub``, in its own process, 127.0.0.1) and downloads each, in
interleaved rounds (the shared method of scripts/benchlib.py; warm source, ``sync`` before every
run), each contender a fresh process into a fresh directory:
  - `k3ckpt fetch REPO --local-dir D` (parallel ranged chunks, sha256 of every file verified,
    fsync before each rename), followed by ``sync`` (a no-op for its files);
  - `huggingface_hub.snapshot_download(local_dir=...)` (the real client; verifies nothing);
  - `modelscope.snapshot_download(local_dir=...)` (the real client; checks sha256 itself);
  - the limit: `xargs -P <workers> curl -s -O` of the same files (no verification), and the
    durable limit: the same followed by `sync` (curl's files are still dirty page cache when it
    exits; k3ckpt's are on disk).
The hub's own CPU-s per run is reported beside each contender.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import benchlib as bl

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

K3CKPT, HFHUB, MSCOPE, CURL, DURABLE = ("k3ckpt fetch (verifies every sha256, fsync)",
                                        "huggingface_hub snapshot_download (no verification)",
                                        "modelscope snapshot_download", "limit: xargs -P{w} curl -O (no verification)",
                                        "durable limit: xargs -P{w} curl -O, then sync")


def contenders(setup: bl.Setup, hub: bl.Hub, shape: bl.Shape, workers: int) -> list[bl.Contender]:
    repo = f"bench/{shape.name}"
    dest = setup.work / "fetch-dest"
    w = str(workers)
    env = hub.env(K3CKPT_CACHE_DIR=str(setup.work / "cache"), MODELSCOPE_CACHE=str(setup.work / "ms-cache"),
                  HF_HOME=str(setup.work / "hf-home"))
    urls = [hub.resolve_url(repo, f.name) for f in shape.files]
    common: dict[str, Any] = {"out": dest, "inputs": shape.files, "env": env}
    return [
        bl.Contender(K3CKPT, [*bl.K3, "fetch", repo, "--local-dir", str(dest), "--max-workers", w], sync=True, **common),
        bl.Contender(HFHUB, [sys.executable, "-c", HF, repo, str(dest), w], **common),
        bl.Contender(MSCOPE, [sys.executable, "-c", MS, repo, str(dest), w], **common),
        bl.Contender(CURL.format(w=w), bl.curl_cmd(urls, dest, workers), **common),
        bl.Contender(DURABLE.format(w=w), bl.curl_cmd(urls, dest, workers), sync=True, **common),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_fetch")
    ap.add_argument("--workers", type=int, default=8, help="concurrent requests of every contender [default: 8]")
    args = ap.parse_args()
    setup = bl.start("bench_fetch", args)
    shapes = {name: setup.shape(name) for name in setup.shapes}
    tables = []
    with bl.Hub({f"bench/{n}": s.path for n, s in shapes.items()}, setup.work) as hub:
        for shape in shapes.values():
            print(f"\n{shape.name}", flush=True)
            cs = contenders(setup, hub, shape, args.workers)
            res = bl.summarize_all(bl.interleave(cs, args.runs, setup.cache, server=hub))
            peers = {key: res[c.label] for key, c in zip(("k3", "hf", "ms", "curl", "durable"), cs)}
            rows = []
            for c, s in zip(cs, res.values()):
                r = bl.row(s, peers["durable"], shape=shape.name, sync="yes" if c.sync else "no")
                for key in ("hf", "ms", "curl"):
                    r[f"vs_{key}"] = round(s.gb_per_s / peers[key].gb_per_s, 3) if peers[key].gb_per_s else None
                rows.append(r)
            columns = [bl.COLUMNS[0], ("sync", "sync", "{}"), *bl.COLUMNS[1:6], ("vs hf", "vs_hf", "{:.2f}x"),
                       ("vs ModelScope", "vs_ms", "{:.2f}x"), ("vs curl", "vs_curl", "{:.2f}x"),
                       ("vs durable (wall)", "vs_wall", "{:.2f}x"), ("vs durable (CPU)", "vs_cpu", "{:.2f}x"),
                       ("hub CPU-s", "server_cpu_s", "{:.2f}"), ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}")]
            tables.append(bl.Table(shape.describe() + f"; served from the page cache; {args.workers} concurrent requests",
                                   columns, rows))
    bl.write_report(setup, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
