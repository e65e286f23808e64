"""`k3ckpt plan`: per-rank bytes from a checkpoint or a manifest, fits, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run
from k3ckpt.deploy.plan import ACCELERATORS, WEIGHT_OVERHEAD, plan_topology
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.format.roles import Kind
from k3ckpt.format.topology import RankSelection, TopologyError
from k3ckpt.integrity.manifest import build_manifest


def test_bytes_per_rank_add_up(k3_tiny: Path) -> None:
    rep = plan_topology(k3_tiny, RankSelection(ep=4, tp=2, gpus_per_node=2))
    ckpt = open_checkpoint(k3_tiny)
    routed = sum(t.nbytes for n, t in ckpt.tensors.items() if ckpt.roles[n].kind == Kind.ROUTED_EXPERT)
    assert sum(r.routed_bytes for r in rep.ranks) == routed  # every expert on exactly one rank
    assert [r.experts for r in rep.ranks] == [4, 4, 4, 4]
    assert [(r.first_expert, r.last_expert) for r in rep.ranks] == [(0, 3), (4, 7), (8, 11), (12, 15)]
    assert [r.node for r in rep.ranks] == [0, 0, 1, 1] and [r.tp_rank for r in rep.ranks] == [0, 1, 0, 1]
    tensor_bytes = sum(t.nbytes for t in ckpt.tensors.values())
    dense = tensor_bytes - routed
    # tp-split parts add up to the split tensors once per dp replica (dp = 2 here)
    r0 = rep.ranks[0]
    assert r0.split_bytes * 2 + r0.replicated_bytes == dense
    assert rep.need_per_gpu() == int(rep.largest.total_bytes * WEIGHT_OVERHEAD) + rep.kv_budget
    assert set(rep.fits()) == set(ACCELERATORS)


def test_round_robin_and_manifest_source_agree_with_the_directory(k3_tiny_grouped: Path, tmp_path: Path) -> None:
    k3_tiny = k3_tiny_grouped  # round_robin node directories need expert groups
    m = tmp_path / "m.json"
    build_manifest(k3_tiny).save(m)
    from_dir = plan_topology(k3_tiny, RankSelection(ep=4, placement="round_robin")).to_json()
    from_manifest = plan_topology(m, RankSelection(ep=4, placement="round_robin")).to_json()
    assert from_dir["ranks"] == from_manifest["ranks"]
    assert from_manifest["notes"]  # says what it could not check without a config
    assert from_dir["ranks"][1]["first_expert"] == 1 and from_dir["ranks"][1]["last_expert"] == 13


def test_a_plan_covers_every_rank(k3_tiny: Path) -> None:
    for sel in (RankSelection(ep=2, ranks="0"), RankSelection(ep=2, node=0, gpus_per_node=1)):
        with pytest.raises(TopologyError, match="a plan covers every rank"):
            plan_topology(k3_tiny, sel)


def test_fits_against_accelerators(k3_tiny: Path) -> None:
    small = plan_topology(k3_tiny, RankSelection(ep=2), kv_budget=10**9)
    assert all(small.fits().values())
    huge = plan_topology(k3_tiny, RankSelection(ep=2), kv_budget=285 * 10**9)
    assert huge.fits() == {"H100 80 GB": False, "H200 141 GB": False, "B200 192 GB": False,
                           "GB300 288 GB": True, "MI355X 288 GB": True}


@pytest.mark.parametrize(("args", "message"), [
    (["--ep", "3", "--tp", "2"], "--tp 2 does not divide world size 3"),
    (["--tp", "8"], "--tp 8 does not divide num_attention_heads 4"),
    (["--ep", "32"], "exceeds 16 experts"),
])
def test_impossible_topologies_are_refused(k3_tiny: Path, args: list[str], message: str) -> None:
    res = run("plan", str(k3_tiny), *args)
    assert res.exit_code == 2, res.output
    assert res.output.startswith("k3ckpt: error: ") and message in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_cli_text_and_json(k3_tiny: Path) -> None:
    res = run("plan", str(k3_tiny), "--ep", "4", "--tp", "2")
    assert res.exit_code == 0, res.output
    assert "topology  ep 4 x tp 2, world size 4 (moe_tp 1, dp 2)" in res.output
    assert "fits      H100 80 GB yes" in res.output
    data = json.loads(run("plan", str(k3_tiny), "--ep", "2", "--tp", "2", "--kv-budget", "1GiB", "--json").output)
    assert data["kv_budget"] == 1024**3 and len(data["ranks"]) == 2 and data["largest_rank"] in (0, 1)


def test_node_rows_are_what_the_node_directories_hold(k3_tiny_grouped: Path, tmp_path: Path) -> None:
    from k3ckpt.deploy.reshard import reshard

    k3_tiny = k3_tiny_grouped  # round_robin node directories need expert groups
    sel = RankSelection(tp=2, dp=4, gpus_per_node=4, placement="round_robin")
    rep = plan_topology(k3_tiny, sel)  # the node format, as reshard's default
    assert rep.layout == "node" and (rep.topology["ep"], rep.topology["world_size"]) == (8, 8)
    reshard(k3_tiny, tmp_path / "o", sel)
    for n in rep.nodes:
        index = json.loads((tmp_path / "o" / f"node-{n.node:05d}" / "model.safetensors.index.json").read_text())
        assert n.total_bytes == index["metadata"]["total_size"] and n.experts == 8 and n.ranks == [4 * n.node + i
                                                                                                   for i in range(4)]
    data = rep.to_json()
    assert data["format"] == "node" and [d["total_bytes"] for d in data["nodes"]] == [n.total_bytes for n in rep.nodes]
    res = run("plan", str(k3_tiny), "--tp", "2", "--dp", "4")  # one node holds the world by default
    assert res.exit_code == 0 and "0       0-7       16" in res.output, res.output


def test_the_two_readings_of_the_options(k3_tiny: Path) -> None:
    # vLLM's expert parallel (node format): --tp 2 alone is EP2; the rank layout: experts cut 2 ways
    assert plan_topology(k3_tiny, RankSelection(tp=2)).topology["moe_tp"] == 1
    rank = plan_topology(k3_tiny, RankSelection(tp=2), layout="rank")
    assert (rank.topology["ep"], rank.topology["moe_tp"], rank.nodes) == (1, 2, [])
    res = run("plan", str(k3_tiny), "--ep", "2", "--tp", "4")
    assert res.exit_code == 2 and "use --ep 4 --tp 4, or --format rank" in res.output
    assert run("plan", str(k3_tiny), "--format", "rank", "--ep", "2", "--tp", "4").exit_code == 0
