"""``k3ckpt reshard``: the rank-layout contract, completeness, resumability, memory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from helpers import segments_digest
from k3ckpt.cli import main
from k3ckpt.deploy import reshard as rs
from k3ckpt.format.checkpoint import INDEX_NAME, open_checkpoint
from k3ckpt.format.header import DTYPE_BITS, read_header
from k3ckpt.format.topology import RankSelection, Topology
from k3ckpt.testing import inject_fault

TENSOR_FIELDS = {"file", "dtype", "shape", "source_shape", "split", "sha256"}
TOPO_FIELDS = {"format", "version", "world_size", "ep", "tp", "moe_tp", "expert_placement", "num_experts",
               "experts_by_rank", "source"}


def _raw(ckpt, name: str) -> np.ndarray:
    """A source tensor's bytes as uint8 of shape ``shape + (itemsize,)``."""
    info = ckpt.tensors[name]
    hdr = ckpt.shards[info.file]
    with open(hdr.path, "rb") as fh:
        fh.seek(hdr.data_start + info.begin)
        data = fh.read(info.nbytes)
    return np.frombuffer(data, np.uint8).reshape(tuple(info.shape) + (DTYPE_BITS[info.dtype] // 8,))


def check_layout(src: Path, out: Path, *, ep: int = 1, tp: int = 1, world_size: int | None = None,
                 placement: str = "linear", ranks: list[int] | None = None) -> dict:
    """Check everything the contract promises about ``out``; returns {rank: manifest}."""
    ckpt = open_checkpoint(src)
    topo = Topology.make(ep=ep, tp=tp, world_size=world_size, placement=placement,
                         num_experts=ckpt.config.num_experts)
    tj = json.loads((out / "topology.json").read_text())
    assert TOPO_FIELDS <= tj.keys()
    assert tj["format"] == "k3ckpt-rank-layout" and tj["version"] == 1
    assert (tj["world_size"], tj["ep"], tj["tp"], tj["moe_tp"]) == (topo.world_size, ep, tp, topo.moe_tp)
    assert tj["expert_placement"] == placement and tj["num_experts"] == topo.num_experts
    assert tj["experts_by_rank"] == topo.experts_by_ep_rank() and len(tj["experts_by_rank"]) == ep
    assert tj["source"]["index_sha256"] == hashlib.sha256((src / INDEX_NAME).read_bytes()).hexdigest()
    # non-weight files copied, the index not
    assert not (out / INDEX_NAME).exists()
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_NAME:
            assert (out / f.name).read_bytes() == f.read_bytes()
    want_ranks = list(range(topo.world_size)) if ranks is None else ranks
    assert sorted(p.name for p in out.glob("rank-*")) == [f"rank-{r:05d}" for r in want_ranks]

    manifests: dict[int, dict] = {}
    held: dict[str, list[tuple[int, dict, np.ndarray]]] = {}
    for r in want_ranks:
        rdir = out / f"rank-{r:05d}"
        assert (rdir / "READY").is_file()
        m = json.loads((rdir / "rank-manifest.json").read_text())
        manifests[r] = m
        info = topo.rank_info(r)
        assert (m["rank"], m["ep_rank"], m["tp_rank"], m["moe_tp_rank"]) == (r, info.ep_rank, info.tp_rank, info.moe_tp_rank)
        files = sorted(p.name for p in rdir.glob("*.safetensors"))
        assert files == sorted(m["files"]) and not list(rdir.glob(".*"))
        for fname in files:
            path = rdir / fname
            raw = path.read_bytes()
            assert m["files"][fname] == {"size": len(raw), "segments_sha256": segments_digest(raw)}
            hdr = read_header(path)
            assert hdr.data_start % 16 == 0
            with safe_open(str(path), framework="numpy") as so:
                keys = set(so.keys())
                for k in keys:
                    sl = so.get_slice(k)
                    assert list(sl.get_shape()) == m["tensors"][k]["shape"]
                    assert sl.get_dtype() == m["tensors"][k]["dtype"]
            assert keys == {n for n, t in m["tensors"].items() if t["file"] == fname}
            for n, t in hdr.tensors.items():
                entry = m["tensors"][n]
                assert entry.keys() == TENSOR_FIELDS
                assert entry["dtype"] == ckpt.tensors[n].dtype == t.dtype
                assert entry["source_shape"] == list(ckpt.tensors[n].shape)
                data = raw[hdr.data_start + t.begin: hdr.data_start + t.end]
                assert entry["sha256"] == hashlib.sha256(data).hexdigest()
                split = entry["split"]
                assert split is None or "experts" in split or (split.keys() == {"dim", "index", "parts"} and split["parts"] > 1)
                arr = np.frombuffer(data, np.uint8).reshape(tuple(t.shape) + (DTYPE_BITS[t.dtype] // 8,))
                held.setdefault(n, []).append((r, split, arr))

    # completeness: every source tensor reassembled byte-for-byte; experts on exactly their owners
    roles = ckpt.roles
    for name in ckpt.tensors:
        role = roles[name]
        copies = held.get(name, [])
        if role.expert is not None:
            owners = topo.owner_ranks(role.expert)
            assert sorted(r for r, _, _ in copies) == [o for o in owners if o in want_ranks], name
        elif ranks is None:
            assert sorted(r for r, _, _ in copies) == want_ranks, name
        if ranks is not None or not copies:
            continue
        src_arr = _raw(ckpt, name)
        if copies[0][1] is not None and "experts" in copies[0][1]:
            rebuilt = np.zeros_like(src_arr)
            seen = set()
            for r, split, arr in copies:
                inner = split["split"]
                ex = split["experts"]
                assert ex == tj["experts_by_rank"][topo.rank_info(r).ep_rank]
                if inner is None:
                    rebuilt[ex] = arr
                else:
                    d = inner["dim"]
                    n = src_arr.shape[d] // inner["parts"]
                    idx = [ex] + [slice(None)] * (src_arr.ndim - 1)
                    idx[d] = slice(inner["index"] * n, (inner["index"] + 1) * n)
                    rebuilt[tuple(idx)] = arr
                seen.update(ex)
            assert seen == set(range(topo.num_experts))
            assert np.array_equal(rebuilt, src_arr), name
            continue
        parts: dict[int, np.ndarray] = {}
        for _rank, split, arr in copies:
            if split is None:
                assert np.array_equal(arr, src_arr), name
            else:
                prev = parts.setdefault(split["index"], arr)
                assert np.array_equal(prev, arr), name
        if parts:
            split = copies[0][1]
            assert sorted(parts) == list(range(split["parts"]))
            assert np.array_equal(np.concatenate([parts[i] for i in sorted(parts)], axis=split["dim"]), src_arr), name
    return manifests


@pytest.mark.parametrize("ep,tp,ws", [(4, 2, None), (1, 2, None), (2, 2, 4)])
def test_k3_layouts_complete(k3_tiny: Path, tmp_path: Path, ep: int, tp: int, ws: int | None) -> None:
    res = rs.reshard(k3_tiny, tmp_path / "out", RankSelection(ep=ep, tp=tp, world_size=ws), jobs=2, layout="rank")
    manifests = check_layout(k3_tiny, tmp_path / "out", ep=ep, tp=tp, world_size=ws)
    assert res.skipped == [] and sorted(res.written) == sorted(manifests)
    if ep == 1:  # moe_tp = 2: routed experts TP-sliced, w2 on its input columns
        m = manifests[1]["tensors"]
        w1 = next(n for n in m if n.endswith("experts.0.w1.weight_packed"))
        w2 = next(n for n in m if n.endswith("experts.0.w2.weight_scale"))
        assert m[w1]["split"] == {"dim": 0, "index": 1, "parts": 2}
        assert m[w2]["split"] == {"dim": 1, "index": 1, "parts": 2}


def test_buffered_mode_same_bytes(k3_tiny: Path, tmp_path: Path) -> None:
    rs.reshard(k3_tiny, tmp_path / "k", RankSelection(ep=2, tp=2), mode="kernel", layout="rank")
    rs.reshard(k3_tiny, tmp_path / "b", RankSelection(ep=2, tp=2), mode="buffered", layout="rank")
    for f in sorted((tmp_path / "k").rglob("*.safetensors")):
        assert f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "k")).read_bytes()


def test_copy_fallbacks(k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cfr(*a: object) -> int:
        raise OSError(18, "cross-device")  # EXDEV
    monkeypatch.setattr(os, "copy_file_range", no_cfr)
    rs.reshard(k3_tiny, tmp_path / "s", RankSelection(ep=2, tp=2), layout="rank")
    monkeypatch.setattr(os, "sendfile", no_cfr)
    rs.reshard(k3_tiny, tmp_path / "b", RankSelection(ep=2, tp=2), layout="rank")
    check_layout(k3_tiny, tmp_path / "s", ep=2, tp=2)
    check_layout(k3_tiny, tmp_path / "b", ep=2, tp=2)


def test_gptoss_stacked_experts(gptoss_tiny: Path, tmp_path: Path) -> None:
    rs.reshard(gptoss_tiny, tmp_path / "lin", RankSelection(ep=2), layout="rank")
    m = check_layout(gptoss_tiny, tmp_path / "lin", ep=2)
    t = m[1]["tensors"]
    blocks = next(n for n in t if n.endswith("gate_up_proj_blocks"))
    assert t[blocks]["split"] == {"dim": 0, "experts": [4, 5, 6, 7], "split": None}
    assert t[blocks]["shape"][0] == 4
    rs.reshard(gptoss_tiny, tmp_path / "rr", RankSelection(ep=4, placement="round_robin"), layout="rank")
    check_layout(gptoss_tiny, tmp_path / "rr", ep=4, placement="round_robin")
    # moe_tp = 2: each expert of the stack is also split (gate_up on rows, down on input blocks)
    rs.reshard(gptoss_tiny, tmp_path / "mtp", RankSelection(ep=2, world_size=4), layout="rank")
    m = check_layout(gptoss_tiny, tmp_path / "mtp", ep=2, world_size=4)
    t = m[3]["tensors"]
    down = next(n for n in t if n.endswith("down_proj_blocks"))
    assert t[down]["split"] == {"dim": 0, "experts": [4, 5, 6, 7], "split": {"dim": 2, "index": 1, "parts": 2}}


def test_subsets(k3_tiny: Path, tmp_path: Path) -> None:
    rs.reshard(k3_tiny, tmp_path / "r", RankSelection(ep=4, tp=2, ranks="0,2-3"), layout="rank")
    check_layout(k3_tiny, tmp_path / "r", ep=4, tp=2, ranks=[0, 2, 3])
    rs.reshard(k3_tiny, tmp_path / "n", RankSelection(ep=4, tp=2, node=1, gpus_per_node=2), layout="rank")
    check_layout(k3_tiny, tmp_path / "n", ep=4, tp=2, ranks=[2, 3])
    # a second node into the same directory completes it
    rs.reshard(k3_tiny, tmp_path / "n", RankSelection(ep=4, tp=2, node=0, gpus_per_node=2), layout="rank")
    check_layout(k3_tiny, tmp_path / "n", ep=4, tp=2)


def test_max_file_size_parts(k3_tiny: Path, tmp_path: Path) -> None:
    rs.reshard(k3_tiny, tmp_path / "o", RankSelection(ep=2, tp=2), max_file_size=300_000, layout="rank")
    m = check_layout(k3_tiny, tmp_path / "o", ep=2, tp=2)
    for r, man in m.items():
        names = sorted(man["files"])
        assert len(names) > 3
        assert set(names) == {f"model-rank-{r}-part-{k}.safetensors" for k in range(len(names))}
        for fname, f in man["files"].items():
            tensors = [t for t in man["tensors"].values() if t["file"] == fname]
            assert tensors
            if len(tensors) > 1:  # only a single oversized tensor may exceed the limit
                assert f["size"] <= 300_000 + 65536


def test_ready_last_and_incomplete_rank_rewritten(k3_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    plan = rs.plan_reshard(k3_tiny, RankSelection(ep=2, tp=2), layout="rank")

    def boom(name: str) -> None:
        if name.startswith("model-rank-1-"):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        with inject_fault("reshard.file_written", boom):
            rs.run_reshard(plan, out, jobs=1)
    r1 = out / "rank-00001"
    assert not (r1 / "READY").exists() and not (r1 / "rank-manifest.json").exists()
    assert not list(r1.glob("model-*.safetensors"))  # never a partial file under a final name
    res = rs.reshard(k3_tiny, out, RankSelection(ep=2, tp=2), layout="rank")
    assert 1 in res.written
    check_layout(k3_tiny, out, ep=2, tp=2)
    for r in range(2):
        rdir = out / f"rank-{r:05d}"
        ready = (rdir / "READY").stat().st_mtime_ns
        assert all(p.stat().st_mtime_ns <= ready for p in rdir.iterdir())


def test_rerun_skips_completed_and_force_redoes(k3_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    rs.reshard(k3_tiny, out, RankSelection(ep=2, tp=2), layout="rank")
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*.safetensors")}
    res = rs.reshard(k3_tiny, out, RankSelection(ep=2, tp=2), layout="rank")
    assert res.written == [] and res.skipped == [0, 1] and res.bytes_written == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.safetensors")} == before
    # a rank whose manifest no longer matches its files is rewritten
    victim = next(iter(before))
    with open(victim, "ab") as fh:
        fh.write(b"x")
    res = rs.reshard(k3_tiny, out, RankSelection(ep=2, tp=2), layout="rank")
    assert len(res.written) == 1
    res = rs.reshard(k3_tiny, out, RankSelection(ep=2, tp=2), force=True, layout="rank")
    assert res.written == [0, 1]
    check_layout(k3_tiny, out, ep=2, tp=2)
    with pytest.raises(rs.ReshardError, match="different topology"):
        rs.reshard(k3_tiny, out, RankSelection(ep=4, tp=2), layout="rank")


def test_cli(k3_tiny: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "o"
    r = runner.invoke(main, ["reshard", str(k3_tiny), "-o", str(out), "--format", "rank", "--ep", "2", "--tp", "2", "--json",
                             "--max-file-size", "1MiB", "--jobs", "2"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["ranks_written"] == [0, 1]
    check_layout(k3_tiny, out, ep=2, tp=2)
    r = runner.invoke(main, ["reshard", str(k3_tiny), "-o", str(out), "--format", "rank", "--ep", "2", "--tp", "2",
                             "--max-file-size", "1MiB"])
    assert r.exit_code == 0 and "2 already complete" in r.output, r.output
    # another part size is another layout: the ranks are rewritten
    r = runner.invoke(main, ["reshard", str(k3_tiny), "-o", str(out), "--format", "rank", "--ep", "2", "--tp", "2"])
    assert r.exit_code == 0 and "2 ranks written" in r.output, r.output
    for args, needle in [
        (["--ep", "3", "--tp", "2"], "does not divide world size"),
        (["--tp", "3"], "does not divide"),
        (["--ep", "2", "--ranks", "0-7"], "out of range"),
        (["--ep", "2", "--node", "0"], "--gpus-per-node"),
        (["--ep", "100"], "exceeds"),
    ]:
        r = runner.invoke(main, ["reshard", str(k3_tiny), "-o", str(tmp_path / "bad"), "--format", "rank", *args])
        assert r.exit_code == 2, (args, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("k3ckpt: error:") and needle in lines[0], r.output


@pytest.mark.slow
def test_peak_rss_bounded(tmp_path: Path) -> None:
    """A moderately large synthetic (k3-small shapes, 3 layers): resharding stays far below 512 MiB."""
    src = tmp_path / "src"
    from dataclasses import replace

    from k3ckpt.testing.synth import spec_from_preset, synthesize

    # Synthesize here, reshard in a fresh process: its peak RSS is then the reshard's alone
    # (quantizing the synthetic weights has its own, unrelated peak).
    synthesize(replace(spec_from_preset("k3-small"), num_layers=3), src)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so a child of a big
    # pytest process would report the parent's high-water mark.
    code = textwrap.dedent(f"""
        from k3ckpt.deploy.reshard import reshard
        from k3ckpt.format.topology import RankSelection
        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        base = hwm()
        res = reshard({str(src)!r}, {str(tmp_path / 'out')!r}, RankSelection(ep=4, tp=2), jobs=2, layout="rank")
        print(res.bytes_written, hwm(), base)
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    nbytes, peak_kib, _ = map(int, out.stdout.split())
    assert nbytes > 100 * 2**20
    assert peak_kib * 1024 < 512 * 2**20, peak_kib


def _ready_ranks(out: Path) -> list[str]:
    return sorted(p.parent.name for p in out.glob("*/READY"))


def test_force_other_topology_removes_the_old_ranks(k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "o"
    rs.reshard(k3_tiny, out, RankSelection(ep=8), layout="rank")
    # killed while clearing the old layout: no READY of it survives, topology.json is still the old one
    real_rmtree = shutil.rmtree

    def crash(path, *a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(shutil, "rmtree", crash)
    with pytest.raises(RuntimeError):
        rs.reshard(k3_tiny, out, RankSelection(ep=4), force=True, layout="rank")
    assert _ready_ranks(out) == [] and json.loads((out / "topology.json").read_text())["ep"] == 8
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    rs.reshard(k3_tiny, out, RankSelection(ep=4), force=True, layout="rank")
    check_layout(k3_tiny, out, ep=4)  # rank-00004..7 are gone
    # per-node runs of one topology share OUT: a node's run keeps the other nodes' ranks
    rs.reshard(k3_tiny, out, RankSelection(ep=4, node=0, gpus_per_node=2), force=True, layout="rank")
    rs.reshard(k3_tiny, out, RankSelection(ep=4, node=1, gpus_per_node=2), layout="rank")
    assert _ready_ranks(out) == [f"rank-{r:05d}" for r in range(4)]
    # the hf-node layout's node directories are another topology's too
    rs.reshard(k3_tiny, out, RankSelection(ep=4, gpus_per_node=2), layout="hf-node", force=True)
    assert _ready_ranks(out) == ["node-00000", "node-00001"]
    rs.reshard(k3_tiny, out, RankSelection(ep=4), force=True, layout="rank")
    assert _ready_ranks(out) == [f"rank-{r:05d}" for r in range(4)]


def test_failed_file_keeps_later_completed_ranks(k3_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    plan = rs.plan_reshard(k3_tiny, RankSelection(ep=4, tp=2), layout="rank")

    def boom(name: str) -> None:
        if name.startswith("model-rank-0-"):
            raise rs.ReshardError(f"writing {name}: disk full")

    with pytest.raises(rs.ReshardError, match="model-rank-0-"):
        with inject_fault("reshard.file_written", boom):
            rs.run_reshard(plan, out, jobs=2)
    assert _ready_ranks(out) == [f"rank-{r:05d}" for r in range(1, 4)]
    res = rs.reshard(k3_tiny, out, RankSelection(ep=4, tp=2), layout="rank")
    assert res.written == [0] and res.skipped == [1, 2, 3]
    check_layout(k3_tiny, out, ep=4, tp=2)


def test_output_and_source_must_not_nest(k3_tiny: Path, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(k3_tiny, src)
    outer = tmp_path / "outer"
    shutil.copytree(k3_tiny, outer / "src")
    for s, o, needle in [(src, src, "is the source"), (src, src / "out", "is inside the source"),
                         (outer / "src", outer, "contains the source")]:
        with pytest.raises(rs.ReshardError, match=needle):
            rs.reshard(s, o, RankSelection(ep=2), layout="rank")
        r = CliRunner().invoke(main, ["reshard", str(s), "-o", str(o), "--format", "rank", "--ep", "2"])
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.output
    assert not (src / "out").exists() and not list(outer.glob("rank-*"))


WORKING_FILES = ["big.bin.part", "big.bin.part.journal", ".k3ckpt-fetch.lock", ".k3ckpt-fetch.lock.break",
                 "config.json.tmp", ".notes.txt.123.abcd.tmp", "sub/w.part"]


def test_working_files_are_not_copied(k3_tiny: Path, tmp_path: Path) -> None:
    import shutil

    from k3ckpt.deploy.unshard import unshard
    from k3ckpt.format.checkpoint import is_working_file

    src = tmp_path / "src"
    shutil.copytree(k3_tiny, src)
    (src / "sub").mkdir()
    for f in WORKING_FILES:
        (src / f).write_bytes(b"x")
    (src / "notes.txt").write_text("kept")
    assert all(map(is_working_file, WORKING_FILES)) and not is_working_file("notes.txt")
    for layout in ("rank", "hf-node"):
        out = tmp_path / layout
        rs.reshard(src, out, RankSelection(ep=2, gpus_per_node=2), layout=layout)
        where = out if layout == "rank" else out / "node-00000"
        assert (where / "notes.txt").read_text() == "kept"
        assert not [f for f in WORKING_FILES if (where / f).exists()]
    lay = tmp_path / "rank"
    (lay / "sub").mkdir(exist_ok=True)
    for f in WORKING_FILES:
        (lay / f).write_bytes(b"x")
    res = unshard(lay, tmp_path / "back")
    assert "notes.txt" in res.files_copied and not set(WORKING_FILES) & set(res.files_copied)


def test_copy_files_streams(tmp_path: Path) -> None:
    """A large non-weight file is copied in bounded chunks, never read whole into memory."""
    import tracemalloc

    from k3ckpt.utils import copy_files

    size = 64 * 2**20
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "big.bin", "wb") as fh:
        fh.truncate(size)
        fh.seek(size // 2)
        fh.write(b"marker")
    tracemalloc.start()
    try:
        copy_files(tmp_path / "src", ["big.bin"], tmp_path / "dst")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, peak
    assert (tmp_path / "dst" / "big.bin").read_bytes() == (tmp_path / "src" / "big.bin").read_bytes()
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["big.bin"]


def test_reshard_loads_only_what_it_uses() -> None:
    """``k3ckpt.deploy`` loads its names on first use: the reshard command's path imports
    neither the other deploy modules (planner, preflight, cost model, unshard: ~70 ms of every
    run's start-up) nor numpy, and each exported name is still its module's object."""
    import importlib

    code = ("import json, sys, click; from k3ckpt.cli import main; "
            "main.get_command(click.Context(main), 'reshard'); import k3ckpt.deploy.reshard; "
            "print(json.dumps(sorted(sys.modules)))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout))
    assert {"k3ckpt.deploy.reshard", "k3ckpt.deploy.bytecopy"} <= loaded
    others = {"k3ckpt.deploy.plan", "k3ckpt.deploy.preflight", "k3ckpt.deploy.estimate", "k3ckpt.deploy.unshard",
              "k3ckpt.deploy.serve", "numpy"}
    assert not others & loaded, sorted(others & loaded)
    deploy = importlib.import_module("k3ckpt.deploy")
    assert set(deploy.__all__) <= set(dir(deploy))
    for name in deploy.__all__:
        value = getattr(deploy, name)
        assert getattr(importlib.import_module(value.__module__), name) is value, name


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.parametrize("layout", ["rank", "node"])
def test_weight_files_are_synced_by_the_finisher_before_their_rename(k3_tiny: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     layout: str) -> None:
    """Writers do not wait for the disk (no fsync on a writer thread: they go on to the next
    file); every weight file is still fsync'd, under its temporary name, before its rename."""
    import threading

    events: list[tuple[str, str, str]] = []  # (what, path, thread)
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", _fd_path(fd), threading.current_thread().name))
        real_fsync(fd)

    def replace(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
        events.append(("replace", str(a), threading.current_thread().name))
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    sel = RankSelection(tp=2, dp=2, gpus_per_node=2) if layout == "node" else RankSelection(ep=4, tp=2)
    res = rs.reshard(k3_tiny, tmp_path / "out", sel, layout=layout, jobs=2)
    assert len(res.written) >= 2
    assert not [e for e in events if e[0] == "fsync" and e[2].startswith("reshard")], events
    weights = sorted((tmp_path / "out").glob("*/*.safetensors"))
    assert weights
    for p in weights:
        tmp = str(p.with_name(f".{p.name}.tmp"))
        synced = events.index(("fsync", tmp, "MainThread"))
        renamed = next(i for i, e in enumerate(events) if e[:2] == ("replace", tmp))
        assert synced < renamed, p


@pytest.mark.parametrize("layout", ["rank", "node"])
@pytest.mark.parametrize("step", ["manifest", "READY"])
def test_a_unit_that_fails_after_its_renames_puts_its_weights_back(
        k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, step: str) -> None:
    """A limit met after a unit's weights have their final names (writing its manifest, or
    READY's directory sync after its rename): the weights go back under temporary names and
    READY is removed, so the unit looks like any unfinished one; a re-run completes it."""
    import errno as errno_

    from k3ckpt.deploy.reshard import units

    out = tmp_path / "out"
    real_write_atomic = units.write_atomic
    failed: list[Path] = []

    def write_atomic(path: str | os.PathLike[str], data: bytes, **kw: object) -> None:
        path = Path(path)
        hit = not failed and path.parent.parent == out and (path.name == "READY") == (step == "READY")
        if hit and step == "READY":
            real_write_atomic(path, data, **kw)  # renamed into place, then its directory sync fails
        if hit:
            failed.append(path.parent)
            raise OSError(errno_.EMFILE, os.strerror(errno_.EMFILE))
        real_write_atomic(path, data, **kw)

    monkeypatch.setattr(units, "write_atomic", write_atomic)
    sel = RankSelection(tp=2, dp=2, gpus_per_node=2) if layout == "node" else RankSelection(ep=4, tp=2)
    with pytest.raises(rs.ReshardError) as ei:
        rs.reshard(k3_tiny, out, sel, layout=layout, jobs=2, check_space=False)
    assert "raise the open-files limit" in str(ei.value) and str(failed[0]) in str(ei.value)
    bad = failed[0]
    assert not (bad / "READY").exists() and not list(bad.glob("*.safetensors"))
    assert sorted(p.name for p in bad.glob(".*.safetensors.tmp"))  # kept as temporary files
    monkeypatch.setattr(units, "write_atomic", real_write_atomic)
    assert rs.reshard(k3_tiny, out, sel, layout=layout).written
    rs.reshard(k3_tiny, tmp_path / "ref", sel, layout=layout)
    for ref in sorted(p for p in (tmp_path / "ref").glob("*/*") if p.is_file()):
        assert (out / ref.relative_to(tmp_path / "ref")).read_bytes() == ref.read_bytes(), ref


@pytest.mark.parametrize("err", ["EIO", "ENOSPC", "EMFILE"])
def test_a_weight_file_that_cannot_be_synced_is_named_and_a_rerun_completes(
        k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: str) -> None:
    """The data of a weight file fails to reach the disk (the fsync before its rename): the
    error names that file, its unit gets no READY and no file under a final name, the other
    units complete, and a plain re-run completes byte-identical to a clean run."""
    import errno as errno_

    out = tmp_path / "out"
    real_fsync = os.fsync
    failed: list[str] = []

    def fsync(fd: int) -> None:
        path = _fd_path(fd)
        if not failed and path.endswith(".safetensors.tmp"):
            failed.append(path)
            code = getattr(errno_, err)
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sel = RankSelection(ep=4, tp=2)
    with pytest.raises(rs.ReshardError) as ei:
        rs.reshard(k3_tiny, out, sel, layout="rank", jobs=2, check_space=False)
    msg = str(ei.value)
    assert failed and failed[0] in msg and os.strerror(getattr(errno_, err)) in msg, msg
    assert "\n" not in msg
    if err == "EMFILE":  # the finisher words a limit as a writer does, hint included
        assert msg.startswith("writing ") and "raise the open-files limit" in msg, msg
    bad = Path(failed[0]).parent
    assert not (bad / "READY").exists() and not list(bad.glob("*.safetensors"))
    assert [d for d in out.glob("rank-*") if (d / "READY").exists()]  # the other ranks completed
    monkeypatch.setattr(os, "fsync", real_fsync)
    res = rs.reshard(k3_tiny, out, sel, layout="rank")
    assert res.written and res.skipped
    rs.reshard(k3_tiny, tmp_path / "ref", sel, layout="rank")
    for ref in sorted((tmp_path / "ref").glob("rank-*/*")):
        assert (out / ref.relative_to(tmp_path / "ref")).read_bytes() == ref.read_bytes(), ref


@pytest.mark.parametrize("caller_froze", [False, True])
def test_the_plan_is_kept_out_of_gc_passes_while_writing(k3_tiny: Path, tmp_path: Path, caller_froze: bool) -> None:
    """While files are written, the objects that existed when the run began (the plan: ~10^5
    tuples per 10^4 tensors) are frozen out of the cyclic GC's passes, and handed back after
    the run, also when it fails. A caller that froze objects itself (say, before forking) keeps
    its freeze untouched: the run neither adds to it nor unfreezes it."""
    import gc

    plan = rs.plan_reshard(k3_tiny, RankSelection(tp=2, dp=2, gpus_per_node=2))
    during: list[int] = []
    if caller_froze:
        gc.freeze()
    before = gc.get_freeze_count()
    # (the count is of frozen objects still alive: a caller's frozen temporaries that die during
    # the run lower it, so with a caller's freeze it is bounded, not equal)
    def kept() -> bool:
        count = gc.get_freeze_count()
        return 0 < count <= before if caller_froze else count == before

    try:
        rs.run_reshard(plan, tmp_path / "o", jobs=2, progress=lambda n: during.append(gc.get_freeze_count()))
        assert during and (0 < min(during) and max(during) <= before if caller_froze else min(during) > 0)
        assert kept()
        with pytest.raises(rs.ReshardError):  # a failed run hands the objects back too
            with inject_fault("reshard.file_written", _fail):
                rs.run_reshard(plan, tmp_path / "o", jobs=2, force=True)
        assert kept()
    finally:
        gc.unfreeze()


def _fail(name: str) -> None:
    raise rs.ReshardError(f"{name}: injected")


def test_rank_manifest_bytes_are_json_dumps_of_the_layout(k3_tiny: Path, gptoss_tiny: Path) -> None:
    """A rank manifest's tensor entries are written from columns, not walked as one dict each:
    the bytes are exactly json.dumps of the layout with every digest added (whole tensors, TP
    cuts, stacked expert slices with their split, several parts per rank)."""
    for src, sel in ((k3_tiny, RankSelection(ep=4, tp=2)), (gptoss_tiny, RankSelection(ep=2, world_size=4))):
        plan = rs.plan_reshard(src, sel, layout="rank", max_file_size=300_000)
        for rp in plan.units:
            results = [{"segments_sha256": hashlib.sha256(f.name.encode()).hexdigest(), "size": f.size,
                        "tensors": {t.name: hashlib.sha256(t.name.encode()).hexdigest() for t in f.tensors}}
                       for f in rp.files]
            want = rp.layout()
            want["source_index_sha256"] = plan.source_json["index_sha256"]
            for f, res in zip(rp.files, results):
                want["files"][f.name].update(size=res["size"], segments_sha256=res["segments_sha256"])
                for name, digest in res["tensors"].items():
                    want["tensors"][name]["sha256"] = digest
            assert rp.final_files(results, plan.source_json) == {"rank-manifest.json": (json.dumps(want) + "\n").encode()}
        assert any(len(rp.files) > 1 for rp in plan.units)
        assert any(t.split is not None for rp in plan.units for f in rp.files for t in f.tensors)
