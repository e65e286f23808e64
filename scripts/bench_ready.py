#!/usr/bin/env python
"""Time to ready on this machine (#28 items 4 and 5): ``plan --link --disk --cores``'s estimate
against a measured run, step by step, and one node of a two-node topology from an empty disk to
``preflight`` PASS by each route, side by side.

    .venv/bin/python scripts/bench_ready.py [--work work/bench_ready] [--runs 3] [--shapes k3-density] [--cores 1,2]

Per shape (default ``k3-density``: 3.3 GB at K3's tensor density), served by the loopback hub in
its own process, node 0 of vLLM TP 2 x DP 2 on two 2-GPU nodes (``--tp 2 --dp 2 --gpus-per-node
2``: the dense tensors and half the experts). For each core count C of ``--cores``, every
command pinned to C CPUs (the hub is not pinned: here it shares the machine's cores, which a
remote hub would not), in ``--runs`` rounds:

1. **This machine's limits**, measured in the round: ``link`` = bytes per second of ``xargs -P8
   curl`` of the checkpoint from the hub into ``/dev/null`` (what the hub serves this client over
   loopback, the hub's files in its page cache); ``disk`` = (bytes read + bytes written) per
   second of ``cp -r`` of the checkpoint then ``sync``, page cache dropped first (the model's one
   disk rate for reads and writes together); ``cores`` = C.
2. **The routes**, each from an empty disk (a fresh directory, HF home and k3ckpt cache), page
   cache dropped before each step (a K3 share does not stay in the page cache from one step to
   the next, and the estimate reads every step's bytes from the disk) - then, before a step that
   reads from the hub, the hub's files read back into it: the hub stands for a remote one, whose
   reads do not take this node's disk (on 2026-12-05, with the hub reading from the same disk,
   the downloads at 2 cores were bound by that disk, read and written at once) - each step
   timed alone (``sync`` inside a writer's wall):

   - ``fetch --node``: ``manifest pull --tensor-hashes`` (not in the estimate: hub metadata
     only), ``fetch REPO --node 0 --manifest M``, ``verify NODE --manifest M``, ``preflight NODE``;
   - ``fetch, verify, reshard``: ``fetch REPO --node 0 --format partial --manifest M`` (the
     estimate's ``fetch --ranks``), ``verify SHARE --manifest M``, ``reshard SHARE --node 0``
     (taking verify's digests), ``preflight NODE``;
   - naive: ``hf download REPO``, ``hf cache verify REPO``, ``preflight SNAPSHOT``.
3. **The estimate**: ``plan SRC --tp 2 --dp 2 --gpus-per-node 2 --link L --disk D --cores C
   --memory RAM --json`` with the round's medians of L and D and this machine's RAM; each step's
   predicted seconds beside the median measured (the engine's load is left out: no engine loads
   these shapes here).

The report: per core count, every step predicted vs measured (ratio measured / predicted; the
target is within 25 %), and per route the wall from an empty disk to preflight PASS, the bytes
downloaded and left on disk, and the naive route's wall over k3ckpt's fastest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl

REPO_PREFIX = "bench"
TOPO = ["--tp", "2", "--dp", "2", "--gpus-per-node", "2"]
NODE = [*TOPO, "--node", "0"]
#: The estimate's step names for the measured steps that have one.
ESTIMATED = {"fetch --node": "fetch --node", "fetch --ranks": "fetch --ranks", "verify share": "verify",
             "reshard --node": "reshard --node", "hf download": "hf download", "hf cache verify": "hf cache verify"}
#: The steps that read from the hub.
DOWNLOADS = frozenset({"manifest pull", "fetch --node", "fetch --ranks", "hf download"})
#: Route name (the estimate's) -> its steps, in order.
ROUTES = {"fetch --node": ["manifest pull", "fetch --node", "verify node", "preflight"],
          "fetch, verify, reshard": ["manifest pull", "fetch --ranks", "verify share", "reshard --node", "preflight"],
          "naive: hf download, verify": ["hf download", "hf cache verify", "preflight"]}


def hf_cli() -> str:
    hf = Path(sys.executable).with_name("hf")
    if not hf.exists():
        raise SystemExit(f"{hf} is missing: huggingface_hub's CLI comes with the [test] extra")
    return str(hf)


def measure_limits(setup: bl.Setup, hub: bl.Hub, shape: bl.Shape, cores: int) -> tuple[float, float]:
    """(link, disk) in bytes per second, measured now (module doc, 1)."""
    repo = f"{REPO_PREFIX}/{shape.name}"
    urls = " ".join(f"'{hub.resolve_url(repo, f.name)}'" for f in shape.files)
    setup.cache.prepare([shape.path])
    bl.read_into_cache([shape.path])  # served from memory, as a remote hub's reads are not this disk's
    t = bl.run_timed(f"printf '%s\\n' {urls} | xargs -P8 -n1 curl -s -f -o /dev/null", cores=cores)
    link = shape.nbytes / t.wall_s
    out = setup.work / "cp-out"
    shutil.rmtree(out, ignore_errors=True)
    setup.cache.prepare([shape.path])
    t = bl.run_timed(["cp", "-r", str(shape.path), str(out)], sync_after=True, cores=cores)
    shutil.rmtree(out, ignore_errors=True)
    return link, 2 * shape.nbytes / t.wall_s


def route_commands(route: str, setup: bl.Setup, hub: bl.Hub, shape: bl.Shape,
                   hf: str) -> list[tuple[str, list[str], bool]]:
    """``(step, argv, writes)`` of ``route``, into fresh directories under ``--work``."""
    repo = f"{REPO_PREFIX}/{shape.name}"
    d = setup.work / "route"
    m, share, node = d / "m.json", d / "share", d / "node"
    pull = ("manifest pull", [*bl.K3, "manifest", "pull", "--source", "hf", "--repo", repo, "--tensor-hashes", "-o",
                              str(m)], True)
    preflight = [*bl.K3, "preflight", "--no-env"]
    if route == "fetch --node":
        return [pull, ("fetch --node", [*bl.K3, "fetch", repo, "--local-dir", str(node), *NODE, "--manifest", str(m)], True),
                ("verify node", [*bl.K3, "verify", str(node), "--manifest", str(m)], False),
                ("preflight", [*preflight, str(node), *NODE], False)]
    if route == "fetch, verify, reshard":
        # the same ranks in the rank-aware fetch's words (ep = tp x dp, whole tensors)
        ranks = ["--ep", "4", "--tp", "2", "--gpus-per-node", "2", "--node", "0", "--format", "partial"]
        return [pull, ("fetch --ranks", [*bl.K3, "fetch", repo, "--local-dir", str(share), *ranks, "--manifest", str(m)],
                       True),
                ("verify share", [*bl.K3, "verify", str(share), "--manifest", str(m)], False),
                ("reshard --node", [*bl.K3, "reshard", str(share), "-o", str(d / "out"), *NODE], True),
                ("preflight", [*preflight, str(d / "out" / "node-00000"), *NODE], False)]
    # the snapshot hf download fills, in the fresh HF home run_route gives the route
    snapshot = d / "hf-home" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / hub.commits[repo]
    return [("hf download", [hf, "download", repo], True),
            ("hf cache verify", [hf, "cache", "verify", repo, "--fail-on-missing-files"], False),
            ("preflight", [*preflight, str(snapshot), *NODE], False)]


def run_route(route: str, setup: bl.Setup, hub: bl.Hub, shape: bl.Shape, cores: int, hf: str) -> dict[str, Any]:
    """One run of ``route`` from an empty disk: each step's wall and CPU, the bytes on disk after."""
    d = setup.work / "route"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    env = hub.env(HF_HOME=str(d / "hf-home"), K3CKPT_CACHE_DIR=str(d / "k3ckpt-cache"))
    steps: dict[str, dict[str, float]] = {}
    for step, cmd, writes in route_commands(route, setup, hub, shape, hf):
        # before every step: what a step reads comes from the disk, as the estimate has it (a K3
        # share of ~0.8 TB does not stay in the page cache for the next step, as 2-4 GB here would)
        setup.cache.prepare([shape.path, d])
        if step in DOWNLOADS:
            # the hub stands for a remote one: what it serves comes from its memory, not from
            # this node's disk, which the estimate gives to the node's own reads and writes
            bl.read_into_cache([shape.path])
        hub_cpu = hub.cpu_s()
        t = bl.run_timed(cmd, env=env, cores=cores)
        t0 = time.perf_counter()
        if writes:
            os.sync()  # inside the step's wall, timed apart: what the writer left to the disk at its exit
        flush = time.perf_counter() - t0
        steps[step] = {"wall_s": t.wall_s + flush, "cpu_s": t.cpu_s, "flush_s": flush,
                       "hub_cpu_s": hub.cpu_s() - hub_cpu}
    on_disk = sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not p.is_symlink()
                  and "k3ckpt-cache" not in p.parts and p.name != "m.json")
    shutil.rmtree(d, ignore_errors=True)
    return {"steps": steps, "on_disk_bytes": on_disk}


def predicted(path: Path, link: float, disk: float, cores: int, memory: int) -> dict[str, dict[str, Any]]:
    """Route name -> step name -> the estimate's step (``plan --json``'s ``time_to_ready``), node 0."""
    t = bl.run_timed([*bl.K3, "plan", str(path), *TOPO, "--link", f"{link:.0f}B/s", "--disk", f"{disk:.0f}B/s",
                      "--cores", str(cores), "--memory", str(memory), "--json"], capture=True)
    node = json.loads(t.stdout)["time_to_ready"]["nodes"][0]
    return {r["name"]: {s["name"]: s for s in r["steps"]} for r in node["routes"]}


def _step_bytes(step: dict[str, Any]) -> int:
    """The bytes an estimated step's CPU cost is per GB of (the share, or the whole checkpoint)."""
    return max(step["download_bytes"], step["read_bytes"], step["write_bytes"], step["hash_bytes"])


def measure(setup: bl.Setup, shapes: dict[str, bl.Shape], core_counts: list[int], runs: int) -> list[dict[str, Any]]:
    """Per shape and core count: the limits measured in each round and each route's runs."""
    hf = hf_cli()
    out: list[dict[str, Any]] = []
    all_cpus = sorted(os.sched_getaffinity(0))
    for shape in shapes.values():
        for cores in core_counts:
            # the hub on the CPUs the client does not use, as a remote hub's would be; on all of
            # them (shared with the client) when the client has every one
            hub_cpus = all_cpus[cores:] or None
            with bl.Hub({f"{REPO_PREFIX}/{shape.name}": shape.path}, setup.work, cpus=hub_cpus) as hub:
                print(f"\n{shape.name}, {cores} core(s), hub on {hub_cpus or 'the same CPUs'}", flush=True)
                got: dict[str, Any] = {"shape": shape.name, "path": str(shape.path), "cores": cores,
                                       "memory_bytes": bl.physical_memory(),
                                       "hub_cpus": hub_cpus or "shared", "links": [], "disks": [],
                                       "runs": {r: [] for r in ROUTES}}
                for i in range(runs):
                    link, disk = measure_limits(setup, hub, shape, cores)
                    got["links"].append(link)
                    got["disks"].append(disk)
                    for k in bl.round_order(len(ROUTES), i):
                        route = list(ROUTES)[k]
                        r = run_route(route, setup, hub, shape, cores, hf)
                        got["runs"][route].append(r)
                        print(f"  round {i + 1}: {route:28s} " + ", ".join(f"{s} {v['wall_s']:.2f} s"
                                                                             for s, v in r["steps"].items()), flush=True)
            out.append(got)
    return out


def compare(measured: list[dict[str, Any]]) -> list[bl.Table]:
    """The tables: the limits, each step predicted (by the estimate as it is now) against the run,
    and each route's wall to preflight PASS."""
    steps_table = bl.Table("Each step, the estimate against the run (node 0; median of the rounds, range in brackets)",
                           [("shape", "shape", "{}"), ("cores", "cores", "{}"), ("route", "route", "{}"),
                            ("step", "step", "`{}`"), ("predicted (s)", "predicted_s", "{:.2f}"),
                            ("bound", "bound", "{}"), ("measured (s)", "measured_s", "{:.2f}"),
                            ("range (s)", "range_s", "{0[0]:.2f}-{0[1]:.2f}"), ("CPU-s", "cpu_s", "{:.2f}"),
                            ("CPU-s per GB", "cpu_s_per_gb", "{:.2f}"), ("of it, sync after (s)", "flush_s", "{:.2f}"),
                            ("hub CPU-s", "hub_cpu_s", "{:.2f}"), ("measured / predicted", "ratio", "{:.2f}"),
                            ("within 25 %", "within", "{}")])
    ready_table = bl.Table("From an empty disk to preflight PASS (node 0 of two; median wall of the rounds)",
                           [("shape", "shape", "{}"), ("cores", "cores", "{}"), ("route", "route", "{}"),
                            ("wall (s)", "wall_s", "{:.2f}"), ("range (s)", "range_s", "{0[0]:.2f}-{0[1]:.2f}"),
                            ("on disk after", "on_disk_bytes", "{:,}"), ("naive / this", "vs_naive", "{:.2f}x")])
    limits = bl.Table("This machine's limits, measured in the rounds (medians)",
                      [("shape", "shape", "{}"), ("cores", "cores", "{}"), ("hub on CPUs", "hub_cpus", "{}"),
                       ("link (GB/s)", "link_gb_s", "{:.3f}"), ("disk (GB/s, read + write)", "disk_gb_s", "{:.3f}")])
    for got in measured:
        link, disk = statistics.median(got["links"]), statistics.median(got["disks"])
        limits.rows.append({"shape": got["shape"], "cores": got["cores"], "hub_cpus": got["hub_cpus"],
                            "link_gb_s": link / bl.GB, "disk_gb_s": disk / bl.GB})
        # (a report made before ccff790 has no memory_bytes: this machine's is taken for it)
        est = predicted(Path(got["path"]), link, disk, got["cores"], got.get("memory_bytes") or bl.physical_memory())
        walls: dict[str, float] = {}
        for route, route_runs in got["runs"].items():
            totals = [sum(v["wall_s"] for v in r["steps"].values()) for r in route_runs]
            walls[route] = statistics.median(totals)
            for step in ROUTES[route]:
                def med(key: str, step: str = step, route_runs: list[dict[str, Any]] = route_runs) -> float:
                    return statistics.median(r["steps"][step][key] for r in route_runs)

                measured_s = [r["steps"][step]["wall_s"] for r in route_runs]
                e = est[route].get(ESTIMATED.get(step, ""))
                m = statistics.median(measured_s)
                steps_table.rows.append({
                    "shape": got["shape"], "cores": got["cores"], "route": route, "step": step,
                    "predicted_s": e["seconds"] if e else None, "bound": e["bound"] if e else "-",
                    "measured_s": m, "range_s": [min(measured_s), max(measured_s)], "cpu_s": med("cpu_s"),
                    "cpu_s_per_gb": med("cpu_s") / (_step_bytes(e) / bl.GB) if e and _step_bytes(e) else None,
                    "flush_s": med("flush_s"), "hub_cpu_s": med("hub_cpu_s"),
                    "ratio": m / e["seconds"] if e else None,
                    "within": ("yes" if abs(m / e["seconds"] - 1) <= 0.25 else "no") if e else "-"})
            ready_table.rows.append({"shape": got["shape"], "cores": got["cores"], "route": route,
                                     "wall_s": walls[route], "range_s": [min(totals), max(totals)],
                                     "on_disk_bytes": int(statistics.median(r["on_disk_bytes"] for r in route_runs))})
        naive = walls["naive: hf download, verify"]
        for row in ready_table.rows[-len(ROUTES):]:
            row["vs_naive"] = naive / row["wall_s"]
    return [limits, steps_table, ready_table]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_ready", cache="cold")
    ap.set_defaults(shapes="k3-density")
    ap.add_argument("--cores", default="1,2", help="core counts, comma-separated [default: 1,2]")
    ap.add_argument("--measured", type=Path, default=None,
                    help="an earlier report's bench_ready.json: compare its runs with the estimate as it is now "
                         "(after a change of the cost model), without running anything")
    args = ap.parse_args()
    if args.measured is not None:
        args.page_reporting = "leave"  # nothing runs: the memory is not touched
    setup = bl.start("bench_ready", args)
    if args.measured is not None:
        measured = json.loads(args.measured.read_text())["measured"]
    else:
        shapes = {name: setup.shape(name) for name in setup.shapes}
        measured = measure(setup, shapes, [int(c) for c in args.cores.split(",") if c], args.runs)
    bl.write_report(setup, compare(measured), {"measured": measured})


if __name__ == "__main__":
    main()
