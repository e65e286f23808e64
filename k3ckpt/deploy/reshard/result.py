"""What a reshard returns (:class:`ReshardResult`) and what ``k3ckpt reshard`` prints of it
(:func:`render_reshard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...utils import human_bytes


@dataclass
class ReshardResult:
    out: Path
    topology: dict[str, Any]
    written: list[int]
    skipped: list[int]
    bytes_written: int
    seconds: float
    files_copied: list[str]
    layout: str = "rank"
    digests_from_manifest: int = 0  # tensors whose sha256 came from a manifest, not from hashing
    digests_manifest: str | None = None  # that manifest: "--manifest", or the one verify used (its path)

    def to_json(self) -> dict[str, Any]:
        unit = "nodes" if self.layout == "node" else "ranks"
        return {"out": str(self.out), "format": self.layout, "topology": self.topology, f"{unit}_written": self.written,
                f"{unit}_skipped": self.skipped, "bytes_written": self.bytes_written,
                "seconds": round(self.seconds, 3), "files_copied": self.files_copied,
                "tensor_digests_from_manifest": self.digests_from_manifest,
                "tensor_digests_manifest": self.digests_manifest,
                "bytes_per_second": int(self.bytes_written / self.seconds) if self.seconds else None}


def render_reshard(res: ReshardResult) -> str:
    """What ``k3ckpt reshard`` prints: the topology and what was written, in one line."""
    rate = f" at {human_bytes(res.bytes_written / res.seconds)}/s" if res.seconds and res.bytes_written else ""
    skipped = f", {len(res.skipped)} already complete (skipped)" if res.skipped else ""
    if res.digests_from_manifest:
        which = "" if res.digests_manifest in (None, "--manifest") else f" {res.digests_manifest} (verify's)"
        skipped += f", {res.digests_from_manifest} tensor digests from the manifest{which}"
    t = res.topology
    unit = "nodes" if res.layout == "node" else "ranks"
    shape = (f"ep {t['ep']} = tp {t['tp']} x dp {t['dp']}" if res.layout == "node"
             else f"ep {t['ep']} x tp {t['tp']}")
    return (f"ok: {res.out}: {shape}, world size {t['world_size']}: "
            f"{len(res.written)} {unit} written ({human_bytes(res.bytes_written)}{rate}){skipped}")
