"""Crash-consistency harness: ``k3ckpt fetch`` and ``k3ckpt reshard`` under SIGKILL at seeded
random points, with power-loss style damage between runs, then re-run to completion; and the
output campaigns: two reshards into one directory, every writing command into a directory it
does not own, reshard and unshard onto a full tmpfs.

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
from typing import TYPE_CHECKING, Any

from ..env import K3CKPT_TEST_PAUSE_AT, K3CKPT_TEST_PAUSE_FILE

if TYPE_CHECKING:  # imported where used: the hub emulator is only needed by the fetch campaigns
    from .hub import LoopbackHub

__all__ = ["CrashStats", "InvariantViolation", "OutputStats", "Tmpfs", "contention_campaign", "exhaustion_campaign",
           "fetch_campaign", "foreign_campaign", "reshard_campaign", "share_fetch_campaign"]

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
            _whole_json(p)
            continue
        stats.files_checked += 1
        src = served / rel
        if not src.is_file() or p.stat().st_size != src.stat().st_size or _sha(p) != _sha(src):
            raise InvariantViolation(f"{p}: under its final name but not the source's bytes")


def _whole_json(p: Path) -> None:
    try:
        json.loads(p.read_bytes())
    except ValueError as e:
        raise InvariantViolation(f"{p}: metadata under its final name is not whole JSON ({e})") from None


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
                "--dest", str(dest), "--endpoint", hub.url, "--chunk-size", str(CHUNK), "--jobs", "3"]
        env = _child_env(hub.env_vars())
        while stats.kills < kills:
            child_env, ready, at_point = _arm_fetch_kill(
                rng, hub, env, dest, work / "paused", stats, total,
                lambda: "before_rename" if rng.random() < 0.2 else f"after_chunk:{rng.randrange(1, max(2, nchunks // 2))}")
            killed = _run_until_killed(args, child_env, ready, at_point, stats)
            _after_kill(killed, args, env, dest, stats, scan=lambda: scan_fetch(dest, served, stats),
                        damage=lambda: rng.random() < power_loss and _damage_fetch(dest, rng, stats), reference=served)
        _complete(args, env, dest, stats)
    _compare_trees(dest, served, stats)
    return stats


def _arm_fetch_kill(rng: random.Random, hub: LoopbackHub, env: dict[str, str], dest: Path, marker: Path,
                    stats: CrashStats, total: int, pause_point: Callable[[], str],
                    ) -> tuple[dict[str, str], Callable[[], bool], bool]:
    """Where the next fetch run is killed: half the time at an exact point of the downloader
    (``pause_point()``, e.g. after the N-th journaled chunk; the child pauses there and touches
    ``marker``), half at a random number of bytes the hub has sent. Returns the child's
    environment, the "kill now" test and whether it is a pause point. Counts the stale lock a
    previous kill left, which the next run must recover."""
    if (dest / ".k3ckpt-fetch.lock").exists():
        stats.stale_locks_recovered += 1
    marker.unlink(missing_ok=True)
    child_env = dict(env)
    if rng.random() < 0.5:
        child_env.update({K3CKPT_TEST_PAUSE_AT.name: pause_point(), K3CKPT_TEST_PAUSE_FILE.name: str(marker)})
        return child_env, marker.exists, True
    threshold = hub.total_bytes_sent() + rng.randrange(1, max(2, total))
    return child_env, lambda: hub.total_bytes_sent() >= threshold, False


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
        if any(d.startswith(".") for d in p.relative_to(out).parts[:-1]):
            _whole_json(p)  # the ownership and stat records: never half-written
            continue
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


def _renamed_parts(out: Path) -> int:
    """How many rank files the running reshard has renamed into place (0 while it clears a
    stale rank: a directory may vanish between listing and reading it)."""
    try:
        return len(list(out.glob("rank-*/[!.]*.safetensors")))
    except FileNotFoundError:
        return 0


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
    common = [sys.executable, "-m", "k3ckpt", "reshard", str(source), "--format", "rank", *topo, "--max-shard-size", "256KiB",
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
            ready = lambda k=k: _renamed_parts(out) >= k  # noqa: E731
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
                "--endpoint", hub.url, "--chunk-size", str(SHARE_CHUNK), "--jobs", "3", *topo]
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
            child_env, ready, at_point = _arm_fetch_kill(
                rng, hub, env, dest, work / "paused", stats, total,
                lambda: "before_shard_rename" if rng.random() < 0.2 else f"after_piece:{rng.randrange(1, 40)}")
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


# ----------------------------------------------------------------------------------------------
# output ownership, the output lock and a full disk (issue 14)
# ----------------------------------------------------------------------------------------------


@dataclass
class OutputStats:
    """What an output campaign did (:func:`contention_campaign`, :func:`foreign_campaign`,
    :func:`exhaustion_campaign`).

    Attributes:
        contended: second runs started into an output a first run held (paused mid-write).
        refused_by_lock: ... refused (exit 2, naming the lock file and its holder).
        held_finished: first runs that finished after the second was refused, output exact.
        foreign_dirs: runs into a directory holding files k3ckpt did not write.
        refused_foreign: ... refused (exit 2, naming a file), the directory byte-identical after.
        forced: ... of which with ``--force``.
        enospc: runs that hit a full tmpfs mid-write (up-front check off).
        enospc_clean: ... that named the path and the shortfall and left no temporary file.
        refused_up_front: runs refused by the space check before any byte (tmpfs too small).
        resumed: runs completed after the tmpfs grew, output exact.
        bytes_verified: output bytes compared with a clean reference run.
    """

    what: str
    seed: int
    contended: int = 0
    refused_by_lock: int = 0
    held_finished: int = 0
    foreign_dirs: int = 0
    refused_foreign: int = 0
    forced: int = 0
    enospc: int = 0
    enospc_clean: int = 0
    refused_up_front: int = 0
    resumed: int = 0
    bytes_verified: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3ckpt", *args]


def _reshard_args(source: Path, out: Path, topo: list[str]) -> list[str]:
    return _cli("reshard", str(source), "-o", str(out), "--format", "rank", *topo, "--max-shard-size", "256KiB",
                "--jobs", "2")


def _verified(out: Path, ref: dict[str, str], stats: OutputStats) -> None:
    got = _digests(out)
    if got != ref:
        raise InvariantViolation(f"{out}: differs from a clean run: {sorted(set(got.items()) ^ set(ref.items()))[:3]}")
    stats.bytes_verified += sum((out / k).stat().st_size for k in got)


def contention_campaign(source: Path, work: Path, *, rounds: int, seed: int) -> OutputStats:
    """Two reshards into one output: the first is held at a seeded random point (after its K-th
    file, ``K3CKPT_TEST_PAUSE_AT=reshard_file:K``), a second (with or without ``--force``) must
    be refused by the output lock naming the holder, and the first, let go, must finish with a
    clean run's bytes."""
    rng = random.Random(seed)
    stats = OutputStats("contention", seed)
    topo = rng.choice([["--ep", "2"], ["--ep", "4"], ["--tp", "2"]])
    ref_dir = work / "reference"
    subprocess.run(_reshard_args(source, ref_dir, topo), check=True, capture_output=True, timeout=600)
    ref = _digests(ref_dir)
    parts = sum(1 for k in ref if k.endswith(".safetensors"))
    for i in range(rounds):
        out, marker = work / f"out-{i}", work / f"paused-{i}"
        env = _child_env({K3CKPT_TEST_PAUSE_AT.name: f"reshard_file:{rng.randrange(1, parts + 1)}",
                          K3CKPT_TEST_PAUSE_FILE.name: str(marker)})
        first = subprocess.Popen(_reshard_args(source, out, topo), env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)
        deadline = time.monotonic() + _PAUSE_TIMEOUT
        while not marker.exists():
            if first.poll() is not None or time.monotonic() > deadline:
                first.kill()
                raise InvariantViolation(f"the held reshard never reached its pause point ({first.returncode})")
            time.sleep(0.005)
        try:
            stats.contended += 1
            second = subprocess.run(_reshard_args(source, out, topo) + (["--force"] if rng.random() < 0.5 else []),
                                    env=_child_env({}), capture_output=True, text=True, timeout=600)
            lock = out / ".k3ckpt-output.lock"
            if second.returncode != 2 or f"another reshard is running there: pid {first.pid}" not in second.stderr \
                    or str(lock) not in second.stderr:
                raise InvariantViolation(f"a second reshard into {out} was not refused by the lock: "
                                         f"{second.returncode} {second.stderr[-300:]}")
            stats.refused_by_lock += 1
        finally:
            marker.unlink()
            os.kill(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=600)
        if first.returncode != 0:
            raise InvariantViolation(f"the held reshard failed after the refusal: {err.decode()[-300:]}")
        _verified(out, ref, stats)
        stats.held_finished += 1
        shutil.rmtree(out)
    return stats


#: What a foreign directory holds in :func:`foreign_campaign`: a user's files that happen to
#: have the names the commands write (or a k3ckpt-looking marker k3ckpt did not write there).
_FOREIGN = ["config.json", "notes.txt", "model-00001-of-00001.safetensors", "rank-00000/READY",
            "node-00000/config.json", "topology.json", "model.safetensors.index.json", ".hidden.tmp",
            ".cache/huggingface/download/config.json.metadata", "LICENSE"]


def _all_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def foreign_campaign(source: Path, work: Path, *, rounds: int, seed: int) -> OutputStats:
    """Every writing command into a directory holding files k3ckpt did not write (seeded random
    names from :data:`_FOREIGN`, a copy of a checkpoint, or both), with or without ``--force``:
    each must exit 2 naming a file there, and leave the directory byte for byte as it was."""
    rng = random.Random(seed)
    stats = OutputStats("foreign", seed)
    layout = work / "layout"
    subprocess.run(_reshard_args(source, layout, ["--ep", "2"]), check=True, capture_output=True, timeout=600)
    for i in range(rounds):
        d = work / f"foreign-{i}"
        if rng.random() < 0.3:
            shutil.copytree(source, d)
        d.mkdir(exist_ok=True)
        for rel in rng.sample(_FOREIGN, rng.randrange(1, 4)):
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(rng.randbytes(rng.randrange(1, 256)))
        force = ["--force"] if rng.random() < 0.5 else []
        commands = [_reshard_args(source, d, ["--ep", "2"]), _cli("reshard", str(source), "-o", str(d), "--tp", "2"),
                    _cli("unshard", str(layout), "-o", str(d))]
        license_ = d / "LICENSE"
        if not (license_.is_file() and b"synthetic fixture generated by k3ckpt" in license_.read_bytes()):
            # synth tells its own output by that LICENSE line alone: a synthetic checkpoint with
            # files replaced is synth's to replace (SECURITY.md), so not a foreign case here
            commands.append(_cli("synth", str(d), "--layers", "2"))
        args = rng.choice(commands) + force
        before = _all_bytes(d)
        stats.foreign_dirs += 1
        stats.forced += bool(force)
        res = subprocess.run(args, env=_child_env({}), capture_output=True, text=True, timeout=600)
        lines = res.stderr.strip().splitlines()
        if (res.returncode != 2 or len(lines) != 1 or "k3ckpt did not write (" + str(d) not in lines[0]
                or _all_bytes(d) != before or sorted(os.listdir(d)) != sorted({k.split("/")[0] for k in before})):
            raise InvariantViolation(f"{' '.join(args[3:5])} into a foreign directory {d}: exit {res.returncode}, "
                                     f"{res.stderr[-300:]!r}; unchanged: {_all_bytes(d) == before}")
        stats.refused_foreign += 1
        shutil.rmtree(d)
    return stats


class Tmpfs:
    """A small tmpfs at ``path`` (root only): :meth:`mount`, :meth:`resize`, :meth:`umount`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mounted = False

    def mount(self, size: int) -> Path:
        """Raises:
            OSError: mounting is not allowed here."""
        self.path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise OSError(f"cannot mount a tmpfs at {self.path}: {r.stderr.strip()[:100]}")
        self.mounted = True
        return self.path

    def resize(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def umount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)
            self.mounted = False


def exhaustion_campaign(source: Path, work: Path, *, rounds: int, seed: int) -> OutputStats:
    """reshard (both formats) and unshard onto a tmpfs of a seeded random size below what the
    output needs: with the up-front check, a refusal before any byte naming path, need and free,
leaving no output directory;
    without it (another writer filling the disk), ENOSPC mid-run that must name the path and the
    shortfall and leave no temporary file. Then the tmpfs grows and a plain re-run must complete
    with a clean run's bytes.

    Raises:
        OSError: a tmpfs cannot be mounted here (not root).
    """
    from ..deploy.reshard import reshard
    from ..deploy.unshard import unshard
    from ..errors import DiskSpaceError, K3ckptError
    from ..format.topology import RankSelection

    rng = random.Random(seed)
    stats = OutputStats("exhaustion", seed)
    layout = work / "layout"
    reshard(source, layout, RankSelection(ep=2), layout="rank")
    refs: dict[str, dict[str, str]] = {}
    for kind in ("rank", "node"):
        reshard(source, work / f"ref-{kind}", RankSelection(ep=2), layout=kind)
        refs[kind] = _digests(work / f"ref-{kind}")
    unshard(layout, work / "ref-unshard")
    refs["unshard"] = _digests(work / "ref-unshard")
    for i in range(rounds):
        kind = rng.choice(["rank", "node", "unshard"])
        total = sum((work / f"ref-{kind}" / k).stat().st_size for k in refs[kind])
        fs = Tmpfs(work / f"mnt-{i}")
        mnt = fs.mount(max(64 << 10, int(total * rng.uniform(0.1, 0.9))))
        try:
            out = mnt / "out"
            check = rng.random() < 0.3

            def run(check_space: bool, out: Path = out, kind: str = kind) -> None:
                if kind == "unshard":
                    unshard(layout, out, check_space=check_space, jobs=2)
                else:
                    reshard(source, out, RankSelection(ep=2), layout=kind, check_space=check_space, jobs=2)

            try:
                run(check)
                raise InvariantViolation(f"{kind} onto a {mnt} too small for it succeeded")
            except DiskSpaceError as e:
                if not check or not str(e).startswith(f"{out}: not enough free space") or " free" not in str(e):
                    raise InvariantViolation(f"{kind}: unexpected refusal {e}") from None
                if out.exists():  # the directory it created goes again, ownership record and all (#25)
                    raise InvariantViolation(f"{out}: refused up front but left {sorted(os.listdir(out))}") from None
                stats.refused_up_front += 1
            except K3ckptError as e:
                msg = str(e)
                stats.enospc += 1
                if check or "No space left on device" not in msg or f"{out} needs " not in msg \
                        or "temporary files removed" not in msg:
                    raise InvariantViolation(f"{kind}: out-of-space error lacks the path or shortfall: {msg}") from None
                left = sorted(p.relative_to(mnt).as_posix() for p in mnt.rglob(".*.tmp"))
                if left:
                    raise InvariantViolation(f"{kind}: temporary files left on the full disk: {left[:3]}") from None
                stats.enospc_clean += 1
            fs.resize(4 * total + (8 << 20))
            run(True)  # a plain re-run: no --force (nothing of a failed unshard is final)
            got = _digests(out)
            if got != refs[kind]:
                raise InvariantViolation(f"{kind}: the re-run after the disk grew differs from a clean run")
            stats.bytes_verified += sum((out / k).stat().st_size for k in got)
            stats.resumed += 1
        finally:
            fs.umount()
    return stats
