#!/usr/bin/env python
"""Node directories against ``cp -r``: ``k3ckpt reshard --node`` and ``k3ckpt fetch --node`` (from
the loopback hub) writing one node's directory, bytes written per second, sync included.

    .venv/bin/python scripts/bench_node.py [--work work/bench_node] [--runs 3] [--shapes k3-8shard,k3-small]

Per shape (default: issue #16's ``k3-8shard`` and ``k3-small``), served by the loopback hub
(``k3ckpt.testing.hub``, in its own process); in interleaved rounds (the shared method of
scripts/benchlib.py; page cache dropped before each run by default): ``cp -r`` of the
checkpoint, ``fetch`` of the whole checkpoint, ``fetch --node 0`` and ``reshard --node 0`` for
vLLM TP2 x DP4 on two 4-GPU nodes (node 0 holds half the experts), each into a fresh directory,
each followed by ``sync`` inside its wall; and ``reshard --node 0 --manifest M``
(``--skip-manifest``), given a tensor-hash manifest the source was verified against outside the
timed runs (bench_reshard's ``tensor_manifest``). ``fetch --node 0`` is compared with the whole
``fetch`` of the same rounds (issue #28: bytes written per second and CPU-s per GB), everything
else with ``cp -r``. ``--skip-reshard`` leaves the reshard runs to ``bench_reshard.py``. The
hub's own CPU-s per run is reported beside the fetches.

Each fetch also runs with ``--dry-run`` in every round (the same launch, listing, headers and
plan, then exit): issue #28's yardstick reports a command's fixed cost apart from its rate, so a
second table gives both fetches' rate and CPU per GB beyond it - each round's run less that
round's dry run - and ``fetch --node`` against the whole ``fetch`` on those figures.
"""

from __future__ import annotations

import argparse
import statistics

import benchlib as bl
from bench_reshard import tensor_manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_node", cache="cold")
    ap.add_argument("--skip-manifest", action="store_true",
                    help="skip the `reshard --node 0 --manifest M` runs (and building the tensor-hash manifests)")
    ap.add_argument("--skip-reshard", action="store_true",
                    help="skip every `reshard --node 0` run: cp -r and the two fetches only")
    args = ap.parse_args()
    setup = bl.start("bench_node", args)
    shapes = {name: setup.shape(name) for name in setup.shapes}
    out = setup.work / "out"
    tables = []
    with bl.Hub({f"bench/{n}": s.path for n, s in shapes.items()}, setup.work) as hub:
        env = hub.env(K3CKPT_CACHE_DIR=str(setup.work / "cache"), HF_HOME=str(setup.work / "hf"))
        for shape in shapes.values():
            print(f"\n{shape.name}", flush=True)
            src = str(shape.path)
            cs = [
                bl.Contender("cp -r + sync", ["cp", "-r", src, str(out)], out=out, sync=True, inputs=[shape.path]),
                whole := bl.Contender("k3ckpt fetch (whole checkpoint)",
                                      [*bl.K3, "fetch", f"bench/{shape.name}", "--local-dir", str(out)],
                                      out=out, sync=True, inputs=[shape.path], env=env),
                node := bl.Contender("k3ckpt fetch --node 0",
                                     [*bl.K3, "fetch", f"bench/{shape.name}", "--local-dir", str(out),
                                      *bl.NODE_LAYOUT, "--node", "0"], out=out, sync=True, inputs=[shape.path], env=env),
            ]
            fetches = [whole, node]
            plans = {c.label: bl.Contender(f"{c.label} --dry-run", [*c.cmd, "--dry-run"], env=env, inputs=[shape.path])
                     for c in fetches}
            cs += plans.values()
            if not args.skip_reshard:
                cs.append(bl.Contender("k3ckpt reshard --node 0",
                                       [*bl.K3, "reshard", src, "-o", str(out), *bl.NODE_LAYOUT, "--node", "0"],
                                       out=out, sync=True, inputs=[shape.path]))
            if not args.skip_manifest and not args.skip_reshard:
                m, menv = tensor_manifest(setup, shape)
                cs.append(bl.Contender("k3ckpt reshard --node 0 --manifest M",
                                       [*bl.K3, "reshard", src, "-o", str(out), *bl.NODE_LAYOUT, "--node", "0",
                                        "--manifest", str(m)], out=out, sync=True, inputs=[shape.path], env=menv))
            runs = bl.interleave(cs, args.runs, setup.cache, server=hub)
            res = bl.summarize_all({label: r for label, r in runs.items() if not label.endswith("--dry-run")})
            cp = res[cs[0].label]
            peers = {node.label: res[whole.label]}  # fetch --node against the whole fetch, the rest against cp -r
            columns = [*bl.COLUMNS[:6], ("peer", "peer", "`{}`"), *bl.COLUMNS[6:], ("hub CPU-s", "server_cpu_s", "{:.2f}")]
            tables.append(bl.Table(shape.describe() + "; node 0 of `" + " ".join(bl.NODE_LAYOUT) + "`; bytes written",
                                   columns, [bl.row(s, peers.get(s.label, cp), shape=shape.name)
                                             for s in res.values()]))
            tables.append(beyond_fixed_cost(shape.name, {c.label: (runs[c.label], runs[plans[c.label].label])
                                                         for c in fetches}, whole.label, node.label))
    bl.write_report(setup, tables)


def beyond_fixed_cost(shape: str, pairs: dict[str, tuple[list[bl.Run], list[bl.Run]]], whole: str,
                      node: str) -> bl.Table:
    """Each fetch's rate and CPU per GB beyond its fixed cost: per round, the run less the same
    round's ``--dry-run`` (launch, listing, headers, plan, exit); medians, and ``node`` against
    ``whole`` round by round (the by-round range beside the median)."""
    # label -> [(GB/s, CPU-s per GB)] by round; None where a run took no longer than its dry run
    per_round: dict[str, list[tuple[float, float] | None]] = {}
    fixed: dict[str, tuple[float, float]] = {}
    for label, (real, dry) in pairs.items():
        per_round[label] = [(r.nbytes / bl.GB / (r.wall_s - d.wall_s), (r.cpu_s - d.cpu_s) / (r.nbytes / bl.GB))
                            if r.wall_s > d.wall_s and r.nbytes else None for r, d in zip(real, dry)]
        fixed[label] = (statistics.median(d.wall_s for d in dry), statistics.median(d.cpu_s for d in dry))
    both = [(n, w) for n, w in zip(per_round[node], per_round[whole]) if n is not None and w is not None]
    rate, cpu = [n[0] / w[0] for n, w in both], [n[1] / w[1] for n, w in both]
    rows = []
    for label, by_round in per_round.items():
        kept = [r for r in by_round if r is not None]
        rows.append({"shape": shape, "label": label, "fixed_wall_s": fixed[label][0], "fixed_cpu_s": fixed[label][1],
                     "gb_per_s": statistics.median(r[0] for r in kept) if kept else None,
                     "cpu_s_per_gb": statistics.median(r[1] for r in kept) if kept else None,
                     **({"vs_wall": statistics.median(rate), "vs_wall_rounds": [min(rate), max(rate)],
                         "vs_cpu": statistics.median(cpu)} if label == node and both else {})})
    return bl.Table(f"**{shape}** beyond each fetch's fixed cost (each round's run less its `--dry-run`)",
                    [("command", "label", "`{}`"), ("fixed cost: dry run wall (s)", "fixed_wall_s", "{:.2f}"),
                     ("its CPU-s", "fixed_cpu_s", "{:.2f}"), ("GB/s beyond it", "gb_per_s", "{:.3f}"),
                     ("CPU-s per GB beyond it", "cpu_s_per_gb", "{:.2f}"),
                     ("vs the whole fetch (rate)", "vs_wall", "{:.2f}x"),
                     ("by round", "vs_wall_rounds", "{0[0]:.2f}-{0[1]:.2f}x"),
                     ("CPU-s per GB vs the whole fetch's", "vs_cpu", "{:.2f}x")], rows)


if __name__ == "__main__":
    main()
