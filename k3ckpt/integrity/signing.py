"""Signed manifests: ed25519 detached signatures over a manifest's exact bytes.

A manifest pins every file's size and sha256 (and, optionally, every tensor's). Signing it
lets a fleet verify a checkpoint against a manifest its operators trust rather than whatever
the network served: the signature is checked over the manifest bytes *before* anything is
parsed or hashed, and the manifest that is then used is parsed from those same bytes (never
re-read, so the file cannot be swapped between the check and the use).

Formats, chosen to interoperate with ``openssl`` and ``ssh-keygen``:

- signature: the raw 64-byte ed25519 signature (what ``openssl pkeyutl -sign -rawin``
  writes); a base64 text of it is accepted too;
- private key: PKCS#8 PEM (``openssl genpkey -algorithm ed25519``; encrypted PEM with the
  passphrase in ``$K3CKPT_KEY_PASSPHRASE``), OpenSSH (``ssh-keygen -t ed25519``), or the raw
  32-byte seed;
- public key: SubjectPublicKeyInfo PEM (``openssl pkey -pubout``), an OpenSSH
  ``ssh-ed25519 AAAA...`` line, or the raw 32 bytes.

Why not OpenSSF ``model-signing``: it signs a model *directory* (re-hashing every file, 1.56 TB
for K3) into a Sigstore bundle, its key-based signer accepts only NIST P-256/384/521 keys, and
version 1.1.1 does not import without pyOpenSSL, which it does not declare. Our manifest already
is the file-by-file statement; a 64-byte signature over it costs microseconds. Operators who
want a Sigstore bundle can still run ``model_signing`` over the directory alongside.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..env import K3CKPT_KEY_PASSPHRASE
from ..errors import K3ckptError, KeyFileError, SignatureError
from ..utils import write_atomic
from ..utils.ownership import refuse_foreign_file

if TYPE_CHECKING:  # cryptography is imported where it is used: the CLI's other commands start faster
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    from .manifest import Manifest

#: Length of an ed25519 signature and of a raw public key / private seed.
SIGNATURE_BYTES = 64
RAW_KEY_BYTES = 32
#: Keys and signatures are small; anything bigger is not one (and is not read whole).
MAX_KEY_FILE_BYTES = 64 * 1024
#: Environment variable holding the passphrase of an encrypted private key.
PASSPHRASE_ENV = K3CKPT_KEY_PASSPHRASE.name


@dataclass(frozen=True)
class SignResult:
    """What :func:`sign_file` wrote.

    Attributes:
        path: The signed file.
        signature: The signature file written.
        sha256: sha256 of the signed bytes.
        key_id: Short identifier of the public key (see :func:`key_id`).
    """

    path: str
    signature: str
    sha256: str
    key_id: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "signature": self.signature, "sha256": self.sha256, "key_id": self.key_id}


def _read_small(path: str | os.PathLike[str], what: str, error: type[K3ckptError]) -> bytes:
    """The bytes of a small file (a key or a signature), or ``error`` naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        raise KeyFileError(f"{path}: {what} not found") from None
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise error(f"{path}: more than {MAX_KEY_FILE_BYTES} bytes, not an ed25519 {what}")
    return data


def key_id(public_key: Ed25519PublicKey) -> str:
    """``ed25519:`` + the first 16 hex digits of the sha256 of the raw public key.

    Printed on signing and in verification errors, so an operator can tell which key was used.
    """
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Load an ed25519 private key (PKCS#8 PEM, OpenSSH or a raw 32-byte seed).

    Raises:
        KeyFileError: missing or unreadable, encrypted without ``$K3CKPT_KEY_PASSPHRASE`` (or
            with a wrong one), another algorithm, or not a key.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    data = _read_small(path, "private key", KeyFileError)
    if len(data) == RAW_KEY_BYTES:
        return Ed25519PrivateKey.from_private_bytes(data)
    passphrase = K3CKPT_KEY_PASSPHRASE.get()
    password = passphrase.encode() if passphrase else None
    loaders = (serialization.load_ssh_private_key if b"OPENSSH PRIVATE KEY" in data
               else serialization.load_pem_private_key)
    try:
        key = loaders(data, password=password)
    except TypeError as e:  # encrypted without a password, or a password for a plain key
        raise KeyFileError(f"{path}: {e} (the passphrase is read from ${PASSPHRASE_ENV})") from None
    except ValueError:
        if password is not None:
            raise KeyFileError(f"{path}: cannot decrypt it with the passphrase in ${PASSPHRASE_ENV} "
                               "(wrong passphrase, or not a key)") from None
        raise KeyFileError(f"{path}: not a PEM, OpenSSH or raw 32-byte ed25519 private key") from None
    except Exception as e:  # noqa: BLE001 - cryptography raises UnsupportedAlgorithm etc. for odd keys
        raise KeyFileError(f"{path}: cannot load the private key ({type(e).__name__})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: holds a key of type {_algorithm(key)}, not ed25519: k3ckpt signs with ed25519 "
                           "(make one with `k3ckpt manifest keygen` or `openssl genpkey -algorithm ed25519`)")
    return key


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """Load an ed25519 public key (SubjectPublicKeyInfo PEM, an OpenSSH line, or 32 raw bytes).

    Raises:
        KeyFileError: missing or unreadable, another algorithm, or not a public key (a private
            key given as ``--pubkey`` is refused: it must not be handed to verifiers).
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    data = _read_small(path, "public key", KeyFileError)
    if len(data) == RAW_KEY_BYTES:
        return Ed25519PublicKey.from_public_bytes(data)
    if b"PRIVATE KEY" in data:
        raise KeyFileError(f"{path}: is a private key; verifiers need the public key "
                           "(`openssl pkey -in KEY -pubout`)")
    text = data.strip()
    # Any algorithm the file may hold, checked for ed25519 below. ``object``, not cryptography's
    # PublicKeyTypes: since 51.0 its loaders return key types (ML-DSA) that union leaves out.
    key: object
    try:
        if text.startswith(b"ssh-"):
            key = serialization.load_ssh_public_key(text)
        else:
            key = serialization.load_pem_public_key(text)
    except Exception:  # noqa: BLE001 - ValueError, UnsupportedAlgorithm, ...: all mean "not a key we use"
        raise KeyFileError(f"{path}: not a PEM, OpenSSH or raw 32-byte ed25519 public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path}: holds a key of type {_algorithm(key)}, not ed25519: "
                           "k3ckpt verifies ed25519 signatures")
    return key


def _algorithm(key: object) -> str:
    """A human name for a key's algorithm, for "this is not ed25519" errors."""
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, rsa, x448, x25519

    kinds = {"RSA": (rsa.RSAPrivateKey, rsa.RSAPublicKey), "ECDSA": (ec.EllipticCurvePrivateKey,
             ec.EllipticCurvePublicKey), "DSA": (dsa.DSAPrivateKey, dsa.DSAPublicKey),
             "Ed448": (ed448.Ed448PrivateKey, ed448.Ed448PublicKey),
             "X25519": (x25519.X25519PrivateKey, x25519.X25519PublicKey),
             "X448": (x448.X448PrivateKey, x448.X448PublicKey)}
    return next((name for name, types in kinds.items() if isinstance(key, types)), type(key).__name__)


def read_signature(path: str | os.PathLike[str]) -> bytes:
    """The 64 signature bytes of a signature file (raw, or base64 text).

    Raises:
        KeyFileError: missing or unreadable.
        SignatureError: not 64 bytes, raw or base64-encoded.
    """
    data = _read_small(path, "signature", SignatureError)
    if len(data) == SIGNATURE_BYTES:
        return data
    try:
        decoded = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        decoded = b""
    if len(decoded) != SIGNATURE_BYTES:
        raise SignatureError(f"{path}: not an ed25519 signature ({len(data)} bytes; expected "
                             f"{SIGNATURE_BYTES} raw bytes or their base64)")
    return decoded


def sign_bytes(data: bytes, key_path: str | os.PathLike[str]) -> tuple[bytes, str]:
    """``(signature, key id)`` of ``data`` signed with the private key at ``key_path``."""
    key = load_private_key(key_path)
    return key.sign(data), key_id(key.public_key())


def verify_bytes(data: bytes, signature_path: str | os.PathLike[str], pubkey_path: str | os.PathLike[str],
                 label: str) -> str:
    """Check that the signature at ``signature_path`` is ``pubkey_path``'s over ``data``.

    Args:
        data: The exact signed bytes.
        label: How to name the signed file in errors.

    Returns:
        The key id of the public key.

    Raises:
        KeyFileError: a file is missing or the key is unusable.
        SignatureError: the signature is malformed or does not verify.
    """
    from cryptography.exceptions import InvalidSignature

    public = load_public_key(pubkey_path)
    signature = read_signature(signature_path)
    kid = key_id(public)
    try:
        public.verify(signature, data)
    except InvalidSignature:
        raise SignatureError(f"{label}: signature {signature_path} does not verify with {kid} ({pubkey_path}); "
                             "the manifest or the signature was changed, or another key signed it") from None
    return kid


def _is_signature_file(path: Path) -> bool:
    """A regular file of exactly one raw ed25519 signature: what :func:`sign_file` writes."""
    return not path.is_symlink() and path.is_file() and path.stat().st_size == SIGNATURE_BYTES


def _is_pem_file(path: Path, kind: bytes) -> bool:
    """A regular file starting with a PEM ``-----BEGIN <kind>-----`` line: what :func:`generate_key`
    writes (PKCS#8 private key, SubjectPublicKeyInfo public key)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(64).startswith(b"-----BEGIN " + kind + b"-----")
    except OSError:
        return False


def sign_file(path: str | os.PathLike[str], key_path: str | os.PathLike[str],
              signature_path: str | os.PathLike[str] | None = None) -> SignResult:
    """Sign the bytes of ``path`` and write the raw signature next to it.

    Args:
        path: The file to sign (a manifest).
        key_path: The ed25519 private key.
        signature_path: Where to write the signature [default: ``<path>.sig``]; written
            atomically (temporary name, fsync, rename).

    Raises:
        KeyFileError: the key is unusable.
        K3ckptError: the file cannot be read.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise K3ckptError(f"{path}: cannot read ({e.strerror or e})") from None
    signature, kid = sign_bytes(data, key_path)
    out = Path(signature_path) if signature_path is not None else Path(f"{path}.sig")
    refuse_foreign_file(out, _is_signature_file(out), "signature")
    write_atomic(out, signature)
    return SignResult(str(path), str(out), hashlib.sha256(data).hexdigest(), kid)


def load_signed_manifest(path: str | os.PathLike[str], signature_path: str | os.PathLike[str],
                         pubkey_path: str | os.PathLike[str]) -> tuple[Manifest, str]:
    """Read a manifest once, check its signature over those bytes, then parse those bytes.

    Nothing of the manifest is interpreted before the signature has verified, so a tampered
    manifest fails here with one line, before any hashing.

    Returns:
        ``(manifest, key id)``.

    Raises:
        ManifestError: the manifest cannot be read, or (signed but) is malformed.
        KeyFileError, SignatureError: as :func:`verify_bytes`.
    """
    from .manifest import Manifest, ManifestError

    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path}: not found") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read ({e.strerror or e})") from None
    kid = verify_bytes(raw, signature_path, pubkey_path, str(path))
    return Manifest.loads(raw, str(path)), kid


def generate_key(private_path: str | os.PathLike[str], public_path: str | os.PathLike[str] | None = None,
                 *, force: bool = False) -> str:
    """Make an ed25519 key pair: PKCS#8 PEM private key (mode 0600) and SubjectPublicKeyInfo PEM.

    Args:
        private_path: Where the private key goes.
        public_path: Where the public key goes [default: ``<private_path>.pub``].
        force: Overwrite existing files.

    Returns:
        The key id.

    Raises:
        KeyFileError: a file exists (without ``force``).
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    priv = Path(private_path)
    pub = Path(public_path) if public_path is not None else Path(f"{private_path}.pub")
    for p, pem_kind in ((priv, b"PRIVATE KEY"), (pub, b"PUBLIC KEY")):
        if not force and os.path.lexists(p):
            raise KeyFileError(f"{p}: exists; not overwriting a key (--force to replace it)")
        # --force replaces a key file of the kind keygen writes, never another file
        refuse_foreign_file(p, _is_pem_file(p, pem_kind), f"PEM {pem_kind.decode().lower()}")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_atomic(priv, pem, mode=0o600)
    write_atomic(pub, key.public_key().public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    return key_id(key.public_key())
