"""Fuzz targets for everything k3ckpt parses from untrusted sources, shared by the test suite
(``tests/test_fuzz.py``, bounded hypothesis runs) and the long campaign (``scripts/campaign.py
--fuzz-seconds N``, hypothesis or atheris).

Each target takes bytes and checks the one property that matters for hostile input: the reader
either accepts the input or raises *its own* typed error (one line, naming the file), never
another exception (a traceback for the user), never a hang or a huge allocation. The readers:

- the safetensors header parser (the bytes after the 8-byte length prefix), and the file
  reader with its length prefix;
- manifests (``Manifest.loads``);
- ``model.safetensors.index.json`` (``read_index``, which also refuses paths leaving the
  checkpoint);
- ``config.json`` (``load_config``).

Seeds are valid documents of each kind; :func:`mutate_json` replaces one leaf or container of a
seed with an arbitrary JSON value, which reaches far deeper than random bytes do.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, ConfigError, IndexFileError, SafetensorsHeaderError
from ..format.checkpoint import read_index
from ..format.config import load_config
from ..format.header import parse_header_columns, read_header_columns
from ..integrity.manifest import Manifest, ManifestError

__all__ = ["SEEDS", "TARGETS", "mutate_json", "paths_of"]

#: Inputs larger than this are cut: the readers' own size limits are tested elsewhere, and the
#: fuzzer's time is better spent on structure.
MAX_INPUT = 1 << 16

_HEADER_SEED = {
    "__metadata__": {"format": "pt"},
    "a.weight_packed": {"dtype": "U8", "shape": [2, 16], "data_offsets": [0, 32]},
    "a.weight_scale": {"dtype": "U8", "shape": [2, 1], "data_offsets": [32, 34]},
    "b": {"dtype": "BF16", "shape": [3], "data_offsets": [34, 40]},
}
_HEADER_DATA = 40

_MANIFEST_SEED = {
    "files": {
        "config.json": {"sha256": "a" * 64, "size": 10},
        "model-00001-of-000001.safetensors": {"data_start": 8, "sha256": "b" * 64, "size": 100},
    },
    "format": "k3ckpt-manifest",
    "source": {"hub": "hf", "repo": "moonshotai/Kimi-K3", "revision": "c" * 40},
    "tensor_hashes": True,
    "tensors": {"x": {"dtype": "BF16", "file": "model-00001-of-000001.safetensors", "offsets": [8, 40],
                      "sha256": "d" * 64, "shape": [4, 4]}},
    "version": 1,
}

_INDEX_SEED = {"metadata": {"total_size": 40},
               "weight_map": {"a": "model-00001-of-000002.safetensors", "b": "sub/model-00002-of-000002.safetensors"}}

_CONFIG_SEED = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": {
        "model_type": "kimi_linear", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 128,
        "num_attention_heads": 4, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 16,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4]},
    },
    "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
    "vision_config": {"hidden_size": 32},
}

#: Target name -> valid seed document (JSON-serializable).
SEEDS: dict[str, Any] = {
    "header": _HEADER_SEED,
    "manifest": _MANIFEST_SEED,
    "index": _INDEX_SEED,
    "config": _CONFIG_SEED,
}


def _header(raw: bytes) -> None:
    try:
        parse_header_columns(raw, file="f.safetensors", path="f.safetensors", file_size=8 + len(raw) + _HEADER_DATA)
    except SafetensorsHeaderError:
        pass


def _header_file(raw: bytes) -> None:
    """The whole file path: a length prefix taken from the input, then the rest as header+data."""
    prefix = raw[:8].ljust(8, b"\0")
    with tempfile.TemporaryDirectory(prefix="k3ckpt-fuzz-") as d:
        p = Path(d) / "model.safetensors"
        p.write_bytes(prefix + raw[8:])
        try:
            read_header_columns(p)
        except SafetensorsHeaderError:
            pass


def _manifest(raw: bytes) -> None:
    try:
        Manifest.loads(raw, "m.json")
    except ManifestError:
        pass


def _index(raw: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="k3ckpt-fuzz-") as d:
        (Path(d) / "model.safetensors.index.json").write_bytes(raw)
        try:
            wm, _ = read_index(Path(d))
        except (IndexFileError, CheckpointNotFoundError):
            return
        for f in wm.values():  # whatever it accepted stays inside the checkpoint
            resolved = os.path.normpath(os.path.join(d, f))
            assert resolved.startswith(d + os.sep), f"index path {f!r} escapes the checkpoint"


def _config(raw: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="k3ckpt-fuzz-") as d:
        p = Path(d) / "config.json"
        p.write_bytes(raw)
        try:
            load_config(p)
        except ConfigError:
            pass


#: Target name -> function of the input bytes; raises only on a bug.
TARGETS: dict[str, Callable[[bytes], None]] = {
    "header": _header,
    "header_file": _header_file,
    "manifest": _manifest,
    "index": _index,
    "config": _config,
}


def paths_of(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys / indices) into a JSON document, the root included."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths_of(v, (*prefix, i))
    return out


def mutate_json(doc: Any, path: tuple[Any, ...], value: Any, *, delete: bool = False) -> Any:
    """A copy of ``doc`` with the node at ``path`` replaced by ``value`` (or deleted)."""
    if not path:
        return value
    out = json.loads(json.dumps(doc))
    node = out
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def encode(doc: Any) -> bytes:
    """A document as the bytes a reader sees (non-finite floats as the JSON extensions
    ``NaN``/``Infinity``, which Python's parser accepts and real files may contain)."""
    return json.dumps(doc).encode()


def header_bytes_from_file(raw: bytes) -> bytes:
    """Prefix header-shaped bytes with their real length (for :func:`_header_file` seeds)."""
    return struct.pack("<Q", len(raw)) + raw + bytes(_HEADER_DATA)
