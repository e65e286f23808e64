#!/usr/bin/env python3
"""Each k3ckpt step's start-up at K3's inventory (issue #28): the work before a step's first byte.

A rank-aware fetch reads the index and every shard's header from the hub and plans from them;
`verify` reads every header and the manifest; `reshard --node` reads every header and plans.
That grows with the tensors, and K3 has 497,385 of them - the judged shapes 2,887. The
time-to-ready estimate (`k3ckpt.deploy.estimate`, `CostPerGB.*_per_tensor`) counts it
per tensor of the checkpoint; this measures those figures.

    .venv/bin/python scripts/bench_scale.py [--work work/bench_scale] [--runs 5]

On `k3-full --headers-only` (96 sparse shards, 1.56 TB apparent; built once) and `k3-tiny`,
both served by one loopback hub, each command a fresh process, in interleaved rounds (the shared
method of scripts/benchlib.py; warm: the headers are in the page cache, as on a node that just
fetched them).

Each step's command, on each shape (node 0 of two: `--tp 8 --dp 2 --gpus-per-node 8`; k3-tiny
`--tp 2 --dp 4 --gpus-per-node 4`):
- `fetch --node`: `fetch REPO --local-dir OUT --node 0 ... --manifest M --dry-run`;
- `fetch --ranks`: the same ranks as `--ep 16 --tp 8 --gpus-per-node 8 --node 0 --format partial`;
- `verify`: `verify DIR --manifest M --quick --no-cache` - the manifest and every header read and
  checked against each other, nothing hashed;
- `reshard --node`: `plan_reshard(DIR, node 0)` in a fresh interpreter - every header read and
  the node's directory planned, as `reshard` does before its first byte.

Per tensor = (median on k3-full - median on k3-tiny) / (k3-full's tensors - k3-tiny's).

M is a tensor-hash manifest. For k3-tiny, `manifest build --tensor-hashes`. For k3-full,
`manifest pull` (the hub's file digests and every header) with each tensor's sha256 set to that
of its length in zero bytes - a headers-only shard's data is a hole, which reads as zeros -
computed once per length: the digests `manifest pull --tensor-hashes` would compute by
streaming 1.56 TB. The hub hashes every file it serves when it starts (cached in
`--work/hub-cache`): k3-full's holes take ~8 minutes the first time.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
from pathlib import Path

import benchlib as bl

#: node 0 of two on each shape: K3's 8-GPU nodes; k3-tiny's 4 attention heads take tp 2 at most
LAYOUTS = {"k3-full": (8, 2, 8), "k3-tiny": (2, 4, 4)}
RESHARD_PLAN = r"""
import sys
from k3ckpt.deploy.reshard import plan_reshard
from k3ckpt.format.topology import RankSelection
tp, dp, gpus = map(int, sys.argv[2:])
plan_reshard(sys.argv[1], RankSelection(tp=tp, dp=dp, gpus_per_node=gpus, node=0))
"""
STEPS = ("fetch --node", "fetch --ranks", "verify", "reshard --node")


def zero_run_manifest(repo: str, hub: bl.Hub, out: Path) -> Path:
    """``manifest pull`` of a headers-only checkpoint with every tensor's sha256: that of its
    length in zero bytes (see the module docstring), once per length."""
    from k3ckpt.integrity import Manifest

    if out.is_file():
        return out
    plain = out.with_suffix(".plain.json")
    subprocess.run([*bl.K3, "manifest", "pull", repo, "-o", str(plain)], check=True, cwd=bl.ROOT, env=hub.env(),
                   stdout=subprocess.DEVNULL)
    m = Manifest.load(plain)
    digests: dict[int, str] = {}
    for name, t in m.tensors.items():
        n = t.offsets[1] - t.offsets[0]
        if n not in digests:
            digests[n] = zeros_sha256(n)
        m.tensors[name] = t._replace(sha256=digests[n])
    m.tensor_hashes = True
    m.save(out)
    plain.unlink()
    return out


def zeros_sha256(n: int) -> str:
    """sha256 of ``n`` zero bytes, 16 MiB at a time."""
    h, block = hashlib.sha256(), memoryview(bytes(1 << 24))
    whole, rest = divmod(n, len(block))
    for _ in range(whole):
        h.update(block)
    h.update(block[:rest])
    return h.hexdigest()


def built_manifest(shape: Path, out: Path) -> Path:
    if not out.is_file():
        subprocess.run([*bl.K3, "manifest", "build", str(shape), "-o", str(out), "--tensor-hashes"], check=True,
                       cwd=bl.ROOT, stdout=subprocess.DEVNULL)
    return out


def contenders(shape: str, path: Path, manifest: Path, hub: bl.Hub, work: Path) -> list[bl.Contender]:
    repo = f"bench/{shape}"
    env = hub.env(K3CKPT_CACHE_DIR=str(work / "cache"), HF_HOME=str(work / "hf"))
    tp, dp, gpus = LAYOUTS[shape]
    layout = ["--tp", str(tp), "--dp", str(dp), "--gpus-per-node", str(gpus), "--node", "0"]
    fetch = [*bl.K3, "fetch", repo, "--local-dir", str(work / "out"), "--manifest", str(manifest), "--dry-run"]
    # the same ranks in the rank-aware fetch's words (ep = tp x dp, whole tensors), as bench_ready's
    ranks = ["--ep", str(tp * dp), "--tp", str(tp), "--gpus-per-node", str(gpus), "--node", "0", "--format", "partial"]
    return [  # labelled "STEP (SHAPE)": main() pairs each step's two shapes by it
        bl.Contender(f"fetch --node ({shape})", [*fetch, *layout], env=env),
        bl.Contender(f"fetch --ranks ({shape})", [*fetch, *ranks], env=env),
        bl.Contender(f"verify ({shape})", [*bl.K3, "verify", str(path), "--manifest", str(manifest), "--quick",
                                           "--no-cache"]),
        bl.Contender(f"reshard --node ({shape})",
                     [sys.executable, "-c", RESHARD_PLAN, str(path), str(tp), str(dp), str(gpus)]),
    ]


def tensors_of(manifest: Path) -> int:
    from k3ckpt.integrity import Manifest

    return len(Manifest.load(manifest).tensors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_scale", runs=5)
    args = ap.parse_args()
    setup = bl.start("bench_scale", args)
    full, tiny = bl.k3_full(setup.work), setup.shape("k3-tiny").path
    print("starting the loopback hub (it hashes k3-full's 1.56 TB the first time: ~8 min)", flush=True)
    with bl.Hub({"bench/k3-full": full, "bench/k3-tiny": tiny}, setup.work) as hub:
        manifests = {"k3-full": zero_run_manifest("bench/k3-full", hub, setup.work / "k3-full.tensors.json"),
                     "k3-tiny": built_manifest(tiny, setup.work / "k3-tiny.tensors.json")}
        tensors = {name: tensors_of(m) for name, m in manifests.items()}
        cs = [*contenders("k3-full", full, manifests["k3-full"], hub, setup.work),
              *contenders("k3-tiny", tiny, manifests["k3-tiny"], hub, setup.work)]
        runs = bl.interleave(cs, args.runs, setup.cache, server=hub)
    rows = []
    for step in STEPS:
        big, small = (runs[f"{step} ({shape})"] for shape in ("k3-full", "k3-tiny"))
        wall = {s: statistics.median(r.wall_s for r in rs) for s, rs in (("full", big), ("tiny", small))}
        cpu = {s: statistics.median(r.cpu_s for r in rs) for s, rs in (("full", big), ("tiny", small))}
        per = (wall["full"] - wall["tiny"]) / (tensors["k3-full"] - tensors["k3-tiny"])
        rows.append({"step": step, "full_wall_s": wall["full"], "full_range": f"{min(r.wall_s for r in big):.2f}-"
                     f"{max(r.wall_s for r in big):.2f}", "full_cpu_s": cpu["full"], "tiny_wall_s": wall["tiny"],
                     "us_per_tensor": per * 1e6, "hub_cpu_s": statistics.median(r.server_cpu_s for r in big)})
    table = bl.Table(f"Start-up at K3's inventory: k3-full --headers-only ({tensors['k3-full']:,} tensors) against "
                     f"k3-tiny ({tensors['k3-tiny']:,}); node 0 of two (`--tp 8 --dp 2 --gpus-per-node 8`; k3-tiny "
                     "`--tp 2 --dp 4 --gpus-per-node 4`)",
                     [("step", "step", "`{}`"), ("k3-full wall (s)", "full_wall_s", "{:.2f}"),
                      ("by round", "full_range", "{}"), ("its CPU-s", "full_cpu_s", "{:.2f}"),
                      ("hub CPU-s", "hub_cpu_s", "{:.2f}"), ("k3-tiny wall (s)", "tiny_wall_s", "{:.2f}"),
                      ("per tensor (us)", "us_per_tensor", "{:.1f}")], rows)
    bl.write_report(setup, [table], {"tensors": tensors})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
