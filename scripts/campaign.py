#!/usr/bin/env python3
"""The long security campaign: crash consistency and fuzzing, with counts for SECURITY.md.

    scripts/campaign.py                          # 20 kills each for fetch, reshard and a share fetch, 60 s of fuzz per target
    scripts/campaign.py --kills 50 --fuzz-seconds 300 --seed 7 --json campaign.json
    scripts/campaign.py --kills 0 --fuzz-seconds 30 --engine atheris
    scripts/campaign.py --kills 0 --fuzz-seconds 0 --output-rounds 30   # outputs only

Crash part (see k3ckpt.testing.crash): a synthetic k3-tiny checkpoint is fetched through the
loopback hub and resharded, each under ``--kills`` SIGKILLs at seeded random points, with
power-loss damage injected between runs; every kill is followed by a scan for incomplete
final-named files, and every byte is compared at the end. A rank-aware fetch (a node directory
or a partial copy) is killed too, and after every kill ``k3ckpt verify`` of the share must not
pass unless it is exactly what a clean fetch writes; after the resume it must pass. Several
seeds are run until the kill count is reached (each seed picks a hub and a topology).

Output part (``--output-rounds``, see k3ckpt.testing.crash): per round, a second reshard into
an output a first one holds (refused by the lock; the first then finishes exactly), a writing
command (reshard, unshard, synth; with or without --force) into a directory holding files
k3ckpt did not write (refused, the directory unchanged), and reshard or unshard onto a tmpfs
too small for the output (refused up front, or ENOSPC mid-run with no temporary file left; the
re-run after the tmpfs grows is exact). The tmpfs part needs root; it is skipped otherwise.

Fuzz part (see k3ckpt.testing.fuzz): every target gets ``--fuzz-seconds`` of inputs, mutated
valid documents and raw bytes. ``--engine hypothesis`` (default) or ``atheris`` (coverage
guided, if installed: ``pip install atheris``). Any exception other than the reader's own typed
error is a finding: the input is saved under ``--findings`` and the campaign exits 1.

Run it with the project's venv: ``.venv/bin/python scripts/campaign.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3ckpt.testing import (
    crash,
    fuzz,  # noqa: E402
)
from k3ckpt.testing.synth import spec_from_preset, synthesize  # noqa: E402

#: Kills per seed: each seed is one campaign (one hub or topology, one final run).
KILLS_PER_SEED = 5


def run_crash(kind: str, source: Path, work: Path, kills: int, seed: int) -> dict[str, Any]:
    """Campaigns of ``kind`` over successive seeds until ``kills`` kills; summed counts."""
    total: dict[str, Any] = {"what": kind, "seeds": [], "kills": 0, "kills_at_pause_points": 0,
                             "kills_mid_transfer": 0, "finished_before_kill": 0, "power_loss_faults": 0,
                             "stale_locks_recovered": 0, "scans": 0, "files_checked": 0, "bytes_verified": 0,
                             "fault_kinds": {}}
    s = seed
    campaign = {"fetch": crash.fetch_campaign, "reshard": crash.reshard_campaign,
                "share-fetch": crash.share_fetch_campaign}[kind]
    while total["kills"] < kills:
        d = work / f"{kind}-{s}"
        d.mkdir()
        stats = campaign(source, d, kills=min(KILLS_PER_SEED, kills - total["kills"]), seed=s).to_json()
        total["seeds"].append(s)
        for k, v in stats.items():
            if k == "fault_kinds":
                for fk, n in v.items():
                    total["fault_kinds"][fk] = total["fault_kinds"].get(fk, 0) + n
            elif isinstance(v, int) and k != "seed":
                total[k] = total.get(k, 0) + v
        s += 1
        print(f"  {kind} seed {stats['seed']}: {stats['kills']} kills, {stats['power_loss_faults']} power-loss "
              f"faults, {stats['files_checked']} final-named files checked", flush=True)
    return total


def run_outputs(work: Path, rounds: int, seed: int, report: dict[str, Any]) -> bool:
    """The three output campaigns, ``rounds`` each, into ``report["outputs_*"]``; False on a violation."""
    source = work / "k3-tiny"
    if not source.exists():
        synthesize(spec_from_preset("k3-tiny"), source)
    ok = True
    for name, campaign in (("contention", crash.contention_campaign), ("foreign", crash.foreign_campaign),
                           ("exhaustion", crash.exhaustion_campaign)):
        d = work / f"outputs-{name}"
        d.mkdir()
        print(f"outputs: {name}, {rounds} rounds", flush=True)
        try:
            report[f"outputs_{name}"] = campaign(source, d, rounds=rounds, seed=seed).to_json()
        except crash.InvariantViolation as e:
            report[f"outputs_{name}"] = {"violation": str(e)}
            print(f"VIOLATION: {e}", flush=True)
            ok = False
        except OSError as e:  # no tmpfs without root
            report[f"outputs_{name}"] = {"skipped": str(e)}
    return ok


def run_fuzz_hypothesis(target: str, seconds: float, findings: Path, seed: int) -> dict[str, Any]:
    """Hypothesis-driven fuzzing of one target for ``seconds``: half mutated valid documents,
    half raw bytes, in rounds of 200 examples with a fresh seed each."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    sys.path.insert(0, str(ROOT / "tests"))
    from test_fuzz import mutated  # the strategy the test suite uses

    count = {"cases": 0, "findings": 0}

    def check(raw: bytes) -> None:
        count["cases"] += 1
        try:
            fuzz.TARGETS[target](raw[: fuzz.MAX_INPUT])
        except Exception:
            count["findings"] += 1
            _save_finding(findings, target, raw)
            raise

    strategies = [mutated(target), st.binary(max_size=2048)]
    for strategy in strategies:
        deadline = time.monotonic() + seconds / len(strategies)
        rounds = 0
        while time.monotonic() < deadline:
            rounds += 1

            @hseed(seed * 100_003 + rounds)
            @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(strategy)
            def prop(raw: bytes) -> None:
                check(raw)

            try:
                prop()
            except Exception:  # noqa: BLE001 - a finding: saved by check(), reported, campaign fails
                traceback.print_exc()
                return count
    return count


def run_fuzz_atheris(target: str, seconds: float, findings: Path, seed: int) -> dict[str, Any]:
    """Coverage-guided fuzzing of one target with atheris, in a child process (atheris owns the
    process: it exits when done), for ``seconds``."""
    import subprocess

    corpus = findings / f"corpus-{target}"
    corpus.mkdir(parents=True, exist_ok=True)
    seed_doc = fuzz.SEEDS["header" if target == "header_file" else target]
    raw = fuzz.encode(seed_doc)
    (corpus / "seed").write_bytes(fuzz.header_bytes_from_file(raw) if target == "header_file" else raw)
    code = (
        "import sys, atheris\n"
        "with atheris.instrument_imports():\n"
        "    from k3ckpt.testing import fuzz\n"
        f"atheris.Setup(sys.argv, lambda data: fuzz.TARGETS[{target!r}](data[:fuzz.MAX_INPUT]))\n"
        "atheris.Fuzz()\n"
    )
    cmd = [sys.executable, "-c", code, f"-max_total_time={int(seconds)}", f"-seed={seed}",
           f"-artifact_prefix={findings}/{target}-", "-print_final_stats=1", str(corpus)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    runs = 0
    for line in res.stderr.splitlines():
        if "stat::number_of_executed_units" in line:
            runs = int(line.split(":")[-1])
    return {"cases": runs, "findings": 0 if res.returncode == 0 else 1,
            **({"log_tail": res.stderr[-800:]} if res.returncode else {})}


def _save_finding(findings: Path, target: str, raw: bytes) -> None:
    findings.mkdir(parents=True, exist_ok=True)
    (findings / f"{target}-{int(time.time() * 1e6)}.bin").write_bytes(raw)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs for fetch, reshard and a share fetch (each) [20]")
    ap.add_argument("--output-rounds", type=int, default=10,
                    help="rounds of each output campaign: lock, foreign directory, full tmpfs [10]")
    ap.add_argument("--fuzz-seconds", type=float, default=60.0, help="seconds of fuzzing per target [60]")
    ap.add_argument("--engine", choices=["hypothesis", "atheris"], default="hypothesis")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--findings", type=Path, default=ROOT / "campaign-findings",
                    help="where failing fuzz inputs are saved [./campaign-findings]")
    ap.add_argument("--json", dest="json_out", type=Path, help="also write the counts as JSON here")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
    t0 = time.monotonic()
    report: dict[str, Any] = {"seed": args.seed, "kills_requested": args.kills, "fuzz_seconds": args.fuzz_seconds,
                              "engine": args.engine}
    ok = True
    with tempfile.TemporaryDirectory(prefix="k3ckpt-campaign-") as tmp:
        work = Path(tmp)
        if args.kills:
            source = work / "k3-tiny"
            synthesize(spec_from_preset("k3-tiny"), source)
            report["source_bytes"] = sum(p.stat().st_size for p in source.iterdir())
            for kind in ("fetch", "reshard", "share-fetch"):
                print(f"crash: {kind}, {args.kills} kills", flush=True)
                try:
                    report[f"crash_{kind}"] = run_crash(kind, source, work, args.kills, args.seed)
                except crash.InvariantViolation as e:
                    report[f"crash_{kind}"] = {"violation": str(e)}
                    print(f"VIOLATION: {e}", flush=True)
                    ok = False
        if args.output_rounds:
            ok = run_outputs(work, args.output_rounds, args.seed, report) and ok
        if args.fuzz_seconds > 0:
            report["fuzz"] = {}
            engine = run_fuzz_atheris if args.engine == "atheris" else run_fuzz_hypothesis
            for target in sorted(fuzz.TARGETS):
                print(f"fuzz: {target}, {args.fuzz_seconds:.0f} s ({args.engine})", flush=True)
                counts = engine(target, args.fuzz_seconds, args.findings, args.seed)
                report["fuzz"][target] = counts
                print(f"  {counts['cases']} cases, {counts['findings']} findings", flush=True)
                ok = ok and counts["findings"] == 0
    report["ok"] = ok
    report["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report, indent=2, sort_keys=True)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
