"""Tests for k3ckpt.hubclient against the loopback hub emulator (real huggingface_hub and
modelscope_hub clients for metadata, our own ranged GETs for bytes).

The emulator serves a *copy* of the session ``k3_tiny`` checkpoint plus a nested file with a space
in its name and an empty file.  Behaviours the emulator cannot produce (a Content-Range that
disagrees with the request, redirects, a compressed body) are served by a small scripted server
defined here.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import os
import random
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import REPO
from k3ckpt.env import K3CKPT_MAX_HEADER_BYTES
from k3ckpt.errors import EXIT_CANNOT_RUN, SafetensorsHeaderError
from k3ckpt.format.header import read_header
from k3ckpt.hub import client as hubclient
from k3ckpt.hub.client import (
    EntryNotFoundError,
    HubAuthError,
    HubError,
    HubFile,
    HubListing,
    HubListingError,
    HubShortReadError,
    HubUnreachableError,
    RangeMismatchError,
    RangeNotSupportedError,
    RepoNotFoundError,
    RetryPolicy,
    RevisionNotFoundError,
    UnsafePathError,
    auth_headers,
    fetch_header,
    file_url,
    list_repo,
    read_range,
    resolve_endpoint,
)
from k3ckpt.testing.hub import LoopbackHub

HUBS = ("hf", "modelscope")
BIG = "model-00001-of-000008.safetensors"  # 1.6 MB: offsets past the 1 MiB skip limit exist
NESTED = "tokenizer/vocab list.txt"  # a directory and a space (URL quoting on both hubs)
OVERRUN = "broken/overrun.safetensors"  # says its header is 1000 bytes; the file is 50
TOKEN = "s3cret-token"


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory, write_raw: Any) -> Path:
    """A private copy of k3_tiny with a nested file, an empty file and a shard whose length
    prefix runs past its end."""
    dest = tmp_path_factory.mktemp("hubclient") / "Kimi-K3"
    shutil.copytree(k3_tiny, dest)
    (dest / "tokenizer").mkdir()
    (dest / NESTED).write_text("hello\nworld\n")
    (dest / "empty.txt").write_bytes(b"")
    write_raw(dest / OVERRUN, {}, b"\0" * 40, length=1000)
    return dest


@pytest.fixture
def token_hub(served: Path, hash_cache: Path) -> Iterator[LoopbackHub]:
    with LoopbackHub({REPO: served}, cache_dir=hash_cache, token=TOKEN) as h:
        yield h


pytestmark = pytest.mark.usefixtures("isolated_hub_clients")


class Sleeps(list):
    """A RetryPolicy.sleep that records instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def _policy(sleeps: Sleeps, **kw: Any) -> RetryPolicy:
    return RetryPolicy(sleep=sleeps, **kw)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _local_files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def _settle(hub: LoopbackHub, path: str, requests: int, timeout: float = 5.0) -> None:
    """Wait until the hub is done with ``requests`` requests for ``path``.

    The emulator adds to ``bytes_sent`` *after* handing bytes to the socket, so the client can
    hold the bytes before the counter moves; once a request's record is ``finished`` its counts
    are in.
    """
    deadline = time.monotonic() + timeout
    while sum(r.file == path and r.finished for r in hub.request_log) < requests and time.monotonic() < deadline:
        time.sleep(0.005)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ----------------------------------------------------------------------------------------------
# listings
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", HUBS)
def test_list_repo_every_file_size_and_hash(which: str, hub: LoopbackHub, served: Path) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    local = _local_files(served)
    assert listing.hub == which and listing.repo == REPO and listing.endpoint == hub.url
    assert listing.revision == hub.commit(REPO)
    assert list(listing.files) == sorted(local)
    for name, p in local.items():
        data = p.read_bytes()
        f = listing.files[name]
        assert f.path == name and f.size == len(data)
        sha = hashlib.sha256(data).hexdigest()
        if which == "modelscope":
            assert (f.sha256, f.git_sha1) == (sha, None)
        elif name.endswith(".safetensors"):  # LFS on HF: sha256 known, no git blob id
            assert (f.sha256, f.git_sha1) == (sha, None)
        else:
            assert (f.sha256, f.git_sha1) == (None, _git_oid(data))
    # The empty file is listed with the (correct) empty-content hash on ModelScope.
    assert listing.files["empty.txt"].size == 0


@pytest.mark.parametrize("which", HUBS)
def test_revision_none_resolves_default_branch_and_pins_commit(which: str, hub: LoopbackHub) -> None:
    default = list_repo(which, REPO, endpoint=hub.url)
    branch = "main" if which == "hf" else "master"
    named = list_repo(which, REPO, branch, endpoint=hub.url)
    by_commit = list_repo(which, REPO, hub.commit(REPO), endpoint=hub.url)
    assert default.revision == named.revision == by_commit.revision == hub.commit(REPO)
    assert default.files == named.files == by_commit.files
    # URLs are pinned to the commit, never to the branch name.
    url = file_url(default, NESTED)
    assert hub.commit(REPO) in url and branch not in url.split("?")[0].split("/resolve/")[-1]


@pytest.mark.parametrize("which", HUBS)
def test_repo_and_revision_not_found(which: str, hub: LoopbackHub) -> None:
    with pytest.raises(RepoNotFoundError) as e:
        list_repo(which, "nobody/nothing", endpoint=hub.url)
    assert e.value.exit_code == EXIT_CANNOT_RUN
    assert f"{which}:nobody/nothing@" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RevisionNotFoundError) as e:
        list_repo(which, REPO, "no-such-branch", endpoint=hub.url)
    assert f"{which}:{REPO}@no-such-branch" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RevisionNotFoundError):
        list_repo(which, REPO, "0" * 40, endpoint=hub.url)  # a well-formed but unknown commit


@pytest.mark.parametrize("which", HUBS)
def test_unreachable_endpoint_names_it(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import urllib3.util.retry

    # modelscope_hub's API session retries a refused connection 5 times with 0.5..8 s backoff;
    # keep the retries, drop the waiting.
    monkeypatch.setattr(urllib3.util.retry.Retry, "get_backoff_time", lambda self: 0)
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(HubUnreachableError) as e:
        list_repo(which, REPO, endpoint=endpoint)
    assert f"cannot reach {endpoint}" in str(e.value) and REPO in str(e.value)
    assert e.value.exit_code == EXIT_CANNOT_RUN

    listing = HubListing(which, REPO, "a" * 40, endpoint, {"x.bin": HubFile("x.bin", 10, None, None)})
    sleeps = Sleeps()
    with pytest.raises(HubUnreachableError) as e:
        read_range(listing, "x.bin", 0, 4, retry=_policy(sleeps, attempts=3))
    assert f"cannot reach {endpoint}" in str(e.value) and "'x.bin'" in str(e.value)
    assert sleeps == [0.5, 1.0]


@pytest.mark.parametrize("bad", ["/etc/passwd", "../escape", "a/../../b", "a\\b", "a\x00b", "C:/x", "a//b", "./a"])
def test_unsafe_paths_refused_hf(bad: str, hub: LoopbackHub, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.hf_api import RepoSibling

    real = huggingface_hub.HfApi.model_info

    def model_info(self: Any, *args: Any, **kwargs: Any) -> Any:
        info = real(self, *args, **kwargs)
        info.siblings.append(RepoSibling(rfilename=bad, size=1, blob_id="0" * 40))
        return info

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    with pytest.raises(UnsafePathError) as e:
        list_repo("hf", REPO, endpoint=hub.url)
    assert repr(bad) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", ["/abs", "..", "x/../y", "dir\\file", "nul\x00"])
def test_unsafe_paths_refused_modelscope(bad: str, hub: LoopbackHub, monkeypatch: pytest.MonkeyPatch) -> None:
    import modelscope_hub
    from modelscope_hub.types import FileInfo

    real = modelscope_hub.HubApi.list_repo_files

    def list_repo_files(self: Any, *args: Any, **kwargs: Any) -> Any:
        return [*real(self, *args, **kwargs), FileInfo(path=bad, size=1, sha256="0" * 64)]

    monkeypatch.setattr(modelscope_hub.HubApi, "list_repo_files", list_repo_files)
    with pytest.raises(UnsafePathError):
        list_repo("modelscope", REPO, endpoint=hub.url)


def test_modelscope_empty_hash_for_nonempty_file_refused(hub: LoopbackHub, monkeypatch: pytest.MonkeyPatch) -> None:
    import modelscope_hub
    from modelscope_hub.types import FileInfo

    monkeypatch.setattr(modelscope_hub.HubApi, "list_repo_files", lambda self, *a, **k: [
        FileInfo(path="model.safetensors", size=123, sha256=hubclient.EMPTY_SHA256)])
    with pytest.raises(HubListingError, match="empty content for a 123-byte file"):
        list_repo("modelscope", REPO, endpoint=hub.url)


# ----------------------------------------------------------------------------------------------
# endpoints
# ----------------------------------------------------------------------------------------------


def test_modelscope_endpoint_from_env_despite_cached_default_config(
    hub: LoopbackHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelscope_hub.config import get_default_config

    # The process-wide default config is frozen on first use (here: modelscope.cn) ...
    assert get_default_config().endpoint == "https://modelscope.cn"
    # ... but a later MODELSCOPE_ENDPOINT still applies to us.
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", hub.url + "/")
    assert resolve_endpoint("modelscope") == hub.url
    listing = list_repo("modelscope", REPO)
    assert listing.endpoint == hub.url and listing.revision == hub.commit(REPO)
    assert read_range(listing, NESTED, 0, 5) == b"hello"


def test_modelscope_endpoint_explicit_and_precedence(hub: LoopbackHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", "http://127.0.0.1:9")  # would be refused
    assert list_repo("modelscope", REPO, endpoint=hub.url).endpoint == hub.url
    assert resolve_endpoint("modelscope", "example.org/") == "https://example.org"
    monkeypatch.delenv("MODELSCOPE_ENDPOINT")
    assert resolve_endpoint("modelscope") == "https://modelscope.cn"
    monkeypatch.setenv("MODELSCOPE_DOMAIN", "mirror.example.cn")
    with pytest.warns(FutureWarning, match="MODELSCOPE_DOMAIN"):
        assert resolve_endpoint("modelscope") == "https://mirror.example.cn"
    monkeypatch.setenv("MODELSCOPE_DOMAIN", hub.url)
    with pytest.warns(FutureWarning):
        assert list_repo("modelscope", REPO).endpoint == hub.url
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", hub.url)  # wins over the domain, no warning
    assert resolve_endpoint("modelscope") == hub.url


def test_hf_endpoint_resolved_per_call(hub: LoopbackHub, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_endpoint("hf") == "https://huggingface.co"
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # huggingface_hub itself read it at import time
    assert resolve_endpoint("hf") == hub.url
    assert list_repo("hf", REPO).revision == hub.commit(REPO)
    assert resolve_endpoint("hf", "http://other:1/") == "http://other:1"
    with pytest.raises(ValueError, match="unknown hub"):
        resolve_endpoint("github")


# ----------------------------------------------------------------------------------------------
# headers and byte ranges
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", HUBS)
def test_fetch_header_of_every_shard_reads_only_the_header(which: str, hub: LoopbackHub, served: Path) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    shards = [p for p in listing.files if p.endswith(".safetensors") and "/" not in p]
    assert len(shards) == 8
    hub.reset_counters()
    for name in shards:
        cols = fetch_header(listing, name)
        local = read_header(served / name)
        remote = cols.to_header()
        assert cols.file == name and cols.path == f"{which}:{REPO}@{listing.revision}/{name}"
        assert (remote.file_size, remote.header_len, remote.metadata) == (local.file_size, local.header_len,
                                                                          local.metadata)
        assert list(remote.tensors) == list(local.tensors)
        for t, info in local.tensors.items():
            r = remote.tensors[t]
            assert (r.dtype, r.shape, r.begin, r.end) == (info.dtype, info.shape, info.begin, info.end)
        _settle(hub, name, 2)
        assert hub.bytes_sent(name) == 8 + local.header_len < local.file_size
        assert hub.requests(name, method="GET") == 2
    assert hub.total_bytes_sent() == sum(8 + read_header(served / n).header_len for n in shards)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="headers are parsed in workers only with two cores or more")
def test_many_headers_are_parsed_in_worker_processes_with_the_same_outcome(
        served: Path, hash_cache: Path, write_raw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With many shards the headers' JSON is parsed in forked workers: each header, and each
    failure - of the bytes (a length past the end) or of the parse (not JSON) - is what parsing
    in the threads gives."""
    import resource

    from k3ckpt.format import checkpoint

    bad_json = "broken/not-json.safetensors"
    root = served.parent / "many"
    if not root.exists():
        shutil.copytree(served, root)
        write_raw(root / bad_json, b"{not json", b"\0" * 16)
    with LoopbackHub({REPO: root}, cache_dir=hash_cache) as h:
        listing = list_repo("hf", REPO, endpoint=h.url)
        paths = sorted(p for p in listing.files if p.endswith(".safetensors"))
        assert OVERRUN in paths and bad_json in paths and len(paths) == 10
        monkeypatch.setattr(checkpoint, "PARALLEL_HEADER_MIN_FILES", 10**6)
        in_threads = hubclient.fetch_headers_each(listing, paths, jobs=4)
        monkeypatch.setattr(checkpoint, "PARALLEL_HEADER_MIN_FILES", 2)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        in_workers = hubclient.fetch_headers_each(listing, paths, jobs=4)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert after.ru_utime + after.ru_stime > before.ru_utime + before.ru_stime  # workers ran, and were reaped
    assert set(in_workers) == set(paths)
    for p in paths:
        a, b = in_threads[p], in_workers[p]
        if p in (OVERRUN, bad_json):
            assert isinstance(a, SafetensorsHeaderError) and type(b) is type(a) and str(b) == str(a)
        else:
            assert not isinstance(b, Exception) and b == a
    assert "not valid JSON" in str(in_workers[bad_json])


def test_fetch_headers_each_pauses_the_gc_and_gives_it_back(hub: LoopbackHub, served: Path) -> None:
    """Parsed headers are ~3 containers per tensor, kept: at K3's scale the cyclic GC re-walking
    them made the plan of a node fetch 10.5 s instead of 7. No collection runs while headers are
    read (a threshold of 1 starts one at almost every allocation), a failing header included,
    and the GC is as the caller had it afterwards."""
    import gc

    listing = list_repo("hf", REPO, endpoint=hub.url)
    shards = [p for p in listing.files if p.endswith(".safetensors") and "/" not in p] + [OVERRUN]
    starts: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            starts.append(info["generation"])

    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    try:
        gc.set_threshold(1)
        got = hubclient.fetch_headers_each(listing, shards, jobs=4)
        # a few at the call's edges, before the pause and after it; unpaused, ~10^4
        assert len(starts) < 100 and gc.isenabled()
        assert isinstance(got[OVERRUN], SafetensorsHeaderError)
        assert all(not isinstance(got[p], Exception) for p in shards[:-1])
        gc.disable()
        hubclient.fetch_headers_each(listing, shards[:2], jobs=2)
        assert not gc.isenabled()  # paused by the caller: left paused
    finally:
        gc.enable()
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)
    gc.collect()
    assert starts  # the callback does see collections: the first assertion was not vacuous


@pytest.mark.parametrize("which", HUBS)
def test_read_range_arbitrary_ranges(which: str, hub: LoopbackHub, served: Path) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    rng = random.Random(7)
    for name in (BIG, "config.json", NESTED, "model-00008-of-000008.safetensors"):
        data = (served / name).read_bytes()
        size = len(data)
        ranges = [(0, 1), (0, size), (size - 1, 1), (size // 2, size - size // 2), (3, 0)]
        ranges += [(s, rng.randrange(0, size - s + 1)) for s in (rng.randrange(size) for _ in range(6))]
        for start, length in ranges:
            assert read_range(listing, name, start, length) == data[start:start + length], (name, start, length)
    assert read_range(listing, "empty.txt", 0, 0) == b""
    with pytest.raises(ValueError, match="past the end"):
        read_range(listing, "config.json", 10, listing.files["config.json"].size)
    with pytest.raises(ValueError):
        read_range(listing, "config.json", -1, 2)
    with pytest.raises(EntryNotFoundError):
        read_range(listing, "missing.bin", 0, 1)


@pytest.mark.parametrize("which", HUBS)
def test_server_ignoring_range(which: str, hub: LoopbackHub, served: Path) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    data = (served / BIG).read_bytes()
    hub.inject("ignore_range", BIG)
    assert read_range(listing, BIG, 1000, 64) == data[1000:1064]  # small start: skipped to
    start = hubclient.RANGE_SKIP_LIMIT + 4096
    hub.inject("ignore_range", BIG)
    sleeps = Sleeps()
    with pytest.raises(RangeNotSupportedError) as e:
        read_range(listing, BIG, start, 16, retry=_policy(sleeps))
    msg = str(e.value)
    assert "ignored Range" in msg and file_url(listing, BIG) in msg and str(start) in msg
    assert sleeps == []  # not retried: the server will not change its mind


@pytest.mark.parametrize("which", HUBS)
def test_server_200_with_correct_content_range(which: str, hub: LoopbackHub, served: Path) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    data = (served / BIG).read_bytes()
    start = hubclient.RANGE_SKIP_LIMIT + 12345
    hub.inject("ignore_range_with_content_range", BIG, times=2)
    hub.reset_counters()
    assert read_range(listing, BIG, start, 100) == data[start:start + 100]
    cols = fetch_header(listing, BIG)
    assert cols.names == list(read_header(served / BIG).tensors)
    _settle(hub, BIG, 3)
    assert hub.bytes_sent(BIG) == 100 + 8 + cols.header_len


@pytest.mark.parametrize("which", HUBS)
def test_5xx_then_success_is_retried(which: str, hub: LoopbackHub, served: Path) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    hub.inject("status", NESTED, status=503, times=2)
    sleeps = Sleeps()
    assert read_range(listing, NESTED, 6, 5, retry=_policy(sleeps)) == b"world"
    assert sleeps == [0.5, 1.0]
    assert hub.requests(NESTED, method="GET") == 3


@pytest.mark.parametrize("which", HUBS)
def test_429_retry_after_is_honoured_and_capped(which: str, hub: LoopbackHub) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    sleeps = Sleeps()
    policy = _policy(sleeps, max_retry_after=30.0)
    # (One request consumes every armed matching fault, so arm one at a time.)
    hub.inject("status", NESTED, status=429, retry_after=7, times=1)
    assert read_range(listing, NESTED, 0, 5, retry=policy) == b"hello"
    hub.inject("status", NESTED, status=429, retry_after=3600, times=1)
    assert read_range(listing, NESTED, 0, 5, retry=policy) == b"hello"
    assert sleeps == [7.0, 30.0]


@pytest.mark.parametrize("which", HUBS)
def test_persistent_5xx_gives_up_after_bounded_attempts(which: str, hub: LoopbackHub) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    hub.inject("status", NESTED, status=502, times=None)
    sleeps = Sleeps()
    with pytest.raises(HubError, match=r"HTTP 502 after 4 attempt") as e:
        read_range(listing, NESTED, 0, 5, retry=_policy(sleeps, attempts=4, max_backoff=1.0))
    assert sleeps == [0.5, 1.0, 1.0]
    assert f"{which}:{REPO}@{listing.revision} {NESTED!r}" in str(e.value)
    hub.faults.clear()
    hub.inject("status", NESTED, status=404, times=None)  # not retryable
    sleeps.clear()
    with pytest.raises(EntryNotFoundError, match="HTTP 404"):
        read_range(listing, NESTED, 0, 5, retry=_policy(sleeps))
    assert sleeps == []


@pytest.mark.parametrize("which", HUBS)
def test_short_body_is_retried_then_an_error(which: str, hub: LoopbackHub, served: Path) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    data = (served / BIG).read_bytes()
    sleeps = Sleeps()
    # (One request consumes every armed matching fault, so arm one at a time.)
    hub.inject("short_body", BIG, missing=10, times=1)  # FIN 10 bytes early
    assert read_range(listing, BIG, 500, 4000, retry=_policy(sleeps)) == data[500:4500]
    hub.inject("drop_after", BIG, after=100, times=1)  # RST after 100 bytes
    assert read_range(listing, BIG, 500, 4000, retry=_policy(sleeps)) == data[500:4500]
    assert sleeps == [0.5, 0.5]
    hub.inject("short_body", BIG, missing=10, times=None)
    with pytest.raises(HubShortReadError) as e:
        read_range(listing, BIG, 500, 4000, retry=_policy(Sleeps(), attempts=2))
    assert file_url(listing, BIG) in str(e.value) and "500-4499" in str(e.value)


def test_header_length_bounded_before_requesting(hub: LoopbackHub, monkeypatch: pytest.MonkeyPatch,
                                                 served: Path) -> None:
    listing = list_repo("hf", REPO, endpoint=hub.url)
    n = read_header(served / BIG).header_len
    with monkeypatch.context() as mp:
        mp.setenv("K3CKPT_MAX_HEADER_BYTES", str(n - 1))
        with pytest.raises(SafetensorsHeaderError, match=f"header length {n} exceeds the {n - 1}-byte limit"):
            fetch_header(listing, BIG)
    _settle(hub, BIG, 1)
    assert hub.requests(BIG, method="GET") == 1 and hub.bytes_sent(BIG) == 8
    # Not a safetensors file: 8 bytes of JSON text read as a length are far over the limit.
    with pytest.raises(SafetensorsHeaderError, match=f"exceeds the {K3CKPT_MAX_HEADER_BYTES.default}-byte limit"):
        fetch_header(listing, "config.json")
    _settle(hub, "config.json", 1)
    assert hub.bytes_sent("config.json") == 8
    with pytest.raises(SafetensorsHeaderError, match="too short"):
        fetch_header(listing, "empty.txt")
    assert hub.requests("empty.txt") == 0
    with pytest.raises(EntryNotFoundError):
        fetch_header(listing, "nope.safetensors")


@pytest.mark.parametrize("which", HUBS)
def test_header_length_past_end_of_file(which: str, hub: LoopbackHub) -> None:
    listing = list_repo(which, REPO, endpoint=hub.url)
    with pytest.raises(SafetensorsHeaderError, match="header length 1000 runs past the end of the 50-byte file") as e:
        fetch_header(listing, OVERRUN)
    assert f"{which}:{REPO}@{listing.revision}/{OVERRUN}" in str(e.value)
    _settle(hub, OVERRUN, 1)
    assert hub.requests(OVERRUN, method="GET") == 1 and hub.bytes_sent(OVERRUN) == 8


# ----------------------------------------------------------------------------------------------
# tokens
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", HUBS)
def test_token_required(which: str, token_hub: LoopbackHub, served: Path) -> None:
    listing = list_repo(which, REPO, endpoint=token_hub.url, token=TOKEN)
    assert listing.revision == token_hub.commit(REPO)
    assert fetch_header(listing, BIG, token=TOKEN).names == list(read_header(served / BIG).tensors)
    variable = {"hf": "HF_TOKEN", "modelscope": "MODELSCOPE_API_TOKEN"}[which]
    for bad, what in ((None, "the repo needs a token"), ("wrong", "the token was refused")):
        with pytest.raises(HubAuthError, match=f"401 Unauthorized: {what}") as e:
            list_repo(which, REPO, endpoint=token_hub.url, token=bad)
        assert e.value.exit_code == EXIT_CANNOT_RUN and "\n" not in str(e.value)
        assert f"set {variable} or pass --token" in str(e.value)
        with pytest.raises(HubAuthError, match=f"401 Unauthorized: {what}.*set {variable} or pass --token"):
            read_range(listing, NESTED, 0, 5, token=bad)


def test_tokens_from_env_and_saved_login(token_hub: LoopbackHub, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hfc
    from modelscope_hub.config import HubConfig

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hf = list_repo("hf", REPO, endpoint=token_hub.url)
    assert read_range(hf, NESTED, 0, 5) == b"hello"
    assert auth_headers("hf")["authorization"] == f"Bearer {TOKEN}"
    assert "authorization" not in auth_headers("hf", token="")
    monkeypatch.delenv("HF_TOKEN")
    Path(hfc.HF_TOKEN_PATH).parent.mkdir(parents=True, exist_ok=True)
    Path(hfc.HF_TOKEN_PATH).write_text(TOKEN)  # `hf auth login`
    assert list_repo("hf", REPO, endpoint=token_hub.url).files == hf.files

    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    ms = list_repo("modelscope", REPO, endpoint=token_hub.url)
    assert read_range(ms, NESTED, 0, 5) == b"hello"
    headers = auth_headers(ms)
    assert headers["Authorization"] == f"Bearer {TOKEN}" and headers["Cookie"] == f"m_session_id={TOKEN}"
    assert headers["User-Agent"].startswith("modelscope_hub/")
    monkeypatch.delenv("MODELSCOPE_API_TOKEN")
    HubConfig(endpoint=token_hub.url).save_token(TOKEN)  # `modelscope login`
    assert list_repo("modelscope", REPO, endpoint=token_hub.url).files == ms.files
    with pytest.raises(HubAuthError):  # "" = explicitly no token, saved login or not
        list_repo("modelscope", REPO, endpoint=token_hub.url, token="")


# ----------------------------------------------------------------------------------------------
# misbehaving servers the emulator has no fault for
# ----------------------------------------------------------------------------------------------

DATA = bytes(range(256)) * 64  # 16 KiB
_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


class _Script(http.server.ThreadingHTTPServer):
    daemon_threads = True
    mode = "ok"
    redirect_to = ""
    seen: list[tuple[str, dict[str, str]]]


class _ScriptHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Script

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        srv = self.server
        srv.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        if srv.mode == "redirect" and not self.path.startswith("/moved/"):
            self._answer(302, b"", {"Location": srv.redirect_to + "/moved" + self.path})
            return
        m = _RANGE.fullmatch(self.headers.get("Range", ""))
        assert m, self.headers.get("Range")
        a, b = int(m.group(1)), int(m.group(2))
        mode = srv.mode
        cr = f"bytes {a}-{b}/{len(DATA)}"
        if mode in ("ok", "redirect"):
            self._answer(206, DATA[a:b + 1], {"Content-Range": cr})
        elif mode == "shifted":
            self._answer(206, DATA[a + 1:b + 2], {"Content-Range": f"bytes {a + 1}-{b + 1}/{len(DATA)}"})
        elif mode == "shifted_200":
            self._answer(200, DATA[a + 1:b + 2], {"Content-Range": f"bytes {a + 1}-{b + 1}/{len(DATA)}"})
        elif mode == "no_content_range":
            self._answer(206, DATA[a:b + 1], {})
        elif mode == "other_size":
            self._answer(206, DATA[a:b + 1], {"Content-Range": f"bytes {a}-{b}/{len(DATA) + 1}"})
        elif mode == "gzip":
            self._answer(206, gzip.compress(DATA[a:b + 1]), {"Content-Range": cr, "Content-Encoding": "gzip"})
        elif mode == "whole_but_longer":
            self._answer(200, DATA + b"extra", {})

    def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def scripted() -> Iterator[list[_Script]]:
    servers = []
    threads = []
    for _ in range(2):
        srv = _Script(("127.0.0.1", 0), _ScriptHandler)
        srv.seen = []
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        servers.append(srv)
        threads.append(t)
    yield servers
    for srv, t in zip(servers, threads):
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


def _url(srv: _Script, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{srv.server_address[1]}"


def _listing(srv: _Script, which: str = "hf") -> HubListing:
    return HubListing(which, "org/repo", "c" * 40, _url(srv), {"f.bin": HubFile("f.bin", len(DATA), None, None)})


@pytest.mark.parametrize(
    ("mode", "exc", "needle"),
    [
        ("shifted", RangeMismatchError, "asked for bytes 100-199, server answered 'bytes 101-200/16384' (HTTP 206)"),
        ("shifted_200", RangeMismatchError, "asked for bytes 100-199, server answered 'bytes 101-200/16384' (HTTP 200)"),
        ("no_content_range", RangeMismatchError, "HTTP 206 without Content-Range"),
        ("other_size", RangeMismatchError, "says the file is 16385 bytes, the listing says 16384"),
        ("gzip", RangeMismatchError, "Content-Encoding 'gzip'"),
        ("whole_but_longer", RangeMismatchError, "16389-byte body for a 16384-byte file"),
    ],
)
def test_wrong_answers_are_errors_not_bytes(scripted: list[_Script], mode: str, exc: type[HubError],
                                            needle: str) -> None:
    srv = scripted[0]
    srv.mode = mode
    listing = _listing(srv)
    sleeps = Sleeps()
    with pytest.raises(exc) as e:
        read_range(listing, "f.bin", 100, 100, retry=_policy(sleeps))
    assert needle in str(e.value) and file_url(listing, "f.bin") in str(e.value)
    assert "'f.bin'" in str(e.value) and "org/repo@" + "c" * 40 in str(e.value)
    assert sleeps == [] and len(srv.seen) == 1
    assert srv.seen[0][1]["accept-encoding"] == "identity"


def test_redirect_to_another_origin_drops_credentials(scripted: list[_Script]) -> None:
    front, cdn = scripted
    front.mode = "redirect"
    front.redirect_to = _url(cdn, "localhost")  # another host name and port
    listing = _listing(front, "modelscope")
    assert read_range(listing, "f.bin", 10, 20, token=TOKEN) == DATA[10:30]
    (_, first), (path, second) = front.seen[0], cdn.seen[0]
    assert first["authorization"] == f"Bearer {TOKEN}" and first["cookie"] == f"m_session_id={TOKEN}"
    assert path.startswith("/moved/api/v1/models/org/repo/repo?")
    assert "authorization" not in second and "cookie" not in second
    assert second["range"] == "bytes=10-29"


def test_redirect_within_origin_keeps_credentials(scripted: list[_Script]) -> None:
    srv = scripted[0]
    srv.mode = "redirect"
    srv.redirect_to = _url(srv)
    assert read_range(_listing(srv), "f.bin", 0, 8, token=TOKEN) == DATA[:8]
    assert [p.startswith("/moved/") for p, _ in srv.seen] == [False, True]
    assert srv.seen[1][1]["authorization"] == f"Bearer {TOKEN}"


def test_errors_pickle_and_are_one_line() -> None:
    import pickle

    e = RangeMismatchError("a\nb", hub="hf", repo="o/r", revision="c" * 40, path="x.bin", endpoint="http://h")
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is RangeMismatchError and str(again) == str(e) == f"hf:o/r@{'c' * 40} 'x.bin': a b"
    assert (again.hub, again.repo, again.path, again.endpoint) == ("hf", "o/r", "x.bin", "http://h")
