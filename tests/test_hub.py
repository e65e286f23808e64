"""Tests for k3ckpt.testing.hub: the real huggingface_hub / modelscope clients download through it.

In-process clients get the hub through ``endpoint=`` (huggingface_hub reads ``HF_ENDPOINT`` at
import time) or ``monkeypatch.setenv`` (modelscope_hub reads ``MODELSCOPE_ENDPOINT`` per HubApi);
subprocess clients (the ``hf`` CLI) get it through ``env=hub.client_env()``.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
from safetensors.numpy import save_file

from helpers import REPO, settled
from k3ckpt.testing.hub import Fault, LoopbackHub, RepoSpec, main

REPO_ROOT = Path(__file__).resolve().parents[1]
HF_CLI = Path(sys.executable).with_name("hf")


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------


def _write_checkpoint(root: Path) -> Path:
    """A tiny Kimi-K3-shaped checkpoint: config, index, two shards, LICENSE, one nested file."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    shard1 = {
        "language_model.model.embed_tokens.weight": rng.standard_normal((64, 512)).astype(np.float32),
        "language_model.model.layers.0.mlp.gate_proj.weight": rng.standard_normal((256, 64)).astype(np.float32),
    }
    shard2 = {
        "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed": rng.integers(
            0, 255, (32, 16), dtype=np.uint8
        ),
        "language_model.model.norm.weight": np.ones(64, dtype=np.float32),
    }
    names = ("model-00001-of-000002.safetensors", "model-00002-of-000002.safetensors")
    save_file(shard1, str(root / names[0]))
    save_file(shard2, str(root / names[1]))
    weight_map = {k: names[0] for k in shard1} | {k: names[1] for k in shard2}
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2)
    )
    (root / "config.json").write_text(
        json.dumps({"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"]})
    )
    (root / "LICENSE").write_text("Modified MIT License\n")
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer_config.json").write_text('{"model_max_length": 1048576}\n')
    return root


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _source_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tree_bytes(root: Path, names: Iterator[str] | list[str]) -> dict[str, bytes]:
    return {n: (root / n).read_bytes() for n in names}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_checkpoint(tmp_path_factory.mktemp("ckpt") / "Kimi-K3")


@pytest.fixture
def hub(checkpoint: Path, hash_cache: Path) -> Iterator[LoopbackHub]:
    with LoopbackHub({REPO: checkpoint}, cache_dir=hash_cache) as h:
        yield h


@pytest.fixture(autouse=True)
def _client_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep in-process clients off the network and out of the user's caches."""
    import huggingface_hub.constants as hc
    import modelscope_hub.config as msc

    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    # modelscope_hub caches its endpoint config on the first HubApi of the process.
    monkeypatch.setattr(msc, "_default_config", None)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-home"))
    monkeypatch.delenv("MODELSCOPE_ENDPOINT", raising=False)
    monkeypatch.delenv("MODELSCOPE_DOMAIN", raising=False)


def _subprocess_env(hub: LoopbackHub, tmp_path: Path) -> dict[str, str]:
    env = hub.client_env()
    env.update({"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_PROGRESS_BARS": "1", "NO_COLOR": "1"})
    env.pop("HF_TOKEN", None)
    return env


def _get(hub: LoopbackHub, path: str, method: str = "GET", headers: dict[str, str] | None = None,
         conn: http.client.HTTPConnection | None = None) -> tuple[http.client.HTTPResponse, bytes]:
    c = conn or http.client.HTTPConnection(hub.host, hub.port, timeout=10)
    c.request(method, path, headers=headers or {})
    r = c.getresponse()
    body = r.read()
    if conn is None:
        c.close()
    return r, body


def _resolve_path(path: str, rev: str = "main") -> str:
    return f"/{REPO}/resolve/{rev}/{path}"


SHARD = "model-00001-of-000002.safetensors"


# ----------------------------------------------------------------------------------------------
# repo model and hashing
# ----------------------------------------------------------------------------------------------


def test_listing_hashes_and_commit(hub: LoopbackHub, checkpoint: Path, hash_cache: Path) -> None:
    src = _source_files(checkpoint)
    files = hub.files(REPO)
    assert set(files) == set(src)
    for name, data in src.items():
        e = files[name]
        assert e.size == len(data)
        assert e.sha256 == hashlib.sha256(data).hexdigest()
        assert e.lfs == name.endswith(".safetensors")
        assert e.etag == (e.sha256 if e.lfs else _git_oid(data))
    assert re.fullmatch(r"[0-9a-f]{40}", hub.commit(REPO))
    assert hub.snapshot(REPO).dirs.keys() == {"tokenizer"}

    # Same content -> same commit; hashes come from the cache on the next start.
    with LoopbackHub({REPO: checkpoint}, cache_dir=hash_cache) as again:
        assert again.commit(REPO) == hub.commit(REPO)
        assert again.hash_stats.hashed == 0 and again.hash_stats.cached == len(src)


def test_rescan_after_change_and_pinned_commit(tmp_path: Path) -> None:
    root = _write_checkpoint(tmp_path / "ckpt")
    pinned = "f831ab66814297da540d832a5235f8e904f29d06"
    with LoopbackHub({REPO: root, "other/copy": RepoSpec(root, commit=pinned, tags=("v1",))},
                     cache_dir=tmp_path / "hc") as hub:
        before = hub.commit(REPO)
        assert hub.commit("other/copy") == pinned
        (root / "LICENSE").write_text("changed\n")
        hub.rescan()
        assert hub.commit(REPO) != before
        assert hub.hash_stats.hashed == 1  # only LICENSE; the second repo shares the dir and its cache
        r, body = _get(hub, "/api/models/other/copy/revision/v1")
        assert r.status == 200 and json.loads(body)["sha"] == pinned
        r, _ = _get(hub, _resolve_path("LICENSE", "refs%2Fheads%2Fmain"))
        assert r.status == 200


# ----------------------------------------------------------------------------------------------
# huggingface_hub
# ----------------------------------------------------------------------------------------------


def test_hf_snapshot_download_local_dir_and_cache(hub: LoopbackHub, checkpoint: Path, tmp_path: Path) -> None:
    from huggingface_hub import snapshot_download

    src = _source_files(checkpoint)
    local = snapshot_download(REPO, endpoint=hub.url, local_dir=tmp_path / "local", token=False)
    assert _tree_bytes(Path(local), list(src)) == src
    cached = snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path / "cache", token=False)
    assert Path(cached).name == hub.commit(REPO)
    assert _tree_bytes(Path(cached), list(src)) == src
    # Every file was sent exactly twice (once per destination), nothing more.
    for name, data in src.items():
        assert hub.requests(name, method="GET") == 2
        assert hub.bytes_sent(name) == 2 * len(data)
    assert {"hf.model_info", "hf.tree", "hf.resolve"} <= set(hub.routes_used())


def test_hf_hub_download_single_file(hub: LoopbackHub, checkpoint: Path, tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(REPO, SHARD, endpoint=hub.url, cache_dir=tmp_path / "c", token=False)
    assert Path(path).read_bytes() == (checkpoint / SHARD).read_bytes()
    # The blob is named by the ETag: the sha256 for an LFS file.
    assert Path(path).resolve().name == hub.files(REPO)[SHARD].sha256
    methods = [(r.method, r.status) for r in hub.request_log if r.file == SHARD]
    assert methods == [("HEAD", 200), ("GET", 200)]
    nested = hf_hub_download(REPO, "tokenizer/tokenizer_config.json", endpoint=hub.url,
                             local_dir=tmp_path / "l", token=False)
    assert Path(nested).read_bytes() == (checkpoint / "tokenizer/tokenizer_config.json").read_bytes()


def test_hf_client_resumes_after_truncated_body(hub: LoopbackHub, checkpoint: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hc
    from huggingface_hub import hf_hub_download

    # http_get only counts whole DOWNLOAD_CHUNK_SIZE (10 MB) chunks towards the resume offset.
    monkeypatch.setattr(hc, "DOWNLOAD_CHUNK_SIZE", 16384)
    after = 3 * 16384
    hub.inject("drop_after", SHARD, after=after, reset=False)  # FIN: huggingface_hub resumes (RST: it gives up)
    path = hf_hub_download(REPO, SHARD, endpoint=hub.url, cache_dir=tmp_path / "c", token=False)
    size = (checkpoint / SHARD).stat().st_size
    assert Path(path).read_bytes() == (checkpoint / SHARD).read_bytes()
    gets = [r for r in hub.request_log if r.file == SHARD and r.method == "GET"]
    assert [(g.status, g.range) for g in gets] == [(200, None), (206, f"bytes={after}-")]
    assert hub.bytes_sent(SHARD) == size


def test_model_info_files_metadata(hub: LoopbackHub, checkpoint: Path) -> None:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url, token=False)
    info = api.model_info(REPO, files_metadata=True)
    assert info.id == REPO and info.sha == hub.commit(REPO)
    src = _source_files(checkpoint)
    assert {s.rfilename for s in info.siblings} == set(src)
    for s in info.siblings:
        data = src[s.rfilename]
        assert s.size == len(data)
        if s.rfilename.endswith(".safetensors"):
            assert s.lfs is not None and s.lfs.sha256 == hashlib.sha256(data).hexdigest()
            assert s.lfs.size == len(data)
        else:
            assert s.lfs is None and s.blob_id == _git_oid(data)
    by_commit = api.model_info(REPO, revision=hub.commit(REPO))
    assert by_commit.sha == hub.commit(REPO) and by_commit.siblings[0].size is None


def test_list_repo_tree_recursive_paginated(checkpoint: Path, hash_cache: Path) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile, RepoFolder

    with LoopbackHub({REPO: checkpoint}, cache_dir=hash_cache, page_size=2) as hub:
        api = HfApi(endpoint=hub.url, token=False)
        entries = list(api.list_repo_tree(REPO, recursive=True))
        src = _source_files(checkpoint)
        assert {e.path for e in entries if isinstance(e, RepoFile)} == set(src)
        assert [e.path for e in entries if isinstance(e, RepoFolder)] == ["tokenizer"]
        # 8 entries at 2 per page: 4 requests following Link: rel="next".
        assert hub.routes_used()["hf.tree"] == 4
        for e in entries:
            if isinstance(e, RepoFile) and e.lfs is not None:
                assert e.lfs.sha256 == hashlib.sha256(src[e.path]).hexdigest()
                assert e.lfs.pointer_size > 0
        top = list(api.list_repo_tree(REPO))
        assert "tokenizer/tokenizer_config.json" not in {e.path for e in top} and "tokenizer" in {e.path for e in top}
        sub = list(api.list_repo_tree(REPO, path_in_repo="tokenizer", expand=True))
        assert [e.path for e in sub] == ["tokenizer/tokenizer_config.json"]
        assert sub[0].last_commit is not None and sub[0].last_commit.oid == hub.commit(REPO)


def test_get_paths_info(hub: LoopbackHub, checkpoint: Path) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile, RepoFolder

    api = HfApi(endpoint=hub.url, token=False)
    infos = api.get_paths_info(REPO, ["config.json", SHARD, "tokenizer", "missing.bin"])
    by_path = {i.path: i for i in infos}
    assert set(by_path) == {"config.json", SHARD, "tokenizer"}
    assert isinstance(by_path["tokenizer"], RepoFolder)
    shard = by_path[SHARD]
    assert isinstance(shard, RepoFile) and shard.size == (checkpoint / SHARD).stat().st_size
    assert shard.lfs is not None and shard.lfs.sha256 == hub.files(REPO)[SHARD].sha256
    assert by_path["config.json"].blob_id == _git_oid((checkpoint / "config.json").read_bytes())


def test_hf_filesystem_ranged_read(hub: LoopbackHub, checkpoint: Path) -> None:
    from huggingface_hub import HfFileSystem

    fs = HfFileSystem(endpoint=hub.url, token=False, skip_instance_cache=True)
    data = (checkpoint / SHARD).read_bytes()
    hub.reset_counters()
    with fs.open(f"{REPO}/{SHARD}", "rb", cache_type="none") as f:
        f.seek(10_000)
        chunk = f.read(777)
    assert chunk == data[10_000:10_777]
    assert settled(lambda: hub.bytes_sent(SHARD), 777) == 777
    assert [r.range for r in hub.request_log if r.file == SHARD] == ["bytes=10000-10776"]
    assert fs.info(f"{REPO}/{SHARD}")["size"] == len(data)


def test_hf_cli_download_and_cache_verify(hub: LoopbackHub, tmp_path: Path) -> None:
    assert HF_CLI.exists(), HF_CLI
    env = _subprocess_env(hub, tmp_path)
    cache = tmp_path / "cache"
    dl = subprocess.run([str(HF_CLI), "download", REPO, "--cache-dir", str(cache)], env=env,
                        capture_output=True, text=True, timeout=60)
    assert dl.returncode == 0, dl.stderr
    verify = [str(HF_CLI), "cache", "verify", REPO]
    ok = subprocess.run([*verify, "--cache-dir", str(cache)], env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "checksums match" in ok.stdout

    # The verification really compares against the hub: a flipped byte in a local_dir copy fails.
    from huggingface_hub import snapshot_download

    local = Path(snapshot_download(REPO, endpoint=hub.url, local_dir=tmp_path / "local", token=False))
    good = subprocess.run([*verify, "--local-dir", str(local)], env=env, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stdout + good.stderr
    blob = bytearray((local / SHARD).read_bytes())
    blob[100] ^= 1
    (local / SHARD).write_bytes(bytes(blob))
    bad = subprocess.run([*verify, "--local-dir", str(local)], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and SHARD in bad.stdout + bad.stderr


def test_hf_typed_errors(hub: LoopbackHub, tmp_path: Path) -> None:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi(endpoint=hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("nobody/nothing")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("nobody/nothing", "config.json", endpoint=hub.url, cache_dir=tmp_path, token=False)
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="no-such-branch", endpoint=hub.url, cache_dir=tmp_path,
                        token=False)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "no-such-file.json", endpoint=hub.url, cache_dir=tmp_path, token=False)
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="no-such-dir"))
    r, _ = _get(hub, _resolve_path("nope.bin"), method="HEAD")
    assert r.status == 404 and r.getheader("X-Error-Code") == "EntryNotFound"
    assert r.getheader("X-Repo-Commit") == hub.commit(REPO)


# ----------------------------------------------------------------------------------------------
# modelscope
# ----------------------------------------------------------------------------------------------


def test_modelscope_snapshot_download(hub: LoopbackHub, checkpoint: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from modelscope import snapshot_download

    src = _source_files(checkpoint)
    cached = snapshot_download(REPO, cache_dir=str(tmp_path / "ms"), endpoint=hub.url)
    assert _tree_bytes(Path(cached), list(src)) == src
    # >=: on a starved machine the ModelScope client retries a download that timed out (its own
    # policy); every file came through the download route, and the bytes are right
    assert hub.routes_used()["ms.files"] == 1 and hub.routes_used()["ms.download"] >= len(src)

    # The endpoint from the environment works in-process once the cached default config is
    # cleared: modelscope_hub reads the variable only for the first HubApi of the process.
    import modelscope_hub.config as msc

    monkeypatch.setenv("MODELSCOPE_ENDPOINT", hub.url)
    msc.set_default_config(None)
    local = snapshot_download(REPO, local_dir=str(tmp_path / "ms-local"), revision=hub.commit(REPO))
    assert _tree_bytes(Path(local), list(src)) == src
    for name, data in src.items():
        assert hub.bytes_sent(name) >= 2 * len(data)  # both runs downloaded it (see above for >=)


def test_modelscope_metadata_and_errors(hub: LoopbackHub, tmp_path: Path) -> None:
    from modelscope import snapshot_download
    from modelscope_hub import HubApi

    api = HubApi(endpoint=hub.url)
    assert api.repo_exists(REPO, "model") and not api.repo_exists("nobody/nothing", "model")
    listed = {f.path: f for f in api.list_repo_files(REPO, "model")}
    assert listed[SHARD].sha256 == hub.files(REPO)[SHARD].sha256
    revs = requests.get(f"{hub.url}/api/v1/models/{REPO}/revisions", timeout=10).json()
    assert revs["Success"] and {b["Revision"] for b in revs["Data"]["RevisionMap"]["Branches"]} == {"main", "master"}
    files = requests.get(f"{hub.url}/api/v1/models/{REPO}/repo/files",
                         params={"Revision": "master", "Recursive": "False", "Root": "tokenizer"}, timeout=10).json()
    assert [f["Path"] for f in files["Data"]["Files"]] == ["tokenizer/tokenizer_config.json"]
    with pytest.raises(requests.HTTPError) as err:
        snapshot_download("nobody/nothing", cache_dir=str(tmp_path / "ms"), endpoint=hub.url)
    assert "404" in str(err.value)
    r = requests.get(hub.modelscope_url(REPO, SHARD, revision="nope"), timeout=10)
    assert r.status_code == 404 and r.json()["Success"] is False


# ----------------------------------------------------------------------------------------------
# HTTP semantics, faults, counters, auth
# ----------------------------------------------------------------------------------------------


def test_range_semantics(hub: LoopbackHub, checkpoint: Path) -> None:
    data = (checkpoint / SHARD).read_bytes()
    size = len(data)
    entry = hub.files(REPO)[SHARD]
    conn = http.client.HTTPConnection(hub.host, hub.port, timeout=10)  # one keep-alive connection
    try:
        r, body = _get(hub, _resolve_path(SHARD), "HEAD", conn=conn)
        assert r.status == 200 and body == b"" and int(r.getheader("Content-Length")) == size
        assert r.getheader("X-Repo-Commit") == hub.commit(REPO)
        assert r.getheader("ETag") == f'"{entry.sha256}"' == r.getheader("X-Linked-Etag")
        assert r.getheader("X-Linked-Size") == str(size) and r.getheader("Accept-Ranges") == "bytes"
        cases = {
            "bytes=0-9": (0, 9),
            "bytes=100-": (100, size - 1),
            "bytes=-16": (size - 16, size - 1),
            f"bytes=10-{size + 50}": (10, size - 1),
            f"bytes=-{size + 5}": (0, size - 1),
        }
        for rng, (a, b) in cases.items():
            r, body = _get(hub, _resolve_path(SHARD), headers={"Range": rng}, conn=conn)
            assert r.status == 206, rng
            assert r.getheader("Content-Range") == f"bytes {a}-{b}/{size}"
            assert body == data[a : b + 1] and int(r.getheader("Content-Length")) == b - a + 1
        for rng in (f"bytes={size}-", f"bytes={size + 10}-{size + 20}", "bytes=-0"):
            r, body = _get(hub, _resolve_path(SHARD), headers={"Range": rng}, conn=conn)
            assert r.status == 416 and r.getheader("Content-Range") == f"bytes */{size}" and body == b""
        r, body = _get(hub, _resolve_path(SHARD), headers={"Range": "bytes=0-1,5-6"}, conn=conn)
        assert r.status == 200 and body == data  # multi-range: whole file
        r, body = _get(hub, hub.modelscope_url(REPO, SHARD).split(str(hub.port), 1)[1],
                       headers={"Range": "bytes=5-9"}, conn=conn)
        assert r.status == 206 and body == data[5:10]
    finally:
        conn.close()


def test_fault_status(hub: LoopbackHub, checkpoint: Path) -> None:
    data = (checkpoint / SHARD).read_bytes()
    hub.inject("status", SHARD, status=503)
    r, _ = _get(hub, _resolve_path(SHARD), "HEAD")
    assert r.status == 200  # HEAD is not in the default methods
    r, _ = _get(hub, _resolve_path(SHARD))
    assert r.status == 503
    r, body = _get(hub, _resolve_path(SHARD))
    assert r.status == 200 and body == data  # times=1: used up
    hub.inject("status", "*.safetensors", status=429, retry_after=2, times=2, methods=("GET", "HEAD"))
    r, _ = _get(hub, _resolve_path(SHARD), "HEAD")
    assert r.status == 429 and r.getheader("Retry-After") == "2"
    r, body = _get(hub, hub.modelscope_url(REPO, SHARD).split(str(hub.port), 1)[1])
    assert r.status == 429 and json.loads(body)["Success"] is False
    assert len(hub.faults) == 0
    hub.inject("status", f"/api/models/{REPO}/tree/*", scope="api", status=500, times=None)
    for _ in range(3):
        r, _ = _get(hub, f"/api/models/{REPO}/tree/main")
        assert r.status == 500
    hub.faults.clear()
    r, _ = _get(hub, f"/api/models/{REPO}/tree/main")
    assert r.status == 200


@pytest.mark.parametrize("kind", ["drop_after", "short_body"])
def test_fault_truncated_bodies(hub: LoopbackHub, checkpoint: Path, kind: str) -> None:
    data = (checkpoint / SHARD).read_bytes()
    params = {"after": 1000} if kind == "drop_after" else {"missing": 10}
    expect = data[:1000] if kind == "drop_after" else data[:-10]
    hub.inject(kind, SHARD, **params)
    conn = http.client.HTTPConnection(hub.host, hub.port, timeout=10)
    conn.request("GET", _resolve_path(SHARD))
    r = conn.getresponse()
    assert r.status == 200 and int(r.getheader("Content-Length")) == len(data)
    got = bytearray()
    if kind == "drop_after":  # RST: the read fails
        with pytest.raises(ConnectionResetError):
            while chunk := r.read(4096):
                got += chunk
    else:  # FIN: the body just ends early
        while chunk := r.read(4096):
            got += chunk
        assert len(got) == len(data) - 10
    conn.close()
    assert data.startswith(bytes(got)) and len(got) <= len(expect)
    assert hub.bytes_sent(SHARD) == len(expect)
    r, body = _get(hub, _resolve_path(SHARD))
    assert body == data


def test_fault_stall(hub: LoopbackHub, checkpoint: Path) -> None:
    data = (checkpoint / SHARD).read_bytes()
    hub.inject("stall", SHARD, after=4096, seconds=0.3)
    t0 = time.monotonic()
    r, body = _get(hub, _resolve_path(SHARD))
    assert time.monotonic() - t0 >= 0.3 and body == data
    hub.inject("stall", SHARD, after=4096, seconds=0.05, close=True)
    conn = http.client.HTTPConnection(hub.host, hub.port, timeout=10)
    conn.request("GET", _resolve_path(SHARD))
    with pytest.raises(http.client.IncompleteRead) as err:
        conn.getresponse().read()
    assert len(err.value.partial) == 4096
    conn.close()


def test_fault_corrupt_byte(hub: LoopbackHub, checkpoint: Path) -> None:
    data = (checkpoint / SHARD).read_bytes()
    fault = hub.inject("corrupt_byte", SHARD, offset=5000)
    r, body = _get(hub, _resolve_path(SHARD), headers={"Range": "bytes=0-99"})
    assert body == data[:100] and fault.hits == 0  # offset not served: not consumed
    r, body = _get(hub, _resolve_path(SHARD), headers={"Range": "bytes=4990-5009"})
    assert r.status == 206 and body[10] == data[5000] ^ 0xFF
    assert body[:10] + body[11:] == data[4990:5000] + data[5001:5010]
    r, body = _get(hub, _resolve_path(SHARD))
    assert body == data and fault.exhausted


def test_fault_range_quirks(hub: LoopbackHub, checkpoint: Path) -> None:
    data = (checkpoint / SHARD).read_bytes()
    size = len(data)
    f = hub.inject("ignore_range", SHARD)
    r, body = _get(hub, _resolve_path(SHARD))  # no Range header: not consumed
    assert r.status == 200 and f.hits == 0
    r, body = _get(hub, _resolve_path(SHARD), headers={"Range": "bytes=100-199"})
    assert r.status == 200 and body == data and r.getheader("Content-Range") is None
    hub.inject("ignore_range_with_content_range", SHARD, times=None)
    for path in (_resolve_path(SHARD), hub.modelscope_url(REPO, SHARD).split(str(hub.port), 1)[1]):
        r, body = _get(hub, path, headers={"Range": "bytes=100-199"})
        assert r.status == 200 and r.getheader("Content-Range") == f"bytes 100-199/{size}"
        assert body == data[100:200]


def test_counters_thread_safe(hub: LoopbackHub, checkpoint: Path) -> None:
    data = (checkpoint / SHARD).read_bytes()
    hub.reset_counters()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with requests.Session() as s:
                for j in range(10):
                    a = (i * 10 + j) * 50
                    r = s.get(hub.resolve_url(REPO, SHARD), headers={"Range": f"bytes={a}-{a + 99}"}, timeout=10)
                    assert r.status_code == 206 and r.content == data[a : a + 100]
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert hub.requests(SHARD) == 80 and hub.requests(SHARD, method="HEAD") == 0
    assert settled(lambda: hub.bytes_sent(SHARD), 8000) == 8000 == hub.total_bytes_sent()
    hub.reset_counters()
    assert hub.requests(SHARD) == 0 and hub.bytes_sent(SHARD) == 0 and hub.request_log == []


def test_a_request_answered_across_a_reset_counts_nowhere(hub: LoopbackHub, checkpoint: Path) -> None:
    """A test's counters must not include the rest of an earlier test's stalled body, which
    wakes up later and is written into its dead socket."""
    data = (checkpoint / SHARD).read_bytes()
    fault = hub.inject("stall", SHARD, after=4096, seconds=0.5)
    earlier: list[bytes] = []
    t = threading.Thread(target=lambda: earlier.append(_get(hub, _resolve_path(SHARD))[1]))
    t.start()
    assert settled(lambda: hub.bytes_sent(SHARD), 4096) == 4096 and fault.hits == 1
    hub.reset_counters()  # the stalled request is still being answered
    r, body = _get(hub, _resolve_path(SHARD), headers={"Range": "bytes=0-99"})
    assert r.status == 206 and body == data[:100]
    t.join()
    assert earlier == [data]  # the stalled request was answered in full...
    # ... and only the request that arrived after the reset is counted and logged (waiting long
    # enough for the stalled handler's count of its last bytes, were it counted)
    assert settled(hub.total_bytes_sent, 100 + len(data) - 4096, timeout=0.5) == 100 == hub.bytes_sent(SHARD)
    assert hub.requests(SHARD) == 1
    assert [(rec.range, rec.body_bytes) for rec in hub.request_log] == [("bytes=0-99", 100)]


def test_a_request_is_logged_as_its_answer_starts(hub: LoopbackHub, checkpoint: Path) -> None:
    """A client that has its answer finds the request in the log, even while the body is sent."""
    data = (checkpoint / SHARD).read_bytes()
    hub.inject("stall", SHARD, after=4096, seconds=0.5)
    conn = http.client.HTTPConnection(hub.host, hub.port, timeout=10)
    conn.request("GET", _resolve_path(SHARD))
    resp = conn.getresponse()
    assert resp.read(4096) == data[:4096]  # the rest is stalled: the handler has not returned
    [rec] = hub.request_log
    assert (rec.route, rec.status, rec.file, rec.method) == ("hf.resolve", 200, SHARD, "GET")
    assert settled(lambda: rec.body_bytes, 4096) == 4096 and not rec.finished
    assert resp.read() == data[4096:]
    conn.close()
    assert settled(lambda: int(rec.finished), 1) and rec.body_bytes == len(data) and len(hub.request_log) == 1


def test_auth(checkpoint: Path, hash_cache: Path, tmp_path: Path) -> None:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
    from modelscope import snapshot_download as ms_snapshot_download

    with LoopbackHub({REPO: checkpoint}, cache_dir=hash_cache, token="hf_loopback") as hub:
        assert requests.get(hub.resolve_url(REPO, "config.json"), timeout=10).status_code == 401
        with pytest.raises(HfHubHTTPError) as err:
            hf_hub_download(REPO, "config.json", endpoint=hub.url, cache_dir=tmp_path / "a", token=False)
        assert err.value.response.status_code == 401
        with pytest.raises(HfHubHTTPError) as err:
            hf_hub_download(REPO, "config.json", endpoint=hub.url, cache_dir=tmp_path / "b", token="wrong")
        assert err.value.response.status_code == 401
        # huggingface_hub maps a 401 to RepositoryNotFoundError only for https:// URLs.
        with pytest.raises(HfHubHTTPError) as err:
            HfApi(endpoint=hub.url, token=False).model_info(REPO)
        assert err.value.response.status_code == 401 and not isinstance(err.value, RepositoryNotFoundError)
        path = hf_hub_download(REPO, "config.json", endpoint=hub.url, cache_dir=tmp_path / "c", token="hf_loopback")
        assert Path(path).read_bytes() == (checkpoint / "config.json").read_bytes()
        with pytest.raises(requests.HTTPError) as ms_err:
            ms_snapshot_download(REPO, cache_dir=str(tmp_path / "ms"), endpoint=hub.url, token="wrong")
        assert "401" in str(ms_err.value)
        out = ms_snapshot_download(REPO, cache_dir=str(tmp_path / "ms"), endpoint=hub.url, token="hf_loopback")
        assert (Path(out) / SHARD).read_bytes() == (checkpoint / SHARD).read_bytes()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc to sample RSS")
def test_sparse_64mib_streams_without_buffering(tmp_path: Path) -> None:
    root = tmp_path / "sparse"
    root.mkdir()
    size = 64 << 20
    with open(root / "blob.bin", "wb") as f:
        f.truncate(size)
        for off in (0, 12345, 33 << 20, size - 7):
            f.seek(off)
            f.write(b"K3!")
    expect = hashlib.sha256()
    with open(root / "blob.bin", "rb") as f:
        while block := f.read(8 << 20):
            expect.update(block)
    with LoopbackHub({REPO: root}, cache_dir=tmp_path / "hc") as hub:
        entry = hub.files(REPO)["blob.bin"]
        assert entry.lfs and entry.size == size and entry.sha256 == expect.hexdigest()
        base = _rss_bytes()
        peak = base
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.002):
                peak = max(peak, _rss_bytes())

        sampler = threading.Thread(target=sample)
        sampler.start()
        got = hashlib.sha256()
        t0 = time.monotonic()
        try:
            conn = http.client.HTTPConnection(hub.host, hub.port, timeout=30)
            conn.request("GET", _resolve_path("blob.bin"))
            r = conn.getresponse()
            assert r.status == 200 and int(r.getheader("Content-Length")) == size
            n = 0
            while chunk := r.read(256 << 10):
                got.update(chunk)
                n += len(chunk)
            conn.close()
        finally:
            done.set()
            sampler.join()
        elapsed = time.monotonic() - t0
        assert n == size and got.hexdigest() == expect.hexdigest()
        assert hub.bytes_sent("blob.bin") == size
        assert peak - base < 24 << 20, f"RSS grew by {(peak - base) >> 20} MiB while streaming 64 MiB"
        assert elapsed < 20


# ----------------------------------------------------------------------------------------------
# API surface and CLI
# ----------------------------------------------------------------------------------------------


def test_fault_validation_and_constructor_errors(checkpoint: Path) -> None:
    with pytest.raises(ValueError):
        Fault(kind="explode")
    with pytest.raises(ValueError):
        Fault(kind="drop_after", scope="api")
    with pytest.raises(ValueError):
        Fault(kind="status", status=200)
    with pytest.raises(ValueError):
        LoopbackHub({})
    with pytest.raises(ValueError):
        LoopbackHub({"a/b/c": checkpoint})
    with pytest.raises(ValueError):
        RepoSpec(checkpoint, commit="main")
    hub = LoopbackHub({REPO: checkpoint})
    with pytest.raises(RuntimeError):
        _ = hub.url
    hub.stop()  # stopping a hub that never started is a no-op


def test_cli_main_serves_until_interrupted(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3ckpt.testing.hub", str(checkpoint), "--repo", REPO, "--port", "0",
         "--cache-dir", str(tmp_path / "hc")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        text = "".join(lines)
        url = re.search(r"Serving on (http://127\.0\.0\.1:\d+)", text)
        assert url, text + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        assert f"export HF_ENDPOINT={url.group(1)}" in text
        assert f"export MODELSCOPE_ENDPOINT={url.group(1)}" in text and "HF_HUB_DISABLE_XET=1" in text
        info = requests.get(f"{url.group(1)}/api/models/{REPO}", timeout=10).json()
        assert info["id"] == REPO
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
