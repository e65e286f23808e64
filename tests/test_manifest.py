"""Manifests: build (every file and tensor, hashes equal to hashlib over the bytes), determinism,
diff (exact +/-/~ lines after real modifications of a checkpoint), load errors, and the CLI.

Every checkpoint that gets modified is a private copy of a session fixture.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from ckpt_edit import edit_index, flip_byte, rewrite_shard
from helpers import assert_one_line_error, run, shard_of
from k3ckpt.format.checkpoint import iter_checkpoint_files, open_checkpoint
from k3ckpt.integrity.manifest import (
    FORMAT,
    VERSION,
    FileEntry,
    Manifest,
    ManifestError,
    TensorEntry,
    build_manifest,
    diff_manifests,
)
from k3ckpt.integrity.verify import verify_checkpoint

INDEX = "model.safetensors.index.json"
LAYER1_EXPERT3 = "language_model.model.layers.1.block_sparse_moe.experts.3."
PACKED = LAYER1_EXPERT3 + "w1.weight_packed"
LAYER2_NORM = "language_model.model.layers.2.input_layernorm.weight"


# -- helpers ------------------------------------------------------------------------------------


def sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# -- build --------------------------------------------------------------------------------------


def test_build_describes_every_file_and_tensor_with_hashlib_equal_digests(k3_tiny: Path) -> None:
    m = build_manifest(k3_tiny, tensor_hashes=True)
    data = json.loads(m.to_json())
    assert data["format"] == FORMAT == "k3ckpt-manifest" and data["version"] == VERSION == 1
    assert data["source"] == {} and data["tensor_hashes"] is True  # a plain dir tells no origin

    on_disk = sorted(p.relative_to(k3_tiny).as_posix() for p in k3_tiny.rglob("*") if p.is_file())
    assert sorted(m.files) == on_disk == list(iter_checkpoint_files(k3_tiny))
    ckpt = open_checkpoint(k3_tiny)
    for rel, entry in m.files.items():
        p = k3_tiny / rel
        assert entry.size == p.stat().st_size, rel
        assert entry.sha256 == sha256_file(p), rel
        assert data["files"][rel] == {"size": entry.size, "sha256": entry.sha256,
                                      **({"data_start": entry.data_start} if rel in ckpt.shards else {})}
        if rel in ckpt.shards:
            assert entry.data_start == ckpt.shards[rel].data_start
        else:
            assert entry.data_start is None

    assert m.tensors.keys() == ckpt.tensors.keys() and len(m.tensors) > 400
    blobs = {f: (k3_tiny / f).read_bytes() for f in ckpt.shards}
    for name, t in m.tensors.items():
        info = ckpt.tensors[name]
        assert (t.file, t.dtype, t.shape) == (info.file, info.dtype, info.shape), name
        start, stop = t.offsets
        assert (start, stop) == ckpt.shards[t.file].absolute_range(name)
        raw = blobs[t.file][start:stop]
        assert raw == ckpt.read_tensor(name).tobytes(), name  # absolute offsets address the tensor
        assert t.sha256 == hashlib.sha256(raw).hexdigest(), name
        assert data["tensors"][name] == {"file": t.file, "dtype": t.dtype, "shape": list(t.shape),
                                         "offsets": [start, stop], "sha256": t.sha256}
    # The offsets of each shard tile its data buffer exactly, from data_start to the end of file.
    for f in ckpt.shards:
        spans = sorted(t.offsets for t in m.tensors.values() if t.file == f)
        assert spans[0][0] == m.files[f].data_start and spans[-1][1] == m.files[f].size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert m.total_bytes == sum((k3_tiny / f).stat().st_size for f in on_disk)


def test_without_tensor_hashes_tensors_carry_no_sha256(k3_tiny: Path) -> None:
    m = build_manifest(k3_tiny)
    data = json.loads(m.to_json())
    assert data["tensor_hashes"] is False
    assert all("sha256" not in t for t in data["tensors"].values())
    assert all(t.sha256 is None for t in m.tensors.values())
    with_hashes = build_manifest(k3_tiny, tensor_hashes=True)
    assert m.files == with_hashes.files  # file hashes do not depend on the option
    assert {n: t._replace(sha256=None) for n, t in with_hashes.tensors.items()} == m.tensors


def test_build_is_deterministic_sorted_and_one_entry_per_line(k3_tiny: Path, tmp_path: Path) -> None:
    a = build_manifest(k3_tiny, tensor_hashes=True, jobs=1)
    b = build_manifest(k3_tiny, tensor_hashes=True, jobs=4)
    assert a.to_json() == b.to_json()
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    text = (tmp_path / "a.json").read_text()
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert text.endswith("}\n")

    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    top_keys = [re.match(r' "([a-z_]+)": ', ln).group(1) for ln in lines if ln.startswith(' "')]
    assert top_keys == sorted(top_keys) == ["files", "format", "source", "tensor_hashes", "tensors", "version"]
    entries = [ln for ln in lines if ln.startswith('  "')]
    assert len(entries) == len(a.files) + len(a.tensors)  # one line per file and per tensor
    names = []
    for ln in entries:
        obj = json.loads("{" + ln.rstrip(",") + "}")  # every entry line is complete JSON by itself
        ((name, value),) = obj.items()
        names.append(name)
        assert list(value) == sorted(value), ln  # sorted keys inside the entry too
    n_files = len(a.files)
    assert names[:n_files] == sorted(a.files) and names[n_files:] == sorted(a.tensors)

    loaded = Manifest.load(tmp_path / "a.json")
    assert loaded == a and loaded.to_json() == text
    assert loaded.fingerprint() == hashlib.sha256(text.encode()).hexdigest() == a.fingerprint()


def test_source_comes_from_the_layout(k3_tiny: Path, tmp_path: Path) -> None:
    commit = "f831ab66" + "0" * 32
    # An HF cache snapshot: models--org--name/snapshots/<commit>
    snap = tmp_path / "hub" / "models--moonshotai--Kimi-K3" / "snapshots" / commit
    shutil.copytree(k3_tiny, snap)
    m = build_manifest(snap)
    assert m.source == {"hub": "hf", "repo": "moonshotai/Kimi-K3", "revision": commit}
    assert json.loads(m.to_json())["source"] == {"hub": "hf", "repo": "moonshotai/Kimi-K3", "revision": commit}

    # A local dir from `hf download --local-dir`: revision from its download metadata, which is
    # not itself part of the checkpoint.
    local = tmp_path / "local"
    shutil.copytree(k3_tiny, local)
    meta = local / ".cache" / "huggingface" / "download" / "config.json.metadata"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"{commit}\netag\n1700000000.0\n")
    m = build_manifest(local)
    assert m.source == {"revision": commit}
    assert not any(f.startswith(".cache") for f in m.files)
    assert sorted(m.files) == sorted(build_manifest(k3_tiny).files)

    assert build_manifest(k3_tiny, source={"hub": "hf", "repo": "x/y"}).source == {"hub": "hf", "repo": "x/y"}


# -- diff ---------------------------------------------------------------------------------------


def test_diff_after_flip_remove_add_and_dtype_change_lists_exact_lines(
    k3_tiny: Path, clone_checkpoint, tmp_path: Path
) -> None:
    d = clone_checkpoint(k3_tiny)
    before = build_manifest(d, tensor_hashes=True)
    ckpt = open_checkpoint(d)
    sa, sb = ckpt.tensors[PACKED].file, ckpt.tensors[LAYER2_NORM].file
    assert sa != sb and ckpt.tensors[LAYER2_NORM].dtype == "BF16"

    flip_byte(d / sa, before.tensors[PACKED].offsets[0] + 10)  # 1. one byte inside a tensor
    (d / "LICENSE").unlink()  # 2. a file removed
    (d / "notes.txt").write_text("added\n")  # 3. a file added
    rewrite_shard(d / sb, lambda ts: [[n, "F16" if n == LAYER2_NORM else dt, s, b] for n, dt, s, b in ts])
    after = build_manifest(d, tensor_hashes=True)  # 4. a dtype changed, shard rewritten
    # The shorter header is absorbed by its padding, so only that tensor's entry changes.
    assert after.files[sb].data_start == before.files[sb].data_start
    assert after.files[sb].size == before.files[sb].size

    def short(h: str) -> str:
        return h[:12]

    fa, fb = before.files, after.files
    ta, tb = before.tensors[PACKED], after.tensors[PACKED]
    assert tb.sha256 == hashlib.sha256(
        (d / sa).read_bytes()[tb.offsets[0]:tb.offsets[1]]).hexdigest() != ta.sha256
    expected = [
        "- file LICENSE",
        f"~ file {sa}: sha256 {short(fa[sa].sha256)} -> {short(fb[sa].sha256)}",
        f"~ file {sb}: sha256 {short(fa[sb].sha256)} -> {short(fb[sb].sha256)}",
        "+ file notes.txt",
        f"~ tensor {PACKED}: sha256 {short(ta.sha256)} -> {short(tb.sha256)}",
        f"~ tensor {LAYER2_NORM}: dtype BF16 -> F16",
    ]
    assert [str(c) for c in diff_manifests(before, after)] == expected
    assert [str(c) for c in diff_manifests(after, before)] == [
        "+ file LICENSE",
        f"~ file {sa}: sha256 {short(fb[sa].sha256)} -> {short(fa[sa].sha256)}",
        f"~ file {sb}: sha256 {short(fb[sb].sha256)} -> {short(fa[sb].sha256)}",
        "- file notes.txt",
        f"~ tensor {PACKED}: sha256 {short(tb.sha256)} -> {short(ta.sha256)}",
        f"~ tensor {LAYER2_NORM}: dtype F16 -> BF16",
    ]

    before.save(tmp_path / "before.json")
    after.save(tmp_path / "after.json")
    res = run("manifest", "diff", str(tmp_path / "before.json"), str(tmp_path / "after.json"))
    assert res.exit_code == 1
    assert res.output.splitlines() == expected
    res = run("manifest", "diff", str(tmp_path / "before.json"), str(tmp_path / "after.json"), "--json")
    assert res.exit_code == 1
    rows = json.loads(res.output)
    assert [(r["kind"], r["what"], r["name"]) for r in rows] == [
        ("removed", "file", "LICENSE"), ("changed", "file", sa), ("changed", "file", sb),
        ("added", "file", "notes.txt"), ("changed", "tensor", PACKED), ("changed", "tensor", LAYER2_NORM)]
    assert rows[-1]["detail"] == "dtype BF16 -> F16"
    res = run("manifest", "diff", str(tmp_path / "before.json"), str(tmp_path / "before.json"))
    assert res.exit_code == 0 and res.output == ""
    res = run("manifest", "diff", str(tmp_path / "after.json"), str(tmp_path / "after.json"), "--json")
    assert res.exit_code == 0 and json.loads(res.output) == []


def test_diff_renamed_tensor_is_removed_plus_added(k3_tiny: Path, clone_checkpoint) -> None:
    d = clone_checkpoint(k3_tiny)
    before = build_manifest(d)
    old = LAYER2_NORM
    new = old.replace("input_layernorm", "input_layernorX")  # same length: same header size
    sb = shard_of(d, old)
    rewrite_shard(d / sb, lambda ts: [[new if n == old else n, dt, s, b] for n, dt, s, b in ts])
    edit_index(d, lambda wm: wm.__setitem__(new, wm.pop(old)))
    after = build_manifest(d)
    sizes_same = before.files[sb].size == after.files[sb].size
    assert sizes_same and before.files[sb].data_start == after.files[sb].data_start
    sha = lambda m, f: m.files[f].sha256[:12]  # noqa: E731
    assert [str(c) for c in diff_manifests(before, after)] == [
        f"~ file {sb}: sha256 {sha(before, sb)} -> {sha(after, sb)}",  # '-' sorts before '.'
        f"~ file {INDEX}: size {before.files[INDEX].size} -> {after.files[INDEX].size}, "
        f"sha256 {sha(before, INDEX)} -> {sha(after, INDEX)}",
        f"+ tensor {new}",  # sorted by name: "...layernorX" < "...layernorm"
        f"- tensor {old}",
    ]


def test_diff_in_memory_tensors_moved_reshaped_and_source_changed() -> None:
    f1, f2 = "a.safetensors", "b.safetensors"
    base = Manifest(
        files={f1: FileEntry(100, "1" * 64, 16), f2: FileEntry(50, "2" * 64, 8)},
        tensors={"t.x": TensorEntry(f1, "BF16", (2, 3), (16, 28), "a" * 64),
                 "t.y": TensorEntry(f2, "U8", (4,), (8, 12), "b" * 64)},
        source={"hub": "hf", "repo": "o/r", "revision": "r1"},
        tensor_hashes=True,
    )
    other = Manifest(
        files={f1: FileEntry(120, "1" * 64, 24), f2: base.files[f2]},
        tensors={"t.x": TensorEntry(f2, "BF16", (3, 2), (8, 20), "a" * 64),
                 "t.z": TensorEntry(f1, "U8", (1,), (24, 25), None)},
        source={"hub": "hf", "repo": "o/r", "revision": "r2", "extra": "e"},
        tensor_hashes=True,
    )
    assert [str(c) for c in diff_manifests(base, other)] == [
        "~ source extra: None -> e",
        "~ source revision: r1 -> r2",
        f"~ file {f1}: size 100 -> 120, data_start 16 -> 24",
        "~ tensor t.x: file a.safetensors -> b.safetensors, shape [2, 3] -> [3, 2], offsets [16, 28] -> [8, 20]",
        "- tensor t.y",
        "+ tensor t.z",
    ]
    assert diff_manifests(base, base) == []


# -- load errors --------------------------------------------------------------------------------


def _good() -> dict:
    return {
        "files": {"model.safetensors": {"size": 24, "sha256": "a" * 64, "data_start": 16}},
        "format": FORMAT, "source": {}, "tensor_hashes": False,
        "tensors": {"t": {"file": "model.safetensors", "dtype": "U8", "shape": [8], "offsets": [16, 24]}},
        "version": VERSION,
    }


def _with(**changes) -> dict:
    d = _good()
    d.update(changes)
    return d


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"files": ', "not valid JSON ("),
        (b"\xff\xfe not text", "cannot read ("),
        (json.dumps(_with(format="safetensors-index")).encode(), "not a k3ckpt-manifest file"),
        (json.dumps([1, 2]).encode(), "not a k3ckpt-manifest file"),
        (json.dumps(_with(version=2)).encode(), "version 2 is not supported (this k3ckpt reads 1)"),
        (json.dumps(_with(files={"../escape.safetensors": {"size": 1, "sha256": "a" * 64}}, tensors={})).encode(),
         "refuses file path '../escape.safetensors' (absolute or outside the checkpoint)"),
        (json.dumps(_with(files={"sub/../../x": {"size": 1, "sha256": "a" * 64}}, tensors={})).encode(),
         "refuses file path 'sub/../../x' (absolute or outside the checkpoint)"),
        (json.dumps(_with(files={"/etc/passwd": {"size": 1, "sha256": "a" * 64}}, tensors={})).encode(),
         "refuses file path '/etc/passwd' (absolute or outside the checkpoint)"),
        (json.dumps(_with(tensors={"t": {"file": "other.safetensors", "dtype": "U8", "shape": [8],
                                          "offsets": [16, 24]}})).encode(),
         "tensor 't' is in 'other.safetensors', which the manifest does not list"),
        (json.dumps(_with(files={"model.safetensors": {"size": -1, "sha256": "a" * 64}})).encode(),
         "malformed (ValueError: bad size -1)"),
        (json.dumps(_with(files={"model.safetensors": {"size": 24, "sha256": "abc"}})).encode(),
         "malformed (ValueError: bad sha256 'abc')"),
        (json.dumps(_with(tensors={"t": {"file": "model.safetensors", "dtype": "U8", "shape": [8],
                                          "offsets": [24, 16]}})).encode(),
         "malformed (ValueError: bad offsets [24, 16])"),
        (json.dumps({k: v for k, v in _good().items() if k != "tensors"}).encode(), "malformed (KeyError: 'tensors')"),
    ],
    ids=["not-json", "not-utf8", "other-format", "not-an-object", "newer-version", "dotdot", "nested-dotdot",
         "absolute", "tensor-in-unlisted-file", "negative-size", "bad-sha", "reversed-offsets", "no-tensors"],
)
def test_load_errors_are_precise(tmp_path: Path, content: bytes, message: str) -> None:
    p = tmp_path / "m.json"
    p.write_bytes(content)
    with pytest.raises(ManifestError) as e:
        Manifest.load(p)
    assert str(e.value).startswith(f"{p}: "), str(e.value)
    assert message in str(e.value)


def test_load_missing_file_and_a_valid_minimal_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"m\.json: not found$"):
        Manifest.load(tmp_path / "m.json")
    (tmp_path / "m.json").write_text(json.dumps(_good()))
    m = Manifest.load(tmp_path / "m.json")
    assert m.tensors["t"] == TensorEntry("model.safetensors", "U8", (8,), (16, 24), None)
    assert m.files["model.safetensors"] == FileEntry(24, "a" * 64, 16)


def test_cli_reports_manifest_errors_as_one_line_exit_2(tmp_path: Path, k3_tiny: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_with(version=7)))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_good()))
    res = run("manifest", "diff", str(good), str(bad))
    assert res.exit_code == 2
    assert res.output.strip() == f"k3ckpt: error: {bad}: version 7 is not supported (this k3ckpt reads 1)"


# -- CLI build ----------------------------------------------------------------------------------


def test_cli_build_writes_atomically_and_prints_a_json_summary(k3_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    target = out / "k3.json"
    target.write_text('{"format": "k3ckpt-manifest", "version": 1}\n')  # an earlier manifest: replaced
    old_inode = target.stat().st_ino
    res = run("manifest", "build", str(k3_tiny), "-o", str(target), "--tensor-hashes", "--json", "--jobs", "2")
    assert res.exit_code == 0, res.output
    assert sorted(os.listdir(out)) == ["k3.json"]  # no temp file left beside it
    assert target.stat().st_ino != old_inode  # replaced by rename, not rewritten in place
    expected = build_manifest(k3_tiny, tensor_hashes=True)
    assert target.read_text() == expected.to_json()
    summary = json.loads(res.output)
    assert summary == {"output": str(target), "files": len(expected.files), "tensors": len(expected.tensors),
                       "bytes": expected.total_bytes, "tensor_hashes": True, "source": {}}
    assert summary["files"] == 17

    res = run("manifest", "build", str(k3_tiny), "-o", str(out / "plain.json"))
    assert res.exit_code == 0 and res.output == ""  # quiet success
    assert Manifest.load(out / "plain.json").to_json() == build_manifest(k3_tiny).to_json()
    assert sorted(os.listdir(out)) == ["k3.json", "plain.json"]


def test_cli_build_on_a_missing_directory_exits_2(tmp_path: Path) -> None:
    res = run("manifest", "build", str(tmp_path / "nope"), "-o", str(tmp_path / "m.json"))
    assert res.exit_code == 2
    assert "no such directory" in res.output
    assert not (tmp_path / "m.json").exists()


# -- other families -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gptoss_tiny", "k2_tiny"])
def test_other_families_build_and_verify_cleanly(family: str, request, tmp_path: Path) -> None:
    root: Path = request.getfixturevalue(family)
    m = build_manifest(root, tensor_hashes=True)
    ckpt = open_checkpoint(root)
    assert sorted(m.files) == list(iter_checkpoint_files(root))
    assert m.tensors.keys() == ckpt.tensors.keys()
    for name, t in m.tensors.items():
        raw = (root / t.file).read_bytes()[t.offsets[0]:t.offsets[1]]
        assert t.sha256 == hashlib.sha256(raw).hexdigest()
        assert raw == ckpt.read_tensor(name).tobytes(), name
    m.save(tmp_path / "m.json")
    rep = verify_checkpoint(root, manifest=Manifest.load(tmp_path / "m.json"), cache_directory=tmp_path / "cache")
    assert rep.ok and rep.issues == [], [str(i) for i in rep.issues]
    assert rep.files_hashed == len(m.files)


def test_build_never_replaces_a_file_that_is_not_a_manifest(k3_tiny: Path, tmp_path: Path) -> None:
    """manifest build/pull replace only a k3ckpt manifest: -o naming the checkpoint's own
    config.json (or any other file) is refused, and the file is untouched."""
    target = tmp_path / "config.json"
    target.write_text('{"model_type": "kimi_k3"}\n')
    res = run("manifest", "build", str(k3_tiny), "-o", str(target))
    assert_one_line_error(res, 2, f"{target}: exists and is not a manifest k3ckpt wrote")
    assert target.read_text() == '{"model_type": "kimi_k3"}\n'
