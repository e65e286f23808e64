"""Crash consistency: SIGKILL ``fetch`` and ``reshard`` at seeded random points (a handful here;
``scripts/campaign.py`` runs many), scan for incomplete final-named files after every kill,
inject power-loss damage, and check every byte after the final run. See
:mod:`k3ckpt.testing.crash` for the invariants."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from k3ckpt.testing.crash import (
    InvariantViolation,
    contention_campaign,
    exhaustion_campaign,
    fetch_campaign,
    foreign_campaign,
    reshard_campaign,
    scan_fetch,
    scan_reshard,
)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12])
def test_fetch_survives_sigkill_and_power_loss(k3_tiny: Path, tmp_path: Path, seed: int) -> None:
    stats = fetch_campaign(k3_tiny, tmp_path, kills=4, seed=seed, power_loss=0.5)
    assert stats.kills == 4 and stats.scans >= 4
    total = sum(p.stat().st_size for p in k3_tiny.iterdir())
    # One full comparison at the end, plus one after each power-loss restart.
    assert stats.bytes_verified == total * (1 + stats.power_loss_faults)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [21, 22])
def test_reshard_survives_sigkill_and_power_loss(k3_tiny: Path, tmp_path: Path, seed: int) -> None:
    stats = reshard_campaign(k3_tiny, tmp_path, kills=4, seed=seed, power_loss=0.5)
    assert stats.kills == 4 and stats.scans >= 4 and stats.bytes_verified > 0
    assert stats.files_checked > 0


def test_the_scans_catch_what_they_look_for(k3_tiny: Path, tmp_path: Path) -> None:
    """The invariant checks are not vacuous: a wrong final-named file and a journal vouching
    for bytes that are not there are both reported."""
    from k3ckpt.testing.crash import CrashStats

    dest = tmp_path / "dest"
    shutil.copytree(k3_tiny, dest)
    shard = sorted(dest.glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(InvariantViolation, match="final name"):
        scan_fetch(dest, k3_tiny, CrashStats("fetch", 0))
    shard.unlink()
    part = Path(f"{shard}.part")
    part.write_bytes(bytes((k3_tiny / shard.name).stat().st_size))
    Path(f"{part}.journal").write_text('{"chunk_size": 65536, "done": [0]}')
    with pytest.raises(InvariantViolation, match="journaled as done"):
        scan_fetch(dest, k3_tiny, CrashStats("fetch", 0))
    out = tmp_path / "out"
    (out / "rank-00000").mkdir(parents=True)
    (out / "rank-00000" / "model-rank-0-part-0.safetensors").write_bytes(b"partial")
    with pytest.raises(InvariantViolation, match="final name"):
        scan_reshard(out, {"rank-00000/model-rank-0-part-0.safetensors": "0" * 64}, CrashStats("reshard", 0))


@pytest.mark.parametrize("seed", [31, 32])
def test_verify_never_passes_a_killed_share_and_passes_the_resumed_one(k3_tiny: Path, tmp_path: Path,
                                                                        seed: int) -> None:
    from k3ckpt.testing.crash import share_fetch_campaign

    stats = share_fetch_campaign(k3_tiny, tmp_path, kills=3, seed=seed)
    assert stats.kills == 3 and stats.verify_refused >= 1
    assert stats.verify_passed >= 1 and stats.bytes_verified > 0  # the final run's share, byte for byte


# -- outputs: the lock, foreign directories, a full disk (issue 14) -----------------------------


@pytest.mark.slow
def test_a_held_reshard_excludes_a_second_one_and_then_finishes(k3_tiny: Path, tmp_path: Path) -> None:
    stats = contention_campaign(k3_tiny, tmp_path, rounds=3, seed=31)
    assert stats.contended == stats.refused_by_lock == stats.held_finished == 3 and stats.bytes_verified > 0


@pytest.mark.slow
def test_no_command_writes_into_a_foreign_directory(k3_tiny: Path, tmp_path: Path) -> None:
    stats = foreign_campaign(k3_tiny, tmp_path, rounds=8, seed=41)
    assert stats.foreign_dirs == stats.refused_foreign == 8


@pytest.mark.slow
def test_a_full_tmpfs_during_reshard_and_unshard_leaves_no_temporaries(k3_tiny: Path, tmp_path: Path) -> None:
    try:
        stats = exhaustion_campaign(k3_tiny, tmp_path, rounds=6, seed=51)
    except OSError as e:
        pytest.skip(str(e))
    assert stats.enospc == stats.enospc_clean and stats.enospc + stats.refused_up_front == 6
    assert stats.resumed == 6 and stats.enospc > 0
