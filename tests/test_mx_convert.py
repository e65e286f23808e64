"""k3ckpt.mx_convert and `k3ckpt mx dequant` / `k3ckpt mx quantize`: exact values, the K3 layout,
selection, streaming with bounded memory, atomic output, one-line errors."""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from helpers import assert_one_line_error, run
from k3ckpt.format.checkpoint import numpy_dtype, open_checkpoint
from k3ckpt.format.header import DTYPE_BITS, TensorSpec, build_header, read_header
from k3ckpt.mx import convert as mx_convert
from k3ckpt.mx.codec import dequantize_mxfp4, dequantize_mxfp4_gptoss, quantize_mxfp4
from k3ckpt.mx.convert import (
    MxConvertError,
    dequantize_to_file,
    is_quantizable,
    quantize_file,
)
from k3ckpt.mx.select import MxSelectionError, MxSource, find_mx_tensors
from k3ckpt.testing.synth import spec_from_preset, synthesize

NP_TO_ST = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
            np.dtype(np.uint8): "U8", np.dtype(np.int64): "I64"}
EXP = "language_model.model.layers.1.block_sparse_moe."


def read_all(path: Path) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """``(metadata, {name: array})`` of a safetensors file through k3ckpt's own header reader."""
    h = read_header(path)
    raw = path.read_bytes()
    return h.metadata, {n: np.frombuffer(raw[h.data_start + t.begin: h.data_start + t.end], dtype=numpy_dtype(t.dtype))
                        .reshape(t.shape) for n, t in h.tensors.items()}


def write_st(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> Path:
    prefix, _ = build_header([TensorSpec(n, NP_TO_ST[a.dtype], a.shape) for n, a in tensors.items()], metadata)
    path.write_bytes(prefix + b"".join(np.ascontiguousarray(a).tobytes() for a in tensors.values()))
    return path


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes (so NaNs and signed zeros count too)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def expected_dequant(root: Path, name: str, dtype: np.dtype) -> np.ndarray:
    """The dequantized tensor from the *whole* stored tensors, through the layout's own decoder."""
    ck = open_checkpoint(root)
    if name + "_blocks" in ck.tensors:  # gpt-oss stacked
        return dequantize_mxfp4_gptoss(ck.read_tensor(name + "_blocks"), ck.read_tensor(name + "_scales"), dtype)
    base = name[: -len(".weight")]
    return dequantize_mxfp4(ck.read_tensor(base + ".weight_packed"), ck.read_tensor(base + ".weight_scale"), dtype)


# -- dequant: values, header, chunking -----------------------------------------------------------


@pytest.mark.parametrize("to", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("family", ["k3", "gptoss"])
def test_dequant_equals_whole_tensor_dequantization(family: str, to: str, k3_tiny: Path, gptoss_tiny: Path,
                                                    tmp_path: Path) -> None:
    root, layer = (k3_tiny, 1) if family == "k3" else (gptoss_tiny, 2)
    st_dtype, np_dtype = mx_convert.DEQUANT_DTYPES[to]
    out = tmp_path / "out.safetensors"
    res = dequantize_to_file(root, out, to=to, layer=layer)
    selected = find_mx_tensors(MxSource.open(root), layer=layer)
    assert res.tensors == tuple(m.weight_name for m in selected)
    assert res.bytes_out == out.stat().st_size and res.dtype == st_dtype
    assert res.bytes_in == sum(m.packed_bytes + m.packed_bytes // 16 for m in selected)

    h = read_header(out)
    assert list(h.tensors) == [m.weight_name for m in selected]  # file order = selection order
    assert h.metadata == {"format": "pt", mx_convert.OWNER_KEY: "mx dequant"}  # the ownership record
    for m in selected:
        t = h.tensors[m.weight_name]
        assert t.dtype == st_dtype and t.shape == m.shape
    if family == "k3":
        assert len(selected) == 16 * 3 and selected[0].shape == (64, 128)  # w1 [moe_inter, expert width]
    else:
        assert [m.weight_name for m in selected] == ["model.layers.2.mlp.experts.down_proj",
                                                     "model.layers.2.mlp.experts.gate_up_proj"]
        assert h.tensors["model.layers.2.mlp.experts.gate_up_proj"].shape == (8, 512, 256)  # [E, out, in]

    _, got = read_all(out)
    # An independent reader: the safetensors library itself (bf16 through ml_dtypes, imported above).
    with safe_open(str(out), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(got)
        for m in selected:
            want = expected_dequant(root, m.weight_name, np_dtype)
            assert same_bits(got[m.weight_name], want), m.weight_name
            assert same_bits(f.get_tensor(m.weight_name), want), m.weight_name


@pytest.mark.parametrize("root_name", ["k3_tiny", "gptoss_tiny"])
def test_dequant_is_independent_of_the_chunk_size(root_name: str, request, tmp_path: Path) -> None:
    root = request.getfixturevalue(root_name)
    outs = []
    for i, chunk in enumerate([1, 100, 4096, 1 << 30]):
        out = tmp_path / f"c{i}.safetensors"
        seen: list[int] = []
        planned: list[int] = []
        dequantize_to_file(root, out, to="fp32", layer=1, chunk_bytes=chunk, progress=seen.append,
                           on_plan=planned.append)
        assert sum(seen) == planned[0] == read_header(out).data_len  # progress = output bytes
        if chunk == 1:
            assert len(seen) > len(read_header(out).tensors)  # really row by row
        outs.append(out.read_bytes())
    assert all(o == outs[0] for o in outs)


def test_dequant_selection_and_file_input(k3_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.safetensors"
    w1 = EXP + "experts.3.w1"
    for form in (w1 + ".weight", w1, w1 + ".weight_packed", w1 + ".weight_scale"):
        res = dequantize_to_file(k3_tiny, out, tensor=form)
        assert res.tensors == (w1 + ".weight",)
    res = dequantize_to_file(k3_tiny, out, layer=2, expert=5)
    assert res.tensors == tuple(f"language_model.model.layers.2.block_sparse_moe.experts.5.{w}.weight"
                                for w in ("w1", "w2", "w3"))
    # FILE input: only the pairs stored in that one shard.
    ck = open_checkpoint(k3_tiny)
    shard = ck.tensors[w1 + ".weight_packed"].file
    res = dequantize_to_file(k3_tiny / shard, out, to="fp32")
    in_shard = {n[: -len("_packed")] for n in ck.shards[shard].tensors if n.endswith(".weight_packed")}
    assert set(res.tensors) == in_shard and len(in_shard) == 48
    _, got = read_all(out)
    assert same_bits(got[w1 + ".weight"], expected_dequant(k3_tiny, w1 + ".weight", np.float32))
    with pytest.raises(MxSelectionError, match="no MXFP4 tensor matches --layer 0"):
        dequantize_to_file(k3_tiny, out, layer=0)  # the dense layer


def test_dequant_cli_json_text_and_usage(k3_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "e.safetensors"
    res = run("mx", "dequant", str(k3_tiny), "--layer", "1", "--expert", "0", "--to", "fp16", "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["dtype"] == "F16" and data["tensors"] == 3 and data["bytes_out"] == out.stat().st_size
    assert data["names"][0] == EXP + "experts.0.w1.weight"
    res = run("mx", "dequant", str(k3_tiny), "--tensor", EXP + "experts.0.w2.weight", "-o", str(out))
    assert res.exit_code == 0 and res.output.startswith(f"wrote {out}: 1 tensors as bf16")
    assert read_header(out).tensors[EXP + "experts.0.w2.weight"].dtype == "BF16"

    assert_one_line_error(run("mx", "dequant", str(k3_tiny), "--layer", "0", "-o", str(out)), 2,
                           "no MXFP4 tensor matches --layer 0")
    assert_one_line_error(run("mx", "dequant", str(tmp_path / "nope"), "-o", str(out)), 2, "nope")
    assert_one_line_error(run("mx", "dequant", str(k3_tiny), "--layer", "1", "-o", str(tmp_path / "no" / "x")), 2,
                           "no such directory")
    assert run("mx", "dequant", str(k3_tiny), "--expert", "1", "-o", str(out)).exit_code == 2  # needs --layer
    assert run("mx", "dequant", str(k3_tiny), "--tensor", "x", "--layer", "1", "-o", str(out)).exit_code == 2


def test_dequant_refuses_to_replace_its_input(k3_tiny: Path, tmp_path: Path) -> None:
    shard = tmp_path / "shard.safetensors"
    ck = open_checkpoint(k3_tiny)
    shutil.copy(k3_tiny / ck.tensors[EXP + "experts.0.w1.weight_packed"].file, shard)
    before = shard.read_bytes()
    assert_one_line_error(run("mx", "dequant", str(shard), "-o", str(shard)), 2, "is an input of this conversion")
    assert shard.read_bytes() == before and listing(tmp_path) == {"shard.safetensors"}


# -- quantize ------------------------------------------------------------------------------------


def _float_input(tmp_path: Path, rng_seed: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
    """A fine-tuned-looking file: routed experts in three float dtypes, and what K3 never quantizes."""
    rng = np.random.default_rng(rng_seed)

    def w(shape: tuple[int, ...], dtype=np.float32, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(dtype)

    e0 = w((64, 96), ml_dtypes.bfloat16)
    e0[3] = 0  # an all-zero row: every block gets the smallest scale
    e0[4, :32] = np.float32(7.0)  # floor saturates this block, ceil does not
    t = {
        "language_model.model.layers.1.input_layernorm.weight": w((96,), ml_dtypes.bfloat16),
        EXP + "gate.e_score_correction_bias": w((8,)),
        EXP + "gate.weight": w((8, 96), ml_dtypes.bfloat16),
        EXP + "experts.0.w1.weight": e0,
        EXP + "experts.0.w2.weight": w((96, 64), np.float32, 3e4),
        EXP + "experts.0.w3.weight": w((64, 96), np.float16),
        EXP + "experts.1.w1.weight": w((5, 64), ml_dtypes.bfloat16, 1e-30),  # odd rows, tiny values
        EXP + "experts.1.w2.weight": w((8, 40), ml_dtypes.bfloat16),  # in % 32 != 0: copied
        EXP + "shared_experts.gate_proj.weight": w((64, 96), ml_dtypes.bfloat16),
        EXP + "routed_expert_down_proj.weight": w((64, 96), ml_dtypes.bfloat16),
        "language_model.model.layers.1.self_attn.q_proj.weight": w((64, 96), ml_dtypes.bfloat16),
        "language_model.model.embed_tokens.weight": w((100, 96), ml_dtypes.bfloat16),
        "language_model.lm_head.weight": w((100, 96), ml_dtypes.bfloat16),
        "vision_tower.encoder.blocks.0.wqkv.weight": w((96, 32), ml_dtypes.bfloat16),
        "odd_u8": np.arange(3, dtype=np.uint8),  # breaks alignment for whatever follows it
        "step": np.array([7], dtype=np.int64),
    }
    return write_st(tmp_path / "in.safetensors", t, {"format": "pt", "note": "kept"}), t


ROUTED = [EXP + "experts.0.w1.weight", EXP + "experts.0.w2.weight", EXP + "experts.0.w3.weight",
          EXP + "experts.1.w1.weight"]


def test_quantize_k3_layout_exact_and_copies_the_rest(tmp_path: Path) -> None:
    inp, src = _float_input(tmp_path)
    out = tmp_path / "out.safetensors"
    res = quantize_file(inp, out)
    assert sorted(res.quantized) == sorted(ROUTED)
    assert res.copied == len(src) - len(ROUTED)
    assert res.bytes_in == inp.stat().st_size and res.bytes_out == out.stat().st_size

    meta, got = read_all(out)
    assert meta == {"format": "pt", "note": "kept", mx_convert.OWNER_KEY: "mx quantize"}  # + who wrote it
    h = read_header(out)
    for name in ROUTED:
        base, (rows, cols) = name[: -len(".weight")], src[name].shape
        assert name not in got
        p, s = h.tensors[base + ".weight_packed"], h.tensors[base + ".weight_scale"]
        assert (p.dtype, p.shape, s.dtype, s.shape) == ("U8", (rows, cols // 2), "U8", (rows, cols // 32))
        want_p, want_s = quantize_mxfp4(src[name])
        assert same_bits(got[base + ".weight_packed"], want_p) and same_bits(got[base + ".weight_scale"], want_s)
    assert set(got) == {n for n in src if n not in ROUTED} | {
        n[: -len("weight")] + part for n in ROUTED for part in ("weight_packed", "weight_scale")}
    for name, a in src.items():
        if name not in ROUTED:
            assert same_bits(got[name], a), name  # same name, dtype, shape, bytes
    # Laid out so every tensor starts at a multiple of its element size.
    for t in h.tensors.values():
        assert (h.data_start + t.begin) % max(1, DTYPE_BITS[t.dtype] // 8) == 0, t.name
    with safe_open(str(out), framework="numpy") as f:  # a valid file for the reference reader too
        assert same_bits(f.get_tensor(EXP + "experts.0.w2.weight_scale"), got[EXP + "experts.0.w2.weight_scale"])
        assert same_bits(f.get_tensor("step"), src["step"])
    # Streaming row by row gives the very same file.
    again = tmp_path / "again.safetensors"
    quantize_file(inp, again, chunk_bytes=1)
    assert again.read_bytes() == out.read_bytes()


def test_quantize_all_takes_every_linear_weight_but_norms_embeddings_heads(tmp_path: Path) -> None:
    inp, _ = _float_input(tmp_path)
    res = quantize_file(inp, tmp_path / "all.safetensors", include_all=True)
    assert sorted(res.quantized) == sorted(ROUTED + [
        EXP + "gate.weight", EXP + "shared_experts.gate_proj.weight", EXP + "routed_expert_down_proj.weight",
        "language_model.model.layers.1.self_attn.q_proj.weight", "vision_tower.encoder.blocks.0.wqkv.weight"])
    assert not is_quantizable("language_model.model.embed_tokens.weight", "BF16", (100, 96), True)
    assert not is_quantizable("model.layers.3.final_layernorm.weight", "BF16", (4, 96), True)
    assert not is_quantizable("model.layers.61.shared_head.head.weight", "BF16", (4, 96), True)  # DeepSeek MTP
    assert is_quantizable("model.layers.61.eh_proj.weight", "BF16", (4, 96), True)
    assert not is_quantizable("some.other.model.head.weight", "BF16", (4, 96), True)  # unknown: by module name
    assert not is_quantizable(EXP + "experts.0.w1.weight", "F8_E4M3", (64, 96))
    assert not is_quantizable(EXP + "experts.0.w1.weight_packed", "U8", (64, 48))
    assert is_quantizable("model.layers.0.mlp.experts.7.gate_proj.weight", "BF16", (64, 96))  # K2 naming


def test_quantize_scale_mode_passes_through(tmp_path: Path) -> None:
    inp, src = _float_input(tmp_path)
    outs = {}
    for mode in ("compressed-tensors", "floor", "ceil", "even"):
        out = tmp_path / f"{mode}.safetensors"
        res = run("mx", "quantize", str(inp), "-o", str(out), "--scale-mode", mode, "--json")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["scale_mode"] == {"floor": "ocp"}.get(mode, mode)
        _, outs[mode] = read_all(out)
        want_p, want_s = quantize_mxfp4(src[ROUTED[0]], scale_mode=mode)
        assert same_bits(outs[mode][EXP + "experts.0.w1.weight_scale"], want_s)
        assert same_bits(outs[mode][EXP + "experts.0.w1.weight_packed"], want_p)
    floor_s, ceil_s = (outs[m][EXP + "experts.0.w1.weight_scale"] for m in ("floor", "ceil"))
    assert floor_s[4, 0] == 127 + 0 and ceil_s[4, 0] == 127 + 1  # the block of 7.0s
    assert outs["compressed-tensors"][EXP + "experts.0.w1.weight_scale"][4, 0] == 127 + 1  # 7 rounds to 8
    assert not np.array_equal(floor_s, ceil_s)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_quantize_refuses_nan_naming_the_tensor(bad: float, tmp_path: Path) -> None:
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    inp, src = _float_input(src_dir)
    x = src[EXP + "experts.0.w3.weight"].copy()
    x[5, 7] = bad
    write_st(inp, {**src, EXP + "experts.0.w3.weight": x})
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = run("mx", "quantize", str(inp), "-o", str(out_dir / "q.safetensors"))
    assert_one_line_error(res, 2, f"tensor '{EXP}experts.0.w3.weight'", "NaN/Inf", "[5, 7]")
    assert listing(out_dir) == set()  # no output, no temporary file
    with pytest.raises(MxConvertError, match="first at \\[5, 7\\]"):
        quantize_file(inp, out_dir / "q.safetensors", chunk_bytes=1)  # found in its own row chunk
    assert listing(out_dir) == set()


def test_quantize_then_dequant_recovers_values_within_mxfp4_error(tmp_path: Path) -> None:
    inp, src = _float_input(tmp_path)
    packed = tmp_path / "packed.safetensors"
    assert run("mx", "quantize", str(inp), "-o", str(packed)).exit_code == 0
    back = tmp_path / "back.safetensors"
    res = run("mx", "dequant", str(packed), "--to", "fp32", "-o", str(back), "--json")
    assert res.exit_code == 0, res.output
    assert sorted(json.loads(res.stdout)["names"]) == sorted(ROUTED)  # names round-trip
    _, got = read_all(back)
    for name in ROUTED:
        x = src[name].astype(np.float32)
        y = got[name]
        assert same_bits(y, dequantize_mxfp4(*quantize_mxfp4(x)))
        # Floor mode: each block's values scale into [0, 8) x 2**e with amax >= 4 x 2**e; rounding
        # (spacing <= 2) and saturation at 6 each cost at most a quarter of the block maximum.
        amax = np.abs(x).reshape(x.shape[0], -1, 32).max(axis=-1, keepdims=True)
        err = np.abs(y - x).reshape(amax.shape[0], -1, 32)
        assert (err <= amax / 4).all(), name
        assert np.abs(y - x).max() <= 0.25 * np.abs(x).max()


def test_quantize_cli_text_json_and_errors(tmp_path: Path) -> None:
    inp, src = _float_input(tmp_path)
    out = tmp_path / "q.safetensors"
    res = run("mx", "quantize", str(inp), "-o", str(out))
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"wrote {out}: 4 tensors quantized (compressed-tensors), {len(src) - 4} copied; ")
    res = run("mx", "quantize", str(inp), "-o", str(out), "--all", "--json")
    data = json.loads(res.stdout)
    assert data["tensors_quantized"] == 9 and data["include_all"] is True
    assert data["bytes_in"] == inp.stat().st_size and data["bytes_out"] == out.stat().st_size < data["bytes_in"]
    assert_one_line_error(run("mx", "quantize", str(tmp_path / "missing.safetensors"), "-o", str(out)), 2,
                           "missing.safetensors", "file not found")
    assert_one_line_error(run("mx", "quantize", str(inp), "-o", str(inp)), 2, "is an input of this conversion")
    # An output name that would collide with a tensor already in the file.
    clash = write_st(tmp_path / "clash.safetensors", {
        EXP + "experts.0.w1.weight": src[EXP + "experts.0.w1.weight"],
        EXP + "experts.0.w1.weight_scale": np.zeros((64, 3), np.uint8)})
    assert_one_line_error(run("mx", "quantize", str(clash), "-o", str(out)), 2, "already has")


# -- atomic output, disk space -------------------------------------------------------------------


def _fail_on_call(monkeypatch: pytest.MonkeyPatch, n: int, exc: BaseException) -> None:
    real = mx_convert.pwrite_all
    calls = iter(range(1, 1_000_000))

    def flaky(fd: int, data, offset: int) -> None:
        if next(calls) == n:
            raise exc
        real(fd, data, offset)

    monkeypatch.setattr(mx_convert, "pwrite_all", flaky)


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["ENOSPC", "Ctrl-C"])
@pytest.mark.parametrize("what", ["dequant", "quantize"])
def test_failure_mid_write_leaves_no_partial_file(what: str, exc: BaseException, k3_tiny: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    exc = copy.copy(exc)  # a fresh one per test: the raise below gives it a file name
    inp, _ = _float_input(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "x.safetensors"
    # an earlier output: a safetensors file whose header says a conversion wrote it
    previous = build_header([], {"previous": "run", mx_convert.OWNER_KEY: "mx " + what})[0]
    out.write_bytes(previous)
    _fail_on_call(monkeypatch, 5, exc)
    with pytest.raises(type(exc)):
        if what == "dequant":
            dequantize_to_file(k3_tiny, out, layer=1, chunk_bytes=64)
        else:
            quantize_file(inp, out, chunk_bytes=64)
    assert listing(out_dir) == {"x.safetensors"} and out.read_bytes() == previous
    if isinstance(exc, OSError):  # the file it was writing is named (no path: "where?")
        assert exc.filename == str(out)


@pytest.mark.parametrize("what", ["dequant", "quantize"])
@pytest.mark.parametrize("foreign", ["checkpoint shard", "another library's file"])
def test_a_safetensors_file_no_conversion_wrote_is_never_replaced(what: str, foreign: str, k3_tiny: Path,
                                                                  tmp_path: Path) -> None:
    """Issue #25: ``-o`` naming a shard of a fetched checkpoint, or a file the safetensors library
    wrote, replaced it silently (only non-safetensors files were refused). Now only a file whose
    header says a conversion wrote it is replaced; the rest are refused before any byte."""
    from safetensors.numpy import save_file

    inp, _ = _float_input(tmp_path)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(k3_tiny, ckpt)
    if foreign == "checkpoint shard":
        out = ckpt / "model-00001-of-000008.safetensors"
    else:
        out = tmp_path / "theirs.safetensors"
        save_file({"w": np.zeros((2, 32), np.float32)}, str(out))
    before = out.read_bytes()
    args = (["mx", "dequant", str(k3_tiny), "--layer", "1"] if what == "dequant" else ["mx", "quantize", str(inp)])
    assert_one_line_error(run(*args, "-o", str(out)), 2, f"{out}: exists and is not a safetensors file k3ckpt wrote")
    assert out.read_bytes() == before and not list(out.parent.glob(".*.tmp"))
    if foreign == "checkpoint shard":
        assert run("verify", str(ckpt)).exit_code == 0
    # an earlier conversion's output is the command's own: a re-run replaces it
    own = tmp_path / "own.safetensors"
    assert run(*args, "-o", str(own)).exit_code == 0
    assert run(*args, "-o", str(own)).exit_code == 0


@pytest.mark.parametrize("what", ["dequant", "quantize"])
def test_an_output_name_holding_another_kind_of_file_is_refused(what: str, k3_tiny: Path, tmp_path: Path) -> None:
    """Only a safetensors file (an earlier conversion's kind) is replaced; notes are not."""
    inp, _ = _float_input(tmp_path)
    out = tmp_path / "notes.safetensors"
    out.write_text("my notes")
    args = (["mx", "dequant", str(k3_tiny), "--layer", "1"] if what == "dequant"
            else ["mx", "quantize", str(inp)])
    res = run(*args, "-o", str(out))
    assert_one_line_error(res, 2, f"{out}: exists and is not a safetensors file k3ckpt wrote")
    assert out.read_text() == "my notes"


def test_failure_through_the_cli_is_one_line(k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_on_call(monkeypatch, 3, OSError(errno.ENOSPC, "No space left on device"))
    res = run("mx", "dequant", str(k3_tiny), "--layer", "1", "-o", str(tmp_path / "x.safetensors"))
    assert_one_line_error(res, 2, "No space left on device")
    assert listing(tmp_path) == set()


@pytest.mark.parametrize("what", ["dequant", "quantize"])
def test_disk_space_is_checked_first(what: str, k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inp, _ = _float_input(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 1000, 1000))
    args = (["mx", "dequant", str(k3_tiny), "--layer", "1", "--to", "fp32"] if what == "dequant"
            else ["mx", "quantize", str(inp)])
    res = run(*args, "-o", str(out_dir / "x.safetensors"))
    assert_one_line_error(res, 2, "not enough disk space", "1,000 bytes", str(out_dir))
    assert listing(out_dir) == set()


# -- bounded memory ------------------------------------------------------------------------------

# Runs one CLI command in a fresh interpreter and reports its own peak RSS (VmHWM): the parent's
# RUSAGE_CHILDREN would mix in every earlier child of the test session.
_MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    def hwm_kb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    base = hwm_kb()
    from k3ckpt.cli import main
    t = time.perf_counter()
    main(sys.argv[1:], standalone_mode=False)
    print(json.dumps({"base_kb": base, "peak_kb": hwm_kb(), "seconds": time.perf_counter() - t,
                      "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), file=sys.stderr)
""")
PEAK_BOUND = 256 * 2**20


def _measure(*args: str) -> dict:
    env = dict(os.environ, K3CKPT_MX_CHUNK_BYTES=str(8 * 2**20))  # the shipped default, whatever the caller set
    p = subprocess.run([sys.executable, "-c", _MEASURE, *args], check=False, capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stderr.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_dequant_of_a_whole_layer_runs_in_bounded_memory(tmp_path: Path) -> None:
    """A whole MoE layer to fp32, > 1 GB of output, from a child process whose peak RSS stays far
    below it - both for a layer of many K3 expert tensors and for gpt-oss, where one stacked
    tensor *is* the layer (so holding a whole tensor would show). The inputs are headers-only
    synthetic checkpoints (data read as zeros from sparse holes): the same reads, decode and
    writes as real data, without minutes of synthesis."""
    k3 = tmp_path / "k3"
    synthesize(spec_from_preset("k3-small", num_layers=2, num_experts=384, vocab_size=1024, vision_layers=0,
                                headers_only=True), k3)
    oss = tmp_path / "oss"
    synthesize(spec_from_preset("gptoss-tiny", num_layers=1, hidden_size=1024, moe_intermediate_size=1024,
                                num_experts=96, num_shards=0, headers_only=True), oss)
    for root, layer in ((k3, "1"), (oss, "0")):
        out = tmp_path / "layer.safetensors"
        m = _measure("mx", "dequant", str(root), "--layer", layer, "--to", "fp32", "-o", str(out), "--json")
        size = out.stat().st_size
        packed = sum(t.packed_bytes for t in find_mx_tensors(MxSource.open(root), layer=int(layer)))
        print(f"{root.name}: {packed / 1e6:.0f} MB packed -> {size / 1e9:.2f} GB fp32, "
              f"peak RSS {m['peak_kb'] / 1024:.0f} MiB (at start {m['base_kb'] / 1024:.0f} MiB), {m['seconds']:.1f} s")
        assert size > 1e9 and packed > 100e6
        assert m["peak_kb"] * 1024 < PEAK_BOUND < size / 4
        h = read_header(out)
        name = next(iter(h.tensors))
        assert h.tensors[name].dtype == "F32"
        out.unlink()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_quantize_of_a_large_tensor_runs_in_bounded_memory(tmp_path: Path) -> None:
    """One 512 MB F32 expert weight (a sparse hole: zeros) quantized in a child process."""
    name = EXP + "experts.0.w1.weight"
    prefix, offsets = build_header([TensorSpec(name, "F32", (8192, 16384))], {"format": "pt"})
    inp = tmp_path / "big.safetensors"
    with open(inp, "wb") as f:
        f.write(prefix)
        f.truncate(len(prefix) + offsets[-1][1])
    out = tmp_path / "q.safetensors"
    m = _measure("mx", "quantize", str(inp), "-o", str(out), "--json")
    print(f"quantize 512 MB F32: peak RSS {m['peak_kb'] / 1024:.0f} MiB, {m['seconds']:.1f} s")
    assert m["peak_kb"] * 1024 < 160 * 2**20
    h = read_header(out)
    assert h.tensors[name[: -len(".weight")] + ".weight_packed"].shape == (8192, 8192)


# -- quantize a whole checkpoint directory -------------------------------------------------------


def float_checkpoint(src: Path, dst: Path) -> Path:
    """``src`` (an MXFP4 checkpoint) with every packed pair decoded to one BF16 ``.weight``, its
    config without quantization_config and every other file as it is: a float checkpoint."""
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        meta, tensors = read_all(src / shard)
        out = {}
        for name, array in tensors.items():
            if name.endswith(".weight_scale"):
                continue
            if name.endswith(".weight_packed"):
                base = name[: -len("_packed")]
                array = dequantize_mxfp4(array, tensors[base + "_scale"], dtype=ml_dtypes.bfloat16)
                name = base
            out[name] = array
            weight_map[name] = shard
        write_st(dst / shard, out, meta)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(p, dst / p.name)
    return dst


def test_quantize_checkpoint_writes_a_loadable_k3_checkpoint(k3_tiny: Path, tmp_path: Path) -> None:
    src = float_checkpoint(k3_tiny, tmp_path / "bf16")
    out = tmp_path / "mxfp4"
    res = run("mx", "quantize", str(src), "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["scale_mode"] == "compressed-tensors" and doc["tensors_quantized"] == 192
    # the same files as the original MXFP4 checkpoint, and the same tensors in the same shards
    assert listing(out) - {".cache"} == listing(k3_tiny)
    want_index = json.loads((k3_tiny / "model.safetensors.index.json").read_text())["weight_map"]
    got_index = json.loads((out / "model.safetensors.index.json").read_text())
    assert got_index["weight_map"] == want_index
    for shard in set(want_index.values()):
        want_meta, want = read_all(k3_tiny / shard)
        _, floats = read_all(src / shard)
        got_meta, got = read_all(out / shard)
        assert got.keys() == want.keys() and got_meta == {**want_meta, mx_convert.OWNER_KEY: "mx quantize"}
        for name, array in got.items():
            if name.endswith(".weight_packed"):  # quantized from the float weight, as quantize_mxfp4 does
                packed, scales = quantize_mxfp4(floats[name[: -len("_packed")]])
                assert same_bits(array, packed) and same_bits(got[name[: -len("packed")] + "scale"], scales)
            elif not name.endswith(".weight_scale"):  # carried over byte for byte
                assert same_bits(array, want[name])
    assert sum(read_header(out / s).data_len for s in set(want_index.values())) == got_index["metadata"]["total_size"]
    for name in ("tiktoken.model", "LICENSE", "tokenizer_config.json", "tokenization_kimi.py"):
        assert (out / name).read_bytes() == (k3_tiny / name).read_bytes()
    # the values survive the round trip exactly (each dequantized block is on the grid again)
    assert run("mx", "dequant", str(out), "-o", str(tmp_path / "a.safetensors")).exit_code == 0
    assert run("mx", "dequant", str(k3_tiny), "-o", str(tmp_path / "b.safetensors")).exit_code == 0
    a, b = read_all(tmp_path / "a.safetensors")[1], read_all(tmp_path / "b.safetensors")[1]
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
    # and k3ckpt's own loadability checks accept it
    assert run("inspect", str(out)).exit_code == 0


def test_quantize_checkpoint_config_is_compressed_tensors_own(k3_tiny: Path, tmp_path: Path) -> None:
    from k3ckpt.mx.checkpoint import compressed_tensors_config

    src = float_checkpoint(k3_tiny, tmp_path / "bf16")
    out = tmp_path / "mxfp4"
    assert run("mx", "quantize", str(src), "-o", str(out)).exit_code == 0
    config = json.loads((out / "config.json").read_text())
    quant = config.pop("quantization_config")
    assert config == json.loads((src / "config.json").read_text())  # nothing else changed
    with np.load(Path(__file__).parent / "data" / "mxfp4_golden.npz") as g:
        golden = json.loads(g["meta"].tobytes())["quantization_config"]
    # every field written is compressed-tensors' own serialisation of it (the rest are its defaults)
    for key, value in quant.items():
        if key == "config_groups":
            got, want = value["group_0"], golden["config_groups"]["group_0"]
            assert got["targets"] == want["targets"] == ["Linear"]
            assert got["weights"] == {k: v for k, v in want["weights"].items() if v is not None}
        elif key != "ignore":
            assert value == golden[key], key
    assert quant == compressed_tensors_config(quant["ignore"])
    # the ignore list names exactly the linear modules left in BF16: attention, shared experts,
    # router, dense MLP, vision, lm_head - never a quantized one, never a norm or an embedding
    ck = open_checkpoint(out)
    packed = {n[: -len(".weight_packed")] for n in ck.tensors if n.endswith(".weight_packed")}
    assert not packed & set(quant["ignore"])
    kept = {n[: -len(".weight")] for n, t in ck.tensors.items() if n.endswith(".weight") and len(t.shape) == 2}
    assert set(quant["ignore"]) <= kept
    assert "language_model.lm_head" in quant["ignore"]
    assert any(".shared_experts." in m for m in quant["ignore"]) and any(".self_attn." in m for m in quant["ignore"])
    assert not any("norm" in m.rsplit(".", 1)[-1] or "embed" in m for m in quant["ignore"])


@pytest.mark.parametrize("where", ["new", "empty"])
def test_a_failed_checkpoint_quantize_leaves_no_directory_it_made(k3_tiny: Path, tmp_path: Path, where: str) -> None:
    """Issue #25: a NaN in a late shard stops mx quantize DIR after other shards and files were
    written; the output directory it created goes again, parents included, and an empty one
    the user made is left empty (nothing of a half-quantized checkpoint stays)."""
    src = float_checkpoint(k3_tiny, tmp_path / "bf16")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name, last = max(((n, f) for n, f in index.items() if ".experts." in n and n.endswith(".weight")),
                     key=lambda nf: (nf[1], nf[0]))  # an expert weight of the last shard holding some
    assert last != min(index.values())  # earlier shards are written before it
    meta, tensors = read_all(src / last)
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = np.nan
    write_st(src / last, tensors, meta)
    out = tmp_path / "new" / "q" if where == "new" else tmp_path / "empty"
    if where == "empty":
        out.mkdir()
    assert_one_line_error(run("mx", "quantize", str(src), "-o", str(out)), 2, name, "NaN/Inf")
    assert not (tmp_path / "new").exists() if where == "new" else listing(out) == set()


def test_quantize_checkpoint_output_rules(k3_tiny: Path, tmp_path: Path) -> None:
    src = float_checkpoint(k3_tiny, tmp_path / "bf16")
    # an already quantized checkpoint is refused, naming its config
    res = run("mx", "quantize", str(k3_tiny), "-o", str(tmp_path / "again"))
    assert_one_line_error(res, 2, "config.json", "already has a quantization_config", "mxfp4-pack-quantized")
    # a directory holding someone else's file is refused, and nothing is written into it
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    res = run("mx", "quantize", str(src), "-o", str(foreign))
    assert_one_line_error(res, 2, "notes.txt")
    assert listing(foreign) == {"notes.txt"}
    # the output may not be inside the input
    res = run("mx", "quantize", str(src), "-o", str(src / "q"))
    assert_one_line_error(res, 2, "outside the input")
    # no config.json: not a checkpoint directory
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(src / "model-00001-of-000008.safetensors", bare / "model.safetensors")
    assert_one_line_error(run("mx", "quantize", str(bare), "-o", str(tmp_path / "b")), 2, "config.json", "not found")
    # a one-file checkpoint stays one file: no index appears
    (bare / "config.json").write_text((src / "config.json").read_text())
    res = run("mx", "quantize", str(bare), "-o", str(tmp_path / "b"))
    assert res.exit_code == 0, res.output
    assert listing(tmp_path / "b") == {".cache", "config.json", "model.safetensors"}
    # its own earlier output is replaced by a re-run (here with another rule)
    out = tmp_path / "mxfp4"
    assert run("mx", "quantize", str(src), "-o", str(out)).exit_code == 0
    first = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    res = run("mx", "quantize", str(src), "-o", str(out), "--scale-mode", "ocp")
    assert res.exit_code == 0, res.output
    assert "quantized (ocp)" in res.output
    second = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert first.keys() == second.keys() and first != second  # another rule: other scale bytes
