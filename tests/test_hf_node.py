"""``k3ckpt reshard --format hf-node``: per node a valid local-dir checkpoint with every dense
tensor whole and only that node's experts, accepted by ``k3ckpt verify`` through its marker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from helpers import tensor_digests
from k3ckpt.cli import main
from k3ckpt.deploy import reshard as rs
from k3ckpt.format.checkpoint import INDEX_NAME, open_checkpoint
from k3ckpt.format.topology import RankSelection, Topology
from k3ckpt.integrity.verify import verify_checkpoint
from k3ckpt.testing.synth import spec_from_preset, synthesize


def check_node(src: Path, ndir: Path, topo: Topology, node: int, gpus_per_node: int) -> None:
    """Everything ``--format hf-node`` promises about ``ndir``."""
    ckpt = open_checkpoint(src)
    ranks = list(range(node * gpus_per_node, min((node + 1) * gpus_per_node, topo.world_size)))
    experts = sorted({e for r in ranks for e in topo.rank_info(r).experts})
    want = {n for n, role in ckpt.roles.items() if role.expert is None or role.expert in experts}
    got = open_checkpoint(ndir)
    assert not got.problems and set(got.tensors) == want
    digests = tensor_digests(src)
    assert tensor_digests(ndir) == {n: digests[n] for n in want}
    index = json.loads((ndir / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == want
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.tensors.values())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(p.name for p in ndir.glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for f in shards:
        with safe_open(str(ndir / f), framework="numpy") as so:
            assert set(so.keys()) == {k for k, v in index["weight_map"].items() if v == f}
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_NAME:
            assert (ndir / f.name).read_bytes() == f.read_bytes(), f.name
    marker = json.loads((ndir / "k3ckpt-node.json").read_text())
    assert (marker["format"], marker["node"], marker["ranks"], marker["experts"]) == ("k3ckpt-node", node, ranks, experts)
    assert marker["topology"] == topo.to_json()
    assert {n: t["sha256"] for n, t in marker["tensors"].items()} == {n: digests[n] for n in want}
    assert (ndir / "READY").is_file() and not list(ndir.glob(".*"))
    rep = verify_checkpoint(ndir, use_cache=False)
    assert rep.ok, [str(i) for i in rep.issues]


@pytest.mark.parametrize("ep,tp,ws,placement,gpn", [
    (4, 2, 8, "linear", 4),
    (8, 1, None, "round_robin", 2),
    (2, 2, 4, "linear", 4),  # one node holding everything
])
def test_k3_nodes(k3_tiny: Path, tmp_path: Path, ep: int, tp: int, ws: int | None, placement: str, gpn: int) -> None:
    sel = RankSelection(ep=ep, tp=tp, world_size=ws, placement=placement, gpus_per_node=gpn)
    res = rs.reshard(k3_tiny, tmp_path / "o", sel, layout="hf-node", max_file_size=1_000_000)
    topo = Topology.make(ep=ep, tp=tp, world_size=ws, placement=placement, num_experts=16)
    nodes = -(-topo.world_size // gpn)
    assert res.written == list(range(nodes)) and res.to_json()["nodes_written"] == res.written
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [f"node-{n:05d}" for n in range(nodes)] + ["topology.json"]
    for n in range(nodes):
        check_node(k3_tiny, tmp_path / "o" / f"node-{n:05d}", topo, n, gpn)


def test_uneven_and_one_node_at_a_time(tmp_path: Path) -> None:
    src = tmp_path / "src"
    synthesize(spec_from_preset("k3-tiny", num_experts=10, num_layers=3), src)
    topo = Topology.make(ep=4, tp=1, num_experts=10)
    for node in (1, 0):  # each node writes its own share into the shared directory
        res = rs.reshard(src, tmp_path / "o", RankSelection(ep=4, gpus_per_node=2, node=node), layout="hf-node")
        assert res.written == [node]
    check_node(src, tmp_path / "o" / "node-00000", topo, 0, 2)  # experts 0-5 (3 + 3)
    check_node(src, tmp_path / "o" / "node-00001", topo, 1, 2)  # experts 6-9 (2 + 2)


def test_gptoss_stacked_experts_stay_whole(gptoss_tiny: Path, tmp_path: Path) -> None:
    rs.reshard(gptoss_tiny, tmp_path / "o", RankSelection(ep=4, gpus_per_node=2), layout="hf-node")
    topo = Topology.make(ep=4, num_experts=8)
    for n in range(2):
        check_node(gptoss_tiny, tmp_path / "o" / f"node-{n:05d}", topo, n, 2)


def test_k2_nodes(k2_tiny: Path, tmp_path: Path) -> None:
    rs.reshard(k2_tiny, tmp_path / "o", RankSelection(ep=4, gpus_per_node=2, placement="round_robin"),
               layout="hf-node")
    topo = Topology.make(ep=4, placement="round_robin", num_experts=8)
    for n in range(2):
        check_node(k2_tiny, tmp_path / "o" / f"node-{n:05d}", topo, n, 2)


@pytest.fixture(scope="module")
def nodes(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nodes") / "o"
    rs.reshard(k3_tiny, out, RankSelection(ep=4, gpus_per_node=2), layout="hf-node")
    return out


def test_verify_checks_exactly_the_nodes_experts(nodes: Path, tmp_path: Path) -> None:
    from ckpt_edit import drop_tensors

    ndir = tmp_path / "n"
    shutil.copytree(nodes / "node-00001", ndir)
    # without its marker the directory is an ordinary checkpoint missing half its experts
    (ndir / "k3ckpt-node.json").rename(tmp_path / "marker")
    rep = verify_checkpoint(ndir, use_cache=False)
    assert any("8 of 16 routed experts missing: 0, 1, 2" in str(i) for i in rep.problems)
    (tmp_path / "marker").rename(ndir / "k3ckpt-node.json")
    assert verify_checkpoint(ndir, use_cache=False).ok
    # one of its own experts lost: named
    index = json.loads((ndir / INDEX_NAME).read_text())
    lost = [n for n in index["weight_map"] if ".layers.2." in n and ".experts.9." in n]
    drop_tensors(ndir, {n for n in lost if index["weight_map"][n] == index["weight_map"][lost[0]]})
    rep = verify_checkpoint(ndir, use_cache=False)
    assert [str(i) for i in rep.problems if "layer 2" in str(i)][0].endswith(
        "1 of this node's 8 routed experts missing: 9")
    # an expert the marker does not give the node
    marker = json.loads((ndir / "k3ckpt-node.json").read_text())
    marker["experts"] = [e for e in marker["experts"] if e != 15]
    (ndir / "k3ckpt-node.json").write_text(json.dumps(marker))
    rep = verify_checkpoint(ndir, use_cache=False)
    assert any("experts not in this node's share: 15" in str(i) for i in rep.problems)
    (ndir / "k3ckpt-node.json").write_text("{not json")
    rep = verify_checkpoint(ndir, use_cache=False)
    assert any(i.file == "k3ckpt-node.json" and "not valid JSON" in i.message for i in rep.problems)


def test_resume_skips_complete_nodes_and_rewrites_broken_ones(k3_tiny: Path, nodes: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    shutil.copytree(nodes, out)
    res = rs.reshard(k3_tiny, out, RankSelection(ep=4, gpus_per_node=2), layout="hf-node")
    assert res.written == [] and res.skipped == [0, 1]
    victim = next((out / "node-00001").glob("model-*.safetensors"))
    with open(victim, "ab") as fh:
        fh.write(b"x")
    res = rs.reshard(k3_tiny, out, RankSelection(ep=4, gpus_per_node=2), layout="hf-node")
    assert res.written == [1] and res.skipped == [0]
    check_node(k3_tiny, out / "node-00001", Topology.make(ep=4, num_experts=16), 1, 2)


def test_interrupted_node_has_no_index_marker_or_ready(k3_tiny: Path, tmp_path: Path) -> None:
    plan = rs.plan_reshard(k3_tiny, RankSelection(ep=4, gpus_per_node=2), layout="hf-node",
                           max_file_size=1_000_000)

    last = plan.nodes[1].files[-1].name
    assert len(plan.nodes[1].files) > 1

    def boom(name: str) -> None:
        if name == last:
            raise OSError(28, "No space left on device")

    with pytest.raises(rs.ReshardError, match="No space left on device; free space"):
        rs.run_reshard(plan, tmp_path / "o", jobs=1, _fail_before=boom)
    unfinished = [d for d in (tmp_path / "o").glob("node-*") if not (d / "READY").exists()]
    assert unfinished
    for ndir in unfinished:
            assert not (ndir / INDEX_NAME).exists() and not (ndir / "k3ckpt-node.json").exists()
            assert not list(ndir.glob("model-*.safetensors"))
    res = rs.reshard(k3_tiny, tmp_path / "o", RankSelection(ep=4, gpus_per_node=2), layout="hf-node",
                     max_file_size=1_000_000)
    assert sorted(res.written + res.skipped) == [0, 1]
    check_node(k3_tiny, tmp_path / "o" / "node-00000", Topology.make(ep=4, num_experts=16), 0, 2)


def test_cli(k3_tiny: Path, nodes: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["reshard", str(k3_tiny), "-o", str(tmp_path / "o"), "--format", "hf-node", "--ep", "4"]
    r = runner.invoke(main, [*args, "--gpus-per-node", "2", "--node", "1", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["format"] == "hf-node" and data["nodes_written"] == [1]
    r = runner.invoke(main, [*args, "--gpus-per-node", "2"])
    assert r.exit_code == 0 and "1 nodes written" in r.output and "1 already complete" in r.output, r.output
    for extra, needle in [([], "needs --gpus-per-node"), (["--gpus-per-node", "2", "--ranks", "0"], "not --ranks"),
                          (["--gpus-per-node", "2", "--node", "2"], "--node 2 out of range")]:
        r = runner.invoke(main, [*args, *extra])
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.output
    # a rank layout in the same directory is another topology
    r = runner.invoke(main, ["reshard", str(k3_tiny), "-o", str(tmp_path / "o"), "--ep", "4"])
    assert r.exit_code == 2 and "different topology" in r.output, r.output
    # and unshard says plainly that this is not a rank layout
    r = runner.invoke(main, ["unshard", str(nodes), "-o", str(tmp_path / "b")])
    assert r.exit_code == 2 and "not a k3ckpt rank layout" in r.output, r.output


def test_inspect_honours_the_node_marker(nodes: Path, tmp_path: Path) -> None:
    ndir = tmp_path / "n"
    shutil.copytree(nodes / "node-00001", ndir)
    res = CliRunner().invoke(main, ["inspect", str(ndir)])
    assert res.exit_code == 0, res.output
    (ndir / "k3ckpt-node.json").rename(tmp_path / "marker")  # now a checkpoint missing half its experts
    res = CliRunner().invoke(main, ["inspect", str(ndir)])
    assert res.exit_code == 1 and "8 of 16 routed experts missing" in res.output
    (ndir / "k3ckpt-node.json").write_text("{not json")
    res = CliRunner().invoke(main, ["inspect", str(ndir)])
    assert res.exit_code == 2 and "k3ckpt-node.json" in res.output and "Traceback" not in res.output
