"""``k3ckpt.utils``: the one atomic write, ``fsync_dir``'s error rule, path containment on resolved
paths, and how sizes and integer sets are written for people."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from k3ckpt.utils import (
    atomic_output,
    format_ranges,
    fsync_dir,
    human_bytes,
    is_within,
    pwrite_all,
    temp_name,
    write_atomic,
)


def _names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


# ----------------------------------------------------------------------------------------------
# write_atomic / atomic_output
# ----------------------------------------------------------------------------------------------


def test_write_atomic_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "a.json"
    p.write_bytes(b"old")
    write_atomic(p, b"new content", mode=0o600)
    assert p.read_bytes() == b"new content"
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert _names(tmp_path) == {"a.json"}


def test_temp_name_is_hidden_unique_and_beside_the_target(tmp_path: Path) -> None:
    a, b = temp_name(tmp_path / "x.json"), temp_name(tmp_path / "x.json")
    assert a != b
    assert a.parent == tmp_path and a.name.startswith(".x.json.") and a.name.endswith(".tmp")


def test_write_atomic_syncs_the_file_and_then_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomic(tmp_path / "f", b"x")
    assert synced == ["file", "dir"]


def test_symlink_planted_at_the_temporary_name_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(os, "urandom", lambda n: bytes(n))  # the next temp_name, predictably
    final = tmp_path / "out.json"
    temp_name(final).symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_atomic(final, b"attacker-controlled? no")
    assert victim.read_bytes() == b"precious"
    assert not final.exists()
    assert temp_name(final).is_symlink()  # not ours: left alone


def test_symlink_at_the_final_name_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    final = tmp_path / "out.json"
    final.symlink_to(victim)
    write_atomic(final, b"data")
    assert victim.read_bytes() == b"precious"
    assert not final.is_symlink() and final.read_bytes() == b"data"


def test_reused_temporary_name_removes_a_leftover_and_a_planted_symlink(tmp_path: Path) -> None:
    final = tmp_path / "f.part.journal"
    leftover = tmp_path / "f.part.journal.tmp"
    leftover.write_bytes(b"half a journal from a killed run")
    write_atomic(final, b"{}", reuse_temp=True)
    assert final.read_bytes() == b"{}" and _names(tmp_path) == {"f.part.journal"}

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    leftover.symlink_to(victim)
    write_atomic(final, b"{1}", reuse_temp=True)
    assert victim.read_bytes() == b"precious" and final.read_bytes() == b"{1}"
    assert _names(tmp_path) == {"f.part.journal", "victim"}


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_never_leaves_a_partial_file_under_the_final_name(tmp_path: Path,
                                                                         exc: BaseException) -> None:
    final = tmp_path / "shard.safetensors"
    final.write_bytes(b"the complete old file")
    with pytest.raises(type(exc)):
        with atomic_output(final, size=1 << 20) as fd:
            os.write(fd, b"half of the new")
            raise exc
    assert final.read_bytes() == b"the complete old file"
    assert _names(tmp_path) == {"shard.safetensors"}
    # and where there was nothing, there still is nothing
    with pytest.raises(type(exc)):
        with atomic_output(tmp_path / "new", size=10) as fd:
            raise exc
    assert _names(tmp_path) == {"shard.safetensors"}


def test_atomic_output_reserves_size_for_pwrite(tmp_path: Path) -> None:
    final = tmp_path / "f"
    with atomic_output(final, size=10) as fd:
        os.pwrite(fd, b"end", 7)
    assert final.read_bytes() == b"\0" * 7 + b"end"


def test_pwrite_all_finishes_short_writes_at_the_right_offsets(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite
    calls = []

    def short_pwrite(fd: int, data: memoryview, offset: int) -> int:  # as a signal or a pipe may
        calls.append(offset)
        return real_pwrite(fd, data[:3], offset)

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    with atomic_output(tmp_path / "f", size=12) as fd:
        pwrite_all(fd, b"0123456789", 2)
    assert (tmp_path / "f").read_bytes() == b"\0\0" + b"0123456789"
    assert calls == [2, 5, 8, 11]


# ----------------------------------------------------------------------------------------------
# fsync_dir
# ----------------------------------------------------------------------------------------------


def _fsync_failing_with(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def fsync(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP])
def test_fsync_dir_accepts_a_filesystem_that_cannot_sync_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      code: int) -> None:
    _fsync_failing_with(monkeypatch, code)
    fsync_dir(tmp_path)  # no error: the rename is as durable as that filesystem makes it


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_fsync_dir_raises_a_real_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    _fsync_failing_with(monkeypatch, code)
    with pytest.raises(OSError) as ei:
        fsync_dir(tmp_path)
    assert ei.value.errno == code


def test_fsync_dir_accepts_a_directory_it_may_not_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def open_(path: object, flags: int, *args: object) -> int:
        if Path(path) == tmp_path:  # type: ignore[arg-type]
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", open_)
    fsync_dir(tmp_path)


def test_fsync_dir_raises_for_a_missing_path_or_a_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        fsync_dir(tmp_path / "file")


# ----------------------------------------------------------------------------------------------
# is_within
# ----------------------------------------------------------------------------------------------


def test_is_within_is_not_a_string_prefix(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "bc").mkdir()
    assert not is_within(tmp_path / "a" / "bc", tmp_path / "a" / "b")
    assert not is_within(tmp_path / "a" / "bc" / "x", tmp_path / "a" / "b")
    assert not is_within("/a/bc", "/a/b") and not is_within("/a/b", "/a/bc")  # need not exist
    assert is_within(tmp_path / "a" / "b", tmp_path / "a" / "b")
    assert is_within(tmp_path / "a" / "b" / "not" / "yet", tmp_path / "a" / "b")


def test_is_within_resolves_dotdot(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    assert not is_within(root / "sub" / ".." / ".." / "x", root)
    assert is_within(root / "sub" / "..", root)
    assert is_within(root / ".." / "root" / "sub", root)


def test_is_within_follows_symlinks(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (tmp_path / "via").symlink_to(root)
    assert not is_within(root / "escape", root)
    assert not is_within(root / "escape" / "f", root)
    assert is_within(tmp_path / "via" / "f", root)  # outside by name, inside once resolved
    assert is_within(root / "f", tmp_path / "via")


# ----------------------------------------------------------------------------------------------
# human_bytes / format_ranges
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,text", [
    (0, "0 B"),
    (999, "999 B"),
    (1000, "1.00 KB"),
    (1536, "1.54 KB"),  # decimal units: not 1.50 KiB
    (64 * 1024 * 1024, "67.11 MB"),
    (1_560_000_000_000, "1.56 TB"),  # as the K3 docs say
    (3 * 10**15, "3.00 PB"),
    (5 * 10**18, "5000.00 PB"),
])
def test_human_bytes_is_decimal(n: int, text: str) -> None:
    assert human_bytes(n) == text


@pytest.mark.parametrize("nums,text", [
    ([], "none"),
    ([3], "3"),
    ([4, 5], "4-5"),
    ([1, 3, 5], "1,3,5"),
    ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"),
    ([0, 1, 2, 3, 4, 5, 6, 7], "0-7"),
])
def test_format_ranges(nums: list[int], text: str) -> None:
    assert format_ranges(nums) == text
