"""Rank-aware fetch (k3ckpt/rankfetch.py, ``k3ckpt fetch --ep/--tp/--ranks/--node``) against the
loopback hub, in ``--format partial`` (the hub's shards rewritten; ``tests/test_nodefetch.py``
has ``--format node``): only the selected ranks' share moves (counted by the emulator), the output is a
checkpoint that verify accepts and that reshards byte-for-byte like the full one, tensor-hash
manifests catch corruption and refuse a manifest of other headers, SIGKILL + resume.

The selection under test is node 0 of ``--ep 8 --tp 2 --gpus-per-node 4`` over k3-tiny (16
experts): ranks 0-3, experts 0-7 of every MoE layer, every dense tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckpt_edit import flip_byte, tree_digests
from helpers import REPO, assert_one_line_error, hub_offline, kill_at_pause, run
from k3ckpt.cli import main
from k3ckpt.deploy.reshard import reshard
from k3ckpt.errors import SafetensorsHeaderError
from k3ckpt.format.checkpoint import INDEX_NAME, open_checkpoint
from k3ckpt.format.header import read_header
from k3ckpt.format.roles import Kind, classify
from k3ckpt.format.topology import RankSelection
from k3ckpt.hub import download
from k3ckpt.hub.client import HubFile
from k3ckpt.hub.rankfetch import PARTIAL_NAME, plan_rank_fetch, plan_shard, run_rank_fetch
from k3ckpt.integrity.manifest import build_manifest
from k3ckpt.integrity.verify import verify_checkpoint

NODE0 = ("--ep", "8", "--tp", "2", "--node", "0", "--gpus-per-node", "4")
CHUNK = 16 * 1024  # small enough that the shards need several requests, and big tensors several pieces


def fetch(h: Any, dest: Path, *extra: str, source: str = "hf") -> Any:
    return run("fetch", "--source", source, "--repo", REPO, "--dest", str(dest), "--endpoint", h.url,
               "--chunk-size", str(CHUNK), "--workers", "3", *NODE0, "--format", "partial", *extra)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def node0_names(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """What node 0 holds, by an independent route: the union of a full reshard's rank manifests."""
    out = tmp_path_factory.mktemp("full-node0")
    reshard(k3_tiny, out, RankSelection(ep=8, tp=2, node=0, gpus_per_node=4), layout="rank")
    names: set[str] = set()
    for m in out.glob("rank-*/rank-manifest.json"):
        names.update(json.loads(m.read_text())["tensors"])
    return names


@pytest.fixture(scope="module")
def tensor_manifest(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("manifest") / "k3-tiny.json"
    build_manifest(k3_tiny, tensor_hashes=True).save(path)
    return path


def expected_bytes(served: Path, names: set[str]) -> dict[str, int]:
    """Bytes the hub must send per file: the index, config and every header to plan; then the
    selected tensors of each shard (a shard wholly selected: the whole file), config again and
    every other file once."""
    out: dict[str, int] = {}
    for p in sorted(served.iterdir()):
        if p.suffix == ".safetensors":
            h = read_header(p)
            kept = [t for n, t in h.tensors.items() if n in names]
            out[p.name] = h.data_start + (p.stat().st_size if len(kept) == len(h.tensors) else sum(t.nbytes for t in kept))
        elif p.name in (INDEX_NAME, "config.json"):
            out[p.name] = p.stat().st_size * (2 if p.name == "config.json" else 1)
        else:
            out[p.name] = p.stat().st_size
    return out


# ----------------------------------------------------------------------------------------------
# planning
# ----------------------------------------------------------------------------------------------


def test_plan_shard_rewrites_header_and_coalesces_adjacent_tensors(k3_tiny: Path, node0_names: set[str]) -> None:
    path = k3_tiny / "model-00002-of-000008.safetensors"
    h = read_header(path)
    entry = HubFile(path.name, path.stat().st_size, None, None)
    sp = plan_shard(h, entry, node0_names, CHUNK)
    assert sp is not None and not sp.whole
    kept = sorted((t for n, t in h.tensors.items() if n in node0_names), key=lambda t: t.begin)
    assert sp.names == [t.name for t in kept] and 0 < len(kept) < len(h.tensors)
    assert sp.tensor_bytes == sum(t.nbytes for t in kept) and sp.size == len(sp.prefix) + sp.tensor_bytes
    assert len(sp.prefix) % 8 == 0  # the data buffer starts 8-byte aligned
    # pieces: at most a chunk, never across a gap in the source, tiling the output's data exactly
    assert all(0 < p.length <= CHUNK for p in sp.pieces)
    assert sum(p.length for p in sp.pieces) == sp.tensor_bytes
    assert [p.dst for p in sp.pieces] == sorted(p.dst for p in sp.pieces)
    src_of = {t.name: h.data_start + t.begin for t in kept}
    for task in sp.tasks:
        start = task.tensors[0][1]
        for name, b, e in task.tensors:
            assert b == start and e - b == h.tensors[name].nbytes
            start = e
        pieces = [sp.pieces[i] for i in task.pieces]
        assert sum(p.length for p in pieces) == start - task.tensors[0][1]
        # each piece reads the source exactly where its tensors are
        first = task.tensors[0][0]
        assert pieces[0].src == src_of[first] and pieces[0].dst == task.tensors[0][1]
    # a rank's expert run (adjacent in the source) costs fewer requests than it has tensors
    assert len(sp.pieces) < len(kept)
    # a tensor bigger than a chunk is one task of several pieces
    big = [t for t in sp.tasks if len(t.pieces) > 1]
    assert big and all(len(t.tensors) == 1 for t in big)
    # the same plan with a chunk larger than the shard: one request per contiguous run
    one = plan_shard(h, entry, node0_names, 1 << 30)
    assert one is not None and len(one.pieces) <= len(sp.pieces) and one.prefix == sp.prefix
    assert plan_shard(h, entry, set(h.tensors), CHUNK).whole  # type: ignore[union-attr]
    assert plan_shard(h, entry, set(), CHUNK) is None


# ----------------------------------------------------------------------------------------------
# the share moved, the output accepted
# ----------------------------------------------------------------------------------------------


def test_node0_moves_only_its_share_and_reshards_identically(served_hub: Any, k3_tiny: Path, node0_names: set[str],
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h, served = served_hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    h.reset_counters()
    dest = tmp_path / "node0"
    res = fetch(h, dest)
    assert res.exit_code == 0, res.output
    # no --manifest: said plainly, and never "ok" (#25: the bytes assembled from tensors are unproven)
    assert res.output.startswith("not proven: ") and "only structure and sizes" not in res.output
    assert "not proven: no --manifest: the files assembled from tensors were checked for structure and sizes " \
           "only" in res.output

    want = expected_bytes(served, node0_names)
    sent = {f: h.bytes_sent(f) for f in want}
    assert sent == want
    assert h.total_bytes_sent() == sum(want.values())
    assert json.loads(fetch(h, dest, "--json").output)["proven"] is False  # (a re-run: all present)

    # a valid checkpoint of exactly those tensors, byte for byte the source's
    ckpt = open_checkpoint(dest)
    src = open_checkpoint(served)
    assert set(ckpt.tensors) == node0_names and not ckpt.problems
    for name in node0_names:
        assert (ckpt.tensors[name].dtype, ckpt.tensors[name].shape) == (src.tensors[name].dtype, src.tensors[name].shape)
        assert ckpt.read_tensor(name).tobytes() == src.read_tensor(name).tobytes(), name
    experts = {classify(n).expert for n in ckpt.tensors if classify(n).kind == Kind.ROUTED_EXPERT}
    assert experts == set(range(8))

    def routed(c: Any) -> int:
        return sum(t.nbytes for n, t in c.tensors.items() if classify(n).kind == Kind.ROUTED_EXPERT)

    assert 2 * routed(ckpt) == routed(src) > 0  # half the experts stored, and moved
    index = json.loads((dest / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ckpt.tensors.values())
    for f in ("config.json", "tokenizer_config.json", "LICENSE"):
        assert sha(dest / f) == sha(served / f)
    marker = json.loads((dest / PARTIAL_NAME).read_text())
    assert marker["ranks"] == [0, 1, 2, 3] and marker["topology"]["ep"] == 8
    assert marker["verification"] == "structure-and-sizes" and marker["source"]["repo"] == REPO
    assert marker["experts"] == list(range(8))

    rep = verify_checkpoint(dest)
    assert rep.ok, [str(i) for i in rep.issues]
    assert run("verify", str(dest)).exit_code == 0

    # reshard of the partial checkpoint == reshard of the full one, for these ranks
    a, b = tmp_path / "rs-partial", tmp_path / "rs-full"
    for src_dir, out in ((dest, a), (k3_tiny, b)):
        r = run("reshard", str(src_dir), "-o", str(out), "--format", "rank", *NODE0)
        assert r.exit_code == 0, r.output
    for rank in range(4):
        ra, rb = a / f"rank-{rank:05d}", b / f"rank-{rank:05d}"
        files = sorted(p.name for p in rb.glob("*.safetensors"))
        assert files and files == sorted(p.name for p in ra.glob("*.safetensors"))
        for f in files:
            assert (ra / f).read_bytes() == (rb / f).read_bytes(), (rank, f)
        ma, mb = (json.loads((d / "rank-manifest.json").read_text()) for d in (ra, rb))
        assert ma["tensors"] == mb["tensors"] and ma["files"] == mb["files"]
    # the source's marker is not copied as if it described the output; the revision is recorded
    assert not (a / PARTIAL_NAME).exists()
    topo = json.loads((a / "topology.json").read_text())
    assert topo["source"]["repo"] == REPO and topo["source"]["revision"] == marker["source"]["revision"]
    # ...and a rank whose experts were not fetched is refused, not written without them
    r = CliRunner().invoke(main, ["reshard", str(dest), "-o", str(tmp_path / "rs-node1"), "--format", "rank",
                                  "--ep", "8", "--tp", "2",
                                  "--node", "1", "--gpus-per-node", "4"])
    assert r.exit_code == 2 and "rank 4 needs routed experts 8-9" in r.output
    assert not (tmp_path / "rs-node1" / "rank-00004").exists()
    r = CliRunner().invoke(main, ["reshard", str(dest), "-o", str(tmp_path / "hf-node1"), "--ep", "8", "--tp", "2",
                                  "--node", "1", "--gpus-per-node", "4", "--format", "hf-node"])
    assert r.exit_code == 2 and "node 1 needs routed experts 8-15" in r.output

    # a second run moves nothing and leaves everything as it was
    before = tree_digests(dest)
    h.reset_counters()
    again = fetch(h, dest, "--json")
    data = json.loads(again.output)
    assert again.exit_code == 0 and data["bytes_downloaded"] == 0 and data["written"] == []
    assert len(data["skipped"]) == 4 and data["verification"] == "structure-and-sizes" and "note" in data
    assert tree_digests(dest) == before


def test_modelscope_gives_the_same_bytes(served_hub: Any, node0_names: set[str], tmp_path: Path) -> None:
    h, served = served_hub
    hf_dest, ms_dest = tmp_path / "hf", tmp_path / "ms"
    assert fetch(h, hf_dest).exit_code == 0
    h.reset_counters()
    res = fetch(h, ms_dest, "--json", source="modelscope")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["hub"] == "modelscope" and data["ok"] and len(data["written"]) == 4
    assert h.total_bytes_sent() == sum(expected_bytes(served, node0_names).values())
    a, b = tree_digests(hf_dest), tree_digests(ms_dest)
    marker_a, marker_b = (json.loads((d / PARTIAL_NAME).read_text()) for d in (hf_dest, ms_dest))
    assert marker_b["source"]["hub"] == "modelscope"
    del a[PARTIAL_NAME], b[PARTIAL_NAME]
    assert a == b


# ----------------------------------------------------------------------------------------------
# verification against a tensor-hash manifest
# ----------------------------------------------------------------------------------------------


def test_manifest_verifies_every_tensor_and_refetches_a_corrupt_range_once(
        served_hub: Any, tensor_manifest: Path, tmp_path: Path) -> None:
    h, served = served_hub
    shard = "model-00003-of-000008.safetensors"
    hdr = read_header(served / shard)
    expert = next(n for n in hdr.tensors if ".experts.3.w2.weight_packed" in n)
    h.inject("corrupt_byte", shard, times=1, offset=hdr.absolute_range(expert)[0] + 5)
    dest = tmp_path / "d"
    res = fetch(h, dest, "--manifest", str(tensor_manifest), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    rewritten = sum(len(plan.names) for plan in _plan(h, dest, tensor_manifest).shards if not plan.whole)
    assert data["verification"] == "tensor-sha256" and data["tensors_verified"] == rewritten and "note" not in data
    assert json.loads((dest / PARTIAL_NAME).read_text())["verification"] == "tensor-sha256"
    src = open_checkpoint(served)
    assert open_checkpoint(dest).read_tensor(expert).tobytes() == src.read_tensor(expert).tobytes()
    # the corrupt range was fetched twice, nothing else was
    assert h.bytes_sent(shard) > expected_bytes(served, set(open_checkpoint(dest).tensors))[shard]
    text = fetch(h, tmp_path / "d2", "--manifest", str(tensor_manifest))
    assert text.exit_code == 0 and "tensors verified against the manifest" in text.output
    assert "structure and sizes only" not in text.output


def test_a_partial_fetched_with_a_manifest_is_proven_until_its_bytes_change(
        served_hub: Any, tensor_manifest: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#25: every tensor of the rewritten shards was hashed against the manifest as it arrived, so
    ``verify --quick`` and ``preflight`` say proven by that manifest (not "checked by size only");
    a shard touched since carries no proof, and an offline re-run with --manifest proves it again."""
    h, _ = served_hub
    dest = tmp_path / "d"
    assert fetch(h, dest, "--manifest", str(tensor_manifest)).exit_code == 0
    res = run("verify", str(dest), "--quick")
    proof = res.output.splitlines()[-1]  # the files fetched whole by the hub's sha256, the rest by the manifest
    assert res.exit_code == 0 and res.output.startswith("ok: ") and proof.startswith("proven by hub sha256 of hf:")
    assert proof.endswith(f"; manifest {tensor_manifest}"), proof
    pre = run("preflight", str(dest), *NODE0, "--require-proof")
    assert pre.exit_code == 0 and "ready to load" in pre.output, pre.output
    shard = next(sp.path for sp in _plan(h, dest, tensor_manifest).shards if not sp.whole)
    os.utime(dest / shard)  # same bytes, but nothing vouches for what is there now
    res = run("verify", str(dest), "--quick")
    assert res.output.startswith("not proven: ") and shard in res.output, res.output
    assert run("preflight", str(dest), *NODE0, "--require-proof").exit_code == 1
    hub_offline(monkeypatch)
    assert fetch(h, dest, "--manifest", str(tensor_manifest)).exit_code == 0
    res = run("verify", str(dest), "--quick")
    assert res.exit_code == 0 and res.output.splitlines()[-1] == proof, res.output


def _plan(h: Any, dest: Path, manifest: Path | None = None) -> Any:
    return plan_rank_fetch("hf", REPO, dest, RankSelection(ep=8, tp=2, node=0, gpus_per_node=4), endpoint=h.url,
                           token="", manifest=manifest, chunk_size=CHUNK)


def test_persistent_corruption_fails_the_shard_naming_the_tensor(served_hub: Any, tensor_manifest: Path,
                                                                 tmp_path: Path) -> None:
    h, served = served_hub
    shard = "model-00004-of-000008.safetensors"
    hdr = read_header(served / shard)
    expert = next(n for n in hdr.tensors if ".experts.1.w1.weight_scale" in n)
    h.inject("corrupt_byte", shard, times=None, offset=hdr.absolute_range(expert)[0])
    dest = tmp_path / "d"
    res = fetch(h, dest, "--manifest", str(tensor_manifest))
    assert res.exit_code == 1
    assert res.output.startswith("FAILED: ")
    line = next(x for x in res.output.splitlines() if x.startswith(f"  could not fetch {shard}"))
    assert f"tensor {expert!r}: sha256" in line and "also after re-fetching its bytes" in line
    assert not (dest / shard).exists()  # never under its final name
    assert not (dest / INDEX_NAME).exists() and not (dest / PARTIAL_NAME).exists()
    assert (dest / "model-00002-of-000008.safetensors").exists()  # the other shards completed


def test_manifest_of_other_headers_is_refused_before_any_tensor_byte(served_hub: Any, tensor_manifest: Path,
                                                                     tmp_path: Path) -> None:
    h, served = served_hub
    doc = json.loads(tensor_manifest.read_text())
    name = next(n for n in sorted(doc["tensors"]) if ".experts.0.w1.weight_packed" in n)
    doc["tensors"][name]["offsets"] = [doc["tensors"][name]["offsets"][0] + 16, doc["tensors"][name]["offsets"][1] + 16]
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(doc))
    h.reset_counters()
    res = fetch(h, tmp_path / "d", "--manifest", str(bad))
    assert res.exit_code == 2
    assert res.output.count("\n") == 1 and res.output.startswith("k3ckpt: error: manifest ")
    assert f"tensor {name!r}: offsets" in res.output and "another checkpoint or revision" in res.output
    planning = sum(read_header(p).data_start for p in served.glob("*.safetensors"))
    planning += (served / INDEX_NAME).stat().st_size + (served / "config.json").stat().st_size
    assert h.total_bytes_sent() == planning
    assert not (tmp_path / "d").exists()

    no_hashes = tmp_path / "plain.json"
    build_manifest(served).save(no_hashes)
    res = fetch(h, tmp_path / "d", "--manifest", str(no_hashes))
    assert res.exit_code == 2 and "has no tensor hashes" in res.output


@pytest.mark.parametrize("change", ["dtype", "shape", "file", "offsets", "missing", "extra"])
def test_a_manifest_differing_in_any_column_is_refused(served_hub: Any, tensor_manifest: Path, tmp_path: Path,
                                                       change: str) -> None:
    """The manifest is compared with the hub's headers column by column (file, dtype, shape,
    offsets, the set of names): a difference in any one is found and named."""
    h, _ = served_hub
    doc = json.loads(tensor_manifest.read_text())
    name = next(n for n in sorted(doc["tensors"]) if ".experts.1.w2.weight_packed" in n)
    entry = doc["tensors"][name]
    if change == "dtype":
        entry["dtype"] = "I8" if entry["dtype"] != "I8" else "U8"
    elif change == "shape":
        entry["shape"] = [entry["shape"][0] * 2, entry["shape"][1] // 2]  # the same bytes, another shape
    elif change == "file":
        entry["file"] = next(f for f in sorted(doc["files"]) if f.endswith(".safetensors") and f != entry["file"])
    elif change == "offsets":
        entry["offsets"] = [entry["offsets"][0] - 2, entry["offsets"][1] - 2]
    elif change == "missing":
        del doc["tensors"][name]
    else:
        doc["tensors"][name + "_extra"] = dict(entry)
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps(doc))
    res = fetch(h, tmp_path / "d", "--manifest", str(bad))
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "another checkpoint or revision" in res.output
    if change in ("dtype", "shape", "file", "offsets"):
        assert f"tensor {name!r}: {change} " in res.output
    elif change == "missing":
        assert f"tensor {name!r} (" in res.output and "is not in the manifest" in res.output
    else:
        assert f"tensor {name + '_extra'!r} is in no shard header" in res.output
    assert not (tmp_path / "d").exists()


def test_shard_headers_are_read_while_the_index_arrives(served_hub: Any, tmp_path: Path) -> None:
    """Planning reads the top-level shards' headers while the index (~45 MB at K3's scale) is on
    its way, not after it: with the index's body stalled for two seconds, every shard's header is
    asked for before the stall ends - and the plan is the one a reading in turn makes."""
    h, served = served_hub
    shards = sorted(p.name for p in served.glob("*.safetensors"))
    h.inject("stall", INDEX_NAME, times=1, after=64, seconds=2.0)
    stalled = _plan(h, tmp_path / "d")
    index_asked = min(r.started for r in h.request_log if r.file == INDEX_NAME)
    header_asked = {r.file: r.started for r in h.request_log if r.file in shards and r.range == "bytes=0-7"}
    assert sorted(header_asked) == shards
    assert max(header_asked.values()) < index_asked + 1.5, (index_asked, header_asked)
    plain = _plan(h, tmp_path / "d")
    assert stalled.to_json() == plain.to_json()


def test_a_broken_safetensors_file_the_index_does_not_name_does_not_stop_the_plan(k3_tiny: Path,
                                                                                  tmp_path: Path) -> None:
    """A top-level ``.safetensors`` file outside the index has its header read with the shards'
    (planning cannot know it is not one before the index arrives), and its failure is not the
    plan's: only the index's shards count. A broken shard the index names still stops it."""
    from k3ckpt.testing.hub import LoopbackHub

    served = tmp_path / "served"
    shutil.copytree(k3_tiny, served)
    (served / "stray.safetensors").write_bytes(b"not a safetensors file at all")
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "hub-cache") as h:
        plan = _plan(h, tmp_path / "d")
        assert "stray.safetensors" not in {s.path for s in plan.shards}
        assert any(r.file == "stray.safetensors" and r.range == "bytes=0-7" for r in h.request_log)
        shard = "model-00003-of-000008.safetensors"
        raw = (served / shard).read_bytes()
        (served / shard).write_bytes((10**12).to_bytes(8, "little") + raw[8:])  # a length no header has
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "hub-cache2") as h:
        with pytest.raises(SafetensorsHeaderError, match=f"{shard}: header length {10**12} exceeds"):
            _plan(h, tmp_path / "d")


def test_manifest_rechecks_complete_shards_and_refetches_a_damaged_one(served_hub: Any, tensor_manifest: Path,
                                                                      tmp_path: Path) -> None:
    h, served = served_hub
    dest = tmp_path / "d"
    assert fetch(h, dest, "--manifest", str(tensor_manifest)).exit_code == 0
    shard = "model-00005-of-000008.safetensors"
    hdr = read_header(dest / shard)
    name = next(n for n in hdr.tensors if ".experts.6.w3.weight_packed" in n)
    at = hdr.absolute_range(name)[0] + 3
    with open(dest / shard, "r+b") as f:  # damage one byte of a complete shard, keep its size
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    # structure and sizes cannot see it: the shard is taken as complete
    plain = json.loads(fetch(h, dest, "--json").output)
    assert plain["skipped"] == sorted(plain["skipped"]) and shard in plain["skipped"] and plain["bytes_downloaded"] == 0
    # the tensor hashes can: only that shard is fetched again
    h.reset_counters()
    checked = json.loads(fetch(h, dest, "--manifest", str(tensor_manifest), "--json").output)
    assert checked["ok"] and checked["written"] == [shard] and shard not in checked["skipped"]
    assert checked["bytes_downloaded"] == sum(t.nbytes for t in hdr.tensors.values())
    assert open_checkpoint(dest).read_tensor(name).tobytes() == open_checkpoint(served).read_tensor(name).tobytes()


def test_disk_space_checked_before_any_tensor_byte(served_hub: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import namedtuple


    h, served = served_hub
    plan = _plan(h, tmp_path / "d")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    h.reset_counters()
    with pytest.raises(download.DiskSpaceError) as ei:
        run_rank_fetch(plan, token="")
    needed = sum(sp.size for sp in plan.shards) + sum(plan.listing.files[f].size for f in plan.files)
    assert f"need {needed} bytes" in str(ei.value) and "only 1000 bytes" in str(ei.value)
    # and the destination it created is gone again, ownership record and all (issue #25)
    assert h.total_bytes_sent() == 0 and not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------------------------
# dry run, usage errors
# ----------------------------------------------------------------------------------------------


def test_dry_run_lists_bytes_and_fetches_only_headers(served_hub: Any, node0_names: set[str], tmp_path: Path) -> None:
    h, served = served_hub
    h.reset_counters()
    dest = tmp_path / "d"
    res = fetch(h, dest, "--dry-run")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    want = expected_bytes(served, node0_names)
    selection = sum(want.values()) - sum(read_header(p).data_start for p in served.glob("*.safetensors")) \
        - (served / INDEX_NAME).stat().st_size - (served / "config.json").stat().st_size
    assert any(line.startswith("would fetch ") and "ranks 0-3 of ep 8 x tp 2" in line for line in lines)
    assert sum("model-0000" in line for line in lines) == 8 and "(whole)" in res.output
    assert lines[-1].startswith("note: no --manifest")
    assert not dest.exists()
    js = fetch(h, dest, "--dry-run", "--json", "--exclude", "LICENSE")
    data = json.loads(js.output)
    assert data["excluded"] == ["LICENSE"] and "LICENSE" not in data["files"]
    selection -= (served / "LICENSE").stat().st_size
    assert data["bytes_total"] == selection and data["source_bytes"] == sum(p.stat().st_size for p in served.iterdir())
    assert data["tensors"] == len(node0_names) and data["ranks"] == [0, 1, 2, 3]
    assert sum(s["bytes"] for s in data["shards"].values()) + sum(data["files"].values()) == selection
    # the dry runs read the index, the config and the headers: nothing else
    planning = sum(read_header(p).data_start for p in served.glob("*.safetensors"))
    planning += (served / INDEX_NAME).stat().st_size + (served / "config.json").stat().st_size
    assert h.total_bytes_sent() == 2 * planning


@pytest.mark.parametrize("args, message", [
    (("--ep", "8"), "needs --ranks or --node"),
    (("--manifest", "m.json"), "--manifest is for a rank-aware fetch"),
    (("--gpus-per-node", "4"), "--gpus-per-node is for a rank-aware fetch"),
])
def test_rank_options_usage_errors(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["fetch", "--source", "hf", "--repo", REPO, "--dest", str(tmp_path), *args])
    assert res.exit_code == 2 and message in res.output


def test_impossible_selection_is_one_line(served_hub: Any, tmp_path: Path) -> None:
    h, _ = served_hub
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(tmp_path / "d"), "--endpoint", h.url,
              "--ep", "8", "--ranks", "0-9")
    assert res.exit_code == 2 and res.output == "k3ckpt: error: --ranks '0-9': rank 9 out of range 0..7 (world size 8)\n"
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(tmp_path / "d"), "--endpoint", h.url,
              "--ep", "32", "--ranks", "0")
    assert res.exit_code == 2 and "ep 32 exceeds 16 experts" in res.output


# ----------------------------------------------------------------------------------------------
# verify on partial checkpoints
# ----------------------------------------------------------------------------------------------


def test_verify_requires_the_markers_experts(served_hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h, _ = served_hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    dest = tmp_path / "d"
    assert fetch(h, dest).exit_code == 0
    marker = json.loads((dest / PARTIAL_NAME).read_text())
    marker["experts"] = list(range(10))
    (dest / PARTIAL_NAME).write_text(json.dumps(marker))
    rep = verify_checkpoint(dest)
    assert len(rep.problems) == 4
    assert all(i.kind == "config" and f"layer {layer}" in str(i) and "8, 9" in str(i)
               for layer, i in zip(range(1, 5), rep.problems)), [str(i) for i in rep.problems]
    (dest / PARTIAL_NAME).unlink()  # without the marker it is a checkpoint missing half its experts
    rep = verify_checkpoint(dest)
    assert len(rep.problems) == 4 and all("8 of 16 routed experts missing" in str(i) for i in rep.problems)
    (dest / PARTIAL_NAME).write_text("{not json")
    rep = verify_checkpoint(dest)
    assert any(PARTIAL_NAME in f"{i.file} {i.message}" and "not valid JSON" in i.message for i in rep.problems)


# ----------------------------------------------------------------------------------------------
# crash and resume
# ----------------------------------------------------------------------------------------------

_CHILD = """
import sys
from k3ckpt.format.topology import RankSelection
from k3ckpt.hub.rankfetch import plan_rank_fetch, run_rank_fetch
url, repo, dest, chunk = sys.argv[1:5]
plan = plan_rank_fetch("hf", repo, dest, RankSelection(ep=8, tp=2, node=0, gpus_per_node=4), endpoint=url, token="",
                       chunk_size=int(chunk))
sys.exit(0 if run_rank_fetch(plan, workers=3, token="").ok else 1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["after_piece:5", "before_shard_rename"])
def test_sigkill_then_resume(point: str, served_hub: Any, node0_names: set[str], tmp_path: Path) -> None:
    h, served = served_hub
    dest = tmp_path / "d"
    kill_at_pause(_CHILD, [h.url, REPO, str(dest), str(CHUNK)], point, tmp_path)

    assert not (dest / INDEX_NAME).exists() and not (dest / PARTIAL_NAME).exists()
    assert (dest / download.LOCK_NAME).exists()  # the dead run's lock: stale, must be recovered
    # every whole file was fetched before the rewritten shards started
    assert all((dest / f).exists() for f in ("config.json", "model-00001-of-000008.safetensors"))
    # Another worker may have been killed between creating a .part (header written, fsync-ed) and
    # its first journal: a legal state, which resume treats as untrusted and recreates.
    parts = [p for p in dest.glob("*.safetensors.part") if Path(f"{p}.journal").exists()]
    assert parts
    assert all(json.loads(Path(f"{p}.journal").read_text()).get("fingerprint") for p in parts)  # ours
    if point == "before_shard_rename":
        done = [p for p in parts if json.loads(Path(f"{p}.journal").read_text())["done"]]
        assert done  # a complete .part waits for its rename: not under its final name

    plan = plan_rank_fetch("hf", REPO, dest, RankSelection(ep=8, tp=2, node=0, gpus_per_node=4), endpoint=h.url,
                           token="", chunk_size=CHUNK)
    res = run_rank_fetch(plan, workers=3, token="")
    assert res.ok, res.failed
    partial = sum(sp.tensor_bytes for sp in plan.shards if not sp.whole)
    resumed_partial = res.bytes_downloaded - sum(h.files(REPO)[f].size for f in res.fetched)
    assert resumed_partial < partial  # the journaled pieces were not fetched again
    assert not list(dest.glob("*.part")) and not list(dest.glob("*.journal"))
    assert not (dest / download.LOCK_NAME).exists()

    clean = tmp_path / "clean"
    assert run_rank_fetch(_plan(h, clean), workers=3, token="").ok
    assert tree_digests(dest) == tree_digests(clean)
    assert set(open_checkpoint(dest).tensors) == node0_names


def test_journal_of_another_selection_is_discarded(served_hub: Any, tmp_path: Path) -> None:
    h, served = served_hub
    dest = tmp_path / "d"
    shard = "model-00002-of-000008.safetensors"
    plan = _plan(h, dest)
    sp = next(s for s in plan.shards if s.path == shard)
    dest.mkdir()
    (dest / f"{shard}.part").write_bytes(b"\0" * sp.size)
    doc = {"version": 1, "path": shard, "fingerprint": "0" * 64, "size": sp.size, "done": list(range(len(sp.pieces)))}
    (dest / f"{shard}.part.journal").write_text(json.dumps(doc))
    res = run_rank_fetch(plan, workers=2, token="")
    assert res.ok and shard in res.written
    assert open_checkpoint(dest).read_tensor(sp.names[0]).tobytes() == open_checkpoint(served).read_tensor(sp.names[0]).tobytes()


# ----------------------------------------------------------------------------------------------
# other families
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, verification", [("k2_tiny", "structure-and-sizes"), ("gptoss_tiny", "file-sha256")])
def test_other_families_reshard_identically(family: str, verification: str, request: pytest.FixtureRequest,
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kimi-K2 (per-expert FP8 with block scales): experts of other ranks are left out. gpt-oss
    (all experts stacked in one tensor per projection): every tensor is needed whole, so every
    shard is fetched whole and checked against the hub's sha256."""
    from k3ckpt.testing.hub import LoopbackHub

    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    src: Path = request.getfixturevalue(family)
    with LoopbackHub({REPO: src}, cache_dir=tmp_path / "hub-cache") as h:
        dest = tmp_path / "d"
        plan = plan_rank_fetch("hf", REPO, dest, RankSelection(ep=4, ranks="0-1"), endpoint=h.url, token="",
                               chunk_size=CHUNK)
        res = run_rank_fetch(plan, workers=2, token="")
        assert res.ok, res.failed
        assert res.verification == plan.verification == verification
        assert (plan.bytes_total < plan.source_bytes) and (any(not s.whole for s in plan.shards) == (family == "k2_tiny"))
    assert verify_checkpoint(dest).ok
    a, b = tmp_path / "a", tmp_path / "b"
    reshard(dest, a, RankSelection(ep=4, ranks="0-1"), layout="rank")
    reshard(src, b, RankSelection(ep=4, ranks="0-1"), layout="rank")
    for rank in (0, 1):
        files = sorted((b / f"rank-{rank:05d}").glob("*.safetensors"))
        assert files
        for f in files:
            assert (a / f"rank-{rank:05d}" / f.name).read_bytes() == f.read_bytes()


def test_a_new_hub_revision_refetches_shards_whose_source_changed(k3_tiny: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a manifest, size and header cannot tell a shard of the hub's current revision from
    one of an earlier revision with the same header: the record of what each was written from can."""
    from k3ckpt.testing.hub import LoopbackHub

    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    served = tmp_path / "served"
    shutil.copytree(k3_tiny, served)
    dest = tmp_path / "dest"
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "hc1") as h:
        assert fetch(h, dest).exit_code == 0
    rewritten = sorted(p.name for p in dest.glob("*.safetensors") if p.stat().st_size != (served / p.name).stat().st_size)
    assert rewritten
    # the publisher changes one byte of a selected tensor: same header, new content, new commit
    shard = served / rewritten[0]
    mine = read_header(dest / rewritten[0])
    name = next(iter(mine.tensors))
    src = read_header(shard)
    data = bytearray(shard.read_bytes())
    data[src.data_start + src.tensors[name].begin] ^= 0xFF
    shard.write_bytes(bytes(data))
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "hc2") as h:
        res = fetch(h, dest, "--json")
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
    assert out["written"] == [rewritten[0]] and rewritten[0] not in out["skipped"]
    got = open_checkpoint(dest).read_tensor(name).tobytes()
    assert got == open_checkpoint(served).read_tensor(name).tobytes()


def test_whole_files_must_match_the_manifest_not_just_the_hub(k3_tiny: Path, tensor_manifest: Path,
                                                             tmp_path: Path) -> None:
    """The downloader checks whole files against the hub's listing; with a manifest, the listing
    must agree with the manifest - a hub serving other bytes under a listing that vouches for them
    does not get past the operator's manifest."""
    from k3ckpt.testing.hub import LoopbackHub

    served = tmp_path / "served"
    shutil.copytree(k3_tiny, served)
    # remote code, a small file the hub lists by git blob id only: checked against the manifest
    # after the download (same size, one byte changed: nothing at plan time can tell)
    code = served / "configuration_kimi_k3.py"
    data = bytearray(code.read_bytes())
    data[-2] = ord("#") if data[-2] != ord("#") else ord(" ")
    code.write_bytes(bytes(data))
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "hc1") as h:  # its listing vouches for the new bytes
        res = fetch(h, tmp_path / "a", "--manifest", str(tensor_manifest))
    assert res.exit_code == 1, res.output
    assert "could not fetch configuration_kimi_k3.py" in res.output and "differs from the manifest's" in res.output
    assert not (tmp_path / "a" / code.name).exists() and not (tmp_path / "a" / PARTIAL_NAME).exists()
    # a file whose size differs is refused at plan time, before any byte moves
    (served / "generation_config.json").write_text("{}")
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "hc2") as h:
        res = fetch(h, tmp_path / "b", "--manifest", str(tensor_manifest))
    assert res.exit_code == 2 and "generation_config.json" in res.output and "another checkpoint" in res.output


def test_a_whole_shard_listed_with_another_sha256_is_refused_before_any_byte(k3_tiny: Path, tensor_manifest: Path,
                                                                            tmp_path: Path) -> None:
    from k3ckpt.testing.hub import LoopbackHub

    served = tmp_path / "served"
    shutil.copytree(k3_tiny, served)
    whole = served / "model-00001-of-000008.safetensors"  # every tensor of it is selected: fetched whole
    hdr = read_header(whole)
    data = bytearray(whole.read_bytes())
    data[hdr.data_start] ^= 0xFF  # same header, other bytes: the listing's sha256 changes
    whole.write_bytes(bytes(data))
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "hc") as h:
        res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(tmp_path / "b"), "--endpoint", h.url,
                  *NODE0, "--format", "partial", "--manifest", str(tensor_manifest))
        assert res.exit_code == 2
        assert "model-00001-of-000008.safetensors" in res.output and "another checkpoint or revision" in res.output
        assert h.bytes_sent(whole.name) <= hdr.data_start  # its header was read to plan; no data moved


def test_rank_fetch_refuses_a_whole_checkpoint_and_a_whole_fetch_clears_the_marker(
        served_hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    h, served = served_hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    whole = tmp_path / "whole"
    shutil.copytree(served, whole)
    before = tree_digests(whole)
    res = fetch(h, whole)  # a copy: files k3ckpt did not write
    assert res.exit_code == 2 and f"holds files k3ckpt did not write ({whole / 'LICENSE'})" in res.output
    assert tree_digests(whole) == before  # nothing touched, the index included
    fetched = tmp_path / "fetched"  # a whole fetch's own directory: fetch's, but not rank-aware
    assert run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(fetched), "--endpoint", h.url).exit_code == 0
    before = tree_digests(fetched)
    res = fetch(h, fetched)
    assert res.exit_code == 2 and "not a rank-aware fetch" in res.output
    assert tree_digests(fetched) == before
    # a rank-aware fetch's directory made whole by a full fetch: its marker goes, verify passes
    dest = tmp_path / "d"
    assert fetch(h, dest).exit_code == 0 and (dest / PARTIAL_NAME).exists()
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url)
    assert res.exit_code == 0, res.output
    assert not (dest / PARTIAL_NAME).exists()
    assert run("verify", str(dest)).exit_code == 0
    assert tree_digests(dest) == tree_digests(served)


@pytest.mark.parametrize("layout", ["partial", "node"])
def test_files_left_out_by_exclude_are_not_missing_to_verify(served_hub: Any, tensor_manifest: Path, tmp_path: Path,
                                                             layout: str) -> None:
    """A share fetched with --exclude records what it left out; verify against the whole
    checkpoint's manifest says so instead of reporting the files missing - and still reports a
    file that went missing afterwards."""
    h, _ = served_hub
    dest = tmp_path / "d"
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url, *NODE0,
              "--format", layout, "--exclude", "LICENSE")
    assert res.exit_code == 0, res.output
    assert not (dest / "LICENSE").exists()
    marker = json.loads((dest / ("k3ckpt-partial.json" if layout == "partial" else "k3ckpt-node.json")).read_text())
    assert marker["excluded"] == ["LICENSE"]
    ok = run("verify", str(dest), "--manifest", str(tensor_manifest), "--json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["share"]["files_excluded"] == ["LICENSE"]
    (dest / "generation_config.json").unlink()
    bad = run("verify", str(dest), "--manifest", str(tensor_manifest), "--json")
    assert bad.exit_code == 1
    issues = json.loads(bad.output)["issues"]
    assert list(issues) == ["missing-file"] and [i["file"] for i in issues["missing-file"]] == ["generation_config.json"]


# ----------------------------------------------------------------------------------------------
# HF_HUB_OFFLINE=1: the same fetch re-run where the hub cannot be reached
# ----------------------------------------------------------------------------------------------


def test_offline_rerun_checks_the_partial_without_the_hub(served_hub: Any, tensor_manifest: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 0 and not one request for the complete partial checkpoint; what a re-run online
    checks, minus the hub: the rewritten shards' size, header and record (with --manifest every
    tensor), the files fetched whole against the recorded listing; exit 1 naming what is
    missing or damaged; other ranks: one line, exit 2."""
    h, _ = served_hub
    dest = tmp_path / "d"
    assert fetch(h, dest, "--manifest", str(tensor_manifest)).exit_code == 0
    hub_offline(monkeypatch)
    h.reset_counters()
    res = fetch(h, dest)
    assert res.exit_code == 0, res.output
    # without --manifest, as online: not proven, and it says why
    assert res.stdout.startswith("not proven (offline, HF_HUB_OFFLINE is set): ") and "ranks 0-3 of ep 8 x tp 2" in res.stdout
    assert res.stdout.splitlines()[-1].startswith("not proven: no --manifest: the rewritten shards were checked for")
    res = fetch(h, dest, "--manifest", str(tensor_manifest))
    assert res.exit_code == 0 and res.stdout.startswith("ok (offline") and "not proven" not in res.stdout
    assert h.request_log == []

    shard = "model-00005-of-000008.safetensors"
    hdr = read_header(dest / shard)
    name = next(n for n in hdr.tensors if ".experts.6.w3.weight_packed" in n)
    flip_byte(dest / shard, hdr.absolute_range(name)[0] + 3)
    assert fetch(h, dest).exit_code == 0  # as online: size and header cannot see it (the note says so)
    doc = json.loads(fetch(h, dest, "--manifest", str(tensor_manifest), "--json").stdout)
    assert not doc["ok"] and list(doc["failed"]) == [shard]
    assert doc["failed"][shard].startswith(f"tensor {name!r}: sha256 ")
    (dest / "tiktoken.model").unlink()
    res = fetch(h, dest, "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["failed"] == {"tiktoken.model": "missing"}
    assert_one_line_error(run("fetch", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url, "--ep", "8",
                              "--tp", "2", "--ranks", "4-7"), 2, "is for ranks 0-3 of ep 8 x tp 2", "not ranks 4-7")
    assert h.request_log == []


def test_offline_rerun_of_a_partial_published_in_the_cache(served_hub: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a cache: the staged partial checkpoint of this very selection is found by its key
    and checked, then its snapshot must serve the staged files."""
    h, _ = served_hub
    cache = tmp_path / "hf-cache"
    args = ("fetch", REPO, "--cache-dir", str(cache), "--endpoint", h.url, "--ep", "8", "--tp", "2", "--ranks", "0-3")
    assert run(*args).exit_code == 0
    hub_offline(monkeypatch)
    h.reset_counters()
    res = run(*args)
    assert res.exit_code == 0, res.output
    assert "not proven (offline" in res.stdout and "note: snapshot: " in res.stderr and "k3ckpt-partial-" in res.stderr
    assert h.request_log == []
    snapshot = Path(res.stderr.split("note: snapshot: ")[1].split(" (revision")[0])
    (snapshot / "config.json").unlink()
    doc = json.loads(run(*args, "--json").stdout)
    assert not doc["ok"] and list(doc["failed"]) == ["snapshot config.json"]
    assert_one_line_error(run(*args[:-1], "0-1"), 2, "HF_HUB_OFFLINE is set", "no complete rank-aware fetch")
