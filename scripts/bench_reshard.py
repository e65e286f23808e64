#!/usr/bin/env python
"""Benchmark ``k3ckpt reshard`` against ``cp -r`` and a plain safetensors script, same disk.

    .venv/bin/python scripts/bench_reshard.py [--work work/bench-reshard] [--ep 8 --tp 2] [--format rank]
    .venv/bin/python scripts/bench_reshard.py --format node --ep 8 --tp 2 --gpus-per-node 4

Makes ``k3-small`` (``k3ckpt synth --preset k3-small``, about 1.1 GB) when missing, then times
each contender in a subprocess, every one followed by ``sync`` (reshard fsyncs its files, so
the others must reach the disk too), dropping the page cache before each run when it can
(root: ``echo 3 > /proc/sys/vm/drop_caches``; otherwise every run is warm and the table says
so). Reports output bytes per second and the child's peak RSS (``wait4``), and prints a
markdown section for BENCHMARKS.md.

Contenders:
- ``cp -r SRC DST``: the floor for moving the checkpoint's bytes once;
- ``k3ckpt reshard SRC -o OUT --format rank --ep E --tp T`` (every rank) and the same limited to
  ranks whose output volume is about the source's (so that both write the same number of bytes);
  with ``--format node --gpus-per-node G``, the node directories of every node and of node 0;
- ``naive``: what a user would write with the ``safetensors`` library: for each rank, load each
  tensor it holds (``safe_open(framework="pt")`` - torch, because the numpy framework cannot
  hold BF16), slice it with the same TP rules, keep the rank's tensors in a dict and
  ``save_file`` them. No hashes, no manifest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

NAIVE = r'''
import sys, os
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.deploy.reshard import plan_reshard
from k3ckpt.format.topology import ExpertSlice, RankSelection

src, out, ep, tp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
plan = plan_reshard(src, RankSelection(ep=ep, tp=tp), layout="rank")  # which tensors and slices each rank holds
ckpt = plan.ckpt
for rp in plan.ranks:
    tensors = {}
    for f in rp.files:
        for t in f.tensors:
            with safe_open(str(ckpt.path_of(t.src_file)), framework="pt") as fh:
                x = fh.get_tensor(t.name)
            s = t.split
            if s is not None and "experts" not in s:
                n = x.shape[s["dim"]] // s["parts"]
                x = x.narrow(s["dim"], s["index"] * n, n)
            tensors[t.name] = x.contiguous()
    d = out / f"rank-{rp.rank:05d}"
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / f"model-rank-{rp.rank}.safetensors"), metadata={"format": "pt"})
    del tensors
'''


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(cmd: list[str], cold: bool) -> tuple[float, int]:
    """Run ``cmd`` then ``sync``; (seconds, peak RSS bytes of the child)."""
    if cold:
        drop_caches()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    subprocess.run(["sync"], check=True)
    dt = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{cmd[:3]}... failed with exit {p.returncode}")
    return dt, ru.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "bench-reshard")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--format", choices=("rank", "node"), default="rank",
                    help="the rank layout (the figures in BENCHMARKS.md before 2026-12-01) or node directories")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="with --format node: GPUs per node")
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--runs", type=int, default=3,
                    help="rounds of cp / reshard / reshard-part, interleaved; medians reported (naive: once)")
    args = ap.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    src = work / "k3-small"
    k3 = [PY, "-m", "k3ckpt"]
    if not (src / "model.safetensors.index.json").exists():
        subprocess.run([*k3, "synth", str(src), "--preset", "k3-small", "--force"], check=True, cwd=ROOT)
    src_bytes = du(src)
    cold = drop_caches()

    from k3ckpt.deploy.reshard import plan_reshard
    from k3ckpt.format.topology import RankSelection

    selection = RankSelection(ep=args.ep, tp=args.tp, gpus_per_node=args.gpus_per_node)
    plan = plan_reshard(src, selection, layout=args.format)
    sizes = [unit.nbytes for unit in plan.units]
    # the first ranks whose output is about the source's size: the same write volume as cp
    acc, k = 0, 0
    while k < len(sizes) and acc + sizes[k] <= src_bytes * 1.02:
        acc += sizes[k]
        k += 1
    k = max(k, 1)

    jobs = ["--jobs", str(args.jobs)] if args.jobs else []
    shape = ["--format", args.format, "--ep", str(args.ep), "--tp", str(args.tp)]
    if args.gpus_per_node:
        shape += ["--gpus-per-node", str(args.gpus_per_node)]
    unit = "ranks" if args.format == "rank" else "nodes"
    # A part of the job as big as the source: the first ranks, or node 0 of a node split.
    part = ["--ranks", f"0-{k - 1}"] if args.format == "rank" else ["--node", "0"]
    part_label = f"ranks 0-{k - 1}" if args.format == "rank" else "node 0"
    results: dict[str, list[tuple[str, int, float, int]]] = {}

    def run(label: str, cmd: list[str], out: Path) -> None:
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        dt, rss = timed(cmd, cold)
        nbytes = du(out)
        shown = " ".join(str(c) for c in cmd).replace(PY + " -m k3ckpt", "k3ckpt").replace(str(work) + "/", "")
        results.setdefault(label, []).append((shown, nbytes, dt, rss))
        print(f"{label:28s} {nbytes / 1e9:6.2f} GB {dt:6.2f} s {nbytes / dt / 1e9:6.2f} GB/s  peak RSS {rss / 2**20:6.0f} MiB",
              flush=True)
        shutil.rmtree(out, ignore_errors=True)

    for _ in range(args.runs):  # interleaved, so that a slow spell of the disk hits every contender
        run("cp -r", ["cp", "-r", str(src), str(work / "cp")], work / "cp")
        run(f"k3ckpt reshard (all {len(sizes)} {unit})",
            [*k3, "reshard", str(src), "-o", str(work / "rs"), *shape, *jobs], work / "rs")
        if len(sizes) > 1:
            run(f"k3ckpt reshard ({part_label})",
                [*k3, "reshard", str(src), "-o", str(work / "rs"), *shape, *part, *jobs], work / "rs")
    if not args.skip_naive and args.format == "rank":
        script = work / "naive_reshard.py"
        script.write_text(NAIVE)
        run("naive safetensors script", [PY, str(script), str(src), str(work / "nv"), str(args.ep), str(args.tp)],
            work / "nv")
    rows = [(label, rs[0][0], rs[0][1], statistics.median(r[2] for r in rs), max(r[3] for r in rs))
            for label, rs in results.items()]

    cp_rate = rows[0][2] / rows[0][3]
    print()
    print(f"cache: {'dropped before each run (cold)' if cold else 'warm (could not drop the page cache)'}; "
          f"source {src_bytes / 1e9:.2f} GB; every run followed by sync; median of {args.runs} interleaved rounds")
    print()
    print("| run | command | output bytes | seconds | output GB/s | vs cp | peak RSS |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, cmd, nbytes, dt, rss in rows:
        rate = nbytes / dt
        print(f"| {label} | `{cmd}` | {nbytes:,} | {dt:.2f} | {rate / 1e9:.2f} | {rate / cp_rate:.2f}x | {rss / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
