#!/usr/bin/env python3
"""Benchmark: peak RSS and runtime of `k3ckpt mx dequant` on one MoE layer at the real K3 shapes.

Synthesizes a `k3-full`-shaped checkpoint (real hidden size, expert shapes w1/w3 [3072, 3584],
w2 [3584, 3072]) with --headers-only, so the packed input costs no disk: its data are sparse
holes that read as zeros, which exercises the same reads, decoding and writes as real weights.
Then, for each expert count, dequantizes the whole of layer 1 in a fresh process and records
that process's own peak RSS (VmHWM from /proc/self/status), wall time and output size. A flat
peak RSS across sizes is the claim: memory is bounded by the row chunk, not by the layer.

A full K3 layer (896 experts) is 15.7 GB packed and 118 GB as fp32 (59 GB as bf16), more than
most scratch disks hold; the default sizes stay under ~10 GB of output.

Usage: .venv/bin/python scripts/bench_mx_memory.py [--work DIR] [--experts 16 64] [--to fp32]
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import benchlib as bl

MEASURE = textwrap.dedent("""
    import json, sys, time
    def hwm_kb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    from k3ckpt.cli import main
    t = time.perf_counter()
    main(sys.argv[1:], standalone_mode=False)
    print(json.dumps({"peak_kb": hwm_kb(), "seconds": time.perf_counter() - t}), file=sys.stderr)
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, help="Scratch directory [default: a temporary one, removed after].")
    ap.add_argument("--experts", type=int, nargs="+", default=[16, 64], help="Routed experts in the layer.")
    ap.add_argument("--to", default="fp32", choices=["bf16", "fp16", "fp32"])
    args = ap.parse_args()

    from k3ckpt.mx.select import MxSource, find_mx_tensors
    from k3ckpt.testing.synth import spec_from_preset, synthesize

    routed = spec_from_preset("k3-full").experts_per_token  # a layer must hold at least the experts a token routes to
    if min(args.experts) < routed:
        ap.error(f"--experts: {min(args.experts)} is fewer than the {routed} experts K3 routes each token to")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-mx-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for n in args.experts:
            root = work / f"k3-layer-{n}"
            if root.exists():
                shutil.rmtree(root)
            synthesize(spec_from_preset("k3-full", num_layers=2, num_experts=n, vision_layers=0), root)
            packed = sum(m.packed_bytes * 17 // 16 for m in find_mx_tensors(MxSource.open(root), layer=1))
            out = work / "layer1.safetensors"
            p = subprocess.run([sys.executable, "-c", MEASURE, "mx", "dequant", str(root), "--layer", "1",
                                "--to", args.to, "-o", str(out), "--json"],
                               check=False, capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"dequant failed ({p.returncode}):\n{p.stderr}")
            m = json.loads(p.stderr.strip().splitlines()[-1])
            size = out.stat().st_size
            out.unlink()
            shutil.rmtree(root)
            rows.append((n, packed, size, m["peak_kb"] * 1024, m["seconds"]))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    print(bl.machine_line(bl.machine(bl.ROOT)) + "\n")
    print(f"`k3ckpt mx dequant DIR --layer 1 --to {args.to}` on a K3-shaped layer "
          f"({os.cpu_count()} CPUs, default chunk {os.environ.get('K3CKPT_MX_CHUNK_BYTES', str(8 * 2**20))} B packed):\n")
    print("| experts | packed (data + scales) | output | peak RSS | wall time | output rate |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, packed, size, peak, secs in rows:
        print(f"| {n} | {packed / 1e9:.2f} GB | {size / 1e9:.2f} GB | {peak / 2**20:.0f} MiB | {secs:.1f} s "
              f"| {size / secs / 1e9:.2f} GB/s |")


if __name__ == "__main__":
    main()
