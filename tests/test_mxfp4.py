"""Tests for k3ckpt.mxfp4: exact MXFP4 / MXFP8 encoding and decoding."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from k3ckpt.mx import codec as M

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
HAS_E8M0 = hasattr(ml_dtypes, "float8_e8m0fnu")
HAS_E2M1 = hasattr(ml_dtypes, "float4_e2m1fn")

PROPERTY_SETTINGS = settings(max_examples=60, deadline=None)


def _block_exponents(scales: np.ndarray) -> np.ndarray:
    return scales.astype(np.int64) - 127


def _finite_float32_rows(max_abs: float = 2.0**100) -> st.SearchStrategy[np.ndarray]:
    """Arrays [rows, 32*k] of finite float32, mixing extreme and ordinary magnitudes."""
    shapes = st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda k: 32 * k))
    elements = st.floats(-max_abs, max_abs, width=32, allow_nan=False, allow_infinity=False)
    return hnp.arrays(np.float32, shapes, elements=elements)


def _scaled_grid_rows() -> st.SearchStrategy[np.ndarray]:
    """Arrays [rows, 32*k] of realistic weights: normal-ish values times a per-array power of two."""

    @st.composite
    def build(draw: st.DrawFn) -> np.ndarray:
        rows = draw(st.integers(1, 3))
        width = 32 * draw(st.integers(1, 3))
        seed = draw(st.integers(0, 2**32 - 1))
        exponent = draw(st.integers(-120, 100))
        rng = np.random.default_rng(seed)
        values = rng.standard_normal((rows, width)).astype(np.float32)
        return np.ldexp(values, exponent).astype(np.float32)

    return build()


# --------------------------------------------------------------------------------------------
# E8M0
# --------------------------------------------------------------------------------------------


def test_e8m0_byte_zero_is_subnormal_not_zero() -> None:
    value = M.decode_e8m0(np.array([0], dtype=np.uint8))[0]
    assert value != 0.0  # the `s << 23` decoder gives 0 here
    assert value == np.float32(2.0**-127)
    assert value.dtype == np.float32


def test_e8m0_special_values() -> None:
    decoded = M.decode_e8m0(np.array([255, 127, 254, 1, 128, 126], dtype=np.uint8))
    assert np.isnan(decoded[0])  # not +inf as with `s << 23`
    assert decoded[1] == 1.0  # bias 127, not 125
    assert decoded[2] == np.float32(2.0**127)
    assert decoded[3] == np.float32(2.0**-126)
    assert decoded[4] == 2.0
    assert decoded[5] == 0.5


def test_e8m0_every_byte_is_exact_power_of_two() -> None:
    decoded = M.decode_e8m0(np.arange(256, dtype=np.uint8))
    for byte in range(255):
        assert float(decoded[byte]) == 2.0 ** (byte - 127)
    assert decoded.shape == (256,)


def test_e8m0_preserves_shape_and_rejects_non_uint8() -> None:
    scales = np.full((2, 3, 4), 127, dtype=np.uint8)
    assert M.decode_e8m0(scales).shape == (2, 3, 4)
    with pytest.raises(TypeError, match="uint8"):
        M.decode_e8m0(np.array([127], dtype=np.int32))


@pytest.mark.skipif(not HAS_E8M0, reason="ml_dtypes without float8_e8m0fnu")
def test_e8m0_matches_ml_dtypes_and_uses_it() -> None:
    codes = np.arange(256, dtype=np.uint8)
    reference = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    ours = M.decode_e8m0(codes)
    assert np.array_equal(ours, reference, equal_nan=True)
    assert M.E8M0_SOURCE == "ml_dtypes"


# --------------------------------------------------------------------------------------------
# E2M1 table and nibble order
# --------------------------------------------------------------------------------------------


def test_e2m1_table_values_and_signs() -> None:
    assert M.E2M1_VALUES.dtype == np.float32
    assert M.E2M1_VALUES.tolist()[:8] == GRID.tolist()
    assert np.array_equal(M.E2M1_VALUES[8:], -GRID.astype(np.float32))
    assert np.signbit(M.E2M1_VALUES[8])  # code 8 is -0.0
    assert not M.E2M1_VALUES.flags.writeable


@pytest.mark.skipif(not HAS_E2M1, reason="ml_dtypes without float4_e2m1fn")
def test_e2m1_table_matches_ml_dtypes() -> None:
    decoded = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert np.array_equal(decoded.view(np.uint32), M.E2M1_VALUES.view(np.uint32))  # sign of -0 too


def test_unpack_is_low_nibble_first() -> None:
    assert M.unpack_fp4(np.array([0x21], dtype=np.uint8)).tolist() == [1, 2]
    assert M.unpack_fp4(np.array([[0xF0, 0x7A]], dtype=np.uint8)).tolist() == [[0, 15, 10, 7]]
    assert M.pack_fp4(np.array([1, 2], dtype=np.uint8)).tolist() == [0x21]


def test_gguf_order_differs_and_round_trips() -> None:
    codes = (np.arange(32) % 16).astype(np.uint8)
    codes[16:] = 15 - codes[16:]
    ours = M.pack_fp4(codes)
    gguf = M.pack_fp4_gguf(codes)
    assert not np.array_equal(ours, gguf)
    # element j is the low nibble of byte j, element j+16 the high nibble
    assert gguf[0] == (codes[0] | (codes[16] << 4))
    assert gguf[5] == (codes[5] | (codes[21] << 4))
    assert np.array_equal(M.unpack_fp4_gguf(gguf), codes)
    assert np.array_equal(M.unpack_fp4(ours), codes)
    # reading GGUF bytes with the compressed-tensors order scrambles the block
    assert not np.array_equal(M.unpack_fp4(gguf), codes)


def test_pack_validates_codes() -> None:
    with pytest.raises(ValueError, match="2 value"):
        M.pack_fp4(np.array([16, 3, -1, 0], dtype=np.int16))
    with pytest.raises(ValueError, match="multiple of 2"):
        M.pack_fp4(np.array([1, 2, 3], dtype=np.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        M.pack_fp4_gguf(np.zeros(16, dtype=np.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        M.unpack_fp4_gguf(np.zeros(8, dtype=np.uint8))
    with pytest.raises(TypeError):
        M.pack_fp4(np.array([1.0, 2.0]))
    with pytest.raises(TypeError):
        M.unpack_fp4(np.array([1, 2], dtype=np.int8))


@PROPERTY_SETTINGS
@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6).map(lambda s: s[:-1] + (2 * s[-1],)),
                  elements=st.integers(0, 15)))
def test_pack_unpack_round_trip(codes: np.ndarray) -> None:
    packed = M.pack_fp4(codes)
    assert packed.shape == codes.shape[:-1] + (codes.shape[-1] // 2,)
    assert np.array_equal(M.unpack_fp4(packed), codes)
    assert np.array_equal(M.pack_fp4(M.unpack_fp4(packed)), packed)


@PROPERTY_SETTINGS
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda k: 32 * k)),
                  elements=st.integers(0, 15)))
def test_gguf_pack_unpack_round_trip(codes: np.ndarray) -> None:
    packed = M.pack_fp4_gguf(codes)
    assert np.array_equal(M.unpack_fp4_gguf(packed), codes)
    # same nibble multiset, different arrangement
    assert np.array_equal(M.e2m1_code_histogram(packed), M.e2m1_code_histogram(M.pack_fp4(codes)))


# --------------------------------------------------------------------------------------------
# MXFP4 dequantization
# --------------------------------------------------------------------------------------------


def _one_block(codes: list[int]) -> np.ndarray:
    full = np.zeros(32, dtype=np.uint8)
    full[: len(codes)] = codes
    return M.pack_fp4(full)


def test_dequantize_known_values() -> None:
    # row 0: scale 2**0, codes 0..15; row 1: scale 2**-3
    codes = np.zeros((2, 32), dtype=np.uint8)
    codes[0, :16] = np.arange(16)
    codes[1, :4] = [7, 15, 1, 2]
    packed = M.pack_fp4(codes)
    scales = np.array([[127], [124]], dtype=np.uint8)
    out = M.dequantize_mxfp4(packed, scales)
    assert out.shape == (2, 32) and out.dtype == np.float32
    assert np.array_equal(out[0, :16].view(np.uint32), M.E2M1_VALUES.view(np.uint32))
    assert out[1, :4].tolist() == [0.75, -0.75, 0.0625, 0.125]
    assert not out[0, 16:].any()


def test_dequantize_exponentiates_scales() -> None:
    # Real checkpoints have scale bytes near 115 (2**-12). Reading them as linear numbers makes
    # weights 115 * 4096 = 471,040 times too large; this must not happen.
    packed = _one_block([2, 7, 12])[None, :]
    scales = np.array([[115]], dtype=np.uint8)
    out = M.dequantize_mxfp4(packed, scales)
    assert out[0, :3].tolist() == [2.0**-12, 6 * 2.0**-12, -2 * 2.0**-12]
    linear_misread = np.array([1.0, 6.0, -2.0]) * 115
    assert np.all(np.abs(out[0, :3]) < np.abs(linear_misread) / 400_000)


def test_dequantize_special_scales() -> None:
    packed = np.stack([_one_block([1, 7, 0]), _one_block([1, 7, 0]), _one_block([0, 7])])
    scales = np.array([[0], [255], [254]], dtype=np.uint8)
    out = M.dequantize_mxfp4(packed, scales)
    assert out[0, 0] == np.float32(2.0**-128)  # 0.5 * 2**-127, a subnormal, exact
    assert out[0, 1] == np.float32(6 * 2.0**-127)
    assert np.isnan(out[1]).all()  # NaN scale poisons the whole block, zeros included
    assert out[2, 0] == 0.0 and np.isinf(out[2, 1])  # 6 * 2**127 is beyond float32


def test_dequantize_output_dtypes() -> None:
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (4, 48), dtype=np.uint8)
    scales = rng.integers(110, 135, (4, 3), dtype=np.uint8)
    reference = M.dequantize_mxfp4(packed, scales).astype(np.float64)
    exact64 = M.dequantize_mxfp4(packed, scales, dtype=np.float64)
    assert np.array_equal(exact64, reference)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        out = M.dequantize_mxfp4(packed, scales, dtype=dtype)
        assert out.dtype == np.dtype(dtype)
        assert np.array_equal(out, reference.astype(np.float32).astype(dtype))
    with pytest.raises(ValueError, match="unsupported output dtype"):
        M.dequantize_mxfp4(packed, scales, dtype=np.int32)


def test_dequantize_any_leading_shape_and_gptoss_layout() -> None:
    rng = np.random.default_rng(2)
    experts, out_features, groups = 3, 5, 4
    blocks = rng.integers(0, 256, (experts, out_features, groups, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (experts, out_features, groups), dtype=np.uint8)
    dense = M.dequantize_mxfp4_gptoss(blocks, scales)
    assert dense.shape == (experts, out_features, groups * 32)
    flat = M.dequantize_mxfp4(blocks.reshape(experts, out_features, groups * 16), scales)
    assert np.array_equal(dense, flat)
    # gpt-oss's own reference loop: low nibble first, ldexp by (scale - 127)
    lo = M.E2M1_VALUES[blocks & 0x0F].astype(np.float64)
    hi = M.E2M1_VALUES[blocks >> 4].astype(np.float64)
    interleaved = np.stack([lo, hi], axis=-1).reshape(experts, out_features, groups, 32)
    expected = np.ldexp(interleaved, _block_exponents(scales)[..., None]).reshape(dense.shape)
    assert np.array_equal(dense, expected)
    one_expert = M.dequantize_mxfp4(blocks[1].reshape(out_features, -1), scales[1])
    assert np.array_equal(one_expert, dense[1])


def test_dequantize_handles_chunking_and_non_contiguous_input() -> None:
    rng = np.random.default_rng(3)
    rows = M.CHUNK_ELEMENTS // 64 + 7  # forces several internal chunks for in = 64
    packed = rng.integers(0, 256, (rows, 32), dtype=np.uint8)
    scales = rng.integers(120, 130, (rows, 2), dtype=np.uint8)
    out = M.dequantize_mxfp4(packed, scales)
    lo = M.E2M1_VALUES[packed & 0x0F]
    hi = M.E2M1_VALUES[packed >> 4]
    expected = np.stack([lo, hi], axis=-1).reshape(rows, 2, 32) * M.decode_e8m0(scales)[..., None]
    assert np.array_equal(out, expected.reshape(rows, 64))
    wide = np.ascontiguousarray(np.concatenate([packed, packed], axis=1))
    assert np.array_equal(M.dequantize_mxfp4(wide[:, :32], np.asfortranarray(scales)), out)


def test_dequantize_shape_errors() -> None:
    packed = np.zeros((4, 64), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"scales must have shape \(4, 4\).*got \(4, 3\)"):
        M.dequantize_mxfp4(packed, np.zeros((4, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"scales must have shape \(4, 4\).*got \(3, 4\)"):
        M.dequantize_mxfp4(packed, np.zeros((3, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="multiple of 16"):
        M.dequantize_mxfp4(np.zeros((4, 24), dtype=np.uint8), np.zeros((4, 1), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"\[\.\.\., G, 16\]"):
        M.dequantize_mxfp4_gptoss(np.zeros((2, 3, 4, 8), dtype=np.uint8), np.zeros((2, 3, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"needs scales of shape \(2, 3, 4\), got \(2, 3\)"):
        M.dequantize_mxfp4_gptoss(np.zeros((2, 3, 4, 16), dtype=np.uint8), np.zeros((2, 3), dtype=np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        M.dequantize_mxfp4(packed.astype(np.int8), np.zeros((4, 4), dtype=np.uint8))
    # the K3 expert shapes: w1 [3072, 1792] + [3072, 112]; w2 [3584, 1536] + [3584, 96]
    with pytest.raises(ValueError, match=r"\(8, 112\).*got \(8, 96\)"):
        M.dequantize_mxfp4(np.zeros((8, 1792), dtype=np.uint8), np.zeros((8, 96), dtype=np.uint8))


# --------------------------------------------------------------------------------------------
# MXFP4 quantization
# --------------------------------------------------------------------------------------------


def test_round_to_e2m1_ties_and_saturation() -> None:
    values = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30], dtype=np.float32)
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0]
    for dtype in (np.float32, np.float64):
        codes = M.round_to_e2m1_codes(values.astype(dtype))
        assert M.E2M1_VALUES[codes].tolist() == expected
        negative = M.E2M1_VALUES[M.round_to_e2m1_codes(-values.astype(dtype))]
        assert negative.tolist() == [-v for v in expected]
    just_above = np.nextafter(values[:7], np.float32(np.inf))
    assert M.E2M1_VALUES[M.round_to_e2m1_codes(just_above)].tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert M.round_to_e2m1_codes(np.array([-0.0, -0.1], dtype=np.float32)).tolist() == [8, 8]


@pytest.mark.skipif(not HAS_E2M1, reason="ml_dtypes without float4_e2m1fn")
@PROPERTY_SETTINGS
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(-8, 8, width=32)))
def test_round_to_e2m1_matches_ml_dtypes(values: np.ndarray) -> None:
    assert np.array_equal(M.round_to_e2m1_codes(values), values.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))


def test_quantize_ties_through_full_path() -> None:
    # amax 4.0 pins the shared exponent to 0 in every mode, so elements are rounded unscaled.
    block = np.zeros(32, dtype=np.float32)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    block[: len(ties)] = ties
    block[7 : 7 + len(ties)] = [-t for t in ties]
    block[31] = 4.0
    for mode in ("compressed-tensors", "ocp", "floor", "ceil", "even"):
        packed, scales = M.quantize_mxfp4(block, mode)
        assert scales.tolist() == [127]
        out = M.dequantize_mxfp4(packed, scales)
        assert out[:7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
        assert out[7:14].tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]


@pytest.mark.parametrize("exponent", [-127, -60, -3, 0, 1, 17, 100, 125])
def test_quantize_grid_values_round_trip_exactly(exponent: int) -> None:
    rng = np.random.default_rng(exponent + 1000)
    codes = rng.integers(0, 16, (3, 64)).astype(np.uint8)
    codes[:, 0] = 7  # amax = 6 * 2**exponent in every block -> floor picks exactly `exponent`
    codes[:, 32] = 15
    x = np.ldexp(M.E2M1_VALUES[codes].astype(np.float64), exponent).astype(np.float32)
    packed, scales = M.quantize_mxfp4(x, "ocp")
    assert np.all(scales == exponent + 127)
    assert np.array_equal(M.dequantize_mxfp4(packed, scales).view(np.uint32), x.view(np.uint32))
    assert np.array_equal(M.unpack_fp4(packed), codes)
    # compressed-tensors' rule picks the same exponent (significand 1.5 < 1.75) and the same
    # codes, except that an input -0.0 becomes +0 (code 8 -> 0), as compressed-tensors writes it.
    packed, scales = M.quantize_mxfp4(x)
    assert np.all(scales == exponent + 127)
    assert np.array_equal(M.unpack_fp4(packed), np.where(codes == 8, 0, codes))


def test_quantize_saturates_and_picks_floor_scale() -> None:
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, :4] = [7.9, -7.0, 6.5, 1.0]
    packed, scales = M.quantize_mxfp4(x, "ocp")
    assert scales.tolist() == [[127]]  # floor(log2 7.9) - 2 = 0
    assert M.dequantize_mxfp4(packed, scales)[0, :4].tolist() == [6.0, -6.0, 6.0, 1.0]


def test_quantize_scale_modes_differ_as_documented() -> None:
    x = np.zeros((3, 32), dtype=np.float32)
    x[0, 0] = 6.5  # > 6: ceil bumps, < 7: even does not
    x[1, 0] = 7.0  # tie at 7: even bumps
    x[2, 0] = 6.0  # exactly representable: nobody bumps
    expected = {"ocp": [127, 127, 127], "floor": [127, 127, 127], "ceil": [128, 128, 127], "even": [127, 128, 127],
                "compressed-tensors": [127, 128, 127]}
    for mode, bytes_ in expected.items():
        _, scales = M.quantize_mxfp4(x, mode)
        assert scales[:, 0].tolist() == bytes_, mode
    # even at 7.0 -> 8.0 exactly (4 * 2**1); floor saturates to 6
    packed, scales = M.quantize_mxfp4(x[1:2], "even")
    assert M.dequantize_mxfp4(packed, scales)[0, 0] == 8.0


def test_quantize_ceil_is_exact_at_boundaries() -> None:
    # amax just above 6 * 2**k must get scale 2**(k+1); exactly 6 * 2**k keeps 2**k.
    for k in (-100, -1, 0, 5, 120):
        x = np.zeros(32, dtype=np.float32)
        x[3] = np.float32(6 * 2.0**k)
        assert M.quantize_mxfp4(x, "ceil")[1][0] == 127 + k
        x[3] = np.nextafter(x[3], np.float32(np.inf))
        assert M.quantize_mxfp4(x, "ceil")[1][0] == 127 + k + 1


def test_quantize_power_of_two_amax_uses_exact_log2() -> None:
    # 2**k must give floor(log2) = k exactly (no 0.99999 from a float log2)
    for k in (-124, -50, -1, 0, 1, 29, 126):
        x = np.zeros(32, dtype=np.float32)
        x[0] = np.float32(2.0**k)
        packed, scales = M.quantize_mxfp4(x)
        assert scales[0] == 127 + k - 2
        assert M.dequantize_mxfp4(packed, scales)[0] == x[0]
        x[0] = np.nextafter(x[0], np.float32(0))
        assert M.quantize_mxfp4(x, "ocp")[1][0] == 127 + k - 3
        assert M.quantize_mxfp4(x)[1][0] == 127 + k - 2  # significand ~2 rounds up to the next binade


def test_quantize_all_zero_block_gets_smallest_scale() -> None:
    x = np.zeros((2, 64), dtype=np.float32)
    x[1, 32:] = -0.0
    x[0, 40] = 1.0
    for mode, minus_zero_code in (("ocp", 8), ("compressed-tensors", 0)):
        packed, scales = M.quantize_mxfp4(x, mode)
        assert scales.tolist() == [[0, 125], [0, 0]]
        assert not M.dequantize_mxfp4(packed, scales)[1].any()
        assert np.all(M.unpack_fp4(packed)[1, 32:] == minus_zero_code)  # ocp keeps -0.0's sign


def test_quantize_clamps_exponent_extremes() -> None:
    # below: amax 2**-140 (fp32 subnormal) would need exponent -142; clamped to -127 -> byte 0
    x = np.zeros(32, dtype=np.float32)
    x[0] = np.float32(2.0**-140)
    x[1] = np.float32(1.75 * 2.0**-127)
    x[2] = np.float32(1.5 * 2.0**-127)
    packed, scales = M.quantize_mxfp4(x)
    assert scales[0] == 0
    out = M.dequantize_mxfp4(packed, scales)
    assert out[0] == 0.0  # 2**-13 on the grid: rounds to zero
    assert out[1] == np.float32(2.0**-126)  # 1.75 -> 2 on the grid at 2**-127
    assert out[2] == x[2]  # 1.5 * 2**-127, a subnormal, survives exactly
    # above: float64 input can need more than 2**127; clamped to byte 254 and saturated
    big = np.zeros(32, dtype=np.float64)
    big[0] = 2.0**200
    big[1] = -(2.0**128)
    packed, scales = M.quantize_mxfp4(big, "ceil")
    assert scales[0] == 254
    assert M.unpack_fp4(packed)[:2].tolist() == [7, 12]  # +6 (saturated), -2
    # largest float32 stays in range
    top = np.zeros(32, dtype=np.float32)
    top[0] = np.finfo(np.float32).max
    packed, scales = M.quantize_mxfp4(top, "ocp")
    assert scales[0] == 127 + 125
    assert M.dequantize_mxfp4(packed, scales)[0] == np.float32(6 * 2.0**125)
    # compressed-tensors' rule rounds amax up to 2**128: byte 253, and the element rounds to
    # 4 * 2**126, which overflows float32 on decoding (docs/mx.md: use --scale-mode ocp there).
    packed, scales = M.quantize_mxfp4(top)
    assert scales[0] == 127 + 126
    assert M.dequantize_mxfp4(packed, scales)[0] == np.inf


def test_quantize_accepts_narrow_float_inputs() -> None:
    rng = np.random.default_rng(4)
    x32 = rng.standard_normal((2, 64)).astype(np.float32)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        narrow = x32.astype(dtype)
        got = M.quantize_mxfp4(narrow)
        want = M.quantize_mxfp4(narrow.astype(np.float32))
        assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_quantize_float64_does_not_double_round() -> None:
    # 1.25 + 2**-40 must round up to 1.5 (it is above the midpoint); via float32 it would be a tie
    x = np.zeros(32, dtype=np.float64)
    x[0] = 4.0
    x[1] = 1.25 + 2.0**-40
    packed, scales = M.quantize_mxfp4(x)
    assert M.dequantize_mxfp4(packed, scales)[1] == 1.5


def test_quantize_input_errors() -> None:
    with pytest.raises(ValueError, match=r"multiple of 32, got 48"):
        M.quantize_mxfp4(np.zeros((2, 48), dtype=np.float32))
    bad = np.zeros((3, 64), dtype=np.float32)
    bad[0, 1] = np.nan
    bad[2, 5] = np.inf
    bad[2, 63] = -np.inf
    with pytest.raises(ValueError, match="3 non-finite"):
        M.quantize_mxfp4(bad)
    with pytest.raises(ValueError, match="scale_mode"):
        M.quantize_mxfp4(np.zeros(32, dtype=np.float32), "nearest")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        M.quantize_mxfp4(np.zeros(32, dtype=np.complex64))
    with pytest.raises(ValueError, match="0-d"):
        M.quantize_mxfp4(np.float32(1.0))


def test_quantize_shapes_and_leading_axes() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 96)).astype(np.float32)
    packed, scales = M.quantize_mxfp4(x)
    assert packed.shape == (2, 3, 48) and scales.shape == (2, 3, 3)
    flat_packed, flat_scales = M.quantize_mxfp4(x.reshape(6, 96))
    assert np.array_equal(packed.reshape(6, 48), flat_packed)
    assert np.array_equal(scales.reshape(6, 3), flat_scales)
    empty_packed, empty_scales = M.quantize_mxfp4(np.zeros((0, 64), dtype=np.float32))
    assert empty_packed.shape == (0, 32) and empty_scales.shape == (0, 2)


def test_quantize_chunked_equals_per_row() -> None:
    rng = np.random.default_rng(6)
    rows = M.CHUNK_ELEMENTS // 64 + 3
    x = (rng.standard_normal((rows, 64)) * np.exp2(rng.integers(-20, 20, (rows, 1)))).astype(np.float32)
    packed, scales = M.quantize_mxfp4(x)
    for row in (0, rows // 2, rows - 1):
        row_packed, row_scales = M.quantize_mxfp4(x[row])
        assert np.array_equal(packed[row], row_packed)
        assert np.array_equal(scales[row], row_scales)


def _check_error_bound(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, mode: str) -> None:
    out = M.dequantize_mxfp4(packed, scales).astype(np.float64)
    exponents = np.repeat(_block_exponents(scales), 32, axis=-1)
    scale = np.ldexp(1.0, exponents)
    ratio = np.abs(x.astype(np.float64)) / scale
    half_step = np.where(ratio <= 2, 0.25, np.where(ratio <= 4, 0.5, 1.0))
    error = np.abs(out - x)
    in_range = ratio <= 6
    assert np.all(error[in_range] <= half_step[in_range] * scale[in_range])
    assert np.array_equal(out[~in_range], np.copysign(6 * scale[~in_range], x[~in_range]))
    if mode == "ceil":
        assert in_range.all()
    if mode == "even":
        assert np.all(ratio < 7)
    # the chosen exponent is the documented one, unless clamped at -127
    amax = np.abs(x.astype(np.float64)).reshape(*x.shape[:-1], -1, 32).max(axis=-1)
    block_ratio = amax / np.ldexp(1.0, _block_exponents(scales))
    free = _block_exponents(scales) > -127
    low = {"floor": 4.0, "ceil": 3.0, "even": 3.5}[mode]
    high = {"floor": 8.0, "ceil": 6.0, "even": 7.0}[mode]
    assert np.all((block_ratio[free] >= low) & (block_ratio[free] <= high))
    assert np.all(block_ratio[~free] < high)


@PROPERTY_SETTINGS
@given(x=st.one_of(_finite_float32_rows(), _scaled_grid_rows()), mode=st.sampled_from(["floor", "ceil", "even"]))
def test_quantize_error_is_at_most_half_a_grid_step(x: np.ndarray, mode: str) -> None:
    packed, scales = M.quantize_mxfp4(x, mode)
    _check_error_bound(x, packed, scales, mode)


@PROPERTY_SETTINGS
@given(x=st.one_of(_finite_float32_rows(), _scaled_grid_rows()))
def test_quantize_floor_is_idempotent(x: np.ndarray) -> None:
    packed, scales = M.quantize_mxfp4(x, "ocp")
    again_packed, again_scales = M.quantize_mxfp4(M.dequantize_mxfp4(packed, scales), "ocp")
    assert np.array_equal(again_packed, packed)
    assert np.array_equal(again_scales, scales)


@PROPERTY_SETTINGS
@given(x=st.one_of(_finite_float32_rows(), _scaled_grid_rows()), mode=st.sampled_from(["ceil", "even"]))
def test_quantize_other_modes_are_value_idempotent(x: np.ndarray, mode: str) -> None:
    once = M.dequantize_mxfp4(*M.quantize_mxfp4(x, mode))
    twice = M.dequantize_mxfp4(*M.quantize_mxfp4(once, mode))
    assert np.array_equal(once.view(np.uint32), twice.view(np.uint32))


# --------------------------------------------------------------------------------------------
# MXFP8
# --------------------------------------------------------------------------------------------


FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_spec_matches_ml_dtypes(fmt: str) -> None:
    spec = M.FP8_SPECS[fmt]
    info = ml_dtypes.finfo(FP8[fmt])
    assert spec.max_finite == float(info.max)
    assert spec.mbits == info.nmant
    assert spec.emin == info.minexp
    assert spec.emax == int(np.frexp(float(info.max))[1]) - 1


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_dequantize_known_values(fmt: str) -> None:
    values = np.array([1.0, -2.5, 0.0, 0.125] + [0.0] * 28, dtype=np.float32)
    data = values.astype(FP8[fmt]).view(np.uint8)[None, :]
    scales = np.array([[124]], dtype=np.uint8)
    out = M.dequantize_mxfp8(data, scales, fmt)
    assert out[0, :4].tolist() == [0.125, -0.3125, 0.0, 2.0**-6]
    assert M.dequantize_mxfp8(data, np.array([[255]], dtype=np.uint8), fmt).dtype == np.float32
    assert np.isnan(M.dequantize_mxfp8(data, np.array([[255]], dtype=np.uint8), fmt)).all()
    bf = M.dequantize_mxfp8(data, scales, fmt, dtype=ml_dtypes.bfloat16)
    assert bf.dtype == ml_dtypes.bfloat16 and np.array_equal(bf.astype(np.float32), out)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("exponent", [-127, -20, 0, 40, 100])
def test_mxfp8_grid_values_round_trip_exactly(fmt: str, exponent: int) -> None:
    rng = np.random.default_rng(exponent + 1000)
    raw = rng.integers(0, 256, (2, 64)).astype(np.uint8)
    grid = raw.view(FP8[fmt]).astype(np.float32)
    grid[~np.isfinite(grid)] = 0.0
    grid[:, 0] = M.FP8_SPECS[fmt].max_finite  # pins floor's exponent to 0
    grid[:, 32] = -M.FP8_SPECS[fmt].max_finite
    x = np.ldexp(grid.astype(np.float64), exponent)
    data, scales = M.quantize_mxfp8(x, fmt)
    assert np.all(scales == exponent + 127)
    assert np.array_equal(M.dequantize_mxfp8(data, scales, fmt, dtype=np.float64), x)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_saturates_and_handles_zero_blocks(fmt: str) -> None:
    spec = M.FP8_SPECS[fmt]
    x = np.zeros((2, 32), dtype=np.float32)
    x[0, 0] = np.float32(2.0 ** (spec.emax + 1)) * 0.999  # rounds above max_finite after scaling
    x[0, 1] = -x[0, 0]
    data, scales = M.quantize_mxfp8(x, fmt)
    assert scales[:, 0].tolist() == [127, 0]
    out = M.dequantize_mxfp8(data, scales, fmt)
    assert out[0, :2].tolist() == [spec.max_finite, -spec.max_finite]
    assert not out[1].any()
    _, ceil_scales = M.quantize_mxfp8(x, fmt, "ceil")
    assert ceil_scales[0, 0] == 128


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@PROPERTY_SETTINGS
@given(x=st.one_of(_finite_float32_rows(), _scaled_grid_rows()), mode=st.sampled_from(["floor", "ceil", "even"]))
def test_mxfp8_matches_ml_dtypes_rounding(fmt: str, x: np.ndarray, mode: str) -> None:
    data, scales = M.quantize_mxfp8(x, fmt, mode)
    spec = M.FP8_SPECS[fmt]
    scaled = np.ldexp(x, -np.repeat(_block_exponents(scales), 32, axis=-1).astype(np.int32))
    # ml_dtypes rounds float32 -> fp8 correctly (nearest-even) but overflows instead of saturating
    expected = np.clip(scaled, -spec.max_finite, spec.max_finite).astype(FP8[fmt]).view(np.uint8)
    assert np.array_equal(data, expected)
    out = M.dequantize_mxfp8(data, scales, fmt, dtype=np.float64)
    again = M.quantize_mxfp8(out, fmt, mode)
    assert np.array_equal(M.dequantize_mxfp8(*again, fmt, dtype=np.float64), out)
    if mode == "ceil":
        assert np.all(np.abs(scaled) <= spec.max_finite)


def test_mxfp8_float64_does_not_double_round() -> None:
    x = np.zeros(32, dtype=np.float64)
    x[0] = 256.0  # exponent 0 for e4m3
    x[1] = 1.0 + 2.0**-4 + 2.0**-30  # just above the 1.0 / 1.125 midpoint
    data, scales = M.quantize_mxfp8(x, "e4m3")
    assert M.dequantize_mxfp8(data, scales, "e4m3")[1] == 1.125


def test_mxfp8_errors() -> None:
    with pytest.raises(ValueError, match="fmt"):
        M.quantize_mxfp8(np.zeros(32, dtype=np.float32), "e3m4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1 non-finite"):
        M.quantize_mxfp8(np.array([np.nan] + [0.0] * 31, dtype=np.float32))
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 2\).*got \(2, 1\)"):
        M.dequantize_mxfp8(np.zeros((2, 64), dtype=np.uint8), np.zeros((2, 1), dtype=np.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        M.dequantize_mxfp8(np.zeros((2, 40), dtype=np.uint8), np.zeros((2, 1), dtype=np.uint8))


# --------------------------------------------------------------------------------------------
# Histograms
# --------------------------------------------------------------------------------------------


def test_code_histogram_counts_both_nibbles() -> None:
    packed = np.array([[0x21, 0x11], [0xF0, 0x00]], dtype=np.uint8)
    hist = M.e2m1_code_histogram(packed)
    assert hist.dtype == np.int64 and hist.shape == (16,)
    expected = np.zeros(16, dtype=np.int64)
    for code in (1, 2, 1, 1, 0, 15, 0, 0):
        expected[code] += 1
    assert np.array_equal(hist, expected)


def test_code_histogram_matches_unpacked_bincount() -> None:
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (37, 48), dtype=np.uint8)
    expected = np.bincount(M.unpack_fp4(packed).ravel(), minlength=16)
    assert np.array_equal(M.e2m1_code_histogram(packed), expected)
    assert M.e2m1_code_histogram(packed[:, ::3]).sum() == 2 * packed[:, ::3].size


def test_scale_histogram() -> None:
    scales = np.array([[0, 127, 127], [255, 254, 127]], dtype=np.uint8)
    hist = M.scale_exponent_histogram(scales)
    assert hist.dtype == np.int64 and hist.shape == (256,)
    assert hist[127] == 3 and hist[0] == 1 and hist[255] == 1 and hist[254] == 1 and hist.sum() == 6
    with pytest.raises(TypeError):
        M.scale_exponent_histogram(scales.astype(np.int16))
