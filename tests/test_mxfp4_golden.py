"""k3ckpt's MXFP4 against compressed-tensors itself, byte for byte, without torch.

``tests/data/mxfp4_golden.npz`` holds inputs and what compressed-tensors (the producer of K3's
expert weights) made of them: packed E2M1 bytes and E8M0 scale bytes, its decoding of every scale
byte, and its serialisation of the quantization config. It was written once by
``scripts/make_mxfp4_golden.py`` in a scratch venv with torch; the versions are in ``meta``.
Where compressed-tensors writes a block of zeros (inputs it cannot represent) k3ckpt deliberately
differs; those blocks are pinned here too, so docs/mx.md stays true.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import click
import ml_dtypes
import numpy as np
import pytest

from k3ckpt.mx import codec as M

GOLDEN = Path(__file__).parent / "data" / "mxfp4_golden.npz"
VIEW = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
F16_SMALLEST_NORMAL = 2.0**-14


@cache
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN) as data:
        return {k: data[k] for k in data.files}


@cache
def meta() -> dict:
    return json.loads(golden()["meta"].tobytes())


def case(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input as its float dtype, compressed-tensors' packed bytes, its scale bytes)."""
    g = golden()
    dtype = name.split("_")[1]
    return g[f"{name}_input"].view(VIEW[dtype]), g[f"{name}_packed"], g[f"{name}_scale"]


def mismatches(name: str, rows: np.ndarray, packed: np.ndarray, scales: np.ndarray) -> list[str]:
    _, want_packed, want_scales = case(name)
    names = meta()["sets"].get(name)
    bad = np.nonzero(((packed != want_packed[rows]).any(axis=1)) | ((scales != want_scales[rows]).any(axis=1)))[0]
    return [f"{names[rows[i]] if names else rows[i]}: scale {scales[i]} vs {want_scales[rows[i]]}" for i in bad]


def test_golden_data_records_where_it_came_from() -> None:
    versions = meta()["versions"]
    assert versions["compressed_tensors"] == "0.20.1" and versions["torch"].startswith("2.")
    assert GOLDEN.stat().st_size < 400_000  # compact: a few hundred KB at most


@pytest.mark.parametrize("name", ["edge_f32", "edge_bf16", "weights_bf16"])
def test_default_rule_matches_compressed_tensors_byte_for_byte(name: str) -> None:
    x, _, _ = case(name)
    packed, scales = M.quantize_mxfp4(x)  # the default rule
    rows = np.arange(len(x))
    assert mismatches(name, rows, packed, scales) == []


def test_default_rule_matches_compressed_tensors_float16_where_it_keeps_the_block() -> None:
    x, want_packed, want_scales = case("edge_f16")
    amax = np.abs(x.astype(np.float64)).max(axis=1)
    kept = np.nonzero(amax >= F16_SMALLEST_NORMAL)[0]
    # compressed-tensors rounds a float16 amax on its bits; a subnormal one below 0.75 * 2**-14
    # (mantissa field < 768) loses its exponent bits entirely.
    flushed = np.nonzero(amax < 0.75 * F16_SMALLEST_NORMAL)[0]
    packed, scales = M.quantize_mxfp4(x)
    assert len(kept) > 100 and mismatches("edge_f16", kept, packed[kept], scales[kept]) == []
    # There its shared exponent is clamped to byte 0; 2**-127 underflows to 0 in float16, is
    # replaced by 1.0, and every element rounds to 0: byte 127 and +-0 codes. k3ckpt keeps the block.
    assert len(flushed) > 20
    assert (want_scales[flushed] == 127).all() and (M.unpack_fp4(want_packed[flushed]) & 7 == 0).all()
    assert (scales[flushed] != 127).all()


def test_the_edge_cases_are_covered() -> None:
    names = meta()["sets"]["edge_bf16"]
    for needle in ("all -0", "-0 among values", "halfway points +", "halfway neighbours", "amax 1.75*2^",
                   "amax 1.7421875*2^", "tiny amax", "huge amax", "saturating amax", "all +0"):
        assert any(n.startswith(needle) for n in names), needle
    x, _, want_scales = case("edge_bf16")
    # The significand >= 1.75 blocks are where the OCP floor rule and compressed-tensors part.
    floor_packed, floor_scales = M.quantize_mxfp4(x, scale_mode="ocp")
    differ = {names[i] for i in np.nonzero((floor_scales != want_scales).any(axis=1))[0]}
    assert {"amax 1.75*2^0", "amax -1.875*2^-40", "amax 1.9921875*2^50"} <= differ
    assert not any(n.startswith(("amax 1.7421875", "amax 1.0*", "amax 1.5*")) for n in differ)
    assert {int(want_scales[names.index(n)][0]) for n in names if n.startswith("tiny amax")} == {0, 1, 2, 3}


def test_minus_zero_is_plus_zero_by_default_and_kept_by_the_other_rules() -> None:
    x, want_packed, _ = case("edge_f32")
    row = meta()["sets"]["edge_f32"].index("-0 among values")
    ct_codes = M.unpack_fp4(M.quantize_mxfp4(x[row:row + 1])[0])[0]
    assert (ct_codes == M.unpack_fp4(want_packed[row])).all()
    minus_zero = np.signbit(x[row]) & (x[row] == 0)
    assert (ct_codes[minus_zero] == 0).all()  # -0.0 -> +0, as torch.sign(-0.0) * 0
    assert (ct_codes[(x[row] < 0) & (np.abs(x[row]) < 0.25 * 2.0 ** -2)] == 8).all()  # underflow keeps -
    for mode in ("ocp", "even", "ceil"):
        codes = M.unpack_fp4(M.quantize_mxfp4(x[row:row + 1], scale_mode=mode)[0])[0]
        assert (codes[minus_zero] == 8).all()


def test_even_rule_differs_from_default_only_in_the_sign_of_zero() -> None:
    for name in ("edge_f32", "edge_bf16", "weights_bf16"):
        x, want_packed, want_scales = case(name)
        packed, scales = M.quantize_mxfp4(x, scale_mode="even")
        assert (scales == want_scales).all()
        differ = M.unpack_fp4(packed) != M.unpack_fp4(want_packed)
        assert (x[differ] == 0).all() and np.signbit(x[differ]).all()


def test_ocp_rule_differs_on_a_documented_share_of_realistic_weights() -> None:
    x, _, want_scales = case("weights_bf16")
    _, scales = M.quantize_mxfp4(x, scale_mode="floor")  # the alias of "ocp"
    share = float((scales != want_scales).mean())
    assert 0.10 < share < 0.18, share  # docs/mx.md quotes 13.5% for this sample


def test_overflow_and_non_finite_blocks_are_where_k3ckpt_parts_on_purpose() -> None:
    for dtype in ("f32", "bf16", "f16"):
        x, want_packed, want_scales = case(f"special_{dtype}")
        names = meta()["sets"][f"special_{dtype}"]
        # compressed-tensors turns each into a block of zeros with scale byte 127 (scale 1.0).
        assert (want_scales == 127).all() and (M.unpack_fp4(want_packed) & 7 == 0).all()
        overflow = [i for i, n in enumerate(names) if n.startswith("overflow")]
        packed, scales = M.quantize_mxfp4(x[overflow])
        assert (scales != 127).all() and (M.unpack_fp4(packed) & 7 != 0).any(axis=1).all()
        non_finite = [i for i, n in enumerate(names) if n.startswith("non-finite")]
        for i in non_finite:
            with pytest.raises(ValueError, match="non-finite"):
                M.quantize_mxfp4(x[i:i + 1])


def test_decode_matches_compressed_tensors_for_every_scale_byte_but_nan() -> None:
    g = golden()
    ours = M.dequantize_mxfp4(g["decode_packed"], g["decode_scale"], dtype=ml_dtypes.bfloat16).view(np.uint16)
    assert (ours[:255] == g["decode_bf16"][:255]).all()
    theirs = g["decode_bf16"][255].view(ml_dtypes.bfloat16).astype(np.float32)
    # byte 255: compressed-tensors computes 2**128 = inf, so +-inf (and NaN for 0 * inf); k3ckpt: NaN.
    assert np.isnan(ours[255].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    assert np.isinf(theirs[np.array([c & 7 != 0 for c in np.tile(np.arange(16), 2)])]).all()


def test_cli_choices_are_the_codec_modes() -> None:
    from k3ckpt.cli import main

    mx = main.get_command(click.Context(main), "mx")
    for command in (mx.commands["error"], mx.commands["quantize"]):  # type: ignore[attr-defined]
        option = next(p for p in command.params if p.name == "scale_mode")
        assert list(option.type.choices) == list(M.SCALE_MODES)  # shown in --help
        assert option.type.aliases == ("floor",)  # accepted, not shown
        assert option.default == M.SCALE_MODES[0] == "compressed-tensors"


def test_floor_is_an_alias_of_ocp_and_unknown_modes_are_refused() -> None:
    assert M.normalize_scale_mode("floor") == "ocp"
    with pytest.raises(ValueError, match="scale_mode"):
        M.normalize_scale_mode("nearest")
    with pytest.raises(ValueError, match="scale_mode"):
        M.quantize_mxfp8(np.ones((1, 32), np.float32), scale_mode="compressed-tensors")  # type: ignore[arg-type]
