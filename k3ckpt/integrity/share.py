"""``k3ckpt verify`` on a *share*: a node directory (``k3ckpt-node.json``, written by ``reshard``
and ``fetch --node``) or a rank-aware fetch's copy (``k3ckpt-partial.json``).

A share holds the tensors its node's ranks need, in rewritten shards (new file names, or the
source's names holding a subset, at new offsets), so whole-file digests of the source cannot
match. It is checked by what is *present*, tensor by tensor:

- every tensor in the share's own headers is looked up in the reference by name: dtype and
  shape must match, and its bytes - read at the share's offsets, in the same parallel read that
  hashes the files and scans the E8M0 scales - must hash to the reference's tensor sha256;
- a weight file byte-identical to a source file (a partial fetch downloads shards whole when
  every tensor is selected) may match the source's whole-file digest; non-weight files
  (config, tokenizer, licence) match by size and sha256;
- completeness: every tensor the ranks need (each non-routed-expert tensor, plus the routed
  experts the marker lists) must be present; other nodes' experts are counted, never reported;
- a node marker's per-file and per-tensor digests are checked too (with no manifest they are the
  reference: a file changed after the node directory was written is still found). A version-2
  marker's file digest is built from the file's header and its tensors' sha256
  (:func:`~k3ckpt.format.filedigest.segments_sha256`); a version-1 marker's is the file's sha256.

A reference that knows only whole files (a manifest without tensor hashes, a hub listing)
cannot check rewritten shards: :class:`~k3ckpt.errors.ShareReferenceError` (exit 2) says
which manifest is needed instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import LayoutError, ShareReferenceError
from ..format.checkpoint import INDEX_NAME, Checkpoint, open_checkpoint
from ..format.filedigest import SEGMENTS_KEY, SHA256_HEX, recorded_digest
from ..format.layout import NODE_MARKER, PARTIAL_MARKER, READY_NAME, read_node_marker
from ..format.roles import Kind, classify
from .hashing import FileDigest, HashError, Span, hash_files
from .manifest import Manifest, TensorEntry, tensors_from_headers
from .report import Expected, Issue, ShareFacts, VerifyReport, content_issue, nan_issues
from .scales import rescan_scales, scale_spans
from .segments import read_prefix, segments_of
from .statcache import StatCache, cached_digest_known, cached_digest_matches, settle_proofs, stat_present
from .structure import structure_issues

#: Which marker makes a directory which kind of share.
SHARE_KINDS = {NODE_MARKER: "node", PARTIAL_MARKER: "partial"}
#: Files of a share that k3ckpt wrote for it (no reference lists them; the index is checked
#: against the headers by the structure checks).
OWN_FILES = frozenset({NODE_MARKER, PARTIAL_MARKER, READY_NAME, INDEX_NAME})
#: What to use when the reference cannot check a share.
TENSOR_MANIFEST_HINT = ("use a tensor-hash manifest: k3ckpt manifest build SRC -o M --tensor-hashes, "
                        "or k3ckpt manifest pull REPO_ID --source HUB -o M --tensor-hashes")


def share_marker(root: str | os.PathLike[str]) -> tuple[str, dict[str, Any]] | None:
    """``(marker file name, marker)`` when ``root`` is a share with a readable marker; None
    otherwise (an unreadable marker is reported by the whole-checkpoint checks)."""
    try:
        marker = read_node_marker(root)
    except LayoutError:
        return None
    if marker is None:
        return None
    name = NODE_MARKER if (Path(root) / NODE_MARKER).exists() else PARTIAL_MARKER
    return name, marker


def is_routed_expert(name: str) -> int | None:
    """The expert id of a per-expert routed tensor (``index_of`` puts it in ``expert_names``),
    else None (dense tensors and stacked all-expert tensors, which every rank needs whole)."""
    role = classify(name)
    return role.expert if role.kind == Kind.ROUTED_EXPERT else None


def verify_share(
    root: Path,
    marker_name: str,
    marker: dict[str, Any],
    report: VerifyReport,
    *,
    manifest: Manifest | None,
    expected: dict[str, Expected],
    quick: bool,
    scan: bool,
    jobs: int | None,
    cache: StatCache | None,
    progress: Callable[[int], None] | None,
    on_plan: Callable[[int], None] | None,
    ckpt: Checkpoint | None = None,
) -> None:
    """Fill ``report`` (a :class:`~k3ckpt.integrity.report.VerifyReport`) for the share at ``root``.

    ``expected``: the reference's files (path -> ``Expected``), empty when there is none.
    ``ckpt``: the share opened already (``open_checkpoint(root, strict=False)``), else opened here.

    Raises:
        ShareReferenceError: the reference knows only whole files and a shard is rewritten.
    """
    issues = report.issues
    node_files = _marker_map(marker, marker_name, "files")
    node_tensors = _marker_map(marker, marker_name, "tensors")
    facts = ShareFacts(SHARE_KINDS[marker_name], marker_name, marker.get("node"),
                       [int(r) for r in marker.get("ranks") or []], list(marker["experts"]))
    report.share = facts
    # files the fetch was told to leave out: absent by request, not missing (a weight file never is:
    # its tensors are checked one by one below)
    excluded = {f for f in marker.get("excluded") or [] if isinstance(f, str) and not f.endswith(".safetensors")}

    present, stats = stat_present(root, report)
    if ckpt is None:
        ckpt = open_checkpoint(root, jobs=jobs, strict=False)
    actual = tensors_from_headers(ckpt.shards.values())
    facts.tensors_present = len(actual)
    weight = set(ckpt.shards)

    tensor_ref = manifest.tensors if manifest is not None and manifest.tensor_hashes else None
    whole_candidates = _whole_copies(ckpt, actual, expected, stats, manifest)
    rewritten = sorted(weight - whole_candidates)
    if expected and tensor_ref is None and rewritten:
        what = "manifest without tensor hashes" if manifest is not None else "hub listing"
        raise ShareReferenceError(
            f"{root}: a {facts.kind} share ({marker_name}) holds rewritten shards ({rewritten[0]}"
            f"{f' and {len(rewritten) - 1} more' if len(rewritten) > 1 else ''}), which a {what} cannot check "
            f"(its sha256 covers whole source files); {TENSOR_MANIFEST_HINT}")

    # -- files: set and sizes -----------------------------------------------------------------------
    for f in sorted(stats):
        if f in OWN_FILES or f in weight:
            continue
        exp = expected.get(f)
        if exp is None:
            if expected:
                issues.append(Issue("extra-file", f, "present but not in the reference"))
        elif stats[f].st_size != exp.size:
            issues.append(Issue("size", f, "size differs", expected=str(exp.size), actual=str(stats[f].st_size)))
    for f in sorted(expected.keys() - stats.keys()):
        if f in excluded:
            facts.files_excluded.append(f)
        elif not f.endswith(".safetensors") and f not in OWN_FILES:
            issues.append(Issue("missing-file", f, "listed in the reference but not present"))
    for f in sorted(weight & stats.keys()):
        want = node_files.get(f, {}).get("size") if isinstance(node_files.get(f), dict) else None
        if want is not None and stats[f].st_size != want:
            issues.append(Issue("size", f, f"size differs from {NODE_MARKER}'s record", expected=str(want),
                                actual=str(stats[f].st_size)))

    # -- structure: headers, index, paths, config vs the marker's experts, MXFP4 ----------------------
    structure = structure_issues(ckpt, None)
    named = {i.file for i in structure if i.kind == "missing-file"}
    issues[:] = [i for i in issues if not (i.kind == "missing-file" and i.file in named)] + structure

    # -- tensors: the reference's dtype and shape; completeness ---------------------------------------
    ref_tensors: dict[str, Any] = tensor_ref if tensor_ref is not None else (
        manifest.tensors if manifest is not None else node_tensors)
    for name, t in sorted(actual.items()):
        ref = ref_tensors.get(name)
        if ref is None:
            if ref_tensors:
                issues.append(Issue("tensor-layout", t.file, "in a header but not in the reference", tensor=name))
            continue
        for attr in ("dtype", "shape"):
            want = _attr(ref, attr)
            want = tuple(want) if attr == "shape" and want is not None else want
            if want is not None and want != getattr(t, attr):
                issues.append(Issue("tensor-layout", t.file, f"{attr} differs", tensor=name,
                                    expected=_show(want), actual=_show(getattr(t, attr))))
    issues += _completeness(root, ckpt, actual, ref_tensors, node_tensors, set(facts.experts), facts, named)

    # -- content: one parallel read hashes files and tensors and scans the scales ---------------------
    want_sha = _tensor_digests(tensor_ref, node_tensors)
    ref_key = _reference_key(manifest, len(node_tensors))
    spans: dict[str, list[Span]] = {f: [] for f in weight}
    for name, t in actual.items():
        spans[t.file].append(Span(name, *t.offsets))
    header_scan = scale_spans(ckpt) if scan else {}
    hits = {f: cache.lookup(f, st) for f, st in stats.items()} if cache is not None else {}
    # file -> the reference this run found it equal to; with no manifest a weight file's reference
    # is the marker's digests, whose origin is the proof its producer recorded (settle_proofs)
    checked: dict[str, str] = {}
    by_reference = manifest is not None or bool(expected)
    if not by_reference:  # the marker's digests are what the bytes are checked against
        report.reference = f"{marker_name}'s digests"

    def file_ref(f: str) -> str | None:  # a non-weight file's reference digest
        exp = expected.get(f)
        return exp.sha256 if exp is not None and f not in OWN_FILES else None

    to_hash: list[str] = []
    to_scan: list[str] = []
    for f in sorted(stats):
        hit = hits.get(f)
        if f in weight:
            if quick:
                if hit and hit.get("share_ref") == ref_key:
                    report.files_trusted.append(f)  # and what the full run found in it, again
                    issues += [Issue(**i) for i in hit.get("share_issues") or []]
                    if by_reference and not hit.get("share_issues"):
                        checked[f] = report.reference
                    facts.tensors_checked += sum(1 for s in spans[f] if s.name in want_sha)
                else:
                    report.files_size_only.append(f)
                if scan and f in header_scan and not (hit and hit.get("scan_ok") is True):
                    to_scan.append(f)
            else:
                to_hash.append(f)
        elif (exp := expected.get(f)) is not None and f not in OWN_FILES and exp.sha256:
            if not quick:
                to_hash.append(f)
            elif hit and cached_digest_matches(hit, exp):
                report.files_trusted.append(f)
                checked[f] = report.reference
            elif hit and cached_digest_known(hit, exp):
                issues.append(content_issue(f, exp, hit))
            else:
                report.files_size_only.append(f)
    if to_hash:
        if on_plan is not None:
            on_plan(sum(stats[f].st_size for f in to_hash))
        # a node file a version-2 marker records by its segments needs no sha256 of its own (unless
        # it may be a source file copied whole): its tensors' digests and header give its digest
        by_segments = {f for f in to_hash if f in weight and f not in whole_candidates
                       and (recorded_digest(node_files.get(f)) or ("",))[0] == SEGMENTS_KEY}
        digests, errors = hash_files(root, to_hash, jobs=jobs, spans={f: spans[f] for f in to_hash if f in spans},
                                     scan={f: header_scan[f] for f in to_hash if f in header_scan},
                                     progress=progress, spans_only=by_segments.__contains__)
        for f, err in sorted(errors.items()):
            issues.append(Issue("unreadable", f, str(err.strerror)))
        for f, d in sorted(digests.items()):
            report.files_hashed += 1
            report.bytes_hashed += d.size
            marked = _marker_file_check(root, ckpt, f, d, spans.get(f, []), node_files) if f in weight else None
            found = _file_content_issues(f, d, file_ref(f), want_sha, whole_candidates, marked, facts,
                                         expected, weight)
            issues += found
            if scan:
                issues += nan_issues(f, d.flagged or [])
            matched = by_reference and not found
            if matched:
                checked[f] = report.reference
            if cache is not None:
                extra = {"share_ref": ref_key, "share_issues": [asdict(i) for i in found],
                         "tensors_match_manifest": _every_tensor_matched(d, found, want_sha, manifest)
                         } if f in weight else {}
                scanned = {"scan_ok": not d.flagged, "flagged": d.flagged or []} if scan and f in weight else {}
                proof = {"proven": report.reference} if matched else {}
                # what these bytes hash to: a file hashed by its segments has no plain sha256, and
                # its segments' digest is what an offline `fetch --node` looks for here
                digest = {"sha256": d.sha256} if d.sha256 else {}
                if marked is not None and marked[0] == SEGMENTS_KEY and SHA256_HEX.fullmatch(marked[2]):
                    digest[SEGMENTS_KEY] = marked[2]
                cache.record(f, stats[f], **digest, **extra, **scanned, **proof)
    issues += rescan_scales(root, to_scan, header_scan, jobs, stats, cache)
    settle_proofs(report, stats, hits, checked, skip=OWN_FILES)


def _every_tensor_matched(d: FileDigest, found: list[Issue], want_sha: dict[str, tuple[str, str]],
                          manifest: Manifest | None) -> str | None:
    """The fingerprint of the tensor-hash manifest every tensor of a hashed share file was just
    found equal to (each one listed with a sha256, none differing), else None: what lets
    ``reshard`` take those tensors' digests from that manifest while the file's stat is unchanged
    (:func:`k3ckpt.deploy.reshard.manifest_digests`), instead of hashing them a second time."""
    if manifest is None or not manifest.tensor_hashes or found or not d.spans:
        return None
    return manifest.fingerprint() if all(name in want_sha for name in d.spans) else None


def share_reference_key(tensors: int) -> str:
    """The key under which ``verify --quick`` finds a weight file of a share of ``tensors``
    tensors checked against its own marker (no manifest): what a command that wrote the share
    records for its files (:func:`k3ckpt.integrity.statcache.record_written`). A rank-aware
    fetch's partial copy, whose marker lists no tensors, is a share of 0 (``fetch --ranks
    --manifest`` records that key for the shards it hashed against the manifest)."""
    return _reference_key(None, tensors)


def _marker_map(marker: dict[str, Any], marker_name: str, key: str) -> dict[str, Any]:
    """A node marker's ``files`` or ``tensors`` (name -> entry with its sha256); a partial
    fetch's marker records no digests."""
    value = marker.get(key) if marker_name == NODE_MARKER else None
    return value if isinstance(value, dict) else {}


def _attr(ref: Any, attr: str) -> Any:
    """A reference tensor's attribute: a manifest's :class:`TensorEntry` or a node marker's dict."""
    return ref.get(attr) if isinstance(ref, dict) else getattr(ref, attr)


def _show(v: Any) -> str:
    return json.dumps(list(v)) if isinstance(v, (tuple, list)) else str(v)


def _whole_copies(ckpt: Checkpoint, actual: dict[str, TensorEntry], expected: dict[str, Any],
                  stats: dict[str, os.stat_result], manifest: Manifest | None) -> set[str]:
    """Weight files that can only be a source file copied whole: the reference lists the same
    name with the same size (and, from a manifest, the same tensors): a rewritten shard holds
    fewer tensors, so it is smaller. Their whole-file sha256 must then match."""
    out = set()
    by_file: dict[str, set[str]] = {}
    if manifest is not None:
        for name, t in manifest.tensors.items():
            by_file.setdefault(t.file, set()).add(name)
    for f in ckpt.shards:
        exp = expected.get(f)
        if exp is None or f not in stats or stats[f].st_size != exp.size or not exp.sha256:
            continue
        if manifest is not None and by_file.get(f, set()) != {n for n, t in actual.items() if t.file == f}:
            continue
        out.add(f)
    return out


def _tensor_digests(tensor_ref: dict[str, TensorEntry] | None, node_tensors: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Tensor name -> ``(sha256, where it comes from)``: the tensor-hash manifest's, else the node
    marker's (which the writer computed while copying)."""
    if tensor_ref is not None:
        return {n: (t.sha256, "") for n, t in tensor_ref.items() if t.sha256}
    return {n: (e["sha256"], f" from {NODE_MARKER}'s record") for n, e in node_tensors.items()
            if isinstance(e, dict) and isinstance(e.get("sha256"), str)}


def _reference_key(manifest: Manifest | None, tensors: int) -> str:
    """What a cached share verdict was checked against (the manifest, or the marker's ``tensors``
    digests): reused by ``--quick`` only for the same. (The scale scan is cached apart, per file.)"""
    h = hashlib.sha256(manifest.fingerprint().encode() if manifest is not None else b"no manifest")
    h.update(str(tensors).encode())
    return h.hexdigest()


def _marker_file_check(root: Path, ckpt: Checkpoint, f: str, d: FileDigest, spans: list[Span],
                       node_files: dict[str, Any]) -> tuple[str, str, str] | None:
    """``(kind, recorded, found)`` for the weight file ``f`` of a share just hashed (``d``, with its
    tensors' ``spans``): the digest its node marker records and this file's of the same kind
    (:func:`~k3ckpt.format.filedigest.recorded_digest`) - its segments' (from its header's bytes and
    ``d``'s tensor digests) or its plain sha256; None when the marker records none."""
    recorded = recorded_digest(node_files.get(f))
    header = ckpt.shards.get(f)
    if recorded is None or header is None:
        return None
    kind, want = recorded
    if kind != SEGMENTS_KEY:
        return kind, want, d.sha256
    try:
        got = segments_of(read_prefix(root / f, header.data_start), spans, d.spans or {})
    except (HashError, OSError, ValueError) as e:
        got = f"not computable ({e})"
    return kind, want, got


def _file_content_issues(f: str, d: FileDigest, want_file: str | None, want_tensors: dict[str, tuple[str, str]],
                         whole: set[str], marked: tuple[str, str, str] | None, facts: ShareFacts,
                         expected: dict[str, Any], weight: set[str]) -> list[Issue]:
    """The tensor and file digests of one hashed file of a share, against the reference
    (``marked``: what the node marker records of the file, :func:`_marker_file_check`)."""
    out = []
    for name, got in sorted((d.spans or {}).items()):
        want = want_tensors.get(name)
        if want is None:
            continue
        facts.tensors_checked += 1
        if got != want[0]:
            out.append(Issue("tensor-sha256", f, "tensor bytes differ" + want[1], tensor=name, expected=want[0],
                             actual=got))
    if f in weight:
        if f in whole and d.sha256 == expected[f].sha256:
            facts.whole_files.append(f)
        checks = [(marked[1], marked[2], f" from {NODE_MARKER}'s record")] if marked is not None else []
        if f in whole:
            checks.append((expected[f].sha256, d.sha256, " from the reference's source file"))
        for want_sha, got, whose in checks:
            if want_sha and got != want_sha and not out:  # a tensor issue already names what changed
                where = " outside the tensor data (header or padding)" if d.spans and want_tensors else ""
                out.append(Issue("sha256", f, f"content differs{whose}{where}", expected=want_sha, actual=got))
                break
    elif want_file is not None and d.sha256 != want_file:
        out.append(content_issue(f, expected[f], {"sha256": d.sha256}))
    return out


def _completeness(root: Path, ckpt: Checkpoint, actual: dict[str, TensorEntry], ref_tensors: dict[str, Any],
                  node_tensors: dict[str, Any], experts: set[int], facts: ShareFacts,
                  missing_files: set[str | None]) -> list[Issue]:
    """Every tensor the ranks need must be present; other nodes' experts are only counted. A
    tensor whose file (by the share's index) is missing is counted under that file's issue."""
    if not ref_tensors:
        return []
    facts.tensors_not_local = 0 if ref_tensors is not node_tensors else None
    share_file = _weight_map(root, ckpt)
    out = []
    for name in sorted(ref_tensors.keys() - actual.keys()):
        expert = is_routed_expert(name)
        if expert is not None and expert not in experts:
            facts.tensors_not_local = (facts.tensors_not_local or 0) + 1
            continue
        facts.tensors_missing += 1
        f = share_file.get(name)
        if f is not None and f in missing_files:
            continue
        source = _attr(ref_tensors[name], "file")
        out.append(Issue("missing-tensor", f, f"needed by the share's ranks but in no header (source file {source})",
                         tensor=name))
    return out


def _weight_map(root: Path, ckpt: Checkpoint) -> dict[str, str]:
    """The share's index: tensor -> file (empty when it cannot be read; the structure checks say why)."""
    if ckpt.index_file is None:
        return {}
    try:
        wm = json.loads((root / ckpt.index_file).read_bytes()).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in wm.items()} if isinstance(wm, dict) else {}
