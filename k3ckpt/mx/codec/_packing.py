"""Codes in bytes: 4-bit E2M1 codes packed two per byte, in compressed-tensors / gpt-oss order
(low nibble first: :func:`pack_fp4`, :func:`unpack_fp4`) and in llama.cpp's split order
(:func:`pack_fp4_gguf`, :func:`unpack_fp4_gguf`), and the counts of codes and scale bytes
(:func:`e2m1_code_histogram`, :func:`scale_exponent_histogram`).
"""

from __future__ import annotations

import numpy as np

from ._formats import MX_BLOCK_SIZE, require_ndim, require_uint8

# Byte -> (low code, high code) as one 2-byte word, so unpacking is a single 2-byte gather per
# packed byte (the trick dequantizing plays with value pairs).
_BYTES = np.arange(256, dtype=np.uint8)
_BYTE_TO_CODE_PAIR_U16 = (
    np.ascontiguousarray(np.stack([_BYTES & 0x0F, _BYTES >> 4], axis=-1)).view(np.uint16).reshape(256)
)


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
    require_uint8(packed, "packed")
    require_ndim(packed, "packed")
    codes = _BYTE_TO_CODE_PAIR_U16[packed].view(np.uint8)
    return codes.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def _check_codes(codes: np.ndarray, multiple: int) -> np.ndarray:
    if codes.dtype.kind not in "iu":
        raise TypeError(f"codes must have an integer dtype, got {codes.dtype}")
    require_ndim(codes, "codes")
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
    require_uint8(packed, "packed")
    require_ndim(packed, "packed")
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
    require_uint8(packed, "packed")
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
    require_uint8(scales, "scales")
    return np.bincount(scales.ravel(), minlength=256).astype(np.int64)
