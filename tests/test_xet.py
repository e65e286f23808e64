"""The loopback hub in Xet mode (``LoopbackHub(..., xet=True)``): a Xet-backed repository as the
real hub presents it - ``xetHash`` in the tree listing, a ``resolve`` that answers 302 with
``X-Xet-Hash`` / ``X-Linked-*`` and a short-lived signed URL on a separate bridge host that
honours Range - and our clients against it: whole fetch, rank-aware fetch (partial and node),
``manifest pull`` (headers, ``--tensor-hashes``) give the bytes the plain hub gives; the hub
token never reaches the bridge host; a signed URL refused as expired is resolved again. The real
``huggingface_hub`` client (HTTP path, ``HF_HUB_DISABLE_XET=1``) downloads from it unmodified,
which shows the emulator answers what the client expects.

Every hub here requires a token, so the hub requests carry one; the bridge answers a request
with any ``Authorization`` or ``Cookie`` header 400, and its log records such a header.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from ckpt_edit import tree_digests
from helpers import REPO, run
from k3ckpt.hub.pull import pull_manifest
from k3ckpt.integrity.manifest import Manifest, build_manifest, diff_manifests
from k3ckpt.testing.hub import LoopbackHub, RequestRecord

TOKEN = "hf_loopback_s3cret"
CHUNK = 16 * 1024  # several ranged requests per shard, so several signed URLs per file
NODE0 = ("--ep", "8", "--tp", "2", "--node", "0", "--gpus-per-node", "4")
SHARD = "model-00002-of-000008.safetensors"


@pytest.fixture(autouse=True)
def _env(isolated_hub_clients: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A token for both hubs' clients (so a leak would show), HTTP path for huggingface_hub."""
    import huggingface_hub.constants as hfc

    monkeypatch.setattr(hfc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(hfc, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "k3ckpt-cache"))


@pytest.fixture(scope="module")
def hubs(k3_tiny: Path, hash_cache: Path) -> Iterator[tuple[LoopbackHub, LoopbackHub]]:
    """``(plain, xet)``: the same checkpoint served both ways, both requiring the token."""
    with LoopbackHub({REPO: k3_tiny}, cache_dir=hash_cache, token=TOKEN) as plain, \
            LoopbackHub({REPO: k3_tiny}, cache_dir=hash_cache, token=TOKEN, xet=True) as xet:
        yield plain, xet


@pytest.fixture
def pair(hubs: tuple[LoopbackHub, LoopbackHub]) -> Iterator[tuple[LoopbackHub, LoopbackHub]]:
    for h in hubs:
        h.faults.clear()
        h.reset_counters()
    yield hubs
    for h in hubs:
        h.faults.clear()


@pytest.fixture
def xet_hub(pair: tuple[LoopbackHub, LoopbackHub]) -> LoopbackHub:
    return pair[1]


def assert_bytes_came_from_the_bridge_without_credentials(h: LoopbackHub) -> None:
    """Tensor bytes came from the bridge (the hub only redirected), and no request to the bridge
    carried a credential, while every hub request did (the hub requires one)."""
    bridge = h.bridge_log
    assert bridge and not any(r.credentials for r in bridge), [r for r in bridge if r.credentials]
    hub_side = [r for r in h.request_log if r.server == "hub"]
    assert hub_side and all(r.credentials for r in hub_side)
    # (An earlier test of the module may have resolved the URLs this one reuses: no count here.)
    lfs_resolves = [r for r in hub_side if r.route == "hf.resolve" and (r.file or "").endswith(".safetensors")]
    assert all(r.status == 302 and r.body_bytes == 0 for r in lfs_resolves)
    assert sum(r.body_bytes for r in bridge if (r.file or "").endswith(".safetensors")) > 0


def fetch_args(h: LoopbackHub, dest: Path, *extra: str) -> list[str]:
    return ["fetch", "--source", "hf", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url,
            "--chunk-size", str(CHUNK), "--workers", "3", *extra]


# ----------------------------------------------------------------------------------------------
# what the emulator answers
# ----------------------------------------------------------------------------------------------


def test_listing_and_resolve_carry_what_the_client_parses_for_xet_files(pair: Any, k3_tiny: Path) -> None:
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils._xet import is_valid_xet_hash

    plain, h = pair
    tree = {f.path: f for f in HfApi(endpoint=h.url, token=TOKEN).list_repo_tree(REPO, recursive=True)
            if isinstance(f, RepoFile)}
    assert set(tree) == {p.name for p in k3_tiny.iterdir()}
    for f in tree.values():
        assert (f.xet_hash is not None) == (f.lfs is not None), f.path
        assert f.xet_hash is None or is_valid_xet_hash(f.xet_hash)
    assert all(f.xet_hash is None for f in HfApi(endpoint=plain.url, token=TOKEN).list_repo_tree(REPO)
               if isinstance(f, RepoFile))  # the control: no Xet fields from the plain hub

    meta = get_hf_file_metadata(hf_hub_url(REPO, SHARD, endpoint=h.url), token=TOKEN, endpoint=h.url)
    lfs = tree[SHARD].lfs
    assert lfs is not None
    assert (meta.etag, meta.size, meta.commit_hash) == (lfs.sha256, (k3_tiny / SHARD).stat().st_size, h.commit(REPO))
    assert meta.xet_file_data is not None and meta.xet_file_data.file_hash == tree[SHARD].xet_hash
    assert meta.xet_file_data.refresh_route == f"{h.url}/api/models/{REPO}/xet-read-token/{h.commit(REPO)}"
    assert meta.location.startswith(f"{h.bridge_url}/xet-bridge-us/") and "Signature=" in meta.location
    small = get_hf_file_metadata(hf_hub_url(REPO, "config.json", endpoint=h.url), token=TOKEN, endpoint=h.url)
    assert small.xet_file_data is None and small.location.startswith(h.url)  # served by the hub itself
    # A client that tries the CAS protocol is told plainly that only the HTTP bridge is emulated.
    r = requests.get(meta.xet_file_data.refresh_route, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 501 and "HF_HUB_DISABLE_XET=1" in r.headers["X-Error-Message"]


def test_the_bridge_serves_ranges_and_refuses_expired_forged_or_credentialed_requests(xet_hub: LoopbackHub,
                                                                                      k3_tiny: Path) -> None:
    h = xet_hub
    data = (k3_tiny / SHARD).read_bytes()
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def location() -> str:
        r = requests.head(h.resolve_url(REPO, SHARD), headers=auth, allow_redirects=False, timeout=10)
        assert r.status_code == 302 and r.headers["X-Xet-Hash"]
        return r.headers["Location"]

    url = location()
    r = requests.get(url, headers={"Range": "bytes=8-1031"}, timeout=10)
    assert r.status_code == 206 and r.headers["Content-Range"] == f"bytes 8-1031/{len(data)}"
    assert r.content == data[8:1032]
    assert requests.get(url, timeout=10).content == data

    forged = re.sub(r"Expires=[0-9.]+", "Expires=99999999999", url)
    r = requests.get(forged, timeout=10)
    assert r.status_code == 403 and b"Invalid signature" in r.content

    h.inject("expired_url", SHARD)
    r = requests.get(url, timeout=10)
    assert r.status_code == 403 and b"Request has expired" in r.content
    assert requests.get(url, timeout=10).status_code == 200  # the fault is spent; the URL itself is valid

    assert not any(rec.credentials for rec in h.bridge_log)
    r = requests.get(url, headers=auth, timeout=10)
    assert r.status_code == 400
    assert [rec.status for rec in h.bridge_log if rec.credentials] == [400]  # recorded: a test sees a leak


def test_modelscope_is_not_xet_backed(xet_hub: LoopbackHub, k3_tiny: Path) -> None:
    pulled = pull_manifest("modelscope", REPO, endpoint=xet_hub.url)
    assert pulled.files == build_manifest(k3_tiny).files
    assert xet_hub.bridge_log == [] and xet_hub.routes_used()["ms.download"] > 0


def test_the_real_client_downloads_over_the_http_bridge(xet_hub: LoopbackHub, k3_tiny: Path, tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download, snapshot_download

    h = xet_hub
    snap = Path(snapshot_download(REPO, endpoint=h.url, token=TOKEN, local_dir=tmp_path / "snap"))
    assert tree_digests(snap) == tree_digests(k3_tiny)
    cached = Path(hf_hub_download(REPO, SHARD, endpoint=h.url, token=TOKEN, cache_dir=tmp_path / "hf-cache"))
    assert cached.read_bytes() == (k3_tiny / SHARD).read_bytes()
    assert cached.resolve().name == build_manifest(k3_tiny).files[SHARD].sha256  # blob named by X-Linked-Etag
    assert_bytes_came_from_the_bridge_without_credentials(h)


# ----------------------------------------------------------------------------------------------
# our clients: the same bytes as from the plain hub, no credential on the bridge
# ----------------------------------------------------------------------------------------------


def test_fetch_gives_the_plain_hubs_bytes(pair: Any, k3_tiny: Path, tmp_path: Path) -> None:
    plain, h = pair
    for hub, dest in ((plain, tmp_path / "plain"), (h, tmp_path / "xet")):
        res = run(*fetch_args(hub, dest))
        assert res.exit_code == 0, res.output
    assert tree_digests(tmp_path / "xet") == tree_digests(tmp_path / "plain") == tree_digests(k3_tiny)
    assert_bytes_came_from_the_bridge_without_credentials(h)
    assert plain.bridge_log == []


@pytest.mark.parametrize("fmt", ["partial", "node"])
def test_rank_aware_fetch_gives_the_plain_hubs_bytes(fmt: str, pair: Any, tmp_path: Path) -> None:
    plain, h = pair
    for hub, dest in ((plain, tmp_path / "plain"), (h, tmp_path / "xet")):
        res = run(*fetch_args(hub, dest, *NODE0, "--format", fmt))
        assert res.exit_code == 0, res.output
    digests = tree_digests(tmp_path / "xet")
    assert digests == tree_digests(tmp_path / "plain") and any(p.endswith(".safetensors") for p in digests)
    assert_bytes_came_from_the_bridge_without_credentials(h)
    # Only the selection moved, as from the plain hub: the bridge sent what the plain hub sent.
    assert h.total_bytes_sent() == plain.total_bytes_sent()


def test_manifest_pull_reads_headers_and_tensor_hashes_through_the_bridge(pair: Any, k3_tiny: Path,
                                                                          tmp_path: Path) -> None:
    plain, h = pair
    built = build_manifest(k3_tiny)
    pulled = pull_manifest("hf", REPO, endpoint=h.url)
    assert [c for c in diff_manifests(built, pulled) if c.what != "source"] == []
    for f, entry in built.files.items():
        if f.endswith(".safetensors"):  # by Range on the bridge: the header, never the tensor data
            assert h.bytes_sent(f) == entry.data_start, f
    assert_bytes_came_from_the_bridge_without_credentials(h)

    outs = {}
    for name, hub in (("plain", plain), ("xet", h)):
        outs[name] = tmp_path / f"{name}.json"
        res = run("manifest", "pull", "--source", "hf", "--repo", REPO, "--endpoint", hub.url, "-o",
                  str(outs[name]), "--tensor-hashes", "--jobs", "3")
        assert res.exit_code == 0, res.output
    a, b = Manifest.load(outs["plain"]), Manifest.load(outs["xet"])
    assert b.tensor_hashes and (a.files, a.tensors) == (b.files, b.tensors)
    assert not any(r.credentials for r in h.bridge_log)


# ----------------------------------------------------------------------------------------------
# signed URLs that expire
# ----------------------------------------------------------------------------------------------


def resolves_after_refusals(h: LoopbackHub) -> tuple[int, list[str]]:
    """(refusals, files refused and not resolved again afterwards) from the request log."""
    log = h.request_log
    refused = [r for r in log if r.server == "bridge" and r.status == 403]

    def replaced(x: RequestRecord) -> bool:
        # After the refusal arrived, the file was resolved afresh - by this worker, or by another
        # whose fresh URL this one then took (reads of the file under another signed URL).
        later = [r for r in log if r.file == x.file and r.started > x.started]
        return any(r.route == "hf.resolve" and r.method == "GET" for r in later) or any(
            r.server == "bridge" and r.target != x.target for r in later)

    return len(refused), [x.file or "" for x in refused if not replaced(x)]


def test_a_signed_url_is_reused_and_resolved_again_when_it_expires_mid_download(pair: Any, k3_tiny: Path,
                                                                                tmp_path: Path) -> None:
    _, h = pair
    # Refused from the 5th chunk on: each shard's URL was issued, and reused, before that.
    h.inject("expired_url", "*.safetensors", times=3, offset=4 * CHUNK)
    res = run(*fetch_args(h, tmp_path / "d"))
    assert res.exit_code == 0, res.output
    assert tree_digests(tmp_path / "d") == tree_digests(k3_tiny)
    assert resolves_after_refusals(h) == (3, [])  # each refused URL was replaced by a fresh one
    shards = sorted(p.name for p in k3_tiny.glob("*.safetensors"))
    resolves = [r for r in h.request_log if r.route == "hf.resolve" and r.file in shards and r.method == "GET"]
    bridge_gets = [r for r in h.bridge_log if r.file in shards]
    # One resolve per file and worker at most (3 workers), plus the three re-resolves - not one per chunk.
    assert len(resolves) <= 3 * len(shards) + 3 < len(bridge_gets)


@pytest.mark.parametrize("what", ["manifest pull", "rank-aware fetch"])
def test_a_freshly_resolved_url_refused_is_resolved_again(what: str, k3_tiny: Path, hash_cache: Path,
                                                          tmp_path: Path) -> None:
    """A hub of its own (a new port, so no URL this process reused before): the refused URLs are
    the ones just resolved, and the retry (header reads, tensor ranges) resolves afresh."""
    with LoopbackHub({REPO: k3_tiny}, cache_dir=hash_cache, token=TOKEN, xet=True) as h:
        h.inject("expired_url", "*.safetensors", times=2)
        if what == "manifest pull":
            assert pull_manifest("hf", REPO, endpoint=h.url).tensors == build_manifest(k3_tiny).tensors
        else:
            res = run(*fetch_args(h, tmp_path / "node0", *NODE0, "--format", "partial"))
            assert res.exit_code == 0, res.output
        assert resolves_after_refusals(h) == (2, [])


def test_a_signed_url_is_reused_only_with_the_credentials_it_was_resolved_with(k3_tiny: Path,
                                                                               hash_cache: Path) -> None:
    """A library user serving several tokens in one process: a URL the hub signed after checking
    one token is never used to read for another (the hub sees, and can refuse, each token)."""
    from k3ckpt.hub.client import list_repo, read_range

    with LoopbackHub({REPO: k3_tiny}, cache_dir=hash_cache, xet=True) as h:
        listing = list_repo("hf", REPO, endpoint=h.url, token="")
        data = (k3_tiny / SHARD).read_bytes()

        def resolves() -> int:
            return sum(1 for r in h.request_log if r.route == "hf.resolve" and r.file == SHARD)

        for token, want in (("tok-a", 1), ("tok-a", 1), ("tok-b", 2), ("tok-a", 2), ("", 3)):
            assert read_range(listing, SHARD, 100, 50, token=token) == data[100:150]
            assert resolves() == want, token
        assert not any(r.credentials for r in h.bridge_log)


def test_urls_that_are_always_expired_fail_in_one_line_without_the_signature(k3_tiny: Path, hash_cache: Path,
                                                                              tmp_path: Path) -> None:
    with LoopbackHub({REPO: k3_tiny}, cache_dir=hash_cache, token=TOKEN, xet=True, xet_url_ttl=0) as h:
        res = run("manifest", "pull", "--source", "hf", "--repo", REPO, "--endpoint", h.url,
                  "-o", str(tmp_path / "m.json"))
        assert res.exit_code == 2, res.output
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and "signed URL refused" in lines[0] and "Signature=" not in res.output
        res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(tmp_path / "d"), "--endpoint", h.url,
                  "--include", SHARD)
        assert res.exit_code != 0 and "signed URL refused" in res.output and "Signature=" not in res.output
        assert "Traceback" not in res.output
        assert h.bridge_log and all(r.status == 403 for r in h.bridge_log)  # bounded: it gave up


def test_the_cli_serves_xet_mode(k3_tiny: Path, tmp_path: Path) -> None:
    repo_root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3ckpt.testing.hub", str(k3_tiny), "--repo", REPO, "--port", "0", "--xet",
         "--cache-dir", str(tmp_path / "hc")],
        cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (lines and lines[-1].startswith("Ctrl-C")):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        text = "".join(lines)
        hub_url = re.search(r"Serving on (http://127\.0\.0\.1:\d+)", text)
        bridge_url = re.search(r"Xet bridge on (http://127\.0\.0\.1:\d+)", text)
        assert hub_url and bridge_url and hub_url.group(1) != bridge_url.group(1), text
        r = requests.head(f"{hub_url.group(1)}/{REPO}/resolve/main/{SHARD}", allow_redirects=False, timeout=10)
        assert r.status_code == 302 and r.headers["Location"].startswith(bridge_url.group(1))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_xet_can_be_chosen_per_repo(k3_tiny: Path, hash_cache: Path) -> None:
    from k3ckpt.testing.hub import RepoSpec

    other = "someone/plain"
    with LoopbackHub({REPO: RepoSpec(k3_tiny, xet=True), other: k3_tiny}, cache_dir=hash_cache) as h:
        xet = requests.head(h.resolve_url(REPO, SHARD), allow_redirects=False, timeout=10)
        plain = requests.head(h.resolve_url(other, SHARD), allow_redirects=False, timeout=10)
        assert xet.status_code == 302 and xet.headers["Location"].startswith(h.bridge_url)
        assert plain.status_code == 200 and "X-Xet-Hash" not in plain.headers
    with LoopbackHub({REPO: k3_tiny}, cache_dir=hash_cache) as h, pytest.raises(RuntimeError, match="no Xet bridge"):
        h.bridge_url  # noqa: B018 - no Xet-backed repo, no bridge socket
