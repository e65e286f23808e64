"""``k3ckpt mx quantize DIR -o OUT``: a float checkpoint directory -> a loadable MXFP4 one.

Every safetensors shard is quantized by :func:`k3ckpt.mx.convert.quantize_file` under its own
name (eligible weights become compressed-tensors ``weight_packed`` + ``weight_scale`` pairs, all
other tensors are carried over byte for byte), ``model.safetensors.index.json`` (when the input
has one) is rewritten for the new tensor names, every other file (tokenizer, licence, code, ...) is copied unchanged, and
``config.json`` gets the ``quantization_config`` that compressed-tensors (and the engines that
load through it: transformers, vLLM, SGLang) reads: format ``mxfp4-pack-quantized``, group size
32, 4-bit float weights with uint8 (E8M0) scales, targets ``Linear``, and an explicit ``ignore``
list naming every linear module that was left in high precision, so that what the config claims
is exactly what the shards hold. ``tests/data/mxfp4_golden.npz`` pins compressed-tensors' own
serialisation of that config (``scripts/make_mxfp4_golden.py --validate`` parses an output with
compressed-tensors itself).

The output directory follows k3ckpt's ownership rule (:func:`k3ckpt.utils.ownership.claim_output_dir`):
new, empty or an earlier ``mx quantize``'s, held under the output lock for the run. ``config.json``
is written last: a run cut short never leaves a directory whose config says it is quantized
next to shards that are not all there.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..env import K3CKPT_LOCK_STALE_SECONDS, K3CKPT_MX_CHUNK_BYTES
from ..errors import MxConvertError
from ..format.checkpoint import INDEX_NAME, SINGLE_NAME, is_working_file, iter_checkpoint_files, read_index
from ..format.header import read_header
from ..format.roles import Kind, classify
from ..utils import copy_files, is_within, load_json, write_atomic
from ..utils.lock import OUTPUT_LOCK_NAME, DirLock
from ..utils.ownership import claim_output_dir, locked_output_dir
from .codec import ScaleMode, normalize_scale_mode
from .convert import _quantize_into

__all__ = ["CONFIG_NAME", "OWNER_COMMAND", "QuantizeCheckpointResult", "compressed_tensors_config",
           "quantize_checkpoint", "render_quantize_checkpoint"]

CONFIG_NAME = "config.json"
#: The command named in the output's ownership record.
OWNER_COMMAND = "mx quantize"

# compressed-tensors' serialisation of its MXFP4 weight arguments (QuantizationArgs as
# `model_dump_json` writes them for the MXFP4A16 preset), checked against the golden file.
_CT_WEIGHTS: dict[str, Any] = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                               "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}
_CT_FORMAT = "mxfp4-pack-quantized"

Progress = Callable[[int], None]


@dataclass(frozen=True)
class QuantizeCheckpointResult:
    """What :func:`quantize_checkpoint` wrote."""

    output: Path
    scale_mode: str
    include_all: bool
    shards: tuple[str, ...]  # shard files written (relative paths)
    quantized: int  # weights replaced by a packed pair
    copied: int  # tensors carried over unchanged
    files: tuple[str, ...]  # other files copied (tokenizer, licence, ...)
    ignored: tuple[str, ...]  # linear modules left in high precision (the config's ignore list)
    bytes_in: int
    bytes_out: int
    seconds: float

    def to_json(self) -> dict:
        return {"output": str(self.output), "scale_mode": self.scale_mode, "include_all": self.include_all,
                "shards": list(self.shards), "tensors_quantized": self.quantized, "tensors_copied": self.copied,
                "files_copied": list(self.files), "ignored_modules": len(self.ignored),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "seconds": round(self.seconds, 3)}


def render_quantize_checkpoint(res: QuantizeCheckpointResult) -> str:
    """What ``k3ckpt mx quantize DIR -o OUT`` prints, in one line."""
    from ..utils import human_bytes

    shards, files = len(res.shards), len(res.files)
    return (f"wrote {res.output}: {shards:,} shard{'s' * (shards != 1)}, {res.quantized:,} tensors quantized "
            f"({res.scale_mode}), {res.copied:,} copied, {files:,} other file{'s' * (files != 1)}; config.json "
            f"quantization_config {_CT_FORMAT}; {human_bytes(res.bytes_in)} -> {human_bytes(res.bytes_out)}, "
            f"{res.seconds:.1f} s")


def compressed_tensors_config(ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of an MXFP4 checkpoint as compressed-tensors writes it:
    every ``Linear`` module quantized except the ``ignore`` ones (exact module names)."""
    return {
        "quant_method": "compressed-tensors",
        "format": _CT_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": _CT_FORMAT, "weights": dict(_CT_WEIGHTS)}},
        "ignore": list(ignore),
    }


def quantize_checkpoint(
    inp: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    scale_mode: ScaleMode = "compressed-tensors",
    include_all: bool = False,
    chunk_bytes: int | None = None,
    progress: Progress | None = None,
    on_plan: Progress | None = None,
) -> QuantizeCheckpointResult:
    """Quantize the float checkpoint directory ``inp`` into the MXFP4 checkpoint directory ``out``.

    Args:
        inp: a safetensors checkpoint directory with a ``config.json`` and BF16/F16/F32 weights.
        out: the directory to write: new, empty or an earlier ``mx quantize`` output.
        scale_mode, include_all, chunk_bytes: as in :func:`k3ckpt.mx.convert.quantize_file`.
        progress: called with the number of input bytes consumed (shards, then nothing else).
        on_plan: called once with the total input tensor bytes, before anything is written.

    Raises:
        MxConvertError: ``inp`` has no ``config.json`` or is already quantized (its config has a
            ``quantization_config``), ``out`` is inside ``inp`` or holds it, a weight holds
            NaN/Inf, or the disk is full.
        CheckpointNotFoundError, IndexFileError: ``inp`` is not a safetensors checkpoint.
        OutputNotOwnedError: ``out`` holds files k3ckpt did not write, or another command's output.
        OutputLockedError: another run is writing into ``out``.
    """
    t0 = time.perf_counter()
    scale_mode = normalize_scale_mode(scale_mode)  # type: ignore[assignment]
    root, outp = Path(inp), Path(out)
    config = _float_config(root)
    weight_map, _ = read_index(root)
    shards = sorted(set(weight_map.values())) if weight_map else [SINGLE_NAME]
    indexed = bool(weight_map)  # a single model.safetensors stays a single file, without an index
    if is_within(outp, root) or is_within(root, outp):
        raise MxConvertError(f"{outp}: the output must be a directory outside the input {root}", path=outp)
    skip = {*shards, INDEX_NAME, CONFIG_NAME}
    files = [rel for rel in iter_checkpoint_files(root) if rel not in skip and not is_working_file(rel)]
    headers = {s: read_header(root / s) for s in shards}
    if on_plan is not None:
        on_plan(sum(h.data_len for h in headers.values()))
    chunk = chunk_bytes if chunk_bytes is not None else K3CKPT_MX_CHUNK_BYTES.get()

    lock = DirLock(outp, OUTPUT_LOCK_NAME, command=OWNER_COMMAND, stale_seconds=K3CKPT_LOCK_STALE_SECONDS.get())
    # a failure leaves no directory it made (nothing here resumes: a re-run rewrites every file)
    with locked_output_dir(outp, lock, resumable=False):
        claim_output_dir(outp, OWNER_COMMAND, [*shards, *([INDEX_NAME] if indexed else []), CONFIG_NAME, *files])
        copy_files(root, files, outp)
        quantized: set[str] = set()
        copied = 0
        for s in shards:
            (outp / s).parent.mkdir(parents=True, exist_ok=True)
            # the directory is claimed: its shards are this command's to replace, whatever wrote them
            res = _quantize_into(root / s, outp / s, scale_mode=scale_mode, include_all=include_all,
                                 chunk_bytes=chunk, progress=progress, on_plan=None)
            quantized.update(res.quantized)
            copied += res.copied
        if indexed:
            _write_index(outp, shards)
        ignored = _left_in_high_precision(headers, quantized)
        config["quantization_config"] = compressed_tensors_config(ignored)
        write_atomic(outp / CONFIG_NAME, (json.dumps(config, indent=2) + "\n").encode())
    return QuantizeCheckpointResult(
        outp, scale_mode, include_all, tuple(shards), len(quantized), copied, tuple(files), tuple(ignored),
        sum((root / s).stat().st_size for s in shards), sum((outp / s).stat().st_size for s in shards),
        time.perf_counter() - t0)


def _write_index(outp: Path, shards: list[str]) -> None:
    """``model.safetensors.index.json`` for the shards as written (the tensor names changed)."""
    weight_map: dict[str, str] = {}
    total = 0
    for s in shards:
        header = read_header(outp / s)
        weight_map.update(dict.fromkeys(header.tensors, s))
        total += header.data_len
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(outp / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())


def _float_config(root: Path) -> dict[str, Any]:
    """``root``'s config.json, which must describe float weights: quantizing a quantized
    checkpoint would stack a second quantization_config on top of the first."""
    path = root / CONFIG_NAME
    if not root.is_dir():
        raise MxConvertError(f"{root}: not a directory", path=root)
    if not path.is_file():
        raise MxConvertError(f"{path}: not found; a checkpoint directory needs its config.json "
                             "(quantize a single file with -o FILE.safetensors)", path=path)
    config, _ = load_json(path, MxConvertError)
    if not isinstance(config, dict):
        raise MxConvertError(f"{path}: not a JSON object", path=path)
    existing = config.get("quantization_config")
    if existing is not None:
        what = existing.get("format") or existing.get("quant_method") if isinstance(existing, dict) else existing
        raise MxConvertError(f"{path}: already has a quantization_config ({what}); mx quantize needs a "
                             "float (BF16/F16/F32) checkpoint", path=path)
    return config


_NOT_LINEAR = frozenset({Kind.NORM, Kind.EMBEDDING})


def _left_in_high_precision(headers: dict[str, Any], quantized: set[str]) -> list[str]:
    """The module names of the 2-D weights that were not quantized and may be ``Linear``
    modules (norms and embeddings are not): compressed-tensors must skip exactly these."""
    names = []
    for header in headers.values():
        for name, info in header.tensors.items():
            if not name.endswith(".weight") or len(info.shape) != 2 or name in quantized:
                continue
            module = name[: -len(".weight")]
            if classify(name).kind in _NOT_LINEAR or "embed" in module.rsplit(".", 1)[-1].lower():
                continue
            names.append(module)
    return sorted(names)
