"""The MX formats themselves: block size, the E8M0 scale byte (bias, NaN, its 256-entry decoding
table, :func:`decode_e8m0`), the E2M1 element grid (:data:`E2M1_VALUES`, its largest value and
exponent parameters), the output dtypes a decoder may produce, and the argument checks every
codec function shares.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import numpy.typing as npt

MX_BLOCK_SIZE: int = 32
"""Number of elements sharing one E8M0 scale (OCP MX v1.0, all concrete MX formats)."""

E8M0_BIAS: int = 127
"""Exponent bias of the E8M0 scale byte. Some third-party tools wrongly use 125."""

E8M0_NAN: int = 255
"""The E8M0 byte that encodes NaN; every element of a block with this scale decodes to NaN."""

E2M1_MAX: float = 6.0
"""Largest finite E2M1 magnitude (1.5 * 2**2)."""

E2M1_EMAX = 2
E2M1_MBITS = 1

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
E8M0_TABLE, E8M0_SOURCE = _build_e8m0_table()
E8M0_TABLE.setflags(write=False)

_OUTPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


def require_uint8(array: np.ndarray, name: str) -> None:
    if array.dtype != np.uint8:
        raise TypeError(f"{name} must have dtype uint8, got {array.dtype}")


def require_ndim(array: np.ndarray, name: str) -> None:
    if array.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d array")


def output_dtype(dtype: npt.DTypeLike) -> np.dtype:
    resolved = np.dtype(dtype)
    if resolved not in _OUTPUT_DTYPES:
        allowed = ", ".join(str(d) for d in _OUTPUT_DTYPES)
        raise ValueError(f"unsupported output dtype {resolved}; expected one of {allowed}")
    return resolved


def check_block_scales(data: np.ndarray, scales: np.ndarray, elements_per_unit: int, data_name: str) -> int:
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
    require_uint8(scales, "scales")
    return E8M0_TABLE[scales]
