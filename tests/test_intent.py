"""Intent errors are refused, not guessed (issue 14, observation 4): ``--ranks``/``--node``
without a topology, ``--include``/``--exclude`` that leave no file, a selection that selects
nothing. Each is exit 2 with one line naming the reason, before any byte moves: the loopback
hub's counters show not one data byte served (and, for what needs no listing, not one request).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import REPO, assert_one_line_error, run

NO_TOPOLOGY = "selects ranks of a topology but none was given"


@pytest.fixture(scope="module")
def served(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("intent") / "Kimi-K3"
    shutil.copytree(k3_tiny, dest)
    return dest


@pytest.fixture
def fetch(hub: Any, tmp_path: Path) -> Iterator[Any]:
    """``fetch(*options)``: ``k3ckpt fetch`` of the served repo into ``tmp_path/dest``."""

    def go(*extra: str) -> Any:
        return run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(tmp_path / "dest"), "--endpoint", hub.url,
                   *extra)

    yield go


def assert_nothing_moved(hub: Any, dest: Path) -> None:
    """At most the repo listing was read (the client may have it cached): no file requested, no
    data byte served, no destination made."""
    assert hub.total_bytes_sent() == 0
    assert hub.routes_used()["hf.resolve"] == 0, hub.routes_used()
    assert not dest.exists()


# -- --ranks / --node without a topology -----------------------------------------------------------


@pytest.mark.parametrize("options", [
    ("--ranks", "0"),  # was: "rank 0 of ep 1 x tp 1", the whole checkpoint (1.56 TB for K3)
    ("--ranks", "0-3", "--format", "partial"),
    ("--node", "0"),  # --format node: one node of a one-rank world, everything again
    ("--node", "1", "--gpus-per-node", "4"),
    ("--node", "0", "--gpus-per-node", "4", "--format", "partial"),
])
def test_fetch_refuses_ranks_without_a_topology_before_any_request(fetch, hub, tmp_path: Path,
                                                                    options: tuple[str, ...]) -> None:
    res = fetch(*options)
    assert_one_line_error(res, 2, f"{options[0]} {options[1]} {NO_TOPOLOGY}", "--tp/--dp", f"drop {options[0]}")
    assert hub.request_log == []
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize(("options", "needle"), [
    (("--tp", "2", "--ranks", "2"), "rank 2 out of range 0..1"),  # ranks beyond the world
    (("--ep", "8", "--ranks", "3-9"), "rank 9 out of range 0..7"),
    (("--tp", "2", "--dp", "2", "--node", "1"), "--node 1 out of range"),  # one node of 4 GPUs by default
    (("--ep", "8", "--node", "2", "--gpus-per-node", "4", "--format", "partial"), "--node 2 out of range"),
    (("--ep", "8", "--ranks", "0", "--node", "0", "--gpus-per-node", "4", "--format", "partial"),
     "give --ranks or --node, not both"),
    (("--ep", "8", "--tp", "3", "--ranks", "0"), "--tp 3 does not divide world size 8"),
])
def test_fetch_refuses_a_selection_of_nothing_before_any_request(fetch, hub, tmp_path: Path,
                                                                 options: tuple[str, ...], needle: str) -> None:
    assert_one_line_error(fetch(*options), 2, needle)
    assert hub.request_log == []
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("options", [
    ("--ep", "1", "--ranks", "0"),  # --ep 1 is the rank layout's default said aloud: a topology
    ("--tp", "2", "--ranks", "1"),  # --tp alone names one too
    ("--tp", "2", "--dp", "2", "--node", "0"),
])
def test_a_named_topology_is_accepted(fetch, options: tuple[str, ...]) -> None:
    res = fetch(*options, "--dry-run")
    assert res.exit_code == 0, res.output


def test_a_whole_fetch_needs_no_topology(fetch, served: Path) -> None:
    res = fetch("--dry-run")
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1].startswith(f"would fetch {len(list(served.iterdir()))} files")


@pytest.mark.parametrize("options", [
    ("--format", "rank", "--ranks", "0"),
    ("--format", "rank", "--node", "0", "--gpus-per-node", "2"),
    ("--node", "0"),
])
def test_reshard_refuses_ranks_without_a_topology(k3_tiny: Path, tmp_path: Path, options: tuple[str, ...]) -> None:
    res = run("reshard", str(k3_tiny), "-o", str(tmp_path / "out"), *options)
    assert_one_line_error(res, 2, NO_TOPOLOGY)
    assert not (tmp_path / "out").exists()


def test_preflight_takes_the_topology_from_the_directory_and_refuses_it_missing(k3_tiny: Path, tmp_path: Path) -> None:
    # a rank layout records its topology: --rank alone is a complete request there
    layout = tmp_path / "layout"
    assert run("reshard", str(k3_tiny), "-o", str(layout), "--format", "rank", "--ep", "2").exit_code == 0
    res = run("preflight", str(layout), "--rank", "1", "--no-env")
    assert res.exit_code in (0, 1) and "ranks 1 (--ranks 1)" in res.output, res.output
    # a plain checkpoint records none
    assert_one_line_error(run("preflight", str(k3_tiny), "--rank", "1", "--no-env"), 2, "need --ep/--tp")


# -- --include / --exclude that leave no file ------------------------------------------------------


@pytest.mark.parametrize(("options", "needle"), [
    (("--include", "*.gguf"), "--include '*.gguf' leaves none of the"),  # was: "ok: ... 0 fetched", exit 0
    (("--exclude", "*"), "--exclude '*' leaves none of the"),
    (("--include", "*.json", "--exclude", "*.json"), "--include '*.json' --exclude '*.json' leave none of the"),
])
def test_whole_fetch_refuses_globs_that_leave_no_file(fetch, hub, served: Path, tmp_path: Path,
                                                      options: tuple[str, ...], needle: str) -> None:
    res = fetch(*options)
    assert_one_line_error(res, 2, needle, f"{len(list(served.iterdir()))} files of hf:{REPO}@", "nothing to fetch")
    assert_nothing_moved(hub, tmp_path / "dest")


@pytest.mark.parametrize("topology", [
    ("--ep", "8", "--tp", "2", "--ranks", "0-3"),  # --format partial
    ("--tp", "2", "--dp", "4", "--node", "0", "--gpus-per-node", "4"),  # --format node
])
def test_rank_aware_fetch_refuses_globs_that_leave_no_file_before_reading_headers(
        fetch, hub, served: Path, tmp_path: Path, topology: tuple[str, ...]) -> None:
    # the weights come by topology; the globs filter the other files, and leaving none of them
    # (no config.json) is no fetch anyone meant - refused before the index, config or a header
    others = [p for p in served.iterdir() if not p.name.endswith((".safetensors", ".index.json"))]
    res = fetch(*topology, "--include", "*.gguf")
    assert_one_line_error(res, 2, "--include '*.gguf' leaves none of the", f"{len(others)} non-weight files")
    assert_nothing_moved(hub, tmp_path / "dest")


def test_a_glob_matching_some_files_is_accepted(fetch, served: Path) -> None:
    # one pattern matching nothing beside one matching something is a filter, not a mistake:
    # scripts pass the same globs to repos with and without some files
    res = fetch("--include", "config.json", "--include", "*.gguf", "--dry-run")
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1].startswith("would fetch 1 file")


def test_select_paths_refuses_globs_that_leave_nothing() -> None:
    from k3ckpt.errors import EmptySelectionError
    from k3ckpt.hub.fetch import select_paths

    files = ["config.json", "model.safetensors"]
    with pytest.raises(EmptySelectionError, match=r"--include '\*.gguf' leaves none of the 2 shards"):
        select_paths(files, include=("*.gguf",), what="shards")
    assert select_paths([], ()) == ([], [])  # no globs: an empty listing is not this refusal
    assert select_paths(files, include=("*.gguf", "config.json")) == (["config.json"], ["model.safetensors"])
