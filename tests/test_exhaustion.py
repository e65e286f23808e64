"""Resource exhaustion: a full disk (``RLIMIT_FSIZE``, and a real ENOSPC on a small tmpfs where
this machine allows mounting one) and too few file descriptors, in the middle of ``fetch`` and
``reshard``. Each must end with one line per failure naming the file, a non-zero exit, no
wrong file under a final name, and a state a plain re-run completes from.
"""

from __future__ import annotations

import math
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt_edit import tree_digests
from helpers import REPO

pytestmark = pytest.mark.slow  # resource-exhaustion campaigns: subprocesses under rlimits and a tiny tmpfs
SHARD = "model-00001-of-000008.safetensors"  # 1.6 MB, the largest k3-tiny shard


def k3ckpt(args: list[str], *, env: dict[str, str] | None = None, fsize: int | None = None,
           nofile: int | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a child with resource limits (SIGXFSZ ignored, so a write past the limit
    fails with EFBIG as it would on a full disk, instead of killing the process)."""

    def limits() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return subprocess.run([sys.executable, "-m", "k3ckpt", *args], env=env, preexec_fn=limits,
                          capture_output=True, text=True, timeout=300)


def final_names_are_complete(dest: Path, served: Path) -> None:
    for p in dest.rglob("*"):
        if ".cache" in p.relative_to(dest).parts:
            continue  # k3ckpt's records (ownership, source revision), not served files
        if p.is_file() and not p.name.endswith((".part", ".journal", ".tmp")) and not p.name.startswith(".k3ckpt"):
            assert p.read_bytes() == (served / p.relative_to(dest)).read_bytes(), f"{p} is final-named but wrong"


def assert_failure_lines(out: str, needle: str) -> list[str]:
    lines = [line for line in out.splitlines() if "could not fetch" in line]
    assert lines, out
    assert all(needle in line for line in lines), out
    return lines


@pytest.fixture
def hub_env(served_hub) -> tuple[object, Path, dict[str, str]]:
    hub, served = served_hub
    env = hub.client_env()
    for var in ("HF_TOKEN", "K3CKPT_TEST_PAUSE_AT"):
        env.pop(var, None)
    return hub, served, env


def fetch_args(hub, dest: Path, *extra: str) -> list[str]:
    return ["fetch", "--source", "hf", "--repo", REPO, "--dest", str(dest), "--endpoint", hub.url,
            "--chunk-size", "65536", *extra]


@pytest.mark.parametrize("limit,needle", [("fsize", "File too large; free space"),
                                          ("nofile", "Too many open files; raise the open-files limit")])
def test_fetch_out_of_space_or_descriptors_fails_per_file_then_resumes(hub_env, tmp_path: Path, limit: str,
                                                                       needle: str) -> None:
    hub, served, env = hub_env
    dest = tmp_path / "dest"
    # 16 workers: their sockets and .part descriptors alone exceed 14 open files
    limits = {"fsize": 300_000} if limit == "fsize" else {"nofile": 14}
    res = k3ckpt(fetch_args(hub, dest, "--workers", "16"), env=env, **limits)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    lines = assert_failure_lines(res.stdout, needle)
    if limit == "fsize":
        assert any(SHARD in line and f"{dest / SHARD}.part" in line for line in lines)
        assert not (dest / SHARD).exists()
    final_names_are_complete(dest, served)
    # Space (or descriptors) back: a plain re-run completes, byte for byte.
    res = k3ckpt(fetch_args(hub, dest), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert tree_digests(dest) == tree_digests(served)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """``mount(size_bytes) -> path``: a tmpfs of that size (skipped where mounting is not allowed);
    ``resize(size)`` on the returned object grows it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = []

    class Tmpfs:
        def mount(self, size: int) -> Path:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
            if r.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]})")
            mounted.append(mnt)
            return mnt

        def resize(self, size: int) -> None:
            subprocess.run(["mount", "-o", f"remount,size={size}", str(mnt)], check=True)

    yield Tmpfs()
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], check=False)


def test_fetch_hitting_a_really_full_disk_mid_file_keeps_a_resumable_state(hub_env, small_tmpfs,
                                                                          tmp_path: Path) -> None:
    """A real ENOSPC after the space check passed: the .part (preallocated) fits exactly, the
    lock and the first journal take the last pages, and the journal update after the first
    chunk finds the disk full (the listing record, written before the first byte, takes one
    more). The journal on disk is the previous, valid one."""
    hub, served, env = hub_env
    page = 4096
    size = (math.ceil((served / SHARD).stat().st_size / page) + 3) * page  # + the listing record
    dest = small_tmpfs.mount(size) / "dest"
    res = k3ckpt(fetch_args(hub, dest, "--include", SHARD, "--workers", "1"), env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert_failure_lines(res.stdout, "No space left on device; free space")
    assert not (dest / SHARD).exists()
    assert (dest / f"{SHARD}.part").exists()
    small_tmpfs.resize(16 << 20)
    res = k3ckpt(fetch_args(hub, dest, "--include", SHARD), env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (dest / SHARD).read_bytes() == (served / SHARD).read_bytes()
    assert sorted(p.name for p in dest.iterdir() if p.name != ".cache") == [SHARD]  # .cache: the source record


@pytest.fixture(scope="module")
def reshard_reference(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("reshard-ref") / "out"
    res = k3ckpt(["reshard", str(k3_tiny), "-o", str(out), "--format", "rank", "--ep", "2"])
    assert res.returncode == 0, res.stderr
    return tree_digests(out)


def ranks_are_all_or_nothing(out: Path) -> None:
    """A rank without READY may hold only temporary files; with READY, what its manifest says."""
    for rdir in out.glob("rank-*"):
        finals = [p for p in rdir.iterdir() if not p.name.startswith(".")]
        if not (rdir / "READY").exists():
            assert not [p for p in finals if p.name.endswith(".safetensors")], sorted(p.name for p in finals)


@pytest.mark.parametrize("limit", ["fsize", "nofile"])
def test_reshard_out_of_space_or_descriptors_is_one_line_and_resumable(k3_tiny: Path, tmp_path: Path,
                                                                     reshard_reference: dict[str, str],
                                                                     limit: str) -> None:
    out = tmp_path / "out"
    args = ["reshard", str(k3_tiny), "-o", str(out), "--format", "rank", "--ep", "2"]
    # 9 descriptors: the interpreter and the planning fit, the writers' source and output files do
    # not. At 12, a loaded machine sometimes ran the two writers one after the other and finished.
    res = k3ckpt(args, fsize=400_000) if limit == "fsize" else k3ckpt(args, nofile=9)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3ckpt: error: writing "), res.stderr
    assert ("File too large; free space" if limit == "fsize" else "Too many open files; raise") in lines[0]
    ranks_are_all_or_nothing(out)
    res = k3ckpt(args)
    assert res.returncode == 0, res.stderr
    assert tree_digests(out) == reshard_reference


# -- a real full disk (tmpfs) under reshard and unshard: issue 14, observation 5 -------------------


def temporaries(root: Path) -> list[str]:
    """Hidden temporary files (``.<name>.tmp`` and ``.<name>.<pid>.<random>.tmp``) under ``root``."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(".*.tmp"))


#: every writing command with an up-front space check, its argv for a source and an output path
#: (``hub``: the loopback hub serving k3-tiny, for the fetches)
REFUSED_FOR_SPACE: dict[str, Callable[[Path, Path, Any], list[str]]] = {
    "reshard --format rank": lambda src, out, hub: ["reshard", str(src), "-o", str(out), "--format", "rank",
                                                    "--ep", "2"],
    "reshard": lambda src, out, hub: ["reshard", str(src), "-o", str(out), "--tp", "2"],
    "unshard": lambda src, out, hub: ["unshard", str(src), "-o", str(out)],
    "fetch": lambda src, out, hub: ["fetch", REPO, "--local-dir", str(out), "--endpoint", hub.url],
    "fetch --node": lambda src, out, hub: ["fetch", REPO, "--local-dir", str(out), "--endpoint", hub.url,
                                           "--tp", "2", "--node", "0"],
    "fetch --ranks": lambda src, out, hub: ["fetch", REPO, "--local-dir", str(out), "--endpoint", hub.url,
                                            "--ep", "2", "--ranks", "0"],
    "fetch --cache-dir": lambda src, out, hub: ["fetch", REPO, "--cache-dir", str(out), "--endpoint", hub.url],
}


@pytest.mark.parametrize("where", ["new", "empty"])
@pytest.mark.parametrize("command", list(REFUSED_FOR_SPACE))
def test_too_small_a_disk_is_refused_before_any_byte(k3_tiny: Path, tmp_path: Path, small_tmpfs,
                                                     request: pytest.FixtureRequest, command: str,
                                                     where: str) -> None:
    """Up front: one line naming the path, the bytes needed and the bytes free; and nothing left
    (issue #25: the directory used to stay behind holding the ownership record). An output the
    run created goes again with the parents it created; an empty one the user made stays, empty."""
    src, hub, env = k3_tiny, None, None
    if command == "unshard":
        src = tmp_path / "lay"
        assert k3ckpt(["reshard", str(k3_tiny), "-o", str(src), "--format", "rank", "--ep", "2"]).returncode == 0
    if command.startswith("fetch"):
        hub, _served, env = request.getfixturevalue("hub_env")
    mnt = small_tmpfs.mount(4 << 20)
    out = mnt / "new" / "out" if where == "new" else mnt / "empty"
    if where == "empty":
        out.mkdir()
    res = k3ckpt(REFUSED_FOR_SPACE[command](src, out, hub), env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"k3ckpt: error: {out}"), res.stderr
    assert ": not enough free space " in lines[0] and " bytes (" in lines[0] and "need " in lines[0], lines[0]
    assert " free" in lines[0]
    assert [p.name for p in mnt.iterdir()] == ([] if where == "new" else ["empty"])
    assert where == "new" or list(out.iterdir()) == []


@pytest.mark.parametrize("layout", ["rank", "node"])
def test_reshard_hitting_a_full_tmpfs_removes_its_temporaries_and_names_the_shortfall(
        k3_tiny: Path, tmp_path: Path, small_tmpfs, layout: str) -> None:
    """Mid-run ENOSPC (the up-front check off, as when another writer fills the disk): the
    error names the file and how much more space is needed, no temporary file keeps the disk
    full, and after the disk grows a plain re-run completes."""
    from k3ckpt.deploy.reshard import ReshardError, reshard
    from k3ckpt.format.topology import RankSelection

    mnt = small_tmpfs.mount(6 << 20)
    out = mnt / "out"
    sel = RankSelection(ep=2, gpus_per_node=1) if layout == "node" else RankSelection(ep=2)
    with pytest.raises(ReshardError) as ei:
        reshard(k3_tiny, out, sel, layout=layout, check_space=False, jobs=1)
    msg = str(ei.value)
    assert msg.startswith(f"writing {out}/") and "No space left on device; " in msg, msg
    assert f"{out} needs " in msg and " more free space for the " in msg, msg
    assert "temporary files removed" in msg and f"completed {layout}s are kept" in msg
    assert temporaries(mnt) == []
    small_tmpfs.resize(64 << 20)
    res = reshard(k3_tiny, out, sel, layout=layout)
    assert sorted(res.skipped + res.written) == [0, 1] and res.written
    reshard(k3_tiny, tmp_path / "ref", sel, layout=layout)
    assert tree_digests(out) == tree_digests(tmp_path / "ref")


def test_unshard_hitting_a_full_tmpfs_removes_its_temporaries_and_names_the_shortfall(
        k3_tiny: Path, tmp_path: Path, small_tmpfs) -> None:
    from k3ckpt.deploy.unshard import UnshardError, unshard

    lay = tmp_path / "lay"
    assert k3ckpt(["reshard", str(k3_tiny), "-o", str(lay), "--format", "rank", "--ep", "2"]).returncode == 0
    mnt = small_tmpfs.mount(3 << 20)
    out = mnt / "back"
    with pytest.raises(UnshardError) as ei:
        unshard(lay, out, check_space=False, jobs=1)
    msg = str(ei.value)
    assert msg.startswith(f"writing {out}/") and "No space left on device; " in msg, msg
    assert f"{out} needs " in msg and " more free space" in msg and "temporary files removed" in msg, msg
    assert temporaries(mnt) == [] and not list(out.glob("*.safetensors"))
    small_tmpfs.resize(64 << 20)
    unshard(lay, out)
    assert tree_digests(out) != {} and (out / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_synth_out_of_space_names_the_file(small_tmpfs, jobs: str) -> None:
    """Before, ``k3ckpt: error: No space left on device`` (no path): the write's OSError names no
    file; :func:`k3ckpt.utils.atomic_output` now gives it the file it was writing."""
    mnt = small_tmpfs.mount(1 << 20)
    res = k3ckpt(["synth", str(mnt / "k3"), "--jobs", jobs])
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"k3ckpt: error: {mnt / 'k3'}/"), res.stderr
    assert lines[0].endswith(": No space left on device"), res.stderr
    assert temporaries(mnt) == []


def test_force_over_another_layout_that_would_not_fit_keeps_the_old_one(k3_tiny: Path, small_tmpfs) -> None:
    """--force replaces another topology only after the space check passed (counting what
    removing the old layout frees): a refused run must not have removed it first."""
    out = small_tmpfs.mount(16 << 20) / "out"
    assert k3ckpt(["reshard", str(k3_tiny), "-o", str(out), "--format", "rank", "--ep", "2"]).returncode == 0
    before = tree_digests(out)
    res = k3ckpt(["reshard", str(k3_tiny), "-o", str(out), "--format", "rank", "--ep", "8", "--tp", "4", "--force"])
    assert res.returncode == 2 and f"k3ckpt: error: {out}: not enough free space for 8 rank" in res.stderr, res.stderr
    assert tree_digests(out) == before
