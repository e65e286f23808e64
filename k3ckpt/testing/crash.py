"""Crash-consistency harness: ``k3ckpt fetch`` and ``k3ckpt reshard`` under SIGKILL at seeded
random points, with power-loss style damage between runs, then re-run to completion.

After every kill the harness scans the output and checks the invariant that matters: **no file
under its final name is ever incomplete or wrong** (each is compared with the source, or with a
clean reference run for reshard). For fetch it also checks that every chunk a journal vouches
for holds the source's bytes (a SIGKILL loses nothing that was fsync-ed). At the end, every
output byte is compared with the reference and no working file may be left.

Power-loss damage (what a crash that loses unsynced page cache could leave) is injected between
runs at random: bytes of a chunk the journal lists as done are flipped (the journal reached
the disk, the data did not), a journal is replaced by garbage, a ``.part`` is truncated, a
final-named rank file is cut short. A resumed run must *validate* its journals rather than
believe them: the final bytes must still be exact.

Used by ``tests/test_crash.py`` (a few kills) and ``scripts/campaign.py`` (many).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..env import K3CKPT_TEST_PAUSE_AT, K3CKPT_TEST_PAUSE_FILE

__all__ = ["CrashStats", "InvariantViolation", "fetch_campaign", "reshard_campaign", "share_fetch_campaign"]

REPO = "moonshotai/Kimi-K3"
#: Small chunks so a small checkpoint has many resume points.
CHUNK = 64 * 1024
_PAUSE_TIMEOUT = 60.0


class InvariantViolation(AssertionError):
    """A crash left something it must never leave (the message says what and where)."""


@dataclass
class CrashStats:
    """What a campaign did.

    Attributes:
        kills: SIGKILLs delivered to a running child.
        kills_at_pause_points: ... of which at an exact point (fetch: after chunk N, before a
            rename; reshard: after the K-th rank file was renamed into place).
        kills_mid_transfer: ... of which at a random byte count in the middle of a transfer.
        finished_before_kill: runs that completed before their kill point was reached.
        power_loss_faults: damage injected between runs (flipped journaled bytes, garbage
            journals, truncated parts, cut final files).
        stale_locks_recovered: runs that started while a killed run's lock file was present.
        scans: invariant scans after kills (each compares every final-named file).
        files_checked: final-named files compared over all scans.
        bytes_verified: bytes compared with the reference at the end.
        verify_refused: ``k3ckpt verify`` runs on a killed share that did not pass (share campaign).
        verify_passed: ``k3ckpt verify`` runs on a share that passed; each is compared byte for
            byte with a clean fetch (a pass on anything else is a violation).
    """

    what: str
    seed: int
    kills: int = 0
    kills_at_pause_points: int = 0
    kills_mid_transfer: int = 0
    finished_before_kill: int = 0
    power_loss_faults: int = 0
    stale_locks_recovered: int = 0
    scans: int = 0
    files_checked: int = 0
    bytes_verified: int = 0
    verify_refused: int = 0
    verify_passed: int = 0
    fault_kinds: dict[str, int] = field(default_factory=dict)

    def fault(self, kind: str) -> None:
        self.power_loss_faults += 1
        self.fault_kinds[kind] = self.fault_kinds.get(kind, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for var in (K3CKPT_TEST_PAUSE_AT.name, K3CKPT_TEST_PAUSE_FILE.name, "HF_TOKEN"):
        env.pop(var, None)
    env.update(extra)
    env.setdefault("HF_HUB_DISABLE_XET", "1")
    return env


def _wait_exit_or_kill(proc: subprocess.Popen[bytes], ready: Callable[[], bool], timeout: float = _PAUSE_TIMEOUT) -> bool:
    """Wait for ``ready()`` then SIGKILL (True), or for the child to exit first (False)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise InvariantViolation(f"child neither reached its kill point nor exited in {timeout} s")
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def _run_until_killed(args: list[str], env: dict[str, str], ready: Callable[[], bool], at_point: bool, stats: CrashStats) -> bool:
    """Start the command and SIGKILL it once ``ready()``; True if killed, False if it finished
    first (successfully: a failure is a violation)."""
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if _wait_exit_or_kill(proc, ready):
        stats.kills += 1
        stats.kills_at_pause_points += at_point
        stats.kills_mid_transfer += not at_point
        return True
    stats.finished_before_kill += 1
    if proc.returncode != 0:
        assert proc.stderr is not None  # started with stderr=PIPE
        raise InvariantViolation(f"{' '.join(args[2:4])} exited {proc.returncode}: {proc.stderr.read().decode()[-500:]}")
    return False


# ----------------------------------------------------------------------------------------------
# fetch
# ----------------------------------------------------------------------------------------------


def scan_fetch(dest: Path, served: Path, stats: CrashStats) -> None:
    """Final names hold exact source files; journaled chunks hold exact source bytes."""
    stats.scans += 1
    for p in dest.rglob("*"):
        if not p.is_file():
            continue
        rel = p.relative_to(dest).as_posix()
        if p.name.endswith(".part.journal"):
            _check_journal(p, served / rel[: -len(".part.journal")], stats)
            continue
        if p.name.endswith((".part", ".tmp")) or p.name.startswith(".k3ckpt-fetch.lock"):
            continue
        if any(d.startswith(".") for d in p.relative_to(dest).parts[:-1]):
            # hidden metadata (fetch's .cache/k3ckpt/source.json): not a source file, but never
            # half-written either
            try:
                json.loads(p.read_bytes())
            except ValueError as e:
                raise InvariantViolation(f"{p}: metadata under its final name is not whole JSON ({e})") from None
            continue
        stats.files_checked += 1
        src = served / rel
        if not src.is_file() or p.stat().st_size != src.stat().st_size or _sha(p) != _sha(src):
            raise InvariantViolation(f"{p}: under its final name but not the source's bytes")


def _check_journal(journal: Path, src: Path, stats: CrashStats) -> None:
    try:
        doc = json.loads(journal.read_text())
    except ValueError as e:
        raise InvariantViolation(f"{journal}: a journal under its final name is not valid JSON ({e})") from None
    part = Path(str(journal)[: -len(".journal")])
    if not part.exists():
        return
    size = doc["chunk_size"]
    with open(part, "rb") as pf, open(src, "rb") as sf:
        for i in doc["done"]:
            pf.seek(i * size)
            sf.seek(i * size)
            if pf.read(size) != sf.read(size):
                raise InvariantViolation(f"{journal}: chunk {i} is journaled as done but {part} does not hold it")


def _damage_fetch(dest: Path, rng: random.Random, stats: CrashStats) -> bool:
    """Power-loss style damage to the resume state (see the module docstring); True if done."""
    journals = sorted(dest.rglob("*.part.journal"))
    if not journals:
        return False
    journal = rng.choice(journals)
    part = Path(str(journal)[: -len(".journal")])
    kind = rng.choice(["flip-journaled-bytes", "garbage-journal", "truncate-part"])
    try:
        doc = json.loads(journal.read_text())
    except ValueError:
        return False
    if kind == "flip-journaled-bytes" and doc.get("done") and part.exists():
        i = rng.choice(doc["done"])
        off = i * doc["chunk_size"] + rng.randrange(min(doc["chunk_size"], max(1, part.stat().st_size - i * doc["chunk_size"])))
        with open(part, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]) if b else b"\xff")
    elif kind == "garbage-journal":
        journal.write_bytes(rng.randbytes(rng.randrange(1, 64)))
    elif kind == "truncate-part" and part.exists() and part.stat().st_size:
        os.truncate(part, rng.randrange(part.stat().st_size))
    else:
        return False
    stats.fault(kind)
    return True


def fetch_campaign(served: Path, work: Path, *, kills: int, seed: int, power_loss: float = 0.3,
                   hub_cache: Path | None = None) -> CrashStats:
    """Fetch ``served`` (through a loopback hub) into ``work/dest`` with ``kills`` SIGKILLs at
    seeded random points, then to completion; raise :class:`InvariantViolation` on a breach.

    Half the kills land at exact points of the downloader (after the N-th journaled chunk,
    before a rename: ``K3CKPT_TEST_PAUSE_AT``), half at a random byte count mid-transfer.
    """
    from .hub import LoopbackHub

    rng = random.Random(seed)
    stats = CrashStats("fetch", seed)
    dest = work / "dest"
    total = sum(p.stat().st_size for p in served.rglob("*") if p.is_file())
    nchunks = sum(max(1, -(-p.stat().st_size // CHUNK)) for p in served.rglob("*") if p.is_file())
    with LoopbackHub({REPO: served}, cache_dir=hub_cache or work / "hub-cache") as hub:
        args = [sys.executable, "-m", "k3ckpt", "fetch", "--source", rng.choice(["hf", "modelscope"]), "--repo", REPO,
                "--dest", str(dest), "--endpoint", hub.url, "--chunk-size", str(CHUNK), "--workers", "3"]
        env = _child_env(hub.env_vars())
        while stats.kills < kills:
            if (dest / ".k3ckpt-fetch.lock").exists():
                stats.stale_locks_recovered += 1
            marker = work / "paused"
            marker.unlink(missing_ok=True)
            at_point = rng.random() < 0.5
            child_env = dict(env)
            ready: Callable[[], bool]
            if at_point:
                point = "before_rename" if rng.random() < 0.2 else f"after_chunk:{rng.randrange(1, max(2, nchunks // 2))}"
                child_env.update({K3CKPT_TEST_PAUSE_AT.name: point, K3CKPT_TEST_PAUSE_FILE.name: str(marker)})
                ready = marker.exists
            else:
                start = hub.total_bytes_sent()
                threshold = start + rng.randrange(1, max(2, total))

                # a def, not a lambda: mypy cannot type a lambda with a default argument as Callable[[], bool]
                def ready(threshold: int = threshold) -> bool:
                    return hub.total_bytes_sent() >= threshold

            killed = _run_until_killed(args, child_env, ready, at_point, stats)
            _after_kill(killed, args, env, dest, stats, scan=lambda: scan_fetch(dest, served, stats),
                        damage=lambda: rng.random() < power_loss and _damage_fetch(dest, rng, stats), reference=served)
        _complete(args, env, dest, stats)
    _compare_trees(dest, served, stats)
    return stats


def _after_kill(killed: bool, args: list[str], env: dict[str, str], out: Path, stats: CrashStats, *,
                scan: Callable[[], None], damage: Callable[[], bool], reference: Path | dict[str, str]) -> None:
    """After one run: check the invariants of what it left (``scan``). A run that ended before its
    kill point is started over, so that the next kills land mid-run again; a killed one is
    sometimes damaged as a power loss would (``damage``), and then the restart must repair it:
    run to the end, compare with the reference, start over."""
    scan()
    if not killed:
        shutil.rmtree(out)
    elif damage():
        _complete(args, env, out, stats)
        _compare_trees(out, reference, stats)
        shutil.rmtree(out)


def _complete(args: list[str], env: dict[str, str], out: Path, stats: CrashStats) -> None:
    """Run a command to its end; it must succeed."""
    if (out / ".k3ckpt-fetch.lock").exists():
        stats.stale_locks_recovered += 1
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise InvariantViolation(f"{' '.join(args[2:4])} failed after a crash ({res.returncode}): "
                                 f"{res.stdout[-500:]} {res.stderr[-500:]}")


# ----------------------------------------------------------------------------------------------
# reshard
# ----------------------------------------------------------------------------------------------


def _digests(root: Path) -> dict[str, str]:
    """sha256 of every file of the tree, except the hidden metadata directories a checkpoint
    may carry (``.cache/k3ckpt/source.json`` that fetch records, ``.cache/huggingface``)."""
    return {p.relative_to(root).as_posix(): _sha(p) for p in sorted(root.rglob("*"))
            if p.is_file() and not any(d.startswith(".") for d in p.relative_to(root).parts[:-1])}


def _compare_trees(got: Path, want: Path | dict[str, str], stats: CrashStats) -> None:
    ref = _digests(want) if isinstance(want, Path) else want
    now = _digests(got)
    if now != ref:
        extra = sorted(now.keys() - ref.keys())
        missing = sorted(ref.keys() - now.keys())
        wrong = sorted(k for k in now.keys() & ref.keys() if now[k] != ref[k])
        raise InvariantViolation(f"{got}: after the final run: extra {extra[:5]}, missing {missing[:5]}, "
                                 f"wrong {wrong[:5]}")
    stats.bytes_verified += sum((got / k).stat().st_size for k in now)


def _allocated(root: Path) -> int:
    n = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                n += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return n


def scan_reshard(out: Path, ref: dict[str, str], stats: CrashStats) -> None:
    """Every final-named file is the reference's; a rank with READY is complete."""
    stats.scans += 1
    for p in out.rglob("*"):
        if not p.is_file() or p.name.startswith("."):
            continue  # temporary names are hidden (".<name>.tmp")
        rel = p.relative_to(out).as_posix()
        stats.files_checked += 1
        if rel not in ref or _sha(p) != ref[rel]:
            raise InvariantViolation(f"{p}: under its final name but not what a clean run writes")
    for rdir in out.glob("rank-*"):
        if (rdir / "READY").exists():
            want = {k for k in ref if k.startswith(rdir.name + "/")}
            have = {p.relative_to(out).as_posix() for p in rdir.iterdir() if not p.name.startswith(".")}
            if want != have:
                raise InvariantViolation(f"{rdir}: READY, but missing {sorted(want - have)[:3]}")


def _damage_reshard(out: Path, rng: random.Random, stats: CrashStats) -> bool:
    """Cut a final-named rank file short (data renamed into place, then lost with the cache)."""
    parts = sorted(p for p in out.glob("rank-*/*.safetensors") if p.stat().st_size)
    if not parts:
        return False
    p = rng.choice(parts)
    os.truncate(p, rng.randrange(p.stat().st_size))
    stats.fault("cut-final-rank-file")
    return True


def reshard_campaign(source: Path, work: Path, *, kills: int, seed: int, power_loss: float = 0.3) -> CrashStats:
    """Reshard ``source`` into ``work/out`` with ``kills`` SIGKILLs at seeded random points
    (a random number of bytes allocated in the output, or just after the K-th rank file is
    renamed into place), then to completion, comparing with a clean reference run; raise
    :class:`InvariantViolation` on a breach.

    A cut final-named file is the one thing a re-run cannot tell from its manifest without
    reading it, when its size is unchanged; the damage here changes the size, which the
    re-run's check (READY + manifest + sizes) catches and redoes the rank.
    """
    rng = random.Random(seed)
    stats = CrashStats("reshard", seed)
    topo = rng.choice([["--ep", "2"], ["--ep", "4"], ["--tp", "2"], ["--ep", "2", "--tp", "2", "--world-size", "2"]])
    common = [sys.executable, "-m", "k3ckpt", "reshard", str(source), "--format", "rank", *topo, "--max-file-size", "256KiB",
              "--jobs", "2"]
    ref_dir = work / "reference"
    res = subprocess.run([*common, "-o", str(ref_dir)], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise InvariantViolation(f"reference reshard failed: {res.stderr[-500:]}")
    ref = _digests(ref_dir)
    total = _allocated(ref_dir)
    parts = sum(1 for k in ref if k.endswith(".safetensors"))
    out = work / "out"
    args = [*common, "-o", str(out)]
    env = _child_env({})
    while stats.kills < kills:
        # Half the kills at a random number of bytes written; half just after the K-th rank file
        # is renamed into place (renames cluster at the end of a rank, where bytes rarely land).
        at_point = rng.random() < 0.5
        if at_point:
            k = rng.randrange(1, max(2, parts))
            ready = lambda k=k: out.exists() and len(list(out.glob("rank-*/[!.]*.safetensors"))) >= k  # noqa: E731
        else:
            threshold = rng.randrange(1, max(2, total))
            ready = lambda threshold=threshold: out.exists() and _allocated(out) >= threshold  # noqa: E731
        killed = _run_until_killed(args, env, ready, at_point, stats)
        _after_kill(killed, args, env, out, stats, scan=lambda: scan_reshard(out, ref, stats),
                    damage=lambda: rng.random() < power_loss and _damage_reshard(out, rng, stats), reference=ref)
    _complete(args, env, out, stats)
    _compare_trees(out, ref, stats)
    return stats


# ----------------------------------------------------------------------------------------------
# a rank-aware fetch's share, and verify
# ----------------------------------------------------------------------------------------------

#: The rank-aware fetches the share campaign picks from, one per seed: node 1 of an EP-4 node
#: directory over 2-GPU nodes, and node 0's partial copy under EP 8 x TP 2 over 4-GPU nodes.
SHARE_FETCHES = (("--ep", "4", "--gpus-per-node", "2", "--node", "1"),
                 ("--ep", "8", "--tp", "2", "--gpus-per-node", "4", "--node", "0", "--format", "partial"))
#: Small requests, so a kill lands between many journaled pieces.
SHARE_CHUNK = 16 * 1024


def share_fetch_campaign(served: Path, work: Path, *, kills: int, seed: int, hub_cache: Path | None = None) -> CrashStats:
    """A rank-aware fetch of ``served`` (a node directory or a partial copy, chosen by the seed)
    under ``kills`` SIGKILLs at seeded random points, each followed by ``k3ckpt verify`` of the
    destination against the checkpoint's tensor-hash manifest; then a run to completion, which
    must verify clean.

    The invariant: ``verify`` passes only on a share that is byte for byte what a clean fetch
    writes - never on one a kill left unfinished (it has no marker yet: "an unfinished fetch").
    Kill points: after the N-th journaled piece, before a shard's rename, or a random byte count.
    """
    from ..integrity.manifest import build_manifest
    from .hub import LoopbackHub

    rng = random.Random(seed)
    stats = CrashStats("share-fetch", seed)
    manifest = work / "tensors.json"
    build_manifest(served, tensor_hashes=True).save(manifest)
    topo = rng.choice(SHARE_FETCHES)
    with LoopbackHub({REPO: served}, cache_dir=hub_cache or work / "hub-cache") as hub:
        base = [sys.executable, "-m", "k3ckpt", "fetch", "--source", rng.choice(["hf", "modelscope"]), "--repo", REPO,
                "--endpoint", hub.url, "--chunk-size", str(SHARE_CHUNK), "--workers", "3", *topo]
        env = _child_env(hub.env_vars())
        reference = work / "reference"
        start = hub.total_bytes_sent()
        _complete([*base, "--dest", str(reference)], env, reference, stats)
        total = hub.total_bytes_sent() - start
        ref = _digests(reference)
        dest = work / "dest"
        args = [*base, "--dest", str(dest)]
        verify = [sys.executable, "-m", "k3ckpt", "verify", str(dest), "--manifest", str(manifest), "--no-cache"]
        while stats.kills < kills:
            if (dest / ".k3ckpt-fetch.lock").exists():
                stats.stale_locks_recovered += 1
            marker = work / "paused"
            marker.unlink(missing_ok=True)
            at_point = rng.random() < 0.5
            child_env = dict(env)
            ready: Callable[[], bool]
            if at_point:
                point = "before_shard_rename" if rng.random() < 0.2 else f"after_piece:{rng.randrange(1, 40)}"
                child_env.update({K3CKPT_TEST_PAUSE_AT.name: point, K3CKPT_TEST_PAUSE_FILE.name: str(marker)})
                ready = marker.exists
            else:
                threshold = hub.total_bytes_sent() + rng.randrange(1, max(2, total))

                def ready(threshold: int = threshold) -> bool:  # a def: mypy cannot type a defaulted lambda
                    return hub.total_bytes_sent() >= threshold

            killed = _run_until_killed(args, child_env, ready, at_point, stats)
            _verify_share(verify, env, dest, ref, stats, must_pass=not killed)
            if not killed:  # finished before its kill point: start over, so the next kill lands mid-run
                shutil.rmtree(dest)
        _complete(args, env, dest, stats)
        _verify_share(verify, env, dest, ref, stats, must_pass=True)
    return stats


def _verify_share(verify: list[str], env: dict[str, str], dest: Path, ref: dict[str, str], stats: CrashStats, *,
                  must_pass: bool) -> None:
    """Run ``k3ckpt verify`` on the share: a pass must be a complete, exact share; a refusal must
    not happen on a finished one."""
    res = subprocess.run(verify, env=env, capture_output=True, text=True, timeout=600)
    passed = res.returncode == 0 and res.stdout.startswith("ok: ")
    if passed:
        stats.verify_passed += 1
        _compare_trees(dest, ref, stats)  # "ok" on anything but a clean fetch's bytes is a violation
    elif must_pass:
        raise InvariantViolation(f"verify of the finished share {dest} did not pass ({res.returncode}): "
                                 f"{res.stdout[-500:]} {res.stderr[-500:]}")
    else:
        stats.verify_refused += 1


def main_selftest() -> None:  # pragma: no cover - a quick manual check
    """``python -m k3ckpt.testing.crash``: one small campaign of each kind."""
    from .synth import spec_from_preset, synthesize

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "src"
        synthesize(spec_from_preset("k3-tiny"), src)
        (Path(d) / "f").mkdir()
        (Path(d) / "r").mkdir()
        print(json.dumps(fetch_campaign(src, Path(d) / "f", kills=3, seed=1).to_json()))
        print(json.dumps(reshard_campaign(src, Path(d) / "r", kills=3, seed=1).to_json()))


if __name__ == "__main__":  # pragma: no cover
    main_selftest()
