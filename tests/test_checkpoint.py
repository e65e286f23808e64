"""Opening checkpoints: layouts (plain dir, single file, HF cache snapshot / repo folder, local
dir), config normalization, tensor data, typed errors, index/header problems (identical in the
in-process and the forked-worker paths) and the promise that opening reads headers only."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import k3ckpt.format.checkpoint as ckmod
import k3ckpt.format.header as sh
from helpers import REPO
from k3ckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IndexFileError,
    K3ckptError,
    SafetensorsHeaderError,
)
from k3ckpt.format.checkpoint import INDEX_NAME, Checkpoint, HeaderReader, Problem, open_checkpoint
from k3ckpt.format.header import TensorSpec, build_header, read_header
from k3ckpt.format.roles import Kind

BF16_NAME = "language_model.model.embed_tokens.weight"
F32_NAME = "language_model.model.layers.0.self_attn.A_log"
U8_NAME = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"


def load_index(root: Path) -> dict:
    return json.loads((root / INDEX_NAME).read_text())


def save_index(root: Path, index: dict) -> None:
    (root / INDEX_NAME).write_text(json.dumps(index, indent=2))


def rewrite_shard(path: Path, extra: list[tuple[TensorSpec, bytes]] = (), drop: tuple[str, ...] = ()) -> None:
    """Rewrite the shard at ``path`` with the same tensors and bytes, minus ``drop``, plus ``extra``."""
    h = read_header(path)
    blob = path.read_bytes()
    specs, chunks = [], []
    for t in h.tensors.values():
        if t.name in drop:
            continue
        specs.append(TensorSpec(t.name, t.dtype, t.shape))
        start, stop = h.absolute_range(t.name)
        chunks.append(blob[start:stop])
    for spec, data in extra:
        specs.append(spec)
        chunks.append(data)
    prefix, _ = build_header(specs, h.metadata)
    path.write_bytes(prefix + b"".join(chunks))


# ---------------------------------------------------------------------------------------------
# Both header-reading paths


class Spy:
    """Records what ``HeaderReader.index_digests`` returned, to prove which path ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[object] = []
        original = HeaderReader.index_digests
        spy = self

        def index_digests(reader: HeaderReader, *args: object):
            out = original(reader, *args)
            spy.calls.append(out)
            return out

        monkeypatch.setattr(HeaderReader, "index_digests", index_digests)


def open_in_process(path: Path, monkeypatch: pytest.MonkeyPatch) -> Checkpoint:
    monkeypatch.setattr(ckmod, "PARALLEL_HEADER_MIN_FILES", 10**9)
    spy = Spy(monkeypatch)
    ck = open_checkpoint(path, jobs=2)
    assert spy.calls == [None]  # the index was read in this process
    return ck


_REAL_HEADER_JOB = ckmod.header_columns_job


def _worker_pids(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make every header job record the pid it runs in (a file per job in the returned dir).

    The wrapper takes the job's module and name, so the pool pickles it by reference and the
    forked workers, which inherit the patched module, find it."""
    marks = Path(tempfile.mkdtemp(prefix="k3ckpt-header-jobs-"))
    real_job = _REAL_HEADER_JOB

    def header_columns_job(args):
        (marks / f"{os.getpid()}-{os.path.basename(args[1])}").touch()
        return real_job(args)

    header_columns_job.__module__ = real_job.__module__
    header_columns_job.__qualname__ = real_job.__qualname__
    monkeypatch.setattr(ckmod, "header_columns_job", header_columns_job)
    return marks


def open_parallel(path: Path, monkeypatch: pytest.MonkeyPatch) -> Checkpoint:
    """Forked workers read every header and a worker digests the index."""
    monkeypatch.setattr(ckmod, "PARALLEL_HEADER_MIN_FILES", 1)
    spy = Spy(monkeypatch)
    marks = _worker_pids(monkeypatch)
    try:
        ck = open_checkpoint(path, jobs=2)
        jobs = [m.name.split("-", 1) for m in marks.iterdir()]
    finally:
        shutil.rmtree(marks, ignore_errors=True)
    if len(list(Path(ck.root).glob("*.safetensors"))) >= 2:
        assert jobs, "no header was read by a worker"
        assert all(int(pid) != os.getpid() for pid, _ in jobs)
        assert {f for _, f in jobs} >= set(ck.shards)  # every shard header came from a worker
    if (Path(ck.root) / INDEX_NAME).is_file():
        assert len(spy.calls) == 1 and isinstance(spy.calls[0], dict), "index digest path not taken"
    return ck


OPENERS = {"in-process": open_in_process, "parallel": open_parallel}


@pytest.fixture(params=sorted(OPENERS))
def opener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], Checkpoint]:
    fn = OPENERS[request.param]
    return lambda path: fn(path, monkeypatch)


def open_both(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Checkpoint, Checkpoint]:
    """Open ``path`` both ways; the outcomes must be identical."""
    a = open_in_process(path, monkeypatch)
    b = open_parallel(path, monkeypatch)
    assert a.problems == b.problems
    assert a.tensors == b.tensors
    assert a.roles == b.roles
    assert a.stats.signatures == b.stats.signatures
    assert a.stats.expert_parts == b.stats.expert_parts
    assert set(a.shards) == set(b.shards)
    return a, b


# ---------------------------------------------------------------------------------------------
# Opening the fixtures


def test_open_k3_tiny(k3_tiny: Path, opener) -> None:
    ck = opener(k3_tiny)
    index = load_index(k3_tiny)
    assert len(ck.tensors) == len(index["weight_map"]) == 533
    assert ck.problems == []
    assert ck.index_file == INDEX_NAME
    assert ck.root == k3_tiny.resolve()
    assert ck.source.layout == "local-dir" and ck.source.revision is None
    assert set(ck.shards) == set(index["weight_map"].values())
    assert {n: t.file for n, t in ck.tensors.items()} == index["weight_map"]
    assert ck.total_bytes == sum((k3_tiny / f).stat().st_size for f in ck.shards)
    assert ck.unknown_tensors() == []

    cfg = ck.config
    raw_text = json.loads((k3_tiny / "config.json").read_text())["text_config"]
    assert cfg.family == "kimi_k3"
    assert cfg.model_type == "kimi_k3" and cfg.text_model_type == "kimi_linear"
    assert cfg.num_layers == 5 == raw_text["num_hidden_layers"]
    assert cfg.hidden_size == 256
    assert cfg.num_experts == 16 and cfg.experts_per_token == 4 and cfg.num_shared_experts == 1
    assert cfg.routed_expert_hidden_size == 128 and cfg.moe_intermediate_size == 64
    assert cfg.first_k_dense == 1 and cfg.moe_layers == [1, 2, 3, 4]
    assert cfg.has_vision and cfg.quant_format == "mxfp4-pack-quantized"
    # full_attn_layers / kda_layers are 1-based in the config; attention_kinds is 0-based.
    lac = raw_text["linear_attn_config"]
    assert lac["full_attn_layers"] == [4, 5]
    assert cfg.attention_kinds == ["kda", "kda", "kda", "mla", "mla"]
    for one_based in lac["full_attn_layers"]:
        assert cfg.attention_kinds[one_based - 1] == "mla"
    for one_based in lac["kda_layers"]:
        assert cfg.attention_kinds[one_based - 1] == "kda"
    # ... and the tensors agree: MLA layers have q_a_proj, KDA layers have A_log.
    for layer, kind in enumerate(cfg.attention_kinds):
        p = f"language_model.model.layers.{layer}.self_attn."
        assert (p + "q_a_proj.weight" in ck.tensors) == (kind == "mla")
        assert (p + "A_log" in ck.tensors) == (kind == "kda")
    # Roles: 16 experts x 6 tensors in each of the 4 MoE layers.
    experts = [r for r in ck.roles.values() if r.kind == Kind.ROUTED_EXPERT]
    assert len(experts) == 4 * 16 * 6
    assert {(r.layer, r.expert) for r in experts} == {(layer, e) for layer in range(1, 5) for e in range(16)}
    assert sum(ck.stats.expert_parts.values()) == len(experts)


@pytest.mark.parametrize("fixture, family, layers, experts", [
    ("gptoss_tiny", "gpt_oss", 4, 8),
    ("k2_tiny", "deepseek_v3", 4, 8),
])
def test_open_other_families(request: pytest.FixtureRequest, opener, fixture: str, family: str, layers: int,
                             experts: int) -> None:
    root = request.getfixturevalue(fixture)
    ck = opener(root)
    assert ck.problems == []
    assert len(ck.tensors) == len(load_index(root)["weight_map"])
    assert ck.config.family == family
    assert ck.config.num_layers == layers and ck.config.num_experts == experts
    assert ck.unknown_tensors() == []
    assert all(r.kind != Kind.UNKNOWN for r in ck.roles.values())
    kinds = {r.kind for r in ck.roles.values()}
    assert {Kind.ROUTED_EXPERT, Kind.ATTENTION, Kind.NORM, Kind.EMBEDDING, Kind.LM_HEAD} <= kinds
    if family == "gpt_oss":
        assert ck.config.attention_kinds == ["sliding", "full", "sliding", "full"]
    else:
        assert ck.config.attention_kinds == ["mla"] * 4
        assert ck.config.quant_format == "fp8-block"


def test_both_paths_agree_on_fixtures(k3_tiny: Path, gptoss_tiny: Path, k2_tiny: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for root in (k3_tiny, gptoss_tiny, k2_tiny):
        a, b = open_both(root, monkeypatch)
        assert a.problems == []


# ---------------------------------------------------------------------------------------------
# Tensor data


def test_read_tensor_matches_safe_open(k3_tiny: Path) -> None:
    import ml_dtypes
    from safetensors import safe_open

    ck = open_checkpoint(k3_tiny)
    for name, dtype, np_dtype in [
        (BF16_NAME, "BF16", ml_dtypes.bfloat16),
        (F32_NAME, "F32", np.float32),
        (U8_NAME, "U8", np.uint8),
    ]:
        info = ck.tensors[name]
        assert info.dtype == dtype
        arr = ck.read_tensor(name)
        assert arr.dtype == np.dtype(np_dtype)
        assert arr.shape == info.shape
        with safe_open(str(k3_tiny / info.file), framework="numpy") as f:
            ref = f.get_tensor(name)
        assert ref.dtype == arr.dtype and ref.shape == arr.shape
        assert arr.tobytes() == ref.tobytes()
        assert np.any(arr.view(np.uint8) != 0)  # real data, not a hole
    assert ck.read_tensor(BF16_NAME).shape == (1024, 256)
    assert ck.read_tensor(F32_NAME).shape == (32,)
    assert ck.read_tensor(U8_NAME).shape == (128, 32)  # w2: [expert width, moe_intermediate / 2]


def test_read_tensor_of_every_float8_dtype(write_raw, tmp_path: Path) -> None:
    # F8_E8M0 (MX scales) needs ml_dtypes >= 0.5, the declared floor: at 0.4 this was an AttributeError
    data = bytes([0, 1, 126, 127, 128, 254, 255, 0x38])
    dtypes = ("F8_E8M0", "F8_E4M3", "F8_E5M2")
    header = {f"t.{d}": {"dtype": d, "shape": [8], "data_offsets": [8 * i, 8 * i + 8]} for i, d in enumerate(dtypes)}
    write_raw(tmp_path / "model.safetensors", header, data * len(dtypes))
    ck = open_checkpoint(tmp_path)
    e8m0 = ck.read_tensor("t.F8_E8M0").astype(np.float64)
    assert list(e8m0[:6]) == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127] and np.isnan(e8m0[6])
    assert ck.read_tensor("t.F8_E4M3").astype(np.float32)[7] == 1.0  # 0x38: exponent 7 (bias 7), mantissa 0
    assert ck.read_tensor("t.F8_E5M2").astype(np.float32)[7] == 0.5  # 0x38: exponent 14 (bias 15)


def test_read_tensor_of_truncated_shard(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    ck = open_checkpoint(root)
    info = ck.tensors[BF16_NAME]
    start, _ = ck.shards[info.file].absolute_range(BF16_NAME)
    os.truncate(root / info.file, start + 10)
    with pytest.raises(IndexFileError, match="truncated"):
        ck.read_tensor(BF16_NAME)


# ---------------------------------------------------------------------------------------------
# Errors


def assert_names(err: BaseException, path: Path | str) -> str:
    msg = str(err)
    assert isinstance(err, K3ckptError)
    assert str(path) in msg, msg
    return msg


def test_missing_dir(tmp_path: Path, opener) -> None:
    with pytest.raises(CheckpointNotFoundError) as ei:
        opener(tmp_path / "nope")
    assert "no such directory" in assert_names(ei.value, tmp_path / "nope")


def test_path_is_a_file(tmp_path: Path, opener) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError) as ei:
        opener(f)
    assert "is a file" in assert_names(ei.value, f)


def test_dir_without_index_or_single_file(tmp_path: Path, k3_tiny: Path, opener) -> None:
    (tmp_path / "empty").mkdir()
    shutil.copy(k3_tiny / "config.json", tmp_path / "empty" / "config.json")
    shutil.copy(k3_tiny / "model-00002-of-000008.safetensors", tmp_path / "empty")
    with pytest.raises(CheckpointNotFoundError) as ei:
        opener(tmp_path / "empty")
    msg = assert_names(ei.value, (tmp_path / "empty").resolve())
    assert INDEX_NAME in msg and "model.safetensors" in msg


@pytest.mark.parametrize("text", ["{not json", "", '{"weight_map": {"a": "b"'])
def test_index_not_json(k3_tiny: Path, clone_checkpoint, opener, text: str) -> None:
    root = clone_checkpoint(k3_tiny)
    (root / INDEX_NAME).write_text(text)
    with pytest.raises(IndexFileError) as ei:
        opener(root)
    assert "not valid JSON" in assert_names(ei.value, root.resolve() / INDEX_NAME)


@pytest.mark.parametrize("index", [{}, {"metadata": {}}, {"weight_map": {}}, {"weight_map": []},
                                   {"weight_map": "model-1.safetensors"}, [], "weight_map"])
def test_index_without_weight_map(k3_tiny: Path, clone_checkpoint, opener, index) -> None:
    root = clone_checkpoint(k3_tiny)
    (root / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(IndexFileError) as ei:
        opener(root)
    assert "no weight_map" in assert_names(ei.value, root.resolve() / INDEX_NAME)


def test_index_maps_to_non_string(k3_tiny: Path, clone_checkpoint, opener) -> None:
    root = clone_checkpoint(k3_tiny)
    index = load_index(root)
    index["weight_map"][BF16_NAME] = 1
    save_index(root, index)
    with pytest.raises(IndexFileError) as ei:
        opener(root)
    assert "not a file name" in assert_names(ei.value, root.resolve() / INDEX_NAME)


def test_index_names_missing_shard(k3_tiny: Path, clone_checkpoint, opener) -> None:
    root = clone_checkpoint(k3_tiny)
    (root / "model-00003-of-000008.safetensors").unlink()
    with pytest.raises(IndexFileError) as ei:
        opener(root)
    msg = assert_names(ei.value, root.resolve() / "model-00003-of-000008.safetensors")
    assert "listed in model.safetensors.index.json but missing" in msg


@pytest.mark.parametrize("what, make", [
    ("is a symlink loop (to model-00003-of-000008.safetensors)", lambda p: p.symlink_to(p.name)),
    ("is a broken symlink (to /nonexistent/shard)", lambda p: p.symlink_to("/nonexistent/shard")),
    ("is a directory, not a file", lambda p: p.mkdir()),
    ("is not a regular file (a FIFO)", lambda p: os.mkfifo(p)),
], ids=["symlink loop", "broken symlink", "directory", "fifo"])
def test_a_shard_that_is_not_a_file_is_named_for_what_it_is(k3_tiny: Path, clone_checkpoint, opener, what: str,
                                                            make) -> None:
    """Issue #25: a shard name holding a symlink loop or a directory was "listed but missing"
    (and a loop a traceback elsewhere): the message says what stands there instead."""
    root = clone_checkpoint(k3_tiny)
    shard = root / "model-00003-of-000008.safetensors"
    shard.unlink()
    make(shard)
    with pytest.raises(IndexFileError) as ei:
        opener(root)
    msg = assert_names(ei.value, root.resolve() / shard.name)
    assert f"listed in model.safetensors.index.json but {what}" in msg


@pytest.mark.parametrize("bad", ["../model-00002-of-000008.safetensors", "sub/../../x.safetensors",
                                 "/etc/passwd", "C:\\x.safetensors", ""])
def test_index_shard_path_outside_checkpoint(k3_tiny: Path, clone_checkpoint, opener, bad: str) -> None:
    root = clone_checkpoint(k3_tiny)
    index = load_index(root)
    index["weight_map"][BF16_NAME] = bad
    save_index(root, index)
    with pytest.raises(IndexFileError) as ei:
        opener(root)
    msg = assert_names(ei.value, root.resolve() / INDEX_NAME)
    assert "refuses shard path" in msg and repr(bad) in msg


def test_index_shard_path_dot_slash_is_normalized(k3_tiny: Path, clone_checkpoint, monkeypatch) -> None:
    root = clone_checkpoint(k3_tiny)
    index = load_index(root)
    index["weight_map"] = {n: "./" + f for n, f in index["weight_map"].items()}
    save_index(root, index)
    a, b = open_both(root, monkeypatch)
    assert a.problems == [] and len(a.tensors) == 533


def test_malformed_shard_header(k3_tiny: Path, clone_checkpoint, opener) -> None:
    root = clone_checkpoint(k3_tiny)
    shard = root / "model-00004-of-000008.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[8] = ord("[")  # the JSON no longer starts with '{'
    shard.write_bytes(bytes(blob))
    with pytest.raises(SafetensorsHeaderError) as ei:
        opener(root)
    msg = assert_names(ei.value, shard.resolve())
    assert "does not start with '{'" in msg
    assert ei.value.path == str(shard.resolve())


def test_malformed_shard_header_names_tensor(k3_tiny: Path, clone_checkpoint, opener) -> None:
    root = clone_checkpoint(k3_tiny)
    shard = root / "model-00002-of-000008.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)  # the last tensor now runs past the buffer
    with pytest.raises(SafetensorsHeaderError) as ei:
        opener(root)
    assert "past the data buffer" in assert_names(ei.value, shard.resolve())
    assert ei.value.tensor is not None and ei.value.tensor in str(ei.value)


def test_config_invalid_json(k3_tiny: Path, clone_checkpoint, opener) -> None:
    root = clone_checkpoint(k3_tiny)
    (root / "config.json").write_text('{"model_type": ')
    with pytest.raises(ConfigError) as ei:
        opener(root)
    assert "not valid JSON" in assert_names(ei.value, root.resolve() / "config.json")


def test_config_missing_required_fields(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    (root / "config.json").write_text('{"model_type": "kimi_k3"}')
    with pytest.raises(ConfigError) as ei:
        open_checkpoint(root)
    assert "num_hidden_layers" in assert_names(ei.value, root.resolve() / "config.json")


def test_config_optional_unless_required(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    (root / "config.json").unlink()
    ck = open_checkpoint(root)
    assert ck.config is None and len(ck.tensors) == 533
    with pytest.raises(ConfigError) as ei:
        open_checkpoint(root, require_config=True)
    assert "not found" in assert_names(ei.value, root.resolve() / "config.json")


# ---------------------------------------------------------------------------------------------
# Problems: index and headers disagree (reported, not raised; identical in both paths)


def test_problem_index_lists_tensor_in_no_header(k3_tiny: Path, clone_checkpoint, monkeypatch) -> None:
    root = clone_checkpoint(k3_tiny)
    index = load_index(root)
    index["weight_map"]["language_model.model.layers.9.ghost.weight"] = "model-00003-of-000008.safetensors"
    save_index(root, index)
    ck, _ = open_both(root, monkeypatch)
    assert ck.problems == [Problem(
        "language_model.model.layers.9.ghost.weight",
        "listed in model.safetensors.index.json under model-00003-of-000008.safetensors but in no shard header",
    )]
    assert len(ck.tensors) == 533


def test_problem_index_says_wrong_shard(k3_tiny: Path, clone_checkpoint, monkeypatch) -> None:
    root = clone_checkpoint(k3_tiny)
    index = load_index(root)
    real = index["weight_map"][U8_NAME]
    assert real == "model-00002-of-000008.safetensors"
    index["weight_map"][U8_NAME] = "model-00005-of-000008.safetensors"
    save_index(root, index)
    ck, _ = open_both(root, monkeypatch)
    assert ck.problems == [Problem(
        U8_NAME,
        f"model.safetensors.index.json says model-00005-of-000008.safetensors but the tensor is in {real}",
    )]
    assert ck.tensors[U8_NAME].file == real  # the header is the truth


def test_problem_header_tensor_not_in_index(k3_tiny: Path, clone_checkpoint, monkeypatch) -> None:
    root = clone_checkpoint(k3_tiny)
    index = load_index(root)
    del index["weight_map"][F32_NAME]
    save_index(root, index)
    ck, _ = open_both(root, monkeypatch)
    shard = ck.tensors[F32_NAME].file
    assert ck.problems == [Problem(F32_NAME, f"in {shard} but not listed in model.safetensors.index.json")]


def test_problem_several_at_once(k3_tiny: Path, clone_checkpoint, monkeypatch) -> None:
    root = clone_checkpoint(k3_tiny)
    index = load_index(root)
    wm = index["weight_map"]
    del wm[F32_NAME]
    wm[U8_NAME] = "model-00001-of-000008.safetensors"
    wm["ghost"] = "model-00008-of-000008.safetensors"
    save_index(root, index)
    ck, _ = open_both(root, monkeypatch)
    assert sorted(p.where for p in ck.problems) == sorted([F32_NAME, U8_NAME, "ghost"])


@pytest.mark.parametrize("dup_into", ["model-00005-of-000008.safetensors", "model-00001-of-000008.safetensors"])
def test_problem_same_tensor_in_two_shards(k3_tiny: Path, clone_checkpoint, monkeypatch, dup_into: str) -> None:
    root = clone_checkpoint(k3_tiny)
    home = "model-00002-of-000008.safetensors"
    original = open_checkpoint(k3_tiny)
    info = original.tensors[U8_NAME]
    assert info.file == home
    data = original.read_tensor(U8_NAME).tobytes()
    rewrite_shard(root / dup_into, extra=[(TensorSpec(U8_NAME, info.dtype, info.shape), data)])
    ck, _ = open_both(root, monkeypatch)
    first, second = sorted([home, dup_into])
    dup = Problem(U8_NAME, f"tensor appears in both {first} and {second}")
    assert dup in ck.problems
    assert len(ck.tensors) == 533
    assert ck.tensors[U8_NAME].file == first  # the first shard holding a name wins
    others = [p for p in ck.problems if p != dup]
    if first == home:
        assert others == []
    else:  # the index says the (later) home shard, but the kept copy is in the earlier one
        assert others == [Problem(U8_NAME, f"model.safetensors.index.json says {home} but the tensor is in {first}")]
    assert ck.roles[U8_NAME].kind == Kind.ROUTED_EXPERT
    assert len(ck.roles) == len(ck.tensors)


def test_problem_shard_not_in_index_is_ignored(k3_tiny: Path, clone_checkpoint, monkeypatch) -> None:
    """A stray shard on disk that the index does not name is not part of the checkpoint."""
    root = clone_checkpoint(k3_tiny)
    shutil.copy(root / "model-00008-of-000008.safetensors", root / "model-stray.safetensors")
    ck, _ = open_both(root, monkeypatch)
    assert ck.problems == [] and "model-stray.safetensors" not in ck.shards


# ---------------------------------------------------------------------------------------------
# Single-file checkpoints


def test_single_file_checkpoint(tmp_path: Path, k3_tiny: Path, opener) -> None:
    from safetensors.numpy import save_file

    root = tmp_path / "single"
    root.mkdir()
    tensors = {
        "model.embed_tokens.weight": np.ones((8, 4), np.float32),
        "model.layers.0.self_attn.q_proj.weight": np.zeros((4, 4), np.float32),
        "model.layers.0.mlp.down_proj.weight": np.arange(8, dtype=np.uint8).reshape(2, 4),
        "lm_head.weight": np.ones((8, 4), np.float32),
    }
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    ck = opener(root)
    assert ck.index_file is None and ck.config is None
    assert set(ck.shards) == {"model.safetensors"}
    assert set(ck.tensors) == set(tensors) and ck.problems == []
    assert ck.unknown_tensors() == []
    np.testing.assert_array_equal(ck.read_tensor("model.layers.0.mlp.down_proj.weight"),
                                  tensors["model.layers.0.mlp.down_proj.weight"])
    # With a config next to it.
    shutil.copy(k3_tiny / "config.json", root / "config.json")
    assert opener(root).config.family == "kimi_k3"


def test_single_file_malformed(tmp_path: Path, write_raw, opener) -> None:
    root = tmp_path / "single"
    p = write_raw(root / "model.safetensors", {"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 1]}}, b"x")
    with pytest.raises(SafetensorsHeaderError) as ei:
        opener(root)
    assert "needs 2 bytes" in assert_names(ei.value, p.resolve())


# ---------------------------------------------------------------------------------------------
# Hugging Face cache and local-dir layouts, downloaded by the real client


@pytest.fixture
def hf_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def test_hf_cache_and_local_dir(k3_tiny: Path, clone_checkpoint, tmp_path: Path, hf_offline) -> None:
    from huggingface_hub import snapshot_download

    from k3ckpt.testing.hub import LoopbackHub

    served = clone_checkpoint(k3_tiny)
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "hub-hashes") as hub:
        commit = hub.commit(REPO)
        snap = Path(snapshot_download(REPO, cache_dir=tmp_path / "cache", endpoint=hub.url, token=False))
        local = Path(snapshot_download(REPO, local_dir=tmp_path / "local", endpoint=hub.url, token=False))
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    repo_dir = tmp_path / "cache" / "models--moonshotai--Kimi-K3"
    assert snap == repo_dir / "snapshots" / commit
    assert (repo_dir / "refs" / "main").read_text().strip() == commit

    # (a) the snapshot folder: files are symlinks into blobs/.
    ck = open_checkpoint(snap)
    assert ck.source.layout == "hf-cache"
    assert ck.source.repo == REPO
    assert ck.source.revision == commit
    assert len(ck.tensors) == 533 and ck.problems == [] and ck.unknown_tensors() == []
    assert ck.root == snap.resolve()
    assert ck.read_tensor(BF16_NAME).tobytes() == open_checkpoint(k3_tiny).read_tensor(BF16_NAME).tobytes()

    # (b) the repo folder, resolved through refs/main.
    ck2 = open_checkpoint(repo_dir)
    assert ck2.root == snap.resolve()
    assert (ck2.source.layout, ck2.source.repo, ck2.source.revision) == ("hf-cache", REPO, commit)
    assert ck2.tensors == ck.tensors

    # (c) local_dir: huggingface_hub records "<commit>\n<etag>\n<timestamp>" per file.
    meta = local / ".cache" / "huggingface" / "download" / "config.json.metadata"
    assert meta.is_file(), "the installed huggingface_hub no longer writes local-dir metadata"
    assert meta.read_text().splitlines()[0] == commit
    ck3 = open_checkpoint(local)
    assert ck3.source.layout == "local-dir"
    assert ck3.source.revision == commit
    assert ck3.source.repo is None
    assert len(ck3.tensors) == 533 and ck3.problems == []
    # Files under hidden dirs are not part of the checkpoint.
    assert not any(f.startswith(".cache") for f in ck3.iter_files())


def test_hf_cache_repo_folder_without_refs(k3_tiny: Path, tmp_path: Path) -> None:
    repo_dir = tmp_path / "models--org--name"
    commits = ["a" * 40, "b" * 40]
    shutil.copytree(k3_tiny, repo_dir / "snapshots" / commits[0])
    ck = open_checkpoint(repo_dir)  # one snapshot, no refs/main: that one
    assert (ck.source.repo, ck.source.revision) == ("org/name", commits[0])
    (repo_dir / "snapshots" / commits[1]).mkdir()
    with pytest.raises(CheckpointNotFoundError) as ei:
        open_checkpoint(repo_dir)
    assert "2 snapshots and no refs/main" in assert_names(ei.value, repo_dir.resolve())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commits[0] + "\n")
    assert open_checkpoint(repo_dir).source.revision == commits[0]


def test_local_dir_revision_needs_40_chars(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    meta = root / ".cache" / "huggingface" / "download" / "config.json.metadata"
    meta.parent.mkdir(parents=True)
    meta.write_text("short\netag\n1.0\n")
    assert open_checkpoint(root).source.revision is None
    meta.write_text("")
    assert open_checkpoint(root).source.revision is None
    meta.write_text("c" * 40 + "\netag\n1.0\n")
    assert open_checkpoint(root).source.revision == "c" * 40


# ---------------------------------------------------------------------------------------------
# Opening reads headers only


def test_open_reads_headers_only(k3_tiny: Path, clone_checkpoint, monkeypatch) -> None:
    root = clone_checkpoint(k3_tiny)
    rng = np.random.default_rng(1)
    data_starts = {}
    for shard in sorted(root.glob("*.safetensors")):
        h = read_header(shard)
        data_starts[shard.name] = h.data_start
        with open(shard, "r+b") as f:  # garbage in every data region, headers intact
            f.seek(h.data_start)
            f.write(rng.integers(0, 256, h.data_len, dtype=np.uint8).tobytes())
    assert data_starts

    # Count the bytes the header reader asks for.
    read_sizes: dict[str, int] = {}
    real_open = open

    class CountingFile:
        def __init__(self, f, name: str) -> None:
            self._f, self._name = f, name

        def read(self, n: int = -1) -> bytes:
            out = self._f.read(n)
            read_sizes[self._name] = read_sizes.get(self._name, 0) + len(out)
            return out

        def __getattr__(self, attr):
            return getattr(self._f, attr)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self._f.close()

    def counting_open(path, mode="r", *args, **kwargs):
        return CountingFile(real_open(path, mode, *args, **kwargs), os.path.basename(path))

    monkeypatch.setattr(sh, "open", counting_open, raising=False)
    ck = open_in_process(root, monkeypatch)
    assert read_sizes == data_starts  # exactly 8 + header length of each shard, no data
    monkeypatch.undo()

    reference = open_checkpoint(k3_tiny)
    for mode in ("in-process", "parallel"):
        ck = OPENERS[mode](root, monkeypatch)
        assert ck.problems == []
        assert ck.tensors == reference.tensors
        assert ck.roles == reference.roles
        assert ck.unknown_tensors() == []
        assert ck.stats.signatures == reference.stats.signatures
    # The garbage is really there: reading data shows it.
    assert ck.read_tensor(U8_NAME).tobytes() != reference.read_tensor(U8_NAME).tobytes()


def test_open_headers_only_synthetic(tmp_path: Path) -> None:
    """A headers-only synth (data regions are holes) opens like the real thing."""
    from k3ckpt.testing.synth import spec_from_preset, synthesize

    synthesize(spec_from_preset("k3-tiny", headers_only=True), tmp_path / "holes")
    ck = open_checkpoint(tmp_path / "holes")
    assert len(ck.tensors) == 533 and ck.problems == [] and ck.unknown_tensors() == []
