"""Preflight's ``proof`` row: is every byte this node loads proven (docs/trust.md), by what?

"ready to load" needs this row to PASS: a directory whose checks all pass but whose bytes no
digest of named origin vouches for is "loadable, not proven" - and, with ``--require-proof``
(what ``examples/node-init.sh`` passes), a FAIL.

- A checkpoint or node directory is checked by ``verify``'s own rule
  (:func:`k3ckpt.integrity.verify.verify_checkpoint`): without ``--full``, from the stat cache
  alone (what ``fetch``, ``verify`` or ``reshard`` recorded of these very bytes: a file changed or
  copied since carries no proof); with ``--full``, a node directory's every weight byte is hashed
  against its marker's digests in one read, so a flipped byte FAILs here whatever its stat says.
- A rank layout: its ranks' files, by the proofs ``reshard`` recorded of them.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ..errors import K3ckptError
from ..format.checkpoint import resolve_root
from ..integrity.statcache import recorded_proofs
from ..integrity.verify import verify_checkpoint
from ..utils import format_some
from ._preflight_report import FAIL, PASS, WARN, Check

#: The row's name.
PROOF = "proof"
#: verify's kinds that say bytes differ from their digests (the rest are other rows' business).
CONTENT_KINDS = frozenset({"sha256", "tensor-sha256", "size", "unreadable"})


def checkpoint_proof(root: Path, *, full: bool, require: bool, jobs: int | None,
                     progress: object | None = None) -> Check:
    """The proof row of a checkpoint or node directory (see the module docstring)."""
    try:
        rep = verify_checkpoint(root, quick=not full, scan=False, jobs=jobs,
                                progress=progress if callable(progress) else None)
    except K3ckptError as e:  # e.g. a share a manifest cannot check: say so, never a traceback
        return _unproven(f"not checked: {e}", require)
    content = [i for i in rep.problems if i.kind in CONTENT_KINDS]
    if content:  # bytes that are not what was proven (or recorded): this row's own finding
        more = f" (+{len(content) - 1} more)" if len(content) > 1 else ""
        return Check(PROOF, FAIL, f"{content[0]}{more}", fix=f"k3ckpt verify {root}",
                     details={"issues": [str(i) for i in content]})
    # (other problems are the structure rows' findings: here they only leave files unproven)
    return _verdict(rep.origins, rep.unproven, require, root, full, fix=_against_hub(root))


def layout_proof(root: Path, rank_dirs: dict[int, Path], *, require: bool) -> Check:
    """The proof row of a rank layout: the recorded proofs of the selected ranks' files."""
    proofs: dict[str, str | None] = {}
    for rdir in rank_dirs.values():
        if not rdir.is_dir():
            continue
        files = sorted(p.name for p in rdir.iterdir() if p.is_file() and p.suffix == ".safetensors")
        proofs.update({f"{rdir.name}/{f}": o for f, o in recorded_proofs(rdir, files).items()})
    origins = sorted({o for o in proofs.values() if o is not None})
    return _verdict(origins, sorted(f for f, o in proofs.items() if o is None), require, root, full=False)


def _against_hub(root: Path) -> str | None:
    """The verify that proves ``root`` against the hub it came from, when it says which (a
    fetch's source record, an HF cache snapshot): the files' digests, or for a node directory
    exactly its tensors by ranged reads. Else none: the source's own proof is what is missing."""
    try:
        _, src = resolve_root(root)
    except K3ckptError:
        return None
    if not (src.hub and src.repo and src.revision):
        return None
    return shlex.join(["k3ckpt", "verify", str(root), "--against", src.hub, "--repo", src.repo,
                       "--revision", src.revision])


def _verdict(origins: list[str], unproven: list[str], require: bool, root: Path, full: bool,
             fix: str | None = None) -> Check:
    if not unproven:
        how = "every byte hashed now" if full else "recorded when they were checked or written, unchanged since"
        return Check(PROOF, PASS, f"proven by {'; '.join(origins) or 'nothing to prove'} ({how})")
    shown = format_some(unproven)
    return _unproven(f"not proven: {len(unproven)} file{'s' if len(unproven) != 1 else ''} ({shown}): no digest "
                     "of named origin vouches for their bytes here (docs/trust.md); verify them against a pinned "
                     "or signed manifest (a node directory: one with tensor hashes) or the hub", require, fix)


#: What proves bytes whose source says nothing of a hub (a local reshard, a copy).
PROVE_SOURCE = ("verify the checkpoint they came from against a pinned or signed manifest (k3ckpt verify SRC "
                "--manifest M), then write them again from it (reshard, or fetch --manifest)")


def _unproven(reason: str, require: bool, fix: str | None = None) -> Check:
    return Check(PROOF, FAIL if require else WARN, reason, fix=fix or PROVE_SOURCE)
