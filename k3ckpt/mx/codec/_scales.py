"""Choosing each block's shared exponent: the scale modes (:data:`SCALE_MODES`,
:func:`normalize_scale_mode`), the exponent rule of each, and the front half every MX quantizer
shares (check the input, cut it into blocks of 32, pick and store each block's E8M0 scale, divide
the block by it: :func:`scaled_blocks`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ._formats import CHUNK_ELEMENTS, E8M0_BIAS, MX_BLOCK_SIZE, require_ndim

ScaleMode = Literal["compressed-tensors", "ocp", "floor", "ceil", "even"]

SCALE_MODES: tuple[str, ...] = ("compressed-tensors", "ocp", "ceil", "even")
"""The shared-exponent rules, the default first (see [`quantize_mxfp4`])."""

_SCALE_MODE_ALIASES = {"floor": "ocp"}  # the OCP rule's name before compressed-tensors' became the default

_EXP_MIN = -E8M0_BIAS
_EXP_MAX = 254 - E8M0_BIAS

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


def _work_array(x: npt.ArrayLike, caller: str) -> np.ndarray:
    """Return `x` as float64 if it already is, else as float32 (exact for every narrower float)."""
    array = np.asarray(x)
    if array.dtype == np.float64:
        return array
    if array.dtype.kind in "fiu" or array.dtype in _ML_FLOAT_INPUTS:
        return array.astype(np.float32, copy=False)
    raise TypeError(f"{caller}: expected a real floating-point array, got dtype {array.dtype}")


def _check_quantize_input(x: np.ndarray, caller: str) -> int:
    require_ndim(x, "x")
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


def scaled_blocks(
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
