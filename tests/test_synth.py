"""Synthetic checkpoints: deterministic, K3-shaped, experts adjacent, MXFP4 by compressed-tensors' rule."""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from k3ckpt.errors import SynthError
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.format.roles import Kind
from k3ckpt.mx.codec import dequantize_mxfp4, quantize_mxfp4
from k3ckpt.testing.synth import PRESETS, assign_shards, spec_from_preset, synthesize, tensor_rng


def _digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def test_same_seed_gives_identical_bytes_and_parallel_equals_serial(tmp_path: Path) -> None:
    spec = spec_from_preset("k3-tiny", num_layers=3, num_experts=8, experts_per_token=2)
    a = synthesize(spec, tmp_path / "a", jobs=1).path
    b = synthesize(spec, tmp_path / "b", jobs=2).path
    assert _digests(a) == _digests(b)


def test_other_seed_changes_data_not_layout(tmp_path: Path) -> None:
    base = spec_from_preset("k3-tiny", num_layers=2, num_experts=4, experts_per_token=2)
    a = open_checkpoint(synthesize(base, tmp_path / "a").path)
    b = open_checkpoint(synthesize(spec_from_preset("k3-tiny", num_layers=2, num_experts=4, experts_per_token=2,
                                                    seed=1), tmp_path / "b").path)
    assert {n: (t.dtype, t.shape, t.file, t.begin) for n, t in a.tensors.items()} == \
           {n: (t.dtype, t.shape, t.file, t.begin) for n, t in b.tensors.items()}
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    assert not np.array_equal(a.read_tensor(name), b.read_tensor(name))


@pytest.mark.parametrize(
    ("preset", "first", "count"),
    [
        ("k3-tiny", "model-00001-of-000008.safetensors", 8),
        ("gptoss-tiny", "model-00000-of-00002.safetensors", 3),
        ("k2-tiny", "model-1-of-3.safetensors", 3),
    ],
)
def test_family_shard_naming(tmp_path: Path, preset: str, first: str, count: int) -> None:
    out = synthesize(PRESETS[preset], tmp_path / preset).path
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == count
    assert first in files
    assert index["metadata"]["total_size"] == sum(
        t.nbytes for t in open_checkpoint(out).tensors.values()
    )


def test_each_expert_is_six_adjacent_tensors_in_one_shard(k3_tiny: Path) -> None:
    ckpt = open_checkpoint(k3_tiny)
    by_expert: dict[tuple[int, int], list] = defaultdict(list)
    for name, role in ckpt.roles.items():
        if role.kind == Kind.ROUTED_EXPERT:
            by_expert[(role.layer, role.expert)].append(ckpt.tensors[name])
    assert len(by_expert) == 4 * 16
    for key, ts in by_expert.items():
        assert len(ts) == 6, key
        assert len({t.file for t in ts}) == 1, key
        ts.sort(key=lambda t: t.begin)
        assert all(a.end == b.begin for a, b in zip(ts, ts[1:])), key


def test_experts_are_ocp_quantized_random_weights(k3_tiny: Path) -> None:
    ckpt = open_checkpoint(k3_tiny)
    spec = PRESETS["k3-tiny"]
    prefix = "language_model.model.layers.2.block_sparse_moe.experts.5.w2"
    out, inn = spec.expert_width, spec.moe_intermediate_size
    w = tensor_rng(spec.seed, prefix).standard_normal((out, inn), dtype=np.float32) * np.float32(1 / math.sqrt(inn))
    packed, scales = quantize_mxfp4(w)
    assert np.array_equal(ckpt.read_tensor(prefix + ".weight_packed"), packed)
    assert np.array_equal(ckpt.read_tensor(prefix + ".weight_scale"), scales)
    back = dequantize_mxfp4(packed, scales)
    rel = np.sqrt(np.mean((back - w) ** 2) / np.mean(w**2))
    assert rel < 0.2  # MXFP4 of Gaussian weights: ~10% relative RMS error


def test_shards_are_read_by_the_safetensors_library(k3_tiny: Path) -> None:
    ckpt = open_checkpoint(k3_tiny)
    for file, header in ckpt.shards.items():
        with safe_open(str(k3_tiny / file), framework="numpy") as f:
            assert set(f.keys()) == set(header.tensors)
            for name in f.keys():
                info = header.tensors[name]
                assert tuple(f.get_slice(name).get_shape()) == info.shape
                if info.dtype in ("U8", "F32"):
                    assert np.array_equal(f.get_tensor(name), ckpt.read_tensor(name))


def test_headers_only_is_sparse_and_reads_as_zeros(tmp_path: Path) -> None:
    spec = spec_from_preset("k3-tiny", headers_only=True, num_experts=64, moe_intermediate_size=256)
    out = synthesize(spec, tmp_path / "h").path
    ckpt = open_checkpoint(out)
    apparent = sum(h.file_size for h in ckpt.shards.values())
    allocated = sum((out / f).stat().st_blocks * 512 for f in ckpt.shards)
    assert allocated < apparent / 4
    name = "language_model.model.layers.1.block_sparse_moe.experts.63.w3.weight_packed"
    assert not ckpt.read_tensor(name).any()


@pytest.mark.slow
def test_full_inventory_headers_only(tmp_path: Path) -> None:
    """The real K3 inventory at true scale: 93 layers, 896 experts, 96 shards, ~497k tensors."""
    out = synthesize(PRESETS["k3-full"], tmp_path / "full", jobs=2).path
    ckpt = open_checkpoint(out)
    assert len(ckpt.shards) == 96
    assert "model-00096-of-000096.safetensors" in ckpt.shards
    assert 497_000 <= len(ckpt.tensors) <= 497_500
    assert 1.55e12 < ckpt.total_bytes < 1.57e12
    layer1 = ckpt.shards["model-00002-of-000096.safetensors"]
    assert len(layer1.tensors) == 896 * 6 + 28  # the whole of layer 1, as in the real shard 2
    assert layer1.file_size == pytest.approx(16_990_911_504, rel=1e-3)
    expert = [t for n, t in layer1.tensors.items() if ".experts.7." in n]
    assert sum(t.nbytes for t in expert) == 17_547_264
    assert not ckpt.problems


def test_options_scale_the_shape(tmp_path: Path) -> None:
    spec = spec_from_preset("k3-tiny", num_layers=3, num_experts=8, experts_per_token=2, num_shards=2)
    ckpt = open_checkpoint(synthesize(spec, tmp_path / "s").path)
    assert len(ckpt.shards) == 2
    experts = {(r.layer, r.expert) for r in ckpt.roles.values() if r.expert is not None}
    assert experts == {(layer, e) for layer in (1, 2) for e in range(8)}


def test_assign_shards_never_leaves_a_shard_empty() -> None:
    from k3ckpt.testing.synth import Planner

    units = Planner(spec_from_preset("k3-tiny", headers_only=True)).units()
    for n in (1, 2, 5, 17, len(units)):
        shards = assign_shards(units, n)
        assert len(shards) == n and all(shards)
        assert [u for s in shards for u in s] == units


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"moe_intermediate_size": 48}, "not a multiple of the MXFP4 block size 32"),
        ({"experts_per_token": 99}, "exceeds num_experts"),
        ({"family": "llama"}, "unknown family"),
        ({"bogus": 1}, "unknown synth option"),
    ],
)
def test_bad_specs_are_refused(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(SynthError, match=message):
        synthesize(spec_from_preset("k3-tiny", **overrides), tmp_path / "x")


def test_force_replaces_only_an_earlier_synthetic_checkpoint(tmp_path: Path) -> None:
    """--force replaced same-named files of any non-empty directory (a real checkpoint's
    config.json included); now only synth's own earlier output, and never a foreign file."""
    from k3ckpt.errors import OutputNotOwnedError

    small = spec_from_preset("k3-tiny", num_layers=2, num_experts=4, experts_per_token=2)
    d = tmp_path / "d"
    synthesize(spec_from_preset("k3-tiny", num_layers=3, num_experts=4, experts_per_token=2, num_shards=3), d)
    with pytest.raises(SynthError, match="holds a synthetic checkpoint already .use --force"):
        synthesize(small, d)
    synthesize(small, d, force=True)
    assert not list(d.glob("*.tmp"))
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(p.name for p in d.glob("*.safetensors")) == sorted(set(weight_map.values()))  # no stale shard
    (d / "keep.txt").write_text("x")
    for force in (False, True):
        with pytest.raises(OutputNotOwnedError, match=f"holds files k3ckpt did not write .{d / 'keep.txt'}"):
            synthesize(small, d, force=force)
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text("{}")
    with pytest.raises(OutputNotOwnedError, match="config.json"):
        synthesize(small, real, force=True)
    assert (real / "config.json").read_text() == "{}"
