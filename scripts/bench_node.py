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
"""

from __future__ import annotations

import argparse

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
            if not args.skip_reshard:
                cs.append(bl.Contender("k3ckpt reshard --node 0",
                                       [*bl.K3, "reshard", src, "-o", str(out), *bl.NODE_LAYOUT, "--node", "0"],
                                       out=out, sync=True, inputs=[shape.path]))
            if not args.skip_manifest and not args.skip_reshard:
                m, menv = tensor_manifest(setup, shape)
                cs.append(bl.Contender("k3ckpt reshard --node 0 --manifest M",
                                       [*bl.K3, "reshard", src, "-o", str(out), *bl.NODE_LAYOUT, "--node", "0",
                                        "--manifest", str(m)], out=out, sync=True, inputs=[shape.path], env=menv))
            res = bl.summarize_all(bl.interleave(cs, args.runs, setup.cache, server=hub))
            cp = res[cs[0].label]
            peers = {node.label: res[whole.label]}  # fetch --node against the whole fetch, the rest against cp -r
            columns = [*bl.COLUMNS[:6], ("peer", "peer", "`{}`"), *bl.COLUMNS[6:], ("hub CPU-s", "server_cpu_s", "{:.2f}")]
            tables.append(bl.Table(shape.describe() + "; node 0 of `" + " ".join(bl.NODE_LAYOUT) + "`; bytes written",
                                   columns, [bl.row(s, peers.get(s.label, cp), shape=shape.name)
                                             for s in res.values()]))
    bl.write_report(setup, tables)


if __name__ == "__main__":
    main()
