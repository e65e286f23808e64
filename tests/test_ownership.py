"""No command overwrites what it does not own (issue 14, observations 2, 5 and 8): the ownership
record (:mod:`k3ckpt.utils.ownership`), the output lock of reshard and unshard
(:mod:`k3ckpt.utils.lock`), and the re-run check of finished ranks by stat record."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_edit import tree_digests
from helpers import REPO, assert_one_line_error, run
from k3ckpt.deploy import reshard as rs
from k3ckpt.errors import OutputNotOwnedError
from k3ckpt.format.topology import RankSelection
from k3ckpt.utils.lock import OUTPUT_LOCK_NAME, DirLock
from k3ckpt.utils.ownership import OWNER_RECORD, check_output_dir, claim_output_dir, locked_output_dir

#: Small files: several per rank, so that a run can be held after its first.
RANK_ARGS = ["--format", "rank", "--ep", "2", "--max-file-size", "256KiB"]


@pytest.fixture(scope="module")
def reference(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("ref") / "out"
    res = run("reshard", str(k3_tiny), "-o", str(out), *RANK_ARGS)
    assert res.exit_code == 0, res.output
    return tree_digests(out)


# -- foreign directories -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", [["--format", "rank", "--ep", "2"], []])
@pytest.mark.parametrize("force", [False, True])
def test_reshard_refuses_a_directory_holding_another_checkpoint(k3_tiny: Path, tmp_path: Path, layout: list[str],
                                                                force: bool) -> None:
    """Observation 2: the output held another checkpoint; its config.json was replaced (exit 0).
    Now exit 2 naming the first foreign file, --force included, and nothing is touched."""
    other = tmp_path / "other"
    shutil.copytree(k3_tiny, other)
    (other / "config.json").write_text('{"mine": true}\n')
    before = tree_digests(other)
    res = run("reshard", str(k3_tiny), "-o", str(other), *layout, *(["--force"] if force else []))
    first = sorted(os.listdir(other))[0]
    assert_one_line_error(res, 2, f"{other}: holds files k3ckpt did not write ({other / first})",
                          "choose a new or empty directory")
    assert tree_digests(other) == before and sorted(os.listdir(other)) == sorted(before)  # no lock, no record left


def test_a_foreign_file_in_own_output_is_never_replaced(k3_tiny: Path, tmp_path: Path,
                                                        reference: dict[str, str]) -> None:
    out = tmp_path / "out"
    assert run("reshard", str(k3_tiny), "-o", str(out), *RANK_ARGS).exit_code == 0
    (out / "notes.txt").write_text("mine")
    for args in (RANK_ARGS, [*RANK_ARGS, "--force"], [*RANK_ARGS[:2], "--ep", "4", "--force"]):
        res = run("reshard", str(k3_tiny), "-o", str(out), *args)
        assert_one_line_error(res, 2, f"({out / 'notes.txt'})")
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert tree_digests(out) == reference


def test_own_output_is_resumed_without_force_and_replaced_with_it(k3_tiny: Path, tmp_path: Path,
                                                                  reference: dict[str, str]) -> None:
    out = tmp_path / "out"
    assert run("reshard", str(k3_tiny), "-o", str(out), *RANK_ARGS).exit_code == 0
    res = run("reshard", str(k3_tiny), "-o", str(out), *RANK_ARGS)
    assert res.exit_code == 0 and "2 already complete (skipped)" in res.output, res.output
    res = run("reshard", str(k3_tiny), "-o", str(out), "--format", "rank", "--ep", "4")
    assert_one_line_error(res, 2, "holds a different topology or source", "--force")
    assert run("reshard", str(k3_tiny), "-o", str(out), "--format", "rank", "--ep", "4", "--force").exit_code == 0
    assert sorted(p.name for p in out.glob("rank-*")) == [f"rank-0000{r}" for r in range(4)]
    assert run("reshard", str(k3_tiny), "-o", str(out), *RANK_ARGS, "--force").exit_code == 0
    assert tree_digests(out) == reference
    record = json.loads((out / OWNER_RECORD).read_text())
    assert record["command"] == "reshard" and "rank-00000" in record["entries"]


def test_commands_do_not_take_over_each_others_output(k3_tiny: Path, tmp_path: Path) -> None:
    lay, back = tmp_path / "lay", tmp_path / "back"
    assert run("reshard", str(k3_tiny), "-o", str(lay), *RANK_ARGS).exit_code == 0
    assert run("unshard", str(lay), "-o", str(back)).exit_code == 0
    res = run("reshard", str(k3_tiny), "-o", str(back), *RANK_ARGS, "--force")
    assert_one_line_error(res, 2, f"{back}: holds the output of k3ckpt unshard", "not of k3ckpt reshard")
    res = run("unshard", str(lay), "-o", str(back))
    assert_one_line_error(res, 2, "already holds a checkpoint", "--force")
    assert run("unshard", str(lay), "-o", str(back), "--force").exit_code == 0
    res = run("unshard", str(lay), "-o", str(lay / "rank-00000" / "x"))
    assert res.exit_code == 2


def test_unshard_never_deletes_foreign_shards(k3_tiny: Path, tmp_path: Path) -> None:
    """Before, unshard removed every model-NNNNN-of-NNNNN.safetensors it found in the output
    (an earlier run's, it assumed) - a user's own shards included."""
    lay, out = tmp_path / "lay", tmp_path / "mine"
    assert run("reshard", str(k3_tiny), "-o", str(lay), *RANK_ARGS).exit_code == 0
    out.mkdir()
    (out / "model-00001-of-00001.safetensors").write_bytes(b"my weights")
    for extra in ([], ["--force"]):
        res = run("unshard", str(lay), "-o", str(out), *extra)
        assert_one_line_error(res, 2, f"({out / 'model-00001-of-00001.safetensors'})")
    assert (out / "model-00001-of-00001.safetensors").read_bytes() == b"my weights"
    assert sorted(os.listdir(out)) == ["model-00001-of-00001.safetensors"]


def test_claim_accepts_only_empty_or_own(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / OUTPUT_LOCK_NAME).write_text("{}")  # a lock is never foreign
    owned = claim_output_dir(d, "reshard", ["a/b.json", "topology.json"])
    assert owned.entries == {".cache", "a", "topology.json"}
    (d / ".topology.json.123.abcd.tmp").write_text("")  # a killed write of a recorded name
    claim_output_dir(d, "reshard", [])
    (d / ".other.tmp").write_text("")
    with pytest.raises(OutputNotOwnedError, match=r"\.other\.tmp"):
        claim_output_dir(d, "reshard", [])
    (d / ".other.tmp").unlink()
    with pytest.raises(OutputNotOwnedError, match="holds the output of k3ckpt reshard"):
        claim_output_dir(d, "unshard", [])
    (d / OWNER_RECORD).write_text("not json")
    with pytest.raises(OutputNotOwnedError, match="is not a k3ckpt ownership record"):
        claim_output_dir(d, "reshard", [])
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputNotOwnedError, match="is not a directory"):
        claim_output_dir(f, "reshard", [])
    e = tmp_path / "e"
    (e / ".cache" / "k3ckpt").mkdir(parents=True)  # a first run killed before its record landed
    claim_output_dir(e, "reshard", [])
    (tmp_path / "h" / ".cache" / "huggingface").mkdir(parents=True)
    with pytest.raises(OutputNotOwnedError, match=r"\.cache\)"):
        claim_output_dir(tmp_path / "h", "reshard", [])


class Refused(Exception):
    """What a refused run raises in these tests (after making what it makes)."""


def _refused_run(out: Path, *, write: str | None = None, resumable: bool = True) -> None:
    """A run into ``out`` that claims it, maybe writes ``write`` (a relative path), then is refused."""
    with pytest.raises(Refused), locked_output_dir(out, DirLock(out, OUTPUT_LOCK_NAME), resumable=resumable):
        claim_output_dir(out, "reshard", ["topology.json"])
        if write is not None:
            (out / write).parent.mkdir(parents=True, exist_ok=True)
            (out / write).write_text("data")
        raise Refused


def test_a_refused_run_leaves_no_directory_it_made(tmp_path: Path) -> None:
    """Issue #25: exactly what the run created goes again - the output and the parents it made,
    with its ownership record and lock - and nothing that existed before."""
    _refused_run(tmp_path / "a" / "b" / "out")
    assert list(tmp_path.iterdir()) == []
    user = tmp_path / "mine"
    user.mkdir()
    _refused_run(user / "out")  # a parent the user made: kept, as it was
    _refused_run(user)  # an empty output the user made: kept, empty
    assert user.is_dir() and list(user.iterdir()) == []
    # data written (a resumable .part, say): kept, the parents with it
    _refused_run(tmp_path / "p" / "out", write="x.safetensors.part")
    assert sorted(p.name for p in (tmp_path / "p" / "out").iterdir()) == [".cache", "x.safetensors.part"]
    # ... unless the command resumes nothing: then everything it wrote goes
    _refused_run(tmp_path / "q" / "out", write="sub/shard.safetensors", resumable=False)
    assert not (tmp_path / "q").exists()
    # a directory that held anything before is never touched
    own = tmp_path / "own"
    claim_output_dir(own, "reshard", ["topology.json"])
    _refused_run(own)
    assert (own / OWNER_RECORD).is_file()
    # another run's lock in it (a fetch racing into the new directory): nothing is removed
    racing = tmp_path / "racing"
    with pytest.raises(Refused), locked_output_dir(racing, DirLock(racing, OUTPUT_LOCK_NAME)):
        (racing / ".k3ckpt-fetch.lock").write_text("{}")
        raise Refused
    assert sorted(p.name for p in racing.iterdir()) == [".k3ckpt-fetch.lock"]
    # a symlink is never followed: the file it points to stays
    target = tmp_path / "target"
    target.write_text("keep")
    with pytest.raises(Refused), locked_output_dir(tmp_path / "s", DirLock(tmp_path / "s", OUTPUT_LOCK_NAME),
                                                   resumable=False):
        (tmp_path / "s" / "link").symlink_to(target)
        raise Refused
    assert target.read_text() == "keep" and not (tmp_path / "s").exists()


def test_a_refused_synth_makes_no_directory(tmp_path: Path) -> None:
    # synth's refusals (a spec it cannot write) all come before it creates anything
    assert_one_line_error(run("synth", str(tmp_path / "a" / "b"), "--moe-intermediate", "33"), 2, "33")
    assert list(tmp_path.iterdir()) == []


def test_check_refuses_what_claim_refuses_and_writes_nothing(tmp_path: Path) -> None:
    """The dry run's check: the same verdicts as a claim, no directory made, no record written."""
    check_output_dir(tmp_path / "new", "fetch")
    assert not (tmp_path / "new").exists()
    d = tmp_path / "d"
    d.mkdir()
    check_output_dir(d, "fetch")
    assert os.listdir(d) == []
    (d / "config.json").write_text("{}")
    with pytest.raises(OutputNotOwnedError, match=r"holds files k3ckpt did not write .*config\.json"):
        check_output_dir(d, "fetch")
    check_output_dir(d, "fetch", adopt=lambda p: True)  # an earlier version's own output
    (d / "config.json").unlink()
    claim_output_dir(d, "reshard", ["topology.json"])
    record = (d / OWNER_RECORD).read_bytes()
    with pytest.raises(OutputNotOwnedError, match="holds the output of k3ckpt reshard"):
        check_output_dir(d, "fetch")
    check_output_dir(d, "reshard")
    assert (d / OWNER_RECORD).read_bytes() == record
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputNotOwnedError, match="is not a directory"):
        check_output_dir(f, "fetch")


# -- the lock ----------------------------------------------------------------------------------


def _paused_reshard(k3_tiny: Path, out: Path, paused: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3CKPT_")}
    env.update(K3CKPT_TEST_PAUSE_AT="reshard_file:1", K3CKPT_TEST_PAUSE_FILE=str(paused))
    proc = subprocess.Popen([sys.executable, "-m", "k3ckpt", "reshard", str(k3_tiny), "-o", str(out), *RANK_ARGS, "--jobs", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not paused.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first reshard never reached its pause point"
        time.sleep(0.01)
    return proc


def test_a_second_reshard_into_the_same_output_is_refused(k3_tiny: Path, tmp_path: Path,
                                                          reference: dict[str, str]) -> None:
    """Observation 8: no lock on the output. The first run holds OUT/.k3ckpt-output.lock while
    it is held at a pause point; the second is refused naming the lock and its holder; the first
    then finishes and its output is a clean run's."""
    out, paused = tmp_path / "out", tmp_path / "paused"
    first = _paused_reshard(k3_tiny, out, paused)
    try:
        for args in (["reshard", str(k3_tiny), "-o", str(out), *RANK_ARGS],
                     ["reshard", str(k3_tiny), "-o", str(out), *RANK_ARGS, "--force"],
                     ["unshard", str(k3_tiny), "-o", str(out)]):
            res = run(*args)
            if args[0] == "unshard":  # k3_tiny is no rank layout: refused before the lock
                assert res.exit_code == 2
                continue
            assert_one_line_error(res, 2, f"{out}: another reshard is running there: pid {first.pid} on host",
                                  f"lock file {out / OUTPUT_LOCK_NAME}")
    finally:
        paused.unlink()
        os.kill(first.pid, signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr.decode()
    assert b"2 ranks written" in stdout
    assert not (out / OUTPUT_LOCK_NAME).exists()
    assert tree_digests(out) == reference


def test_a_killed_runs_lock_is_broken(k3_tiny: Path, tmp_path: Path, reference: dict[str, str]) -> None:
    out, paused = tmp_path / "out", tmp_path / "paused"
    first = _paused_reshard(k3_tiny, out, paused)
    first.kill()
    first.communicate()
    assert (out / OUTPUT_LOCK_NAME).exists()
    res = run("reshard", str(k3_tiny), "-o", str(out), *RANK_ARGS)
    assert res.exit_code == 0, res.output
    assert tree_digests(out) == reference and not (out / OUTPUT_LOCK_NAME).exists()


# -- re-run checks finished ranks by stat record -------------------------------------------------


def _flip(path: Path, offset: int, keep_mtime: bool) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size


@pytest.mark.parametrize("layout", ["rank", "node"])
@pytest.mark.parametrize("keep_mtime", [False, True])
def test_rerun_rewrites_a_unit_whose_bytes_changed_at_the_same_size(k3_tiny: Path, tmp_path: Path, layout: str,
                                                                     keep_mtime: bool) -> None:
    """Observation 8: a re-run skipped a READY rank whose files had the right size. A flipped
    byte (size kept, mtime put back with os.utime) now gets the unit rewritten."""
    out = tmp_path / "out"
    sel = RankSelection(ep=2)
    rs.reshard(k3_tiny, out, sel, layout=layout)
    clean = tree_digests(out)
    assert rs.reshard(k3_tiny, out, sel, layout=layout).written == []
    unit = sorted(out.glob(f"{layout}-*"))[-1]
    victim = max(unit.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    _flip(victim, victim.stat().st_size - 1, keep_mtime)
    res = rs.reshard(k3_tiny, out, sel, layout=layout)
    n = int(unit.name.split("-")[1])
    assert res.written == [n] and n not in res.skipped
    assert tree_digests(out) == clean


def test_rerun_rewrites_a_unit_without_a_stat_record(k3_tiny: Path, tmp_path: Path) -> None:
    """An output without the record (an older version's, or copied elsewhere: other inodes)
    is rewritten rather than trusted by size."""
    out = tmp_path / "out"
    sel = RankSelection(ep=2)
    rs.reshard(k3_tiny, out, sel, layout="rank")
    shutil.rmtree(out / ".cache" / "k3ckpt" / "units")
    assert rs.reshard(k3_tiny, out, sel, layout="rank").written == [0, 1]
    moved = tmp_path / "moved"
    shutil.copytree(out, moved, copy_function=shutil.copy2)
    assert rs.reshard(k3_tiny, moved, sel, layout="rank").written == [0, 1]


# -- fetch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", [[], ["--ep", "8", "--tp", "2", "--node", "0", "--gpus-per-node", "4",
                                      "--format", "partial"],
                                 ["--tp", "2", "--dp", "4", "--gpus-per-node", "4", "--node", "1"]])
def test_fetch_refuses_a_directory_holding_files_it_did_not_write(served_hub: Any, tmp_path: Path,
                                                                  how: list[str]) -> None:
    """A whole fetch replaced same-named files it found (a hand-copied config.json with other
    bytes was "repaired"); every kind of fetch now refuses a foreign directory, and resumes
    its own."""
    h, served = served_hub
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}\n')
    args = ["fetch", "--source", "hf", "--repo", REPO, "--endpoint", h.url, "--workers", "2", *how]
    for dry in ([], ["--dry-run"]):  # the dry run says what the run would: refused, nothing written
        res = run(*args, "--dest", str(mine), *dry)
        assert_one_line_error(res, 2, f"{mine}: holds files k3ckpt did not write ({mine / 'config.json'})")
        assert sorted(os.listdir(mine)) == ["config.json"] and (mine / "config.json").read_text() == '{"mine": true}\n'
    dest = tmp_path / "dest"
    assert run(*args, "--dest", str(dest), "--dry-run").exit_code == 0 and not dest.exists()
    assert run(*args, "--dest", str(dest)).exit_code == 0
    assert run(*args, "--dest", str(dest), "--dry-run").exit_code == 0  # its own destination: planned, not refused
    res = run(*args, "--dest", str(dest))  # its own: re-run verifies and skips
    assert res.exit_code == 0 and "0 failed" in res.output, res.output
    assert json.loads((dest / OWNER_RECORD).read_text())["command"] == "fetch"


def test_fetch_resumes_a_destination_an_earlier_version_left(served_hub: Any, tmp_path: Path) -> None:
    """No ownership record, but fetch's own records under .cache/k3ckpt: adopted, not refused."""
    h, served = served_hub
    dest = tmp_path / "dest"
    args = ["fetch", "--source", "hf", "--repo", REPO, "--endpoint", h.url, "--dest", str(dest)]
    assert run(*args).exit_code == 0
    (dest / OWNER_RECORD).unlink()
    assert (dest / ".cache" / "k3ckpt" / "source.json").exists()
    res = run(*args)
    assert res.exit_code == 0 and ": 0 fetched, " in res.output and " 0 failed; 0 B downloaded" in res.output, res.output
