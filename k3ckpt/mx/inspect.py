"""What is inside MXFP4 weights (``k3ckpt mx inspect``); what quantizing to MXFP4 would cost is
:mod:`k3ckpt.mx.error`, and both reports read as text through :mod:`k3ckpt.mx.render`.

- :func:`inspect_mx` reads quantized tensors (K3 compressed-tensors pairs, gpt-oss stacked
  experts) row chunk by row chunk and reports, per tensor, statistics of the dequantized values,
  the histogram of the 16 E2M1 codes and of the E8M0 scale exponents, and *flags* for what looks
  broken. Memory is bounded by the chunk size whatever the selection (a whole K3 layer is
  ~16 GB of packed data).

Flags (a flagged tensor makes ``k3ckpt mx inspect`` exit 1):

- ``nan-scale``: at least one scale byte is 0xFF. E8M0 reserves it for NaN and the whole block of
  32 decodes to NaN, which no quantizer produces from finite weights: a corrupt byte.
- ``non-finite``: dequantized values are NaN (always together with ``nan-scale``) or +-Inf (scale
  bytes >= 253 times a large code leave the float32 range).
- ``zero-blocks``: a block of 32 whose codes are all 0 or 8 (+-0). Quantizing never makes one
  from a block with a non-zero weight above float32's subnormals (its largest element lands on
  +-3 or more in every scale mode), so such a block is data that was zeroed, a sparse hole, or a
  truncated write.
- ``exp-outlier``: a tensor's scale exponents are far from its siblings'. Tensors (for gpt-oss:
  each expert's slice of a stacked tensor) are grouped by (layer, projection) - gate, up and down
  have different fan-in and so different typical scales - and for each we take the mean and the
  max of its scale exponents (NaN bytes excluded). Within a group of at least
  :data:`OUTLIER_MIN_GROUP` members, a member is flagged when ``|x - median| / spread >``
  :data:`OUTLIER_Z` for either statistic, with ``spread = max(1.4826 * MAD, floor)``: 1.4826 * MAD
  estimates a standard deviation robustly (one bad expert cannot inflate it as it would the plain
  std), and the floor - :data:`MEAN_EXP_FLOOR` for the mean, :data:`MAX_EXP_FLOOR` for the integer
  max - keeps near-identical experts (MAD ~ 0) from flagging harmless differences. So a mean
  exponent must be more than 1.25 away from the group median (a factor ~2.4 in typical block
  magnitude) and a max exponent more than 5 away (a factor 32) before anything is flagged. The
  comparison is within the selection only: inspect a whole layer (``--layer N``) to check it.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..env import K3CKPT_MX_INSPECT_CHUNK_BYTES
from ..utils import format_percent
from .codec import (
    E2M1_VALUES,
    E8M0_BIAS,
    E8M0_NAN,
    MX_BLOCK_SIZE,
    dequantize_mxfp4,
    e2m1_code_histogram,
    scale_exponent_histogram,
)
from .select import MxSelectionError, MxSource, MxTensor, find_mx_tensors

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ExponentGroup",
    "Flag",
    "MxInspectReport",
    "TensorInspection",
    "inspect_mx",
    "inspect_tensor",
]

#: Packed bytes per chunk. A chunk becomes 4x its size in float32 values plus 8x in float64 while
#: its statistics are taken, so 1 MiB keeps a worker under ~30 MB while the per-chunk Python
#: overhead stays negligible (a K3 expert tensor is 5-6 chunks).
#: ``$K3CKPT_MX_INSPECT_CHUNK_BYTES``, read at call time, overrides it.
DEFAULT_CHUNK_BYTES = K3CKPT_MX_INSPECT_CHUNK_BYTES.default

#: Selections smaller than this are inspected in-process: forking workers costs more than it saves.
PARALLEL_MIN_BYTES = 64 << 20

#: Robust z-score above which a scale-exponent statistic is an outlier (see the module docstring).
OUTLIER_Z = 5.0
#: Smallest group (same layer and projection) in which outliers are looked for: with fewer
#: members the median and MAD say nothing.
OUTLIER_MIN_GROUP = 5
#: Floor of the spread of per-tensor *mean* exponents, in exponent units (powers of two).
MEAN_EXP_FLOOR = 0.25
#: Floor of the spread of per-tensor *max* exponents (integers, so one whole step).
MAX_EXP_FLOOR = 1.0
#: 1.4826 * MAD estimates the standard deviation of normally distributed data.
_MAD_TO_SIGMA = 1.4826

#: Scale bytes at or below this decode every code to a finite float32 (6 * 2**125 < 2**128);
#: a chunk whose scales all are needs no NaN/Inf masking.
_MAX_FINITE_SCALE = 252

#: Flag kinds, most severe first (the order --top ranks tensors by).
FLAG_KINDS = ("nan-scale", "non-finite", "exp-outlier", "zero-blocks")
FLAG_LETTERS = {"nan-scale": "N", "non-finite": "F", "exp-outlier": "E", "zero-blocks": "Z"}

#: Label of each E2M1 code (index = code), signed so +0 and -0 stay distinct.
CODE_LABELS = tuple(("-" if i >= 8 else "+") + f"{abs(float(v)):g}" for i, v in enumerate(E2M1_VALUES))

# Byte -> "both nibbles are +-0" (bit 3 of each nibble is the sign, so mask it off).
_ZERO_NIBBLES_MASK = np.uint64(0x7777777777777777)


# ---------------------------------------------------------------------------------------------
# Streaming statistics
# ---------------------------------------------------------------------------------------------


@dataclass
class _Moments:
    """Count, sum, min, max and M2 (sum of squared deviations) of finite values, merged chunk by
    chunk with Chan et al.'s pairwise update. Each chunk's M2 is taken around its own mean in
    float64 (two passes over data already in memory), so neither the order of chunks nor a
    mean far from zero costs precision the way ``sum(x**2)/n - mean**2`` would."""

    n: int = 0
    total: float = 0.0
    m2: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, x: np.ndarray) -> None:
        """Fold in a float32 array holding only finite values."""
        k = x.size
        if k == 0:
            return
        x64 = x.astype(np.float64).ravel()
        s = float(x64.sum())
        mean_b = s / k
        x64 -= mean_b
        m2_b = sum_squares(x64)
        if self.n:
            delta = mean_b - self.total / self.n
            self.m2 += m2_b + delta * delta * self.n * k / (self.n + k)
        else:
            self.m2 = m2_b
        self.n += k
        self.total += s
        self.lo = min(self.lo, float(x.min()))
        self.hi = max(self.hi, float(x.max()))

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    @property
    def std(self) -> float | None:
        """Population standard deviation (``ddof=0``, as ``np.std``)."""
        return math.sqrt(max(self.m2, 0.0) / self.n) if self.n else None


def sum_squares(x64: np.ndarray) -> float:
    """Sum of squares of a float64 vector, squaring in place: numpy's pairwise summation is
    more accurate than a BLAS dot product and, for vectors this size, not slower (some OpenBLAS
    builds spend milliseconds starting threads for a 256K-element dot)."""
    np.square(x64, out=x64)
    return float(x64.sum())


def _count_zero_blocks(packed: np.ndarray) -> int:
    """Blocks of 32 (16 packed bytes) whose 32 codes are all 0 or 8: two 8-byte words per block,
    sign bits masked off, both zero."""
    words = np.ascontiguousarray(packed).reshape(-1, 2 * 8).view(np.uint64) & _ZERO_NIBBLES_MASK
    return int(np.count_nonzero((words[:, 0] | words[:, 1]) == 0))


# ---------------------------------------------------------------------------------------------
# Report types
# ---------------------------------------------------------------------------------------------


@dataclass
class Flag:
    """Something suspicious about one tensor (for gpt-oss outliers: one expert's slice of it)."""

    kind: str  # one of FLAG_KINDS
    tensor: str  # the dequantized tensor's name
    message: str
    count: int | None = None
    fraction: float | None = None
    z: float | None = None  # the larger |robust z| of an exp-outlier
    expert: int | None = None

    def to_json(self) -> dict[str, Any]:
        d = {"kind": self.kind, "tensor": self.tensor, "message": self.message}
        for k in ("count", "fraction", "z", "expert"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d

    def __str__(self) -> str:
        return f"{self.tensor}: {self.kind}: {self.message}"


@dataclass
class UnitExponents:
    """Scale-exponent summary of one outlier-test unit: a tensor, or one expert of a stacked one."""

    expert: int | None
    mean: float | None  # over non-NaN scale bytes; None when every byte is 0xFF
    max: int | None
    z_mean: float | None = None
    z_max: float | None = None


@dataclass
class TensorInspection:
    """Everything :func:`inspect_mx` learned about one quantized tensor."""

    tensor: MxTensor
    expert_slice: int | None  # gpt-oss: the expert whose rows alone were read (--expert)
    numel: int
    blocks: int
    moments: _Moments
    zeros: int
    nan_count: int
    inf_count: int
    code_hist: np.ndarray  # int64 [16]
    scale_first: int  # the scale histogram, trimmed: counts of bytes scale_first, scale_first+1, ...
    scale_counts: np.ndarray  # int64; 0xFF (NaN) is counted in nan_scales instead
    nan_scales: int
    zero_blocks: int
    units: list[UnitExponents]
    flags: list[Flag] = field(default_factory=list)

    # -- identity --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        n = self.tensor.weight_name
        return f"{n}[{self.expert_slice}]" if self.expert_slice is not None else n

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor.shape[1:] if self.expert_slice is not None else self.tensor.shape

    @property
    def group(self) -> tuple[int | None, str | None]:
        """Outlier-test group: tensors of one layer and one projection are comparable."""
        return self.tensor.role.layer, self.tensor.role.proj

    # -- derived statistics ----------------------------------------------------------------

    @property
    def absmax(self) -> float | None:
        m = self.moments
        return max(abs(m.lo), abs(m.hi)) if m.n else None

    @property
    def zero_fraction(self) -> float:
        """Exact zeros (+0 and -0) among *all* values, NaN ones included in the denominator."""
        return self.zeros / self.numel if self.numel else 0.0

    @property
    def scale_hist(self) -> np.ndarray:
        """Count of each scale byte, int64 [256] (index 255 = NaN). Stored trimmed: exponents
        cluster within a few binades, and a whole-checkpoint run holds ~250k of these."""
        out = np.zeros(256, dtype=np.int64)
        self.add_scale_hist_to(out)
        return out

    def add_scale_hist_to(self, out: np.ndarray) -> None:
        out[self.scale_first:self.scale_first + self.scale_counts.size] += self.scale_counts
        out[E8M0_NAN] += self.nan_scales

    @property
    def exponent_mean(self) -> float | None:
        return _hist_exponent_mean(self.scale_hist)

    @property
    def exponent_range(self) -> tuple[int, int] | None:
        present = np.flatnonzero(self.scale_hist[:E8M0_NAN])
        return (int(present[0]) - E8M0_BIAS, int(present[-1]) - E8M0_BIAS) if present.size else None

    @property
    def severity(self) -> tuple[int, float]:
        """Sort key, most severe first: the worst flag kind, then its size."""
        if not self.flags:
            return (len(FLAG_KINDS), 0.0)
        rank = min(FLAG_KINDS.index(f.kind) for f in self.flags)
        size = max(f.z if f.z is not None else (f.fraction or 0.0)
                   for f in self.flags if FLAG_KINDS.index(f.kind) == rank)
        return (rank, -size)

    def to_json(self) -> dict[str, Any]:
        t = self.tensor
        m = self.moments
        rng = self.exponent_range
        d: dict[str, Any] = {
            "name": self.name,
            "format": "mxfp4",
            "layout": t.layout,
            "layer": t.role.layer,
            "expert": t.role.expert if self.expert_slice is None else self.expert_slice,
            "proj": t.role.proj,
            "stored": {
                "data": {"name": t.data_name, "dtype": "U8", "shape": list(t.data_shape)},
                "scales": {"name": t.scale_name, "dtype": "U8 (E8M0)", "shape": list(t.scale_shape)},
            },
            "shape": list(self.shape),
            "numel": self.numel,
            "blocks": self.blocks,
            "stats": {
                "min": m.lo if m.n else None,
                "max": m.hi if m.n else None,
                "mean": m.mean,
                "std": m.std,
                "absmax": self.absmax,
                "zero_fraction": self.zero_fraction,
                "finite_count": m.n,
                "nan_count": self.nan_count,
                "inf_count": self.inf_count,
            },
            "code_histogram": self.code_hist.tolist(),
            "scale_exponent_histogram": _sparse_exponent_hist(self.scale_hist),
            "scale_exponents": {
                "mean": self.exponent_mean,
                "min": rng[0] if rng else None,
                "max": rng[1] if rng else None,
                "nan_scales": self.nan_scales,
            },
            "zero_blocks": self.zero_blocks,
            "zero_block_fraction": self.zero_blocks / self.blocks if self.blocks else 0.0,
            "flags": [f.to_json() for f in self.flags],
        }
        if t.layout == "gpt-oss" and self.expert_slice is None:
            d["experts"] = [
                {"expert": u.expert, "exponent_mean": u.mean, "exponent_max": u.max, "z_mean": u.z_mean, "z_max": u.z_max}
                for u in self.units
            ]
        elif self.units:
            d["scale_exponents"].update(z_mean=self.units[0].z_mean, z_max=self.units[0].z_max)
        return d


@dataclass
class ExponentGroup:
    """The distribution the outlier test compares a group's members against."""

    layer: int | None
    proj: str | None
    members: int
    checked: bool
    median_mean: float | None = None
    mad_mean: float | None = None
    median_max: float | None = None
    mad_max: float | None = None

    @property
    def label(self) -> str:
        where = f"layer {self.layer}" if self.layer is not None else "no layer"
        return f"{where} {self.proj or '?'}"

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class MxInspectReport:
    """Result of :func:`inspect_mx`."""

    source: str
    selection: dict[str, Any]
    tensors: list[TensorInspection]
    groups: list[ExponentGroup]
    seconds: float
    bytes_read: int

    @property
    def flags(self) -> list[Flag]:
        return [f for t in self.tensors for f in t.flags]

    @property
    def flagged(self) -> list[TensorInspection]:
        """Flagged tensors, most severe first."""
        return sorted((t for t in self.tensors if t.flags), key=lambda t: t.severity)

    @property
    def code_hist(self) -> np.ndarray:
        out = np.zeros(16, dtype=np.int64)
        for t in self.tensors:
            out += t.code_hist
        return out

    @property
    def scale_hist(self) -> np.ndarray:
        out = np.zeros(256, dtype=np.int64)
        for t in self.tensors:
            t.add_scale_hist_to(out)
        return out

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        agg = self.scale_hist
        return {
            "source": self.source,
            "selection": self.selection,
            "tensors": [t.to_json() for t in self.tensors],
            "aggregate": {
                "tensors": len(self.tensors),
                "numel": self.numel,
                "code_histogram": self.code_hist.tolist(),
                "scale_exponent_histogram": _sparse_exponent_hist(agg),
                "exponent_mean": _hist_exponent_mean(agg),
                "nan_scales": int(agg[E8M0_NAN]),
            },
            "code_labels": list(CODE_LABELS),
            "exponent_groups": [g.to_json() for g in self.groups],
            "thresholds": {
                "outlier_z": OUTLIER_Z,
                "outlier_min_group": OUTLIER_MIN_GROUP,
                "mean_exponent_spread_floor": MEAN_EXP_FLOOR,
                "max_exponent_spread_floor": MAX_EXP_FLOOR,
            },
            "flags": [f.to_json() for f in self.flags],
            "flagged_tensors": len(self.flagged),
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3),
        }


def _hist_exponent_mean(scale_hist: np.ndarray) -> float | None:
    counts = scale_hist[:E8M0_NAN]
    n = int(counts.sum())
    if not n:
        return None
    return float(np.dot(counts, np.arange(E8M0_NAN, dtype=np.int64) - E8M0_BIAS)) / n


def _sparse_exponent_hist(scale_hist: np.ndarray) -> dict[str, int]:
    """``{"-5": count, ..., "nan": count}`` for the bytes that occur (JSON keys are strings)."""
    out = {str(int(b) - E8M0_BIAS): int(scale_hist[b]) for b in np.flatnonzero(scale_hist[:E8M0_NAN])}
    if scale_hist[E8M0_NAN]:
        out["nan"] = int(scale_hist[E8M0_NAN])
    return out


# ---------------------------------------------------------------------------------------------
# Inspecting
# ---------------------------------------------------------------------------------------------


def inspect_tensor(
    t: MxTensor,
    *,
    chunk_bytes: int | None = None,
    expert_slice: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> TensorInspection:
    """Statistics and histograms of one quantized tensor, read in row chunks.

    Args:
        t: the tensor (from :func:`~k3ckpt.mxsel.find_mx_tensors`).
        chunk_bytes: packed bytes read per chunk; results do not depend on it beyond float64
            rounding in the last digits of mean and std.
        expert_slice: for a gpt-oss stacked tensor, read only this expert's rows.
        progress: called with the bytes read after each chunk.
    """
    if chunk_bytes is None:
        chunk_bytes = K3CKPT_MX_INSPECT_CHUNK_BYTES.get()
    unit_rows = _unit_rows(t)
    if expert_slice is not None:
        n_exp = t.rows // unit_rows
        if not 0 <= expert_slice < n_exp:
            raise MxSelectionError(f"{t.weight_name}: has experts 0..{n_exp - 1}, not {expert_slice}")
        first, last = expert_slice * unit_rows, (expert_slice + 1) * unit_rows
    else:
        first, last = 0, t.rows
    n_units = max(1, (last - first) // unit_rows)
    moments = _Moments()
    zeros = nan_count = inf_count = zero_blocks = 0
    code_hist = np.zeros(16, dtype=np.int64)
    unit_hist = np.zeros(n_units * 256, dtype=np.int64)
    for start, packed, scales in _iter_rows(t, first, last, chunk_bytes):
        code_hist += e2m1_code_histogram(packed)
        zero_blocks += _count_zero_blocks(packed)
        if n_units == 1:
            unit_hist += scale_exponent_histogram(scales)
        else:
            # One 256-bin histogram per expert of a stack, as one bincount over (expert, byte).
            units = (np.arange(start, start + packed.shape[0]) - first) // unit_rows
            unit_hist += np.bincount((units[:, None] * 256 + scales).ravel(), minlength=n_units * 256)
        values = dequantize_mxfp4(packed, scales)
        if int(scales.max()) <= _MAX_FINITE_SCALE:
            finite = values
        else:
            # Only NaN scale bytes and the top three exponents can leave the finite range.
            nan = np.isnan(values)
            inf = np.isinf(values)
            nan_count += int(np.count_nonzero(nan))
            inf_count += int(np.count_nonzero(inf))
            finite = values[~(nan | inf)]
        moments.add(finite)
        zeros += int(np.count_nonzero(values == 0))
        if progress is not None:
            progress(packed.nbytes + scales.nbytes)
    unit_hists = unit_hist.reshape(n_units, 256)  # one row per unit
    units_out = []
    for i, h in enumerate(unit_hists):
        present = np.flatnonzero(h[:E8M0_NAN])
        expert = (i if t.layout == "gpt-oss" and expert_slice is None
                  else expert_slice if expert_slice is not None else t.role.expert)
        units_out.append(UnitExponents(expert, _hist_exponent_mean(h),
                                       int(present[-1]) - E8M0_BIAS if present.size else None))
    numel = (last - first) * t.row_elements
    scale_hist = unit_hists.sum(axis=0)
    present = np.flatnonzero(scale_hist[:E8M0_NAN])
    lo, hi = (int(present[0]), int(present[-1]) + 1) if present.size else (0, 0)
    return TensorInspection(
        tensor=t, expert_slice=expert_slice, numel=numel, blocks=numel // MX_BLOCK_SIZE, moments=moments,
        zeros=zeros, nan_count=nan_count, inf_count=inf_count, code_hist=code_hist,
        scale_first=lo, scale_counts=scale_hist[lo:hi].copy(), nan_scales=int(scale_hist[E8M0_NAN]),
        zero_blocks=zero_blocks, units=units_out,
    )


def _unit_rows(t: MxTensor) -> int:
    """Rows per outlier-test unit: one expert of a gpt-oss stack, else the whole tensor."""
    if t.layout == "gpt-oss" and len(t.shape) >= 3:
        return math.prod(t.shape[1:-1])
    return t.rows


def _iter_rows(t: MxTensor, first: int, last: int, chunk_bytes: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """:meth:`MxTensor.iter_rows` restricted to rows ``[first, last)``."""
    if first == 0 and last == t.rows:
        yield from t.iter_rows(chunk_bytes)
        return
    step = t.rows_per_chunk(chunk_bytes)
    for start in range(first, last, step):
        packed, scales = t.read_rows(start, min(last, start + step))
        yield start, packed, scales


def inspect_mx(
    path: str | os.PathLike[str],
    *,
    tensor: str | None = None,
    layer: int | None = None,
    expert: int | None = None,
    chunk_bytes: int | None = None,
    jobs: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> MxInspectReport:
    """Inspect the MXFP4 tensors of a checkpoint directory or one safetensors file.

    Args:
        path: a checkpoint directory or a single ``.safetensors`` file.
        tensor: one tensor, by its dequantized name (``...w1.weight``), base or a stored name.
        layer: only this layer's tensors.
        expert: only this expert's tensors. For gpt-oss stacked tensors (one tensor holds every
            expert of a layer) only that expert's rows are read.
        chunk_bytes: packed bytes per read; bounds memory (about 30x this per worker).
        jobs: worker processes when the selection holds at least :data:`PARALLEL_MIN_BYTES`
            [default: min(CPU count, 8)]; smaller selections are read in this process.
        progress: called with bytes read (per chunk in-process, per tensor from workers).
        on_plan: called once with the total bytes to read, before reading.

    Returns:
        The report; ``report.flags`` lists everything suspicious.

    Raises:
        MxSelectionError: nothing matches the selection or a pair is malformed.
        CheckpointNotFoundError, SafetensorsHeaderError: the path is not a checkpoint / file.
    """
    if chunk_bytes is None:  # read here, once: the workers get the number
        chunk_bytes = K3CKPT_MX_INSPECT_CHUNK_BYTES.get()
    t0 = time.perf_counter()
    source = MxSource.open(path)
    picked: list[tuple[MxTensor, int | None]]  # (tensor, expert slice of a stacked tensor or None)
    try:
        picked = [(t, None) for t in find_mx_tensors(source, tensor=tensor, layer=layer, expert=expert)]
    except MxSelectionError:
        # gpt-oss keeps all experts of a layer in one tensor: select it, then read one slice.
        if expert is None or tensor is not None:
            raise
        stacked = [t for t in _find_or_empty(source, layer) if t.layout == "gpt-oss" and t.role.expert is None]
        if not stacked:
            raise
        picked = [(t, expert) for t in stacked]
    sizes = [(t.packed_bytes + t.numel // MX_BLOCK_SIZE) // (1 if e is None else t.rows // _unit_rows(t))
             for t, e in picked]
    total = sum(sizes)
    if on_plan is not None:
        on_plan(total)
    workers = max(1, min(jobs or min(os.cpu_count() or 1, 8), len(picked)))
    if workers == 1 or total < PARALLEL_MIN_BYTES:
        results = [inspect_tensor(t, chunk_bytes=chunk_bytes, expert_slice=e, progress=progress) for t, e in picked]
    else:
        results = _inspect_in_processes(picked, sizes, chunk_bytes, workers, progress)
    groups = _flag_outliers(results)
    for r in results:
        r.flags[:0] = _local_flags(r)
        r.flags.sort(key=lambda f: FLAG_KINDS.index(f.kind))
    selection = {k: v for k, v in (("tensor", tensor), ("layer", layer), ("expert", expert)) if v is not None}
    return MxInspectReport(source=str(path), selection=selection, tensors=results, groups=groups,
                           seconds=time.perf_counter() - t0, bytes_read=total)


def _inspect_job(item: tuple[MxTensor, int | None, int]) -> TensorInspection:
    return inspect_tensor(item[0], expert_slice=item[1], chunk_bytes=item[2])


def _inspect_in_processes(picked: list[tuple[MxTensor, int | None]], sizes: list[int], chunk_bytes: int,
                          workers: int, progress: Callable[[int], None] | None) -> list[TensorInspection]:
    """Tensors spread over worker processes: the byte histograms (``np.bincount``) hold the GIL,
    so threads do not scale. Results are small (histograms and a few sums), so shipping them
    back costs nothing next to the reading; progress advances as each tensor comes back."""
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    results = []
    try:
        jobs = [(t, e, chunk_bytes) for t, e in picked]
        # Batches amortize the inter-process round trip over the small tensors of a big layer.
        batch = max(1, min(16, len(jobs) // (workers * 8)))
        for r, size in zip(pool.map(_inspect_job, jobs, chunksize=batch), sizes):
            results.append(r)
            if progress is not None:
                progress(size)
    finally:
        # On Ctrl-C or an error, do not start the remaining tensors.
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def _find_or_empty(source: MxSource, layer: int | None) -> list[MxTensor]:
    try:
        return find_mx_tensors(source, layer=layer)
    except MxSelectionError:
        return []


def _local_flags(r: TensorInspection) -> list[Flag]:
    """Flags that need only the tensor itself."""
    out = []
    if r.nan_scales:
        out.append(Flag("nan-scale", r.name, f"{r.nan_scales:,} NaN scale byte{'s' if r.nan_scales != 1 else ''} "
                        f"(0xFF): {r.nan_scales * MX_BLOCK_SIZE:,} values decode to NaN",
                        count=r.nan_scales, fraction=r.nan_scales / r.blocks))
    if r.nan_count or r.inf_count:
        out.append(Flag("non-finite", r.name, f"{r.nan_count:,} NaN and {r.inf_count:,} Inf dequantized values",
                        count=r.nan_count + r.inf_count, fraction=(r.nan_count + r.inf_count) / r.numel))
    if r.zero_blocks:
        frac = r.zero_blocks / r.blocks
        out.append(Flag("zero-blocks", r.name, f"{r.zero_blocks:,} all-zero block{'s' if r.zero_blocks != 1 else ''} "
                        f"of 32 ({format_percent(frac)} of {r.blocks:,})", count=r.zero_blocks, fraction=frac))
    return out


def _robust(values: np.ndarray) -> tuple[float, float]:
    med = float(np.median(values))
    return med, float(np.median(np.abs(values - med)))


def _flag_outliers(results: list[TensorInspection]) -> list[ExponentGroup]:
    """Group units by (layer, proj), compare each to its group, add exp-outlier flags."""
    members: dict[tuple[int | None, str | None], list[tuple[TensorInspection, UnitExponents]]] = {}
    for r in results:
        for u in r.units:
            members.setdefault(r.group, []).append((r, u))
    groups = []
    for (layer, proj), items in sorted(members.items(), key=lambda kv: (kv[0][0] if kv[0][0] is not None else -1, str(kv[0][1]))):
        valid = [(r, u) for r, u in items if u.mean is not None and u.max is not None]
        g = ExponentGroup(layer, proj, len(items), checked=len(valid) >= OUTLIER_MIN_GROUP)
        groups.append(g)
        if not valid:
            continue
        g.median_mean, g.mad_mean = _robust(np.array([u.mean for _, u in valid]))
        g.median_max, g.mad_max = _robust(np.array([u.max for _, u in valid], dtype=np.float64))
        if not g.checked:
            continue
        spread_mean = max(_MAD_TO_SIGMA * g.mad_mean, MEAN_EXP_FLOOR)
        spread_max = max(_MAD_TO_SIGMA * g.mad_max, MAX_EXP_FLOOR)
        for r, u in valid:
            assert u.mean is not None and u.max is not None  # valid keeps only units with both
            u.z_mean = (u.mean - g.median_mean) / spread_mean
            u.z_max = (u.max - g.median_max) / spread_max
            if abs(u.z_mean) <= OUTLIER_Z and abs(u.z_max) <= OUTLIER_Z:
                continue
            who = f"expert {u.expert}: " if r.tensor.layout == "gpt-oss" and r.expert_slice is None else ""
            # Kept short: with the tensor name and kind in front it must still fit 100 columns.
            msg = (f"{who}exp mean {u.mean:.2f} / max {u.max}; {g.label} median {g.median_mean:.2f} / "
                   f"{g.median_max:g}; z {u.z_mean:+.3g} / {u.z_max:+.3g} > {OUTLIER_Z:g}")
            r.flags.append(Flag("exp-outlier", r.name, msg, z=round(max(abs(u.z_mean), abs(u.z_max)), 3),
                                expert=u.expert))
    return groups
