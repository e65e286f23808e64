"""What the ``k3ckpt`` load format checks inside an engine, in pure Python (no torch, no vLLM):
the topology guard (:func:`check_topology`: the engine's parallel state against the node
directory's marker) and the digests of the bytes each rank reads (:class:`TensorDigests`).

The engine adapter (:mod:`k3ckpt.engine.vllm`) asks the engine for its state - EP on or off,
ep size and rank, and the experts the built model holds on this rank - and passes it here;
nothing here re-derives the engine's expert placement.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..deploy.serve import serve_command
from ..errors import EngineTopologyError, K3ckptError, ManifestError, TensorDigestError
from ..format.layout import read_node_marker
from ..integrity.manifest import Manifest

#: ``model_loader_extra_config`` key naming a tensor-hash manifest (``k3ckpt manifest --tensor-hashes``).
MANIFEST_KEY = "manifest"
#: The index vLLM reads the weight map from (which file holds which tensor).
INDEX_FILE = "model.safetensors.index.json"


def check_topology(
    root: str | os.PathLike[str],
    *,
    expert_parallel: bool,
    ep_size: int,
    ep_rank: int,
    tp_size: int,
    dp_size: int,
    local_experts: Iterable[int] | None,
) -> None:
    """Refuse a launch the node directory ``root`` was not written for; accept a plain checkpoint.

    ``local_experts``: the global expert ids the engine placed on this rank (from the built model),
    None for a model without experts.

    Raises:
        EngineTopologyError: one line: EP off on a directory with only some experts, an ep size
            other than the marker topology's world size, or engine-given experts this directory
            does not hold (another placement, another node's directory); it ends with the
            launch that fits.
        LayoutError: the marker is unreadable.
    """
    marker = read_node_marker(root)
    if marker is None or local_experts is None:
        return
    held = set(marker["experts"])
    topo = marker.get("topology") or {}
    total = int(topo.get("num_experts") or len(held))
    world = int(topo.get("world_size") or 1)
    where = f"{root}: node {marker.get('node', 0)} of a {world}-rank expert-parallel topology holds experts " \
            f"{spans(held)} of {total}"
    state = f"(engine: tp {tp_size} x dp {dp_size}, ep size {ep_size})"
    if not expert_parallel:
        if held != set(range(total)):
            _refuse(root, marker, f"{where}, but the engine runs without expert parallelism {state}")
        return
    if world > 1 and ep_size != world:
        _refuse(root, marker, f"{where}; the engine's ep size is {ep_size}, not {world} {state}")
    mine = set(local_experts)
    if not mine <= held:
        _refuse(root, marker, f"{where}; the engine gives ep rank {ep_rank} experts {spans(mine)} "
                              f"(wrong placement or another node's directory) {state}")


def fitting_launch(root: str | os.PathLike[str], marker: Mapping[str, Any]) -> str | None:
    """The serve line for the topology the marker was written for (``preflight``'s), or None
    when the marker does not say enough to build one."""
    topo = marker.get("topology") or {}
    try:
        tp = int(topo["tp"])
        world = int(topo["world_size"])
        argv = serve_command(root, tp=tp, dp=max(1, world // tp), placement=str(topo.get("expert_placement", "linear")),
                             node=int(marker.get("node", 0)), gpus_per_node=marker.get("gpus_per_node"), guard=True)
    except (KeyError, TypeError, ValueError, K3ckptError):
        return None
    return shlex.join(argv)


def _refuse(root: str | os.PathLike[str], marker: Mapping[str, Any], what: str) -> None:
    launch = fitting_launch(root, marker)
    raise EngineTopologyError(what + (f"; serve it with: {launch}" if launch else ""), path=str(root))


def spans(ids: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 7}`` -> ``"0-3,7"``: expert ids the way one reads them."""
    out: list[str] = []
    for i in sorted(set(ids)):
        if out and out[-1].rpartition("-")[2] == str(i - 1):
            out[-1] = f"{out[-1].partition('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out) or "none"


@dataclass
class TensorDigests:
    """The expected sha256 of each tensor (name -> (file, hex digest)) and what the engine yielded.

    :meth:`update` hashes each tensor's bytes once, as the engine's iterator passes them;
    :meth:`finish` refuses the first mismatch and any expected tensor that never came.
    """

    expected: dict[str, tuple[str, str]]
    source: str
    seen: set[str] = field(default_factory=set)
    bad: list[str] = field(default_factory=list)

    @classmethod
    def for_directory(cls, root: str | os.PathLike[str], extra: Mapping[str, Any] | None = None) -> TensorDigests | None:
        """The digests of ``root``: from ``extra[MANIFEST_KEY]`` (a tensor-hash manifest) when
        given, else from the node marker's tensors; None when neither has any.

        Raises:
            ManifestError: the manifest is unreadable or has no tensor digests.
            LayoutError: the marker is unreadable.
        """
        manifest = (extra or {}).get(MANIFEST_KEY)
        if manifest:
            return cls.from_manifest(root, manifest)
        marker = read_node_marker(root)
        if marker is None:
            return None
        tensors = marker.get("tensors")
        if not isinstance(tensors, dict):  # a rank-aware fetch's marker counts them, digests are per file
            return None
        expected = {str(n): (str(t["file"]), str(t["sha256"])) for n, t in tensors.items()
                    if isinstance(t, dict) and t.get("sha256") and t.get("file")}
        return cls(expected, f"{root}/k3ckpt-node.json") if expected else None

    @classmethod
    def from_manifest(cls, root: str | os.PathLike[str], path: str | os.PathLike[str]) -> TensorDigests:
        """The digests of the tensors ``root`` holds, from a tensor-hash manifest (of the original
        checkpoint or of this directory); the file named is the one this directory holds it in."""
        m = Manifest.load(path)
        if not m.tensor_hashes:
            raise ManifestError(f"{path}: no tensor digests (build it with `k3ckpt manifest --tensor-hashes`)")
        here = weight_map(root)
        expected = {n: (here.get(n, t.file), str(t.sha256)) for n, t in m.tensors.items()
                    if t.sha256 and (not here or n in here)}
        return cls(expected, str(path))

    def update(self, name: str, buffer: Any) -> None:
        """Hash one yielded tensor's bytes (any buffer: bytes, a numpy array); a tensor yielded
        again is not hashed again, a tensor without a digest is not this check's business."""
        if name in self.seen or name not in self.expected:
            return
        self.seen.add(name)
        file, want = self.expected[name]
        if hashlib.sha256(buffer).hexdigest() != want:
            self.bad.append(f"{file}: tensor {name}")

    def finish(self, skipped: Callable[[str], bool] | None = None) -> None:
        """Refuse if a yielded tensor differed, or an expected one that ``skipped`` (the engine's
        own filter: another rank's expert) does not excuse never came.

        Raises:
            TensorDigestError: one line naming the file and tensor of the first problem (+N more).
        """
        if self.bad:
            more = f" (+{len(self.bad) - 1} more)" if len(self.bad) > 1 else ""
            raise TensorDigestError(f"{self.bad[0]}: bytes differ from the sha256 in {self.source}{more}; "
                                    "the engine refused to serve them")
        missing = sorted(n for n in self.expected if n not in self.seen and not (skipped and skipped(n)))
        if missing:
            more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
            raise TensorDigestError(f"{self.expected[missing[0]][0]}: tensor {missing[0]} listed in {self.source} "
                                    f"was never read by the engine{more}")


def weight_map(root: str | os.PathLike[str]) -> dict[str, str]:
    """Tensor name -> file, from the directory's safetensors index ({} without one)."""
    try:
        data = json.loads((Path(root) / INDEX_FILE).read_text(encoding="utf-8"))
        return {str(k): str(v) for k, v in (data.get("weight_map") or {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}
