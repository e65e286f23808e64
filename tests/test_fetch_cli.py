"""`k3ckpt fetch` through the CLI, against the loopback hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_edit import tree_digests
from helpers import REPO, run
from k3ckpt.cli import main
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.hub.fetch import select_paths


@pytest.fixture()
def hub(served_hub):
    return served_hub


def test_select_paths_globs() -> None:
    files = ["config.json", "model-00001-of-000002.safetensors", "model-00002-of-000002.safetensors",
             "tokenizer_config.json", "sub/dir/readme.md"]
    assert select_paths(files) == (sorted(files), [])
    sel, dropped = select_paths(files, include=("*.json",), exclude=("tokenizer*",))
    assert sel == ["config.json"] and len(dropped) == 4
    assert select_paths(files, include=("sub/*",))[0] == ["sub/dir/readme.md"]


def test_dry_run_lists_and_downloads_nothing(hub, tmp_path: Path) -> None:
    h, served = hub
    h.reset_counters()
    dest = tmp_path / "dest"
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url, "--dry-run",
              "--exclude", "LICENSE")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[-1].startswith(f"would fetch {len(list(served.iterdir())) - 1} files")
    assert not any(line.endswith("LICENSE") for line in lines)
    assert not dest.exists()
    assert sum(h.bytes_sent(p.name) for p in served.iterdir()) == 0
    js = run("fetch", "--source", "modelscope", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url,
             "--dry-run", "--json")
    data = json.loads(js.output)
    assert data["bytes_total"] == sum(p.stat().st_size for p in served.iterdir())
    assert data["present"] == [] and len(data["revision"]) >= 7


@pytest.mark.parametrize("source", ["hf", "modelscope"])
def test_fetch_verify_inspect(hub, tmp_path: Path, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    h, served = hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    dest = tmp_path / "dest"
    res = run("fetch", "--source", source, "--repo", REPO, "--dest", str(dest), "--endpoint", h.url,
              "--chunk-size", "64KiB", "--workers", "4", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["failed"] == {} and sorted(data["fetched"]) == sorted(p.name for p in served.iterdir())
    assert tree_digests(dest) == tree_digests(served)
    assert open_checkpoint(dest).tensors.keys() == open_checkpoint(served).tensors.keys()
    assert run("verify", str(dest), "--against", source, "--repo", REPO, "--endpoint", h.url).exit_code == 0
    again = run("fetch", "--source", source, "--repo", REPO, "--dest", str(dest), "--endpoint", h.url, "--json")
    assert json.loads(again.output)["bytes_downloaded"] == 0


def test_unfetchable_file_is_listed_and_exit_is_1(hub, tmp_path: Path) -> None:
    h, served = hub
    h.inject("corrupt_byte", "config.json", times=None, offset=3)
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(tmp_path / "d"), "--endpoint", h.url)
    assert res.exit_code == 1
    assert "could not fetch config.json" in res.output and res.output.startswith("FAILED: ")
    assert not (tmp_path / "d" / "config.json").exists()


def test_bad_chunk_size_is_a_usage_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["fetch", "--source", "hf", "--repo", REPO, "--dest", str(tmp_path),
                                    "--chunk-size", "lots"])
    assert res.exit_code == 2 and "is not a size" in res.output


def test_the_clis_chunk_size_is_the_librarys_default() -> None:
    """The CLI states its default as text for --help; it must be the size run_fetch takes without one."""
    from k3ckpt.hub.download import DEFAULT_CHUNK
    from k3ckpt.utils import parse_size

    (param,) = [p for p in main.commands["fetch"].params if p.name == "chunk_size"]
    assert parse_size(str(param.default)) == DEFAULT_CHUNK


def test_verify_quick_after_fetch_trusts_what_fetch_verified(hub, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    h, served = hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    dest = tmp_path / "dest"
    assert run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url).exit_code == 0
    quick = run("verify", str(dest), "--quick", "--against", "hf", "--repo", REPO, "--endpoint", h.url, "--json")
    assert quick.exit_code == 0, quick.output
    rep = json.loads(quick.output)
    assert sorted(rep["files_trusted"]) == sorted(p.name for p in served.iterdir())
    assert rep["files_size_only"] == []
    # A file changed since the fetch (same size, new mtime) is no longer vouched for.
    cfg = dest / "config.json"
    cfg.write_bytes(cfg.read_bytes())
    rep = json.loads(run("verify", str(dest), "--quick", "--against", "hf", "--repo", REPO, "--endpoint", h.url,
                         "--json").output)
    assert "config.json" in rep["files_size_only"] and "config.json" not in rep["files_trusted"]


def test_fetch_records_its_source_for_reshard_and_preflight(hub, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    h, served = hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    dest = tmp_path / "dest"
    res = run("fetch", "--source", "modelscope", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url, "--json")
    assert res.exit_code == 0, res.output
    revision = json.loads(res.output)["revision"]
    src = open_checkpoint(dest).source
    assert (src.hub, src.repo, src.revision) == ("modelscope", REPO, revision)
    out = tmp_path / "rs"
    assert run("reshard", str(dest), "-o", str(out), "--format", "rank", "--ep", "2").exit_code == 0
    topo = json.loads((out / "topology.json").read_text())
    assert (topo["source"]["repo"], topo["source"]["revision"]) == (REPO, revision)
    # the record is not part of the checkpoint: a hub verify sees exactly the hub's files
    assert run("verify", str(dest), "--against", "modelscope", "--repo", REPO, "--endpoint", h.url).exit_code == 0


def _help_examples(*command: str) -> list[list[str]]:
    """The argv of each example in ``k3ckpt COMMAND --help`` (a trailing ``\\`` continues one)."""
    import shlex

    text = run(*command, "--help").output
    body = text.split("Examples:", 1)[1].split("\nOptions:", 1)[0]
    lines = " ".join(line.strip() for line in body.replace("\\\n", " ").splitlines() if line.strip())
    return [shlex.split("k3ckpt " + ex.strip()) for ex in lines.split("k3ckpt ") if ex.strip()]


@pytest.mark.usefixtures("isolated_hub_clients")
def test_help_examples_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #25: ``fetch --help``'s ``--ep 8 --ranks 0 --manifest kimi-k3.json`` exited 2 ("no
    tensor hashes") with the name the docs give a plain manifest. Every example runs here as
    printed, in order, against the loopback hub serving k3-tiny with K3's TP 8-able heads
    (``/nvme`` under the test's directory)."""
    from k3ckpt.testing.hub import LoopbackHub
    from k3ckpt.testing.synth import spec_from_preset, synthesize

    served = tmp_path / "served"
    synthesize(spec_from_preset("k3-tiny", num_attention_heads=8, kda_num_heads=8), served)
    h = LoopbackHub({REPO: served}, cache_dir=tmp_path / "hub-cache").start()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", h.url)
    examples = _help_examples("fetch")
    assert any("--manifest" in ex for ex in examples) and any(ex[1:3] == ["manifest", "pull"] for ex in examples)
    try:
        for argv in examples:
            argv = [a.replace("/nvme/", f"{tmp_path}/nvme/") for a in argv]
            res = run(*argv[1:])
            assert res.exit_code == 0, (argv, res.output)
    finally:
        h.stop()


_KILLED_FETCH = """
import sys
from k3ckpt.format.topology import RankSelection
from k3ckpt.hub.fetch import plan_fetch, run_fetch
from k3ckpt.hub.rankfetch import plan_rank_fetch, run_rank_fetch
url, repo, dest, kind = sys.argv[1:5]
if kind == "plain":
    plan = plan_fetch("hf", repo, dest, endpoint=url, token="")
    sys.exit(0 if run_fetch(plan, workers=2, chunk_size=65536, token="").ok else 1)
plan = plan_rank_fetch("hf", repo, dest, RankSelection(ep=4, ranks="0-1"), endpoint=url, token="", chunk_size=65536)
sys.exit(0 if run_rank_fetch(plan, workers=2, token="").ok else 1)
"""


@pytest.mark.parametrize("chunk", [32 << 10, 96 << 10, 256 << 10])
def test_a_fetch_resumed_with_another_chunk_size_keeps_the_bytes_its_journal_proves(hub, tmp_path: Path,
                                                                                   chunk: int) -> None:
    """A run killed with 64 KiB chunks, resumed with ``chunk`` (smaller, not a multiple, larger:
    as after the default went from 64 to 256 MiB): every chunk wholly inside the journaled bytes
    is kept and no other byte, so this run downloads exactly the rest, and the files are the hub's."""
    from helpers import kill_at_pause

    h, served = hub
    dest = tmp_path / "d"
    kill_at_pause(_KILLED_FETCH, [h.url, REPO, str(dest), "plain"], "after_chunk:12", tmp_path)
    kept: dict[str, int] = {}  # file -> bytes the journal proves in whole chunks of the new size
    for journal in dest.glob("*.part.journal"):
        doc = json.loads(journal.read_text())
        assert doc["chunk_size"] == 65536
        proven = [(i * 65536, min((i + 1) * 65536, doc["size"])) for i in doc["done"]]
        chunks = [(a, min(a + chunk, doc["size"])) for a in range(0, doc["size"], chunk)]
        inside = sum(b - a for a, b in chunks
                     if all(any(p <= x < q for p, q in proven) for x in range(a, b, 4096)) and
                     any(p < b <= q for p, q in proven))
        if inside:
            kept[doc["path"]] = inside
    assert kept  # the killed run left chunks to keep
    res = run("fetch", REPO, "--local-dir", str(dest), "--endpoint", h.url, "--chunk-size", str(chunk), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert set(data["resumed"]) == set(kept)
    sizes = h.files(REPO)
    assert data["bytes_downloaded"] == sum(sizes[f].size for f in data["fetched"]) - sum(kept.values())
    assert tree_digests(dest) == tree_digests(served)


@pytest.mark.parametrize("kind, point", [("plain", "after_chunk:12"), ("ranks", "after_piece:6")])
def test_a_resumed_fetch_says_what_it_did(hub, tmp_path: Path, kind: str, point: str) -> None:
    """Issue #25: a resumed fetch said "0 files fetched (503.64 MB ...)": the bytes sat beside a
    count they did not belong to. The summary counts the files fetched, those resumed and those
    already present, and gives this run's bytes apart."""
    import re

    from helpers import kill_at_pause

    h, _ = hub
    dest = tmp_path / "d"
    kill_at_pause(_KILLED_FETCH, [h.url, REPO, str(dest), kind], point, tmp_path)
    journaled = {p.name.removesuffix(".part.journal") for p in dest.glob("*.part.journal")
                 if json.loads(p.read_text())["done"]}
    assert journaled  # the killed run left files part-done
    args = ["fetch", REPO, "--local-dir", str(dest), "--endpoint", h.url, "--chunk-size", "64KiB"]
    args += ["--ep", "4", "--ranks", "0-1"] if kind == "ranks" else []
    res = run(*args, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert set(data["resumed"]) == journaled
    if kind == "plain":  # the journaled chunks were not downloaded again
        assert 0 < data["bytes_downloaded"] < sum(h.files(REPO)[f].size for f in data["fetched"])
    # the same, in words (a re-run: nothing left to do, nothing downloaded)
    line = run(*args).output.splitlines()[0]
    counted = "node files written|shards rewritten|fetched"
    assert re.search(rf": 0 ({counted}), .*already present.*, 0 failed; 0 B downloaded this run", line), line
    dest2 = tmp_path / "d2"
    (tmp_path / "again").mkdir()
    kill_at_pause(_KILLED_FETCH, [h.url, REPO, str(dest2), kind], point, tmp_path / "again")
    n = len({p.name for p in dest2.glob("*.part.journal") if json.loads(p.read_text())["done"]})
    line = run(*[str(dest2) if a == str(dest) else a for a in args]).output.splitlines()[0]
    assert n > 0
    assert re.search(rf" \({n} resumed from an earlier run\), .*; [\d.]+ [KM]B downloaded this run", line), line
