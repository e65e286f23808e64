"""A hostile hub: every misbehaviour yields a clear error and nothing is written outside the
destination (nor a wrong file under a final name inside it).

The hub is the loopback emulator with its hostile faults (lying listings, path traversal in
names, a shifted Content-Range, a redirect to another host, an endless body, an HTML page in
place of the bytes), talked to through the real huggingface_hub / modelscope clients and
k3ckpt's own downloader and range reader.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import REPO, run
from k3ckpt.errors import K3ckptError
from k3ckpt.hub.client import RetryPolicy, list_repo
from k3ckpt.hub.download import fetch_files
from k3ckpt.hub.pull import pull_manifest
from k3ckpt.testing.hub import LoopbackHub

HUBS = ("hf", "modelscope")
SHARD = "model-00001-of-000008.safetensors"  # 1.6 MB
CHUNK = 256 * 1024

pytestmark = pytest.mark.usefixtures("isolated_hub_clients")


def fast_retry() -> RetryPolicy:
    return RetryPolicy(attempts=3, backoff=0.0, max_backoff=0.0, sleep=lambda s: None)


def tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.fixture(params=HUBS)
def which(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def hub(served_hub) -> LoopbackHub:
    return served_hub[0]


@pytest.fixture
def served(served_hub) -> Path:
    return served_hub[1]


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Path]:
    """A directory holding the destination; afterwards nothing but ``dest`` may be in it."""
    b = tmp_path / "box"
    b.mkdir()
    yield b
    assert {p.split("/")[0] for p in tree(b)} <= {"dest"}, sorted(tree(b))
    escaped = [p for p in tree(tmp_path) if p.endswith(("evil", "evil.part"))]
    assert not escaped, escaped


def assert_no_wrong_final(dest: Path, served: Path) -> None:
    """Every file under a final name in ``dest`` is byte-identical to the served one."""
    for p in dest.rglob("*") if dest.exists() else []:
        if ".cache" in p.relative_to(dest).parts:
            continue  # k3ckpt's records (ownership, source revision): not served files
        if p.is_file() and not p.name.endswith((".part", ".journal", ".lock")):
            assert p.read_bytes() == (served / p.relative_to(dest)).read_bytes(), p


# -- listings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../evil", "/tmp/evil", "tokenizer/../../../evil", "a\\..\\evil"])
def test_path_traversal_in_a_listing_is_refused_before_anything_is_written(
        hub: LoopbackHub, which: str, box: Path, name: str) -> None:
    hub.inject("list_as", "config.json", times=None, name=name, methods=("GET", "POST"))
    dest = box / "dest"
    res = run("fetch", "--source", which, "--repo", REPO, "--dest", str(dest), "--endpoint", hub.url)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3ckpt: error: ") and "refusing the path" in lines[0], res.output
    assert repr(name) in lines[0] or name in lines[0]
    assert not dest.exists()
    assert hub.total_bytes_sent() == 0  # not one file byte was requested


def test_a_listing_naming_the_downloaders_own_files_is_refused_per_file(hub: LoopbackHub, box: Path,
                                                                        served: Path) -> None:
    hub.inject("list_as", "LICENSE", times=None, name="config.json.part", methods=("GET", "POST"))
    listing = list_repo("hf", REPO, endpoint=hub.url, token="")
    dest = box / "dest"
    r = fetch_files(listing, dest, chunk_size=CHUNK, token="", retry=fast_retry())
    assert "collides with the downloader's working files" in r.failed["config.json.part"]
    assert "config.json" in r.fetched and not r.ok
    assert_no_wrong_final(dest, served)


@pytest.mark.parametrize("delta", [1, -1, -4096])
def test_a_listing_whose_size_lies_fails_that_file_clearly(hub: LoopbackHub, which: str, box: Path, served: Path,
                                                          delta: int) -> None:
    hub.inject("lie_size", SHARD, times=None, delta=delta, methods=("GET", "POST", "HEAD"))
    listing = list_repo(which, REPO, endpoint=hub.url, token="")
    assert listing.files[SHARD].size == (served / SHARD).stat().st_size + delta
    dest = box / "dest"
    r = fetch_files(listing, dest, [SHARD, "config.json"], chunk_size=CHUNK, token="", retry=fast_retry())
    assert r.fetched == ["config.json"] and list(r.failed) == [SHARD]
    why = r.failed[SHARD]
    assert "\n" not in why and ("the listing says" in why or "HTTP 416" in why or "size" in why), why
    assert not (dest / SHARD).exists()
    assert_no_wrong_final(dest, served)


def test_a_huge_lying_size_is_refused_by_the_space_check(hub: LoopbackHub, box: Path) -> None:
    hub.inject("lie_size", SHARD, times=None, delta=1 << 60, methods=("GET", "POST", "HEAD"))
    dest = box / "dest"
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(dest), "--endpoint", hub.url)
    assert res.exit_code == 2 and res.output.startswith("k3ckpt: error: ") and "not enough free space" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert hub.total_bytes_sent() == 0
    # nothing was preallocated, and the destination the refused run created is gone again, with
    # the records it had written (ownership, listing) and its lock (issue #25)
    assert not dest.exists()


# -- bodies ------------------------------------------------------------------------------------


def test_a_shifted_content_range_is_never_written(hub: LoopbackHub, which: str, box: Path, served: Path) -> None:
    hub.inject("wrong_content_range", SHARD, times=None, delta=1)
    listing = list_repo(which, REPO, endpoint=hub.url, token="")
    dest = box / "dest"
    r = fetch_files(listing, dest, [SHARD], chunk_size=CHUNK, token="", retry=fast_retry())
    assert "asked for bytes" in r.failed[SHARD] and "server answered 'bytes " in r.failed[SHARD]
    assert not (dest / SHARD).exists()
    # The CLI says the same in one line per file, and exits 1.
    res = run("fetch", "--source", which, "--repo", REPO, "--dest", str(dest), "--endpoint", hub.url,
              "--include", SHARD, "--chunk-size", str(CHUNK))
    assert res.exit_code == 1 and f"could not fetch {SHARD}: asked for bytes" in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("content_range", [False, True], ids=["200-no-length", "206-no-length"])
def test_an_endless_body_is_cut_off_and_never_trusted(hub: LoopbackHub, which: str, box: Path, served: Path,
                                                      content_range: bool) -> None:
    hub.inject("endless_body", SHARD, times=None, content_range=content_range, fill=0x41)
    listing = list_repo(which, REPO, endpoint=hub.url, token="")
    dest = box / "dest"
    r = fetch_files(listing, dest, [SHARD], chunk_size=CHUNK, token="", retry=fast_retry())
    assert SHARD in r.failed and not (dest / SHARD).exists()
    assert "\n" not in r.failed[SHARD]
    # The client stopped reading: a few chunks' worth per attempt (plus socket buffers), not gigabytes.
    assert hub.bytes_sent(SHARD) < 512 * 1024 * 1024
    # Header reads take exactly what they asked for: here 8 bytes of "A"s, an absurd length.
    with pytest.raises(K3ckptError, match="exceeds the|body is longer"):
        pull_manifest(which, REPO, endpoint=hub.url, token="")


def test_an_html_error_page_with_status_200_is_named_as_such(hub: LoopbackHub, which: str, box: Path,
                                                             served: Path) -> None:
    hub.inject("html_200", "*", times=None)
    listing = list_repo(which, REPO, endpoint=hub.url, token="")
    dest = box / "dest"
    r = fetch_files(listing, dest, [SHARD, "config.json"], chunk_size=CHUNK, token="", retry=fast_retry())
    assert sorted(r.failed) == ["config.json", SHARD] and not r.fetched
    for why in r.failed.values():
        assert "HTML page" in why and "\n" not in why, why
    assert_no_wrong_final(dest, served)
    assert not (dest / "config.json").exists()
    # manifest pull reads headers with ranged GETs: the same page there is one line, exit 2.
    res = run("manifest", "pull", "--source", which, "--repo", REPO, "--endpoint", hub.url, "-o",
              str(box / "dest" / "m.json"))
    assert res.exit_code == 2 and res.output.startswith("k3ckpt: error: ") and "HTML page" in res.output, res.output
    assert not (box / "dest" / "m.json").exists()


# -- redirects ---------------------------------------------------------------------------------


@pytest.fixture
def token_hub(served: Path, tmp_path: Path) -> Iterator[tuple[LoopbackHub, LoopbackHub]]:
    """``(origin, other)``: the origin needs a token; ``other`` (another host, 127.0.0.2) serves
    the same files to anyone and records what credentials it was sent."""
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "c1", token="s3cret") as origin, \
            LoopbackHub({REPO: served}, host="127.0.0.2", cache_dir=tmp_path / "c2") as other:
        yield origin, other


def test_a_redirect_to_another_host_does_not_carry_the_token(token_hub, which: str, box: Path, served: Path) -> None:
    origin, other = token_hub
    origin.inject("redirect", "*.safetensors", times=None, location=other.url)
    listing = list_repo(which, REPO, endpoint=origin.url, token="s3cret")
    dest = box / "dest"
    r = fetch_files(listing, dest, [SHARD, "config.json"], chunk_size=CHUNK, token="s3cret", retry=fast_retry())
    assert r.ok, r.failed
    assert (dest / SHARD).read_bytes() == (served / SHARD).read_bytes()
    at_other = [rec for rec in other.request_log if rec.file == SHARD]
    assert at_other and not any(rec.credentials for rec in at_other)
    # The origin did get the token (the redirect is what strips it, not a client without one).
    assert all(rec.credentials for rec in origin.request_log)
    # Header reads of manifest pull follow the same rule.
    other.reset_counters()
    pull_manifest(which, REPO, endpoint=origin.url, token="s3cret")
    assert other.request_log and not any(rec.credentials for rec in other.request_log)


def test_a_same_host_redirect_keeps_the_token(token_hub, box: Path, served: Path) -> None:
    """The control for the test above: a redirect within the origin keeps credentials (so the
    origin, which requires them, still serves), which shows the stripping is by host."""
    origin, _ = token_hub
    origin.inject("redirect", SHARD, times=1, location=origin.url)
    listing = list_repo("hf", REPO, endpoint=origin.url, token="s3cret")
    r = fetch_files(listing, box / "dest", [SHARD], chunk_size=CHUNK, token="s3cret", retry=fast_retry())
    assert r.ok, r.failed
    assert sum(1 for rec in origin.request_log if rec.status == 302) == 1


def test_a_redirect_loop_is_a_clear_error(hub: LoopbackHub, box: Path, served: Path) -> None:
    hub.inject("redirect", SHARD, times=None, location=hub.url)
    listing = list_repo("hf", REPO, endpoint=hub.url, token="")
    r = fetch_files(listing, box / "dest", [SHARD], chunk_size=CHUNK, token="", retry=fast_retry())
    assert "redirects" in r.failed[SHARD]
    assert not (box / "dest" / SHARD).exists()
