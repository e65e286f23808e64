"""MXFP4: E2M1 codes packed two per byte with one E8M0 scale per 32 elements.

Decoding (:func:`dequantize_mxfp4`, gpt-oss stacked experts :func:`dequantize_mxfp4_gptoss`) is a
gather from a 65,536-entry table per output dtype (:func:`decode_table`), each entry computed by
the exact float path (:func:`dequantize_mxfp4_float`); encoding (:func:`quantize_mxfp4`) rounds
the scaled block values to the E2M1 grid (:func:`round_to_e2m1_codes`).
"""

from __future__ import annotations

import math
import sys

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ._formats import (
    CHUNK_ELEMENTS,
    E2M1_EMAX,
    E2M1_MAX,
    E2M1_MBITS,
    E2M1_VALUES,
    E8M0_TABLE,
    MX_BLOCK_SIZE,
    check_block_scales,
    output_dtype,
    require_ndim,
    require_uint8,
)
from ._scales import ScaleMode, normalize_scale_mode, scaled_blocks

# Byte -> (value of low nibble, value of high nibble) as one 8-byte word, so dequantizing is a
# single 8-byte gather per packed byte followed by a free reinterpretation as float32 pairs.
_BYTES = np.arange(256, dtype=np.uint8)
_BYTE_TO_VALUE_PAIR = np.stack([E2M1_VALUES[_BYTES & 0x0F], E2M1_VALUES[_BYTES >> 4]], axis=-1)
_BYTE_TO_VALUE_PAIR_U64 = np.ascontiguousarray(_BYTE_TO_VALUE_PAIR).view(np.uint64).reshape(256)

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
        pairs = _decode_pairs_float(packed_bytes, E8M0_TABLE[scale_bytes], out_dtype)
        table = np.ascontiguousarray(pairs).view(_TABLE_WORDS[out_dtype]).reshape(1 << 16)
        table.setflags(write=False)
        _DECODE_TABLES[out_dtype] = table
    return table


def _check_mxfp4_args(packed: np.ndarray, scales: np.ndarray, dtype: npt.DTypeLike) -> tuple[np.dtype, int]:
    require_uint8(packed, "packed")
    require_uint8(scales, "scales")
    require_ndim(packed, "packed")
    require_ndim(scales, "scales")
    out_dtype = output_dtype(dtype)
    return out_dtype, check_block_scales(packed, scales, 2, "packed")


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
        block_scales = np.broadcast_to(E8M0_TABLE[flat_scales[start:stop]][..., None], byte_values.shape)
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
    require_uint8(blocks, "blocks")
    require_uint8(scales, "scales")
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


def _signbit(x: np.ndarray, _zero: int) -> np.ndarray:
    """`np.signbit` with the signature of `np.less(x, 0)`: -0.0 counts as negative."""
    return np.signbit(x)


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
    lead, groups, n_blocks, scales, chunks = scaled_blocks(
        x, "quantize_mxfp4", E2M1_EMAX, E2M1_MBITS, E2M1_MAX, scale_mode)
    # compressed-tensors takes the sign from torch.sign(x), which is +0 for -0.0.
    negative = np.less if scale_mode == "compressed-tensors" else _signbit
    packed = np.empty((n_blocks, 16), dtype=np.uint8)
    for start, stop, chunk, magnitude in chunks:
        codes = _round_e2m1_magnitude(magnitude)
        codes |= negative(chunk, 0).view(np.uint8) << 3
        packed[start:stop] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.reshape(lead + (groups * 16,)), scales.reshape(lead + (groups,))
