"""Proving a checkpoint is what it claims to be: parallel hashing, manifests (build, save, diff),
ed25519-signed manifests and ``verify`` (structure, sizes and hashes, scale scan).

Builds on :mod:`k3ckpt.format`; nothing here talks to a hub.
"""

from .hashing import FileDigest, hash_file, hash_files
from .manifest import Change, Manifest, build_manifest, diff_manifests
from .signing import SignResult, generate_key, load_signed_manifest, sign_file
from .verify import Expected, Issue, VerifyReport, verify_checkpoint

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
