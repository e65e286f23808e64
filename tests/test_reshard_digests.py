"""``k3ckpt reshard``'s digests: every output byte and every recorded sha256 recomputed
independently (``safetensors`` + ``hashlib``) for both formats, and ``--manifest``: whole-tensor
digests taken from a source manifest only for files ``verify`` (or ``fetch``) found unchanged and
equal to it - a source whose bytes do not match the manifest is hashed, never given its digests."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors

from helpers import assert_one_line_error, run, segments_digest, shard_of, tensor_digests
from k3ckpt.format.checkpoint import INDEX_NAME, open_checkpoint
from k3ckpt.format.header import DTYPE_BITS
from k3ckpt.integrity.manifest import build_manifest
from k3ckpt.integrity.verify import record_verified
from k3ckpt.testing import inject_fault

FORMATS = {
    "rank": ["--format", "rank", "--ep", "4", "--tp", "2"],
    "node": ["--tp", "2", "--dp", "2", "--gpus-per-node", "2"],
}


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A private verify stat cache (``K3CKPT_CACHE_DIR``) for this test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(d))
    return d


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _units(out: Path) -> list[tuple[Path, dict]]:
    """Each rank or node directory with its manifest or marker."""
    dirs = sorted(out.glob("rank-*")) + sorted(out.glob("node-*"))
    assert dirs
    return [(d, json.loads((d / ("rank-manifest.json" if d.name.startswith("rank-") else "k3ckpt-node.json"))
                           .read_text())) for d in dirs]


def check_digests(src: Path, out: Path) -> dict[str, str]:
    """Every recorded file digest and tensor sha256 of ``out`` equals hashlib over the bytes on disk
    (tensors cut out by the ``safetensors`` library), and every whole tensor's bytes are the
    source's; returns {tensor: recorded sha256} (equal on every unit holding it)."""
    source = tensor_digests(src)
    recorded: dict[str, str] = {}
    for d, m in _units(out):
        seen = set()
        assert set(m["files"]) == {p.name for p in d.glob("*.safetensors")}
        for fname, entry in m["files"].items():
            raw = (d / fname).read_bytes()
            # a rank or node file's digest is its segments' (docs/trust.md), never a plain sha256
            assert entry == {**entry, "size": len(raw), "segments_sha256": segments_digest(raw)}, (d.name, fname)
            assert "sha256" not in entry
            for name, t in safetensors.deserialize(raw):
                got = _sha(bytes(t["data"]))
                assert m["tensors"][name]["sha256"] == got, (d.name, name)
                if m["tensors"][name].get("split") is None:  # whole: the source's bytes
                    assert got == source[name], (d.name, name)
                assert recorded.setdefault(name, got) == got or m["tensors"][name].get("split") is not None
                seen.add(name)
        assert seen == set(m["tensors"]), d.name
    return recorded


def _reshard(src: Path, out: Path, fmt: str, *extra: str) -> dict:
    res = run("reshard", str(src), "-o", str(out), *FORMATS[fmt], "--json", *extra)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _manifest(src: Path, path: Path, tensor_hashes: bool = True) -> Path:
    build_manifest(src, tensor_hashes=tensor_hashes).save(path)
    return path


def _whole_tensors(out: Path) -> set[str]:
    return {n for _, m in _units(out) for n, t in m["tensors"].items() if t.get("split") is None}


def _flip(path: Path, offset: int) -> None:
    """Change one byte in place (same size)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("jobs", ["1", "3"])
def test_every_byte_and_digest_recomputed(k3_tiny: Path, tmp_path: Path, cache: Path, fmt: str, jobs: str) -> None:
    res = _reshard(k3_tiny, tmp_path / "out", fmt, "--jobs", jobs)
    assert res["tensor_digests_from_manifest"] == 0
    check_digests(k3_tiny, tmp_path / "out")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_manifest_digests_of_a_verified_source(k3_tiny: Path, tmp_path: Path, cache: Path, fmt: str) -> None:
    m = _manifest(k3_tiny, tmp_path / "m.json")
    plain = _reshard(k3_tiny, tmp_path / "plain", fmt)  # nothing verified yet: every tensor hashed
    assert run("verify", str(k3_tiny), "--manifest", str(m)).exit_code == 0
    taken = _reshard(k3_tiny, tmp_path / "taken", fmt, "--manifest", str(m))
    # the documented flow, no flag: the manifest verify just used gives the same digests
    auto = _reshard(k3_tiny, tmp_path / "auto", fmt)
    whole = _whole_tensors(tmp_path / "taken")
    assert plain["tensor_digests_from_manifest"] == 0 and taken["tensor_digests_from_manifest"] == len(whole) > 0
    assert auto["tensor_digests_from_manifest"] == len(whole) and auto["tensor_digests_manifest"] == str(m.resolve())
    assert taken["tensor_digests_manifest"] == "--manifest" and plain["tensor_digests_manifest"] is None
    # the same bytes and the same recorded digests, byte for byte, as hashing everything
    for other in ("taken", "auto"):
        for f in sorted(p for p in (tmp_path / "plain").rglob("*") if p.is_file() and ".cache" not in p.parts):
            assert f.read_bytes() == (tmp_path / other / f.relative_to(tmp_path / "plain")).read_bytes(), f
        check_digests(k3_tiny, tmp_path / other)


def test_the_manifest_verify_used_is_taken_only_while_it_and_the_source_are_unchanged(
        k3_tiny: Path, tmp_path: Path, cache: Path, clone_checkpoint: Callable[[Path], Path]) -> None:
    """Without --manifest, reshard takes digests from the manifest file verify last used only
    while that file holds the bytes verify read (an edited manifest gives none), and only for
    source files unchanged since (a flipped byte after verify: that shard is hashed, and the
    marker records what it holds now)."""
    src = clone_checkpoint(k3_tiny)
    m = _manifest(src, tmp_path / "m.json")
    assert run("verify", str(src), "--manifest", str(m)).exit_code == 0
    res = run("reshard", str(src), "-o", str(tmp_path / "said"), *FORMATS["node"])
    assert res.exit_code == 0 and f"tensor digests from the manifest {m.resolve()} (verify's)" in res.output, res.output
    # the source changes after verify: its shard is hashed, the others still take the manifest's
    ckpt = open_checkpoint(src)
    name = next(n for n, r in ckpt.roles.items() if r.expert is not None)
    info, shard = ckpt.tensors[name], shard_of(src, name)
    _flip(src / shard, ckpt.shards[shard].data_start + info.begin)
    res_json = _reshard(src, tmp_path / "changed", "node")
    recorded = check_digests(src, tmp_path / "changed")
    assert recorded[name] == tensor_digests(src)[name] != json.loads(m.read_text())["tensors"][name]["sha256"]
    in_shard = {n for n, t in ckpt.tensors.items() if t.file == shard}
    assert res_json["tensor_digests_from_manifest"] == len(_whole_tensors(tmp_path / "changed") - in_shard) > 0
    # the manifest file edited after verify: not what verify checked, so nothing is taken from it
    m.write_text(m.read_text() + "\n")
    edited = _reshard(src, tmp_path / "edited", "node")
    assert edited["tensor_digests_from_manifest"] == 0 and edited["tensor_digests_manifest"] is None
    check_digests(src, tmp_path / "edited")


def test_changed_source_is_hashed_not_given_the_manifest_digest(
        k3_tiny: Path, tmp_path: Path, cache: Path, clone_checkpoint: Callable[[Path], Path]) -> None:
    src = clone_checkpoint(k3_tiny)
    m = _manifest(src, tmp_path / "m.json")
    assert run("verify", str(src), "--manifest", str(m)).exit_code == 0
    ckpt = open_checkpoint(src)
    name = next(n for n, r in ckpt.roles.items() if r.expert is not None)  # whole in both formats
    info, shard = ckpt.tensors[name], shard_of(src, name)
    _flip(src / shard, ckpt.shards[shard].data_start + info.begin)  # after verify: the stat changes
    res = _reshard(src, tmp_path / "out", "node", "--manifest", str(m))
    recorded = check_digests(src, tmp_path / "out")
    assert recorded[name] == tensor_digests(src)[name] != json.loads(m.read_text())["tensors"][name]["sha256"]
    in_shard = {n for n, t in ckpt.tensors.items() if t.file == shard}
    assert res["tensor_digests_from_manifest"] == len(_whole_tensors(tmp_path / "out") - in_shard) > 0


def test_source_verified_against_other_digests_is_hashed(
        k3_tiny: Path, tmp_path: Path, cache: Path, clone_checkpoint: Callable[[Path], Path]) -> None:
    src = clone_checkpoint(k3_tiny)
    m = _manifest(src, tmp_path / "m.json")
    assert _reshard(src, tmp_path / "never", "rank", "--manifest", str(m))["tensor_digests_from_manifest"] == 0
    # a shard changed, then verified against what it now holds (say, a newer hub revision):
    # the stat cache knows its bytes, and they are not the manifest's
    ckpt = open_checkpoint(src)
    name = next(n for n in ckpt.tensors if n.endswith("input_layernorm.weight"))  # whole on every rank
    shard = shard_of(src, name)
    _flip(src / shard, ckpt.shards[shard].data_start + ckpt.tensors[name].begin)
    record_verified(src, {f: (_sha((src / f).read_bytes()), None) for f in ckpt.shards})
    res = _reshard(src, tmp_path / "out", "rank", "--manifest", str(m))
    recorded = check_digests(src, tmp_path / "out")
    assert recorded[name] == tensor_digests(src)[name]
    in_shard = {n for n, t in ckpt.tensors.items() if t.file == shard}
    assert res["tensor_digests_from_manifest"] == len(_whole_tensors(tmp_path / "out") - in_shard) > 0


def test_manifest_verify_flagged_is_not_trusted(k3_tiny: Path, tmp_path: Path, cache: Path) -> None:
    """A manifest whose tensor digest is wrong (file digests intact): verify reports it, and
    reshard hashes that file's tensors instead of copying the wrong digest."""
    m = _manifest(k3_tiny, tmp_path / "m.json")
    doc = json.loads(m.read_text())
    name = next(n for n in sorted(doc["tensors"]) if ".experts." in n)
    doc["tensors"][name]["sha256"] = "0" * 64
    m.write_text(json.dumps(doc))
    assert run("verify", str(k3_tiny), "--manifest", str(m)).exit_code == 1
    res = _reshard(k3_tiny, tmp_path / "out", "node", "--manifest", str(m))
    assert check_digests(k3_tiny, tmp_path / "out")[name] == tensor_digests(k3_tiny)[name]
    in_shard = {n for n, t in open_checkpoint(k3_tiny).tensors.items() if t.file == shard_of(k3_tiny, name)}
    assert res["tensor_digests_from_manifest"] == len(_whole_tensors(tmp_path / "out") - in_shard) > 0


def test_manifest_without_tensor_hashes_is_refused(k3_tiny: Path, tmp_path: Path, cache: Path) -> None:
    m = _manifest(k3_tiny, tmp_path / "m.json", tensor_hashes=False)
    res = run("reshard", str(k3_tiny), "-o", str(tmp_path / "out"), "--manifest", str(m))
    assert_one_line_error(res, 2, "--manifest has no tensor hashes", "--tensor-hashes")
    assert not (tmp_path / "out").exists()


class _CountingSha256:
    """hashlib.sha256 that adds every byte it is fed to ``total``."""

    total = 0

    def __init__(self, data: bytes = b"") -> None:
        self._h = hashlib.sha256(data)
        _CountingSha256.total += len(data)

    def update(self, data: bytes | memoryview) -> None:
        _CountingSha256.total += len(data)
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _count_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count every byte reshard hashes: the source's index digest (planning) and the output's
    digests (writing)."""
    import types

    from k3ckpt.deploy.reshard import plan, write

    for module in (plan, write):
        monkeypatch.setattr(module, "hashlib", types.SimpleNamespace(sha256=_CountingSha256))


@pytest.mark.parametrize("manifest", [False, True])
def test_each_byte_hashed_once_per_digest(k3_tiny: Path, tmp_path: Path, cache: Path,
                                          monkeypatch: pytest.MonkeyPatch, manifest: bool) -> None:
    """Node directories: each distinct tensor is hashed once - or not at all with a verified
    manifest - and no file is hashed whole (its digest is built from its header and tensors'
    sha256, docs/trust.md) nor read back: the bytes hashed are exactly the tensors' (with a
    manifest: none but the source's index)."""
    from k3ckpt.deploy import reshard as rs
    from k3ckpt.format.topology import RankSelection
    from k3ckpt.integrity.manifest import Manifest

    m = None
    if manifest:
        m = Manifest.load(_manifest(k3_tiny, tmp_path / "m.json"))
        assert run("verify", str(k3_tiny), "--manifest", str(tmp_path / "m.json")).exit_code == 0
    _count_hashing(monkeypatch)
    _CountingSha256.total = 0
    res = rs.reshard(k3_tiny, tmp_path / "out", RankSelection(tp=2, dp=2, gpus_per_node=2), layout="node", jobs=3,
                     manifest=m)
    assert len(res.written) == 2
    files = {(d / f).read_bytes() for d, mk in _units(tmp_path / "out") for f in mk["files"]}
    dense = [d / "model-dense-00001-of-00001.safetensors" for d, _ in _units(tmp_path / "out")]
    assert len(dense) == 2 and dense[0].read_bytes() == dense[1].read_bytes()  # the twin files
    ckpt = open_checkpoint(k3_tiny)
    tensors = {n for _, mk in _units(tmp_path / "out") for n in mk["tensors"]}
    assert files
    want = ((0 if manifest else sum(ckpt.tensors[n].nbytes for n in tensors))
            + (k3_tiny / INDEX_NAME).stat().st_size)  # the source's index digest, in topology.json
    assert _CountingSha256.total == want
    check_digests(k3_tiny, tmp_path / "out")


def test_rank_format_after_a_verify_hashes_only_the_cuts(k3_tiny: Path, tmp_path: Path, cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--format rank with a verified manifest: a whole tensor's digest is the manifest's, and a
    rank file's is its segments', so the only bytes hashed are the TP cuts (each distinct one
    once) - no whole tensor, no file whole; every digest still equals hashlib over the output."""
    from k3ckpt.deploy import reshard as rs
    from k3ckpt.format.topology import RankSelection
    from k3ckpt.integrity.manifest import Manifest

    m = Manifest.load(_manifest(k3_tiny, tmp_path / "m.json"))
    assert run("verify", str(k3_tiny), "--manifest", str(tmp_path / "m.json")).exit_code == 0
    _count_hashing(monkeypatch)
    _CountingSha256.total = 0
    rs.reshard(k3_tiny, tmp_path / "out", RankSelection(ep=4, tp=2), layout="rank", jobs=1, manifest=m)
    cuts: dict[tuple[str, str], int] = {}  # (tensor, its cut) -> bytes
    for _, mk in _units(tmp_path / "out"):
        for name, t in mk["tensors"].items():
            if t["split"] is not None:
                cuts[(name, json.dumps(t["split"]))] = math.prod(t["shape"]) * DTYPE_BITS[t["dtype"]] // 8
    assert cuts and _CountingSha256.total == sum(cuts.values()) + (k3_tiny / INDEX_NAME).stat().st_size
    check_digests(k3_tiny, tmp_path / "out")


def test_rank_dense_parts_are_twins_hashed_once(k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--format rank: a rank's dense tensors (whole or its tp_rank's cut) are in parts of their
    own, byte-identical on every rank of that tp_rank; a run hashes each distinct tensor slice
    once and no file whole (a rank file's digest is its segments'): the bytes hashed are exactly
    the slices' sum."""
    from k3ckpt.deploy import reshard as rs
    from k3ckpt.format.topology import RankSelection

    _count_hashing(monkeypatch)
    _CountingSha256.total = 0
    # one writer: two writers may hash a whole tensor both tp_ranks' parts hold at the same time
    rs.reshard(k3_tiny, tmp_path / "out", RankSelection(ep=4, tp=2), layout="rank", jobs=1)
    units = _units(tmp_path / "out")
    dense_parts: dict[int, set[bytes]] = {0: set(), 1: set()}
    slices: dict[tuple[str, str], int] = {}  # (tensor, its cut) -> bytes
    for d, mk in units:
        for fname in mk["files"]:
            raw = (d / fname).read_bytes()
            names = [name for name, _ in safetensors.deserialize(raw)]
            experts = {".experts." in n for n in names}
            assert len(experts) == 1, (d.name, fname)  # dense and expert tensors never share a part
            if experts == {False}:
                dense_parts[mk["tp_rank"]].add(raw)
            for name, t in safetensors.deserialize(raw):
                slices[(name, json.dumps(mk["tensors"][name]["split"]))] = len(bytes(t["data"]))
    assert len(dense_parts[0]) == len(dense_parts[1]) == 1 and dense_parts[0] != dense_parts[1]
    assert _CountingSha256.total == sum(slices.values()) + (k3_tiny / INDEX_NAME).stat().st_size
    check_digests(k3_tiny, tmp_path / "out")


def test_a_twin_is_written_as_soon_as_its_first_is(k3_tiny: Path, tmp_path: Path) -> None:
    """One writer: the second node's dense file (a twin: copied, not hashed) is taken right
    after the first node's, ahead of the expert files queued before it was released - not
    last, where it was copied with the other cores idle."""
    from k3ckpt.deploy import reshard as rs
    from k3ckpt.format.topology import RankSelection

    plan = rs.plan_reshard(k3_tiny, RankSelection(tp=2, dp=2, gpus_per_node=2), layout="node")
    written: list[str] = []
    with inject_fault("reshard.file_written", written.append):
        rs.run_reshard(plan, tmp_path / "out", jobs=1)
    dense = [k for k, name in enumerate(written) if name.startswith("model-dense-")]
    assert len(dense) == 2 and dense[1] == dense[0] + 1 and dense[1] < len(written) - 1, written
    check_digests(k3_tiny, tmp_path / "out")


def test_extra_files_are_copied_while_the_weights_are_written(k3_tiny: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The config, tokenizer and licence of each node are copied once the writers copy weights
    (their fsyncs are not on the way to the first weight byte), and still land before READY."""
    import threading

    from k3ckpt.deploy import reshard as rs
    from k3ckpt.deploy.reshard import run as reshard_run
    from k3ckpt.format.topology import RankSelection

    copying = threading.Event()
    real_copy = reshard_run.copy_files
    waited: list[bool] = []

    def copy_files(*args: Any, **kwargs: Any) -> Any:
        waited.append(copying.wait(30))  # False (after 30 s) if no weight byte was copied first
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(reshard_run, "copy_files", copy_files)
    rs.reshard(k3_tiny, tmp_path / "out", RankSelection(tp=2, dp=2, gpus_per_node=2), layout="node",
               progress=lambda n: copying.set())
    assert waited == [True, True]  # one copy per node
    for d, _ in _units(tmp_path / "out"):
        assert (d / "READY").exists()
        for f in ("config.json", "tokenizer_config.json", "LICENSE"):
            assert (d / f).read_bytes() == (k3_tiny / f).read_bytes()
    check_digests(k3_tiny, tmp_path / "out")


def test_twin_of_a_failed_file_is_hashed_itself(k3_tiny: Path, tmp_path: Path, cache: Path) -> None:
    """The first writer of the dense file fails: its twin on the other node is hashed as any
    file, that node completes, and a re-run completes the other."""
    from k3ckpt.deploy import reshard as rs
    from k3ckpt.format.topology import RankSelection

    sel = RankSelection(tp=2, dp=2, gpus_per_node=2)
    plan = rs.plan_reshard(k3_tiny, sel, layout="node")
    calls: list[str] = []

    def boom(name: str) -> None:
        calls.append(name)
        if name.startswith("model-dense-") and calls.count(name) == 1:
            raise rs.ReshardError(f"writing {name}: disk full")

    with pytest.raises(rs.ReshardError, match="model-dense-"):
        with inject_fault("reshard.file_written", boom):
            rs.run_reshard(plan, tmp_path / "out", jobs=2)
    ready = [d for d in (tmp_path / "out").glob("node-*") if (d / "READY").exists()]
    assert len(ready) == 1
    res = rs.reshard(k3_tiny, tmp_path / "out", sel, layout="node")
    assert len(res.written) == 1 and len(res.skipped) == 1
    check_digests(k3_tiny, tmp_path / "out")


@pytest.mark.parametrize("fmt", ["node", "rank"])
def test_source_truncated_after_planning_is_an_error_not_a_crash(
        k3_tiny: Path, tmp_path: Path, clone_checkpoint: Callable[[Path], Path], fmt: str) -> None:
    """Chunks are read from the source to be hashed: a source shorter than its header says is a
    one-line error naming it (the read, or the copy, reports the short read), and leaves no file
    under a final name."""
    from k3ckpt.deploy import reshard as rs
    from k3ckpt.errors import SourceShortReadError
    from k3ckpt.format.topology import RankSelection

    src = clone_checkpoint(k3_tiny)
    sel = RankSelection(tp=2, dp=2, gpus_per_node=2) if fmt == "node" else RankSelection(ep=4, tp=2)
    plan = rs.plan_reshard(src, sel, layout=fmt)
    for shard in open_checkpoint(src).shards.values():
        with open(shard.path, "r+b") as fh:
            fh.truncate(shard.data_start + 1)
    with pytest.raises(SourceShortReadError, match="source ended early") as info:
        rs.run_reshard(plan, tmp_path / "out", jobs=2)
    assert info.value.path is not None and Path(info.value.path).parent == src  # names the source file
    assert str(info.value).startswith(f"{info.value.path}: ")
    assert not [p for p in (tmp_path / "out").rglob("*.safetensors")]  # no file under a final name


_GATHER_WITHOUT_NUMPY = r'''
import sys
from k3ckpt.deploy.bytecopy import ROW_COPY_MIN
from k3ckpt.deploy.reshard import plan_reshard, run_reshard
from k3ckpt.format.topology import RankSelection
plan = plan_reshard(sys.argv[1], RankSelection(ep=4, tp=2), layout="rank")
gathered = [r for u in plan.units for f in u.files for t in f.tensors for r in t.runs
            if r.count > 1 and r.length < ROW_COPY_MIN]
run_reshard(plan, sys.argv[2], jobs=2)
print(len(gathered), "numpy" in sys.modules)
'''


def test_strided_slices_gathered_without_numpy(k3_tiny: Path, tmp_path: Path) -> None:
    """TP slices of a later dim (rows gathered through a buffer) are cut row by row: the run
    imports no numpy (its import and the OpenBLAS thread it starts cost more than the gather),
    and every byte and digest is the independently recomputed one."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _GATHER_WITHOUT_NUMPY, str(k3_tiny), str(tmp_path / "out")],
                          capture_output=True, text=True, check=True)
    gathered, numpy_imported = proc.stdout.split()
    assert int(gathered) > 0 and numpy_imported == "False", proc.stdout
    check_digests(k3_tiny, tmp_path / "out")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_chunks_hashed_in_steps_smaller_than_a_chunk(k3_tiny: Path, tmp_path: Path, cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """A chunk copied kernel-side is hashed in ``$K3CKPT_HASH_BUFFER`` steps read from the source
    (several per chunk, ending off the page grid): every byte and digest is still the
    independently recomputed one, and no step is larger than asked."""
    from k3ckpt.deploy import bytecopy

    monkeypatch.setattr(bytecopy, "CHUNK", 64 * 1024)
    step = 3 * 4096 + 123
    monkeypatch.setenv("K3CKPT_HASH_BUFFER", str(step))
    reads: list[int] = []
    real_pread = bytecopy.Copier._pread

    def counting_pread(self: bytecopy.Copier, fd: int, n: int, off: int) -> memoryview:
        reads.append(n)
        return real_pread(self, fd, n, off)

    chunks: list[int] = []
    real_hash_and_copy = bytecopy.Copier._hash_and_copy

    def counting_hash_and_copy(self: bytecopy.Copier, *args: Any) -> None:
        chunks.append(args[2])  # the chunk's length
        real_hash_and_copy(self, *args)

    monkeypatch.setattr(bytecopy.Copier, "_pread", counting_pread)
    monkeypatch.setattr(bytecopy.Copier, "_hash_and_copy", counting_hash_and_copy)
    _reshard(k3_tiny, tmp_path / "out", fmt, "--jobs", "2")
    assert chunks and max(chunks) > step and max(reads) <= 64 * 1024, (max(chunks), max(reads))
    assert step in reads and sum(1 for n in reads if n == step) > len(chunks) // 2
    check_digests(k3_tiny, tmp_path / "out")


PARTIAL = ("--ep", "8", "--tp", "2", "--node", "0", "--gpus-per-node", "4", "--format", "partial")  # experts 0-7
NODE_OF_PARTIAL = ["--tp", "2", "--dp", "4", "--gpus-per-node", "4", "--node", "0"]  # the same ranks, ep = tp x dp


def test_a_partial_share_verified_tensor_by_tensor_gives_reshard_its_digests(
        served_hub: Any, k3_tiny: Path, tmp_path: Path, cache: Path) -> None:
    """The documented flow on a rank-aware fetch's copy (fetch --format partial, verify --manifest,
    reshard --node, no flag): the share's rewritten shards match no file digest of the manifest,
    but verify found every tensor of them equal to it - reshard takes those digests instead of
    hashing each tensor again, writes the bytes and markers hashing would, and a tensor changed
    after verify is hashed (its file's stat changed), never given the manifest's digest."""
    h, _ = served_hub
    share, m = tmp_path / "share", _manifest(k3_tiny, tmp_path / "m.json")
    res = run("fetch", "--repo", "moonshotai/Kimi-K3", "--dest", str(share), "--endpoint", h.url, *PARTIAL)
    assert res.exit_code == 0, res.output

    def reshard(name: str) -> dict:
        got = run("reshard", str(share), "-o", str(tmp_path / name), *NODE_OF_PARTIAL, "--json")
        assert got.exit_code == 0, got.output
        return json.loads(got.stdout)

    plain = reshard("plain")  # verified by nothing yet: every tensor hashed
    assert run("verify", str(share), "--manifest", str(m)).exit_code == 0
    taken = reshard("taken")
    whole = _whole_tensors(tmp_path / "taken")
    assert plain["tensor_digests_from_manifest"] == 0
    assert taken["tensor_digests_from_manifest"] == len(whole) > 0 and taken["tensor_digests_manifest"] == str(m.resolve())
    for f in sorted(p for p in (tmp_path / "plain").rglob("*") if p.is_file() and ".cache" not in p.parts):
        assert f.read_bytes() == (tmp_path / "taken" / f.relative_to(tmp_path / "plain")).read_bytes(), f
    check_digests(share, tmp_path / "taken")

    # one expert byte changed after verify: its shard is hashed, and the marker records what it holds
    ckpt = open_checkpoint(share)
    name = next(n for n, r in ckpt.roles.items() if r.expert is not None and n in whole)
    info = ckpt.tensors[name]
    _flip(share / info.file, ckpt.shards[info.file].data_start + info.begin)
    changed = reshard("changed")
    recorded = check_digests(share, tmp_path / "changed")
    assert recorded[name] == tensor_digests(share)[name] != json.loads(m.read_text())["tensors"][name]["sha256"]
    in_shard = {n for n, t in ckpt.tensors.items() if t.file == info.file}
    assert changed["tensor_digests_from_manifest"] == len(whole - in_shard) > 0
    # verified again, the changed shard is found differing: still hashed, not taken
    assert run("verify", str(share), "--manifest", str(m)).exit_code == 1
    again = reshard("again")
    assert again["tensor_digests_from_manifest"] == len(whole - in_shard)
    assert check_digests(share, tmp_path / "again")[name] == tensor_digests(share)[name]
