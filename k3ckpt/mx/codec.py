"""Numeric core for OCP Microscaling (MX v1.0) formats: MXFP4 and MXFP8.

An MX block is 32 consecutive elements along the last axis sharing one E8M0 scale byte (a pure
power of two, ``2**(s - 127)``; byte 255 is NaN). MXFP4 elements are E2M1 codes packed two per
byte; MXFP8 elements are one FP8 byte each (E4M3 or E5M2).

Layouts handled here:

- compressed-tensors ``mxfp4-pack-quantized`` (the Kimi K3 checkpoint): ``weight_packed`` is
  ``[out, in/2]`` with element ``2j`` in the **low** nibble of byte ``j``, ``weight_scale`` is
  ``[out, in/32]``. All functions accept any number of leading axes.
- gpt-oss stacked experts: ``*_blocks [E, out, in/32, 16]`` + ``*_scales [E, out, in/32]``, same
  nibble order (see [`dequantize_mxfp4_gptoss`]).
- llama.cpp GGUF split nibble order within a 32-element block (see [`unpack_fp4_gguf`]).

Everything is exact: decoding multiplies an E2M1/FP8 value by a power of two, and encoding
derives the shared exponent from `np.frexp` (never a floating-point ``log2``) and rounds with
exact comparisons or `np.rint` on power-of-two-scaled values.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np
import numpy.typing as npt

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E8M0_BIAS",
    "E8M0_NAN",
    "MX_BLOCK_SIZE",
    "SCALE_MODES",
    "decode_e8m0",
    "dequantize_mxfp4",
    "dequantize_mxfp4_gptoss",
    "dequantize_mxfp8",
    "e2m1_code_histogram",
    "normalize_scale_mode",
    "pack_fp4",
    "pack_fp4_gguf",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "round_to_e2m1_codes",
    "scale_exponent_histogram",
    "unpack_fp4",
    "unpack_fp4_gguf",
]

ScaleMode = Literal["compressed-tensors", "ocp", "floor", "ceil", "even"]

SCALE_MODES: tuple[str, ...] = ("compressed-tensors", "ocp", "ceil", "even")
"""The shared-exponent rules, the default first (see [`quantize_mxfp4`])."""

_SCALE_MODE_ALIASES = {"floor": "ocp"}  # the OCP rule's name before compressed-tensors' became the default
Fp8Format = Literal["e4m3", "e5m2"]

MX_BLOCK_SIZE: int = 32
"""Number of elements sharing one E8M0 scale (OCP MX v1.0, all concrete MX formats)."""

E8M0_BIAS: int = 127
"""Exponent bias of the E8M0 scale byte. Some third-party tools wrongly use 125."""

E8M0_NAN: int = 255
"""The E8M0 byte that encodes NaN; every element of a block with this scale decodes to NaN."""

E2M1_MAX: float = 6.0
"""Largest finite E2M1 magnitude (1.5 * 2**2)."""

_E2M1_EMAX = 2
_E2M1_MBITS = 1
_EXP_MIN = -E8M0_BIAS
_EXP_MAX = 254 - E8M0_BIAS

# Rows of this many elements are processed per internal step: large enough that the Python loop
# is negligible, small enough that the temporaries of one step stay in cache.
CHUNK_ELEMENTS = 1 << 18

E2M1_VALUES: np.ndarray = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
E2M1_VALUES.setflags(write=False)
"""
Float32 value of each 4-bit E2M1 code (index = code; bit 3 is the sign, so code 8 is -0.0).

Written out literally instead of decoded through `ml_dtypes.float4_e2m1fn`: the table *is* the
OCP definition, and keeping it independent of ml_dtypes lets the test-suite use
`float4_e2m1fn` as a genuine cross-check.
"""


def _build_e8m0_table() -> tuple[np.ndarray, str]:
    # Reference construction: ldexp is exact, including 2**-127 which is an fp32 subnormal.
    reference = np.empty(256, dtype=np.float32)
    reference[:255] = np.ldexp(np.ones(255, dtype=np.float32), np.arange(255, dtype=np.int32) - E8M0_BIAS)
    reference[255] = np.nan
    # Prefer ml_dtypes' own float8_e8m0fnu decoding (0.5 to 0.7 decode byte 0 to 2**-127 and 255 to
    # NaN, i.e. exactly the spec), but only after checking it bit for bit: the byte-0 subnormal is
    # precisely what naive `s << 23` decoders get wrong (the type itself arrived in ml_dtypes 0.5).
    # Either way decoding is a 256-entry gather, which is faster than a per-element dtype cast.
    e8m0 = getattr(ml_dtypes, "float8_e8m0fnu", None)
    if e8m0 is None:
        return reference, "ldexp"
    decoded = np.arange(256, dtype=np.uint8).view(e8m0).astype(np.float32)
    same_finite = np.array_equal(decoded[:255].view(np.uint32), reference[:255].view(np.uint32))
    if same_finite and np.isnan(decoded[255]):
        return decoded, "ml_dtypes"
    return reference, "ldexp"


# E8M0_SOURCE records which construction won ("ml_dtypes" or "ldexp"), for tests and debugging.
_E8M0_TABLE, E8M0_SOURCE = _build_e8m0_table()
_E8M0_TABLE.setflags(write=False)

# Byte -> (value of low nibble, value of high nibble) as one 8-byte word, so dequantizing is a
# single 8-byte gather per packed byte followed by a free reinterpretation as float32 pairs.
_BYTES = np.arange(256, dtype=np.uint8)
_BYTE_TO_VALUE_PAIR = np.stack([E2M1_VALUES[_BYTES & 0x0F], E2M1_VALUES[_BYTES >> 4]], axis=-1)
_BYTE_TO_VALUE_PAIR_U64 = np.ascontiguousarray(_BYTE_TO_VALUE_PAIR).view(np.uint64).reshape(256)
# Byte -> (low code, high code) as one 2-byte word, for the same trick on unpacking.
_BYTE_TO_CODE_PAIR_U16 = (
    np.ascontiguousarray(np.stack([_BYTES & 0x0F, _BYTES >> 4], axis=-1)).view(np.uint16).reshape(256)
)

# Fast MXFP4 decoding: one table entry per (scale byte, packed byte) pair, i.e. 65,536 entries at
# index `scale << 8 | byte`, each holding the two decoded elements as raw output bits (a uint32
# for two bf16/fp16 values, a uint64 for two float32). Each entry is computed once by the exact
# float path (`_decode_pairs_float`, the same arithmetic `dequantize_mxfp4_float` applies to
# every element), so a table gather returns bit for bit what that path returns, for all 256 scale
# bytes - NaN (255), the 2**-127 subnormal scale (0) and overflow (>= 253) included - without any
# range analysis. Decoding is then an index build plus one gather per packed byte. Tables are
# built on first use per output dtype (256 KiB for bf16/fp16, 512 KiB for float32); with real
# scales (a dozen distinct bytes per tensor) only a few KiB of a table are ever touched.
_TABLE_WORDS: dict[np.dtype, type] = {
    np.dtype(ml_dtypes.bfloat16): np.uint32,
    np.dtype(np.float16): np.uint32,
    np.dtype(np.float32): np.uint64,
}
_DECODE_TABLES: dict[np.dtype, np.ndarray] = {}

# Packed bytes (16 per 32-element block) per step of the table path: the step's intp index buffer
# (8 bytes per packed byte, 512 KiB) and output slice (256 KiB as bf16) stay in L2, and the six
# numpy calls of a step are amortized over 131,072 elements. Measured flat from 2**15 to 2**18.
TABLE_CHUNK_BYTES = 1 << 16
_REPEAT_BYTE_8 = np.uint64(0x0101010101010101)


@dataclass(frozen=True)
class _Fp8Spec:
    dtype: type
    emax: int
    mbits: int
    emin: int
    max_finite: float


FP8_SPECS: dict[str, _Fp8Spec] = {
    "e4m3": _Fp8Spec(ml_dtypes.float8_e4m3fn, emax=8, mbits=3, emin=-6, max_finite=448.0),
    "e5m2": _Fp8Spec(ml_dtypes.float8_e5m2, emax=15, mbits=2, emin=-14, max_finite=57344.0),
}

_FP8_TABLES: dict[str, np.ndarray] = {
    name: np.arange(256, dtype=np.uint8).view(spec.dtype).astype(np.float32) for name, spec in FP8_SPECS.items()
}
for _table in _FP8_TABLES.values():
    _table.setflags(write=False)

_OUTPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))
_ML_FLOAT_INPUTS = tuple(
    np.dtype(getattr(ml_dtypes, name))
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3b11fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn",
        "float6_e2m3fn",
        "float6_e3m2fn",
    )
    if hasattr(ml_dtypes, name)
)


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _require_uint8(array: np.ndarray, name: str) -> None:
    if array.dtype != np.uint8:
        raise TypeError(f"{name} must have dtype uint8, got {array.dtype}")


def _require_ndim(array: np.ndarray, name: str) -> None:
    if array.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d array")


def _output_dtype(dtype: npt.DTypeLike) -> np.dtype:
    resolved = np.dtype(dtype)
    if resolved not in _OUTPUT_DTYPES:
        allowed = ", ".join(str(d) for d in _OUTPUT_DTYPES)
        raise ValueError(f"unsupported output dtype {resolved}; expected one of {allowed}")
    return resolved


def _check_block_scales(data: np.ndarray, scales: np.ndarray, elements_per_unit: int, data_name: str) -> int:
    """Check `scales` is `[..., in/32]` for `data` `[..., in/elements_per_unit]`; return `in/32`."""
    units_per_block = MX_BLOCK_SIZE // elements_per_unit
    last = data.shape[-1]
    if last % units_per_block:
        raise ValueError(
            f"{data_name} last dimension must be a multiple of {units_per_block} "
            f"(in = {elements_per_unit} x {last} elements is not a multiple of {MX_BLOCK_SIZE}); "
            f"got {data_name} shape {data.shape}"
        )
    groups = last // units_per_block
    expected = data.shape[:-1] + (groups,)
    if scales.shape != expected:
        raise ValueError(
            f"scales shape mismatch: {data_name} shape {data.shape} holds in = {last * elements_per_unit} "
            f"elements per row, so scales must have shape {expected} (one per {MX_BLOCK_SIZE}); "
            f"got {scales.shape}"
        )
    return groups


def _work_array(x: npt.ArrayLike, caller: str) -> np.ndarray:
    """Return `x` as float64 if it already is, else as float32 (exact for every narrower float)."""
    array = np.asarray(x)
    if array.dtype == np.float64:
        return array
    if array.dtype.kind in "fiu" or array.dtype in _ML_FLOAT_INPUTS:
        return array.astype(np.float32, copy=False)
    raise TypeError(f"{caller}: expected a real floating-point array, got dtype {array.dtype}")


def _check_quantize_input(x: np.ndarray, caller: str) -> int:
    _require_ndim(x, "x")
    last = x.shape[-1]
    if last % MX_BLOCK_SIZE:
        raise ValueError(
            f"{caller}: the last dimension (in) must be a multiple of {MX_BLOCK_SIZE}, "
            f"got {last} (x shape {x.shape})"
        )
    return last // MX_BLOCK_SIZE


def _raise_non_finite(x: np.ndarray, caller: str) -> None:
    count = int(np.count_nonzero(~np.isfinite(x)))
    raise ValueError(
        f"{caller}: input contains {count} non-finite value(s) (NaN or +-Inf) out of {x.size}; "
        "MX element formats cannot encode them"
    )


def normalize_scale_mode(scale_mode: str, allowed: tuple[str, ...] = SCALE_MODES) -> str:
    """
    The canonical name of a shared-exponent rule: `"floor"` is accepted as the OCP rule's old name.

    Raises:
        `ValueError`:
            If `scale_mode` is none of `allowed` (or an alias of one).
    """
    canonical = _SCALE_MODE_ALIASES.get(scale_mode, scale_mode)
    if canonical not in allowed:
        names = ", ".join(repr(m) for m in allowed)
        raise ValueError(f"scale_mode must be one of {names} ('floor' = 'ocp'), got {scale_mode!r}")
    return canonical


def _signbit(x: np.ndarray, _zero: int) -> np.ndarray:
    """`np.signbit` with the signature of `np.less(x, 0)`: -0.0 counts as negative."""
    return np.signbit(x)


def _fp8_spec(fmt: str) -> _Fp8Spec:
    try:
        return FP8_SPECS[fmt]
    except KeyError:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}") from None


# --------------------------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------------------------


def decode_e8m0(scales: np.ndarray) -> np.ndarray:
    """
    Decode E8M0 scale bytes to float32 powers of two.

    Byte `s` decodes to exactly `2**(s - 127)`; byte 0 is `2**-127` (an fp32 subnormal, not 0)
    and byte 255 is NaN.

    Args:
        scales (`np.ndarray`):
            uint8 array of any shape.

    Returns:
        `np.ndarray`: float32 array of the same shape.

    Raises:
        `TypeError`:
            If `scales` is not uint8.
    """
    scales = np.asarray(scales)
    _require_uint8(scales, "scales")
    return _E8M0_TABLE[scales]


def _shared_exponent(amax: np.ndarray, emax: int, mbits: int, max_finite: float, scale_mode: str) -> np.ndarray:
    """Unbiased shared exponent per block (int32, clamped to [-127, 127]) from the block maxima."""
    # frexp gives amax = m * 2**p with m in [0.5, 1), so floor(log2(amax)) = p - 1 exactly,
    # including subnormals and exact powers of two where a float log2 can land on the wrong side.
    mantissa, exponent = np.frexp(amax)
    shared = exponent.astype(np.int32) - 1 - emax
    if scale_mode == "ceil":
        # amax / 2**shared is in [2**emax, 2**(emax+1)) and equals mantissa * 2**(emax+1) exactly.
        shared += (mantissa * (2.0 ** (emax + 1)) > max_finite).astype(np.int32)
    elif scale_mode in ("even", "compressed-tensors"):
        # Significand 2*mantissa in [1, 2) rounded to `mbits` bits carries into the next binade.
        # compressed-tensors' `round_to_power_2` does this on the bits (add half of the last kept
        # mantissa bit, mask the mantissa off): for E2M1's one bit, a bump exactly when the
        # significand is >= 1.75, the same as rounding to nearest with ties to even.
        shared += (mantissa * 2.0 >= 2.0 - 2.0 ** -(mbits + 1)).astype(np.int32)
    shared[amax == 0] = _EXP_MIN
    np.clip(shared, _EXP_MIN, _EXP_MAX, out=shared)
    return shared


# --------------------------------------------------------------------------------------------
# Nibble packing
# --------------------------------------------------------------------------------------------


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """
    Unpack bytes into 4-bit codes, low nibble first (compressed-tensors / gpt-oss order).

    Element `2j` of the result is the low nibble of byte `j`, element `2j+1` its high nibble.

    Args:
        packed (`np.ndarray`):
            uint8 array `[..., n]`.

    Returns:
        `np.ndarray`: uint8 codes `[..., 2n]`, each in `0..15`.

    Raises:
        `TypeError`:
            If `packed` is not uint8.
        `ValueError`:
            If `packed` is 0-d.
    """
    packed = np.asarray(packed)
    _require_uint8(packed, "packed")
    _require_ndim(packed, "packed")
    codes = _BYTE_TO_CODE_PAIR_U16[packed].view(np.uint8)
    return codes.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def _check_codes(codes: np.ndarray, multiple: int) -> np.ndarray:
    if codes.dtype.kind not in "iu":
        raise TypeError(f"codes must have an integer dtype, got {codes.dtype}")
    _require_ndim(codes, "codes")
    if codes.shape[-1] % multiple:
        raise ValueError(f"codes last dimension must be a multiple of {multiple}, got shape {codes.shape}")
    out_of_range = int(np.count_nonzero((codes < 0) | (codes > 15)))
    if out_of_range:
        raise ValueError(f"codes must be in 0..15; {out_of_range} value(s) are out of range")
    return codes.astype(np.uint8, copy=False)


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """
    Pack 4-bit codes two per byte, low nibble first; the inverse of [`unpack_fp4`].

    Args:
        codes (`np.ndarray`):
            Integer array `[..., 2n]` with values in `0..15`.

    Returns:
        `np.ndarray`: uint8 array `[..., n]`.

    Raises:
        `TypeError`:
            If `codes` does not have an integer dtype.
        `ValueError`:
            If the last dimension is odd or a code is outside `0..15`.
    """
    codes = _check_codes(np.asarray(codes), 2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4_gguf(packed: np.ndarray) -> np.ndarray:
    """
    Unpack bytes into 4-bit codes in llama.cpp's split order.

    Each 32-element block occupies 16 bytes: element `j` (0 <= j < 16) is the low nibble of byte
    `j` and element `j + 16` the high nibble of the same byte. Only the nibble order is handled;
    GGUF's `block_mxfp4` also interleaves the scale byte in front of each 16 bytes and uses
    doubled integer element values with a halved scale, which the caller must strip or undo.

    Args:
        packed (`np.ndarray`):
            uint8 array `[..., n]` with `n` a multiple of 16.

    Returns:
        `np.ndarray`: uint8 codes `[..., 2n]` in element order.

    Raises:
        `TypeError`:
            If `packed` is not uint8.
        `ValueError`:
            If the last dimension is not a multiple of 16.
    """
    packed = np.asarray(packed)
    _require_uint8(packed, "packed")
    _require_ndim(packed, "packed")
    n = packed.shape[-1]
    if n % 16:
        raise ValueError(f"packed last dimension must be a multiple of 16 for the GGUF order, got shape {packed.shape}")
    blocks = packed.reshape(packed.shape[:-1] + (n // 16, 16))
    codes = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1)
    return codes.reshape(packed.shape[:-1] + (2 * n,))


def pack_fp4_gguf(codes: np.ndarray) -> np.ndarray:
    """
    Pack 4-bit codes in llama.cpp's split order; the inverse of [`unpack_fp4_gguf`].

    Args:
        codes (`np.ndarray`):
            Integer array `[..., 2n]` with values in `0..15`, `2n` a multiple of 32.

    Returns:
        `np.ndarray`: uint8 array `[..., n]`.

    Raises:
        `TypeError`:
            If `codes` does not have an integer dtype.
        `ValueError`:
            If the last dimension is not a multiple of 32 or a code is outside `0..15`.
    """
    codes = _check_codes(np.asarray(codes), MX_BLOCK_SIZE)
    m = codes.shape[-1]
    blocks = codes.reshape(codes.shape[:-1] + (m // MX_BLOCK_SIZE, MX_BLOCK_SIZE))
    packed = blocks[..., :16] | (blocks[..., 16:] << 4)
    return packed.reshape(codes.shape[:-1] + (m // 2,))


# --------------------------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------------------------


def round_to_e2m1_codes(values: np.ndarray) -> np.ndarray:
    """
    Round already-scaled values to E2M1 codes, nearest-even at ties, saturating at +-6.

    The sign is kept (negative values that round to zero give code 8, i.e. -0.0). Ties go to the
    code with an even last bit: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0,
    3.5 -> 4.0, 5.0 -> 4.0. Implemented with exact comparisons against the midpoints rather than a
    cast to `ml_dtypes.float4_e2m1fn` (which agrees on float32 input): it is about twice as fast,
    and does not double-round float64 input through float32.

    Args:
        values (`np.ndarray`):
            Finite float32 or float64 array; NaN is not checked for here and maps to code 0.

    Returns:
        `np.ndarray`: uint8 codes of the same shape.
    """
    values = np.asarray(values)
    if values.dtype != np.float64:
        values = values.astype(np.float32, copy=False)
    magnitude = np.abs(values)
    codes = _round_e2m1_magnitude(magnitude)
    codes |= np.signbit(values).view(np.uint8) << 3
    return codes


def _round_e2m1_magnitude(magnitude: np.ndarray) -> np.ndarray:
    # Code = number of midpoints below the value. At a midpoint the tie must go to the even code,
    # so the comparison is strict where the lower neighbour's code is even (0|1, 2|3, 4|5, 6|7)
    # and inclusive where it is odd (1|2, 3|4, 5|6). Everything above 5 lands on code 7 (6.0),
    # which is the saturation.
    codes = np.greater(magnitude, 0.25).view(np.uint8)
    scratch = np.empty(magnitude.shape, dtype=np.bool_)
    for threshold, inclusive in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        (np.greater_equal if inclusive else np.greater)(magnitude, threshold, out=scratch)
        codes += scratch.view(np.uint8)
    return codes


def _decode_pairs_float(byte_values: np.ndarray, scale_values: np.ndarray, out_dtype: np.dtype) -> np.ndarray:
    """The exact float path for packed bytes `[..., n]` and their float32 scales `[..., n]`.

    Returns `[..., n, 2]` of `out_dtype`: E2M1 value pairs times the scale in float32, then one cast.
    """
    values = _BYTE_TO_VALUE_PAIR[byte_values]
    with np.errstate(over="ignore"):
        values *= scale_values[..., None]
        return values.astype(out_dtype, copy=False)


def decode_table(out_dtype: np.dtype) -> np.ndarray:
    """The 65,536-entry `(scale << 8 | byte)` table of decoded pairs for `out_dtype` (see above)."""
    table = _DECODE_TABLES.get(out_dtype)
    if table is None:
        scale_bytes, packed_bytes = np.divmod(np.arange(1 << 16, dtype=np.int64), 256)
        pairs = _decode_pairs_float(packed_bytes, _E8M0_TABLE[scale_bytes], out_dtype)
        table = np.ascontiguousarray(pairs).view(_TABLE_WORDS[out_dtype]).reshape(1 << 16)
        table.setflags(write=False)
        _DECODE_TABLES[out_dtype] = table
    return table


def _check_mxfp4_args(packed: np.ndarray, scales: np.ndarray, dtype: npt.DTypeLike) -> tuple[np.dtype, int]:
    _require_uint8(packed, "packed")
    _require_uint8(scales, "scales")
    _require_ndim(packed, "packed")
    _require_ndim(scales, "scales")
    out_dtype = _output_dtype(dtype)
    return out_dtype, _check_block_scales(packed, scales, 2, "packed")


def dequantize_mxfp4_float(packed: np.ndarray, scales: np.ndarray, dtype: npt.DTypeLike = np.float32) -> np.ndarray:
    """
    The exact float path of [`dequantize_mxfp4`]: the definition the fast path must equal bit for bit.

    Each element is `E2M1_VALUES[code] * 2**(s - 127)` computed in float32 and then cast once to
    `dtype` (round-to-nearest-even; ml_dtypes for bfloat16). The float32 product is exact, or
    +-inf where it leaves the float32 range: E2M1 magnitudes are `m * 2**e` with `m` in
    `{1, 1.5}` (two significant bits) and `e` in `[-1, 2]`, so the product is `m * 2**(e + k)`
    with `e + k` in `[-128, 129]`; float32 represents it exactly for `e + k <= 127` (the smallest
    nonzero products, `0.5 * 2**-127 = 2**-128` and `1.5 * 2**-127`, are subnormals far above
    2**-149), and `e + k >= 128` overflows to inf, which is also the correctly rounded result. A single rounding from an exact
    value is the correctly rounded result in `dtype`, so there is no double rounding. For bfloat16
    (float32's exponent range, 7 mantissa bits, subnormals down to 2**-133) every finite product is
    representable, so the cast is exact too. NaN-scale blocks (255) are NaN throughout.

    Used for float64 output (whose values are these float32 results widened) and by the tests.
    """
    packed = np.asarray(packed)
    scales = np.asarray(scales)
    out_dtype, groups = _check_mxfp4_args(packed, scales, dtype)
    lead = packed.shape[:-1]
    rows = math.prod(lead)
    width = groups * MX_BLOCK_SIZE
    out = np.empty((rows, width), dtype=out_dtype)
    if rows == 0 or width == 0:
        return out.reshape(lead + (width,))
    flat_packed = packed.reshape(rows, groups * 16)
    flat_scales = scales.reshape(rows, groups)
    step = max(1, CHUNK_ELEMENTS // width)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        byte_values = flat_packed[start:stop].reshape(stop - start, groups, 16)
        block_scales = np.broadcast_to(_E8M0_TABLE[flat_scales[start:stop]][..., None], byte_values.shape)
        out[start:stop] = _decode_pairs_float(byte_values, block_scales, out_dtype).reshape(stop - start, width)
    return out.reshape(lead + (width,))


def dequantize_mxfp4(
    packed: np.ndarray,
    scales: np.ndarray,
    dtype: npt.DTypeLike = np.float32,
) -> np.ndarray:
    """
    Decode MXFP4 (packed E2M1 codes + E8M0 block scales) to floats, exactly.

    Each element is `E2M1 value * 2**(s - 127)`, computed exactly in float32 and rounded once to
    `dtype` (see `dequantize_mxfp4_float` for the argument). For bfloat16, float32 and float64
    every finite result is exact; float16 rounds to nearest-even where its narrower range demands.
    Scale byte 255 makes its whole block NaN. Scale bytes >= 253 can produce values beyond the
    float32 range; those come out as +-inf without a warning.

    For bfloat16, float16 and float32 the work is a table gather: one 65,536-entry table per
    output dtype maps `(scale byte, packed byte)` to the two output values' bits, and each table
    entry is produced by the exact float path, so results are bit-identical to it for every input.

    Args:
        packed (`np.ndarray`):
            uint8 `[..., in/2]`, low nibble first (compressed-tensors `weight_packed`).
        scales (`np.ndarray`):
            uint8 `[..., in/32]` E8M0 bytes (compressed-tensors `weight_scale`).
        dtype (`np.dtype`, *optional*, defaults to `np.float32`):
            Output dtype: `np.float32`, `np.float16`, `ml_dtypes.bfloat16` or `np.float64`.

    Returns:
        `np.ndarray`: `[..., in]` array of `dtype`.

    Raises:
        `TypeError`:
            If `packed` or `scales` is not uint8.
        `ValueError`:
            If the shapes do not match (`scales` must be `packed.shape[:-1] + (in/32,)`) or the
            dtype is unsupported.
    """
    packed = np.asarray(packed)
    scales = np.asarray(scales)
    out_dtype, groups = _check_mxfp4_args(packed, scales, dtype)
    if out_dtype not in _TABLE_WORDS:
        return dequantize_mxfp4_float(packed, scales, out_dtype)
    table = decode_table(out_dtype)

    lead = packed.shape[:-1]
    width = groups * MX_BLOCK_SIZE
    n_blocks = math.prod(lead) * groups
    out = np.empty(lead + (width,), dtype=out_dtype)
    if n_blocks == 0:
        return out
    # Everything is flattened to [blocks, 16] so chunks are a fixed size whatever the row width.
    block_bytes = packed.reshape(n_blocks, 16)
    block_scales = scales.reshape(n_blocks)
    out_words = out.view(table.dtype).reshape(n_blocks, 16)
    step = max(1, TABLE_CHUNK_BYTES // 16)
    rows = min(step, n_blocks)
    # The table index `scale << 8 | byte` is assembled bytewise in a zeroed intp buffer: byte 0 of
    # each index (its least significant byte) is the packed byte, byte 1 the block's scale, the
    # rest stay 0. That is two strided byte copies per step; a broadcasting `|` of a [blocks, 1]
    # scale column into [blocks, 16] costs about 1.5x as much (numpy's inner loop would be 16 long).
    index = np.zeros((rows, 16), dtype=np.intp)
    index_bytes = index.view(np.uint8).reshape(rows, 16, index.itemsize)
    low, high = (0, 1) if sys.byteorder == "little" else (index.itemsize - 1, index.itemsize - 2)
    # Each block's scale byte repeated 16 times, made by one multiply into 8-byte words.
    scale_bytes = np.empty((rows, 16), dtype=np.uint8)
    scale_words = scale_bytes.view(np.uint64)
    repeated = np.empty(rows, dtype=np.uint64)
    for start in range(0, n_blocks, step):
        stop = min(n_blocks, start + step)
        count = stop - start
        np.multiply(block_scales[start:stop], _REPEAT_BYTE_8, out=repeated[:count], dtype=np.uint64)
        scale_words[:count, 0] = repeated[:count]
        scale_words[:count, 1] = repeated[:count]
        index_bytes[:count, :, low] = block_bytes[start:stop]
        index_bytes[:count, :, high] = scale_bytes[:count]
        # Indices are in [0, 65535] by construction, so "clip" never clips; it merely skips the
        # per-element bounds-error path of the default mode.
        np.take(table, index[:count], out=out_words[start:stop], mode="clip")
    return out


def dequantize_mxfp4_gptoss(
    blocks: np.ndarray,
    scales: np.ndarray,
    dtype: npt.DTypeLike = np.float32,
) -> np.ndarray:
    """
    Decode gpt-oss style stacked MXFP4 expert tensors.

    gpt-oss stores `*_blocks [E, out, G, 16]` (16 bytes = 32 elements per block, low nibble
    first) and `*_scales [E, out, G]`. Any number of leading axes is accepted. For
    `gate_up_proj` the gate and up rows stay interleaved exactly as stored; splitting them is the
    caller's job.

    Args:
        blocks (`np.ndarray`):
            uint8 `[..., G, 16]`.
        scales (`np.ndarray`):
            uint8 `[..., G]`, the same leading shape as `blocks`.
        dtype (`np.dtype`, *optional*, defaults to `np.float32`):
            Output dtype, as in [`dequantize_mxfp4`].

    Returns:
        `np.ndarray`: `[..., G * 32]` array of `dtype` (`[E, out, in]` for the usual layout).

    Raises:
        `TypeError`:
            If `blocks` or `scales` is not uint8.
        `ValueError`:
            If `blocks` does not end in 16 or `scales.shape != blocks.shape[:-1]`.
    """
    blocks = np.asarray(blocks)
    scales = np.asarray(scales)
    _require_uint8(blocks, "blocks")
    _require_uint8(scales, "scales")
    if blocks.ndim < 2 or blocks.shape[-1] != 16:
        raise ValueError(f"blocks must have shape [..., G, 16] (16 bytes per 32-element block), got {blocks.shape}")
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(
            f"scales shape mismatch: blocks shape {blocks.shape} needs scales of shape {blocks.shape[:-1]}, "
            f"got {scales.shape}"
        )
    groups = blocks.shape[-2]
    flat = blocks.reshape(blocks.shape[:-2] + (groups * 16,))
    return dequantize_mxfp4(flat, scales, dtype=dtype)


def _scaled_blocks(
    x: npt.ArrayLike, caller: str, emax: int, mbits: int, max_finite: float, scale_mode: str
) -> tuple[tuple[int, ...], int, int, np.ndarray, Iterator[tuple[int, int, np.ndarray, np.ndarray]]]:
    """The front half every MX quantizer shares: validate ``x``, split it into blocks of 32,
    and, chunk by chunk, choose each block's shared exponent (written into ``scales``) and
    divide the block's magnitudes by it.

    Returns ``(lead shape, groups per row, n_blocks, scales, chunks)``; ``chunks`` yields
    ``(start, stop, signed block values, scaled magnitudes)`` for the caller to round.
    """
    work = _work_array(x, caller)
    groups = _check_quantize_input(work, caller)
    lead = work.shape[:-1]
    n_blocks = math.prod(lead) * groups
    scales = np.empty(n_blocks, dtype=np.uint8)
    blocks = work.reshape(n_blocks, MX_BLOCK_SIZE)

    def chunks() -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        step = max(1, CHUNK_ELEMENTS // MX_BLOCK_SIZE)
        for start in range(0, n_blocks, step):
            stop = min(n_blocks, start + step)
            chunk = blocks[start:stop]
            magnitude = np.abs(chunk)
            amax = magnitude.max(axis=1)
            if not np.isfinite(amax).all():
                _raise_non_finite(work, caller)
            shared = _shared_exponent(amax, emax, mbits, max_finite, scale_mode)
            scales[start:stop] = shared + E8M0_BIAS
            # Multiplying by an exact power of two is exact (2**127 and 2**-127 are both
            # representable in float32), so the caller's rounding is the only rounding. Values
            # that would turn subnormal are far below E2M1's first midpoint (0.25); the FP8
            # quantizer rounds its subnormal binades explicitly.
            magnitude *= np.ldexp(np.ones_like(amax), -shared)[:, None]
            yield start, stop, chunk, magnitude

    return lead, groups, n_blocks, scales, chunks()


def quantize_mxfp4(
    x: npt.ArrayLike,
    scale_mode: ScaleMode = "compressed-tensors",
) -> tuple[np.ndarray, np.ndarray]:
    """
    Quantize floats to MXFP4 (packed E2M1 codes + E8M0 block scales).

    Each block of 32 consecutive elements along the last axis gets a shared exponent `e`,
    clamped to `[-127, 127]` and stored as the byte `e + 127`; an all-zero block gets byte 0.
    Elements become `x / 2**e` rounded to nearest-even on the E2M1 grid
    `{0, 0.5, 1, 1.5, 2, 3, 4, 6}` and saturated to +-6 (sign kept, so negative underflow is -0).
    With `amax = max(|x|)` over the block and `f = floor(log2(amax))` (computed exactly with
    `np.frexp`), the modes are:

    - `"compressed-tensors"` (the default; what made K3's experts): amax rounded to one mantissa
      bit, then `floor(log2) - 2`, i.e. `e = f - 2`, plus one when amax's significand is
      >= 1.75 - the `"even"` exponent. Elements as below, except that the sign code follows
      `x < 0`: an input -0.0 gives code 0 (+0), as compressed-tensors' `cast_to_fp4` does, while a
      small negative value still rounds to code 8 (-0). Byte for byte what compressed-tensors
      0.20.1 writes for every finite float32/bfloat16 block with amax below 1.75 * 2**127, and
      every float16 block with amax in [2**-14, 57344) (tests/test_mxfp4_golden.py); outside
      those it writes a block of zeros, k3ckpt the nearest encoding (docs/mx.md).
    - `"ocp"` (OCP MX v1.0 section 6.3; `"floor"` is an alias): `e = f - 2`. `amax / 2**e` lies
      in `[4, 8)`, so values above 6 in that block saturate.
    - `"ceil"`: the smallest `e` with `amax / 2**e <= 6`, i.e. `ceil(log2(amax / 6))` evaluated
      exactly (the triton_kernels rule): `f - 2`, plus one when `amax / 2**(f-2) > 6`. Nothing
      saturates unless the exponent is clamped at 127 (only reachable from float64 input).
    - `"even"`: `f - 2`, plus one when rounding amax's significand to E2M1's one mantissa bit
      (nearest, ties to even) carries into the next binade, i.e. when `amax / 2**(f-2) >= 7`.
      Equivalently: bump exactly when `amax` itself would round to 8 on an unbounded E2M1 grid,
      so saturation never adds error beyond ordinary rounding.

    float64 input is processed in float64; every other float (float16, bfloat16, float8...) is
    widened to float32 exactly. Both are exact: scaling is by powers of two and rounding uses
    exact comparisons. Large inputs are processed in row chunks internally.

    Args:
        x (`np.ndarray`):
            Real array `[..., in]` with `in` a multiple of 32; all values finite.
        scale_mode (`str`, *optional*, defaults to `"compressed-tensors"`):
            `"compressed-tensors"`, `"ocp"` (alias `"floor"`), `"ceil"` or `"even"`, as above.

    Returns:
        `tuple[np.ndarray, np.ndarray]`: `(packed, scales)`, uint8 `[..., in/2]` (low nibble
        first) and uint8 `[..., in/32]`.

    Raises:
        `TypeError`:
            If `x` is not a real numeric array.
        `ValueError`:
            If `in` is not a multiple of 32, `x` holds NaN/Inf (the message gives the count), or
            `scale_mode` is unknown.
    """
    scale_mode = normalize_scale_mode(scale_mode)  # type: ignore[assignment]
    lead, groups, n_blocks, scales, chunks = _scaled_blocks(
        x, "quantize_mxfp4", _E2M1_EMAX, _E2M1_MBITS, E2M1_MAX, scale_mode)
    # compressed-tensors takes the sign from torch.sign(x), which is +0 for -0.0.
    negative = np.less if scale_mode == "compressed-tensors" else _signbit
    packed = np.empty((n_blocks, 16), dtype=np.uint8)
    for start, stop, chunk, magnitude in chunks:
        codes = _round_e2m1_magnitude(magnitude)
        codes |= negative(chunk, 0).view(np.uint8) << 3
        packed[start:stop] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.reshape(lead + (groups * 16,)), scales.reshape(lead + (groups,))


# --------------------------------------------------------------------------------------------
# MXFP8
# --------------------------------------------------------------------------------------------


def dequantize_mxfp8(
    data: np.ndarray,
    scales: np.ndarray,
    fmt: Fp8Format = "e4m3",
    dtype: npt.DTypeLike = np.float32,
) -> np.ndarray:
    """
    Decode MXFP8 (one FP8 byte per element + E8M0 block scales) to floats, exactly.

    FP8 bytes are decoded through a 256-entry table built from `ml_dtypes.float8_e4m3fn` /
    `ml_dtypes.float8_e5m2`, so their NaN and Inf encodings carry through. Products are exact in
    float32 except where they leave its range (+-inf, no warning) or fall below its subnormals.

    Args:
        data (`np.ndarray`):
            uint8 `[..., in]` raw FP8 bytes.
        scales (`np.ndarray`):
            uint8 `[..., in/32]` E8M0 bytes.
        fmt (`str`, *optional*, defaults to `"e4m3"`):
            `"e4m3"` (OCP E4M3, no Inf, max 448) or `"e5m2"` (max 57344).
        dtype (`np.dtype`, *optional*, defaults to `np.float32`):
            Output dtype, as in [`dequantize_mxfp4`].

    Returns:
        `np.ndarray`: `[..., in]` array of `dtype`.

    Raises:
        `TypeError`:
            If `data` or `scales` is not uint8.
        `ValueError`:
            If the shapes do not match, or `fmt` / `dtype` is unsupported.
    """
    _fp8_spec(fmt)
    data = np.asarray(data)
    scales = np.asarray(scales)
    _require_uint8(data, "data")
    _require_uint8(scales, "scales")
    _require_ndim(data, "data")
    _require_ndim(scales, "scales")
    out_dtype = _output_dtype(dtype)
    groups = _check_block_scales(data, scales, 1, "data")
    values = _FP8_TABLES[fmt][data].reshape(data.shape[:-1] + (groups, MX_BLOCK_SIZE))
    with np.errstate(over="ignore"):
        values *= decode_e8m0(scales)[..., None]
        return values.reshape(data.shape).astype(out_dtype, copy=False)


def quantize_mxfp8(
    x: npt.ArrayLike,
    fmt: Fp8Format = "e4m3",
    scale_mode: ScaleMode = "ocp",
) -> tuple[np.ndarray, np.ndarray]:
    """
    Quantize floats to MXFP8 (FP8 bytes + E8M0 block scales).

    Same block structure and scale modes as [`quantize_mxfp4`], with the element format's
    parameters: `emax` 8 / 15, mantissa bits 3 / 2 and largest finite value 448 / 57344 for
    E4M3 / E5M2. `"ocp"` (alias `"floor"`): `e = floor(log2(amax)) - emax`; `"ceil"`: smallest `e` with
    `amax / 2**e <= max_finite`; `"even"`: floor, plus one when amax's significand rounded to the
    format's mantissa width (nearest, ties to even) carries into the next binade. Elements are
    rounded to nearest-even on the FP8 grid (subnormals included) and saturated to the largest
    finite value.

    The rounding is done here with `np.rint` on exactly power-of-two-scaled values, and
    `ml_dtypes` is only used for the final, exact, conversion to FP8 bytes: ml_dtypes 0.5 and 0.6
    cast float64 to FP8 through float32, which double-rounds (1 + 2**-4 + 2**-30 becomes 1.0 in E4M3
    instead of 1.125).

    Args:
        x (`np.ndarray`):
            Real array `[..., in]` with `in` a multiple of 32; all values finite.
        fmt (`str`, *optional*, defaults to `"e4m3"`):
            `"e4m3"` or `"e5m2"`.
        scale_mode (`str`, *optional*, defaults to `"ocp"`):
            `"ocp"` (alias `"floor"`), `"ceil"` or `"even"` (the compressed-tensors rule is
            MXFP4-only here: no golden vectors pin its MXFP8 variant).

    Returns:
        `tuple[np.ndarray, np.ndarray]`: `(data, scales)`, uint8 `[..., in]` FP8 bytes and uint8
        `[..., in/32]` E8M0 bytes.

    Raises:
        `TypeError`:
            If `x` is not a real numeric array.
        `ValueError`:
            If `in` is not a multiple of 32, `x` holds NaN/Inf, or `fmt` / `scale_mode` is unknown.
    """
    spec = _fp8_spec(fmt)
    scale_mode = normalize_scale_mode(scale_mode, ("ocp", "ceil", "even"))  # type: ignore[assignment]
    lead, groups, n_blocks, scales, chunks = _scaled_blocks(
        x, "quantize_mxfp8", spec.emax, spec.mbits, spec.max_finite, scale_mode)
    data = np.empty((n_blocks, MX_BLOCK_SIZE), dtype=np.uint8)
    for start, stop, chunk, magnitude in chunks:
        # Quantum of each value's binade (subnormal binades share the quantum of emin); scaling by
        # it, rint (nearest-even), and scaling back are all exact.
        _, exponent = np.frexp(magnitude)
        quantum_exp = np.maximum(exponent - 1, spec.emin) - spec.mbits
        rounded = np.ldexp(np.rint(np.ldexp(magnitude, -quantum_exp)), quantum_exp)
        np.minimum(rounded, spec.max_finite, out=rounded)
        np.copysign(rounded, chunk, out=rounded)
        # `rounded` is on the FP8 grid already, so this conversion is exact.
        data[start:stop] = rounded.astype(spec.dtype).view(np.uint8)
    return data.reshape(lead + (groups * MX_BLOCK_SIZE,)), scales.reshape(lead + (groups,))


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def e2m1_code_histogram(packed: np.ndarray) -> np.ndarray:
    """
    Count how often each 4-bit E2M1 code occurs in packed MXFP4 data (both nibbles).

    A single `np.bincount` over whole bytes is folded into the two nibble histograms, which
    avoids materialising nibble arrays the size of the input.

    Args:
        packed (`np.ndarray`):
            uint8 array of any shape.

    Returns:
        `np.ndarray`: int64 `[16]`, index = code; the total is `2 * packed.size`.

    Raises:
        `TypeError`:
            If `packed` is not uint8.
    """
    packed = np.asarray(packed)
    _require_uint8(packed, "packed")
    by_byte = np.bincount(packed.ravel(), minlength=256).astype(np.int64).reshape(16, 16)
    # Row = high nibble, column = low nibble.
    return by_byte.sum(axis=0) + by_byte.sum(axis=1)


def scale_exponent_histogram(scales: np.ndarray) -> np.ndarray:
    """
    Count how often each E8M0 scale byte occurs.

    Args:
        scales (`np.ndarray`):
            uint8 array of any shape.

    Returns:
        `np.ndarray`: int64 `[256]`, index = byte (unbiased exponent = index - 127, 255 = NaN).

    Raises:
        `TypeError`:
            If `scales` is not uint8.
    """
    scales = np.asarray(scales)
    _require_uint8(scales, "scales")
    return np.bincount(scales.ravel(), minlength=256).astype(np.int64)
