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

Where it lives (every name is importable from here):

- ``_formats``: block size, the E8M0 byte and its decoding, the E2M1 grid, argument checks;
- ``_scales``: the scale modes and the shared-exponent front half of every quantizer;
- ``_packing``: nibble packing orders and code / scale-byte histograms;
- ``_mxfp4``: MXFP4 decoding (exact table path) and encoding;
- ``_mxfp8``: MXFP8 decoding and encoding.
"""

from ._formats import CHUNK_ELEMENTS as CHUNK_ELEMENTS
from ._formats import E2M1_MAX, E2M1_VALUES, E8M0_BIAS, E8M0_NAN, MX_BLOCK_SIZE, decode_e8m0
from ._formats import E8M0_SOURCE as E8M0_SOURCE
from ._mxfp4 import TABLE_CHUNK_BYTES as TABLE_CHUNK_BYTES
from ._mxfp4 import decode_table as decode_table
from ._mxfp4 import dequantize_mxfp4, dequantize_mxfp4_gptoss, quantize_mxfp4, round_to_e2m1_codes
from ._mxfp4 import dequantize_mxfp4_float as dequantize_mxfp4_float
from ._mxfp8 import FP8_SPECS as FP8_SPECS
from ._mxfp8 import Fp8Format as Fp8Format
from ._mxfp8 import dequantize_mxfp8, quantize_mxfp8
from ._packing import e2m1_code_histogram, pack_fp4, pack_fp4_gguf, scale_exponent_histogram, unpack_fp4, unpack_fp4_gguf
from ._scales import SCALE_MODES, normalize_scale_mode
from ._scales import ScaleMode as ScaleMode

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
