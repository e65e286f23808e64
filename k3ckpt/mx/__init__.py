"""OCP Microscaling (MXFP4) weights: the exact codec, finding the quantized tensors of a
checkpoint, inspecting their scales and codes, measuring round-trip error, and converting
files between MXFP4 and BF16/F16/F32.

Importing this package imports numpy.
"""

from .checkpoint import QuantizeCheckpointResult, quantize_checkpoint
from .codec import dequantize_mxfp4, quantize_mxfp4
from .convert import DequantResult, QuantizeResult, dequantize_to_file, quantize_file
from .error import QuantErrorReport, quantization_error
from .inspect import MxInspectReport, inspect_mx
from .render import render_error, render_inspect

__all__ = [
    "DequantResult",
    "MxInspectReport",
    "QuantErrorReport",
    "QuantizeCheckpointResult",
    "QuantizeResult",
    "dequantize_mxfp4",
    "dequantize_to_file",
    "inspect_mx",
    "quantization_error",
    "quantize_checkpoint",
    "quantize_file",
    "quantize_mxfp4",
    "render_error",
    "render_inspect",
]
