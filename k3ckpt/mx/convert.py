"""Converting between MXFP4 and float safetensors files, streaming, with atomic output.

- :func:`dequantize_to_file`: the MXFP4 pairs of a checkpoint (or one file) -> one safetensors
  file of BF16/F16/F32 weights, each pair mapped to one tensor (``MxTensor.weight_name``, the
  logical shape; gpt-oss stacked experts stay ``[E, out, in]``).
- :func:`quantize_file`: a float safetensors file -> the K3 packed layout (compressed-tensors
  ``mxfp4-pack-quantized``): each eligible ``<base>.weight`` [out, in] becomes
  ``<base>.weight_packed`` [out, in/2] U8 + ``<base>.weight_scale`` [out, in/32] U8; every other
  tensor is copied through byte for byte.

Both compute the output header from shapes alone, then fill the data row chunk by row chunk with
``pread``/``pwrite``: memory is bounded by the chunk, never by a tensor or a layer (one real K3
MoE layer is 15.7 GB packed and 63 GB as fp32). The output is written to a temporary file next
to the destination, fsynced and renamed over it, so the final name never holds a partial file;
any failure (including Ctrl-C) removes the temporary file. Free disk space is checked first.

Ownership (the rule of :mod:`k3ckpt.utils.ownership`, applied to one file): each output says in
its header metadata which command wrote it (:data:`OWNER_KEY`, e.g. ``"k3ckpt.command": "mx
dequant"``), and an existing ``-o`` file is replaced only when it says so. A checkpoint shard, a
file another library wrote or a user's notes under that name are refused, before any byte.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..env import K3CKPT_MX_CHUNK_BYTES
from ..errors import K3ckptError, MxConvertError
from ..format.checkpoint import numpy_dtype
from ..format.header import (
    DTYPE_BITS,
    TensorInfo,
    TensorSpec,
    build_header,
    read_header,
)
from ..format.roles import Kind, classify
from ..utils import atomic_output, pwrite_all
from ..utils.ownership import refuse_foreign_file
from ..utils.space import free_bytes
from .codec import MX_BLOCK_SIZE, ScaleMode, dequantize_mxfp4, normalize_scale_mode, quantize_mxfp4
from .select import CHUNK_BYTES, MxSource, find_mx_tensors

__all__ = [
    "CHUNK_BYTES",
    "OWNER_KEY",
    "DEQUANT_DTYPES",
    "DequantResult",
    "MxConvertError",
    "QuantizeResult",
    "dequantize_to_file",
    "is_quantizable",
    "quantize_file",
    "render_dequant",
    "render_quantize",
]

#: ``--to`` choice -> (safetensors dtype, numpy dtype) of the dequantized output.
DEQUANT_DTYPES: dict[str, tuple[str, np.dtype]] = {
    "bf16": ("BF16", np.dtype(ml_dtypes.bfloat16)),
    "fp16": ("F16", np.dtype(np.float16)),
    "fp32": ("F32", np.dtype(np.float32)),
}

#: Float dtypes a weight may have to be quantized (wider ones would need a policy for F64).
QUANTIZABLE_DTYPES = ("BF16", "F16", "F32")

Progress = Callable[[int], None]

# The output's permission bits: the umask decides, as for any file the user creates.
_NEW_FILE_MODE = 0o666

#: The header metadata key naming the k3ckpt command that wrote a file (its ownership record):
#: only a file carrying one of :data:`_OWN_COMMANDS` is replaced by a conversion.
OWNER_KEY = "k3ckpt.command"
_DEQUANT_COMMAND = "mx dequant"
_QUANTIZE_COMMAND = "mx quantize"
_OWN_COMMANDS = frozenset({_DEQUANT_COMMAND, _QUANTIZE_COMMAND})


# -- results -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DequantResult:
    """What :func:`dequantize_to_file` wrote."""

    output: Path
    dtype: str  # safetensors dtype of every tensor written (BF16 / F16 / F32)
    tensors: tuple[str, ...]  # names written, in file order
    bytes_in: int  # MXFP4 bytes read (packed data + scales)
    bytes_out: int  # size of the output file
    seconds: float

    def to_json(self) -> dict:
        return {"output": str(self.output), "dtype": self.dtype, "tensors": len(self.tensors),
                "names": list(self.tensors), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class QuantizeResult:
    """What :func:`quantize_file` wrote."""

    output: Path
    scale_mode: str
    include_all: bool
    quantized: tuple[str, ...]  # input names (``<base>.weight``) replaced by a packed pair
    copied: int  # tensors copied through unchanged
    bytes_in: int  # size of the input file
    bytes_out: int  # size of the output file
    seconds: float

    def to_json(self) -> dict:
        return {"output": str(self.output), "scale_mode": self.scale_mode, "include_all": self.include_all,
                "tensors_quantized": len(self.quantized), "tensors_copied": self.copied,
                "quantized": list(self.quantized), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "seconds": round(self.seconds, 3)}


def render_dequant(res: DequantResult) -> str:
    """What ``k3ckpt mx dequant`` prints: what was written, in one line."""
    from ..utils import human_bytes

    to = next(k for k, (dtype, _) in DEQUANT_DTYPES.items() if dtype == res.dtype)  # the --to that made it
    return (f"wrote {res.output}: {len(res.tensors):,} tensors as {to}, {human_bytes(res.bytes_out)} "
            f"from {human_bytes(res.bytes_in)} of MXFP4, {res.seconds:.1f} s")


def render_quantize(res: QuantizeResult) -> str:
    """What ``k3ckpt mx quantize`` prints: what was quantized and copied, in one line."""
    from ..utils import human_bytes

    return (f"wrote {res.output}: {len(res.quantized):,} tensors quantized ({res.scale_mode}), "
            f"{res.copied:,} copied; {human_bytes(res.bytes_in)} -> {human_bytes(res.bytes_out)}, "
            f"{res.seconds:.1f} s")


# -- dequantize --------------------------------------------------------------------------------


def dequantize_to_file(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    to: str = "bf16",
    tensor: str | None = None,
    layer: int | None = None,
    expert: int | None = None,
    chunk_bytes: int | None = None,
    progress: Progress | None = None,
    on_plan: Progress | None = None,
) -> DequantResult:
    """Dequantize the selected MXFP4 tensors of ``path`` into one safetensors file ``out``.

    Each quantized pair becomes one tensor named ``MxTensor.weight_name`` with the logical shape
    (``[out, in]``; gpt-oss stacked ``[E, out, in]``), in the order :func:`find_mx_tensors`
    returns them. Values are exact (E2M1 x power of two) before the one cast to ``to``; a NaN
    scale byte (255) gives NaN for its block, as in :func:`dequantize_mxfp4`.

    Args:
        path: a checkpoint directory or a single safetensors file.
        out: the safetensors file to write; an existing one is replaced (atomically) only when
            an earlier conversion wrote it (:data:`OWNER_KEY`).
        to: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        tensor, layer, expert: the selection, as in :func:`find_mx_tensors` (all when ``None``).
        chunk_bytes: packed bytes read per step; the float output of a step is
            ``chunk_bytes * 2 * itemsize`` (64 MiB for fp32 at the 8 MiB default)
            [default: ``$K3CKPT_MX_CHUNK_BYTES``, else :data:`CHUNK_BYTES`].
        progress: called with the number of output bytes after each chunk is written.
        on_plan: called once with the total output data bytes, before anything is written.

    Raises:
        MxSelectionError: nothing matches the selection, or a pair is malformed.
        MxConvertError: not enough free disk space, or ``out`` is one of the inputs.
        OutputNotOwnedError: ``out`` exists and no conversion wrote it.
        ValueError: unknown ``to``.
        OSError: reading or writing failed (the temporary file is removed).
    """
    if to not in DEQUANT_DTYPES:
        raise ValueError(f"to must be one of {', '.join(DEQUANT_DTYPES)}, got {to!r}")
    st_dtype, np_dtype = DEQUANT_DTYPES[to]
    if chunk_bytes is None:
        chunk_bytes = K3CKPT_MX_CHUNK_BYTES.get()
    t0 = time.perf_counter()
    out_path = Path(out)
    selected = find_mx_tensors(MxSource.open(path), tensor=tensor, layer=layer, expert=expert)
    _refuse_overwriting_inputs(out_path, {p for m in selected for p in (m.data_path, m.scale_path)})

    # The whole header is known from shapes alone, so it is written first and every chunk then
    # goes straight to its final offset: nothing larger than one chunk is ever held.
    prefix, offsets = build_header([TensorSpec(m.weight_name, st_dtype, m.shape) for m in selected],
                                   {"format": "pt", OWNER_KEY: _DEQUANT_COMMAND})
    data_len = offsets[-1][1] if offsets else 0
    size = len(prefix) + data_len
    _check_free_space(out_path, size)
    if on_plan is not None:
        on_plan(data_len)

    bytes_in = 0
    with atomic_output(out_path, mode=_NEW_FILE_MODE, size=size) as fd:
        pwrite_all(fd, prefix, 0)
        for m, (begin, end) in zip(selected, offsets):
            pos = len(prefix) + begin
            for _, packed, scales in m.iter_rows(chunk_bytes):
                values = dequantize_mxfp4(packed, scales, dtype=np_dtype)
                pwrite_all(fd, values.reshape(-1).view(np.uint8), pos)
                pos += values.nbytes
                bytes_in += packed.nbytes + scales.nbytes
                if progress is not None:
                    progress(values.nbytes)
                # Drop this chunk before the next is read and decoded: otherwise two output
                # chunks are alive at once and the peak doubles.
                del values, packed, scales
            if pos != len(prefix) + end:  # a bug here would silently leave zeros in the file
                raise MxConvertError(f"{m.weight_name}: wrote {pos - len(prefix) - begin} of {end - begin} bytes")
    return DequantResult(out_path, st_dtype, tuple(m.weight_name for m in selected), bytes_in, size,
                         time.perf_counter() - t0)


# -- quantize ----------------------------------------------------------------------------------

# Kinds K3 (and --all) never quantize: 1-D or lookup tables, where 4 bits would cost accuracy
# for no memory that matters.
_NEVER_QUANTIZED = frozenset({Kind.NORM, Kind.EMBEDDING, Kind.LM_HEAD})
# Multi-token-prediction parts that are an embedding, a head or a norm rather than a linear layer.
_MTP_NOT_LINEAR = frozenset({"embed_tokens", "shared_head.head", "shared_head.norm", "enorm", "hnorm"})


def is_quantizable(name: str, dtype: str, shape: tuple[int, ...], include_all: bool = False) -> bool:
    """Whether :func:`quantize_file` turns tensor ``name`` into an MXFP4 pair.

    Always required: ``name`` ends in ``.weight``, ``dtype`` is BF16/F16/F32, the shape is
    2-D ``[out, in]`` with ``in`` a positive multiple of 32.

    By default only what K3 itself quantizes qualifies: routed-expert weights (K3 leaves norms,
    the router, embeddings, lm_head, attention, shared experts, the dense MLP, the latent
    projections and the vision tower in BF16). With ``include_all``, every such linear weight
    except norms, embeddings and LM heads.
    """
    if not name.endswith(".weight") or dtype not in QUANTIZABLE_DTYPES:
        return False
    if len(shape) != 2 or shape[1] <= 0 or shape[1] % MX_BLOCK_SIZE:
        return False
    role = classify(name)
    if not include_all:
        return role.kind == Kind.ROUTED_EXPERT and role.part == "weight"
    if role.kind in _NEVER_QUANTIZED or (role.kind == Kind.MTP and role.proj in _MTP_NOT_LINEAR):
        return False
    # Names no rule knows (other model families) are judged by their module name.
    module = name[: -len(".weight")].rsplit(".", 1)[-1].lower()
    return not ("norm" in module or "embed" in module or module in ("lm_head", "head", "wte", "wpe"))


@dataclass(frozen=True)
class _Planned:
    """One output tensor and where its bytes come from."""

    spec: TensorSpec
    source: TensorInfo
    role: str  # "copy", "packed" (written with its scales) or "scale"


def quantize_file(
    inp: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    scale_mode: ScaleMode = "compressed-tensors",
    include_all: bool = False,
    chunk_bytes: int | None = None,
    progress: Progress | None = None,
    on_plan: Progress | None = None,
) -> QuantizeResult:
    """Quantize the eligible weights of safetensors file ``inp`` to MXFP4 in the K3 layout.

    Eligible tensors (see :func:`is_quantizable`) ``<base>.weight`` [out, in] are written as
    ``<base>.weight_packed`` [out, in/2] U8 (low nibble first) and ``<base>.weight_scale``
    [out, in/32] U8 (E8M0), bit-identical to :func:`quantize_mxfp4` of the whole tensor. Every
    other tensor keeps its name, dtype, shape and bytes; the header metadata is kept too.
    Tensors are laid out widest dtype first (input order otherwise), so every tensor starts at a
    multiple of its element size whatever sizes the packed pairs have.

    Args:
        inp: the float safetensors file.
        out: the file to write; an existing one is replaced (atomically) only when an earlier
            conversion wrote it (:data:`OWNER_KEY`).
        scale_mode: ``"compressed-tensors"`` (K3's producer), ``"ocp"`` (alias ``"floor"``),
            ``"ceil"`` or ``"even"``; see :func:`quantize_mxfp4`.
        include_all: quantize every linear weight, not only routed experts.
        chunk_bytes: input bytes read per step [default: ``$K3CKPT_MX_CHUNK_BYTES``, else
            :data:`CHUNK_BYTES`].
        progress: called with the number of input bytes consumed after each step.
        on_plan: called once with the total input data bytes, before anything is written.

    Raises:
        SafetensorsHeaderError: ``inp`` is not a valid safetensors file.
        MxConvertError: a weight to quantize holds NaN/Inf (named, with its first position), an
            output name would collide with an input tensor, not enough free disk space, or
            ``out`` is ``inp``. No output or temporary file is left behind.
        OutputNotOwnedError: ``out`` exists and no conversion wrote it.
        ValueError: unknown ``scale_mode``.
        OSError: reading or writing failed.
    """
    _refuse_overwriting_inputs(Path(out), {Path(inp)})
    return _quantize_into(inp, out, scale_mode=scale_mode, include_all=include_all, chunk_bytes=chunk_bytes,
                          progress=progress, on_plan=on_plan)


def _quantize_into(inp: str | os.PathLike[str], out: str | os.PathLike[str], *, scale_mode: ScaleMode,
                   include_all: bool, chunk_bytes: int | None, progress: Progress | None,
                   on_plan: Progress | None) -> QuantizeResult:
    """:func:`quantize_file` without the check of an existing ``out``: for a caller that owns
    ``out`` already (a shard of a claimed ``mx quantize`` output directory)."""
    scale_mode = normalize_scale_mode(scale_mode)  # type: ignore[assignment]
    if chunk_bytes is None:
        chunk_bytes = K3CKPT_MX_CHUNK_BYTES.get()
    t0 = time.perf_counter()
    in_path, out_path = Path(inp), Path(out)
    header = read_header(in_path)

    plan: list[_Planned] = []
    quantized: list[str] = []
    for info in sorted(header.tensors.values(), key=lambda t: t.begin):
        if not is_quantizable(info.name, info.dtype, info.shape, include_all):
            plan.append(_Planned(TensorSpec(info.name, info.dtype, info.shape), info, "copy"))
            continue
        base, (rows, cols) = info.name[: -len(".weight")], info.shape
        for new in (base + ".weight_packed", base + ".weight_scale"):
            if new in header.tensors:
                raise MxConvertError(f"{in_path}: cannot quantize {info.name!r}: the file already has {new!r}")
        plan.append(_Planned(TensorSpec(base + ".weight_packed", "U8", (rows, cols // 2)), info, "packed"))
        plan.append(_Planned(TensorSpec(base + ".weight_scale", "U8", (rows, cols // MX_BLOCK_SIZE)), info, "scale"))
        quantized.append(info.name)
    # Stable sort, widest element first: offsets stay multiples of every element size.
    plan.sort(key=lambda p: -max(1, DTYPE_BITS[p.spec.dtype] // 8))

    prefix, offsets = build_header([p.spec for p in plan], {**(header.metadata or {}), OWNER_KEY: _QUANTIZE_COMMAND})
    size = len(prefix) + (offsets[-1][1] if offsets else 0)
    _check_free_space(out_path, size)
    if on_plan is not None:
        on_plan(header.data_len)
    where = {p.spec.name: len(prefix) + begin for p, (begin, _) in zip(plan, offsets)}

    with open(in_path, "rb", buffering=0) as src, atomic_output(out_path, mode=_NEW_FILE_MODE, size=size) as fd:
        pwrite_all(fd, prefix, 0)
        for p in plan:
            if p.role == "copy":
                _copy_range(src.fileno(), header.data_start + p.source.begin, fd, where[p.spec.name],
                            p.source.nbytes, chunk_bytes, progress)
            elif p.role == "packed":
                base = p.spec.name[: -len(".weight_packed")]
                _quantize_tensor(src.fileno(), header.data_start, p.source, fd, where[p.spec.name],
                                 where[base + ".weight_scale"], scale_mode, chunk_bytes, progress, in_path)
    return QuantizeResult(out_path, scale_mode, include_all, tuple(quantized), len(plan) - 2 * len(quantized),
                          header.file_size, size, time.perf_counter() - t0)


def _quantize_tensor(src: int, data_start: int, info: TensorInfo, dst: int, packed_at: int, scale_at: int,
                     scale_mode: ScaleMode, chunk_bytes: int, progress: Progress | None, in_path: Path) -> None:
    """Quantize ``info`` row chunk by row chunk into its two output regions."""
    rows, cols = info.shape
    dtype = numpy_dtype(info.dtype)
    row_bytes = cols * dtype.itemsize
    step = max(1, chunk_bytes // row_bytes)
    for first in range(0, rows, step):
        n = min(step, rows - first)
        raw = _pread_exact(src, n * row_bytes, data_start + info.begin + first * row_bytes, in_path)
        x = np.frombuffer(raw, dtype=dtype).reshape(n, cols)
        try:
            packed, scales = quantize_mxfp4(x, scale_mode)
        except ValueError:
            bad = ~np.isfinite(x.astype(np.float32))
            if not bad.any():
                raise
            r, c = (int(i) for i in np.argwhere(bad)[0])
            raise MxConvertError(
                f"{in_path}: tensor {info.name!r} holds NaN/Inf ({int(bad.sum())} in rows {first}-{first + n - 1}, "
                f"first at [{first + r}, {c}] = {x[r, c]}); MXFP4 cannot encode it, nothing written"
            ) from None
        pwrite_all(dst, packed.reshape(-1), packed_at + first * (cols // 2))
        pwrite_all(dst, scales.reshape(-1), scale_at + first * (cols // MX_BLOCK_SIZE))
        if progress is not None:
            progress(len(raw))


def _copy_range(src: int, src_at: int, dst: int, dst_at: int, nbytes: int, chunk_bytes: int,
                progress: Progress | None) -> None:
    step = max(1, chunk_bytes)
    for off in range(0, nbytes, step):
        n = min(step, nbytes - off)
        pwrite_all(dst, _pread_exact(src, n, src_at + off, None), dst_at + off)
        if progress is not None:
            progress(n)


# -- files -------------------------------------------------------------------------------------


def _pread_exact(fd: int, n: int, offset: int, path: Path | None) -> bytes:
    # pread may return less than asked (large requests, signals); only 0 bytes means EOF.
    parts, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            raise MxConvertError(f"{path or 'input'}: short read at offset {offset} ({got} of {n} bytes; truncated?)")
        parts.append(b)
        got += len(b)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _refuse_overwriting_inputs(out: Path, inputs: Iterable[Path]) -> None:
    """Renaming over a file still being read would replace a checkpoint shard with a conversion;
    renaming over any file no conversion wrote would replace something k3ckpt does not own."""
    if out.is_dir():
        raise MxConvertError(f"{out}: is a directory; pass the output file name")
    if not out.exists() and not out.is_symlink():
        return
    for p in inputs:
        with suppress(OSError):
            if os.path.samefile(out, p):
                raise MxConvertError(f"{out}: is an input of this conversion; write to another file")
    refuse_foreign_file(out, _is_own_output(out), "safetensors file")


def _is_own_output(path: Path) -> bool:
    """A regular safetensors file whose header says a conversion wrote it (:data:`OWNER_KEY`):
    the only kind a conversion replaces. A shard of a checkpoint, a file another library wrote
    and a user's notes under that name are refused."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        metadata = read_header(path).metadata or {}
    except (OSError, K3ckptError):
        return False
    return metadata.get(OWNER_KEY) in _OWN_COMMANDS


def _check_free_space(out: Path, needed: int) -> None:
    parent = out.absolute().parent
    if not parent.is_dir():
        raise MxConvertError(f"{parent}: no such directory")
    free = free_bytes(parent)
    if needed > free:
        from ..utils import human_bytes

        raise MxConvertError(f"{out}: not enough disk space: needs {human_bytes(needed)} ({needed:,} bytes), "
                             f"{human_bytes(free)} ({free:,} bytes) free in {parent}")
