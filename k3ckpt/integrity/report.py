"""The verify report: what ``k3ckpt verify`` found and how it is said.

- :class:`Issue`: one problem (or warning) by kind, with file, tensor, expected and actual;
  :data:`KINDS` is the order they are reported in, :data:`WARNING_KINDS` those that do not fail;
- :class:`Expected`: what a file should be, from a manifest or a hub listing;
- :class:`ShareFacts`: what verify found out about a share (a node directory or a rank-aware copy);
- :class:`VerifyReport`: the whole run (``--json`` is its :meth:`~VerifyReport.to_json`), and
  :func:`render_verify`, what the command prints.

The verdict follows the one rule for "proven" (docs/trust.md): ``ok`` only when nothing is wrong
*and* every file was checked against a digest whose origin is named (:attr:`VerifyReport.proofs`);
``not proven`` when nothing is wrong but some bytes were checked by less (sizes, structure);
``FAILED`` when something is wrong.

Both the whole-checkpoint checks (:mod:`k3ckpt.integrity.verify`) and the share checks
(:mod:`k3ckpt.integrity.share`) fill it in; it imports neither.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ..utils import format_ranges, format_some

#: Order in which kinds are reported (most fundamental first).
KINDS = (
    "missing-file", "missing-tensor", "unreadable", "size", "sha256", "tensor-sha256", "tensor-layout", "header",
    "index", "path", "config", "mxfp4", "nan-scale", "extra-file",
)
#: Kinds that are warnings: reported, but do not fail verification.
WARNING_KINDS = frozenset({"extra-file"})


@dataclass(frozen=True)
class Issue:
    kind: str
    file: str | None
    message: str
    tensor: str | None = None
    expected: str | None = None
    actual: str | None = None

    @property
    def is_warning(self) -> bool:
        return self.kind in WARNING_KINDS

    def __str__(self) -> str:
        where = self.file or ""
        if self.tensor:
            where += f" tensor {self.tensor}" if where else f"tensor {self.tensor}"
        exp = f" (expected {self.expected}, got {self.actual})" if self.expected is not None else ""
        return f"{where}: {self.message}{exp}" if where else f"{self.message}{exp}"


@dataclass(frozen=True)
class Expected:
    """What a file should be, from a manifest or a hub listing."""

    size: int
    sha256: str | None = None
    git_sha1: str | None = None


@dataclass
class ShareFacts:
    """What ``verify`` found out about a share (``--json``: the report's ``share``)."""

    kind: str  # "node" | "partial"
    marker: str
    node: int | None
    ranks: list[int]
    experts: list[int]
    tensors_present: int = 0
    tensors_checked: int = 0  # present tensors whose bytes were compared with a digest
    tensors_not_local: int | None = None  # the reference's tensors of other nodes' experts (None: it lists only the node's)
    tensors_missing: int = 0  # needed by the ranks, absent
    whole_files: list[str] = field(default_factory=list)  # weight files identical to a source file
    files_excluded: list[str] = field(default_factory=list)  # left out by the fetch's --include/--exclude

    def summary(self) -> str:
        who = f"node {self.node}, " if self.node is not None else ""
        ranks = f"rank{'s' if len(self.ranks) != 1 else ''} {_ranges(self.ranks)}"
        text = f"{self.kind} share ({self.marker}; {who}{ranks}): {self.tensors_checked:,} tensors checked"
        if self.tensors_not_local is not None:
            text += f", {self.tensors_not_local:,} not local (other nodes' experts)"
        if self.tensors_missing:
            text += f", {self.tensors_missing:,} needed but absent"
        if self.files_excluded:
            n = len(self.files_excluded)
            text += f"; {n} file{'s' if n != 1 else ''} left out by the fetch's --include/--exclude"
        return text


def _ranges(values: list[int]) -> str:
    return format_ranges(values)


@dataclass
class VerifyReport:
    root: str
    mode: str  # "full" | "quick"
    reference: str  # "manifest <path>", "hf:<repo>@<rev>", or "none (structure only)"
    files: int = 0
    files_hashed: int = 0
    bytes_hashed: int = 0
    files_trusted: list[str] = field(default_factory=list)  # content trusted from the stat cache
    files_size_only: list[str] = field(default_factory=list)  # quick mode, no cached digest
    structure_cached: bool = False
    seconds: float = 0.0
    issues: list[Issue] = field(default_factory=list)
    share: ShareFacts | None = None  # a node directory or rank-aware copy: what it holds, what was checked
    # every file -> the named origin of the digest its bytes were found equal to (None: nothing
    # proved them); files k3ckpt writes about a share (its marker, READY, the index the structure
    # checks compare with the headers) are not listed
    proofs: dict[str, str | None] = field(default_factory=dict)

    @property
    def problems(self) -> list[Issue]:
        return [i for i in self.issues if not i.is_warning]

    @property
    def ok(self) -> bool:
        """Nothing is wrong (a report can be ok and still not proven)."""
        return not self.problems

    @property
    def unproven(self) -> list[str]:
        """The files no digest of named origin vouches for, sorted."""
        return sorted(f for f, origin in self.proofs.items() if origin is None)

    @property
    def origins(self) -> list[str]:
        """The named origins that vouch for the files, sorted."""
        return sorted({o for o in self.proofs.values() if o is not None})

    @property
    def proven(self) -> bool:
        """Nothing is wrong and every file is proven: the only report that says ``ok``."""
        return self.ok and not self.unproven

    @property
    def verdict(self) -> str:
        return "FAILED" if not self.ok else "ok" if self.proven else "not proven"

    def grouped(self) -> dict[str, list[Issue]]:
        out: dict[str, list[Issue]] = {}
        for kind in KINDS:
            got = [i for i in self.issues if i.kind == kind]
            if got:
                out[kind] = got
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["proven"] = self.proven
        d["unproven"] = self.unproven
        d["origins"] = self.origins
        d["issues"] = {k: [asdict(i) for i in v] for k, v in self.grouped().items()}
        return d


def nan_issues(file: str, names: list[str]) -> list[Issue]:
    return [Issue("nan-scale", file, "E8M0 scale byte 0xFF (NaN): every weight of its 32-block decodes to NaN",
                  tensor=n) for n in names]


def content_issue(f: str, exp: Expected, got: dict[str, Any]) -> Issue:
    if exp.sha256:
        return Issue("sha256", f, "content differs", expected=exp.sha256, actual=str(got.get("sha256")))
    return Issue("sha256", f, "content differs (git blob id)", expected=exp.git_sha1, actual=str(got.get("git_sha1")))


def summarize_counts(report: VerifyReport) -> str:
    counts = Counter(i.kind for i in report.problems)
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def render_verify(rep: VerifyReport) -> str:
    """What ``k3ckpt verify`` prints: one summary line, then the issues grouped by kind (at most
    200 a kind; ``--json`` lists all)."""
    from ..utils import human_bytes

    rate = f" at {human_bytes(rep.bytes_hashed / rep.seconds)}/s" if rep.bytes_hashed and rep.seconds else ""
    head = (f"{rep.verdict}: {rep.root} ({rep.mode}; reference: {rep.reference}): "
            f"{rep.files} files, {rep.files_hashed} hashed ({human_bytes(rep.bytes_hashed)}{rate})")
    if rep.files_trusted:
        head += f", {len(rep.files_trusted)} trusted from the stat cache"
    if rep.files_size_only:
        head += f", {len(rep.files_size_only)} checked by size only (no cached digest)"
    if rep.structure_cached:
        head += ", structure unchanged since the last check"
    head += f", {rep.seconds:.1f} s"
    lines = [head]
    if rep.share is not None:
        lines.append(rep.share.summary())
    if rep.ok:
        lines += proof_lines(rep)
    for kind, items in rep.grouped().items():
        label = "warning" if items[0].is_warning else "problem"
        lines.append(f"[{kind}] {len(items)} {label}{'s' if len(items) != 1 else ''}")
        lines += [f"  {i}" for i in items[:200]]
        if len(items) > 200:
            lines.append(f"  ... and {len(items) - 200} more (--json lists all)")
    return "\n".join(lines)


def proof_lines(rep: VerifyReport) -> list[str]:
    """What vouches for the bytes (``proven by ...``), or what does not and how to prove it."""
    if rep.proven:
        return [f"proven by {'; '.join(rep.origins)}"] if rep.origins else []
    files = rep.unproven
    shown = format_some(files)
    referenced = rep.reference.startswith(("manifest ", "hf:", "ms:", "hub "))
    if rep.files_size_only and referenced:
        how = "run verify without --quick"
    elif rep.share is not None:
        how = ("verify against a tensor-hash manifest (--manifest M, from k3ckpt manifest pull --tensor-hashes): "
               "a share's own digests prove its bytes only where k3ckpt wrote or verified them")
    else:
        how = "verify against a pinned or signed manifest (--manifest M) or the hub's listing (--against hf REPO_ID)"
    why = ("checked by size only (no record of an earlier check of these bytes here)" if rep.files_size_only else
           "no digest of named origin (a manifest, a signature or the hub's sha256) was checked for them")
    return [f"not proven: {len(files)} file{'s' if len(files) != 1 else ''} ({shown}): {why}; {how}"]
