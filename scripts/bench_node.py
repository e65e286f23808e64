#!/usr/bin/env python
"""Node directories against ``cp -r``: ``k3ckpt reshard --node`` and ``k3ckpt fetch --node`` (from
the loopback hub) writing one node's directory, bytes written per second, sync included.

    .venv/bin/python scripts/bench_node.py [--work work/bench-node] [--runs 3]

Makes ``k3-small`` (about 1.1 GB) when missing and serves it with ``k3ckpt.testing.hub``; each
round, interleaved: ``cp -r`` of the checkpoint, ``fetch --node 0`` and ``reshard --node 0`` for
vLLM TP2 x DP4 on two 4-GPU nodes (node 0 holds half the experts), each into a fresh directory,
each followed by ``sync``, the page cache dropped before each run when it can be (root). Prints
medians and a markdown table for BENCHMARKS.md.
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
K3 = [sys.executable, "-m", "k3ckpt"]
TOPOLOGY = ["--tp", "2", "--dp", "4", "--gpus-per-node", "4", "--node", "0"]


def drop_caches() -> bool:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``, a fetch's hidden ``.cache`` records left out."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and ".cache" not in p.relative_to(path).parts)


def timed(cmd: list[str], out: Path, env: dict[str, str]) -> tuple[int, float]:
    shutil.rmtree(out, ignore_errors=True)
    drop_caches()
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["sync"], check=True)
    dt = time.perf_counter() - t0
    nbytes = tree_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    return nbytes, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "bench-node")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    src = work / "k3-small"
    if not (src / "model.safetensors.index.json").exists():
        subprocess.run([*K3, "synth", str(src), "--preset", "k3-small", "--force"], check=True, cwd=ROOT)
    env = {**os.environ, "HF_HUB_DISABLE_XET": "1", "K3CKPT_CACHE_DIR": str(work / "cache"), "HF_HOME": str(work / "hf")}
    log = work / "hub.log"
    with open(log, "w") as fh:
        hub = subprocess.Popen([sys.executable, "-m", "k3ckpt.testing.hub", str(src), "--repo", "moonshotai/Kimi-K3",
                                "--port", "0", "--cache-dir", str(work / "hub-cache")], stdout=fh, stderr=subprocess.STDOUT,
                               cwd=ROOT, env=env)
    try:
        for _ in range(300):
            if "Serving on" in log.read_text():
                break
            time.sleep(0.1)
        env["HF_ENDPOINT"] = log.read_text().split("Serving on ", 1)[1].split()[0]
        contenders = {
            "cp -r": ["cp", "-r", str(src), str(work / "out")],
            "k3ckpt fetch --node 0": [*K3, "fetch", "--source", "hf", "--repo", "moonshotai/Kimi-K3", "--dest",
                                      str(work / "out"), *TOPOLOGY],
            "k3ckpt reshard --node 0": [*K3, "reshard", str(src), "-o", str(work / "out"), *TOPOLOGY],
        }
        results: dict[str, list[tuple[int, float]]] = {k: [] for k in contenders}
        for _ in range(args.runs):  # interleaved, so that a slow spell hits every contender
            for label, cmd in contenders.items():
                nbytes, dt = timed(cmd, work / "out", env)
                results[label].append((nbytes, dt))
                print(f"{label:26s} {nbytes / 1e9:6.3f} GB {dt:6.2f} s {nbytes / dt / 1e9:6.3f} GB/s", flush=True)
    finally:
        hub.terminate()
        hub.wait()
    med = {k: (v[0][0], statistics.median(d for _, d in v)) for k, v in results.items()}
    cp_rate = med["cp -r"][0] / med["cp -r"][1]
    print(f"\nmedian of {args.runs} interleaved rounds; cache dropped before each run: {drop_caches()}\n")
    print("| run | bytes written | seconds | GB/s | vs cp -r |")
    print("|---|---:|---:|---:|---:|")
    for label, (nbytes, dt) in med.items():
        print(f"| `{label}` | {nbytes:,} | {dt:.2f} | {nbytes / dt / 1e9:.3f} | {nbytes / dt / cp_rate:.2f}x |")


if __name__ == "__main__":
    main()
