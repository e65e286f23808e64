#!/usr/bin/env python
"""Fixed cost of every command (#28: <= 0.15 s from launch to the first byte of work): each
command on ``k3-tiny`` (6 MB, so its bytes take no time), warm, pinned to one CPU, with the
loopback hub on another, in ``--runs`` interleaved rounds.

    .venv/bin/python scripts/bench_start.py [--work work/bench_start] [--runs 9]

Two figures per command, medians [range of the rounds]:

- **to first byte**: for a fetch, launch to the hub's arrival of the first ``Range`` request of
  a safetensors file (the hub runs in this process: ``RequestRecord.started`` and the launch
  are both ``time.monotonic()``); for a local command, launch to its first read of a tensor
  byte, from ``strace -f -ttt`` (the first read, kernel copy or mapping that reaches past a
  file's header) in a second, traced run of the round - strace slows a Python start by
  ~0.05-0.08 s, so that is an upper bound, and so is the untraced run's exit (the first byte
  comes before it): the lower of the two is reported (launch to exit where strace is missing);
- **launch to exit**: the whole untraced run's wall - the ceiling of the fixed cost, since the
  tiny checkpoint's bytes take about nothing.

Beside them: ``python -c pass`` and ``k3ckpt --version``, what any Python CLI pays to start.
The package is byte-compiled first and the commands run without ``PYTHONDONTWRITEBYTECODE``, as
an installed k3ckpt starts (compiling every module on each launch added ~0.05-0.15 s).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib as bl

from k3ckpt.format import open_checkpoint
from k3ckpt.testing import LoopbackHub

REPO = "bench/k3-tiny"
#: What any Python CLI pays to start, beside the commands (no first byte of work of their own).
FLOORS = ("python -c pass", "k3ckpt --version")
NODE = ["--tp", "2", "--dp", "2", "--gpus-per-node", "2", "--node", "0"]


def commands(src: Path, out: Path, manifest: Path, url: str) -> dict[str, tuple[list[str], bool]]:
    """label -> (argv, reads the hub)."""
    fetch = [*bl.K3, "fetch", REPO, "--endpoint", url, "--local-dir", str(out)]
    return {
        "python -c pass": ([sys.executable, "-c", "pass"], False),
        "k3ckpt --version": ([*bl.K3, "--version"], False),
        "verify --manifest M --no-cache": ([*bl.K3, "verify", str(src), "--manifest", str(manifest), "--no-cache"], False),
        "reshard --format rank --ep 4": ([*bl.K3, "reshard", str(src), "-o", str(out), "--ep", "4"], False),
        "reshard --node 0 (node format)": ([*bl.K3, "reshard", str(src), "-o", str(out), *NODE], False),
        "preflight": ([*bl.K3, "preflight", "--no-env", str(src)], False),
        "fetch": (fetch, True),
        "fetch --node 0": ([*fetch, *NODE], True),
    }


#: ``PID SECONDS syscall(args) = result`` (``strace -f -ttt -s 0``; no PID without ``-f``).
_LINE = re.compile(r"^(?:\d+\s+)?(\d+\.\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\w+)")
TRACED = "trace=openat,read,pread64,preadv,mmap,copy_file_range"


def first_tensor_read(trace: str, t0: float, data_start: dict[str, int]) -> float | None:
    """Seconds from ``t0`` (wall clock) to the first access of a tensor byte of a safetensors file
    in an ``strace -f -ttt -s 0 -e`` :data:`TRACED` log: a read, pread or kernel copy reaching past
    the file's header, or a mapping of it."""
    fds: dict[str, str] = {}
    pos: dict[str, int] = {}
    for line in trace.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        ts, call, argstr, result = float(m.group(1)), m.group(2), m.group(3), m.group(4)
        args = [a.strip() for a in argstr.split(",")]
        if call == "openat":
            name = os.path.basename(argstr.split('"')[1]) if '"' in argstr else ""
            if name in data_start and result.isdigit():
                fds[result], pos[result] = name, 0
            elif result.isdigit():
                fds.pop(result, None)  # the number now names another file
            continue
        fd = args[0] if call != "mmap" else (args[4] if len(args) > 4 else "")
        if fd not in fds or not result.lstrip("-").isalnum() or result.startswith("-"):
            continue
        header_end = data_start[fds[fd]]
        if call == "mmap":
            return ts - t0
        if call == "read":
            pos[fd] += int(result)
            if pos[fd] > header_end:
                return ts - t0
        elif call in ("pread64", "preadv"):
            if int(args[-1]) + int(result) > header_end:
                return ts - t0
        elif call == "copy_file_range":
            off = re.search(r"\[(\d+)\]", args[1])
            if off is None or int(off.group(1)) + int(result) > header_end:
                return ts - t0
    return None


def run_once(argv: list[str], out: Path, env: dict[str, str], client: list[int], hub: LoopbackHub,
             starts: dict[str, int], *, remote: bool = False, strace: str | None = None,
             trace_file: Path | None = None) -> tuple[float, float | None]:
    """One run pinned to ``client``'s CPU into an emptied ``out``: ``(launch to exit, launch to
    first byte)``. The first byte is the hub's first ``Range`` request of a safetensors file
    (``remote``), the first tensor byte read in an ``strace`` log (``strace``), else the exit."""
    shutil.rmtree(out, ignore_errors=True)
    run = [strace, "-f", "-ttt", "-s", "0", "-e", TRACED, "-o", str(trace_file), *argv] if strace else argv
    seen = len(hub.request_log)
    t0 = time.monotonic()
    t0_wall = time.time()
    p = subprocess.run(run, env=env, cwd=bl.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       preexec_fn=lambda: os.sched_setaffinity(0, client))
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.decode()[-2000:]}")
    if remote:
        got = [r.started for r in hub.request_log[seen:] if r.file and r.file.endswith(".safetensors") and r.range]
        return wall, (min(got) - t0 if got else None)
    if strace and trace_file is not None:
        return wall, first_tensor_read(trace_file.read_text(), t0_wall, starts)
    return wall, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, "bench_start", runs=9)
    ap.set_defaults(shapes="k3-tiny")
    args = ap.parse_args()
    setup = bl.start("bench_start", args)
    shape = setup.shape("k3-tiny", manifest=True)
    assert shape.manifest is not None
    starts = {name: sh.data_start for name, sh in open_checkpoint(shape.path).shards.items()}
    strace = shutil.which("strace")
    cpus = sorted(os.sched_getaffinity(0))
    client, hub_cpus = cpus[:1], cpus[1:] or cpus
    os.sched_setaffinity(0, hub_cpus)  # this process serves the hub's threads; the commands get CPU 0
    out = setup.work / "out"
    samples: dict[str, dict[str, list[float]]] = {}
    with LoopbackHub({REPO: shape.path}, cache_dir=setup.work / "hub-cache") as hub:
        env = {**hub.client_env(os.environ), "K3CKPT_CACHE_DIR": str(setup.work / "k3ckpt-cache")}
        # Bytecode as an installed package has it (pip compiles on install): a shell or test
        # run's PYTHONDONTWRITEBYTECODE would otherwise add a compile of every module to each run.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(bl.ROOT / "k3ckpt")], check=True,
                       stdout=subprocess.DEVNULL)
        cmds = commands(shape.path, out, shape.manifest, hub.url)
        for i in range(args.runs):
            for k in bl.round_order(len(cmds), i):
                label, (argv, remote) = list(cmds.items())[k]
                traced = strace is not None and not remote and label not in FLOORS
                wall, first = run_once(argv, out, env, client, hub, starts, remote=remote)
                if traced:
                    # the traced run's first byte is late by strace's slowdown; the untraced run's
                    # exit bounds it too (a command reads its first byte before it exits): the
                    # lower of the two bounds
                    assert strace is not None
                    _, traced_first = run_once(argv, out, env, client, hub, starts, strace=strace,
                                               trace_file=setup.work / "trace.txt")
                    first = wall if traced_first is None else min(traced_first, wall)
                s = samples.setdefault(label, {"wall": [], "first": []})
                s["wall"].append(wall)
                if first is not None:
                    s["first"].append(first)
            print(f"round {i + 1} done", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    for label, s in samples.items():
        first = s["first"]
        rows.append({"command": label, "first_s": statistics.median(first) if first else None,
                     "first_range": [min(first), max(first)] if first else None,
                     "wall_s": statistics.median(s["wall"]), "wall_range": [min(s["wall"]), max(s["wall"])],
                     "target": "-" if label in FLOORS else
                     ("yes" if first and statistics.median(first) <= 0.15 else "no")})
    table = bl.Table("Launch to the first byte of work, and to exit, on k3-tiny (one CPU; median of the rounds "
                     "[range])", [("command", "command", "`{}`"), ("to first byte (s)", "first_s", "{:.3f}"),
                                  ("range", "first_range", "{0[0]:.3f}-{0[1]:.3f}"),
                                  ("launch to exit (s)", "wall_s", "{:.3f}"),
                                  ("range ", "wall_range", "{0[0]:.3f}-{0[1]:.3f}"),
                                  ("<= 0.15 s", "target", "{}")], rows,
                     notes="a local command's first byte: the lower of two upper bounds, its first tensor byte under "
                     "strace (which slows it) and its untraced run's exit"
                     if strace else "no strace here: local commands' first byte is their exit")
    bl.write_report(setup, [table])


if __name__ == "__main__":
    main()
