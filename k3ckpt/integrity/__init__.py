"""Proving a checkpoint is what it claims to be: parallel hashing, manifests (build, save, diff),
ed25519-signed manifests and ``verify`` (structure, sizes and hashes, scale scan).

Builds on :mod:`k3ckpt.format`; nothing here talks to a hub.
"""

from typing import TYPE_CHECKING

from ..utils.lazy import lazy_exports

__all__ = [
    "Change",
    "Expected",
    "FileDigest",
    "Issue",
    "Manifest",
    "SignResult",
    "VerifyReport",
    "build_manifest",
    "diff_manifests",
    "generate_key",
    "hash_file",
    "hash_files",
    "load_signed_manifest",
    "sign_file",
    "verify_checkpoint",
]

# Each name is imported from its module on first use (see lazy_exports): ``import
# k3ckpt.integrity.<module>`` does not import the rest of the package.
__getattr__, __dir__ = lazy_exports(__name__, {
    "Change": ".manifest",
    "Expected": ".report",
    "FileDigest": ".hashing",
    "Issue": ".report",
    "Manifest": ".manifest",
    "SignResult": ".signing",
    "VerifyReport": ".report",
    "build_manifest": ".manifest",
    "diff_manifests": ".manifest",
    "generate_key": ".signing",
    "hash_file": ".hashing",
    "hash_files": ".hashing",
    "load_signed_manifest": ".signing",
    "sign_file": ".signing",
    "verify_checkpoint": ".verify",
})

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from .hashing import FileDigest, hash_file, hash_files
    from .manifest import Change, Manifest, build_manifest, diff_manifests
    from .report import Expected, Issue, VerifyReport
    from .signing import SignResult, generate_key, load_signed_manifest, sign_file
    from .verify import verify_checkpoint
