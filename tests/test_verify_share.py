"""``verify`` on a share - a node directory (``reshard``, ``fetch --node``) or a rank-aware fetch's
copy (``fetch --format partial``): everything present is checked against a tensor-hash manifest
(tensors at the share's own offsets), what the node's ranks need must be present, and the other
nodes' experts are counted, never reported. Also: ``manifest pull --tensor-hashes`` (streamed,
tied to the hub's published sha256), ``verify --against`` on a share, signed manifests, quick
mode, and a SIGKILLed rank-aware fetch before and after its resume."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ckpt_edit import drop_tensors, flip_byte
from helpers import REPO, assert_one_line_error, kill_at_pause, run
from k3ckpt.format.header import read_header
from k3ckpt.format.layout import NODE_MARKER, PARTIAL_MARKER
from k3ckpt.format.roles import Kind, classify
from k3ckpt.hub.pull import pull_manifest
from k3ckpt.integrity.manifest import Manifest, build_manifest, diff_manifests

CHUNK = 16 * 1024
NODE1 = ("--ep", "4", "--gpus-per-node", "2")  # node 1 holds ranks 2-3: experts 8-15 of 16
PARTIAL0 = ("--ep", "8", "--tp", "2", "--node", "0", "--gpus-per-node", "4", "--format", "partial")  # experts 0-7
EXPERT_FILE = "model-rank-00003-experts-00001-of-00001.safetensors"
EXPERT = "language_model.model.layers.2.block_sparse_moe.experts.13.w2.weight_packed"
DENSE = "language_model.model.layers.0.mlp.down_proj.weight"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")


@pytest.fixture(scope="module")
def manifests(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``tensors``: the pinned tensor-hash manifest of k3-tiny; ``files``: one without tensor hashes."""
    d = tmp_path_factory.mktemp("manifests")
    build_manifest(k3_tiny, tensor_hashes=True).save(d / "k3.tensors.json")
    build_manifest(k3_tiny).save(d / "k3.json")
    return {"tensors": d / "k3.tensors.json", "files": d / "k3.json"}


@pytest.fixture(scope="module")
def resharded(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reshard") / "out"
    res = run("reshard", str(k3_tiny), "-o", str(out), *NODE1)
    assert res.exit_code == 0, res.output
    return out / "node-00001"


@pytest.fixture()
def node(resharded: Path, clone_checkpoint: Any) -> Path:
    """A private copy of reshard's node 1 that a test may break."""
    return clone_checkpoint(resharded)


def verify(share: Path, *args: str) -> Any:
    return run("verify", str(share), *args)


def not_local(manifest: Path, experts: set[int]) -> int:
    """Tensors of the manifest that are other nodes' routed experts."""
    roles = (classify(n) for n in Manifest.load(manifest).tensors)
    return sum(1 for r in roles if r.kind == Kind.ROUTED_EXPERT and r.expert is not None and r.expert not in experts)


def data_offset(path: Path, tensor: str) -> int:
    return read_header(path).absolute_range(tensor)[0]


# -- a node directory (reshard) ------------------------------------------------------------------


def test_node_dir_verifies_clean_against_the_tensor_manifest(resharded: Path, manifests: dict[str, Path]) -> None:
    res = verify(resharded, "--manifest", str(manifests["tensors"]))
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    held = len(json.loads((resharded / NODE_MARKER).read_text())["tensors"])
    skipped = not_local(manifests["tensors"], set(range(8, 16)))
    assert lines[0].startswith("ok: ")
    assert lines[1] == (f"node share ({NODE_MARKER}; node 1, ranks 2-3): {held:,} tensors checked, "
                        f"{skipped:,} not local (other nodes' experts)")
    assert lines[2] == f"proven by manifest {manifests['tensors']}"
    assert len(lines) == 3 and skipped > 0  # nothing about the experts the node does not hold

    rep = json.loads(verify(resharded, "--manifest", str(manifests["tensors"]), "--json").output)
    assert rep["ok"] and rep["issues"] == {}
    share = rep["share"]
    assert (share["kind"], share["node"], share["ranks"], share["experts"]) == ("node", 1, [2, 3], list(range(8, 16)))
    assert (share["tensors_checked"], share["tensors_not_local"], share["tensors_missing"]) == (held, skipped, 0)


def test_a_bad_manifest_is_said_first_while_the_share_opens(node: Path, tmp_path: Path) -> None:
    """verify opens a share's headers while it parses the manifest: a manifest that cannot be
    read is the one error said, as when it was read first - also when the share cannot be opened."""
    notjson = tmp_path / "m.json"
    notjson.write_text("not json")
    res = verify(node, "--manifest", str(notjson))
    assert res.exit_code == 2 and res.output.startswith(f"k3ckpt: error: {notjson}: not valid JSON (")
    assert res.output.count("\n") == 1
    (node / "model.safetensors.index.json").write_text("not json")
    alone = verify(node)
    assert alone.exit_code == 2 and "model.safetensors.index.json: not valid JSON" in alone.output  # its own error
    res = verify(node, "--manifest", str(tmp_path / "absent.json"))
    assert res.exit_code == 2 and res.output.strip() == f"k3ckpt: error: {tmp_path / 'absent.json'}: not found"


def test_a_flipped_byte_in_one_expert_is_named(node: Path, manifests: dict[str, Path]) -> None:
    flip_byte(node / EXPERT_FILE, data_offset(node / EXPERT_FILE, EXPERT) + 7)
    res = verify(node, "--manifest", str(manifests["tensors"]))
    assert res.exit_code == 1
    assert res.output.splitlines()[0].startswith("FAILED: ")
    problems = [ln for ln in res.output.splitlines() if ln.startswith("  ")]
    assert problems == [next(ln for ln in problems if ln.startswith(f"  {EXPERT_FILE} tensor {EXPERT}: tensor bytes differ"))]
    # without a manifest the node marker's own digests still name it
    res = verify(node)
    assert res.exit_code == 1 and f"{EXPERT_FILE} tensor {EXPERT}: tensor bytes differ from {NODE_MARKER}'s record" in res.output


def test_a_changed_header_byte_is_found_by_the_markers_file_digest(node: Path) -> None:
    path = node / EXPERT_FILE
    raw = path.read_bytes()
    pad = raw.index(b" " * 8, 8, read_header(path).data_start)  # the header's padding: no tensor data changes
    path.write_bytes(raw[:pad] + b"\t" + raw[pad + 1:])
    for quick in ((), ("--quick",)):  # the full run's finding, then remembered while the file is unchanged
        res = verify(node, *quick)
        assert res.exit_code == 1
        assert f"{EXPERT_FILE}: content differs from {NODE_MARKER}'s record outside the tensor data" in res.output


def test_the_marker_records_each_files_segments_digest_and_a_version_1_marker_still_verifies(node: Path) -> None:
    """Marker version 2 records ``segments_sha256`` per file (docs/layout.md), computed here from
    the bytes alone; a version-1 marker (a plain sha256 per file, k3ckpt before 2026-12-04) is
    still checked: clean it verifies, and a changed byte - in a tensor, or in the header outside
    any tensor - is found against its sha256."""
    import hashlib

    from helpers import segments_digest

    marker = json.loads((node / NODE_MARKER).read_text())
    assert marker["version"] == 2
    for name, entry in marker["files"].items():
        assert entry["segments_sha256"] == segments_digest((node / name).read_bytes()) and "sha256" not in entry
    marker["version"] = 1
    for name, entry in marker["files"].items():
        entry["sha256"] = hashlib.sha256((node / name).read_bytes()).hexdigest()
        del entry["segments_sha256"]
    (node / NODE_MARKER).write_text(json.dumps(marker))
    res = verify(node)
    assert res.exit_code == 0 and res.output.startswith("not proven: "), res.output  # clean; no origin named
    path = node / EXPERT_FILE
    raw = path.read_bytes()
    pad = raw.index(b" " * 8, 8, read_header(path).data_start)
    path.write_bytes(raw[:pad] + b"\t" + raw[pad + 1:])
    res = verify(node)
    assert res.exit_code == 1
    assert f"{EXPERT_FILE}: content differs from {NODE_MARKER}'s record outside the tensor data" in res.output
    path.write_bytes(raw)
    flip_byte(path, data_offset(path, EXPERT) + 3)
    res = verify(node)
    assert res.exit_code == 1 and f"{EXPERT_FILE} tensor {EXPERT}: tensor bytes differ from {NODE_MARKER}'s record" in res.output


def test_node_files_are_hashed_by_their_tensors_only(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify reads each node file once and hashes each of its bytes once: its tensors' sha256
    and its header give the digest the marker records, so no sha256 of the whole file is taken
    (which would double the CPU); a flipped byte is still found."""
    from k3ckpt.integrity import share

    seen: dict[str, str] = {}
    real = share.hash_files

    def recording(*args: Any, **kw: Any) -> Any:
        digests, errors = real(*args, **kw)
        seen.update({f: d.sha256 for f, d in digests.items()})
        return digests, errors

    monkeypatch.setattr(share, "hash_files", recording)
    res = verify(node)
    assert res.exit_code == 0, res.output
    weights = {p.name for p in node.glob("*.safetensors")}
    assert weights and {f: seen[f] for f in weights} == dict.fromkeys(weights, "")
    flip_byte(node / EXPERT_FILE, data_offset(node / EXPERT_FILE, EXPERT) + 1)
    assert verify(node).exit_code == 1


def test_a_deleted_file_and_a_dropped_tensor_are_named(node: Path, manifests: dict[str, Path]) -> None:
    (node / "model-rank-00002-experts-00001-of-00001.safetensors").unlink()
    (node / "tokenizer_config.json").unlink()
    drop_tensors(node, {DENSE})
    res = verify(node, "--manifest", str(manifests["tensors"]))
    assert res.exit_code == 1
    out = res.output
    assert "model-rank-00002-experts-00001-of-00001.safetensors: listed in model.safetensors.index.json but missing" in out
    assert "tokenizer_config.json: listed in the reference but not present" in out
    assert f"tensor {DENSE}: needed by the share's ranks but in no header" in out
    assert "[missing-tensor] 1 problem\n" in out  # the deleted file's experts are its one line, not 96
    assert "96 + 1" not in out and ", 97 needed but absent" in out


def test_a_manifest_without_tensor_hashes_says_which_one_is_needed(resharded: Path, manifests: dict[str, Path]) -> None:
    res = verify(resharded, "--manifest", str(manifests["files"]))
    assert_one_line_error(res, 2, "rewritten shards", "without tensor hashes cannot check",
                          "k3ckpt manifest build SRC -o M --tensor-hashes", "manifest pull", "--tensor-hashes")


def test_a_signed_tensor_manifest_verifies_a_share(resharded: Path, manifests: dict[str, Path], tmp_path: Path) -> None:
    key = tmp_path / "release.key"
    m = tmp_path / "k3.tensors.json"
    m.write_bytes(manifests["tensors"].read_bytes())
    assert run("manifest", "keygen", str(key)).exit_code == 0
    assert run("manifest", "sign", str(m), "--key", str(key)).exit_code == 0
    signed = ("--manifest", str(m), "--signature", f"{m}.sig", "--pubkey", f"{key}.pub")
    res = verify(resharded, *signed)
    assert res.exit_code == 0, res.output
    assert "signed by" in res.output.splitlines()[0] and "tensors checked" in res.output
    m.write_bytes(m.read_bytes().replace(b'"tensor_hashes": true', b'"tensor_hashes": false'))
    assert verify(resharded, *signed).exit_code == 1  # the signature covers the bytes the share is checked with


def test_quick_trusts_unchanged_files_and_never_reports_other_nodes_experts(node: Path, manifests: dict[str, Path]) -> None:
    m = ("--manifest", str(manifests["tensors"]))
    full = verify(node, *m)
    assert full.exit_code == 0
    hashed = int(re.search(r"(\d+) hashed", full.output).group(1))  # type: ignore[union-attr]
    res = verify(node, *m, "--quick")
    assert res.exit_code == 0, res.output
    assert f"{hashed} trusted from the stat cache" in res.output and "not local (other nodes' experts)" in res.output
    assert len(res.output.splitlines()) == 3 and res.output.splitlines()[2].startswith("proven by manifest ")
    flip_byte(node / EXPERT_FILE, data_offset(node / EXPERT_FILE, EXPERT))
    res = verify(node, *m, "--quick")  # changed stat: no cached verdict, checked by size only
    # issue #25: that was "ok"; sizes prove nothing
    assert res.exit_code == 0 and "checked by size only" in res.output and res.output.startswith("not proven: ")
    assert verify(node, *m).exit_code == 1
    res = verify(node, *m, "--quick")  # the full run's verdict is remembered while the file is unchanged
    assert res.exit_code == 1 and f"tensor {EXPERT}: tensor bytes differ" in res.output


# -- fetched shares: a node directory and a partial copy ------------------------------------------


def fetch(h: Any, dest: Path, *topo: str, source: str = "hf") -> Any:
    return run("fetch", "--source", source, "--repo", REPO, "--dest", str(dest), "--endpoint", h.url,
               "--chunk-size", str(CHUNK), "--workers", "3", *topo)


def test_a_fetched_node_dir_verifies_clean(served_hub: Any, manifests: dict[str, Path], tmp_path: Path) -> None:
    h, _ = served_hub
    dest = tmp_path / "node1"
    assert fetch(h, dest, *NODE1, "--node", "1").exit_code == 0
    res = verify(dest, "--manifest", str(manifests["tensors"]))
    assert res.exit_code == 0, res.output
    assert f"node share ({NODE_MARKER}; node 1, ranks 2-3)" in res.output


def test_a_partial_fetch_verifies_and_names_a_flipped_expert(served_hub: Any, manifests: dict[str, Path],
                                                               tmp_path: Path) -> None:
    h, _ = served_hub
    dest = tmp_path / "part"
    assert fetch(h, dest, *PARTIAL0).exit_code == 0
    rep = json.loads(verify(dest, "--manifest", str(manifests["tensors"]), "--json").output)
    assert rep["ok"], rep["issues"]
    assert (rep["share"]["kind"], rep["share"]["ranks"]) == ("partial", [0, 1, 2, 3])
    assert rep["share"]["tensors_not_local"] == not_local(manifests["tensors"], set(range(8)))
    assert rep["share"]["tensors_checked"] == rep["share"]["tensors_present"] > 0

    tensor = "language_model.model.layers.3.block_sparse_moe.experts.6.w1.weight_packed"
    shard = json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    flip_byte(dest / shard, data_offset(dest / shard, tensor))
    res = verify(dest, "--manifest", str(manifests["tensors"]))
    assert res.exit_code == 1 and f"{shard} tensor {tensor}: tensor bytes differ" in res.output


@pytest.mark.parametrize("source", ["hf", "modelscope"])
def test_verify_against_a_hub_on_a_share(source: str, served_hub: Any, resharded: Path, clone_checkpoint: Any) -> None:
    h, _ = served_hub
    res = verify(resharded, "--against", source, "--repo", REPO, "--endpoint", h.url)
    assert res.exit_code == 0, res.output
    assert "tensors as the hub serves them now" in res.output and "not local (other nodes' experts)" in res.output
    node = clone_checkpoint(resharded)
    flip_byte(node / EXPERT_FILE, data_offset(node / EXPERT_FILE, EXPERT) + 3)
    res = verify(node, "--against", source, "--repo", REPO, "--endpoint", h.url)
    assert res.exit_code == 1 and f"{EXPERT_FILE} tensor {EXPERT}: tensor bytes differ" in res.output


# -- manifest pull --tensor-hashes ---------------------------------------------------------------


@pytest.mark.parametrize("source", ["hf", "modelscope"])
def test_pull_tensor_hashes_equals_build(source: str, served_hub: Any, tmp_path: Path) -> None:
    h, served = served_hub
    out = tmp_path / "pulled.json"
    res = run("manifest", "pull", "--source", source, "--repo", REPO, "--endpoint", h.url, "-o", str(out),
              "--tensor-hashes", "--jobs", "3", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["tensor_hashes"] is True
    pulled, built = Manifest.load(out), build_manifest(served, tensor_hashes=True)
    assert [c for c in diff_manifests(built, pulled) if c.what != "source"] == []
    assert pulled.tensors == built.tensors and pulled.files == built.files and pulled.tensor_hashes
    assert pulled.source["hub"] == source


def test_pull_tensor_hashes_refuses_bytes_the_hub_does_not_publish(served_hub: Any, tmp_path: Path) -> None:
    h, served = served_hub
    shard = served / "model-00003-of-000008.safetensors"
    h.inject("corrupt_byte", shard.name, times=None, offset=shard.stat().st_size - 100)  # tensor data, not header
    out = tmp_path / "pulled.json"
    res = run("manifest", "pull", "--source", "hf", "--repo", REPO, "--endpoint", h.url, "-o", str(out),
              "--tensor-hashes")
    assert_one_line_error(res, 1, "model-00003-of-000008.safetensors", "the listing says")
    assert not out.exists()
    plain = pull_manifest("hf", REPO, endpoint=h.url)  # headers only: no tensor data read, nothing to refuse
    assert not plain.tensor_hashes


# -- a SIGKILLed rank-aware fetch: before and after its resume -----------------------------------

_CHILD = """
import sys
from k3ckpt.format.topology import RankSelection
from k3ckpt.hub.rankfetch import plan_rank_fetch, run_rank_fetch
url, repo, dest, chunk = sys.argv[1:5]
plan = plan_rank_fetch("hf", repo, dest, RankSelection(ep=8, tp=2, node=0, gpus_per_node=4), endpoint=url, token="",
                       chunk_size=int(chunk))
sys.exit(0 if run_rank_fetch(plan, workers=3, token="").ok else 1)
"""


def test_a_killed_rank_fetch_is_not_ok_until_resumed(served_hub: Any, manifests: dict[str, Path],
                                                      tmp_path: Path) -> None:
    h, _ = served_hub
    dest = tmp_path / "d"
    kill_at_pause(_CHILD, [h.url, REPO, str(dest), str(CHUNK)], "after_piece:5", tmp_path)
    assert not (dest / PARTIAL_MARKER).exists()
    res = verify(dest, "--manifest", str(manifests["tensors"]))
    assert res.exit_code != 0 and not res.output.startswith("ok")
    assert_one_line_error(res, 2, "an unfinished fetch", "run the same fetch again to resume it")

    assert fetch(h, dest, *PARTIAL0).exit_code == 0  # the resume
    res = verify(dest, "--manifest", str(manifests["tensors"]))
    assert res.exit_code == 0, res.output
    assert f"partial share ({PARTIAL_MARKER}; node 0, ranks 0-3)" in res.output


def test_preflight_proposes_the_verify_command_that_works_on_a_share(resharded: Path, manifests: dict[str, Path]) -> None:
    res = run("preflight", str(resharded), *NODE1, "--node", "1")
    line = next(ln for ln in res.output.splitlines() if ln.startswith("PASS  structure"))
    advice = line[line.index("k3ckpt verify "):].split(" for every tensor's sha256")[0]
    assert advice == f"k3ckpt verify {resharded} --manifest <tensor-hash manifest>"
    args = advice.replace("<tensor-hash manifest>", str(manifests["tensors"])).split()[2:]
    assert run("verify", *args).exit_code == 0  # the command it proposes passes on a clean share
