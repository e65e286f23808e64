"""The words operators arrive with: ``hf download``'s (checked against the real ``hf`` CLI on the
loopback hub), and one name per concept across k3ckpt's own commands (--jobs, --max-shard-size,
--ranks, --revision, --debug anywhere, a closed pipe ending quietly)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from helpers import REPO, assert_one_line_error, run, walk_commands
from k3ckpt.cli import main
from k3ckpt.hub.fetch import select_paths

HF = Path(sys.executable).with_name("hf")
TOKEN = "hf_s3cret"


def _files(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path, the clients' own ``.cache/`` (hf's
    ``.cache/huggingface``, k3ckpt's ``.cache/k3ckpt``) left out."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).parts[0] != ".cache"}


def _hf_download(hub: Any, tmp_path: Path, dest: Path, *args: str) -> None:
    """The real ``hf download REPO ARGS... --local-dir DEST`` against the loopback hub, with no
    token, cache or endpoint from the machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_DISABLE_TELEMETRY="1")
    res = subprocess.run([str(HF), "download", REPO, *args, "--local-dir", str(dest)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.fixture()
def hub(served_hub: tuple[Any, Path], isolated_hub_clients: None) -> Iterator[Any]:
    yield served_hub[0]


@pytest.fixture()
def tree_hub(tmp_path: Path, isolated_hub_clients: None) -> Iterator[Any]:
    """A small repo with a directory in it (``sub/``), for the pattern rules."""
    from k3ckpt.testing.hub import LoopbackHub

    root = tmp_path / "tree"
    for rel, text in {"config.json": "{}", "b.json": "[1]", "sub/a.json": "{\"a\": 1}", "sub/deep/c.txt": "c",
                      "README.md": "hi", "w[1].bin": "literal"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    with LoopbackHub({REPO: root}, cache_dir=tmp_path / "hub-cache") as h:
        yield h


@pytest.fixture()
def gated_hub(served_hub: tuple[Any, Path], tmp_path: Path, isolated_hub_clients: None) -> Iterator[Any]:
    """k3-tiny on a loopback hub that wants ``TOKEN`` on every request (a private or gated repo)."""
    from k3ckpt.testing.hub import LoopbackHub

    with LoopbackHub({REPO: served_hub[1]}, cache_dir=tmp_path / "gated-cache", token=TOKEN) as h:
        yield h


# -- hf download, side by side -------------------------------------------------------------------


@pytest.mark.skipif(not HF.exists(), reason="the hf CLI of huggingface_hub is not installed next to python")
def test_fetch_repo_local_dir_is_hf_download(hub: Any, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    res = run("fetch", REPO, "--local-dir", str(ours), "--endpoint", hub.url, "--max-workers", "4")
    assert res.exit_code == 0, res.output
    _hf_download(hub, tmp_path, theirs)
    assert _files(ours) == _files(theirs) and len(_files(ours)) > 5


@pytest.mark.skipif(not HF.exists(), reason="the hf CLI of huggingface_hub is not installed next to python")
def test_fetch_files_positional_is_hf_download_files(tree_hub: Any, tmp_path: Path) -> None:
    # (hf download takes one name as a path, several as patterns: "*.json" goes with another name)
    for i, names in enumerate((["config.json", "sub/a.json"], ["sub/"], ["*.json", "README.md"])):
        ours, theirs = tmp_path / f"ours{i}", tmp_path / f"theirs{i}"
        res = run("fetch", REPO, *names, "--local-dir", str(ours), "--endpoint", tree_hub.url)
        assert res.exit_code == 0, res.output
        _hf_download(tree_hub, tmp_path, theirs, *names)
        assert _files(ours) == _files(theirs), names
    assert set(_files(tmp_path / "ours1")) == {"sub/a.json", "sub/deep/c.txt"}
    assert set(_files(tmp_path / "ours2")) == {"config.json", "b.json", "sub/a.json", "README.md"}  # * crosses /


def test_include_exclude_follow_huggingface_hub(tree_hub: Any, tmp_path: Path) -> None:
    files = ["README.md", "b.json", "config.json", "sub/a.json", "sub/deep/c.txt"]
    assert select_paths(files, include=("sub/",))[0] == ["sub/a.json", "sub/deep/c.txt"]
    assert select_paths(files, include=("*.json",), exclude=("sub/",))[0] == ["b.json", "config.json"]
    dest = tmp_path / "d"
    res = run("fetch", REPO, "--local-dir", str(dest), "--endpoint", tree_hub.url, "--include", "sub/", "--json")
    assert res.exit_code == 0, res.output
    assert sorted(json.loads(res.output)["fetched"]) == ["sub/a.json", "sub/deep/c.txt"]
    # patterns leaving nothing are still refused before a byte moves
    assert_one_line_error(run("fetch", REPO, "--local-dir", str(tmp_path / "e"), "--endpoint", tree_hub.url,
                              "--include", "nope/"), 2, "--include 'nope/' leaves none of the 6 files")
    assert not (tmp_path / "e").exists()


def test_a_file_name_is_a_path_before_a_pattern(tree_hub: Any, tmp_path: Path) -> None:
    res = run("fetch", REPO, "w[1].bin", "--local-dir", str(tmp_path / "d"), "--endpoint", tree_hub.url)
    assert res.exit_code == 0, res.output
    assert set(_files(tmp_path / "d")) == {"w[1].bin"}


def test_files_that_match_nothing_or_with_patterns_are_refused(tree_hub: Any, tmp_path: Path) -> None:
    dest = str(tmp_path / "d")
    assert_one_line_error(run("fetch", REPO, "config.json", "missing.bin", "--local-dir", dest, "--endpoint",
                              tree_hub.url), 2, "'missing.bin': no such file in the repo")
    assert_one_line_error(run("fetch", REPO, "config.json", "--include", "*.md", "--local-dir", dest), 2,
                          "FILES and --include/--exclude both select files")
    assert_one_line_error(run("fetch", REPO, "config.json", "--local-dir", dest, "--ranks", "0", "--ep", "2"), 2,
                          "FILES is for a plain fetch")
    assert not Path(dest).exists()


def test_old_names_still_fetch(hub: Any, tmp_path: Path) -> None:
    """--source/--repo/--dest/--workers of 0.1 keep working for a release, the same as the new words."""
    old, new = tmp_path / "old", tmp_path / "new"
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(old), "--workers", "2", "--endpoint", hub.url,
              "--include", "*.json")
    assert res.exit_code == 0, res.output
    res = run("fetch", REPO, "--local-dir", str(new), "--jobs", "2", "--endpoint", hub.url, "--include", "*.json")
    assert res.exit_code == 0, res.output
    assert _files(old) == _files(new)
    assert_one_line_error(run("fetch", REPO, "--repo", "other/repo", "--local-dir", str(new)), 2, "disagree")


# -- tokens ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "variable"), [("hf", "HF_TOKEN"), ("modelscope", "MODELSCOPE_API_TOKEN")])
def test_401_names_the_token_variable_and_flag(gated_hub: Any, tmp_path: Path, source: str, variable: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "d"
    args = ["fetch", REPO, "--source", source, "--local-dir", str(dest), "--endpoint", gated_hub.url,
            "--include", "*.json"]
    default = {"hf": "main", "modelscope": "master"}[source]  # the branch each hub's client resolves
    assert_one_line_error(run(*args), 2, f"k3ckpt: error: {source}:{REPO}@{default}: 401 Unauthorized: the repo "
                          f"needs a token: set {variable} or pass --token")
    assert_one_line_error(run(*args, "--token", "wrong"), 2,
                          "401 Unauthorized: the token was refused", f"set {variable} or pass --token")
    assert not dest.exists()
    res = run(*args, "--token", TOKEN)
    assert res.exit_code == 0, res.output
    monkeypatch.setenv(variable, TOKEN)  # the client's own variable, as before
    res = run(*args[:-2], "--include", "LICENSE")
    assert res.exit_code == 0, res.output
    assert (dest / "LICENSE").is_file() and (dest / "config.json").is_file()


def test_token_reaches_manifest_pull_and_verify(gated_hub: Any, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    pull = ["manifest", "pull", "--source", "hf", "--repo", REPO, "--endpoint", gated_hub.url, "-o", str(out)]
    assert_one_line_error(run(*pull), 2, "set HF_TOKEN or pass --token")
    assert run(*pull, "--token", TOKEN).exit_code == 0
    assert_one_line_error(run("verify", str(tmp_path), "--token", TOKEN), 2, "--token is for --against")


def test_refused_byte_reads_name_the_token_too(gated_hub: Any, tmp_path: Path) -> None:
    """A 401 on the files themselves (not the listing), as a token that expired mid-fetch gets."""
    from k3ckpt.hub.client import list_repo
    from k3ckpt.hub.download import fetch_files

    listing = list_repo("hf", REPO, endpoint=gated_hub.url, token=TOKEN)
    res = fetch_files(listing, tmp_path / "d", ["config.json"], token="")
    assert "401 Unauthorized: the repo needs a token: set HF_TOKEN or pass --token" in res.failed["config.json"]


# -- one name per concept ------------------------------------------------------------------------


def _commands() -> Iterator[tuple[str, click.Command]]:
    for path, cmd in walk_commands():
        if not isinstance(cmd, click.Group):
            yield " ".join(("k3ckpt", *path)), cmd


#: concept (parameter name) -> the one name --help shows, and the names also accepted
CONCEPTS = {"jobs": ("--jobs", {"--max-workers", "--workers"}),
            "max_shard_size": ("--max-shard-size", {"--max-file-size"}),
            "ranks": ("--ranks", {"--rank"}),
            "revision": ("--revision", set())}
RETIRED = {"--workers", "--max-file-size", "--rank", "--dest", "--repo"}


def test_one_name_per_concept_across_commands() -> None:
    seen = dict.fromkeys(CONCEPTS, 0)
    for path, cmd in _commands():
        ctx = click.Context(cmd, info_name=path)
        shown = " ".join(rec[0] for p in cmd.params if (rec := p.get_help_record(ctx)) is not None)
        for word in shown.replace(",", " ").split():
            assert word not in RETIRED or (word == "--repo" and "fetch" not in path), (path, word)
        for p in cmd.params:
            if p.name in CONCEPTS:
                seen[p.name] += 1
                primary, aliases = CONCEPTS[p.name]
                assert p.opts[0] == primary and set(p.opts[1:]) == aliases, (path, p.opts)
            # the old names are nowhere a concept of their own
            assert not set(p.opts) & {"--workers", "--max-file-size", "--rank"} or p.name in CONCEPTS, (path, p.opts)
    assert seen["jobs"] >= 9 and seen["max_shard_size"] == 3 and seen["ranks"] >= 3 and seen["revision"] == 3


def test_revision_default_is_named_per_hub() -> None:
    from huggingface_hub import constants

    assert constants.DEFAULT_REVISION == "main"  # what the help says hf resolves (ModelScope's: "master")
    for args in (["fetch"], ["manifest", "pull"], ["verify"]):
        res = run(*args, "--help")
        assert "[default: main for hf, master for modelscope]" in " ".join(res.output.split()), args


def test_aliases_parse_to_the_same_value(k3_tiny: Path, tmp_path: Path) -> None:
    for flag in ("--max-shard-size", "--max-file-size"):
        res = run("reshard", str(k3_tiny), "-o", str(tmp_path / flag), "--ep", "2", flag, "0")
        assert_one_line_error(res, 2, "Invalid value for '--max-shard-size'", "'0' must be positive")
    for flag in ("--jobs", "--max-workers", "--workers"):
        assert_one_line_error(run("fetch", REPO, "--local-dir", str(tmp_path), flag, "0"), 2,
                              "Invalid value for '--jobs' / '--max-workers'")
    for flag in ("--ranks", "--rank"):
        res = run("preflight", str(k3_tiny), flag, "1", "--ep", "2", "--no-env", "--json")
        assert res.exit_code in (0, 1) and json.loads(res.output)["ranks"] == [1], res.output


def test_value_aliases_are_accepted_and_not_shown(k3_tiny: Path, tmp_path: Path) -> None:
    """Issue #25: ``--format hf-node`` and ``--scale-mode floor`` showed in ``--help``, though the
    docs say the older spellings are hidden; they still work."""
    for args, alias in ((["reshard"], "hf-node"), (["plan"], "hf-node"), (["mx", "error"], "floor"),
                        (["mx", "quantize"], "floor")):
        res = run(*args, "--help")
        # (the word, not the OCP rule's floor(log2(amax)))
        assert res.exit_code == 0 and not re.search(rf"\b{alias}\b(?!\()", res.output), (args, res.output)
    res = run("reshard", str(k3_tiny), "-o", str(tmp_path / "o"), "--format", "hf-node", "--tp", "2", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["format"] == "node", res.output
    res = run("plan", str(k3_tiny), "--format", "hf-node", "--tp", "2", "--json")
    assert res.exit_code == 0, res.output
    res = run("mx", "error", str(k3_tiny / "model-00002-of-000008.safetensors"), "--scale-mode", "floor", "--json")
    assert res.exit_code in (0, 1) and json.loads(res.output)["scale_mode"] == "ocp", res.output
    # an unknown value is still refused, naming only the shown choices
    res = run("reshard", str(k3_tiny), "-o", str(tmp_path / "p"), "--format", "nodes")
    assert_one_line_error(res, 2, "'nodes' is not one of 'node', 'rank'")


# -- --debug anywhere, a closed pipe ----------------------------------------------------------------


def test_debug_is_accepted_after_the_command(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    assert_one_line_error(run("inspect", missing), 2, "no such directory")
    for args in (["inspect", missing, "--debug"], ["--debug", "inspect", missing], ["manifest", "build", missing,
                                                                                      "-o", missing, "--debug"]):
        res = CliRunner().invoke(main, args)
        # the traceback, then the one line, with the exit code a script sees without --debug
        assert res.exit_code == 2 and "CheckpointNotFoundError" in res.stderr, args
        assert res.stderr.rstrip().splitlines()[-1].startswith("k3ckpt: error: "), args
    # after "--" it is an argument like any other
    assert_one_line_error(run("inspect", "--", "--debug"), 2, "--debug")


def _into_closed_pipe(*args: str) -> subprocess.CompletedProcess[bytes]:
    """``k3ckpt ARGS`` with stdout a pipe nobody reads any more (``| head`` after its line):
    the read end is closed before the command starts, so its first write meets EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "k3ckpt", *args], stdout=write, stderr=subprocess.PIPE,
                              timeout=300)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["inspect", "{ckpt}", "--layers"], ["inspect", "{ckpt}", "--json"],
                                  ["verify", "{ckpt}", "--json", "--no-cache"], ["--help"], ["fetch", "--help"]])
def test_a_closed_pipe_ends_quietly_as_cat_does(k3_tiny: Path, args: list[str]) -> None:
    res = _into_closed_pipe(*(a.format(ckpt=k3_tiny) for a in args))
    assert (res.returncode, res.stderr) == (141, b"")


def test_a_real_error_into_a_closed_pipe_still_says_so(tmp_path: Path) -> None:
    res = _into_closed_pipe("inspect", str(tmp_path / "nope"), "--json")
    assert res.returncode == 2 and res.stderr.decode().startswith("k3ckpt: error: ") and b"Traceback" not in res.stderr
