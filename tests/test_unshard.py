"""``k3ckpt unshard``: reshard then unshard is byte-identical per tensor, across topologies and
families; every inconsistency of a layout is refused with a one-line error; resharding killed at
a random point resumes to the same layout; per-node runs add up to the full run."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from helpers import tensor_digests
from k3ckpt.cli import main
from k3ckpt.deploy import reshard as rs
from k3ckpt.deploy.unshard import UnshardError, natural_key, plan_unshard, unshard
from k3ckpt.format.checkpoint import INDEX_NAME, open_checkpoint
from k3ckpt.format.header import read_header
from k3ckpt.format.topology import RankSelection
from k3ckpt.testing.synth import spec_from_preset, synthesize
from test_reshard import check_layout


def assert_round_trip(src: Path, back: Path) -> None:
    """``back`` is a valid local-dir checkpoint whose tensors equal ``src``'s byte for byte."""
    a, b = open_checkpoint(src), open_checkpoint(back)
    assert {n: (t.dtype, t.shape) for n, t in b.tensors.items()} == {n: (t.dtype, t.shape) for n, t in a.tensors.items()}
    assert tensor_digests(back) == tensor_digests(src)
    index = json.loads((back / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in b.tensors.values())
    files = sorted(set(index["weight_map"].values()))
    assert files == sorted(p.name for p in back.glob("*.safetensors"))
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for f in files:  # the reference reader agrees with ours
        with safe_open(str(back / f), framework="numpy") as so:
            assert set(so.keys()) == {k for k, v in index["weight_map"].items() if v == f}
    for f in src.iterdir():  # config, tokenizer, LICENSE ...
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_NAME:
            assert (back / f.name).read_bytes() == f.read_bytes(), f.name
    # nothing hidden but the ownership record (.cache/k3ckpt/owner.json): no temporary left
    assert not (back / "topology.json").exists() and [p.name for p in back.glob(".*")] == [".cache"]
    assert sorted(p.name for p in (back / ".cache").rglob("*") if p.is_file()) == ["owner.json"]
    assert not b.problems


@pytest.fixture(scope="module")
def k3_uneven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-tiny with 10 routed experts: ep 4 places 3, 3, 2, 2 (linear) or 3, 3, 2, 2 (round robin)."""
    dest = tmp_path_factory.mktemp("uneven") / "k3-uneven"
    synthesize(spec_from_preset("k3-tiny", num_experts=10, num_layers=3), dest)
    return dest


@pytest.mark.parametrize("ep,tp,ws,placement", [
    (1, 1, None, "linear"),
    (2, 1, None, "linear"),
    (4, 2, None, "linear"),
    (8, 1, None, "linear"),
    (1, 2, None, "linear"),       # moe_tp 2: every expert split, w2 on dim 1
    (4, 4, None, "linear"),
    (2, 1, 4, "linear"),          # moe_tp 2 with ep 2
    (8, 2, None, "round_robin"),
    (4, 2, 8, "round_robin"),     # moe_tp 2, round robin
])
def test_k3_round_trip(k3_tiny: Path, tmp_path: Path, ep: int, tp: int, ws: int | None, placement: str) -> None:
    rs.reshard(k3_tiny, tmp_path / "lay", RankSelection(ep=ep, tp=tp, world_size=ws, placement=placement),
               jobs=2, layout="rank")
    res = unshard(tmp_path / "lay", tmp_path / "back", max_shard_size=1_000_000, jobs=2)
    assert_round_trip(k3_tiny, tmp_path / "back")
    assert len(res.shards) > 1 and res.tensors == len(open_checkpoint(k3_tiny).tensors)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_uneven_experts_round_trip(k3_uneven: Path, tmp_path: Path, placement: str) -> None:
    rs.reshard(k3_uneven, tmp_path / "lay", RankSelection(ep=4, tp=2, placement=placement), layout="rank")
    by_rank = json.loads((tmp_path / "lay" / "topology.json").read_text())["experts_by_rank"]
    assert sorted(map(len, by_rank)) == [2, 2, 3, 3]
    unshard(tmp_path / "lay", tmp_path / "back")
    assert_round_trip(k3_uneven, tmp_path / "back")


@pytest.mark.parametrize("ep,ws,placement", [(2, 4, "linear"), (4, None, "round_robin"), (8, 16, "round_robin")])
def test_gptoss_stacked_round_trip(gptoss_tiny: Path, tmp_path: Path, ep: int, ws: int | None, placement: str) -> None:
    rs.reshard(gptoss_tiny, tmp_path / "lay", RankSelection(ep=ep, world_size=ws, placement=placement), layout="rank")
    unshard(tmp_path / "lay", tmp_path / "back", mode="buffered")
    assert_round_trip(gptoss_tiny, tmp_path / "back")


@pytest.mark.parametrize("ep,placement", [(2, "linear"), (4, "round_robin"), (8, "linear")])
def test_k2_fp8_round_trip(k2_tiny: Path, tmp_path: Path, ep: int, placement: str) -> None:
    rs.reshard(k2_tiny, tmp_path / "lay", RankSelection(ep=ep, placement=placement), layout="rank")
    unshard(tmp_path / "lay", tmp_path / "back")
    assert_round_trip(k2_tiny, tmp_path / "back")


def test_interleave_through_small_buffers(k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dim-1 joins in several bands and rows copied one by one give the same bytes."""
    from k3ckpt.deploy import bytecopy

    rs.reshard(k3_tiny, tmp_path / "lay", RankSelection(ep=2, tp=2, world_size=4), layout="rank")
    monkeypatch.setattr(bytecopy, "CHUNK", 4096)
    unshard(tmp_path / "lay", tmp_path / "banded")
    assert_round_trip(k3_tiny, tmp_path / "banded")
    monkeypatch.setattr(bytecopy, "ROW_COPY_MIN", 16)
    unshard(tmp_path / "lay", tmp_path / "rows")
    assert_round_trip(k3_tiny, tmp_path / "rows")


def test_natural_order_and_packing(k3_tiny: Path, tmp_path: Path) -> None:
    rs.reshard(k3_tiny, tmp_path / "lay", RankSelection(ep=2), layout="rank")
    unshard(tmp_path / "lay", tmp_path / "back", max_shard_size=300_000)
    index = json.loads((tmp_path / "back" / INDEX_NAME).read_text())
    order = []
    for f in sorted(set(index["weight_map"].values())):
        hdr = read_header(tmp_path / "back" / f)
        names = sorted(hdr.tensors, key=lambda n: hdr.tensors[n].begin)
        order += names
        if len(names) > 1:
            assert sum(t.nbytes for t in hdr.tensors.values()) <= 300_000
    assert order == sorted(order, key=natural_key)
    assert natural_key("layers.2.x") < natural_key("layers.10.x")


# -- refusals ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layout(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ep 2 x tp 2 (read-only: copy before breaking)."""
    out = tmp_path_factory.mktemp("layout") / "lay"
    rs.reshard(k3_tiny, out, RankSelection(ep=2, tp=2), layout="rank")
    return out


def _manifest(lay: Path, rank: int) -> tuple[Path, dict]:
    p = lay / f"rank-{rank:05d}" / "rank-manifest.json"
    return p, json.loads(p.read_text())


def _split_tensor(m: dict, dim: int) -> str:
    return next(n for n, t in m["tensors"].items() if t["split"] and t["split"].get("dim") == dim
                and "experts" not in t["split"])


def _break_missing_rank(lay: Path) -> None:
    shutil.rmtree(lay / "rank-00001")


def _break_ready(lay: Path) -> None:
    (lay / "rank-00000" / "READY").unlink()


def _break_missing_file(lay: Path) -> None:
    next((lay / "rank-00001").glob("*.safetensors")).unlink()


def _break_size(lay: Path) -> None:
    with open(next((lay / "rank-00000").glob("*.safetensors")), "ab") as fh:
        fh.write(b"\0")


def _break_rank_field(lay: Path) -> None:
    p, m = _manifest(lay, 1)
    m["tp_rank"] = 0
    p.write_text(json.dumps(m))


def _break_topology(lay: Path) -> None:
    p = lay / "topology.json"
    t = json.loads(p.read_text())
    t["experts_by_rank"] = t["experts_by_rank"][::-1]
    p.write_text(json.dumps(t))


def _break_source(lay: Path) -> None:
    p, m = _manifest(lay, 1)
    m["source_index_sha256"] = "0" * 64
    p.write_text(json.dumps(m))


def _break_tiling(lay: Path) -> None:
    """Rank 1 claims to hold part 0 of a dim-0 split again, so part 1 is nowhere."""
    _, m0 = _manifest(lay, 0)
    p, m1 = _manifest(lay, 1)
    name = _split_tensor(m1, 0)
    m1["tensors"][name]["split"]["index"] = 0
    m1["tensors"][name]["sha256"] = m0["tensors"][name]["sha256"]
    p.write_text(json.dumps(m1))


def _break_replica(lay: Path) -> None:
    p, m = _manifest(lay, 1)
    name = next(n for n, t in m["tensors"].items() if t["split"] is None and ".experts." not in n)
    m["tensors"][name]["sha256"] = "f" * 64
    p.write_text(json.dumps(m))


def _break_header(lay: Path) -> None:
    p, m = _manifest(lay, 0)
    name = _split_tensor(m, 0)
    m["tensors"][name]["shape"][0] += 1
    p.write_text(json.dumps(m))


def _break_expert_owner(lay: Path) -> None:
    """Rank 0's manifest and file lose an expert tensor: the expert is then missing."""
    from ckpt_edit import rewrite_shard

    p, m = _manifest(lay, 0)
    name = next(n for n in m["tensors"] if ".experts.0." in n)
    f = lay / "rank-00000" / m["tensors"].pop(name)["file"]
    rewrite_shard(f, lambda ts: [t for t in ts if t[0] != name])
    m["files"][f.name]["size"] = f.stat().st_size
    p.write_text(json.dumps(m))


@pytest.mark.parametrize("breaker,needle", [
    (_break_missing_rank, "rank-00001: missing"),
    (_break_ready, "rank-00000: no READY"),
    (_break_missing_file, "missing (listed in rank-00001/rank-manifest.json)"),
    (_break_size, "bytes, the manifest says"),
    (_break_rank_field, "tp_rank is 0 but topology.json makes it 1"),
    (_break_topology, "experts_by_rank disagree"),
    (_break_source, "written from another source"),
    (_break_tiling, "parts [1] missing"),
    (_break_replica, "differs from the same slice on rank 0"),
    (_break_header, "header says"),
    (_break_expert_owner, "on no rank (rank 0 should hold it; 15 of 16 experts have it)"),
])
def test_refusals(layout: Path, tmp_path: Path, breaker, needle: str) -> None:
    lay = tmp_path / "lay"
    shutil.copytree(layout, lay)
    breaker(lay)
    with pytest.raises(UnshardError) as ei:
        unshard(lay, tmp_path / "back")
    assert needle in str(ei.value) and "\n" not in str(ei.value)
    assert not (tmp_path / "back").exists()  # refused before anything was written
    r = CliRunner().invoke(main, ["unshard", str(lay), "-o", str(tmp_path / "back")])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("k3ckpt: error:") and needle in lines[0], r.output


def test_corrupt_data_fails_and_leaves_no_checkpoint(layout: Path, tmp_path: Path) -> None:
    """A rank file changed after reshard (same size): the digest check while copying catches
    it; no shard under a final name, no index, no temporary file is left."""
    from ckpt_edit import flip_byte

    lay = tmp_path / "lay"
    shutil.copytree(layout, lay)
    _, m = _manifest(lay, 1)
    name = _split_tensor(m, 1)
    f = lay / "rank-00001" / m["tensors"][name]["file"]
    hdr = read_header(f)
    flip_byte(f, hdr.data_start + hdr.tensors[name].begin + 3)
    out = tmp_path / "back"
    with pytest.raises(UnshardError, match=f"rank-00001/.*tensor {name!r}: sha256 .* does not match"):
        unshard(lay, out, max_shard_size=100_000, jobs=2)
    assert list(out.iterdir()) and not list(out.glob("*.safetensors")) and not list(out.glob(".*.tmp"))
    assert not (out / INDEX_NAME).exists()


def test_existing_checkpoint_refused_unless_force(layout: Path, k3_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "back"
    unshard(layout, out, max_shard_size=200_000)
    many = sorted(p.name for p in out.glob("*.safetensors"))
    with pytest.raises(UnshardError, match="already holds a checkpoint"):
        unshard(layout, out)
    unshard(layout, out, force=True)  # one shard now: the earlier shards must not linger
    assert len(many) > 1 and [p.name for p in out.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    assert_round_trip(k3_tiny, out)
    with pytest.raises(UnshardError, match="inside the rank layout"):
        unshard(layout, layout / "x")
    with pytest.raises(UnshardError, match="topology.json: not found"):
        plan_unshard(k3_tiny)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "topology.json").write_text('{"format": "something-else"}')
    with pytest.raises(UnshardError, match="not a k3ckpt rank layout"):
        plan_unshard(tmp_path / "other")


def test_cli_json(layout: Path, tmp_path: Path, k3_tiny: Path) -> None:
    r = CliRunner().invoke(main, ["unshard", str(layout), "-o", str(tmp_path / "b"), "--json", "--max-shard-size", "1MB"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["tensors"] == len(open_checkpoint(k3_tiny).tensors) and len(data["shards"]) > 1
    assert "config.json" in data["files_copied"]
    r = CliRunner().invoke(main, ["unshard", str(layout), "-o", str(tmp_path / "c")])
    assert r.exit_code == 0 and r.output.startswith("ok: ") and len(r.output.splitlines()) == 1, r.output


# -- resuming and per-node runs of reshard ------------------------------------------------------


_KILLER = textwrap.dedent("""
    import os, signal, sys
    from k3ckpt.deploy import bytecopy
    from k3ckpt.deploy.reshard import reshard
    from k3ckpt.format.topology import RankSelection
    src, out, after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    calls = [0]
    real = bytecopy.Copier.contiguous
    def contiguous(self, *a, **k):
        calls[0] += 1
        if calls[0] > after:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *a, **k)
    bytecopy.Copier.contiguous = contiguous
    res = reshard(src, out, RankSelection(ep=4, tp=2), jobs=2, max_file_size=200_000, layout="rank")
    print("finished", calls[0])
""")


@pytest.mark.slow
def test_reshard_killed_at_random_points_resumes(k3_tiny: Path, tmp_path: Path) -> None:
    """SIGKILL after a random number of copy steps; whatever is left, ranks with READY are
    intact (files match their manifest's sizes and digests) and are skipped by the re-run,
    and the re-run completes the layout."""
    full = subprocess.run([sys.executable, "-c", _KILLER, str(k3_tiny), str(tmp_path / "probe"), str(10**9)],
                          capture_output=True, text=True, check=True)
    steps = int(full.stdout.split()[-1])
    rng = random.Random(20261130)
    for trial, after in enumerate(sorted(rng.sample(range(1, steps), 3))):
        out = tmp_path / f"o{trial}"
        p = subprocess.run([sys.executable, "-c", _KILLER, str(k3_tiny), str(out), str(after)],
                           capture_output=True, text=True)
        assert p.returncode == -signal.SIGKILL, p.stderr
        ready = []
        for rdir in sorted(out.glob("rank-*")):
            if not (rdir / "READY").exists():
                continue
            m = json.loads((rdir / "rank-manifest.json").read_text())
            for fname, meta in m["files"].items():
                data = (rdir / fname).read_bytes()
                assert (len(data), hashlib.sha256(data).hexdigest()) == (meta["size"], meta["sha256"])
            ready.append(int(rdir.name.split("-")[1]))
        res = rs.reshard(k3_tiny, out, RankSelection(ep=4, tp=2), max_file_size=200_000, layout="rank")
        assert res.skipped == ready and sorted(res.written + res.skipped) == list(range(4))
        check_layout(k3_tiny, out, ep=4, tp=2)
        for f in (tmp_path / "probe").rglob("*"):
            if f.is_file() and ".cache" not in f.relative_to(tmp_path / "probe").parts:  # stat records differ
                assert f.read_bytes() == (out / f.relative_to(tmp_path / "probe")).read_bytes(), f


def test_per_node_runs_add_up_to_the_full_run(k3_tiny: Path, tmp_path: Path) -> None:
    rs.reshard(k3_tiny, tmp_path / "full", RankSelection(ep=4, tp=2, world_size=8, placement="round_robin"), layout="rank")
    for node in (2, 0, 3, 1):
        rs.reshard(k3_tiny, tmp_path / "nodes", RankSelection(ep=4, tp=2, world_size=8, placement="round_robin",
                                                              node=node, gpus_per_node=2), layout="rank")
    # the hidden records (.cache/k3ckpt: ownership, the stat of each written file) are per directory
    full = sorted(p.relative_to(tmp_path / "full") for p in (tmp_path / "full").rglob("*")
                  if p.is_file() and ".cache" not in p.parts)
    nodes = sorted(p.relative_to(tmp_path / "nodes") for p in (tmp_path / "nodes").rglob("*")
                   if p.is_file() and ".cache" not in p.parts)
    assert full == nodes
    for rel in full:
        assert (tmp_path / "full" / rel).read_bytes() == (tmp_path / "nodes" / rel).read_bytes(), rel
    unshard(tmp_path / "nodes", tmp_path / "back")
    assert_round_trip(k3_tiny, tmp_path / "back")


# -- malformed manifests: always a one-line UnshardError, never another exception ---------------


@pytest.fixture(scope="module")
def gptoss_layout(gptoss_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-oss stacked experts, ep 2 x moe_tp 2 (inner splits; read-only)."""
    out = tmp_path_factory.mktemp("gptoss-layout") / "lay"
    rs.reshard(gptoss_tiny, out, RankSelection(ep=2, world_size=4), layout="rank")
    return out


def _first(m: dict, pred) -> str:
    return next(n for n, t in m["tensors"].items() if pred(t))


def _on_split(field, value):
    def mutate(m: dict) -> None:
        name = _first(m, lambda t: t["split"] and "experts" not in t["split"])
        if value is _DEL:
            del m["tensors"][name]["split"][field]
        else:
            m["tensors"][name]["split"][field] = value
    return mutate


def _on_tensor(field, value, pred=lambda t: True):
    def mutate(m: dict) -> None:
        m["tensors"][_first(m, pred)][field] = value
    return mutate


def _on_inner(field, value):
    def mutate(m: dict) -> None:
        name = _first(m, lambda t: t["split"] and "experts" in t["split"] and t["split"]["split"])
        split = m["tensors"][name]["split"]
        target = split if field in ("split", "experts") else split["split"]
        if value is _DEL:
            del target[field if field != "split" else "split"]
        else:
            target[field] = value
    return mutate


def _rename_file(new: str):
    def mutate(m: dict) -> None:
        old = next(iter(m["files"]))
        m["files"][new] = m["files"].pop(old)
        for t in m["tensors"].values():
            if t["file"] == old:
                t["file"] = new
    return mutate


def _on_files(value):
    def mutate(m: dict) -> None:
        m["files"][next(iter(m["files"]))] = value
    return mutate


_DEL = object()
_BAD = ["2", 2.5, None, True, -1, [], {}]
_MUTATIONS = (
    [("k3", f"split.{f}={v!r}", _on_split(f, v)) for f in ("dim", "index", "parts") for v in _BAD + [0, 99]]
    + [("k3", f"split.{f} missing", _on_split(f, _DEL)) for f in ("dim", "index", "parts")]
    + [("k3", f"source_shape={v!r}", _on_tensor("source_shape", v)) for v in [5, "abc", None, [1.5], ["a"], [-1], {}]]
    + [("k3", f"{f}={v!r}", _on_tensor(f, v)) for f in ("file", "dtype", "shape", "sha256", "split")
       for v in [5, ["x"], {"a": 1}, None, "2"] if (f, v) != ("sha256", "2")]  # a wrong digest fails at copy time
    + [("k3", f"file name {n!r}", _rename_file(n)) for n in ["../x", "a/b", "a\\b", ".hidden", "", "a\0b"]]
    + [("k3", f"files entry {v!r}", _on_files(v)) for v in [5, "x", None, [], {"size": "1"}]]
    + [("k3", "tensor entry 5", lambda m: m["tensors"].__setitem__(next(iter(m["tensors"])), 5))]
    + [("k3", "source digest 5", lambda m: m.__setitem__("source_index_sha256", 5))]
    + [("gptoss", f"inner.{f}={v!r}", _on_inner(f, v)) for f in ("dim", "index", "parts") for v in _BAD + [0, 99]]
    + [("gptoss", f"inner.{f} missing", _on_inner(f, _DEL)) for f in ("dim", "index", "parts", "split")]
    + [("gptoss", f"experts={v!r}", _on_inner("experts", v)) for v in ["x", [None], 5, [0.5]]]
    + [("gptoss", f"inner split={v!r}", _on_inner("split", v)) for v in ["x", 5, []]]
)


@pytest.mark.parametrize("which,label,mutate", _MUTATIONS, ids=[m[1] for m in _MUTATIONS])
def test_malformed_manifest_is_a_one_line_error(layout: Path, gptoss_layout: Path, tmp_path: Path,
                                                which: str, label: str, mutate) -> None:
    lay = tmp_path / "lay"
    shutil.copytree(layout if which == "k3" else gptoss_layout, lay)
    p, m = _manifest(lay, 0)
    mutate(m)
    if m == _manifest(lay, 0)[1]:
        pytest.skip("the mutation changes nothing here")
    p.write_text(json.dumps(m))
    with pytest.raises(UnshardError) as ei:  # any other exception fails the test
        plan_unshard(lay)
    msg = str(ei.value)
    assert "\n" not in msg and "rank-00000" in msg, msg


def test_manifest_file_names_stay_in_the_rank_directory(layout: Path, tmp_path: Path) -> None:
    """``../x`` naming a real copy of a rank file beside the rank directory is still refused."""
    lay = tmp_path / "lay"
    shutil.copytree(layout, lay)
    p, m = _manifest(lay, 0)
    old = next(iter(m["files"]))
    shutil.copy(lay / "rank-00000" / old, lay / "x")
    _rename_file("../x")(m)
    p.write_text(json.dumps(m))
    with pytest.raises(UnshardError, match=r"refuses file name '\.\./x'"):
        plan_unshard(lay)


def test_unshard_output_carries_the_proof_of_the_layout_it_was_read_from(k3_tiny: Path, tmp_path: Path) -> None:
    """#25 (docs/trust.md): a layout ``reshard`` wrote from a proven source gives an unshard
    output proven by the same origin (every slice hashed as it is copied, against the digest
    recorded from proven bytes); a rank part touched since, or a source nothing proved, leaves
    the output "not proven"."""
    from helpers import run

    src = tmp_path / "src"
    shutil.copytree(k3_tiny, src)
    manifest = tmp_path / "m.json"
    assert run("manifest", "build", str(src), "-o", str(manifest)).exit_code == 0
    assert run("verify", str(src), "--manifest", str(manifest)).exit_code == 0
    assert run("reshard", str(src), "-o", str(tmp_path / "ranks"), "--format", "rank", "--ep", "4", "--tp", "2").exit_code == 0
    assert run("unshard", str(tmp_path / "ranks"), "-o", str(tmp_path / "back")).exit_code == 0
    res = run("verify", str(tmp_path / "back"), "--quick")
    assert res.exit_code == 0 and res.output.splitlines()[-1] == f"proven by manifest {manifest}", res.output
    assert run("preflight", str(tmp_path / "back"), "--require-proof").exit_code == 0

    # rank 3's experts (its dense part is rank 1's, read from there): the same bytes, but nothing
    # vouches for them now
    part = max((tmp_path / "ranks" / "rank-00003").glob("*.safetensors"))
    assert any(".experts." in n for n in read_header(part).tensors)
    os.utime(part)
    assert run("unshard", str(tmp_path / "ranks"), "-o", str(tmp_path / "back2")).exit_code == 0
    res = run("verify", str(tmp_path / "back2"), "--quick")
    assert res.output.startswith("not proven: "), res.output
    assert run("preflight", str(tmp_path / "back2"), "--require-proof").exit_code == 1
