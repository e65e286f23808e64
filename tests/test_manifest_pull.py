"""`manifest pull`: the same manifest from hub metadata alone, without downloading the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import REPO
from k3ckpt.cli import main
from k3ckpt.hub.pull import pull_manifest
from k3ckpt.integrity.manifest import Manifest, build_manifest, diff_manifests


@pytest.fixture()
def hub(served_hub):
    return served_hub


@pytest.mark.parametrize("source", ["hf", "modelscope"])
def test_pull_equals_build_and_moves_only_headers(hub, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    h, served = hub
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    h.reset_counters()
    pulled = pull_manifest(source, REPO, endpoint=h.url)
    built = build_manifest(served)
    assert [c for c in diff_manifests(built, pulled) if c.what != "source"] == []  # only provenance differs
    assert pulled.files == built.files and pulled.tensors == built.tensors
    assert pulled.source == {"hub": source, "repo": REPO, "revision": pulled.source["revision"]}
    assert pulled.source["revision"] and pulled.source["revision"] != "main"
    for f, entry in built.files.items():
        if f.endswith(".safetensors"):  # 8-byte length + the header, never the tensor data
            assert h.bytes_sent(f) == entry.data_start, f


def test_pull_cli_writes_a_manifest_verify_accepts(hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h, served = hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "pulled.json"
    # REPO_ID as `hf download` takes it (hf the default source), as fetch takes it
    res = CliRunner().invoke(main, ["manifest", "pull", REPO, "--endpoint", h.url, "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["files"] == len(list(served.iterdir())) and summary["tensors"] > 500
    assert Manifest.load(out).source["repo"] == REPO
    ok = CliRunner().invoke(main, ["verify", str(served), "--manifest", str(out)])
    assert ok.exit_code == 0, ok.output


def test_pull_unknown_repo_is_a_one_line_error(hub, tmp_path: Path) -> None:
    h, _ = hub
    res = CliRunner().invoke(main, ["manifest", "pull", "--source", "hf", "--repo", "nobody/nothing",
                                    "--endpoint", h.url, "-o", str(tmp_path / "x.json")])
    assert res.exit_code == 2
    assert res.output.startswith("k3ckpt: error: ") and "nobody/nothing" in res.output
    assert not (tmp_path / "x.json").exists()


def test_pull_takes_the_repo_by_argument_or_the_old_option_never_two_different(hub, tmp_path: Path) -> None:
    h, _ = hub
    out = tmp_path / "m.json"
    res = CliRunner().invoke(main, ["manifest", "pull", "--source", "modelscope", "--repo", REPO, "--endpoint", h.url,
                                    "-o", str(out), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["source"]["hub"] == "modelscope", res.output
    res = CliRunner().invoke(main, ["manifest", "pull", REPO, "--repo", "other/repo", "-o", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "disagree" in res.output and not (tmp_path / "x.json").exists()
    res = CliRunner().invoke(main, ["manifest", "pull", "-o", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "Missing argument 'REPO_ID'" in res.output
