"""`k3ckpt fetch --cache-dir`: the hubs' own cache layouts, read back offline by the real clients
(huggingface_hub, modelscope, and vLLM's own weight-download call), and `fetch` under
HF_HUB_OFFLINE=1 (verifies what is there, never asks the hub)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ckpt_edit import tree_digests
from helpers import REPO, kill_at_pause, run
from helpers import hub_offline as _offline_hf
from k3ckpt.hub.cache import RECORDS_DIR


@pytest.fixture()
def hub(served_hub: tuple[Any, Path], isolated_hub_clients: None) -> tuple[Any, Path]:
    return served_hub


def _fetch(h: Any, *args: str) -> Any:
    return run("fetch", "--repo", REPO, "--endpoint", h.url, "--chunk-size", "64KiB", "--workers", "4", *args)


def _snapshot_digests(snapshot: str | Path) -> dict[str, str]:
    return tree_digests(Path(snapshot))


def test_hf_cache_layout_is_what_the_client_returns_offline(hub, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import scan_cache_dir, snapshot_download

    h, served = hub
    cache = tmp_path / "hf-cache"
    res = _fetch(h, "--source", "hf", "--cache-dir", str(cache), "--revision", "main")
    assert res.exit_code == 0, res.output
    repo_dir = cache / "models--moonshotai--Kimi-K3"
    commit = h.commit(REPO)
    assert (repo_dir / "refs" / "main").read_text() == commit  # no newline, as the client writes it
    snap = repo_dir / "snapshots" / commit
    files = h.files(REPO)
    for rel, entry in files.items():
        link = snap / rel
        assert link.is_symlink() and not os.path.isabs(os.readlink(link))
        # blob named by the ETag the hub sends: sha256 for LFS files, git blob id for small ones
        assert os.path.realpath(link) == str((repo_dir / "blobs" / entry.etag).resolve())
    assert not list((repo_dir / "blobs").glob("*.part*"))
    assert not (snap / ".cache").exists() and not list(cache.rglob("owner.json"))  # no k3ckpt record where clients look
    assert str(snap) in res.output

    _offline_hf(monkeypatch)
    h.reset_counters()
    got = snapshot_download(REPO, cache_dir=cache, local_files_only=True)
    assert got == str(snap)
    assert _snapshot_digests(got) == tree_digests(served)
    # the client's own cache scan accepts it (k3ckpt's .k3ckpt/ folder is not a corruption)
    info = scan_cache_dir(cache)
    assert not info.warnings and [r.repo_id for r in info.repos] == [REPO]
    assert h.request_log == []


def test_vllm_weight_download_finds_the_cache_offline(hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's own ``download_weights_from_hf`` (loaded from the wheel), offline, returns the
    snapshot fetch wrote; it lists only the weights its allow_patterns select."""
    from engines import load_vllm, missing_reason

    vllm = load_vllm()
    if vllm is None:
        pytest.skip(missing_reason("vllm"))
    h, served = hub
    cache = tmp_path / "hf-cache"
    assert _fetch(h, "--source", "hf", "--cache-dir", str(cache)).exit_code == 0
    _offline_hf(monkeypatch)
    h.reset_counters()
    folder = vllm.download_weights_from_hf(REPO, cache_dir=str(cache), allow_patterns=["*.safetensors"],
                                         revision=None)
    assert folder == str(cache / "models--moonshotai--Kimi-K3" / "snapshots" / h.commit(REPO))
    weights = sorted(p.name for p in Path(folder).glob("*.safetensors"))
    assert weights == sorted(p.name for p in served.glob("*.safetensors"))
    assert _snapshot_digests(folder) == tree_digests(served)
    assert h.request_log == []


def test_hf_client_refuses_an_incomplete_cache_fetch_offline(hub, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """--include fetches part of the commit: the tree listing fetch records lets the client's
    offline check say so, instead of returning a snapshot that misses weights."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError

    h, _ = hub
    cache = tmp_path / "hf-cache"
    assert _fetch(h, "--source", "hf", "--cache-dir", str(cache), "--include", "*.json").exit_code == 0
    _offline_hf(monkeypatch)
    with pytest.raises(IncompleteSnapshotError):
        snapshot_download(REPO, cache_dir=cache, local_files_only=True)
    got = snapshot_download(REPO, cache_dir=cache, local_files_only=True, allow_patterns=["*.json"])
    assert sorted(p.name for p in Path(got).iterdir()) == sorted(p for p in h.files(REPO) if p.endswith(".json"))


def test_default_cache_is_the_clients_own(hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hfc

    h, served = hub
    monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(tmp_path / "from-env"))
    res = _fetch(h, "--source", "hf", "--include", "config.json")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "from-env" / "models--moonshotai--Kimi-K3" / "snapshots" / h.commit(REPO) / "config.json").is_file()
    res = _fetch(h, "--source", "modelscope", "--include", "config.json")  # MODELSCOPE_CACHE (isolated_hub_clients)
    assert res.exit_code == 0, res.output
    assert (Path(os.environ["MODELSCOPE_CACHE"]) / "models" / "moonshotai--Kimi-K3" / "snapshots" / "master" /
            "config.json").read_bytes() == (served / "config.json").read_bytes()


def test_modelscope_cache_is_what_its_client_returns_offline(hub, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``modelscope`` client offline, called directly and as vLLM's ``VLLM_USE_MODELSCOPE=1``
    path calls it (its own ``maybe_download_from_modelscope`` from the wheel when present)."""
    from modelscope.hub.snapshot_download import snapshot_download

    from engines import load_vllm

    h, served = hub
    cache = tmp_path / "ms-cache"
    res = _fetch(h, "--source", "modelscope", "--cache-dir", str(cache))
    assert res.exit_code == 0, res.output
    snap = cache / "models" / "moonshotai--Kimi-K3" / "snapshots" / "master"
    assert not (snap / ".cache").exists() and not (snap / ".k3ckpt-fetch.lock").exists()
    h.reset_counters()
    got = [snapshot_download(REPO, cache_dir=str(cache), local_files_only=True)]
    vllm = load_vllm()
    if vllm is not None:
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
        got.append(vllm.maybe_download_from_modelscope(REPO, download_dir=str(cache)))
    for folder in got:
        assert Path(folder) == snap
        assert tree_digests(Path(folder)) == tree_digests(served)
    assert h.request_log == []


def test_second_cache_fetch_does_nothing_and_says_so(hub, tmp_path: Path) -> None:
    h, served = hub
    cache = tmp_path / "hf-cache"
    assert _fetch(h, "--source", "hf", "--cache-dir", str(cache)).exit_code == 0
    snap = cache / "models--moonshotai--Kimi-K3" / "snapshots" / h.commit(REPO)
    before = {p: (os.lstat(p).st_ino, os.lstat(p).st_mtime_ns) for p in snap.rglob("*")}
    h.reset_counters()
    res = _fetch(h, "--source", "hf", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["fetched"] == [] and doc["bytes_downloaded"] == 0 and len(doc["skipped"]) == len(h.files(REPO))
    assert {p: (os.lstat(p).st_ino, os.lstat(p).st_mtime_ns) for p in snap.rglob("*")} == before
    assert sum(h.bytes_sent(p) for p in h.files(REPO)) == 0


def test_foreign_file_in_a_snapshot_is_never_replaced(hub, tmp_path: Path) -> None:
    h, _ = hub
    cache = tmp_path / "hf-cache"
    snap = cache / "models--moonshotai--Kimi-K3" / "snapshots" / h.commit(REPO)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("someone else's file\n")
    res = _fetch(h, "--source", "hf", "--cache-dir", str(cache))
    assert res.exit_code == 1
    assert "config.json" in res.output and "not replaced" in res.output
    assert (snap / "config.json").read_text() == "someone else's file\n"
    assert not (cache / "models--moonshotai--Kimi-K3" / "refs" / "main").exists()  # the ref only when complete


def test_local_dir_and_cache_dir_together_are_refused(tmp_path: Path) -> None:
    res = run("fetch", "--source", "hf", "--repo", REPO, "--local-dir", str(tmp_path / "a"), "--cache-dir",
              str(tmp_path / "b"))
    assert res.exit_code == 2 and "give one" in res.output


def test_node_format_into_a_cache_is_refused(tmp_path: Path) -> None:
    res = run("fetch", "--source", "hf", "--repo", REPO, "--cache-dir", str(tmp_path / "c"), "--tp", "2", "--dp", "4",
              "--node", "0", "--gpus-per-node", "4")
    assert res.exit_code == 2 and "not a snapshot of the repo" in res.output and "--local-dir" in res.output
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("source", ["hf", "modelscope"])
def test_rank_aware_fetch_publishes_its_own_snapshot(hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     source: str) -> None:
    """--ranks into a cache: the rewritten shards are never stored under the hub's names; the
    partial checkpoint is a snapshot of its own (ref k3ckpt-partial-...), whose index lists only
    the files present, and the clients return it offline only when asked for that revision."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from modelscope.hub.snapshot_download import snapshot_download as ms_snapshot_download

    h, served = hub
    cache = tmp_path / "cache"
    res = _fetch(h, "--source", source, "--cache-dir", str(cache), "--ep", "8", "--ranks", "0", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    ref = doc["snapshot_revision"]
    assert ref.startswith("k3ckpt-partial-")
    _offline_hf(monkeypatch)
    h.reset_counters()
    if source == "hf":
        snap = Path(snapshot_download(REPO, cache_dir=cache, revision=ref, local_files_only=True))
        blobs = cache / "models--moonshotai--Kimi-K3" / "blobs"
        # content-addressed: every blob is named by the sha256 of what it holds
        assert all(hashlib.sha256(b.read_bytes()).hexdigest() == b.name for b in blobs.iterdir())
        with pytest.raises(LocalEntryNotFoundError):  # the hub's main is not this partial snapshot
            snapshot_download(REPO, cache_dir=cache, local_files_only=True)
    else:
        snap = Path(ms_snapshot_download(REPO, cache_dir=str(cache), revision=ref, local_files_only=True))
    assert snap == Path(doc["snapshot"])
    index = json.loads((snap / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in snap.glob("*.safetensors"))
    source_index = json.loads((served / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) < set(source_index["weight_map"])  # only rank 0's tensors...
    assert run("verify", str(snap)).exit_code == 0  # ... and every one listed is in its shard
    # rewritten shards (the MoE ones) in the snapshot, stored under their own sha256 (above)
    assert any((snap / n).stat().st_size < (served / n).stat().st_size for n in shards)
    assert h.request_log == []
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    again = _fetch(h, "--source", source, "--cache-dir", str(cache), "--ep", "8", "--ranks", "0", "--json")
    assert again.exit_code == 0 and json.loads(again.output)["bytes_downloaded"] == 0
    assert json.loads(again.output)["snapshot"] == str(snap)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_blob_is_replaced_and_said(hub, tmp_path: Path, damage: str) -> None:
    """A blob is named by its content and shared by every snapshot linking it: one whose bytes
    are not its name's serves none, so a re-fetch replaces it - a new file renamed over the name,
    never a write into the old one (a hard link to it keeps its bytes) - and says so."""
    from ckpt_edit import flip_byte

    h, served = hub
    cache = tmp_path / "hf-cache"
    assert _fetch(h, "--source", "hf", "--cache-dir", str(cache)).exit_code == 0
    snap = cache / "models--moonshotai--Kimi-K3" / "snapshots" / h.commit(REPO)
    victim = "model-00002-of-000008.safetensors"
    blob = (snap / victim).resolve()
    elsewhere = tmp_path / "hard-link"
    os.link(blob, elsewhere)
    if damage == "flip":
        flip_byte(blob, 5000)
        why = "sha256 mismatch"
    else:
        os.truncate(blob, 100)
        why = f"size 100 != listed {h.files(REPO)[victim].size}"
    damaged = elsewhere.read_bytes()
    res = _fetch(h, "--source", "hf", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["fetched"] == [victim]
    assert doc["notes"] == [f"replaced damaged blob blobs/{blob.name} ({why}) with the hub's verified bytes "
                            f"(the content of {victim})"]
    assert (snap / victim).read_bytes() == (served / victim).read_bytes()
    assert elsewhere.read_bytes() == damaged and not os.path.samefile(elsewhere, blob)  # renamed over, not rewritten


def test_a_modelscope_snapshot_file_of_other_content_is_replaced_and_said(hub, tmp_path: Path) -> None:
    """ModelScope's snapshot is named by the branch, not the commit: a file there with other
    content than the listed one (a former commit's, or damaged) is replaced, and a note says so."""
    h, served = hub
    cache = tmp_path / "ms-cache"
    assert _fetch(h, "--source", "modelscope", "--cache-dir", str(cache)).exit_code == 0
    snap = cache / "models" / "moonshotai--Kimi-K3" / "snapshots" / "master"
    (snap / "LICENSE").write_text("an older licence\n")
    res = _fetch(h, "--source", "modelscope", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 0, res.output
    size = (served / "LICENSE").stat().st_size
    assert json.loads(res.stdout)["notes"] == [
        f"replaced master/LICENSE, whose content was not the listed one (size 17 != listed {size})"]
    assert (snap / "LICENSE").read_bytes() == (served / "LICENSE").read_bytes()


# ----------------------------------------------------------------------------------------------
# HF_HUB_OFFLINE=1
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "where"), [("hf", "local-dir"), ("hf", "cache-dir"), ("modelscope", "cache-dir")])
def test_offline_fetch_verifies_what_is_there(hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              source: str, where: str) -> None:
    """HF_HUB_OFFLINE=1 (which vLLM also hands the ModelScope client as local_files_only):
    verify against the recorded listing, exit 0 or 1, and not one request to the hub."""
    h, served = hub
    target = tmp_path / where
    assert _fetch(h, "--source", source, f"--{where}", str(target)).exit_code == 0
    _offline_hf(monkeypatch)
    h.reset_counters()
    res = _fetch(h, "--source", source, f"--{where}", str(target))
    assert res.exit_code == 0, res.output
    assert res.output.startswith("ok (offline") and "the hub was not contacted" in res.output
    files = tree_digests(served)
    root = {"local-dir": target,
            "cache-dir": (target / "models--moonshotai--Kimi-K3" / "snapshots" / h.commit(REPO) if source == "hf"
                          else target / "models" / "moonshotai--Kimi-K3" / "snapshots" / "master")}[where]
    victim = sorted(f for f in files if f.endswith(".safetensors"))[0]
    (root / victim).unlink()
    res = _fetch(h, "--source", source, f"--{where}", str(target), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert doc["offline"] and list(doc["failed"]) == [victim] and len(doc["verified"]) == len(files) - 1
    assert h.request_log == []


def test_offline_without_a_record_cannot_run(hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import assert_one_line_error

    h, _ = hub
    _offline_hf(monkeypatch)
    res = _fetch(h, "--source", "hf", "--local-dir", str(tmp_path / "empty"))
    assert_one_line_error(res, 2, "HF_HUB_OFFLINE is set", "no record")
    assert h.request_log == []


# ----------------------------------------------------------------------------------------------
# Crash
# ----------------------------------------------------------------------------------------------

_CHILD = """
import sys
from k3ckpt.hub.fetch import plan_fetch, run_fetch
url, repo, cache = sys.argv[1:4]
plan = plan_fetch("hf", repo, None, cache_dir=cache, endpoint=url, token="")
sys.exit(0 if run_fetch(plan, workers=3, chunk_size=65536, token="").ok else 1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["after_chunk:4", "before_rename"])
def test_sigkill_then_resume_into_the_cache(point: str, hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import snapshot_download

    h, served = hub
    cache = tmp_path / "hf-cache"
    kill_at_pause(_CHILD, [h.url, REPO, str(cache)], point, tmp_path)
    repo_dir = cache / "models--moonshotai--Kimi-K3"
    assert list((repo_dir / "blobs").glob("*.part.journal"))  # the dead run's working files, where we keep them
    assert not (repo_dir / "refs" / "main").exists()
    assert (repo_dir / RECORDS_DIR / ".k3ckpt-fetch.lock").exists()
    res = _fetch(h, "--source", "hf", "--cache-dir", str(cache))
    assert res.exit_code == 0, res.output
    assert not list((repo_dir / "blobs").glob("*.part*"))
    _offline_hf(monkeypatch)
    assert tree_digests(Path(snapshot_download(REPO, cache_dir=cache, local_files_only=True))) == tree_digests(served)


def test_offline_check_of_an_interrupted_cache_fetch_names_what_is_missing(hub, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """No ref yet (it is written when a fetch completes): the record of the interrupted fetch
    still tells the offline check which commit, and it lists the files not there (exit 1)."""
    h, served = hub
    cache = tmp_path / "hf-cache"
    h.inject("corrupt_byte", "config.json", times=None, offset=3)
    assert _fetch(h, "--source", "hf", "--cache-dir", str(cache)).exit_code == 1
    assert not (cache / "models--moonshotai--Kimi-K3" / "refs" / "main").exists()
    _offline_hf(monkeypatch)
    h.reset_counters()
    res = _fetch(h, "--source", "hf", "--cache-dir", str(cache), "--json")
    assert res.exit_code == 1, res.output
    doc = json.loads(res.output)
    assert list(doc["failed"]) == ["config.json"] and doc["revision"] == h.commit(REPO)
    assert h.request_log == []


def test_cache_fetch_from_a_xet_backed_repo(k3_tiny: Path, tmp_path: Path, isolated_hub_clients: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A Xet-backed repo (resolve redirects to the bridge host): the blobs are still named by the
    sha256 the hub reports as the LFS ETag, and the client finds the snapshot offline."""
    from huggingface_hub import snapshot_download

    from k3ckpt.testing.hub import LoopbackHub

    cache = tmp_path / "hf-cache"
    with LoopbackHub({REPO: k3_tiny}, cache_dir=tmp_path / "hashes", xet=True) as h:
        res = _fetch(h, "--source", "hf", "--cache-dir", str(cache))
        assert res.exit_code == 0, res.output
        blobs = {e.etag for e in h.files(REPO).values()}
    assert {b.name for b in (cache / "models--moonshotai--Kimi-K3" / "blobs").iterdir()} == blobs
    _offline_hf(monkeypatch)
    assert tree_digests(Path(snapshot_download(REPO, cache_dir=cache, local_files_only=True))) == tree_digests(k3_tiny)
