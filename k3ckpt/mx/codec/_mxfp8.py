"""MXFP8: one FP8 byte per element (OCP E4M3 or E5M2, :data:`FP8_SPECS`) with one E8M0 scale per
32 elements: :func:`dequantize_mxfp8` through a 256-entry table per format, :func:`quantize_mxfp8`
rounding on the FP8 grid itself before the exact final cast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ._formats import MX_BLOCK_SIZE, check_block_scales, decode_e8m0, output_dtype, require_ndim, require_uint8
from ._scales import ScaleMode, normalize_scale_mode, scaled_blocks

Fp8Format = Literal["e4m3", "e5m2"]


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


def _fp8_spec(fmt: str) -> _Fp8Spec:
    try:
        return FP8_SPECS[fmt]
    except KeyError:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}") from None


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
    require_uint8(data, "data")
    require_uint8(scales, "scales")
    require_ndim(data, "data")
    require_ndim(scales, "scales")
    out_dtype = output_dtype(dtype)
    groups = check_block_scales(data, scales, 1, "data")
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
    lead, groups, n_blocks, scales, chunks = scaled_blocks(
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
