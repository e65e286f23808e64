#!/usr/bin/env python
"""Cost per GB (issue #16, Deliver 5): CPU-seconds per GB of fetch, verify, reshard and node_fetch
with 1 and 2 workers, next to the floor "sha256 at OpenSSL speed + the copy", and the scaling.

    .venv/bin/python scripts/bench_cost.py [--work work/bench_cost] [--runs 3] [--workers 1,2] [--shapes k3-8shard,k3-small]

Per shape (default: issue #16's ``k3-8shard`` and ``k3-small``), in interleaved rounds (the shared
method of scripts/benchlib.py; warm source, ``sync`` before every run and, for writers, inside
their wall), for each worker count N, the command pinned to N CPUs (``sched_setaffinity``, so a
1-worker run cannot lean on a second core for its main thread; ``--no-pin`` to let it):

| work | command | CPU-s per GB of |
|---|---|---|
| ``verify`` | ``verify SRC --manifest M --no-cache --jobs N`` | bytes hashed (the checkpoint) |
| ``reshard`` | ``reshard SRC -o OUT --tp 2 --dp 4 --gpus-per-node 4 --jobs N`` (node format) | bytes written |
| ``reshard_rank`` | ``reshard SRC -o OUT --format rank --ep 8 --tp 2 --jobs N`` | bytes written |
| ``fetch`` | ``fetch REPO --local-dir OUT --json``, loopback hub, 8 requests | bytes received (incl. hash, write, fsync) |
| ``node_fetch`` | ``fetch REPO --local-dir OUT --tp 2 --dp 4 --gpus-per-node 4 --node 0 --json`` | bytes received |

``--jobs N`` is each command's own worker count; a fetch's ``--jobs`` is its concurrent requests,
left at 8, so for fetch N is the CPUs only. Bytes received are the ``bytes_downloaded`` of the
fetch's ``--json``. The loopback hub runs in its own process on the same machine, unpinned; its
CPU is reported apart (on a real deployment the server is remote).

The floor, per GB, is ``sha256`` at ``openssl speed -evp sha256`` (one core) plus the copy the
work cannot avoid, measured in the same rounds on the same data (pinned to the largest N):
``cat FILES > /dev/null`` for a reader (verify), ``cp -r SRC OUT && sync`` per GB written
(reshard), ``xargs -P8 curl -O && sync`` per GB received, client side (fetch, node_fetch);
``xargs -PN openssl dgst -sha256`` is timed as a check of the read + hash floor.

Scaling = wall at the fewest workers / wall at the most: about N where the work is CPU-bound.

Fixed and marginal: the same commands on ``--fixed-shape`` (default ``k3-tiny``, 6 MB) give each
work's fixed CPU-s (interpreter start, imports, planning; ~0.2-0.9 s, a visible part of 1 GB
but nothing on 1.56 TB); ``marginal_cpu_s_per_gb`` = (CPU-s - fixed) / (GB - the tiny shape's
GB) is the cost per GB a large run pays, the one to compare with the floor.

The report (``bench_cost.md`` / ``bench_cost.json``) ends with ``cost``: per work the constant a
cost model takes (``cpu_s_per_gb``, ``fixed_cpu_s`` and ``marginal_cpu_s_per_gb``: each the
largest of the shapes' medians at the most workers, so the contention of parallel workers is in
it), its ``floor_cpu_s_per_gb`` and the floor's parts.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import benchlib as bl

# work -> (what its GB are, the copy part of its floor)
WORKS = {
    "verify": ("hashed", "read_copy"),
    "reshard": ("written", "write_copy"),
    "reshard_rank": ("written", "write_copy"),
    "fetch": ("received", "receive_copy"),
    "node_fetch": ("received", "receive_copy"),
}
COPIES = {"read_copy": "cat FILES > /dev/null", "write_copy": "cp -r SRC OUT && sync",
          "receive_copy": "xargs -P8 curl -O && sync", "sha256_read": "xargs -P{n} openssl dgst -sha256"}


def received(stdout: str) -> int | None:
    """A fetch's bytes received, from its ``--json`` summary."""
    value = bl.json_value(stdout, "bytes_downloaded") if stdout.strip() else None
    return int(value) if isinstance(value, int) else None


def shown(cmd: list[str], shape: bl.Shape, work: Path) -> str:
    """``cmd`` as a reader would type it: ``k3ckpt ...`` with the paths named by role."""
    text = " ".join(cmd[3:]).replace(str(shape.manifest), "M").replace(str(shape.path), "SRC")
    return "k3ckpt " + text.replace(str(work / "out"), "OUT").replace(f"bench/{shape.name}", "REPO")


def contenders(setup: bl.Setup, shape: bl.Shape, hub: bl.Hub, works: list[str], workers: list[int],
               pin: bool, floors: bool = True) -> list[bl.Contender]:
    src, out = str(shape.path), setup.work / "out"
    repo = f"bench/{shape.name}"
    env = hub.env(K3CKPT_CACHE_DIR=str(setup.work / "cache"), HF_HOME=str(setup.work / "hf-home"))
    cmds: dict[str, list[str]] = {
        "verify": [*bl.K3, "verify", src, "--manifest", str(shape.manifest), "--no-cache"],
        "reshard": [*bl.K3, "reshard", src, "-o", str(out), *bl.NODE_LAYOUT],
        "reshard_rank": [*bl.K3, "reshard", src, "-o", str(out), *bl.RANK_LAYOUT],
        "fetch": [*bl.K3, "fetch", repo, "--local-dir", str(out), "--json"],
        "node_fetch": [*bl.K3, "fetch", repo, "--local-dir", str(out), *bl.NODE_LAYOUT, "--node", "0", "--json"],
    }
    cs = []
    for n in workers:
        for work in works:
            cmd = cmds[work] + ([] if work.endswith("fetch") else ["--jobs", str(n)])
            meta = {"work": work, "shape": shape.name, "workers": n, "shown": shown(cmd, shape, setup.work)}
            if work == "verify":
                cs.append(bl.Contender(f"{work} x{n}", cmd, nbytes=shape.nbytes, inputs=shape.files,
                                       cores=n if pin else None, meta=meta))
            else:
                cs.append(bl.Contender(f"{work} x{n}", cmd, out=out, sync=True, inputs=shape.files,
                                       env=env if work.endswith("fetch") else None, cores=n if pin else None,
                                       count=received if work.endswith("fetch") else None, meta=meta))
    if not floors:
        return cs
    n = max(workers)
    cores = n if pin else None
    listing = " ".join(f"'{f}'" for f in shape.files)
    urls = [hub.resolve_url(repo, f.name) for f in shape.files]
    floor = {"shape": shape.name, "workers": n}
    cs += [
        bl.Contender("read_copy", f"cat {listing} > /dev/null", nbytes=shape.nbytes, inputs=shape.files, cores=cores,
                     meta={**floor, "work": "read_copy"}),
        bl.Contender("write_copy", f"cp -r '{src}' '{out}' && sync", out=out, sync=True, inputs=shape.files, cores=cores,
                     meta={**floor, "work": "write_copy"}),
        bl.Contender("receive_copy", bl.curl_cmd(urls, out, 8, sync=True), out=out, sync=True, inputs=shape.files,
                     env=env, cores=cores, meta={**floor, "work": "receive_copy"}),
        bl.Contender("sha256_read", f"printf '%s\\n' {listing} | xargs -P{n} -n1 openssl dgst -sha256",
                     nbytes=shape.nbytes, inputs=shape.files, cores=cores, meta={**floor, "work": "sha256_read"}),
    ]
    return cs


def cost_rows(cs: list[bl.Contender], res: dict[str, bl.Summary], sha: float) -> list[dict[str, Any]]:
    """One row per contender, with its floor and, on the most-workers row, the scaling."""
    copy = {c.meta["work"]: res[c.label].cpu_s_per_gb for c in cs if c.meta["work"] in COPIES}
    by_work: dict[str, dict[int, bl.Summary]] = {}
    for c in cs:
        by_work.setdefault(c.meta["work"], {})[c.meta["workers"]] = res[c.label]
    rows = []
    for c in cs:
        s, work, n = res[c.label], c.meta["work"], c.meta["workers"]
        fetch = work.endswith("fetch") or work == "receive_copy"
        r = bl.row(s, work=work, shape=c.meta["shape"], workers=n, gb=round(s.nbytes / bl.GB, 4),
                   server_cpu_s_per_gb=round(s.server_cpu_s / (s.nbytes / bl.GB), 4) if s.nbytes and fetch else None)
        r["label"] = c.meta.get("shown") or COPIES[work].format(n=n)
        if work in WORKS:
            basis, part = WORKS[work]
            r["basis"] = basis
            if part in copy:  # (the fixed-cost shape measures no copies)
                r["floor_cpu_s_per_gb"] = round(sha + copy[part], 4)
                r["x_floor"] = round(s.cpu_s_per_gb / r["floor_cpu_s_per_gb"], 3)
            runs = by_work[work]
            if len(runs) > 1 and n == max(runs) and runs[n].wall_s:
                r["scaling"] = round(runs[min(runs)].wall_s / runs[n].wall_s, 3)
        else:
            r["basis"] = "read" if work in ("read_copy", "sha256_read") else ("written" if work == "write_copy" else "received")
        rows.append(r)
    return rows


def in_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows by work (as in WORKS, the floor's copies last), then workers."""
    return sorted(rows, key=lambda r: (list(WORKS).index(r["work"]) if r["work"] in WORKS else len(WORKS), r["workers"]))


def add_marginal(rows: list[dict[str, Any]], fixed_rows: list[dict[str, Any]]) -> None:
    """Split each work's CPU-s into a fixed part (the same command on the tiny shape: start-up,
    imports, planning) and a marginal cost per GB beyond it - what a 1.56 TB run pays per GB."""
    fixed = {(r["work"], r["workers"]): r for r in fixed_rows if r["work"] in WORKS}
    for r in rows:
        f = fixed.get((r["work"], r["workers"]))
        if f is None or r["bytes"] <= f["bytes"]:
            continue
        r["fixed_cpu_s"] = f["cpu_s"]
        r["marginal_cpu_s_per_gb"] = round((r["cpu_s"] - f["cpu_s"]) / ((r["bytes"] - f["bytes"]) / bl.GB), 4)
        r["x_floor_marginal"] = round(r["marginal_cpu_s_per_gb"] / r["floor_cpu_s_per_gb"], 3)


def cost_summary(rows: list[dict[str, Any]], sha: float, sha_speed: float) -> dict[str, Any]:
    """The constants a cost model takes: per work the largest of the shapes at the most workers."""
    most = max(r["workers"] for r in rows)

    def worst(work: str, key: str) -> float | None:
        vals = [r[key] for r in rows if r["work"] == work and r["workers"] == most and r.get(key) is not None]
        return max(vals) if vals else None

    cost: dict[str, Any] = {
        "unit": "CPU-seconds per GB (1e9 B) of the work's basis bytes; the largest of the shapes' medians at "
                f"{most} workers",
        "floor": {"sha256_cpu_s_per_gb": round(sha, 4), "openssl_sha256_gb_per_s_per_core": round(sha_speed / bl.GB, 4),
                  **{f"{k}_cpu_s_per_gb": worst(k, "cpu_s_per_gb") for k in COPIES}},
    }
    for work, (basis, _part) in WORKS.items():
        if any(r["work"] == work for r in rows):
            cost[work] = {"basis": f"GB {basis}", "cpu_s_per_gb": worst(work, "cpu_s_per_gb"),
                          "fixed_cpu_s": worst(work, "fixed_cpu_s"),
                          "marginal_cpu_s_per_gb": worst(work, "marginal_cpu_s_per_gb"),
                          "floor_cpu_s_per_gb": worst(work, "floor_cpu_s_per_gb"), "x_floor": worst(work, "x_floor"),
                          "x_floor_marginal": worst(work, "x_floor_marginal"),
                          "scaling_by_shape": {r["shape"]: r.get("scaling") for r in rows
                                               if r["work"] == work and r["workers"] == most},
                          "server_cpu_s_per_gb": worst(work, "server_cpu_s_per_gb") if work.endswith("fetch") else None}
    return cost


COLUMNS = [("work", "work", "`{}`"), ("command", "label", "`{}`"), ("workers", "workers", "{}"), ("GB", "gb", "{:.3f}"),
           ("of", "basis", "{}"),
           ("wall (s)", "wall_s", "{:.2f}"), ("CPU-s", "cpu_s", "{:.2f}"), ("CPU/wall", "cpu_per_wall", "{:.2f}"),
           ("CPU-s per GB", "cpu_s_per_gb", "{:.3f}"), ("floor CPU-s per GB", "floor_cpu_s_per_gb", "{:.3f}"),
           ("x floor", "x_floor", "{:.2f}x"), ("marginal CPU-s per GB", "marginal_cpu_s_per_gb", "{:.3f}"),
           ("scaling (wall 1 / wall 2)", "scaling", "{:.2f}x"),
           ("hub CPU-s per GB", "server_cpu_s_per_gb", "{:.3f}"), ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_cost")
    ap.add_argument("--workers", default="1,2", help="worker counts, comma-separated [default: 1,2]")
    ap.add_argument("--works", default=",".join(WORKS), help=f"comma-separated, of: {', '.join(WORKS)}")
    ap.add_argument("--no-pin", action="store_true", help="do not pin an N-worker run to N CPUs")
    ap.add_argument("--fixed-shape", default="k3-tiny",
                    help="the shape whose runs give each work's fixed CPU-s ('' for none) [default: k3-tiny]")
    args = ap.parse_args()
    workers = sorted({int(w) for w in args.workers.split(",") if w})
    works = [w for w in args.works.split(",") if w]
    if not set(works) <= set(WORKS) or not workers or min(workers) < 1:
        raise SystemExit(f"--works of {', '.join(WORKS)}; --workers >= 1")
    setup = bl.start("bench_cost", args)
    if not args.no_pin and max(workers) > len(os.sched_getaffinity(0)):
        raise SystemExit(f"--workers {max(workers)}: only {len(os.sched_getaffinity(0))} CPUs to pin to")
    speed = setup.machine["openssl_sha256_gb_per_s_per_core"] * bl.GB
    sha = bl.GB / speed
    shapes = {name: setup.shape(name, manifest=True) for name in setup.shapes}
    tiny = setup.shape(args.fixed_shape, manifest=True) if args.fixed_shape else None
    served = {f"bench/{n}": s.path for n, s in shapes.items()}
    if tiny is not None:
        served[f"bench/{tiny.name}"] = tiny.path
    rows: list[dict[str, Any]] = []
    fixed_rows: list[dict[str, Any]] = []
    tables = []
    with bl.Hub(served, setup.work) as hub:
        if tiny is not None:
            print(f"\n{tiny.name} (fixed costs)", flush=True)
            cs = contenders(setup, tiny, hub, works, workers, not args.no_pin, floors=False)
            fixed_rows = cost_rows(cs, bl.summarize_all(bl.interleave(cs, args.runs, setup.cache, server=hub)), sha)
        for shape in shapes.values():
            print(f"\n{shape.name}", flush=True)
            cs = contenders(setup, shape, hub, works, workers, not args.no_pin)
            res = bl.summarize_all(bl.interleave(cs, args.runs, setup.cache, server=hub))
            shape_rows = cost_rows(cs, res, sha)
            rows += shape_rows
            tables.append(bl.Table(shape.describe(), COLUMNS, in_order(shape_rows)))
    add_marginal(rows, fixed_rows)
    if fixed_rows:
        tables.append(bl.Table(tiny.describe() + ": the fixed cost of each command (start-up, imports, planning)"
                               if tiny else "", COLUMNS[:8], in_order(fixed_rows)))
    cost = cost_summary(rows, sha, speed)
    floor = cost["floor"]
    notes = (f"Floor per GB = sha256 at OpenSSL speed ({floor['openssl_sha256_gb_per_s_per_core']:.2f} GB/s per core: "
             f"{floor['sha256_cpu_s_per_gb']:.3f} CPU-s) + the copy: read {floor['read_copy_cpu_s_per_gb'] or 0:.3f} "
             f"(verify), write {floor['write_copy_cpu_s_per_gb'] or 0:.3f} (reshard), receive "
             f"{floor['receive_copy_cpu_s_per_gb'] or 0:.3f} (fetch, node_fetch) CPU-s per GB; measured read + hash "
             f"(`openssl dgst`): {floor['sha256_read_cpu_s_per_gb'] or 0:.3f}. `x floor` = CPU-s per GB over the floor.")
    summary = bl.Table("Cost per GB, for a cost model (the largest of the shapes at the most workers)",
                       [("work", "work", "`{}`"), ("of", "basis", "{}"), ("CPU-s per GB", "cpu_s_per_gb", "{:.3f}"),
                        ("fixed CPU-s", "fixed_cpu_s", "{:.2f}"),
                        ("marginal CPU-s per GB", "marginal_cpu_s_per_gb", "{:.3f}"),
                        ("floor", "floor_cpu_s_per_gb", "{:.3f}"), ("x floor", "x_floor", "{:.2f}x"),
                        ("x floor (marginal)", "x_floor_marginal", "{:.2f}x"), ("scaling", "scaling", "{}")],
                       [{"work": w, "basis": c["basis"], "cpu_s_per_gb": c["cpu_s_per_gb"], "fixed_cpu_s": c["fixed_cpu_s"],
                         "marginal_cpu_s_per_gb": c["marginal_cpu_s_per_gb"], "x_floor_marginal": c["x_floor_marginal"],
                         "floor_cpu_s_per_gb": c["floor_cpu_s_per_gb"], "x_floor": c["x_floor"],
                         "scaling": ", ".join(f"{k} {v:.2f}x" for k, v in c["scaling_by_shape"].items() if v)}
                        for w, c in cost.items() if w in WORKS], notes)
    bl.write_report(setup, [summary, *tables], {"cost": cost})


if __name__ == "__main__":
    main()

