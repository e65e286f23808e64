"""What a rank-aware or node fetch reports: :class:`RankFetchResult` (the result of both
:func:`k3ckpt.hub.rankfetch.run_rank_fetch` and :func:`k3ckpt.hub.nodefetch.run_node_fetch`), the
``verification`` values it and the markers carry, and the text both print: a dry run's last
lines (:func:`dry_run_total`) and a run's summary (:func:`fetch_summary`).

Verification. The hub's sha256 covers whole files, so a file assembled from tensors cannot be
checked against it. With a tensor-hash manifest each tensor is hashed while its bytes stream in
and compared with the manifest (:data:`VERIFIED_TENSORS`); without one only structure and sizes
are checked (:data:`VERIFIED_STRUCTURE`), and the result says so (:data:`STRUCTURE_ONLY_NOTE`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..utils import human_bytes
from .client import HubListing
from .fetch import moved_text, pull_command, resumed_text, source_text

#: ``verification`` values of the result and the marker: every rewritten shard's tensors were
#: checked against a manifest; or only their structure and sizes; or no shard was rewritten (every
#: file was checked against the hub's sha256).
VERIFIED_TENSORS = "tensor-sha256"
VERIFIED_STRUCTURE = "structure-and-sizes"
VERIFIED_FILES = "file-sha256"
#: Said plainly whenever no manifest was given.
STRUCTURE_ONLY_NOTE = ("no --manifest: the files assembled from tensors were checked for structure and sizes only (the hub's "
                       "sha256 covers whole files); pass a tensor-hash manifest as --manifest to verify every tensor")


def structure_only_note(source: HubListing | str) -> str:
    """:data:`STRUCTURE_ONLY_NOTE`, with the command that pulls the manifest of this very commit
    (``source``: the listing or its ``hub:repo@revision``)."""
    return f"{STRUCTURE_ONLY_NOTE} (`{pull_command(source)}`, before the download)"


@dataclass
class RankFetchResult:
    """What one :func:`~k3ckpt.hub.rankfetch.run_rank_fetch` (or :func:`~k3ckpt.hub.nodefetch.run_node_fetch`) did.

    Attributes:
        dest: The destination directory.
        written: Rewritten shards downloaded (fully or resumed) and checked this run.
        resumed: Of ``written``, those continued from an earlier run's journaled pieces.
        skipped: Rewritten shards already complete (size, header and, with a manifest, tensor hashes).
        fetched: Whole files (non-weight files and whole shards) downloaded and sha256-verified.
        files_skipped: Whole files already present and verified.
        failed: Path -> one-line reason, for everything that could not be fetched.
        bytes_downloaded: Body bytes received this run (retries included; planning headers not).
        bytes_total: Bytes of the whole selection (see :attr:`k3ckpt.hub.rankfetch.RankFetchPlan.bytes_total`).
        tensors_verified: Tensors whose sha256 was checked against the manifest this run.
        verification: :data:`VERIFIED_TENSORS` or :data:`VERIFIED_STRUCTURE`.
        seconds: Wall time of the run.
    """

    dest: Path
    verification: str
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    fetched: list[str] = field(default_factory=list)
    files_skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    bytes_downloaded: int = 0
    bytes_total: int = 0
    tensors_verified: int = 0
    seconds: float = 0.0
    resumed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True only if every selected shard and file is present and checked."""
        return not self.failed

    @property
    def proven(self) -> bool:
        """Every byte checked against a digest of named origin (docs/trust.md): the hub's sha256
        of the files fetched whole, a tensor-hash manifest's of the files assembled from tensors.
        Without a manifest those are checked for structure and sizes only: not proven."""
        return self.ok and self.verification != VERIFIED_STRUCTURE

    @property
    def verdict(self) -> str:
        return "FAILED" if not self.ok else "ok" if self.proven else "not proven"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "dest": str(self.dest), "ok": self.ok, "proven": self.proven, "written": sorted(self.written),
            "resumed": sorted(self.resumed),
            "skipped": sorted(self.skipped),
            "fetched": sorted(self.fetched), "files_skipped": sorted(self.files_skipped),
            "failed": dict(sorted(self.failed.items())), "bytes_downloaded": self.bytes_downloaded,
            "bytes_total": self.bytes_total, "tensors_verified": self.tensors_verified,
            "verification": self.verification, "seconds": round(self.seconds, 3),
        }
        if self.verification == VERIFIED_STRUCTURE:
            d["note"] = STRUCTURE_ONLY_NOTE
        return d


class FetchPlanTotals(Protocol):
    """What a rank-aware or a node fetch plan both tell about the whole run."""

    @property
    def listing(self) -> HubListing: ...
    @property
    def dest(self) -> Path: ...
    @property
    def files(self) -> list[str]: ...
    @property
    def header_bytes(self) -> int: ...
    @property
    def source_bytes(self) -> int: ...
    @property
    def bytes_total(self) -> int: ...
    @property
    def tensors(self) -> int: ...
    @property
    def verification(self) -> str: ...


def dry_run_total(plan: FetchPlanTotals, selection: str, written: str) -> list[str]:
    """The last lines of a rank-aware or node fetch's dry run: what would be fetched of the
    whole, into what (``written``: the weight files), and the structure-only note."""
    share = plan.bytes_total / plan.source_bytes if plan.source_bytes else 1.0
    lines = [f"would fetch {human_bytes(plan.bytes_total)} of {human_bytes(plan.source_bytes)} ({share:.1%}) "
             f"from {source_text(plan.listing)} into {plan.dest} for {selection}: {plan.tensors:,} tensors "
             f"in {written} and {len(plan.files)} other files; headers read: {human_bytes(plan.header_bytes)}"]
    if plan.verification == VERIFIED_STRUCTURE:
        lines.append(f"note: {structure_only_note(plan.listing)}")
    return lines


def fetch_summary(res: RankFetchResult, *, source: str, dest: Path, selection: str, written: str, wrote_note: str,
                  whole: str, bytes_total: int, source_bytes: int, manifest: bool, verbose: bool) -> str:
    """The summary line (and failures, and the structure-only note) of a fetch that writes files of
    its own from selected tensors: the rank-aware fetch (``written`` "shards rewritten") and the
    node fetch ("node files written") say the same things in the same order."""
    lines = []
    if verbose:
        lines += [f"wrote    {p}{wrote_note}" for p in res.written]
        lines += [f"fetched  {p}" for p in res.fetched]
        lines += [f"verified {p} (already present)" for p in res.skipped + res.files_skipped]
    checked = f", {res.tensors_verified:,} tensors verified against the manifest" if manifest else ""
    resumed = sorted(set(res.resumed) & set(res.written))
    lines.append(f"{res.verdict}: {source} -> {dest}: {selection}: "
                 f"{len(res.written)} {written}{resumed_text(resumed)}, {len(res.fetched)} whole files fetched, "
                 f"{len(res.skipped) + len(res.files_skipped)} already present{checked}, {len(res.failed)} failed; "
                 f"{moved_text(res.bytes_downloaded, res.seconds)} ({whole} is {human_bytes(bytes_total)} of "
                 f"{human_bytes(source_bytes)})")
    lines += [f"  could not fetch {p}: {why}" for p, why in sorted(res.failed.items())]
    if res.verification == VERIFIED_STRUCTURE:
        lines.append(f"not proven: {structure_only_note(source)}")
    return "\n".join(lines)
