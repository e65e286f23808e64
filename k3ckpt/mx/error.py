"""What quantizing floating-point weights to MXFP4 would cost: :func:`quantization_error` runs
BF16/F16/F32/F64 tensors through :func:`~k3ckpt.mx.codec.quantize_mxfp4` and
:func:`~k3ckpt.mx.codec.dequantize_mxfp4` row chunk by row chunk and reports the round-trip
error per tensor (``k3ckpt mx error``)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import MxInspectError
from ..format.header import ShardHeader, TensorInfo, read_header
from ..format.roles import Kind, classify
from .codec import (
    E2M1_MAX,
    MX_BLOCK_SIZE,
    ScaleMode,
    decode_e8m0,
    dequantize_mxfp4,
    normalize_scale_mode,
    quantize_mxfp4,
)
from .inspect import sum_squares

__all__ = ["ERROR_CHUNK_BYTES", "SKIPPED_KINDS", "ErrorRow", "QuantErrorReport", "quantization_error"]

# ---------------------------------------------------------------------------------------------
# Quantization error of float weights
# ---------------------------------------------------------------------------------------------

#: Roles K3 keeps in high precision: only routed experts are MXFP4 in the released checkpoint.
#: Everything else that is a plain linear weight (dense MLP, latent projections, unknown names in
#: a user's file) is measured, since a user may well want to know what MXFP4 would do to it.
SKIPPED_KINDS = frozenset({
    Kind.NORM, Kind.ROUTER, Kind.ROUTER_BIAS, Kind.EMBEDDING, Kind.LM_HEAD, Kind.ATTENTION,
    Kind.SHARED_EXPERT, Kind.VISION, Kind.PROJECTOR, Kind.RESIDUAL,
})
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
#: Bytes of float input read per chunk.
ERROR_CHUNK_BYTES = 4 << 20


@dataclass
class ErrorRow:
    """Round-trip MXFP4 error of one float tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: str  # the Kind of the tensor
    values: int  # values measured (excludes blocks holding NaN/Inf, which MXFP4 cannot encode)
    rms: float  # of the input
    rms_error: float
    relative_rms_error: float  # rms_error / rms (0 when the tensor is all zeros)
    max_abs_error: float
    saturated: int  # values clipped to +-6 * scale (|x| above the largest representable)
    nonfinite: int  # NaN/Inf input values
    sum_squares: float = field(default=0.0, repr=False)
    sum_error_squares: float = field(default=0.0, repr=False)

    @property
    def saturated_fraction(self) -> float:
        return self.saturated / self.values if self.values else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "role": self.role,
            "values": self.values, "rms": self.rms, "rms_error": self.rms_error,
            "relative_rms_error": self.relative_rms_error, "max_abs_error": self.max_abs_error,
            "saturated": self.saturated, "saturated_fraction": self.saturated_fraction,
            "nonfinite": self.nonfinite,
        }


@dataclass
class QuantErrorReport:
    """Result of :func:`quantization_error`: one row per measured tensor, and what was skipped."""

    path: str
    scale_mode: str
    rows: list[ErrorRow]
    skipped: list[tuple[str, str]]  # (name, reason)
    seconds: float

    @property
    def values(self) -> int:
        return sum(r.values for r in self.rows)

    @property
    def relative_rms_error(self) -> float:
        """Over all measured values together (each tensor weighted by its energy)."""
        den = sum(r.sum_squares for r in self.rows)
        return math.sqrt(sum(r.sum_error_squares for r in self.rows) / den) if den else 0.0

    @property
    def max_abs_error(self) -> float:
        return max((r.max_abs_error for r in self.rows), default=0.0)

    @property
    def saturated_fraction(self) -> float:
        return sum(r.saturated for r in self.rows) / self.values if self.values else 0.0

    @property
    def nonfinite(self) -> int:
        return sum(r.nonfinite for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.path,
            "scale_mode": self.scale_mode,
            "tensors": [r.to_json() for r in self.rows],
            "totals": {
                "tensors": len(self.rows), "values": self.values,
                "relative_rms_error": self.relative_rms_error, "max_abs_error": self.max_abs_error,
                "saturated": sum(r.saturated for r in self.rows), "saturated_fraction": self.saturated_fraction,
                "nonfinite": self.nonfinite,
            },
            "skipped": [{"name": n, "reason": why} for n, why in self.skipped],
            "seconds": round(self.seconds, 3),
        }


def _eligibility(info: TensorInfo) -> str | None:
    """Why a tensor cannot be quantized to MXFP4 at all (None: it can)."""
    if info.dtype not in _FLOAT_DTYPES:
        return f"dtype {info.dtype} is not BF16/F16/F32/F64"
    if len(info.shape) != 2:
        return f"shape {list(info.shape)} is not 2-D"
    if info.shape[1] % MX_BLOCK_SIZE:
        return f"in = {info.shape[1]} is not a multiple of {MX_BLOCK_SIZE}"
    return None


def quantization_error(
    path: str | os.PathLike[str],
    *,
    scale_mode: ScaleMode = "compressed-tensors",
    tensor: str | None = None,
    include_all: bool = False,
    chunk_bytes: int = ERROR_CHUNK_BYTES,
) -> QuantErrorReport:
    """Round-trip MXFP4 error of the float linear weights in one safetensors file.

    Each tensor is read in row chunks (header offsets + ``os.pread``), quantized with
    :func:`~k3ckpt.mxfp4.quantize_mxfp4` and dequantized back; errors are accumulated in float64.

    Args:
        path: a ``.safetensors`` file.
        scale_mode: ``"compressed-tensors"`` (what made K3's experts), ``"ocp"`` (alias
            ``"floor"``), ``"ceil"`` or ``"even"``; see :func:`quantize_mxfp4`.
        tensor: measure only this tensor (whatever its role).
        include_all: also measure tensors whose role K3 keeps in high precision
            (:data:`SKIPPED_KINDS`).
        chunk_bytes: input bytes per read.

    Raises:
        SafetensorsHeaderError: the file is missing or not safetensors.
        MxInspectError: ``tensor`` is missing or not quantizable, or no tensor qualifies.
        ValueError: unknown ``scale_mode``.
    """
    scale_mode = normalize_scale_mode(scale_mode)  # type: ignore[assignment]
    t0 = time.perf_counter()
    header = read_header(path)
    rows: list[ErrorRow] = []
    skipped: list[tuple[str, str]] = []
    if tensor is not None:
        info = header.tensors.get(tensor)
        if info is None:
            raise MxInspectError(f"{path}: no tensor named {tensor!r}")
        why = _eligibility(info)
        if why:
            raise MxInspectError(f"{path}: {tensor}: cannot be quantized to MXFP4: {why}")
        candidates = [info]
    else:
        candidates = []
        for info in sorted(header.tensors.values(), key=lambda i: i.name):
            why = _eligibility(info)
            kind = classify(info.name).kind
            if why is None and not include_all and kind in SKIPPED_KINDS:
                why = f"role {kind}: K3 keeps it in high precision (--all includes it)"
            if why:
                skipped.append((info.name, why))
            else:
                candidates.append(info)
    for info in candidates:
        rows.append(_measure(header, info, scale_mode, chunk_bytes))
    if not rows:
        raise MxInspectError(f"{path}: no tensor to quantize ({len(skipped)} skipped: none is a 2-D float "
                             f"weight with in % 32 == 0 outside the roles K3 keeps in high precision; try --all)")
    return QuantErrorReport(str(path), scale_mode, rows, skipped, time.perf_counter() - t0)


def _measure(header: ShardHeader, info: TensorInfo, scale_mode: ScaleMode, chunk_bytes: int) -> ErrorRow:
    from ..format.checkpoint import numpy_dtype

    dtype = numpy_dtype(info.dtype)
    out_rows, width = info.shape
    groups = width // MX_BLOCK_SIZE
    row_bytes = width * dtype.itemsize
    step = max(1, chunk_bytes // max(1, row_bytes))
    values = saturated = nonfinite = 0
    sum_sq = err_sq = max_err = 0.0
    fd = os.open(header.path, os.O_RDONLY)
    try:
        for start in range(0, out_rows, step):
            n = min(out_rows, start + step) - start
            want = n * row_bytes
            raw = os.pread(fd, want, header.data_start + info.begin + start * row_bytes)
            if len(raw) != want:
                raise MxInspectError(f"{header.path}: {info.name}: short read ({len(raw)} of {want} bytes; truncated?)")
            x = np.frombuffer(raw, dtype=dtype).reshape(n, width)
            # quantize_mxfp4 works in float32 (float64 for F64); widening bf16/f16 is exact.
            x = x.astype(np.float64 if dtype == np.float64 else np.float32)
            blocks = x.reshape(n, groups, MX_BLOCK_SIZE)
            finite = np.isfinite(x)
            if not finite.all():
                # MXFP4 cannot encode NaN/Inf: count them, and measure the other blocks only.
                nonfinite += int(np.count_nonzero(~finite))
                bad = ~finite.reshape(n, groups, MX_BLOCK_SIZE).all(axis=-1)
                blocks = blocks.copy()
                blocks[bad] = 0.0
                x = blocks.reshape(n, width)
                values -= int(np.count_nonzero(bad)) * MX_BLOCK_SIZE
            packed, scales = quantize_mxfp4(x, scale_mode=scale_mode)
            q = dequantize_mxfp4(packed, scales, dtype=np.float64)
            x64 = x.astype(np.float64).ravel()
            err = q.ravel() - x64
            values += x.size
            max_err = max(max_err, float(np.abs(err).max()))
            sum_sq += sum_squares(x64)
            err_sq += sum_squares(err)
            limit = E2M1_MAX * decode_e8m0(scales).astype(np.float64)
            saturated += int(np.count_nonzero(np.abs(blocks) > limit[..., None]))
    finally:
        os.close(fd)
    rms = math.sqrt(sum_sq / values) if values else 0.0
    rms_err = math.sqrt(err_sq / values) if values else 0.0
    return ErrorRow(
        name=info.name, dtype=info.dtype, shape=tuple(info.shape), role=classify(info.name).kind,
        values=values, rms=rms, rms_error=rms_err, relative_rms_error=math.sqrt(err_sq / sum_sq) if sum_sq else 0.0,
        max_abs_error=max_err, saturated=saturated, nonfinite=nonfinite, sum_squares=sum_sq, sum_error_squares=err_sq,
    )
