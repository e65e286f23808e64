#!/usr/bin/env python
"""Benchmark ``k3ckpt reshard`` against ``cp -r`` and a plain safetensors script, same disk.

    .venv/bin/python scripts/bench_reshard.py [--work work/bench_reshard] [--runs 3] [--formats rank,node]

Per shape (default: issue #16's ``k3-8shard`` and ``k3-small``), in interleaved rounds (the
shared method of scripts/benchlib.py; page cache dropped before each run by default, every run
followed by ``sync`` inside its wall: reshard fsyncs its files, so the others must reach the
disk too), output bytes per second and the process tree's peak RSS:
- ``cp -r SRC DST``: the floor for moving the checkpoint's bytes once;
- ``--formats rank``: ``k3ckpt reshard SRC -o OUT --format rank --ep 8 --tp 2`` (every rank) and
  the same limited to the first ranks whose output is about the source's size (the same write
  volume as ``cp``);
- ``--formats node``: the engine node format, ``reshard SRC -o OUT --tp 2 --dp 4
  --gpus-per-node 4`` (both nodes) and ``--node 0``;
- ``--manifest M`` (both formats, every unit; ``--skip-manifest``): the same reshard given a
  tensor-hash manifest of a source ``verify`` found intact, so whole tensors take their digests
  from it (the route of a checkpoint fetched or verified first). Prepared outside the timed
  runs, once per shape: ``k3ckpt manifest build SRC -o WORK/NAME.tensor-manifest.json
  --tensor-hashes`` and ``k3ckpt verify SRC --manifest M``, with ``K3CKPT_CACHE_DIR=WORK/cache``
  (verify's stat cache lives there, never in the read-only data; reshard reads it there); and
  the documented flow with no flag (verify ran with ``M``, then a plain reshard under the same
  stat cache: it takes ``M``'s digests itself);
- ``naive`` (rank layout, once per shape, when torch imports; ``--skip-naive``): what a user
  would write with the ``safetensors`` library: for each rank, load each tensor it holds
  (``safe_open(framework="pt")`` - torch, because the numpy framework cannot hold BF16), slice
  it with the same TP rules, keep the rank's tensors in a dict and ``save_file`` them. No
  hashes, no manifest.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import benchlib as bl

NAIVE = r'''
import sys, os
from pathlib import Path
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from k3ckpt.deploy.reshard import plan_reshard
from k3ckpt.format.topology import RankSelection

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


def rank_part(shape: bl.Shape) -> tuple[int, int]:
    """(ranks, k): the rank layout's rank count and the first k ranks whose output is about the source's size."""
    from k3ckpt.deploy.reshard import plan_reshard
    from k3ckpt.format.topology import RankSelection

    sizes = [unit.nbytes for unit in plan_reshard(shape.path, RankSelection(ep=8, tp=2), layout="rank").units]
    acc, k = 0, 0
    while k < len(sizes) and acc + sizes[k] <= shape.nbytes * 1.02:
        acc += sizes[k]
        k += 1
    return len(sizes), max(k, 1)


def tensor_manifest(setup: bl.Setup, shape: bl.Shape) -> tuple[Path, dict[str, str]]:
    """A tensor-hash manifest of ``shape`` that ``verify`` found the source equal to, and the
    environment under which reshard finds that verdict (the stat cache in ``--work``), built
    once (outside every timed run; the manifest is reused, the verify is re-run, cheap when
    the stat cache already holds the files)."""
    env = bl.child_env(K3CKPT_CACHE_DIR=str(setup.work / "cache"))
    m = setup.work / f"{shape.name}.tensor-manifest.json"
    if not m.is_file():
        print(f"building {m.name} (tensor hashes)", flush=True)
        subprocess.run([*bl.K3, "manifest", "build", str(shape.path), "-o", str(m), "--tensor-hashes"], check=True,
                       cwd=bl.ROOT, env=env, stdout=subprocess.DEVNULL)
    subprocess.run([*bl.K3, "verify", str(shape.path), "--manifest", str(m)], check=True, cwd=bl.ROOT, env=env,
                   stdout=subprocess.DEVNULL)
    return m, env


def contenders(setup: bl.Setup, shape: bl.Shape, formats: list[str], jobs: list[str],
               manifest: tuple[Path, dict[str, str]] | None = None) -> list[bl.Contender]:
    out = setup.work / "out"
    src = str(shape.path)

    def writer(label: str, cmd: list[str], env: dict[str, str] | None = None) -> bl.Contender:
        return bl.Contender(label, cmd, out=out, sync=True, inputs=[shape.path], env=env, meta={"shape": shape.name})

    def with_manifest(label: str, cmd: list[str]) -> list[bl.Contender]:
        if manifest is None:
            return []
        # the documented flow needs no flag: reshard takes the manifest the verify used (#28)
        return [writer(f"{label} --manifest M", [*cmd, "--manifest", str(manifest[0])], manifest[1]),
                writer(f"{label} after verify --manifest M, no flag", cmd, manifest[1])]

    cs = [writer("cp -r + sync", ["cp", "-r", src, str(out)])]
    if "rank" in formats:
        ranks, k = rank_part(shape)
        cmd = [*bl.K3, "reshard", src, "-o", str(out), *bl.RANK_LAYOUT, *jobs]
        cs.append(writer(f"reshard --format rank --ep 8 --tp 2 (all {ranks} ranks)", cmd))
        cs += with_manifest(f"reshard --format rank --ep 8 --tp 2 (all {ranks} ranks)", cmd)
        cs.append(writer(f"reshard --format rank --ep 8 --tp 2 --ranks 0-{k - 1}",
                         [*bl.K3, "reshard", src, "-o", str(out), *bl.RANK_LAYOUT, "--ranks", f"0-{k - 1}", *jobs]))
    if "node" in formats:
        cmd = [*bl.K3, "reshard", src, "-o", str(out), *bl.NODE_LAYOUT, *jobs]
        cs.append(writer("reshard --tp 2 --dp 4 --gpus-per-node 4 (node format, 2 nodes)", cmd))
        cs += with_manifest("reshard --tp 2 --dp 4 --gpus-per-node 4 (node format, 2 nodes)", cmd)
        cs.append(writer("reshard --tp 2 --dp 4 --gpus-per-node 4 --node 0",
                         [*bl.K3, "reshard", src, "-o", str(out), *bl.NODE_LAYOUT, "--node", "0", *jobs]))
    return cs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_reshard", cache="cold")
    ap.add_argument("--formats", default="rank,node", help="comma-separated: rank, node [default: both]")
    ap.add_argument("--jobs", type=int, default=None, help="reshard --jobs [default: reshard's]")
    ap.add_argument("--skip-naive", action="store_true", help="skip the plain safetensors script (needs torch)")
    ap.add_argument("--skip-manifest", action="store_true",
                    help="skip the `--manifest M` runs (and building the tensor-hash manifests)")
    args = ap.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    if not set(formats) <= {"rank", "node"}:
        raise SystemExit(f"--formats: rank and/or node, not {args.formats}")
    setup = bl.start("bench_reshard", args)
    jobs = ["--jobs", str(args.jobs)] if args.jobs else []
    naive = not args.skip_naive and "rank" in formats and importlib.util.find_spec("torch") is not None
    tables = []
    for name in setup.shapes:
        shape = setup.shape(name)
        print(f"\n{shape.name}", flush=True)
        cs = contenders(setup, shape, formats, jobs, None if args.skip_manifest else tensor_manifest(setup, shape))
        runs = bl.interleave(cs, args.runs, setup.cache)
        if naive:
            script = setup.work / "naive_reshard.py"
            script.write_text(NAIVE)
            c = bl.Contender("naive safetensors script (one run)",
                             [sys.executable, str(script), str(shape.path), str(setup.work / "nv"), "8", "2"],
                             out=setup.work / "nv", sync=True, inputs=[shape.path])
            runs[c.label] = [bl.run_one(c, setup.cache)]
        res = bl.summarize_all(runs)
        cp = res[cs[0].label]
        notes = "" if naive or args.skip_naive else "naive script skipped: torch does not import in this venv."
        tables.append(bl.Table(shape.describe(), bl.COLUMNS, [bl.row(s, cp, shape=shape.name) for s in res.values()],
                               notes))
    bl.write_report(setup, tables)


if __name__ == "__main__":
    main()
