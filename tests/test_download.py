"""Tests for k3ckpt.download (the parallel, resumable, verified downloader) against the loopback
hub emulator: both hubs, every injected fault, crash/resume by SIGKILL at chosen moments,
hostile listings, symlinked destinations, the destination lock and the disk-space check.

Chunks are 64 KiB so the 1.6 MB shard has 26 chunks (some past the 1 MiB range-skip limit).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from helpers import REPO
from k3ckpt.hub import download
from k3ckpt.hub.client import HubFile, HubListing, RetryPolicy, list_repo
from k3ckpt.hub.download import DiskSpaceError, FetchLockedError, FetchResult, fetch_files
from k3ckpt.testing.hub import LoopbackHub

HUBS = ("hf", "modelscope")
BIG = "model-00001-of-000008.safetensors"  # 1.6 MB: 26 chunks of 64 KiB
NESTED = "tokenizer/vocab.txt"
EMPTY = "empty.txt"
CHUNK = 64 * 1024

pytestmark = pytest.mark.usefixtures("isolated_hub_clients")


# ----------------------------------------------------------------------------------------------
# fixtures and helpers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of k3_tiny plus a nested file and an empty file."""
    dest = tmp_path_factory.mktemp("download") / "Kimi-K3"
    shutil.copytree(k3_tiny, dest)
    (dest / "tokenizer").mkdir()
    (dest / NESTED).write_text("hello\nworld\n")
    (dest / EMPTY).write_bytes(b"")
    return dest


@pytest.fixture(params=HUBS)
def which(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def listing(hub: LoopbackHub, which: str) -> HubListing:
    return list_repo(which, REPO, endpoint=hub.url, token="")


@pytest.fixture
def hf_listing(hub: LoopbackHub) -> HubListing:
    return list_repo("hf", REPO, endpoint=hub.url, token="")


class Sleeps(list):
    """A RetryPolicy.sleep that records instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def _fast(sleeps: Sleeps | None = None, attempts: int = 4) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, backoff=0.01, max_backoff=0.05, sleep=sleeps if sleeps is not None else Sleeps())


def _assert_identical(served: Path, dest: Path, paths: list[str]) -> None:
    for rel in paths:
        assert (dest / rel).read_bytes() == (served / rel).read_bytes(), rel


def _no_partial_finals(served: Path, dest: Path, listing: HubListing) -> None:
    """Every file under its final name is complete and correct (partials only as .part)."""
    for rel in listing.files:
        p = dest / rel
        if p.exists():
            assert p.read_bytes() == (served / rel).read_bytes(), f"{rel} is under its final name but wrong"


def _bytes_kept(dest: Path, listing: HubListing) -> int:
    """Bytes a killed run left for the next one: files under their final name, and the chunks
    each ``.part``'s journal names."""
    kept = 0
    for rel, entry in listing.files.items():
        journal = Path(f"{dest / rel}.part.journal")
        if (dest / rel).exists():
            kept += entry.size
        elif journal.exists():
            doc = json.loads(journal.read_text())
            kept += sum(min(doc["chunk_size"], entry.size - i * doc["chunk_size"]) for i in doc["done"])
    return kept


def _work_files(dest: Path) -> list[str]:
    return sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")
                  if p.name.endswith((".part", ".journal")) or p.name.startswith(download.LOCK_NAME))


# ----------------------------------------------------------------------------------------------
# the happy path
# ----------------------------------------------------------------------------------------------


def test_fetch_identical_then_everything_skipped(hub: LoopbackHub, listing: HubListing, served: Path,
                                                tmp_path: Path) -> None:
    dest = tmp_path / "out"
    plans: list[int] = []
    seen: list[int] = []
    lock = threading.Lock()

    def progress(n: int) -> None:
        with lock:
            seen.append(n)

    r = fetch_files(listing, dest, chunk_size=CHUNK, token="", progress=progress, on_plan=plans.append)
    assert r.ok and not r.failed and not r.skipped
    assert sorted(r.fetched) == sorted(listing.files)
    total = sum(f.size for f in listing.files.values())
    assert r.bytes_total == total and r.bytes_downloaded == total == sum(seen) == plans[0]
    assert hub.requests(BIG) == -(-listing.files[BIG].size // CHUNK)  # one request per chunk
    _assert_identical(served, dest, list(listing.files))
    assert _work_files(dest) == []  # no .part, journal or lock left behind
    doc = r.to_json()
    assert doc["ok"] is True and json.loads(json.dumps(doc)) == doc

    hub.reset_counters()
    r2 = fetch_files(listing, dest, chunk_size=CHUNK, token="", on_plan=plans.append)
    assert r2.ok and r2.fetched == [] and sorted(r2.skipped) == sorted(listing.files)
    assert r2.bytes_downloaded == 0 and plans[-1] == 0 and hub.total_bytes_sent() == 0


def test_the_client_is_loaded_before_the_workers_start(hf_listing: HubListing, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub client's URL builder is imported in the calling thread before the download
    workers start: a worker importing it while the open-files limit is reached failed with an
    ImportError naming no limit (test_exhaustion's descriptor case, now and then)."""
    from k3ckpt.hub import client as hubclient

    calls: list[tuple[str, list[str]]] = []
    real_load = hubclient.load_client

    def load_client(hub: str) -> None:
        calls.append((threading.current_thread().name, [t.name for t in threading.enumerate()]))
        real_load(hub)

    monkeypatch.setattr(hubclient, "load_client", load_client)
    fetch_files(hf_listing, tmp_path / "o", ["config.json"], chunk_size=CHUNK, token="")
    assert len(calls) == 1 and calls[0][0] == threading.main_thread().name, calls
    assert not [name for name in calls[0][1] if name.startswith("k3ckpt-fetch")], calls  # no worker yet


def test_subset_and_unknown_path(hub: LoopbackHub, hf_listing: HubListing, served: Path, tmp_path: Path) -> None:
    r = fetch_files(hf_listing, tmp_path / "o", [NESTED, "config.json", "nope.bin"], chunk_size=CHUNK, token="")
    assert not r.ok and r.failed == {"nope.bin": "not in the listing"}
    assert sorted(r.fetched) == ["config.json", NESTED]
    _assert_identical(served, tmp_path / "o", ["config.json", NESTED])


def test_existing_wrong_file_is_replaced(hub: LoopbackHub, hf_listing: HubListing, served: Path,
                                         tmp_path: Path) -> None:
    dest = tmp_path / "o"
    dest.mkdir()
    data = bytearray((served / BIG).read_bytes())
    data[100] ^= 1  # same size, wrong content: must be hashed, not trusted by size
    (dest / BIG).write_bytes(bytes(data))
    r = fetch_files(hf_listing, dest, [BIG, "config.json"], chunk_size=CHUNK, token="")
    assert r.ok and sorted(r.fetched) == sorted([BIG, "config.json"])
    _assert_identical(served, dest, [BIG])


# ----------------------------------------------------------------------------------------------
# faults
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,params", [
    ("drop_after", {"after": 1000}),
    ("drop_after", {"after": 1000, "reset": False}),
    ("status", {"status": 503}),
    ("status", {"status": 500}),
    ("short_body", {"missing": 7}),
    ("ignore_range", {}),
    ("ignore_range_with_content_range", {}),
], ids=lambda v: str(v) if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_one_shot_faults_are_survived(kind: str, params: dict[str, Any], hub: LoopbackHub, listing: HubListing,
                                      served: Path, tmp_path: Path) -> None:
    fault = hub.inject(kind, BIG, times=3, **params)
    sleeps = Sleeps()
    r = fetch_files(listing, tmp_path / "o", [BIG], chunk_size=CHUNK, token="", retry=_fast(sleeps))
    assert r.ok, r.failed
    if kind == "ignore_range":
        # Each ranged request sent before the first whole-file answer came back gets one too; how
        # many that is depends on the threads' timing. Then one plain GET fetches the file.
        assert 1 <= fault.hits <= 3 and len(r.notes) == 1 and "the server ignores Range" in r.notes[0], r.notes
    else:
        assert fault.hits == 3
    _assert_identical(served, tmp_path / "o", [BIG])
    if kind not in ("ignore_range", "ignore_range_with_content_range"):
        assert len(sleeps) == 3  # one backoff per faulty answer


def test_429_honours_retry_after(hub: LoopbackHub, hf_listing: HubListing, served: Path, tmp_path: Path) -> None:
    hub.inject("status", BIG, times=1, status=429, retry_after=7)
    hub.inject("status", NESTED, times=1, status=503)
    sleeps = Sleeps()
    r = fetch_files(hf_listing, tmp_path / "o", [BIG, NESTED], chunk_size=CHUNK, token="",
                    retry=RetryPolicy(backoff=2.0, sleep=sleeps))
    assert r.ok
    assert 7.0 in sleeps  # Retry-After as given, no jitter
    other = [s for s in sleeps if s != 7.0]
    assert len(other) == 1 and 1.0 <= other[0] <= 2.0  # backoff 2 s with equal jitter


def test_stall_times_out_and_is_retried(hub: LoopbackHub, hf_listing: HubListing, served: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(download, "TIMEOUT", 0.5)
    fault = hub.inject("stall", BIG, times=1, after=1000, seconds=10)
    sleeps = Sleeps()
    t0 = time.monotonic()
    r = fetch_files(hf_listing, tmp_path / "o", [BIG], chunk_size=CHUNK, token="", retry=_fast(sleeps, attempts=6))
    # >= 1: the emulator's small listen backlog can also make a connect exceed the 0.5 s timeout.
    assert r.ok and fault.hits == 1 and len(sleeps) >= 1
    assert time.monotonic() - t0 < 6  # gave up on the stalled body, did not wait it out
    _assert_identical(served, tmp_path / "o", [BIG])


def test_persistent_ignore_range_falls_back_to_one_sequential_get(hub: LoopbackHub, listing: HubListing,
                                                                  served: Path, tmp_path: Path) -> None:
    fault = hub.inject("ignore_range", BIG, times=None)
    dest = tmp_path / "o"
    size = listing.files[BIG].size
    assert size > 2 * CHUNK
    r = fetch_files(listing, dest, [BIG, "config.json"], chunk_size=CHUNK, token="", workers=4,
                    retry=_fast(attempts=2))
    assert r.ok, r.failed
    assert sorted(r.fetched) == sorted([BIG, "config.json"])
    assert len(r.notes) == 1 and BIG in r.notes[0] and "ignores Range" in r.notes[0]
    assert fault.hits >= 1  # the ranged GETs that were answered with the whole file
    # Those answers were abandoned unread: the file's bytes came once, in the sequential GET.
    assert r.bytes_downloaded == size + listing.files["config.json"].size
    _assert_identical(served, dest, [BIG])
    assert not (dest / (BIG + ".part")).exists() and not (dest / (BIG + ".part.journal")).exists()


def test_range_dropped_mid_file_rehashes_the_rewritten_chunks(hub: LoopbackHub, listing: HubListing,
                                                               served: Path, tmp_path: Path) -> None:
    """The server honours Range for chunk 0, then ignores it: the whole-file GET rewrites chunk
    0 with (here) a flipped byte. The digest must cover the rewritten bytes, not the ranged ones
    hashed earlier, so the file is refused rather than renamed with the bad byte."""
    hub.inject("ignore_range", BIG, times=None, skip=1)
    corrupt = hub.inject("corrupt_byte", BIG, times=None, skip=1, offset=10)
    dest = tmp_path / "o"
    r = fetch_files(listing, dest, [BIG], chunk_size=CHUNK, token="", workers=1, retry=_fast(attempts=2))
    assert corrupt.skipped == 1 and corrupt.hits >= 1  # chunk 0 came clean, the whole-file GETs did not
    assert not r.ok and "sha256" in r.failed[BIG]
    assert not (dest / BIG).exists()


def test_sequential_fallback_journals_chunks_and_resumes(hub: LoopbackHub, listing: HubListing, served: Path,
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-file GET dies mid-body: the chunks it completed are journaled with their exact
    bytes (nothing shifted), and the retry completes the file."""
    monkeypatch.setattr(download, "PIECE", 16 * 1024)  # a reset loses the piece being read
    hub.inject("ignore_range", BIG, times=None)
    size = listing.files[BIG].size
    # Two hits: the first ranged GET (answered with the whole file, abandoned unread), then the
    # sequential GET.
    # reset=False: the body ends with a FIN, so every byte sent before it arrives (an RST would
    # let the kernel discard received bytes not yet read).
    drop = hub.inject("drop_after", BIG, times=2, after=2 * CHUNK + 100, reset=False)
    dest = tmp_path / "o"
    r = fetch_files(listing, dest, [BIG], chunk_size=CHUNK, token="", workers=1, retry=_fast(attempts=1))
    assert not r.ok and drop.hits == 2
    assert f"connection lost after {2 * CHUNK + 100} of {size} bytes" in r.failed[BIG]
    journal = json.loads((dest / (BIG + ".part.journal")).read_text())
    assert journal["done"] == [0, 1]
    part = (dest / (BIG + ".part")).read_bytes()
    src = (served / BIG).read_bytes()
    assert part[:2 * CHUNK] == src[:2 * CHUNK]
    assert not (dest / BIG).exists()
    r = fetch_files(listing, dest, [BIG], chunk_size=CHUNK, token="", workers=2, retry=_fast())
    assert r.ok and r.fetched == [BIG]
    assert r.bytes_downloaded == size  # no Range: the resumed run reads the file from byte 0
    _assert_identical(served, dest, [BIG])


def test_one_corrupt_byte_refetched_once(hub: LoopbackHub, listing: HubListing, served: Path,
                                         tmp_path: Path) -> None:
    size = listing.files[BIG].size
    hub.inject("corrupt_byte", BIG, times=1, offset=size // 2)
    r = fetch_files(listing, tmp_path / "o", [BIG], chunk_size=CHUNK, token="", retry=_fast())
    assert r.ok and r.fetched == [BIG]
    assert r.bytes_downloaded == 2 * size  # verified, mismatched, re-fetched in full once
    _assert_identical(served, tmp_path / "o", [BIG])


def test_persistent_corruption_is_reported(hub: LoopbackHub, listing: HubListing, tmp_path: Path) -> None:
    hub.inject("corrupt_byte", BIG, times=None, offset=5)
    dest = tmp_path / "o"
    r = fetch_files(listing, dest, [BIG, "config.json"], chunk_size=CHUNK, token="", retry=_fast())
    assert not r.ok and list(r.failed) == [BIG] and "sha256 mismatch" in r.failed[BIG]
    assert r.fetched == ["config.json"]
    assert not (dest / BIG).exists()
    assert _work_files(dest) == []  # known-bad .part and journal are not kept


def test_git_sha1_verified_small_file_corruption(hub: LoopbackHub, hf_listing: HubListing, tmp_path: Path) -> None:
    assert hf_listing.files["config.json"].sha256 is None and hf_listing.files["config.json"].git_sha1
    hub.inject("corrupt_byte", "config.json", times=None, offset=3)
    r = fetch_files(hf_listing, tmp_path / "o", ["config.json"], chunk_size=CHUNK, token="", retry=_fast())
    assert not r.ok and "git blob id mismatch" in r.failed["config.json"]
    assert not (tmp_path / "o" / "config.json").exists()


def test_zero_byte_body_for_non_empty_file_fails(hub: LoopbackHub, listing: HubListing, tmp_path: Path) -> None:
    hub.inject("short_body", "config.json", times=None, missing=10**9)
    r = fetch_files(listing, tmp_path / "o", ["config.json", EMPTY], chunk_size=CHUNK, token="", retry=_fast())
    assert not r.ok and "empty body" in r.failed["config.json"]
    assert not (tmp_path / "o" / "config.json").exists()
    assert r.fetched == [EMPTY] and (tmp_path / "o" / EMPTY).read_bytes() == b""  # a real empty file is fine


def test_not_found_is_not_retried(hub: LoopbackHub, hf_listing: HubListing, tmp_path: Path) -> None:
    sha = hashlib.sha256(b"x").hexdigest()
    bogus = HubListing(hf_listing.hub, hf_listing.repo, hf_listing.revision, hf_listing.endpoint,
                       {"missing.bin": HubFile("missing.bin", 1, sha, None)})
    sleeps = Sleeps()
    r = fetch_files(bogus, tmp_path / "o", chunk_size=CHUNK, token="", retry=_fast(sleeps))
    assert not r.ok and "404" in r.failed["missing.bin"] and sleeps == []


# ----------------------------------------------------------------------------------------------
# hostile names and destinations
# ----------------------------------------------------------------------------------------------


def test_hostile_listing_refused(hub: LoopbackHub, hf_listing: HubListing, tmp_path: Path) -> None:
    sha = hashlib.sha256(b"pwned").hexdigest()
    names = ["../../x", "/etc/evil", "a/../../b", "ok/./x", "c:\\win", "x.part", download.LOCK_NAME]
    files = {n: HubFile(n, 5, sha, None) for n in names}
    files["config.json"] = hf_listing.files["config.json"]
    bogus = HubListing(hf_listing.hub, hf_listing.repo, hf_listing.revision, hf_listing.endpoint, files)
    root = tmp_path / "a" / "b"
    dest = root / "dest"
    r = fetch_files(bogus, dest, chunk_size=CHUNK, token="")
    assert sorted(r.failed) == sorted(names) and r.fetched == ["config.json"] and not r.ok
    assert all("refusing" in why for why in r.failed.values())
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "a", "a/b", "a/b/dest", "a/b/dest/config.json"]
    assert sum(hub.requests(n) for n in names) == 0


def test_symlinked_directory_outside_dest_refused(hub: LoopbackHub, hf_listing: HubListing, served: Path,
                                                  tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "tokenizer").symlink_to(outside)
    (dest / "config.json").symlink_to(outside / "config.json")  # a dangling link out, too
    r = fetch_files(hf_listing, dest, [NESTED, "config.json", "LICENSE"], chunk_size=CHUNK, token="")
    assert sorted(r.failed) == ["config.json", NESTED] and "symlink" in r.failed[NESTED]
    assert r.fetched == ["LICENSE"]
    assert list(outside.iterdir()) == []


def test_symlinked_dest_itself_and_inside_links_are_fine(hub: LoopbackHub, hf_listing: HubListing, served: Path,
                                                         tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "tokenizer").symlink_to(real / "sub")  # stays inside dest
    link = tmp_path / "link"
    link.symlink_to(real)
    r = fetch_files(hf_listing, link, [NESTED], chunk_size=CHUNK, token="")
    assert r.ok and (real / "sub" / "vocab.txt").read_text() == "hello\nworld\n"


# ----------------------------------------------------------------------------------------------
# lock and disk space
# ----------------------------------------------------------------------------------------------


def test_second_concurrent_fetch_is_locked_out(hub: LoopbackHub, hf_listing: HubListing, served: Path,
                                               tmp_path: Path) -> None:
    dest = tmp_path / "o"
    hub.inject("stall", BIG, times=1, after=1000, seconds=1.5)
    results: list[FetchResult] = []
    t = threading.Thread(target=lambda: results.append(
        fetch_files(hf_listing, dest, [BIG], chunk_size=CHUNK, token="", retry=_fast())))
    t.start()
    lock = dest / download.LOCK_NAME
    deadline = time.monotonic() + 5
    while not lock.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(FetchLockedError) as ei:
        fetch_files(hf_listing, dest, [BIG], chunk_size=CHUNK, token="")
    assert f"pid {os.getpid()}" in str(ei.value) and socket.gethostname() in str(ei.value)
    t.join(10)
    assert results and results[0].ok
    assert not lock.exists()
    _assert_identical(served, dest, [BIG])


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_locks(hub: LoopbackHub, hf_listing: HubListing, tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "o"
    dest.mkdir()
    lock = dest / download.LOCK_NAME
    # Same host, dead pid: stale, recovered.
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "started": time.time(), "token": "t"}))
    assert fetch_files(hf_listing, dest, ["LICENSE"], chunk_size=CHUNK, token="").ok
    assert not lock.exists()
    # Another host, recent: we cannot check its pid, so it is live.
    lock.write_text(json.dumps({"host": "node-17.example", "pid": 4242, "started": time.time(), "token": "t"}))
    with pytest.raises(FetchLockedError, match=r"pid 4242 on host node-17\.example"):
        fetch_files(hf_listing, dest, ["LICENSE"], chunk_size=CHUNK, token="")
    # ... until it is older than K3CKPT_LOCK_STALE_SECONDS.
    old = time.time() - 120
    os.utime(lock, (old, old))
    monkeypatch.setenv("K3CKPT_LOCK_STALE_SECONDS", "60")
    assert fetch_files(hf_listing, dest, ["LICENSE"], chunk_size=CHUNK, token="").ok
    assert not lock.exists()


def test_disk_space_checked_before_any_byte(hub: LoopbackHub, hf_listing: HubListing, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    dest = tmp_path / "o"
    needed = sum(f.size for f in hf_listing.files.values() if f.size)
    with pytest.raises(DiskSpaceError) as ei:
        fetch_files(hf_listing, dest, chunk_size=CHUNK, token="")
    assert f"need {needed} bytes" in str(ei.value) and "only 1000 bytes" in str(ei.value)
    assert hub.total_bytes_sent() == 0 and not dest.exists()  # (the refused run removed the directory it made)
    # check_space=False skips the check.
    assert fetch_files(hf_listing, dest, ["LICENSE"], chunk_size=CHUNK, token="", check_space=False).ok


# ----------------------------------------------------------------------------------------------
# crash and resume
# ----------------------------------------------------------------------------------------------

_CHILD = """
import faulthandler, signal, sys, threading
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks when it hangs
# A run started from a background job of a non-interactive shell inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler: this test is about Ctrl-C, so take it back.
signal.signal(signal.SIGINT, signal.default_int_handler)
from k3ckpt.hub.download import fetch_files
from k3ckpt.hub.client import list_repo
which, url, repo, dest, chunk, workers = sys.argv[1:7]
listing = list_repo(which, repo, endpoint=url, token="")
received, lock = [0], threading.Lock()
def progress(n):
    with lock:
        received[0] += n
try:
    r = fetch_files(listing, dest, chunk_size=int(chunk), workers=int(workers), token="", progress=progress)
except KeyboardInterrupt:
    print(f"RECEIVED {received[0]}", file=sys.stderr)  # what this run got before it stopped
    raise
sys.exit(0 if r.ok else 1)
"""


def _child(which: str, hub: LoopbackHub, dest: Path, tmp_path: Path, workers: int,
           pause: str | None) -> tuple[subprocess.Popen[bytes], Path]:
    marker = tmp_path / "paused"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MODELSCOPE_", "K3CKPT_"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
               MODELSCOPE_CACHE=str(tmp_path / "ms-cache"), MODELSCOPE_HOME=str(tmp_path / "ms-home"),
               K3CKPT_TEST_PAUSE_FILE=str(marker))
    if pause:
        env["K3CKPT_TEST_PAUSE_AT"] = pause
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, which, hub.url, REPO, str(dest), str(CHUNK), str(workers)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, marker


def _wait(cond: Any, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}) before {what}: {proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("point", ["after_chunk:1", "after_chunk:40", "before_rename", "mid_body"])
def test_sigkill_then_resume(point: str, hub: LoopbackHub, listing: HubListing, which: str, served: Path,
                             tmp_path: Path) -> None:
    workers = 3
    dest = tmp_path / "o"
    if point == "mid_body":
        fault = hub.inject("stall", BIG, times=1, after=CHUNK // 2, seconds=20)
        proc, _ = _child(which, hub, dest, tmp_path, workers, None)
        _wait(lambda: fault.hits == 1 and hub.bytes_sent(BIG) >= CHUNK // 2, proc, "the stalled body")
        time.sleep(0.2)  # let other workers get mid-chunk too
    else:
        proc, marker = _child(which, hub, dest, tmp_path, workers, point)
        _wait(marker.exists, proc, f"pause point {point}")
    proc.kill()
    proc.wait()
    # What the killed run was sent. Counted now: afterwards the hub may still accept connections
    # the dead client had queued and push whole bodies into their dead sockets.
    sent_to_killed_run = hub.total_bytes_sent()
    hub.faults.clear()
    _no_partial_finals(served, dest, listing)
    assert (dest / download.LOCK_NAME).exists()  # the dead run's lock: stale, must be recovered
    if point == "before_rename":
        # another worker's .part may not have its first journal yet when the pause is reached (a
        # legal state: a .part without a journal is re-fetched); the paused file's journal is there
        journals = [Path(str(p) + ".journal") for p in dest.rglob("*.part")]
        done = [j for j in journals if j.exists() and json.loads(j.read_text())["done"]]
        assert done  # a complete .part waiting for its rename, not under the final name

    first_run = {rel: hub.bytes_sent(rel) for rel in listing.files}
    kept = _bytes_kept(dest, listing)
    r = fetch_files(listing, dest, chunk_size=CHUNK, workers=workers, token="")
    assert r.ok, r.failed
    _assert_identical(served, dest, list(listing.files))
    assert _work_files(dest) == []
    total = sum(f.size for f in listing.files.values())
    # Exactly what the dead run had not made durable is downloaded again: no kept byte twice.
    assert r.bytes_downloaded == total - kept, (r.bytes_downloaded, total, kept)
    assert kept > 0 or point == "mid_body"  # a pause point comes after a journaled chunk
    # The dead run lost at most the request each worker had in flight.
    assert sent_to_killed_run - kept <= workers * CHUNK, (sent_to_killed_run, kept, first_run)


def test_foreign_journal_discarded(hub: LoopbackHub, hf_listing: HubListing, served: Path, tmp_path: Path) -> None:
    """A journal for other content (here: another sha256) must not vouch for the .part's bytes."""
    dest = tmp_path / "o"
    dest.mkdir()
    entry = hf_listing.files[BIG]
    (dest / (BIG + ".part")).write_bytes(b"\0" * entry.size)
    nchunks = -(-entry.size // CHUNK)
    doc = {"version": 1, "path": BIG, "size": entry.size, "sha256": "0" * 64, "git_sha1": None,
           "chunk_size": CHUNK, "done": list(range(nchunks))}
    (dest / (BIG + ".part.journal")).write_text(json.dumps(doc))
    r = fetch_files(hf_listing, dest, [BIG], chunk_size=CHUNK, token="")
    assert r.ok and r.bytes_downloaded == entry.size
    _assert_identical(served, dest, [BIG])


def test_ctrl_c_stops_promptly_releases_lock_and_resumes(hub: LoopbackHub, hf_listing: HubListing, served: Path,
                                                         tmp_path: Path) -> None:
    dest = tmp_path / "o"
    fault = hub.inject("stall", BIG, times=1, after=CHUNK // 2, seconds=20)
    proc, _ = _child("hf", hub, dest, tmp_path, 3, None)
    _wait(lambda: fault.hits == 1 and hub.bytes_sent(BIG) >= CHUNK // 2, proc, "the stalled body")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # every thread's stack, to say where it hangs
        time.sleep(1)
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError("the fetch did not stop within 15 s of SIGINT:\n" + err.decode(errors="replace")[-6000:]) from None
    assert time.monotonic() - t0 < 8  # does not wait out the 20 s stall nor the read timeout
    assert proc.returncode != 0 and b"KeyboardInterrupt" in err
    assert not (dest / download.LOCK_NAME).exists()  # released on the way out
    _no_partial_finals(served, dest, hf_listing)
    hub.faults.clear()
    r = fetch_files(hf_listing, dest, chunk_size=CHUNK, workers=3, token="")
    assert r.ok
    _assert_identical(served, dest, list(hf_listing.files))
    # Received by the stopped run (it says so on its way out) but fetched again: at most the
    # chunks in flight. Counted by the client: the hub's counter also holds what it pushed into
    # sockets the stopping run had stopped reading, which grows with the machine's load.
    received = int(re.search(rb"RECEIVED (\d+)", err).group(1))  # type: ignore[union-attr]
    kept = sum(f.size for f in hf_listing.files.values()) - r.bytes_downloaded
    assert received - kept <= 3 * CHUNK


# ----------------------------------------------------------------------------------------------
# hashing as the bytes arrive, and O_DIRECT writes
# ----------------------------------------------------------------------------------------------


def _direct_io_supported(where: Path) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(where / "direct-probe", os.O_RDWR | os.O_CREAT | flag, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(where / "direct-probe")
    return True


def _is_part(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").endswith(".part")
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
@pytest.mark.parametrize("direct", ["on", "off"])
def test_one_worker_per_file_hashes_what_it_receives(direct: str, hub: LoopbackHub, listing: HubListing,
                                                     served: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks fetched in file order are hashed from the receive buffer: no byte is read back
    from a .part (the old way read every chunk back from the page cache)."""
    monkeypatch.setenv("K3CKPT_DIRECT_IO", direct)
    read_back: list[int] = []
    preadv = os.preadv

    def counting_preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if _is_part(fd):
            read_back.append(offset)
        return preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    r = fetch_files(listing, tmp_path / "o", chunk_size=CHUNK, token="", workers=1, retry=_fast())
    assert r.ok, r.failed
    _assert_identical(served, tmp_path / "o", list(listing.files))
    assert read_back == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
@pytest.mark.parametrize("share", ["off", "on"])
def test_spare_workers_share_a_file_only_as_k3ckpt_share_files_says(share: str, hub: LoopbackHub,
                                                                     listing: HubListing, served: Path,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight workers, one file. Off: one worker streams it and the others stay idle, so no byte
    is read back. On: they share it from the start, and the chunks done ahead of the digest
    are read back from the .part - among them requests whose earlier pieces were still being
    written when the digest reached them, which must be on disk first: the file verifies at
    its first try (no whole-file re-fetch, which a mismatch would cause)."""
    monkeypatch.setenv("K3CKPT_SHARE_FILES", share)
    read_back: list[int] = []
    preadv = os.preadv

    def counting_preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if _is_part(fd):
            read_back.append(offset)
        return preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    size = listing.files[BIG].size
    r = fetch_files(listing, tmp_path / "o", [BIG], chunk_size=CHUNK, token="", workers=8, retry=_fast())
    assert r.ok, r.failed
    assert r.bytes_downloaded == size
    _assert_identical(served, tmp_path / "o", [BIG])
    assert (read_back != []) is (share == "on"), len(read_back)


@pytest.mark.parametrize("workers", [1, 8])
def test_corrupt_byte_mid_chunk_never_reaches_the_final_name(workers: int, hub: LoopbackHub, listing: HubListing,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashed as it arrives (one worker) or read back (several on one file): a byte flipped in
    the middle of a chunk, every time it is served, fails the file before its rename."""
    monkeypatch.setenv("K3CKPT_SHARE_FILES", "on")  # the eight workers share the file from the start
    hub.inject("corrupt_byte", BIG, times=None, offset=3 * CHUNK + CHUNK // 3)
    dest = tmp_path / "o"
    r = fetch_files(listing, dest, [BIG], chunk_size=CHUNK, token="", workers=workers, retry=_fast())
    assert not r.ok and "sha256 mismatch" in r.failed[BIG]
    assert not (dest / BIG).exists() and _work_files(dest) == []


def test_a_request_lost_mid_chunk_is_unhashed_before_its_retry(hub: LoopbackHub, listing: HubListing,
                                                               served: Path, tmp_path: Path) -> None:
    """The bytes a failed request fed to the file's digest are taken back (the retry sends them
    again): the file verifies at once, with no whole-file re-fetch. Without the rollback they
    would be hashed twice, the digest would not match and the file would be fetched again."""
    size = listing.files[BIG].size
    # FIN, not RST: every byte sent before the close is received (and hashed) first
    drop = hub.inject("drop_after", BIG, times=1, after=CHUNK // 2, reset=False)
    r = fetch_files(listing, tmp_path / "o", [BIG], chunk_size=CHUNK, token="", workers=1, retry=_fast())
    assert r.ok and drop.hits == 1
    assert r.bytes_downloaded == size + CHUNK // 2
    _assert_identical(served, tmp_path / "o", [BIG])


@pytest.mark.parametrize("workers", [1, 8])
def test_resumed_bytes_are_hashed_too(workers: int, hub: LoopbackHub, hf_listing: HubListing, served: Path,
                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks journaled by an earlier run are not fetched again, but their bytes on disk are
    still part of the digest: one rotten there makes the file fail its check and be fetched
    again in full, never renamed with it."""
    monkeypatch.setenv("K3CKPT_SHARE_FILES", "on")
    dest = tmp_path / "o"
    dest.mkdir()
    entry = hf_listing.files[BIG]
    data = bytearray((served / BIG).read_bytes())
    data[CHUNK + 7] ^= 0xFF  # in chunk 1, "written before the kill"
    (dest / (BIG + ".part")).write_bytes(bytes(data))
    nchunks = -(-entry.size // CHUNK)
    doc = {"version": 1, "path": BIG, "size": entry.size, "sha256": entry.sha256, "git_sha1": entry.git_sha1,
           "chunk_size": CHUNK, "done": list(range(nchunks - 1))}
    (dest / (BIG + ".part.journal")).write_text(json.dumps(doc))
    r = fetch_files(hf_listing, dest, [BIG], chunk_size=CHUNK, token="", workers=workers, retry=_fast())
    assert r.ok, r.failed
    last = entry.size - (nchunks - 1) * CHUNK
    assert r.bytes_downloaded == last + entry.size  # the missing chunk, then the whole file again
    _assert_identical(served, dest, [BIG])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
@pytest.mark.parametrize("direct", ["on", "off", "nfs"])
def test_direct_io_takes_the_aligned_pieces(direct: str, hub: LoopbackHub, hf_listing: HubListing, served: Path,
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With K3CKPT_DIRECT_IO on (the default) on a local disk's filesystem, aligned pieces are
    written with O_DIRECT and the rest (a file's unaligned tail) through the page cache; off,
    or on a network filesystem (here a mount table saying NFS), nothing is written with
    O_DIRECT. The files are the same either way."""
    import fcntl

    local = download.filesystem_of(tmp_path) in download.DIRECT_IO_FILESYSTEMS
    if direct != "off" and not (local and _direct_io_supported(tmp_path)):
        pytest.skip("the temporary directory is not on a local filesystem with O_DIRECT")
    monkeypatch.setenv("K3CKPT_DIRECT_IO", "off" if direct == "off" else "on")
    if direct == "nfs":
        table = tmp_path / "mountinfo"
        table.write_text(f"21 1 0:21 / / rw,relatime - ext4 /dev/vda rw\n"
                         f"40 21 0:40 / {os.path.realpath(tmp_path)} rw,relatime - nfs4 server:/export rw,vers=4.2\n")
        monkeypatch.setattr(download, "MOUNTINFO", str(table))
        assert download.filesystem_of(tmp_path / "o") == "nfs4"
    writes: list[tuple[bool, int, int]] = []
    pwrite = os.pwrite

    def recording_pwrite(fd: int, data: Any, offset: int) -> int:
        if _is_part(fd):
            writes.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, len(data)))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", recording_pwrite)
    dest = tmp_path / "o"
    r = fetch_files(hf_listing, dest, [BIG, "config.json"], chunk_size=CHUNK, token="", workers=2, retry=_fast())
    assert r.ok, r.failed
    _assert_identical(served, dest, [BIG, "config.json"])
    direct_writes = [(o, n) for d, o, n in writes if d]
    if direct != "on":
        assert writes and not direct_writes
        return
    assert direct_writes and all(o % 4096 == 0 and n % 4096 == 0 for o, n in direct_writes)
    buffered = [(o, n) for d, o, n in writes if not d]
    assert all(o % 4096 or n < 4096 for o, n in buffered)  # only what O_DIRECT cannot take
    assert sum(n for _, n in direct_writes) >= hf_listing.files[BIG].size - 4096


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name descriptors")
def test_chunks_started_ahead_of_the_digest_go_through_the_page_cache(hub: LoopbackHub, listing: HubListing,
                                                                     served: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight workers sharing one file written with O_DIRECT: a chunk whose request starts ahead
    of the digest is written through the page cache instead, read back from it (not through
    the O_DIRECT descriptor, which would go to the disk), and its pages let go once hashed;
    the chunks in line are still written with O_DIRECT. The file is the same either way."""
    import fcntl

    if not (download.filesystem_of(tmp_path) in download.DIRECT_IO_FILESYSTEMS and _direct_io_supported(tmp_path)):
        pytest.skip("the temporary directory is not on a local filesystem with O_DIRECT")
    monkeypatch.setenv("K3CKPT_DIRECT_IO", "on")
    monkeypatch.setenv("K3CKPT_SHARE_FILES", "on")  # the eight workers share the file from the start

    def is_direct(fd: int) -> bool:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)

    writes: list[tuple[bool, int]] = []
    reads: list[tuple[bool, int]] = []
    released: list[tuple[int, int]] = []
    pwrite, preadv, fadvise = os.pwrite, os.preadv, os.posix_fadvise

    def recording_pwrite(fd: int, data: Any, offset: int) -> int:
        if _is_part(fd):
            writes.append((is_direct(fd), offset))
        return pwrite(fd, data, offset)

    def recording_preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if _is_part(fd):
            reads.append((is_direct(fd), offset))
        return preadv(fd, buffers, offset, *args)

    def recording_fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if _is_part(fd) and advice == os.POSIX_FADV_DONTNEED:
            released.append((offset, length))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "pwrite", recording_pwrite)
    monkeypatch.setattr(os, "preadv", recording_preadv)
    monkeypatch.setattr(os, "posix_fadvise", recording_fadvise)
    size = listing.files[BIG].size
    r = fetch_files(listing, tmp_path / "o", [BIG], chunk_size=CHUNK, token="", workers=8, retry=_fast())
    assert r.ok, r.failed
    _assert_identical(served, tmp_path / "o", [BIG])
    full = size // CHUNK  # whole chunks (the last, shorter one has an unaligned tail either way)
    cached = {o // CHUNK for d, o in writes if not d and o // CHUNK < full}
    direct = {o // CHUNK for d, o in writes if d}
    assert cached and direct and not cached & direct, (sorted(cached), sorted(direct))
    assert 0 in direct  # the first chunk is in line from its first byte
    read_cached = {o // CHUNK for d, o in reads if not d} & cached
    assert read_cached and not any(d for d, o in reads if o // CHUNK in cached)
    for i in cached:  # every cached chunk is let go of, once hashed as it arrived or read back
        assert any(o <= i * CHUNK and i * CHUNK + CHUNK <= o + n for o, n in released), i


def test_filesystem_of_reads_the_mount_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "mountinfo"
    table.write_text("21 1 8:1 / / rw - ext4 /dev/vda rw\n"
                     "30 21 0:40 / /mnt/my\\040share rw - nfs4 srv:/x rw\n"
                     "31 21 0:41 / /mnt/my rw - xfs /dev/vdb rw\n"
                     "garbage line\n")
    monkeypatch.setattr(download, "MOUNTINFO", str(table))
    assert download.filesystem_of("/mnt/my share/a/b") == "nfs4"  # \040 is a space
    assert download.filesystem_of("/mnt/my/x") == "xfs"
    assert download.filesystem_of("/mnt/myself") == "ext4"  # a prefix of the name is not the mount
    monkeypatch.setattr(download, "MOUNTINFO", str(tmp_path / "absent"))
    assert download.filesystem_of("/") is None
