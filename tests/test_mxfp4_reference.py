"""MXFP4 decoding checked against an independent reference built only on ml_dtypes.

The reference (`_reference_dequantize`) uses none of k3ckpt's tables: 4-bit codes are unpacked
from the bytes (element 2j = low nibble of byte j), viewed as `ml_dtypes.float4_e2m1fn` (one code
per byte, which is how ml_dtypes stores that type) and widened to float64; the scale bytes are
viewed as `ml_dtypes.float8_e8m0fnu`. The float64 product is exact (at most two significant bits,
exponents within [-128, 129]) and is rounded once, to nearest-even, into the output dtype. For
float64 output k3ckpt documents a float32 intermediate, so there the reference maps values beyond
the float32 range to +-inf.

Also here: the fast table path of `dequantize_mxfp4` against the exact float path bit for bit
on every (scale byte, packed byte) pair, round trips with hypothesis, known vectors, and the
gpt-oss layout against the K3 layout.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from k3ckpt.mx import codec as M

pytestmark = pytest.mark.skipif(
    not (hasattr(ml_dtypes, "float4_e2m1fn") and hasattr(ml_dtypes, "float8_e8m0fnu")),
    reason="the reference needs ml_dtypes >= 0.5 (float4_e2m1fn, float8_e8m0fnu)",
)

BF16 = np.dtype(ml_dtypes.bfloat16)
FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
ALL_DTYPES = FAST_DTYPES + (np.dtype(np.float64),)
EDGE_SCALES = (0, 1, 127, 254, 255)
FLOAT32_MAX = float(np.finfo(np.float32).max)
PROPERTY_SETTINGS = settings(max_examples=50, deadline=None)


def _bits(array: np.ndarray) -> np.ndarray:
    return array.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize])


def _reference_dequantize(packed: np.ndarray, scales: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Decode with ml_dtypes conversions only (see the module docstring)."""
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1)  # [..., n, 2]: low nibble first
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    values = values.reshape(packed.shape[:-1] + (scales.shape[-1], 32))
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    exact = (values * scale[..., None]).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
    if np.dtype(dtype) == np.float64:
        too_big = np.abs(exact) > FLOAT32_MAX  # NaN compares False and stays NaN
        return np.where(too_big, np.copysign(np.inf, exact), exact)
    with np.errstate(over="ignore"):
        return exact.astype(dtype)


def _assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal values, the same signed zeros and infinities, NaN exactly where expected."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = np.isnan(expected.astype(np.float64))
    assert np.array_equal(np.isnan(actual.astype(np.float64)), nan)
    assert np.array_equal(_bits(actual)[~nan], _bits(expected)[~nan])


def _all_pairs() -> tuple[np.ndarray, np.ndarray]:
    """Every (scale byte, packed byte) pair: block i has scale i // 16 and bytes 16*(i%16) ...+15."""
    packed = np.tile(np.arange(256, dtype=np.uint8), 256).reshape(4096, 16)
    scales = np.repeat(np.arange(256, dtype=np.uint8), 16).reshape(4096, 1)
    return packed, scales


# --------------------------------------------------------------------------------------------
# The reference itself, and known vectors
# --------------------------------------------------------------------------------------------


def test_reference_is_the_ocp_definition() -> None:
    codes = np.arange(16, dtype=np.uint8)
    decoded = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    assert decoded.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(decoded[8])
    scale = np.array([0, 1, 127, 254, 255], dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    assert scale[:4].tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127] and np.isnan(scale[4])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_known_vector_0x21(dtype: np.dtype) -> None:
    block = np.zeros((1, 16), dtype=np.uint8)
    block[0, 0] = 0x21  # low nibble 1 (0.5) first, then high nibble 2 (1.0)
    for fn in (M.dequantize_mxfp4, _reference_dequantize):
        out = fn(block, np.array([[127]], dtype=np.uint8), dtype)
        assert out.dtype == dtype and out.shape == (1, 32)
        assert out[0, :2].astype(np.float64).tolist() == [0.5, 1.0]
        assert not out[0, 2:].astype(np.float64).any()


def test_known_vectors_at_the_edges() -> None:
    block = np.array([[0x71, 0xF8] + [0] * 14], dtype=np.uint8)  # 0.5, 6, -0, -6
    out = M.dequantize_mxfp4(block, np.array([[0]], dtype=np.uint8), BF16)
    tiny = np.array([2.0**-128, 6 * 2.0**-127], dtype=np.float32).astype(BF16)
    assert np.array_equal(_bits(out[0, :2]), _bits(tiny))  # bf16 subnormals, exact
    assert out[0, :2].astype(np.float64).tolist() == [2.0**-128, 6 * 2.0**-127]
    assert _bits(out[0, 2:3]).tolist() == [0x8000] and out[0, 3] == -6 * 2.0**-127
    half = M.dequantize_mxfp4(block, np.array([[0]], dtype=np.uint8), np.float16)
    assert not half[0].astype(np.float64).any()  # 2**-128 is far below float16's subnormals
    assert np.signbit(half[0, 2]) and np.signbit(half[0, 3])  # the signs survive the underflow
    top = M.dequantize_mxfp4(block, np.array([[254]], dtype=np.uint8), BF16).astype(np.float64)
    assert top[0, :4].tolist() == [2.0**126, np.inf, -0.0, -np.inf]
    nan = M.dequantize_mxfp4(block, np.array([[255]], dtype=np.uint8), BF16)
    assert np.isnan(nan.astype(np.float32)).all()


# --------------------------------------------------------------------------------------------
# Against the reference: every code, every scale, random tensors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("scale", EDGE_SCALES)
def test_every_code_pair_at_edge_scales(dtype: np.dtype, scale: int) -> None:
    packed = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every byte = every (low, high) code pair
    scales = np.full((16, 1), scale, dtype=np.uint8)
    _assert_same(M.dequantize_mxfp4(packed, scales, dtype), _reference_dequantize(packed, scales, dtype))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_scale_and_byte_matches_reference(dtype: np.dtype) -> None:
    packed, scales = _all_pairs()
    _assert_same(M.dequantize_mxfp4(packed, scales, dtype), _reference_dequantize(packed, scales, dtype))


@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_fast_path_equals_exact_float_path_bit_for_bit(dtype: np.dtype) -> None:
    # All 256 scale bytes x all 256 packed bytes, NaN payloads included: the table path must
    # return exactly the bits of float32 product + one cast (ml_dtypes' round-to-nearest-even
    # for bfloat16), the definition in `dequantize_mxfp4_float`.
    packed, scales = _all_pairs()
    fast = M.dequantize_mxfp4(packed, scales, dtype)
    exact = M.dequantize_mxfp4_float(packed, scales, dtype)
    assert fast.dtype == exact.dtype == dtype
    assert np.array_equal(_bits(fast), _bits(exact))
    # and that definition spelled out once more, per element
    with np.errstate(over="ignore"):
        products = M.E2M1_VALUES[M.unpack_fp4(packed)].reshape(4096, 1, 32) * M.decode_e8m0(scales)[..., None]
        assert np.array_equal(_bits(fast), _bits(products.reshape(4096, 32).astype(dtype)))
    # NaN for scale 255 whatever the code, zero codes included
    assert np.isnan(fast[scales[:, 0] == 255].astype(np.float32)).all()
    assert not np.isnan(fast[scales[:, 0] != 255].astype(np.float32)).any()


def test_fast_path_tables_are_read_only_and_cover_every_index() -> None:
    for dtype in FAST_DTYPES:
        table = M.decode_table(dtype)
        assert table.shape == (65536,) and not table.flags.writeable
        assert table.dtype.itemsize == 2 * dtype.itemsize


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_random_tensors_match_reference(dtype: np.dtype) -> None:
    rng = np.random.default_rng(11)
    # realistic scales, a K3-shaped slice spanning several internal chunks, and 3-d leading axes
    blocks_per_chunk = M.TABLE_CHUNK_BYTES // 16
    cases = [
        (rng.integers(0, 256, (40, 1792), dtype=np.uint8), rng.integers(110, 131, (40, 112), dtype=np.uint8)),
        (rng.integers(0, 256, (3, 5, 48), dtype=np.uint8), rng.integers(0, 256, (3, 5, 3), dtype=np.uint8)),
        (rng.integers(0, 256, (blocks_per_chunk + 3, 16), dtype=np.uint8),
         rng.integers(0, 256, (blocks_per_chunk + 3, 1), dtype=np.uint8)),
        (rng.integers(0, 256, (1, 16), dtype=np.uint8), np.array([[127]], dtype=np.uint8)),
    ]
    for packed, scales in cases:
        _assert_same(M.dequantize_mxfp4(packed, scales, dtype), _reference_dequantize(packed, scales, dtype))


def test_non_contiguous_and_empty_inputs() -> None:
    rng = np.random.default_rng(12)
    wide = rng.integers(0, 256, (64, 96), dtype=np.uint8)
    packed = wide[::2, 16:80]  # strided rows, offset columns
    scales = np.asfortranarray(rng.integers(100, 150, (32, 4), dtype=np.uint8))
    for dtype in ALL_DTYPES:
        _assert_same(M.dequantize_mxfp4(packed, scales, dtype), _reference_dequantize(packed, scales, dtype))
        assert M.dequantize_mxfp4(np.zeros((0, 32), np.uint8), np.zeros((0, 2), np.uint8), dtype).shape == (0, 64)
        assert M.dequantize_mxfp4(np.zeros((3, 0), np.uint8), np.zeros((3, 0), np.uint8), dtype).shape == (3, 0)


# --------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------


def _packed_and_scales(max_scale: int = 255) -> st.SearchStrategy[tuple[np.ndarray, np.ndarray]]:
    @st.composite
    def build(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
        lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2))
        groups = draw(st.integers(1, 4))
        packed = draw(hnp.arrays(np.uint8, tuple(lead) + (16 * groups,)))
        scales = draw(hnp.arrays(np.uint8, tuple(lead) + (groups,), elements=st.integers(0, max_scale)))
        return packed, scales

    return build()


@PROPERTY_SETTINGS
@given(data=_packed_and_scales(), dtype=st.sampled_from(ALL_DTYPES))
def test_property_matches_reference(data: tuple[np.ndarray, np.ndarray], dtype: np.dtype) -> None:
    packed, scales = data
    _assert_same(M.dequantize_mxfp4(packed, scales, dtype), _reference_dequantize(packed, scales, dtype))


@PROPERTY_SETTINGS
@given(data=_packed_and_scales(max_scale=252))
def test_property_decode_quantize_decode_round_trips(data: tuple[np.ndarray, np.ndarray]) -> None:
    # Every decoded block is exactly representable again (scales <= 252 keep float32 finite), so
    # quantizing it back and decoding gives the same values - signed zeros included - even when
    # the quantizer picks a different (scale, codes) spelling for a block without a 4 or 6 in it.
    packed, scales = data
    values = M.dequantize_mxfp4(packed, scales)
    again_packed, again_scales = M.quantize_mxfp4(values, "ocp")
    again = M.dequantize_mxfp4(again_packed, again_scales)
    assert np.array_equal(_bits(again), _bits(values))
    # compressed-tensors' rule gives the same values; only -0.0 comes back as +0.
    ct_packed, ct_scales = M.quantize_mxfp4(values)
    assert np.array_equal(M.dequantize_mxfp4(ct_packed, ct_scales), values)
    _assert_same(again.astype(np.float64), _reference_dequantize(again_packed, again_scales, np.float64))


@PROPERTY_SETTINGS
@given(x=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda k: 32 * k)),
                    elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_nan=False)),
       mode=st.sampled_from(["compressed-tensors", "ocp", "ceil", "even"]))
def test_property_quantized_floats_decode_like_reference(x: np.ndarray, mode: str) -> None:
    packed, scales = M.quantize_mxfp4(x, mode)
    for dtype in ALL_DTYPES:
        _assert_same(M.dequantize_mxfp4(packed, scales, dtype), _reference_dequantize(packed, scales, dtype))
    # and the codes are ml_dtypes' own nearest-even rounding of x / 2**e (saturated at 6)
    exponent = np.repeat(scales.astype(np.int32) - 127, 32, axis=-1)
    scaled = np.clip(np.ldexp(x, -exponent), -6.0, 6.0)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    if mode == "compressed-tensors":  # its sign is torch.sign(x): an input -0.0 becomes +0
        codes = np.where(x == 0, codes & 0x07, codes)
    assert np.array_equal(M.unpack_fp4(packed), codes)


# --------------------------------------------------------------------------------------------
# gpt-oss layout
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_gptoss_layout_decodes_like_k3_layout(dtype: np.dtype) -> None:
    rng = np.random.default_rng(13)
    experts, out_features, in_features = 4, 6, 128
    groups = in_features // 32
    # K3 stores each expert's weight as [out, in/2] + [out, in/32]; stacked: [E*out, ...]
    k3_packed = rng.integers(0, 256, (experts * out_features, in_features // 2), dtype=np.uint8)
    k3_scales = rng.integers(105, 135, (experts * out_features, groups), dtype=np.uint8)
    k3_scales[0, 0], k3_scales[1, 1], k3_scales[2, 2] = 0, 255, 254
    # gpt-oss: [E, out, G, 16] blocks + [E, out, G] scales, same low-nibble-first byte order
    blocks = k3_packed.reshape(experts, out_features, groups, 16)
    gptoss_scales = k3_scales.reshape(experts, out_features, groups)
    gptoss = M.dequantize_mxfp4_gptoss(blocks, gptoss_scales, dtype)
    k3 = M.dequantize_mxfp4(k3_packed, k3_scales, dtype).reshape(experts, out_features, in_features)
    assert gptoss.shape == (experts, out_features, in_features)
    assert np.array_equal(_bits(gptoss), _bits(k3))
    _assert_same(gptoss, _reference_dequantize(k3_packed, k3_scales, dtype).reshape(gptoss.shape))
    for expert in range(experts):
        one = M.dequantize_mxfp4(k3_packed[expert * out_features:(expert + 1) * out_features],
                                 k3_scales[expert * out_features:(expert + 1) * out_features], dtype)
        assert np.array_equal(_bits(one), _bits(gptoss[expert]))
