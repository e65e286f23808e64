"""Helpers the tests use to break a (copied) checkpoint in precise ways."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from k3ckpt.format.checkpoint import INDEX_NAME
from k3ckpt.format.header import TensorSpec, build_header, read_header


def tree_digests(root: Path) -> dict[str, str]:
    """sha256 of every checkpoint file under ``root``, by relative path (files in hidden metadata
    directories such as fetch's ``.cache/k3ckpt`` excluded, as the checkpoint model does)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not any(d.startswith(".") for d in p.relative_to(root).parts[:-1])}


def shard_tensors(path: Path) -> tuple[dict[str, str], list[list]]:
    """``(metadata, [[name, dtype, shape, bytes], ...])`` of a shard, in data order."""
    h = read_header(path)
    data = path.read_bytes()
    ts = [[n, t.dtype, tuple(t.shape), data[h.data_start + t.begin: h.data_start + t.end]]
          for n, t in sorted(h.tensors.items(), key=lambda kv: kv[1].begin)]
    return h.metadata, ts


def rewrite_shard(path: Path, mutate: Callable[[list[list]], list[list]]) -> None:
    """Rewrite a shard through the library's header writer, after ``mutate`` on its tensor list
    (so the result is a valid safetensors file)."""
    metadata, ts = shard_tensors(path)
    ts = mutate(ts)
    prefix, _ = build_header([TensorSpec(n, d, s) for n, d, s, _ in ts], metadata or None)
    path.write_bytes(prefix + b"".join(t[3] for t in ts))


def edit_index(root: Path, mutate: Callable[[dict[str, str]], None]) -> None:
    """Apply ``mutate`` to the checkpoint's ``weight_map``."""
    p = root / INDEX_NAME
    data = json.loads(p.read_text())
    mutate(data["weight_map"])
    p.write_text(json.dumps(data, indent=2))


def set_expert_groups(root: Path, groups: int | None) -> Path:
    """Give the checkpoint's config ``groups`` router expert groups (``n_group``, with
    ``topk_group`` equal, so routing is unchanged), or none (``None``: both keys dropped, as K3's
    config has them) - in its text section (``text_config`` when nested). vLLM honours
    round_robin placement only with several groups, so a round_robin node directory is written
    from a grouped config. Returns ``root``."""
    p = root / "config.json"
    config = json.loads(p.read_text())
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    for key in ("n_group", "topk_group"):
        text.pop(key, None)
        if groups is not None:
            text[key] = groups
    p.write_text(json.dumps(config, indent=2))
    return root


def drop_tensors(root: Path, names: set[str]) -> None:
    """Remove ``names`` (all in one shard) from that shard and from the index."""
    file = json.loads((root / INDEX_NAME).read_text())["weight_map"][next(iter(names))]
    rewrite_shard(root / file, lambda ts: [t for t in ts if t[0] not in names])
    edit_index(root, lambda wm: [wm.pop(n) for n in names])


def set_byte(path: Path, offset: int, value: int) -> None:
    b = bytearray(path.read_bytes())
    b[offset] = value
    path.write_bytes(bytes(b))


def flip_byte(path: Path, offset: int) -> None:
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x01
    path.write_bytes(bytes(b))
