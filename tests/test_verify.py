"""``verify``: every corruption class is made by the test from a clean synthetic checkpoint and
must be reported precisely - the right kind, the right file, the right tensor - by the library
and by the CLI (exit codes, --json, text grouped by kind).

Checkpoints that get broken are private copies of the session fixtures. Every run passes a
``cache_directory`` under ``tmp_path`` (or ``K3CKPT_CACHE_DIR`` for the CLI), so nothing touches
the user's cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from ckpt_edit import edit_index, rewrite_shard, shard_tensors
from ckpt_edit import set_byte as patch
from helpers import REPO, run, shard_of
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.format.header import read_header
from k3ckpt.integrity.manifest import Manifest, build_manifest
from k3ckpt.integrity.verify import KINDS, Issue, VerifyReport, verify_checkpoint

INDEX = "model.safetensors.index.json"
L1E3 = "language_model.model.layers.1.block_sparse_moe.experts.3."
PACKED = L1E3 + "w1.weight_packed"  # in the layer-1 shard
SCALE = L1E3 + "w2.weight_scale"
L1E3_SIX = [L1E3 + f"{w}.{p}" for w in ("w1", "w2", "w3") for p in ("weight_packed", "weight_scale")]
L2_PACKED = "language_model.model.layers.2.block_sparse_moe.experts.0.w1.weight_packed"  # layer-2 shard
L3_SCALE = "language_model.model.layers.3.block_sparse_moe.experts.5.w3.weight_scale"  # layer-3 shard

hub_needed = pytest.mark.skipif(
    importlib.util.find_spec("k3ckpt.hub.client") is None,
    reason="k3ckpt.hubclient (imported by verify --against) is not written yet",
)


# -- helpers ------------------------------------------------------------------------------------


def verify(path: Path, tmp_path: Path, **kw) -> VerifyReport:
    kw.setdefault("cache_directory", tmp_path / "cache")
    return verify_checkpoint(path, **kw)


def tensor_range(root: Path, tensor: str) -> tuple[str, int, int]:
    """``(file, start, stop)`` of a tensor, from its shard header."""
    f = shard_of(root, tensor)
    return (f, *read_header(root / f).absolute_range(tensor))


def edit_config(root: Path, **text_config) -> None:
    p = root / "config.json"
    c = json.loads(p.read_text())
    c["text_config"].update(text_config)
    p.write_text(json.dumps(c, indent=2))


def summary(issues: list[Issue]) -> list[tuple[str, str | None, str | None]]:
    return [(i.kind, i.file, i.tensor) for i in issues]


def of_kind(rep: VerifyReport, kind: str) -> list[Issue]:
    return [i for i in rep.issues if i.kind == kind]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def manifests(k3_tiny_manifests: dict[str, Path]) -> dict[str, Manifest]:
    """Manifests of the clean k3-tiny (with and without tensor hashes), loaded once."""
    out = {}
    for name, path in k3_tiny_manifests.items():
        out[name] = Manifest.load(path)
        out[name + "_path"] = path  # type: ignore[assignment]
    return out


@pytest.fixture
def ckpt(k3_tiny: Path, clone_checkpoint) -> Path:
    """A private, breakable copy of k3-tiny."""
    return clone_checkpoint(k3_tiny)


# -- clean --------------------------------------------------------------------------------------


def test_clean_checkpoint_passes_structure_only_and_against_a_manifest(k3_tiny: Path, tmp_path: Path,
                                                                        manifests) -> None:
    rep = verify(k3_tiny, tmp_path, use_cache=False)
    assert rep.ok and rep.issues == [] and rep.reference == "none (structure only)"
    assert rep.files == 17 and rep.mode == "full"
    rep = verify(k3_tiny, tmp_path, manifest=manifests["tensors"], manifest_label="m.json")
    assert rep.ok and rep.issues == [] and rep.reference == "manifest m.json"
    assert rep.files_hashed == 17 and rep.bytes_hashed == manifests["tensors"].total_bytes


# -- structure: headers -------------------------------------------------------------------------


def test_two_bad_headers_are_both_reported_and_the_other_shards_still_verified(ckpt: Path, tmp_path: Path) -> None:
    s2, s3 = shard_of(ckpt, L2_PACKED), shard_of(ckpt, L3_SCALE)
    f1, start, _ = tensor_range(ckpt, SCALE)  # a third shard, still read: its NaN must be found
    assert len({s2, s3, f1}) == 3
    patch(ckpt / f1, start, 0xFF)
    patch(ckpt / s2, 8, ord("["))  # header JSON no longer an object
    raw = bytearray((ckpt / s3).read_bytes())
    raw[8:16] = b'{"x":1,,'  # still an object, but broken JSON
    (ckpt / s3).write_bytes(bytes(raw))
    rep = verify(ckpt, tmp_path)
    headers = of_kind(rep, "header")
    assert summary(headers) == [("header", s2, None), ("header", s3, None)]
    assert headers[0].message == "header does not start with '{'"
    assert headers[1].message.startswith("header is not valid JSON")
    assert summary(of_kind(rep, "nan-scale")) == [("nan-scale", f1, SCALE)]
    assert not rep.ok
    # What is in the unreadable shards is reported once, as the header problem - never as one
    # index problem per tensor listed there.
    assert of_kind(rep, "index") == []


# -- structure: index vs headers ---------------------------------------------------------------


def _listed_but_absent(root: Path) -> None:
    edit_index(root, lambda wm: wm.__setitem__("language_model.model.layers.1.ghost.weight", shard_of(root, PACKED)))


def _wrong_shard(root: Path) -> None:
    other = shard_of(root, L2_PACKED)
    edit_index(root, lambda wm: wm.__setitem__(PACKED, other))


def _not_in_index(root: Path) -> None:
    edit_index(root, lambda wm: wm.pop(PACKED))


def _in_two_files(root: Path) -> None:
    src = shard_of(root, PACKED)
    (_, ts) = shard_tensors(root / src)
    copy = next(t for t in ts if t[0] == PACKED)
    rewrite_shard(root / shard_of(root, L2_PACKED), lambda ts: ts + [list(copy)])


@pytest.mark.parametrize(
    "corrupt, tensor, message",
    [
        (_listed_but_absent, "language_model.model.layers.1.ghost.weight",
         "listed in model.safetensors.index.json under {s1} but in no shard header"),
        (_wrong_shard, PACKED, "model.safetensors.index.json says {s2} but the tensor is in {s1}"),
        (_not_in_index, PACKED, "in {s1} but not listed in model.safetensors.index.json"),
        (_in_two_files, PACKED, "tensor appears in both {s1} and {s2}"),
    ],
    ids=["listed-but-absent", "wrong-shard", "not-in-index", "in-two-files"],
)
def test_index_and_headers_disagree(ckpt: Path, tmp_path: Path, corrupt, tensor: str, message: str) -> None:
    s1, s2 = shard_of(ckpt, PACKED), shard_of(ckpt, L2_PACKED)
    corrupt(ckpt)
    rep = verify(ckpt, tmp_path)
    assert summary(rep.issues) == [("index", None, tensor)], [str(i) for i in rep.issues]
    assert rep.issues[0].message == message.format(s1=s1, s2=s2)
    assert not rep.ok


# -- structure: paths ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["/abs/elsewhere.safetensors", "../outside.safetensors", "a/../../up.safetensors"])
def test_weight_map_path_escaping_the_directory(ckpt: Path, tmp_path: Path, bad: str) -> None:
    edit_index(ckpt, lambda wm: wm.__setitem__("language_model.model.layers.1.extra.weight", bad))
    rep = verify(ckpt, tmp_path)
    assert summary(rep.issues) == [("path", bad, None)], [str(i) for i in rep.issues]
    assert rep.issues[0].message == f"{INDEX} names a shard path that is absolute or outside the checkpoint"


def test_weight_map_path_of_a_real_tensor_escaping(ckpt: Path, tmp_path: Path) -> None:
    s1 = shard_of(ckpt, PACKED)
    edit_index(ckpt, lambda wm: wm.__setitem__(PACKED, "../" + s1))
    rep = verify(ckpt, tmp_path)
    assert summary(rep.issues) == [("index", None, PACKED), ("path", "../" + s1, None)]


def test_shard_symlinked_out_of_the_directory(ckpt: Path, tmp_path: Path) -> None:
    s1 = shard_of(ckpt, PACKED)
    outside = tmp_path / "elsewhere" / s1
    outside.parent.mkdir()
    shutil.move(ckpt / s1, outside)
    (ckpt / s1).symlink_to(outside)
    rep = verify(ckpt, tmp_path)
    assert summary(rep.issues) == [("path", s1, None)]
    assert rep.issues[0].message == f"is a symlink leading out of the checkpoint, to {outside.resolve()}"
    # A symlink that stays inside the checkpoint is fine.
    inside = ckpt / "real" / s1
    inside.parent.mkdir()
    shutil.move(outside, inside)
    (ckpt / s1).unlink()
    (ckpt / s1).symlink_to(Path("real") / s1)
    rep = verify(ckpt, tmp_path)
    assert rep.ok and rep.issues == []


def test_hf_cache_snapshot_links_into_blobs_are_allowed(k3_tiny: Path, tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--moonshotai--Kimi-K3"
    commit = "c" * 40
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in sorted(os.listdir(k3_tiny)):
        blob = repo / "blobs" / sha((k3_tiny / f).read_bytes())
        shutil.copyfile(k3_tiny / f, blob)
        (snap / f).symlink_to(Path("../../blobs") / blob.name)
    m = build_manifest(k3_tiny)
    rep = verify(repo, tmp_path, manifest=m)  # the repo folder resolves through refs/main
    assert rep.ok and rep.issues == [], [str(i) for i in rep.issues]
    # ... but a snapshot link out of the cache is not.
    s1 = shard_of(k3_tiny, PACKED)
    stray = tmp_path / "stray" / s1
    stray.parent.mkdir()
    shutil.copyfile(k3_tiny / s1, stray)
    (snap / s1).unlink()
    (snap / s1).symlink_to(stray)
    rep = verify(snap, tmp_path, manifest=m)
    assert summary(rep.issues) == [("path", s1, None)]


# -- structure: config vs tensors, MXFP4 pairs --------------------------------------------------


def test_expert_removed_from_shard_and_index(ckpt: Path, tmp_path: Path) -> None:
    s1 = shard_of(ckpt, PACKED)
    rewrite_shard(ckpt / s1, lambda ts: [t for t in ts if not t[0].startswith(L1E3)])
    edit_index(ckpt, lambda wm: [wm.pop(n) for n in L1E3_SIX])
    rep = verify(ckpt, tmp_path)
    assert [(i.kind, i.message) for i in rep.issues] == [("config", "layer 1: 1 of 16 routed experts missing: 3")]


def test_expert_with_a_tensor_missing(ckpt: Path, tmp_path: Path) -> None:
    s1 = shard_of(ckpt, PACKED)
    rewrite_shard(ckpt / s1, lambda ts: [t for t in ts if t[0] != L1E3 + "w3.weight_packed"])
    edit_index(ckpt, lambda wm: wm.pop(L1E3 + "w3.weight_packed"))
    rep = verify(ckpt, tmp_path)
    assert rep.issues and {i.kind for i in rep.issues} <= {"config", "mxfp4"}
    assert any(i.message == "layer 1 expert 3: 1 expert(s) do not have the usual 6 tensors (first shown: 5)"
               for i in rep.issues), [str(i) for i in rep.issues]


@pytest.mark.parametrize(
    "num_experts, message",
    [(12, "layer {l}: expert ids beyond num_experts 12: 12, 13, 14, 15"),
     (20, "layer {l}: 4 of 20 routed experts missing: 16, 17, 18, 19")],
)
def test_num_experts_changed_in_config(ckpt: Path, tmp_path: Path, num_experts: int, message: str) -> None:
    edit_config(ckpt, num_experts=num_experts)
    rep = verify(ckpt, tmp_path)
    assert [(i.kind, i.message) for i in rep.issues] == [("config", message.format(l=layer)) for layer in (1, 2, 3, 4)]


def _bad_scale_shape(ckpt: Path) -> str:
    s1 = shard_of(ckpt, PACKED)
    name = L1E3 + "w1.weight_scale"  # [64, 4] -> [64, 2]: no longer pairs with [64, 64] packed

    def shrink(ts: list[list]) -> list[list]:
        return [[n, d, (s[0], s[1] // 2), b[: len(b) // 2]] if n == name else [n, d, s, b] for n, d, s, b in ts]

    rewrite_shard(ckpt / s1, shrink)
    return name


def test_mxfp4_scale_of_wrong_shape_is_reported(ckpt: Path, tmp_path: Path) -> None:
    name = _bad_scale_shape(ckpt)
    rep = verify(ckpt, tmp_path)
    assert [(i.kind, i.file, i.tensor, i.message) for i in rep.issues] == [
        ("mxfp4", shard_of(ckpt, name), name, "shape [64, 2] differs from the other experts' [64, 4]")
    ]


def test_mxfp4_scale_of_wrong_shape_names_the_tensor(ckpt: Path, tmp_path: Path) -> None:
    name = _bad_scale_shape(ckpt)
    rep = verify(ckpt, tmp_path)
    assert any(i.tensor == name or name in i.message or "expert 3" in i.message for i in rep.issues)


# -- structure: NaN scale bytes -----------------------------------------------------------------


def test_nan_scale_byte_names_exactly_that_tensor_and_no_scan_skips_it(ckpt: Path, tmp_path: Path,
                                                                       monkeypatch) -> None:
    f, start, stop = tensor_range(ckpt, SCALE)
    assert stop - start == 256
    patch(ckpt / f, start + 77, 0xFF)
    rep = verify(ckpt, tmp_path, use_cache=False)
    assert summary(rep.issues) == [("nan-scale", f, SCALE)]
    assert "0xFF" in rep.issues[0].message and not rep.ok
    rep = verify(ckpt, tmp_path, use_cache=False, scan=False)
    assert rep.ok and rep.issues == []

    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cli-cache"))
    res = run("verify", str(ckpt), "--no-cache")
    assert res.exit_code == 1 and "[nan-scale] 1 problem\n" in res.output and SCALE in res.output
    res = run("verify", str(ckpt), "--no-cache", "--no-scan")
    # nothing wrong, but no reference proved the bytes: said so, exit 0 unless proof is required
    assert res.exit_code == 0 and res.output.startswith("not proven: "), res.output
    assert run("verify", str(ckpt), "--no-cache", "--no-scan", "--require-proof").exit_code == 1


def test_nan_in_the_last_byte_of_a_scale_and_not_in_packed_data(ckpt: Path, tmp_path: Path) -> None:
    f, start, stop = tensor_range(ckpt, L3_SCALE)
    patch(ckpt / f, stop - 1, 0xFF)  # last byte of the scale tensor
    _, pstart, _ = tensor_range(ckpt, PACKED)
    patch(ckpt / shard_of(ckpt, PACKED), pstart, 0xFF)  # 0xFF is a valid FP4 pair in packed data
    rep = verify(ckpt, tmp_path)
    assert summary(rep.issues) == [("nan-scale", f, L3_SCALE)]


# -- content vs manifest ------------------------------------------------------------------------


def test_flipped_byte_in_a_tensor(ckpt: Path, tmp_path: Path, manifests) -> None:
    f, start, stop = tensor_range(ckpt, PACKED)
    b = bytearray((ckpt / f).read_bytes())
    b[start + 100] ^= 0x10
    (ckpt / f).write_bytes(bytes(b))
    m = manifests["tensors"]
    rep = verify(ckpt, tmp_path, manifest=m)
    assert summary(rep.issues) == [("sha256", f, None), ("tensor-sha256", f, PACKED)]
    file_issue, tensor_issue = rep.issues
    assert file_issue.message == "content differs"
    assert (file_issue.expected, file_issue.actual) == (m.files[f].sha256, sha(bytes(b)))
    assert (tensor_issue.expected, tensor_issue.actual) == (m.tensors[PACKED].sha256, sha(bytes(b[start:stop])))
    # Without tensor hashes: the file, and nothing more.
    rep = verify(ckpt, tmp_path, manifest=manifests["files"])
    assert summary(rep.issues) == [("sha256", f, None)]
    assert rep.issues[0].message == "content differs"


def test_changed_header_padding_is_content_outside_the_tensor_data(ckpt: Path, tmp_path: Path, manifests) -> None:
    padded = [f for f in manifests["tensors"].files if f.endswith(".safetensors")
              and (ckpt / f).read_bytes()[read_header(ckpt / f).data_start - 1] == ord(" ")]
    assert padded, "no shard with header padding"
    f = padded[0]
    patch(ckpt / f, read_header(ckpt / f).data_start - 1, ord("\t"))  # still valid JSON whitespace
    rep = verify(ckpt, tmp_path, manifest=manifests["tensors"])
    assert summary(rep.issues) == [("sha256", f, None)]
    assert rep.issues[0].message == "content differs outside the tensor data (header or padding)"
    rep = verify(ckpt, tmp_path, manifest=manifests["files"])
    assert summary(rep.issues) == [("sha256", f, None)] and rep.issues[0].message == "content differs"


def test_truncated_shard(ckpt: Path, tmp_path: Path, manifests) -> None:
    f = shard_of(ckpt, PACKED)
    size = (ckpt / f).stat().st_size
    os.truncate(ckpt / f, size - 1000)
    for name, m in (("tensors", manifests["tensors"]), ("files", manifests["files"])):
        rep = verify(ckpt, tmp_path, manifest=m)
        assert summary(of_kind(rep, "size")) == [("size", f, None)], name
        size_issue = of_kind(rep, "size")[0]
        assert (size_issue.expected, size_issue.actual) == (str(size), str(size - 1000))
        assert summary(of_kind(rep, "header")) == [("header", f, None)]
        assert "is past the data buffer" in of_kind(rep, "header")[0].message
        assert of_kind(rep, "sha256") == []  # the size already says it
        # Tensors past the new end differ; all of them are in that file.
        assert all(i.file == f for i in of_kind(rep, "tensor-sha256"))
        assert bool(of_kind(rep, "tensor-sha256")) == (name == "tensors")
        assert {i.kind for i in rep.issues} <= {"size", "header", "tensor-sha256", "config"}


def test_deleted_shard_and_deleted_license(ckpt: Path, tmp_path: Path, manifests) -> None:
    s3 = shard_of(ckpt, L3_SCALE)
    (ckpt / s3).unlink()
    (ckpt / "LICENSE").unlink()
    rep = verify(ckpt, tmp_path, manifest=manifests["tensors"])
    missing = of_kind(rep, "missing-file")
    assert {i.file for i in missing} == {"LICENSE", s3}
    assert [i.message for i in missing if i.file == "LICENSE"] == ["listed in the reference but not present"]
    assert not rep.ok and of_kind(rep, "tensor-layout") == []  # its tensors are not listed one by one


def test_deleted_non_weight_file(ckpt: Path, tmp_path: Path, manifests) -> None:
    (ckpt / "LICENSE").unlink()
    rep = verify(ckpt, tmp_path, manifest=manifests["files"])
    assert summary(rep.issues) == [("missing-file", "LICENSE", None)] and not rep.ok


def test_deleted_shard_is_reported_once(ckpt: Path, tmp_path: Path, manifests) -> None:
    s3 = shard_of(ckpt, L3_SCALE)
    (ckpt / s3).unlink()
    rep = verify(ckpt, tmp_path, manifest=manifests["files"])
    assert len(of_kind(rep, "missing-file")) == 1


def test_stray_file_is_a_warning(ckpt: Path, tmp_path: Path, manifests, monkeypatch) -> None:
    (ckpt / "notes").mkdir()
    (ckpt / "notes" / "stray.txt").write_text("hello\n")
    rep = verify(ckpt, tmp_path, manifest=manifests["tensors"])
    assert summary(rep.issues) == [("extra-file", "notes/stray.txt", None)]
    assert rep.issues[0].is_warning and rep.ok and rep.problems == []
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cli-cache"))
    res = run("verify", str(ckpt), "--manifest", str(manifests["tensors_path"]))
    assert res.exit_code == 0, res.output
    assert res.output.startswith("ok: ") and "[extra-file] 1 warning\n  notes/stray.txt: present but not" in res.output


def test_corrupt_config_json_is_reported_not_fatal(ckpt: Path, tmp_path: Path, manifests) -> None:
    (ckpt / "config.json").write_text('{"text_config": ')
    rep = verify(ckpt, tmp_path, manifest=manifests["files"])
    assert ("sha256", "config.json", None) in summary(rep.issues) or ("size", "config.json", None) in summary(rep.issues)


# -- hostile headers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header, data, length, message",
    [
        (b"{}", b"", 2**63, "header length 9223372036854775808 exceeds the"),
        (b"[" * 100_000, b"", None, "header does not start with '{'"),
        (b'{"t":' + b"[" * 100_000, b"", None, "header is not valid JSON"),
        (b'{"\xff\xfe": 1}', b"", None, "header is not valid UTF-8 (byte 2)"),
        (json.dumps({"t": {"dtype": "U8", "shape": [4], "data_offsets": [-4, 0]}}).encode(), b"\0" * 4, None,
         "tensor 't': data_offsets [-4, 0] is not [begin, end]"),
        (json.dumps({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}).encode(), b"\0" * 2, None,
         "tensor 't': data_offsets end 4 is past the data buffer (2 bytes)"),
        (json.dumps({"t": {"dtype": "U8", "shape": [4], "data_offsets": [2**64, 2**64 + 4]}}).encode(), b"\0" * 4,
         None, "tensor 't': data_offsets end 18446744073709551620 is past the data buffer (4 bytes)"),
        (b'{"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}', b"", 10**6,
         "header length 1000000 runs past the end of the"),
    ],
    ids=["length-2**63", "nested-arrays", "nested-in-object", "not-utf8", "negative-offsets",
         "offsets-past-file", "offsets-overflow-u64", "length-past-file"],
)
def test_hostile_headers_are_clean_header_issues(ckpt: Path, tmp_path: Path, write_raw, monkeypatch,
                                                 header: bytes, data: bytes, length: int | None,
                                                 message: str) -> None:
    s3 = shard_of(ckpt, L3_SCALE)
    write_raw(ckpt / s3, header, data, length=length)
    rep = verify(ckpt, tmp_path)
    headers = of_kind(rep, "header")
    assert summary(headers) == [("header", s3, None)], [str(i) for i in rep.issues]
    assert message in headers[0].message
    assert {i.kind for i in rep.issues} <= {"header", "config"} and not rep.ok
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cli-cache"))
    res = run("verify", str(ckpt), "--json")
    assert res.exit_code == 1
    out = json.loads(res.output)
    assert [(i["file"], i["kind"]) for i in out["issues"]["header"]] == [(s3, "header")]


# -- vs hub -------------------------------------------------------------------------------------


@pytest.fixture
def hub_env(monkeypatch, tmp_path: Path) -> None:
    """Keep whatever client k3ckpt.hubclient uses off the network and out of user caches."""
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "k3cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-home"))
    for var in ("HF_TOKEN", "HF_ENDPOINT", "MODELSCOPE_ENDPOINT", "MODELSCOPE_DOMAIN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def served(hub_env, served_hub) -> tuple[object, str]:
    return served_hub[0], REPO


@hub_needed
@pytest.mark.parametrize("hub_name", ["hf", "modelscope"])
def test_verify_against_a_hub_listing(served, hub_name: str, k3_tiny: Path, clone_checkpoint) -> None:
    hub, repo = served
    res = run("verify", str(k3_tiny), "--against", hub_name, "--repo", repo, "--endpoint", hub.url, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["ok"] is True and out["issues"] == {} and out["reference"].startswith(f"{hub_name}:{repo}@")

    bad = clone_checkpoint(k3_tiny)
    f, start, _ = tensor_range(bad, PACKED)
    b = bytearray((bad / f).read_bytes())
    b[start + 3] ^= 0x01
    (bad / f).write_bytes(bytes(b))
    lic = bytearray((bad / "LICENSE").read_bytes())
    lic[0] ^= 0x20  # same size, other content: a small (non-LFS) file
    (bad / "LICENSE").write_bytes(bytes(lic))
    res = run("verify", str(bad), "--against", hub_name, "--repo", repo, "--endpoint", hub.url, "--json")
    assert res.exit_code == 1, res.output
    out = json.loads(res.output)
    assert out["ok"] is False and sorted(out["issues"]) == ["sha256"]
    got = {i["file"]: i for i in out["issues"]["sha256"]}
    assert sorted(got) == ["LICENSE", f]
    assert got[f]["expected"] == sha((k3_tiny / f).read_bytes()) and got[f]["actual"] == sha(bytes(b))
    res = run("verify", str(bad), "--against", hub_name, "--repo", repo, "--endpoint", hub.url)
    assert res.exit_code == 1 and "[sha256] 2 problems" in res.output


def test_manifest_and_against_together_is_a_usage_error(k3_tiny: Path, tmp_path: Path, monkeypatch,
                                                         manifests) -> None:
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cli-cache"))
    res = run("verify", str(k3_tiny), "--manifest", str(manifests["files_path"]), "--against", "hf", "--repo", "o/r")
    assert res.exit_code == 2 and "use --manifest or --against, not both" in res.output
    res = run("verify", str(k3_tiny), "--against", "hf")
    assert res.exit_code == 2 and "--against needs --repo" in res.output
    assert not (tmp_path / "cli-cache").exists()


# -- quick mode and the stat cache ---------------------------------------------------------------


def test_quick_after_a_full_run_trusts_every_file(ckpt: Path, tmp_path: Path, manifests, monkeypatch) -> None:
    m = manifests["tensors"]
    before = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*"))
    full = verify(ckpt, tmp_path, manifest=m)
    assert full.ok and full.files_hashed == 17 and not full.structure_cached
    cache_files = list((tmp_path / "cache").rglob("*.json"))
    assert len(cache_files) == 1 and cache_files[0].parent == tmp_path / "cache" / "verify"
    assert json.loads(cache_files[0].read_text())["root"] == str(ckpt.resolve())
    # The cache is never written into the checkpoint.
    assert sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")) == before

    quick = verify(ckpt, tmp_path, manifest=m, quick=True)
    assert quick.ok and quick.issues == [] and quick.mode == "quick"
    assert quick.files_trusted == sorted(m.files) and quick.files_hashed == 0 and quick.bytes_hashed == 0
    assert quick.files_size_only == [] and quick.structure_cached

    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    res = run("verify", str(ckpt), "--manifest", str(manifests["tensors_path"]))
    assert res.exit_code == 0, res.output
    res = run("verify", str(ckpt), "--manifest", str(manifests["tensors_path"]), "--quick")
    assert res.exit_code == 0, res.output
    head = res.output.splitlines()[0]
    assert head.startswith("ok: ") and "(quick; reference: manifest " in head
    assert "17 files, 0 hashed" in head and "17 trusted from the stat cache" in head
    assert "structure unchanged since the last check" in head


def test_quick_remembers_nan_and_sha256_problems_from_the_last_full_run(ckpt: Path, tmp_path: Path,
                                                                         manifests) -> None:
    m = manifests["tensors"]
    f, start, _ = tensor_range(ckpt, SCALE)
    patch(ckpt / f, start + 1, 0xFF)
    full = verify(ckpt, tmp_path, manifest=m)
    assert summary(full.issues) == [("sha256", f, None), ("tensor-sha256", f, SCALE), ("nan-scale", f, SCALE)]
    for _ in range(2):
        quick = verify(ckpt, tmp_path, manifest=m, quick=True)
        assert quick.structure_cached and quick.files_hashed == 0
        assert quick.issues == full.issues
        assert f not in quick.files_trusted and len(quick.files_trusted) == 16


def test_quick_stops_trusting_a_file_whose_content_changed_at_the_same_size(ckpt: Path, tmp_path: Path,
                                                                             manifests) -> None:
    m = manifests["tensors"]
    assert verify(ckpt, tmp_path, manifest=m).ok
    f, start, _ = tensor_range(ckpt, PACKED)
    st = (ckpt / f).stat()
    patch(ckpt / f, start, (ckpt / f).read_bytes()[start] ^ 0x01)
    os.utime(ckpt / f, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))  # a later mtime, surely
    assert (ckpt / f).stat().st_size == st.st_size and (ckpt / f).stat().st_ino == st.st_ino
    quick = verify(ckpt, tmp_path, manifest=m, quick=True)
    assert quick.files_size_only == [f] and f not in quick.files_trusted
    assert len(quick.files_trusted) == 16 and quick.files_hashed == 0
    assert not quick.structure_cached and quick.ok  # size is all quick mode can say about it
    full = verify(ckpt, tmp_path, manifest=m)
    assert summary(full.issues) == [("sha256", f, None), ("tensor-sha256", f, PACKED)]


def test_quick_on_a_never_verified_checkpoint_is_size_only(ckpt: Path, tmp_path: Path, manifests,
                                                           monkeypatch) -> None:
    rep = verify(ckpt, tmp_path, manifest=manifests["files"], quick=True)
    assert rep.files_size_only == sorted(manifests["files"].files) and rep.files_trusted == []
    assert rep.ok and rep.files_hashed == 0 and not rep.structure_cached
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "other-cache"))
    res = run("verify", str(ckpt), "--manifest", str(manifests["files_path"]), "--quick")
    assert res.exit_code == 0
    assert "17 checked by size only (no cached digest)" in res.output.splitlines()[0]


def test_quick_still_catches_a_size_change_and_a_new_nan(ckpt: Path, tmp_path: Path, manifests) -> None:
    m = manifests["files"]
    assert verify(ckpt, tmp_path, manifest=m).ok
    (ckpt / "generation_config.json").write_text('{"max_new_tokens": 1}\n')
    f, start, _ = tensor_range(ckpt, L3_SCALE)
    patch(ckpt / f, start, 0xFF)
    rep = verify(ckpt, tmp_path, manifest=m, quick=True)
    assert summary(rep.issues) == [("size", "generation_config.json", None), ("nan-scale", f, L3_SCALE)]


def test_no_cache_writes_nothing(ckpt: Path, tmp_path: Path, manifests, monkeypatch) -> None:
    rep = verify(ckpt, tmp_path, manifest=manifests["files"], use_cache=False)
    assert rep.ok and not (tmp_path / "cache").exists()
    rep = verify(ckpt, tmp_path, manifest=manifests["files"], use_cache=False, quick=True)
    assert rep.files_trusted == [] and not (tmp_path / "cache").exists()
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cli-cache"))
    assert run("verify", str(ckpt), "--no-cache").exit_code == 0
    assert not (tmp_path / "cli-cache").exists()
    assert run("verify", str(ckpt)).exit_code == 0
    assert len(list((tmp_path / "cli-cache" / "verify").glob("*.json"))) == 1


# -- CLI: exit codes and output ----------------------------------------------------------------


def test_exit_codes(ckpt: Path, tmp_path: Path, manifests, monkeypatch) -> None:
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cli-cache"))
    assert run("verify", str(ckpt), "--manifest", str(manifests["files_path"])).exit_code == 0
    res = run("verify", str(tmp_path / "nope"))
    assert res.exit_code == 2 and res.output.strip() == f"k3ckpt: error: {tmp_path / 'nope'}: no such directory"
    notjson = tmp_path / "m.json"
    notjson.write_text("not json")
    res = run("verify", str(ckpt), "--manifest", str(notjson))
    assert res.exit_code == 2 and res.output.startswith(f"k3ckpt: error: {notjson}: not valid JSON (")
    res = run("verify", str(ckpt), "--manifest", str(tmp_path / "absent.json"))
    assert res.exit_code == 2 and "absent.json: not found" in res.output
    (ckpt / "LICENSE").unlink()
    assert run("verify", str(ckpt), "--manifest", str(manifests["files_path"])).exit_code == 1


def test_json_and_text_output_group_issues_by_kind(ckpt: Path, tmp_path: Path, manifests, monkeypatch) -> None:
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cli-cache"))
    f, start, _ = tensor_range(ckpt, PACKED)
    b = bytearray((ckpt / f).read_bytes())
    b[start + 5] ^= 0x04
    (ckpt / f).write_bytes(bytes(b))
    (ckpt / "LICENSE").unlink()
    (ckpt / "stray.bin").write_bytes(b"\0")
    m = manifests["tensors"]
    res = run("verify", str(ckpt), "--manifest", str(manifests["tensors_path"]), "--json")
    assert res.exit_code == 1
    out = json.loads(res.output)
    assert out["ok"] is False and out["mode"] == "full"
    assert sorted(out["issues"]) == ["extra-file", "missing-file", "sha256", "tensor-sha256"]
    assert out["issues"]["sha256"] == [{"kind": "sha256", "file": f, "message": "content differs", "tensor": None,
                                        "expected": m.files[f].sha256, "actual": sha(bytes(b))}]
    (t,) = out["issues"]["tensor-sha256"]
    assert (t["file"], t["tensor"], t["expected"]) == (f, PACKED, m.tensors[PACKED].sha256)
    assert out["issues"]["missing-file"][0]["file"] == "LICENSE"
    assert out["issues"]["extra-file"][0]["file"] == "stray.bin"
    assert out["files_hashed"] == 16 and out["files"] == 17

    res = run("verify", str(ckpt), "--manifest", str(manifests["tensors_path"]))
    assert res.exit_code == 1
    lines = res.output.splitlines()
    assert lines[0].startswith(f"FAILED: {ckpt.resolve()} (full; reference: manifest ")
    assert lines[1:] == [
        "[missing-file] 1 problem",
        "  LICENSE: listed in the reference but not present",
        "[sha256] 1 problem",
        f"  {f}: content differs (expected {m.files[f].sha256}, got {sha(bytes(b))})",
        "[tensor-sha256] 1 problem",
        f"  {f} tensor {PACKED}: tensor bytes differ (expected {m.tensors[PACKED].sha256}, got {t['actual']})",
        "[extra-file] 1 warning",
        "  stray.bin: present but not in the reference",
    ]


def test_report_orders_issues_by_kind() -> None:
    rep = VerifyReport("/x", "full", "none")
    rep.issues = [Issue("extra-file", "z", "m"), Issue("header", "a", "m"), Issue("missing-file", "b", "m")]
    assert list(rep.grouped()) == ["missing-file", "header", "extra-file"]
    assert rep.ok is False and [i.kind for i in rep.problems] == ["header", "missing-file"]
    assert set(KINDS) >= {"missing-file", "size", "sha256", "tensor-sha256", "header", "index", "path", "config",
                          "mxfp4", "nan-scale", "extra-file"}


# -- other families ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gptoss_tiny", "k2_tiny"])
def test_other_families_verify_cleanly_and_catch_a_flipped_byte(family: str, request, tmp_path: Path,
                                                                clone_checkpoint) -> None:
    root: Path = request.getfixturevalue(family)
    m = build_manifest(root, tensor_hashes=True)
    rep = verify(root, tmp_path, manifest=m)
    assert rep.ok and rep.issues == [], [str(i) for i in rep.issues]
    assert verify(root, tmp_path, manifest=m, quick=True).files_trusted == sorted(m.files)
    d = clone_checkpoint(root)
    name, t = max(m.tensors.items(), key=lambda kv: kv[1].offsets[1] - kv[1].offsets[0])
    patch(d / t.file, t.offsets[0] + 1, (d / t.file).read_bytes()[t.offsets[0] + 1] ^ 0x02)
    rep = verify(d, tmp_path, manifest=m)
    assert summary(rep.issues) == [("sha256", t.file, None), ("tensor-sha256", t.file, name)]


def test_gptoss_stacked_scales_are_scanned_for_nan(gptoss_tiny: Path, clone_checkpoint, tmp_path: Path) -> None:
    d = clone_checkpoint(gptoss_tiny)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    f, start, stop = tensor_range(d, name)
    patch(d / f, (start + stop) // 2, 0xFF)
    assert summary(verify(d, tmp_path, use_cache=False).issues) == [("nan-scale", f, name)]


# -- reading in chunks, sparse files -------------------------------------------------------------


def test_tensor_hashes_and_scan_across_read_chunk_boundaries(k3_tiny: Path, clone_checkpoint, tmp_path: Path,
                                                             monkeypatch, manifests) -> None:
    chunk = 997  # a prime: chunk boundaries fall inside tensors at odd places
    monkeypatch.setenv("K3CKPT_HASH_BUFFER", str(chunk))
    assert build_manifest(k3_tiny, tensor_hashes=True).to_json() == manifests["tensors"].to_json()
    d = clone_checkpoint(k3_tiny)
    ckpt = open_checkpoint(d)
    f = ckpt.tensors[PACKED].file
    h = ckpt.shards[f]
    # A scale tensor that a chunk boundary splits; the NaN goes just after the boundary.
    name, (start, stop) = next((n, h.absolute_range(n)) for n in sorted(h.tensors) if n.endswith("weight_scale")
                               and any(k % chunk == 0 for k in range(h.absolute_range(n)[0] + 1,
                                                                      h.absolute_range(n)[1])))
    boundary = next(k for k in range(start + 1, stop) if k % chunk == 0)
    patch(d / f, boundary + 1, 0xFF)
    rep = verify(d, tmp_path, manifest=manifests["tensors"], use_cache=False)
    assert summary(rep.issues) == [("sha256", f, None), ("tensor-sha256", f, name), ("nan-scale", f, name)]
    rep = verify(d, tmp_path, manifest=manifests["tensors"], use_cache=False, quick=True)  # scan_file path
    assert summary(rep.issues) == [("nan-scale", f, name)]


def test_nan_written_into_a_hole_of_a_sparse_headers_only_checkpoint(tmp_path: Path) -> None:
    from k3ckpt.testing.synth import spec_from_preset, synthesize

    d = tmp_path / "sparse"
    synthesize(spec_from_preset("k3-tiny", headers_only=True), d)
    assert verify(d, tmp_path, use_cache=False).ok  # zero scales are valid (2**-127), holes included
    f, start, _ = tensor_range(d, SCALE)
    fd = os.open(d / f, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff", start + 100)  # keeps the rest of the file sparse
    finally:
        os.close(fd)
    for quick in (True, False):  # quick: scan_file skipping holes (SEEK_DATA); full: the hashing read
        rep = verify(d, tmp_path, use_cache=False, quick=quick)
        assert summary(rep.issues) == [("nan-scale", f, SCALE)], quick


def test_nan_scan_follows_the_headers_when_the_manifest_layout_disagrees(ckpt: Path, tmp_path: Path, manifests) -> None:
    """Full verify scans scales at the offsets of each file's own header while hashing; a
    manifest that says otherwise is a layout issue, and a NaN is named where it really is."""
    m = manifests["tensors"]
    twin = L3_SCALE.replace("experts.5.", "experts.6.")
    # The manifest swaps where two same-shaped scales are: a layout disagreement.
    fake = Manifest(dict(m.files), {**m.tensors, L3_SCALE: m.tensors[twin], twin: m.tensors[L3_SCALE]},
                    dict(m.source), m.tensor_hashes)
    f, start, _ = tensor_range(ckpt, L3_SCALE)
    patch(ckpt / f, start + 3, 0xFF)
    rep = verify(ckpt, tmp_path, manifest=fake)
    assert summary(of_kind(rep, "nan-scale")) == [("nan-scale", f, L3_SCALE)]
    assert {i.tensor for i in of_kind(rep, "tensor-layout")} == {L3_SCALE, twin}


def test_an_error_during_the_structure_check_stops_the_background_hashing(ckpt: Path, tmp_path: Path, manifests,
                                                                          monkeypatch) -> None:
    import threading
    import time as _time

    import k3ckpt.integrity.hashing as hashing_mod
    import k3ckpt.integrity.verify as verify_mod

    started = threading.Event()
    real_hash_file = hashing_mod.hash_file

    def slow_hash_file(*a, **kw):
        started.set()
        _time.sleep(0.3)  # still hashing when the structure check fails
        return real_hash_file(*a, **kw)

    def boom(*a, **kw):
        started.wait(5)
        raise KeyboardInterrupt

    monkeypatch.setattr(hashing_mod, "hash_file", slow_hash_file)
    monkeypatch.setattr(verify_mod, "structure_issues", boom)
    t0 = _time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        verify(ckpt, tmp_path, manifest=manifests["tensors"], jobs=1)
    deadline = _time.perf_counter() + 5
    while any(t.name.startswith(("ThreadPoolExecutor", "k3ckpt-hash")) and t.is_alive() for t in threading.enumerate()):
        assert _time.perf_counter() < deadline, "hashing threads kept running after the error"
        _time.sleep(0.05)
    # cancelled at the next chunk: far less than hashing all 15 files at 0.3 s each
    assert _time.perf_counter() - t0 < 15 * 0.3


# -- hashing through mapped windows ---------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 100_003])
@pytest.mark.parametrize("chunk", [997, 4096, 1 << 20])
def test_chunked_reads_hash_what_one_read_hashes(tmp_path: Path, size: int, chunk: int) -> None:
    """Every read size (not a multiple of the page size too, and larger than the file) gives the
    file's sha256, its spans' sha256 and the scan's finds, with a chunk boundary every ``chunk``
    bytes; a buffer passed in, larger than a chunk and full of stale 0xFF bytes, changes nothing:
    only the bytes read are hashed and searched."""
    from k3ckpt.integrity.hashing import Span, hash_file

    data = bytes((i * 7 + i // 4099) % 251 for i in range(size))
    if size > 5000:
        data = data[:4500] + b"\xff" + data[4501:]
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    spans = [Span("a", 0, size // 3), Span("b", size // 3, size // 3 + 17), Span("c", size - size // 5, size)]
    scan = [Span("s", 4000, 5000), Span("t", 0, 100)] if size > 5000 else []
    want = {s.name: hashlib.sha256(data[s.start:s.stop]).hexdigest() for s in spans}
    seen: list[int] = []
    d = hash_file(p, spans=spans, scan=scan, chunk_bytes=chunk, progress=seen.append)
    assert d.sha256 == hashlib.sha256(data).hexdigest() and d.size == size and d.spans == want
    assert d.flagged == (["s"] if scan else None)
    assert seen == [min(chunk, size - k) for k in range(0, size, chunk)]  # the chunk boundaries
    buffer = bytearray(b"\xff" * (chunk + 13))  # stale bytes past each chunk must not be hashed or searched
    given = hash_file(p, spans=spans, scan=[Span("t", 0, 100)], chunk_bytes=chunk, buffer=buffer)
    assert (given.sha256, given.spans, given.flagged) == (d.sha256, d.spans, [])


_SHRINK_WHILE_HASHING = """
import os, sys
from k3ckpt.errors import HashError
from k3ckpt.integrity.hashing import hash_file

path = sys.argv[1]
with open(path, "wb") as f:
    f.truncate(64 << 20)
mode = sys.argv[2]

def after_chunk(n):
    if mode == "shrink":
        os.truncate(path, (1 << 20) + 4096)  # before the next chunk: the next read finds the end
    else:
        with open(path, "ab") as f:
            f.write(b"more")

try:
    hash_file(path, chunk_bytes=4 << 20, progress=after_chunk)
except HashError as e:
    print("HashError:", e.strerror)
    sys.exit(1)
print("ok")
"""


@pytest.mark.parametrize("mode", ["shrink", "grow"])
def test_a_file_changing_size_while_hashed_is_an_error_not_a_crash(tmp_path: Path, mode: str) -> None:
    """A file truncated (by someone else) between chunks is a HashError naming what was read
    against the size now, and one that grew is an error too (the read stops at the size it
    had: it does not chase a growing file). In a child process: a regression that hangs or
    kills it does not take the test run with it."""
    import subprocess
    import sys

    p = tmp_path / "moving.bin"
    res = subprocess.run([sys.executable, "-c", _SHRINK_WHILE_HASHING, str(p), mode], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "HashError:" in res.stdout and "changed while hashing?" in res.stdout, res.stdout
    if mode == "shrink":
        assert "read 4194304 bytes but the file is 1052672" in res.stdout


@pytest.mark.parametrize("change", ["file", "dtype", "shape", "offsets", "dropped", "added"])
def test_each_way_the_manifest_layout_can_differ_from_the_headers(k3_tiny: Path, tmp_path: Path, manifests,
                                                                  change: str) -> None:
    """The layout check decides agreement on whole columns per shard; any one tensor's file,
    dtype, shape or offsets differing, or a tensor missing or extra, is still named."""
    m = manifests["files"]
    t = m.tensors[SCALE]
    other = next(f for f in m.files if f.endswith(".safetensors") and f != t.file)
    tensors = dict(m.tensors)
    if change == "dropped":
        del tensors[SCALE]
    elif change == "added":
        tensors[SCALE + "_twin"] = t
    else:
        alter = {"file": other, "dtype": "F32", "shape": (*t.shape, 1), "offsets": (t.offsets[0], t.offsets[1] + 1)}
        tensors[SCALE] = t._replace(**{change: alter[change]})
    rep = verify(k3_tiny, tmp_path, manifest=Manifest(dict(m.files), tensors, dict(m.source), m.tensor_hashes),
                 use_cache=False)
    layout = of_kind(rep, "tensor-layout")
    named = SCALE + "_twin" if change == "added" else SCALE
    assert [i.tensor for i in layout] == [named], layout
    if change not in ("dropped", "added"):
        assert layout[0].message == f"{change} differs"
    assert verify(k3_tiny, tmp_path, manifest=m, use_cache=False).ok


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs procfs")
def test_a_file_that_says_it_is_empty_but_reads_more_is_read_not_mapped() -> None:
    """A size-0 file is never mapped: what a read gives is hashed and checked against the size,
    as before mapped windows (procfs says 0 and reads more: changed while hashing)."""
    from k3ckpt.errors import HashError
    from k3ckpt.integrity.hashing import hash_file

    with pytest.raises(HashError, match=r"read [1-9]\d* bytes but the file is 0 \(changed while hashing\?\)"):
        hash_file("/proc/self/status")
