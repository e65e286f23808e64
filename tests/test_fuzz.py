"""Hostile checkpoints and manifests: fuzz every reader of untrusted bytes (bounded here; the
long run is ``scripts/campaign.py --fuzz-seconds N``), plus the hand-written cases the fuzzer
found or that matter most: allocation bombs, deep nesting, manifests and indexes pointing
outside the checkpoint, symlinks and hard links in source and destination.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import run
from k3ckpt.errors import ConfigError, IndexFileError
from k3ckpt.format.checkpoint import open_checkpoint, read_index
from k3ckpt.format.config import load_config
from k3ckpt.integrity.manifest import Manifest, ManifestError, build_manifest
from k3ckpt.integrity.verify import verify_checkpoint
from k3ckpt.testing.fuzz import SEEDS, TARGETS, encode, header_bytes_from_file, mutate_json, paths_of

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, target: str) -> bytes:
    seed = SEEDS["header" if target == "header_file" else target]
    path = draw(st.sampled_from(paths_of(seed)))
    delete = bool(path) and draw(st.booleans()) and draw(st.booleans())
    doc = mutate_json(seed, path, None if delete else draw(json_values), delete=delete)
    raw = encode(doc)
    return header_bytes_from_file(raw) if target == "header_file" else raw


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_seed_is_accepted(target: str) -> None:
    """The fuzz targets reach the accept path (a target that rejects everything proves nothing)."""
    seed = encode(SEEDS["header" if target == "header_file" else target])
    TARGETS[target](header_bytes_from_file(seed) if target == "header_file" else seed)


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(TARGETS))
@FUZZ
@given(data=st.data())
def test_fuzz_mutated_documents(target: str, data: st.DataObject) -> None:
    TARGETS[target](data.draw(mutated(target)))


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(TARGETS))
@FUZZ
@given(raw=st.binary(max_size=512))
def test_fuzz_random_bytes(target: str, raw: bytes) -> None:
    TARGETS[target](raw)


# -- cases found by fuzzing, kept as regressions ------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("num_hidden_layers", 10**12),  # would allocate a 10**12-element attention list
    ("num_hidden_layers", -1),
    ("num_hidden_layers", True),
    ("num_experts", "many"),
    ("num_experts", [8]),
    ("vocab_size", float("inf")),
    ("hidden_size", 1e300),
    ("first_k_dense_replace", {"a": 1}),
])
def test_config_fields_of_the_wrong_kind_are_one_line_errors(tmp_path: Path, field: str, value: object) -> None:
    doc = mutate_json(SEEDS["config"], ("text_config", field), value)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=f"config.json.*{field}"):
        load_config(p)


@pytest.mark.parametrize("reader", ["manifest", "index", "config"])
def test_deep_nesting_is_a_one_line_error(tmp_path: Path, reader: str) -> None:
    raw = b"[" * 200_000 + b"]" * 200_000
    name = {"manifest": "m.json", "index": "model.safetensors.index.json", "config": "config.json"}[reader]
    p = tmp_path / name
    p.write_bytes(raw)
    with pytest.raises((ManifestError, IndexFileError, ConfigError), match="nested too deeply"):
        {"manifest": Manifest.load, "index": lambda _: read_index(tmp_path), "config": load_config}[reader](p)


# -- manifests and indexes that point outside the checkpoint ----------------------------------


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "a/../../x", "sub\\..\\..\\x"])
def test_a_manifest_naming_files_outside_the_checkpoint_is_refused(k3_tiny: Path, tmp_path: Path, bad: str) -> None:
    m = build_manifest(k3_tiny)
    doc = json.loads(m.to_json())
    doc["files"][bad] = {"sha256": "0" * 64, "size": 11}
    p = tmp_path / "m.json"
    p.write_text(json.dumps(doc))
    res = run("verify", str(k3_tiny), "--manifest", str(p), "--no-cache")
    assert res.exit_code == 2 and res.output.startswith("k3ckpt: error: ") and "refuses file path" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_an_index_naming_shards_outside_the_checkpoint_is_refused(k3_tiny: Path, clone_checkpoint,
                                                                  tmp_path: Path) -> None:
    ck = clone_checkpoint(k3_tiny)
    secret = tmp_path / "secret.safetensors"
    shutil.copy(next(ck.glob("model-*.safetensors")), secret)
    idx = ck / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    name = next(iter(doc["weight_map"]))
    doc["weight_map"][name] = "../secret.safetensors"
    idx.write_text(json.dumps(doc))
    res = run("inspect", str(ck))
    assert res.exit_code == 2 and "refuses shard path '../secret.safetensors'" in res.output
    rep = verify_checkpoint(ck, use_cache=False)
    assert not rep.ok and any(i.kind == "path" for i in rep.issues)


# -- symlinks and hard links --------------------------------------------------------------------


def test_a_shard_symlinked_outside_the_checkpoint_fails_verification(k3_tiny: Path, clone_checkpoint,
                                                                     tmp_path: Path) -> None:
    ck = clone_checkpoint(k3_tiny)
    shard = next(ck.glob("model-*.safetensors"))
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    rep = verify_checkpoint(ck, use_cache=False)
    assert not rep.ok and any(i.kind == "path" and shard.name in (i.file or "") for i in rep.issues), rep.issues


def test_a_hard_linked_shard_verifies_by_content(k3_tiny: Path, clone_checkpoint, tmp_path: Path) -> None:
    """A hard link is the same bytes (no path leaves the directory): verified by content like
    any file, and a change through the other name is caught."""
    ck = clone_checkpoint(k3_tiny)
    m = build_manifest(ck)
    shard = sorted(ck.glob("model-*.safetensors"))[-1]
    other = tmp_path / "other-name"
    os.link(shard, other)
    assert verify_checkpoint(ck, manifest=m, use_cache=False).ok
    with open(other, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    rep = verify_checkpoint(ck, manifest=m, use_cache=False)
    assert not rep.ok and any(i.kind == "sha256" and i.file == shard.name for i in rep.issues)


def test_reshard_does_not_write_through_destination_symlinks(k3_tiny: Path, tmp_path: Path) -> None:
    """Symlinks planted in the output - at final names and at the temporary names earlier
    versions used (``.topology.json.tmp``, ``.config.json.tmp``) - never redirect a write."""
    from k3ckpt.deploy.reshard import plan_reshard, run_reshard
    from k3ckpt.format.topology import RankSelection

    out = tmp_path / "out"
    plan = plan_reshard(k3_tiny, RankSelection(ep=2), layout="rank")
    run_reshard(plan, out)
    # .cache/k3ckpt holds the run's records (ownership, the stat of each file written): per run
    reference = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*")
                 if p.is_file() and ".cache" not in p.relative_to(out).parts}
    victims = []
    for name in (".topology.json.tmp", ".config.json.tmp", "LICENSE", "rank-00001/.model-rank-1-part-0.safetensors.tmp"):
        victim = tmp_path / f"victim-{len(victims)}"
        victim.write_text("precious\n")
        victims.append(victim)
        link = out / name
        link.unlink(missing_ok=True)
        link.symlink_to(victim)
    (out / "rank-00000" / "READY").unlink()  # rank 0 is redone; rank 1 is complete and skipped
    run_reshard(plan, out)
    assert all(v.read_text() == "precious\n" for v in victims)
    assert not (out / "LICENSE").is_symlink()
    now = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*")
           if p.is_file() and not p.is_symlink() and ".cache" not in p.relative_to(out).parts}
    assert {k: v for k, v in now.items() if not k.endswith(".tmp")} == reference


def test_a_source_checkpoint_through_symlinks_inside_it_is_fine(k3_tiny: Path, tmp_path: Path) -> None:
    """An HF cache snapshot is all symlinks into blobs/: links that stay inside are followed."""
    root = tmp_path / "ck"
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    snap = root / "snap"
    snap.mkdir()
    for f in k3_tiny.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("..") / "blobs" / f.name)
    assert open_checkpoint(snap).shards
