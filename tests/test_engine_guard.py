"""The ``k3ckpt`` load format inside the running engine (#27): vLLM CPU 0.32.0 loads the plugin the
way a user installs it (a wheel of this tree, its ``vllm.general_plugins`` entry point), serves a
fitting launch as the default loader does, and refuses before the first token a launch without
expert parallelism on node 0 of two and a flipped byte in a tensor it reads.

The wheel is installed with ``--no-deps --target`` into a temporary directory the engine process
gets on ``PYTHONPATH`` (the ``plugin`` fixture): the shared engine environment is never changed.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckpt_edit import shard_tensors
from enginelib import (
    Engine,
    assert_a_real_answer,
    assert_same_answers,
    fetch_k2,
    grouped_k2,
    reshard,
    synth,
    with_one_group,
)
from helpers import REPO
from k3ckpt.format.checkpoint import INDEX_NAME
from k3ckpt.format.header import read_header

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
GUARDED = {"load_format": "k3ckpt"}


def flip_byte(root: Path, name: str) -> str:
    """Flip one byte in the middle of tensor ``name``'s data; the file it is in."""
    file = json.loads((root / INDEX_NAME).read_text())["weight_map"][name]
    path = root / file
    h = read_header(path)
    t = h.tensors[name]
    offset = h.data_start + (t.begin + t.end) // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    return file


def an_expert_tensor(root: Path, expert: int) -> str:
    names = json.loads((root / INDEX_NAME).read_text())["weight_map"]
    return sorted(n for n in names if f".experts.{expert}." in n and n.endswith(".weight"))[0]


def test_the_fitting_launch_loads_through_the_guard_and_answers_as_the_original(
        engine: Engine, ckpts: Path, plugin: dict[str, str]) -> None:
    """A one-node directory served with ``--load-format k3ckpt``: every digest checks, and the
    tokens and logprobs are the original's."""
    src = synth(ckpts, "k2-engine")
    node = reshard(src, "tp1", "--tp", "1") / "node-00000"
    original = engine.generate(src)
    assert_a_real_answer(original)
    guarded = engine.run(node, engine_args=GUARDED, env=plugin)
    assert guarded.report is not None, guarded.log_text()[-3000:]
    assert_same_answers(original, guarded.report, "the one-node directory through the k3ckpt load format")
    checked = [ln for ln in guarded.log_text().splitlines() if ln.startswith("k3ckpt: checked: ")]
    held = len(json.loads((node / "k3ckpt-node.json").read_text())["tensors"])
    assert checked == [f"k3ckpt: checked: {node}: {held} tensors read, each matches its sha256 in "
                       f"{node}/k3ckpt-node.json"], guarded.log_text()[-3000:]


def test_node_0_of_two_without_expert_parallelism_is_refused_naming_the_launch(
        engine: Engine, ckpts: Path, plugin: dict[str, str]) -> None:
    """The launch the issue measured serving wrong tokens (#27): refused before the first token,
    on one line that names expert parallelism and the serve line that fits."""
    src = synth(ckpts, "k2-engine")
    node0 = reshard(src, "2nodes", "--tp", "1", "--dp", "2", "--gpus-per-node", "1") / "node-00000"
    code, report, log = engine.attempt(node0, engine_args=GUARDED, env=plugin)
    assert code != 0 and report is None
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("k3ckpt: refused: ")]
    assert len(lines) == 1, log.read_text(errors="replace")[-3000:]
    line = lines[0]
    assert "without expert parallelism" in line and "experts 0-7 of 16" in line, line
    assert f"serve it with: vllm serve {node0} " in line and "--enable-expert-parallel" in line, line
    assert "--data-parallel-size 2" in line and "--load-format k3ckpt" in line, line


def test_a_flipped_byte_in_an_expert_is_refused_naming_file_and_tensor(
        engine: Engine, ckpts: Path, plugin: dict[str, str], tmp_path: Path) -> None:
    """A copy of the one-node directory with one byte of one expert's weight flipped: the engine
    process hashes what it reads and refuses, naming the file and the tensor."""
    src = synth(ckpts, "k2-engine")
    node = reshard(src, "tp1", "--tp", "1") / "node-00000"
    bad = tmp_path / "flipped"
    shutil.copytree(node, bad)
    name = an_expert_tensor(bad, 3)
    file = flip_byte(bad, name)
    code, report, log = engine.attempt(bad, engine_args=GUARDED, env=plugin)
    assert code != 0 and report is None
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("k3ckpt: refused: ")]
    assert lines == [f"k3ckpt: refused: {file}: tensor {name}: bytes differ from the sha256 in "
                     f"{bad}/k3ckpt-node.json; the engine refused to serve them"], log.read_text(errors="replace")[-3000:]
    assert shard_tensors(bad / file)  # the file itself is still a valid shard: only the digest catches it


EP_TP2 = {**GUARDED, "enable_expert_parallel": True, "enable_ep_weight_filter": True}


def guard_lines(log: str, what: str) -> list[str]:
    """Each ``k3ckpt: WHAT (ep rank R/2): ...`` line of a TP 2 run with EP."""
    return [ln for ln in log.splitlines() if re.match(rf"k3ckpt: {what} \(ep rank [01]/2\): ", ln)]


def test_tp2_with_the_ep_filter_each_rank_verifies_exactly_what_it_reads(
        engine: Engine, ckpts: Path, plugin: dict[str, str]) -> None:
    """``reshard --tp 2`` served at TP 2 with EP and the weight filter: each rank checks the dense
    tensors and its own experts, no more (the other rank's are skipped by vLLM's filter before
    they are read, and excused). The forward pass then crashes on the CPU backend (vLLM issue
    57837), so this asserts on the loader's lines, not on tokens."""
    src = synth(ckpts, "k2-engine")
    node = reshard(src, "tp2", "--tp", "2") / "node-00000"
    marker = json.loads((node / "k3ckpt-node.json").read_text())
    r = engine.run(node, tp=2, engine_args=EP_TP2, env=plugin)
    log = r.log_text()
    assert "k3ckpt: refused" not in log, log[-3000:]
    by_rank = marker["experts_by_rank"]
    want = []
    for rank in (0, 1):
        own = {n for n, t in marker["tensors"].items()
               if t["file"].startswith("model-dense") or f"rank-{rank:05d}" in t["file"]}
        assert len(own) < len(marker["tensors"]) and by_rank[str(rank)]
        want.append(f"k3ckpt: checked (ep rank {rank}/2): {node}: {len(own)} tensors read, each matches its sha256 in "
                    f"{node}/k3ckpt-node.json")
    assert sorted(guard_lines(log, "checked")) == want, log[-3000:]


def test_tp2_a_flipped_byte_in_rank_1_s_expert_is_refused_by_rank_1_only(
        engine: Engine, ckpts: Path, plugin: dict[str, str], tmp_path: Path) -> None:
    """The same launch on a copy whose rank 1 expert file has one flipped byte: rank 1 refuses,
    naming file and tensor; rank 0 never reads that tensor and does not refuse."""
    src = synth(ckpts, "k2-engine")
    node = reshard(src, "tp2", "--tp", "2") / "node-00000"
    bad = tmp_path / "tp2-flipped"
    shutil.copytree(node, bad)
    marker = json.loads((bad / "k3ckpt-node.json").read_text())
    name = an_expert_tensor(bad, marker["experts_by_rank"]["1"][0])
    file = flip_byte(bad, name)
    assert "rank-00001" in file
    r = engine.run(bad, tp=2, engine_args=EP_TP2, env=plugin)
    log = r.log_text()
    assert r.code != 0 and r.report is None
    assert guard_lines(log, "refused") == [
        f"k3ckpt: refused (ep rank 1/2): {file}: tensor {name}: bytes differ from the sha256 in {bad}/k3ckpt-node.json; "
        "the engine refused to serve them"], log[-3000:]


def test_another_node_s_directory_is_refused_by_the_rank_it_does_not_fit(
        engine: Engine, ckpts: Path, plugin: dict[str, str]) -> None:
    """Node 1's directory of ``--tp 1 --dp 2 --gpus-per-node 1`` (experts 8-15) served by one host
    at TP 2 with EP (the same ep size 2): ep rank 0 is given experts 0-7, which the directory does
    not hold, and refuses before reading a byte; ep rank 1's experts are there (not its refusal)."""
    src = synth(ckpts, "k2-engine")
    node1 = reshard(src, "2nodes", "--tp", "1", "--dp", "2", "--gpus-per-node", "1") / "node-00001"
    r = engine.run(node1, tp=2, engine_args=EP_TP2, env=plugin)
    log = r.log_text()
    assert r.code != 0 and r.report is None
    lines = guard_lines(log, "refused")
    assert len(lines) == 1 and lines[0].startswith(f"k3ckpt: refused (ep rank 0/2): {node1}: node 1 of a 2-rank "
                                                   "expert-parallel topology holds experts 8-15 of 16; "), log[-3000:]
    assert "the engine gives ep rank 0 experts 0-7 (wrong placement or another node's directory)" in lines[0]
    assert f"serve it with: vllm serve {node1} " in lines[0] and "--headless" in lines[0], lines[0]
    # rank 1's experts are here: it may read and check them before rank 0's refusal stops the engine
    assert not any("(ep rank 0/2)" in ln for ln in guard_lines(log, "checked")), log[-3000:]


def test_a_placement_the_engine_does_not_use_is_refused(engine: Engine, ckpts: Path, plugin: dict[str, str]) -> None:
    """Node 0 of a round_robin ``--dp 2`` topology (experts 0,2,..,14) served at TP 2 with EP and
    ``--expert-placement-strategy round_robin``: this model has one expert group, so vLLM places
    its experts linearly (``docs/engines.md``), and the guard sees the engine's own map - each
    rank given experts the directory does not hold refuses, naming the placement. (reshard writes
    round_robin only for a model with several groups: the directory is written from the grouped
    model, then its config set to one group.)"""
    node0 = with_one_group(reshard(grouped_k2(ckpts), "rr-2nodes", "--tp", "1", "--dp", "2", "--gpus-per-node", "1",
                                   "--placement", "round_robin") / "node-00000")
    held = json.loads((node0 / "k3ckpt-node.json").read_text())["experts"]
    assert held == list(range(0, 16, 2))
    r = engine.run(node0, tp=2, engine_args={**EP_TP2, "expert_placement_strategy": "round_robin"}, env=plugin)
    log = r.log_text()
    assert r.code != 0 and r.report is None
    lines = guard_lines(log, "refused")
    assert lines, log[-3000:]
    for line in lines:
        assert "holds experts 0,2,4,6,8,10,12,14 of 16; the engine gives ep rank " in line, line
        assert "(wrong placement or another node's directory)" in line and "--expert-placement-strategy round_robin" \
            in line, line
    assert not guard_lines(log, "checked"), log[-3000:]


@pytest.mark.usefixtures("isolated_hub_clients")
def test_a_rank_aware_share_in_the_hf_cache_served_by_repo_id_is_guarded(
        engine: Engine, k2_hub: Any, plugin: dict[str, str], tmp_path: Path) -> None:
    """``fetch --ranks 0`` of ``--ep 2`` into an HF cache publishes rank 0's share under a
    k3ckpt revision; vLLM given the **repo id** and that revision, offline, resolves the snapshot
    itself - and the load format finds the same snapshot's marker (huggingface_hub's cache lookup)
    and refuses the launch without expert parallelism."""
    home = tmp_path / "hf-home"
    cache = home / "hub"
    got = json.loads(fetch_k2(k2_hub, "--cache-dir", str(cache), "--ep", "2", "--ranks", "0", "--json").output)
    ref, snap = got["snapshot_revision"], Path(got["snapshot"])
    assert ref.startswith("k3ckpt-partial-") and (snap / "k3ckpt-partial.json").is_file()
    env = {**plugin, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(home)}
    code, report, log = engine.attempt(REPO, engine_args={**GUARDED, "revision": ref}, env=env)
    assert code != 0 and report is None
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("k3ckpt: refused: ")]
    assert len(lines) == 1, log.read_text(errors="replace")[-3000:]
    assert lines[0].startswith(f"k3ckpt: refused: {snap}: ") and "without expert parallelism" in lines[0], lines[0]
    assert "experts 0-7 of 16" in lines[0], lines[0]
