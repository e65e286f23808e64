"""``k3ckpt reshard`` node directories (``--format node``, the default; ``hf-node`` is its older
name): per node a valid local-dir checkpoint with every dense tensor whole and only the experts
its ranks own under vLLM's expert parallel (``ep = tp x dp``, ``ep_rank = dp_rank * tp + tp_rank``,
``determine_expert_map``'s linear or round_robin rule), each rank's experts in files of their
own, accepted by ``k3ckpt verify`` through its marker."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import safetensors
from click.testing import CliRunner
from safetensors import safe_open

from ckpt_edit import set_expert_groups
from helpers import assert_one_line_error, run, segments_digest, tensor_digests
from k3ckpt.cli import main
from k3ckpt.deploy import reshard as rs
from k3ckpt.format.checkpoint import INDEX_NAME, open_checkpoint
from k3ckpt.format.nodedir import plan_node_dir
from k3ckpt.format.roles import classify
from k3ckpt.format.topology import RankSelection, Topology
from k3ckpt.integrity.verify import verify_checkpoint
from k3ckpt.testing import inject_fault
from k3ckpt.testing.synth import spec_from_preset, synthesize

_RANK_FILE = re.compile(r"model-rank-(\d{5})-experts-(\d{5})-of-(\d{5})\.safetensors")
_DENSE_FILE = re.compile(r"model-dense-(\d{5})-of-(\d{5})\.safetensors")


def vllm_experts(num_experts: int, ep: int, ep_rank: int, placement: str) -> list[int]:
    """The experts of ``ep_rank`` as vLLM's ``determine_expert_map`` places them, written out
    here independently of k3ckpt's topology code (the engine conformance tests run vLLM's own)."""
    if placement == "round_robin":
        return list(range(ep_rank, num_experts, ep))
    base, rem = divmod(num_experts, ep)
    start = ep_rank * base + min(ep_rank, rem)
    return list(range(start, start + base + (1 if ep_rank < rem else 0)))


def read_tensors(path: Path) -> dict[str, bytes]:
    """Every tensor of a safetensors file, by the real ``safetensors`` library (raw bytes, so any
    dtype, BF16 and U8 included)."""
    return {name: bytes(t["data"]) for name, t in safetensors.deserialize(path.read_bytes())}


def check_node(src: Path, ndir: Path, *, tp: int, dp: int, placement: str, node: int, gpus_per_node: int,
               num_experts: int, max_file_size: int | None = None) -> dict[str, bytes]:
    """Everything a node directory promises; returns its tensors (name -> bytes)."""
    world = tp * dp
    ranks = list(range(node * gpus_per_node, min((node + 1) * gpus_per_node, world)))
    # vLLM: ep_size = dp * tp and ep_rank = dp_rank * tp + tp_rank, which is the global rank
    own = {r: vllm_experts(num_experts, world, (r // tp) * tp + r % tp, placement) for r in ranks}
    experts = sorted(e for ex in own.values() for e in ex)
    ckpt = open_checkpoint(src)
    want = {n for n, role in ckpt.roles.items() if role.expert is None or role.expert in experts}
    got = open_checkpoint(ndir)
    assert not got.problems and set(got.tensors) == want
    index = json.loads((ndir / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == want
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.tensors.values())
    files = sorted(p.name for p in ndir.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files  # the index names exactly the files present
    tensors: dict[str, bytes] = {}
    for f in files:
        held = read_tensors(ndir / f)
        assert set(held) == {k for k, v in index["weight_map"].items() if v == f}
        tensors.update(held)
        if max_file_size is not None:
            assert (ndir / f).stat().st_size <= max_file_size or len(held) == 1, f
        roles = {n: classify(n) for n in held}
        m = _RANK_FILE.fullmatch(f)
        if m is None:  # a dense file: no per-expert tensor at all
            assert _DENSE_FILE.fullmatch(f) and all(r.expert is None for r in roles.values()), f
            continue
        rank = int(m.group(1))
        assert all(r.expert in own[rank] for r in roles.values()), f  # only that rank's experts
        with safe_open(str(ndir / f), framework="numpy") as so:  # data order: layer, then expert
            names = list(so.keys())
        order = [(roles[n].layer, roles[n].expert) for n in sorted(names, key=lambda n: got.tensors[n].begin)]
        assert order == sorted(order), f
    for rank, ex in own.items():  # every rank's experts: all of them, in its own files
        holders = {f for n, f in index["weight_map"].items() if ckpt.roles[n].expert in ex}
        stacked = not any(r.expert is not None for r in ckpt.roles.values())  # gpt-oss: all in dense files
        owners = {int(m.group(1)) if (m := _RANK_FILE.fullmatch(h)) else None for h in holders}
        assert (stacked and not holders) or owners == {rank}, (rank, holders)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_NAME:
            assert (ndir / f.name).read_bytes() == f.read_bytes(), f.name
    marker = json.loads((ndir / "k3ckpt-node.json").read_text())
    assert (marker["format"], marker["node"], marker["ranks"], marker["experts"]) == ("k3ckpt-node", node, ranks, experts)
    assert marker["experts_by_rank"] == {str(r): ex for r, ex in own.items()}
    assert marker["topology"]["ep"] == world and marker["topology"]["moe_tp"] == 1
    digests = tensor_digests(src)
    assert {n: t["sha256"] for n, t in marker["tensors"].items()} == {n: digests[n] for n in want}
    assert set(marker["files"]) == set(files)
    assert marker["version"] == 2
    for f in files:  # every recorded file digest is the segments' digest of the bytes on disk
        raw = (ndir / f).read_bytes()
        assert (marker["files"][f]["size"], marker["files"][f]["segments_sha256"]) == (len(raw), segments_digest(raw))
        assert "sha256" not in marker["files"][f]  # never a plain sha256 it is not
    assert (ndir / "READY").is_file() and not list(ndir.glob(".*"))
    rep = verify_checkpoint(ndir, use_cache=False)
    assert rep.ok, [str(i) for i in rep.issues]
    return tensors


def check_nodes(src: Path, out: Path, **kw: int | str) -> None:
    """Every node of ``out`` (see :func:`check_node`), and together they reproduce every source
    tensor byte for byte."""
    gpn, world = int(kw["gpus_per_node"]), int(kw["tp"]) * int(kw["dp"])
    nodes = -(-world // gpn)
    assert sorted(p.name for p in out.iterdir()) == [".cache"] + [f"node-{n:05d}" for n in range(nodes)] + ["topology.json"]
    union: dict[str, bytes] = {}
    for n in range(nodes):
        for name, data in check_node(src, out / f"node-{n:05d}", node=n, **kw).items():  # type: ignore[arg-type]
            assert union.setdefault(name, data) == data, name  # a dense tensor is the same on every node
    source: dict[str, bytes] = {}
    for f in sorted(src.glob("*.safetensors")):
        source.update(read_tensors(f))
    assert union == source


@pytest.fixture(scope="module")
def k3_heads8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-tiny with 8 attention heads (TP8 must divide them) and 3 layers, 16 experts."""
    src = tmp_path_factory.mktemp("k3h8") / "src"
    synthesize(spec_from_preset("k3-tiny", num_attention_heads=8, kda_num_heads=8, num_layers=3), src)
    return set_expert_groups(src, 2)  # the round_robin case needs groups (vLLM's rule: docs/engines.md)


@pytest.mark.parametrize("tp,dp,gpn,placement,max_size", [
    (8, 1, 8, "linear", None),  # one node, TP8 / EP8
    (8, 2, 8, "linear", None),  # 2 nodes x 8 GPUs, TP8 DP2 = EP16: one expert per rank
    (4, 4, 4, "round_robin", 20_000),  # 4 nodes x 4 GPUs, round robin, several files per rank
])
def test_engine_topologies(k3_heads8: Path, tmp_path: Path, tp: int, dp: int, gpn: int, placement: str,
                           max_size: int | None) -> None:
    out = tmp_path / "o"
    args = ["reshard", str(k3_heads8), "-o", str(out), "--tp", str(tp), "--dp", str(dp), "--gpus-per-node", str(gpn),
            "--placement", placement, "--json"] + (["--max-file-size", str(max_size)] if max_size else [])
    r = run(*args)  # no --format: the node directory is the default
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["format"] == "node" and data["nodes_written"] == list(range(tp * dp // gpn))
    topo = json.loads((out / "topology.json").read_text())
    assert (topo["format"], topo["ep"], topo["tp"], topo["dp"], topo["world_size"], topo["gpus_per_node"]) == (
        "k3ckpt-node-layout", tp * dp, tp, dp, tp * dp, gpn)
    check_nodes(k3_heads8, out, tp=tp, dp=dp, placement=placement, gpus_per_node=gpn, num_experts=16,
                max_file_size=max_size or 5 * 1024**3)
    if max_size:
        assert any(_RANK_FILE.fullmatch(f.name) and not f.name.endswith("-00001-of-00001.safetensors")
                   for f in (out / "node-00000").iterdir())  # the limit did split a rank's experts


@pytest.mark.parametrize("num_experts,tp,dp,gpn,placement", [
    (10, 2, 4, 4, "linear"),  # ranks 0 and 1 hold 2 experts, the others 1
    (7, 1, 4, 2, "round_robin"),  # 2, 2, 2, 1
    (7, 1, 4, 2, "linear"),
])
def test_uneven_expert_counts(tmp_path: Path, num_experts: int, tp: int, dp: int, gpn: int, placement: str) -> None:
    src = tmp_path / "src"
    synthesize(spec_from_preset("k3-tiny", num_experts=num_experts, experts_per_token=2, num_layers=3), src)
    if placement == "round_robin":
        set_expert_groups(src, num_experts)
    out = tmp_path / "o"
    sel = RankSelection(tp=tp, dp=dp, gpus_per_node=gpn, placement=placement)
    res = rs.reshard(src, out, sel, layout="node", max_file_size=200_000)
    assert res.written == list(range(tp * dp // gpn))
    check_nodes(src, out, tp=tp, dp=dp, placement=placement, gpus_per_node=gpn, num_experts=num_experts,
                max_file_size=200_000)


def test_one_node_holds_the_world_by_default(k3_tiny: Path, tmp_path: Path) -> None:
    r = run("reshard", str(k3_tiny), "-o", str(tmp_path / "o"), "--ep", "4", "--tp", "2")
    assert r.exit_code == 0 and "ep 4 = tp 2 x dp 2, world size 4: 1 nodes written" in r.output, r.output
    check_nodes(k3_tiny, tmp_path / "o", tp=2, dp=2, placement="linear", gpus_per_node=4, num_experts=16)


@pytest.mark.parametrize("args,needle", [
    # experts would be TP-sliced under EP: vLLM never does that
    (["--ep", "4", "--tp", "2", "--world-size", "8"],
     "the engine format needs --ep equal to the world size (vLLM's expert parallel uses ep = tp x dp = 8, not 4); "
     "use --ep 8 --tp 2, or --format rank for pre-split experts"),
    (["--ep", "4", "--tp", "8"], "use --ep 8 --tp 8, or --format rank"),
    # ep that is not tp x dp
    (["--ep", "8", "--tp", "2", "--dp", "2"], "ep = tp x dp = 4, not 8); use --tp 2 --dp 2, or --tp 2 --dp 4 for ep 8"),
    (["--ep", "4", "--tp", "2", "--dp", "4"], "ep = tp x dp = 8, not 4); use --tp 2 --dp 4, or --format rank"),
    (["--tp", "2", "--dp", "2", "--world-size", "8"], "--world-size 8 is not tp x dp = 2 x 2 = 4"),
    (["--ep", "4", "--ranks", "0"], "not --ranks (or --format rank for per-rank directories)"),
    (["--ep", "4", "--gpus-per-node", "2", "--node", "2"], "--node 2 out of range"),
])
def test_engine_format_refuses_what_vllm_cannot_run(k3_tiny: Path, tmp_path: Path, args: list[str],
                                                    needle: str) -> None:
    out = tmp_path / "o"
    assert_one_line_error(run("reshard", str(k3_tiny), "-o", str(out), *args), 2, needle)
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.parametrize("args", [
    ["--ep", "4", "--tp", "2", "--world-size", "8"],
    ["--ep", "2", "--tp", "4"],
    ["--ep", "2", "--tp", "2", "--dp", "2"],  # rank layout: --dp only sets the world size; experts cut 2 ways
])
def test_the_same_topologies_work_as_a_rank_layout(k3_tiny: Path, tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "o"
    r = run("reshard", str(k3_tiny), "-o", str(out), "--format", "rank", *args, "--json")
    assert r.exit_code == 0, r.output
    topo = json.loads((out / "topology.json").read_text())
    assert topo["format"] == "k3ckpt-rank-layout" and topo["moe_tp"] > 1
    assert json.loads(r.output)["ranks_written"] == list(range(topo["world_size"]))


def test_plan_is_a_pure_function_of_the_inventory(k3_tiny: Path) -> None:
    """What a rank-aware fetch will call: the same plan from the inventory alone, in any dict order."""
    ckpt = open_checkpoint(k3_tiny)
    topo = Topology.make(ep=8, tp=2, num_experts=16, placement="round_robin")
    a = plan_node_dir(ckpt.tensors, topo, 1, 4, max_file_size=300_000)
    b = plan_node_dir(dict(reversed(list(ckpt.tensors.items()))), topo, 1, 4, max_file_size=300_000,
                      roles=ckpt.roles)
    assert a == b and a.ranks == (4, 5, 6, 7) and a.experts_by_rank[5] == (5, 13)
    dense = [f.name for f in a.files if f.rank is None]
    assert dense == [f"model-dense-{k:05d}-of-{len(dense):05d}.safetensors" for k in range(1, len(dense) + 1)]
    assert [f.rank for f in a.files] == [None] * len(dense) + [4, 5, 6, 7]  # dense first, then rank by rank
    assert a.files[-1].name == "model-rank-00007-experts-00001-of-00001.safetensors"
    assert all(f.size <= 300_000 for f in a.files if len(f.tensors) > 1)
    assert a.index_json()["weight_map"] == {t.name: f.name for f in a.files for t in f.tensors}
    with pytest.raises(rs.TopologyError, match="holds whole experts: ep 4 must equal the world size 8"):
        plan_node_dir(ckpt.tensors, Topology.make(ep=4, tp=2, world_size=8, num_experts=16), 0, 8, max_file_size=10**9)


def test_uneven_and_one_node_at_a_time(tmp_path: Path) -> None:
    src = tmp_path / "src"
    synthesize(spec_from_preset("k3-tiny", num_experts=10, num_layers=3), src)
    for node in (1, 0):  # each node writes its own share into the shared directory
        res = rs.reshard(src, tmp_path / "o", RankSelection(ep=4, gpus_per_node=2, node=node), layout="node")
        assert res.written == [node]
    # node 0: experts 0-5 (3 + 3); node 1: experts 6-9 (2 + 2)
    check_nodes(src, tmp_path / "o", tp=1, dp=4, placement="linear", gpus_per_node=2, num_experts=10)


def test_gptoss_stacked_experts_stay_whole(gptoss_tiny: Path, tmp_path: Path) -> None:
    rs.reshard(gptoss_tiny, tmp_path / "o", RankSelection(ep=4, gpus_per_node=2), layout="node")
    check_nodes(gptoss_tiny, tmp_path / "o", tp=1, dp=4, placement="linear", gpus_per_node=2, num_experts=8)


def test_k2_nodes(k2_tiny_grouped: Path, tmp_path: Path) -> None:
    rs.reshard(k2_tiny_grouped, tmp_path / "o", RankSelection(ep=4, gpus_per_node=2, placement="round_robin"),
               layout="node")
    check_nodes(k2_tiny_grouped, tmp_path / "o", tp=1, dp=4, placement="round_robin", gpus_per_node=2, num_experts=8)


@pytest.fixture(scope="module")
def nodes(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nodes") / "o"
    rs.reshard(k3_tiny, out, RankSelection(ep=4, gpus_per_node=2), layout="hf-node")  # the older name
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
    rs.reshard(k3_tiny, out, RankSelection(ep=4, gpus_per_node=2), layout="node")
    res = rs.reshard(k3_tiny, out, RankSelection(ep=4, gpus_per_node=2), layout="node")
    assert res.written == [] and res.skipped == [0, 1]
    victim = next((out / "node-00001").glob("model-*.safetensors"))
    with open(victim, "ab") as fh:
        fh.write(b"x")
    res = rs.reshard(k3_tiny, out, RankSelection(ep=4, gpus_per_node=2), layout="node")
    assert res.written == [1] and res.skipped == [0]
    check_node(k3_tiny, out / "node-00001", tp=1, dp=4, placement="linear", node=1, gpus_per_node=2, num_experts=16)


def test_interrupted_node_has_no_index_marker_or_ready(k3_tiny: Path, tmp_path: Path) -> None:
    plan = rs.plan_reshard(k3_tiny, RankSelection(ep=4, gpus_per_node=2), layout="node",
                           max_file_size=1_000_000)

    last = plan.nodes[1].files[-1].name
    assert len(plan.nodes[1].files) > 1

    def boom(name: str) -> None:
        if name == last:
            raise OSError(28, "No space left on device")

    with pytest.raises(rs.ReshardError, match="No space left on device; .*temporary files removed.*free space and re-run"):
        with inject_fault("reshard.file_written", boom):
            rs.run_reshard(plan, tmp_path / "o", jobs=1)
    unfinished = [d for d in (tmp_path / "o").glob("node-*") if not (d / "READY").exists()]
    assert unfinished
    for ndir in unfinished:
            assert not (ndir / INDEX_NAME).exists() and not (ndir / "k3ckpt-node.json").exists()
            assert not list(ndir.glob("model-*.safetensors"))
    res = rs.reshard(k3_tiny, tmp_path / "o", RankSelection(ep=4, gpus_per_node=2), layout="node",
                     max_file_size=1_000_000)
    assert sorted(res.written + res.skipped) == [0, 1]
    check_node(k3_tiny, tmp_path / "o" / "node-00000", tp=1, dp=4, placement="linear", node=0, gpus_per_node=2,
               num_experts=16)


def test_cli(k3_tiny: Path, nodes: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["reshard", str(k3_tiny), "-o", str(tmp_path / "o"), "--format", "hf-node", "--ep", "4"]
    r = runner.invoke(main, [*args, "--gpus-per-node", "2", "--node", "1", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["format"] == "node" and data["nodes_written"] == [1]
    r = runner.invoke(main, [*args, "--gpus-per-node", "2"])
    assert r.exit_code == 0 and "1 nodes written" in r.output and "1 already complete" in r.output, r.output
    for extra, needle in [(["--gpus-per-node", "2", "--ranks", "0"], "not --ranks"),
                          (["--gpus-per-node", "2", "--node", "2"], "--node 2 out of range")]:
        r = runner.invoke(main, [*args, *extra])
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.output
    # a rank layout in the same directory is another topology
    r = runner.invoke(main, ["reshard", str(k3_tiny), "-o", str(tmp_path / "o"), "--format", "rank", "--ep", "4"])
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


def test_the_plan_fixes_every_byte_a_producer_writes(k3_tiny_grouped: Path, tmp_path: Path) -> None:
    """A second producer (a rank-aware fetch) that follows the plan writes the same directory:
    headers, tensor offsets, index and marker all come from :func:`plan_node_dir`."""
    k3_tiny = k3_tiny_grouped
    ckpt = open_checkpoint(k3_tiny)
    sel = RankSelection(tp=2, dp=4, gpus_per_node=4, node=1, placement="round_robin")
    rs.reshard(k3_tiny, tmp_path / "o", sel, max_file_size=300_000)
    ndir = tmp_path / "o" / "node-00001"
    topo = sel.topology(16, engine=True)
    nd = plan_node_dir(ckpt.tensors, topo, 1, 4, max_file_size=300_000)
    assert sorted(f.name for f in nd.files) == sorted(p.name for p in ndir.glob("*.safetensors"))
    tensor_sha, file_digests = {}, {}
    for f in nd.files:
        data = (ndir / f.name).read_bytes()
        assert len(data) == f.size and data.startswith(f.prefix)
        for t, (b, e) in zip(f.tensors, f.offsets):  # each tensor's source bytes at its planned offset
            hdr = ckpt.shards[t.file]
            with open(hdr.path, "rb") as fh:
                fh.seek(hdr.data_start + t.begin)
                src = fh.read(t.nbytes)
            assert data[len(f.prefix) + b:len(f.prefix) + e] == src, t.name
            tensor_sha[t.name] = hashlib.sha256(src).hexdigest()
        file_digests[f.name] = segments_digest(data)
    assert (ndir / INDEX_NAME).read_bytes() == nd.index_bytes()
    source_sha = hashlib.sha256((k3_tiny / INDEX_NAME).read_bytes()).hexdigest()
    assert nd.segments_sha256(tensor_sha) == file_digests
    assert (ndir / "k3ckpt-node.json").read_bytes() == nd.marker_bytes(source_sha, tensor_sha)


@pytest.mark.parametrize("odd_names", [False, True])
def test_marker_bytes_are_json_dumps_of_the_marker(k3_tiny: Path, odd_names: bool) -> None:
    """The marker's tensor entries are written from columns (json_records), not walked as one
    dict each: the bytes are exactly json.dumps of the marker with its digests, for plain names
    and for names JSON must escape (quotes, backslashes, control and non-ASCII characters),
    over several files of each kind."""
    from k3ckpt.format.header import TensorInfo

    tensors = dict(open_checkpoint(k3_tiny).tensors)
    if odd_names:
        for k, name in enumerate(['odd."q".weight', "odd\\b.weight", "odd.\x01.weight", "odd.é名.weight"]):
            tensors[name] = TensorInfo(name, "BF16", (2, k + 1), 0, 4 * (k + 1), f"extra-{k}.safetensors")
    topo = Topology.make(ep=8, tp=2, num_experts=16)
    nd = plan_node_dir(tensors, topo, 1, 4, max_file_size=300_000)
    assert len([f for f in nd.files if f.rank is None]) > 1 and len(nd.files) > 5
    tensor_sha = {t.name: hashlib.sha256(t.name.encode()).hexdigest() for f in nd.files for t in f.tensors}
    file_sha = nd.segments_sha256(tensor_sha)
    for excluded in ((), ("z.txt", 'a"é.md')):
        want = nd.marker_json()
        want["source_index_sha256"] = "abc"
        if excluded:
            want["excluded"] = sorted(excluded)
        for name, entry in want["files"].items():
            entry["segments_sha256"] = file_sha[name]
        for name, entry in want["tensors"].items():
            entry["sha256"] = tensor_sha[name]
        assert nd.marker_bytes("abc", tensor_sha, excluded) == (json.dumps(want) + "\n").encode()
