"""Signed manifests: keygen, sign, verify --signature/--pubkey, key formats, openssl interop."""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from helpers import run
from k3ckpt.integrity.manifest import Manifest, build_manifest
from k3ckpt.integrity.signing import (
    KeyFileError,
    SignatureError,
    generate_key,
    load_private_key,
    load_public_key,
    load_signed_manifest,
    sign_file,
)

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="no openssl CLI on this machine")


def one_line_error(res, code: int, *needles: str) -> str:
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3ckpt: error: "), res.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def manifest_file(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("signing") / "k3-tiny.json"
    build_manifest(k3_tiny, tensor_hashes=True).save(p)
    return p


@pytest.fixture
def signed(manifest_file: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """``(manifest, signature, public key)``: a private copy of the manifest, signed."""
    m = tmp_path / "m.json"
    shutil.copy(manifest_file, m)
    key = tmp_path / "release.key"
    res = run("manifest", "keygen", str(key))
    assert res.exit_code == 0, res.output
    res = run("manifest", "sign", str(m), "--key", str(key))
    assert res.exit_code == 0 and res.output == "", res.output  # quiet success
    return m, Path(f"{m}.sig"), Path(f"{key}.pub")


def test_keygen_writes_a_private_key_only_its_owner_can_read(tmp_path: Path) -> None:
    key = tmp_path / "k"
    res = run("manifest", "keygen", str(key), "--json")
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["key_id"].startswith("ed25519:") and info["public_key"] == f"{key}.pub"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert b"BEGIN PRIVATE KEY" in key.read_bytes() and b"BEGIN PUBLIC KEY" in Path(f"{key}.pub").read_bytes()
    # Never silently replace a release key.
    one_line_error(run("manifest", "keygen", str(key)), 2, str(key), "exists")
    assert run("manifest", "keygen", str(key), "--force").exit_code == 0


def test_verify_with_a_good_signature_passes_and_names_the_key(signed, k3_tiny: Path, tmp_path: Path) -> None:
    m, sig, pub = signed
    assert len(sig.read_bytes()) == 64
    env = {"K3CKPT_CACHE_DIR": str(tmp_path / "cache")}
    res = run("verify", str(k3_tiny), "--manifest", str(m), "--signature", str(sig), "--pubkey", str(pub), "--json",
              env=env)
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["ok"] and "signed by ed25519:" in rep["reference"] and rep["files_hashed"] > 0


@pytest.mark.parametrize("tamper", ["manifest-byte", "manifest-appended", "signature-bit", "other-key"])
def test_bad_signature_is_exit_1_one_line_before_any_hashing(signed, k3_tiny: Path, tmp_path: Path,
                                                             tamper: str) -> None:
    m, sig, pub = signed
    if tamper == "manifest-byte":
        # The kind of edit an attacker wants: point one file at another digest.
        data = bytearray(m.read_bytes())
        i = data.index(b'"sha256": "') + len(b'"sha256": "')
        data[i] = ord("0") if data[i] != ord("0") else ord("1")
        m.write_bytes(bytes(data))
    elif tamper == "manifest-appended":
        m.write_bytes(m.read_bytes() + b"\n")
    elif tamper == "signature-bit":
        raw = bytearray(sig.read_bytes())
        raw[10] ^= 1
        sig.write_bytes(bytes(raw))
    else:
        generate_key(tmp_path / "other.key")
        pub = tmp_path / "other.key.pub"
    cache = tmp_path / "cache"
    res = run("verify", str(k3_tiny), "--manifest", str(m), "--signature", str(sig), "--pubkey", str(pub),
              env={"K3CKPT_CACHE_DIR": str(cache)})
    one_line_error(res, 1, str(m), "does not verify", "ed25519:")
    # verify writes its stat cache after hashing; a refused manifest must not get that far.
    assert not cache.exists()


def test_signature_and_pubkey_go_together(signed, k3_tiny: Path) -> None:
    m, sig, pub = signed
    for args in (["--signature", str(sig)], ["--pubkey", str(pub)]):
        res = run("verify", str(k3_tiny), "--manifest", str(m), *args)
        assert res.exit_code == 2 and "--signature and --pubkey go together" in res.output
    res = run("verify", str(k3_tiny), "--signature", str(sig), "--pubkey", str(pub))
    assert res.exit_code == 2 and "--manifest" in res.output


def test_missing_and_malformed_key_and_signature_files(signed, k3_tiny: Path, tmp_path: Path) -> None:
    m, sig, pub = signed
    base = ["verify", str(k3_tiny), "--manifest", str(m)]
    one_line_error(run(*base, "--signature", str(tmp_path / "nope.sig"), "--pubkey", str(pub)), 2, "nope.sig", "not found")
    one_line_error(run(*base, "--signature", str(sig), "--pubkey", str(tmp_path / "nope.pub")), 2, "nope.pub", "not found")
    short = tmp_path / "short.sig"
    short.write_bytes(b"\x00" * 63)
    one_line_error(run(*base, "--signature", str(short), "--pubkey", str(pub)), 1, "short.sig", "not an ed25519 signature")
    garbage = tmp_path / "garbage.pub"
    garbage.write_text("-----BEGIN PUBLIC KEY-----\nnot base64 at all\n-----END PUBLIC KEY-----\n")
    one_line_error(run(*base, "--signature", str(sig), "--pubkey", str(garbage)), 2, "garbage.pub", "not a PEM")
    # Handing a private key to verifiers is a mistake worth naming.
    one_line_error(run(*base, "--signature", str(sig), "--pubkey", str(pub)[:-4]), 2, "is a private key")
    big = tmp_path / "big.pub"
    big.write_bytes(b"A" * (1 << 20))
    one_line_error(run(*base, "--signature", str(sig), "--pubkey", str(big)), 2, "big.pub", "more than")


def test_keys_of_another_algorithm_are_refused_by_name(manifest_file: Path, tmp_path: Path) -> None:
    k = ec.generate_private_key(ec.SECP256R1())
    priv = tmp_path / "p256.key"
    priv.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))
    pub = tmp_path / "p256.pub"
    pub.write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                                serialization.PublicFormat.SubjectPublicKeyInfo))
    one_line_error(run("manifest", "sign", str(manifest_file), "--key", str(priv)), 2, "ECDSA", "ed25519")
    with pytest.raises(KeyFileError, match="ECDSA"):
        load_public_key(pub)


def test_openssh_raw_base64_and_encrypted_keys(manifest_file: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    key = ed25519.Ed25519PrivateKey.generate()
    forms = {
        "ssh": (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                  serialization.NoEncryption()),
                key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
                + b" ops@fleet\n"),
        "raw": (key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                  serialization.NoEncryption()),
                key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)),
    }
    m = tmp_path / "m.json"
    shutil.copy(manifest_file, m)
    for name, (priv, pub) in forms.items():
        (tmp_path / f"{name}.key").write_bytes(priv)
        (tmp_path / f"{name}.pub").write_bytes(pub)
    sign_file(m, tmp_path / "ssh.key", tmp_path / "a.sig")
    # Signed with the OpenSSH form, checked with the raw form of the same key: same key id.
    manifest, kid = load_signed_manifest(m, tmp_path / "a.sig", tmp_path / "raw.pub")
    assert kid == load_signed_manifest(m, tmp_path / "a.sig", tmp_path / "ssh.pub")[1]
    assert manifest.files == Manifest.load(m).files
    # A base64 text signature (e.g. pasted into a ticket) is accepted too.
    (tmp_path / "b64.sig").write_text(base64.b64encode((tmp_path / "a.sig").read_bytes()).decode() + "\n")
    load_signed_manifest(m, tmp_path / "b64.sig", tmp_path / "raw.pub")

    enc = tmp_path / "enc.key"
    enc.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(b"correct horse")))
    monkeypatch.delenv("K3CKPT_KEY_PASSPHRASE", raising=False)
    with pytest.raises(KeyFileError, match="K3CKPT_KEY_PASSPHRASE"):
        load_private_key(enc)
    monkeypatch.setenv("K3CKPT_KEY_PASSPHRASE", "wrong")
    with pytest.raises(KeyFileError, match="wrong passphrase"):
        load_private_key(enc)
    monkeypatch.setenv("K3CKPT_KEY_PASSPHRASE", "correct horse")
    assert load_private_key(enc).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw) == forms["raw"][1]


def test_the_manifest_used_is_the_one_whose_bytes_were_checked(signed, monkeypatch: pytest.MonkeyPatch) -> None:
    """Swapping the file between the signature check and its use changes nothing: the manifest
    returned is parsed from the very bytes whose signature verified (read once)."""
    import k3ckpt.integrity.signing as signing

    m, sig, pub = signed
    original = Manifest.load(m).fingerprint()
    other = b'{"format": "k3ckpt-manifest", "version": 1, "files": {}, "tensors": {}}'
    checked = signing.verify_bytes

    def verify_then_swap(*args, **kwargs):
        kid = checked(*args, **kwargs)
        m.write_bytes(other)  # an attacker replaces the manifest right after the check
        return kid

    monkeypatch.setattr(signing, "verify_bytes", verify_then_swap)
    manifest, _ = load_signed_manifest(m, sig, pub)
    assert manifest.fingerprint() == original != Manifest.load(m).fingerprint()
    monkeypatch.undo()
    with pytest.raises(SignatureError):  # and the swapped file itself does not verify
        load_signed_manifest(m, sig, pub)


def test_build_and_sign_in_one_step(k3_tiny: Path, tmp_path: Path) -> None:
    key = tmp_path / "k"
    generate_key(key)
    out = tmp_path / "m.json"
    res = run("manifest", "build", str(k3_tiny), "-o", str(out), "--sign", str(key), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["signature"] == f"{out}.sig"
    load_signed_manifest(out, f"{out}.sig", f"{key}.pub")
    # A bad key is refused before the checkpoint is hashed, and no manifest is written.
    out2 = tmp_path / "m2.json"
    bad = tmp_path / "bad.key"
    bad.write_text("nope")
    one_line_error(run("manifest", "build", str(k3_tiny), "-o", str(out2), "--sign", str(bad)), 2, "bad.key")
    assert not out2.exists()


@needs_openssl
def test_openssl_signs_k3ckpt_verifies(manifest_file: Path, k3_tiny: Path, tmp_path: Path) -> None:
    key, pub, sig = tmp_path / "o.key", tmp_path / "o.pub", tmp_path / "o.sig"
    subprocess.run([OPENSSL, "genpkey", "-algorithm", "ed25519", "-out", str(key)], check=True, capture_output=True)
    subprocess.run([OPENSSL, "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True, capture_output=True)
    subprocess.run([OPENSSL, "pkeyutl", "-sign", "-rawin", "-inkey", str(key), "-in", str(manifest_file),
                    "-out", str(sig)], check=True, capture_output=True)
    res = run("verify", str(k3_tiny), "--manifest", str(manifest_file), "--signature", str(sig), "--pubkey", str(pub),
              "--no-cache")
    assert res.exit_code == 0, res.output
    # And k3ckpt signs with the openssl-made key.
    res = run("manifest", "sign", str(manifest_file), "--key", str(key), "-o", str(tmp_path / "k.sig"))
    assert res.exit_code == 0, res.output
    assert (tmp_path / "k.sig").read_bytes() == sig.read_bytes()  # ed25519 is deterministic


@needs_openssl
def test_k3ckpt_signs_openssl_verifies(signed, tmp_path: Path) -> None:
    m, sig, pub = signed
    ok = subprocess.run([OPENSSL, "pkeyutl", "-verify", "-rawin", "-pubin", "-inkey", str(pub), "-in", str(m),
                         "-sigfile", str(sig)], capture_output=True, text=True)
    assert ok.returncode == 0 and "Signature Verified Successfully" in ok.stdout, ok.stdout + ok.stderr
    m.write_bytes(m.read_bytes().replace(b'"version": 1', b'"version": 2'))
    bad = subprocess.run([OPENSSL, "pkeyutl", "-verify", "-rawin", "-pubin", "-inkey", str(pub), "-in", str(m),
                          "-sigfile", str(sig)], capture_output=True, text=True)
    assert bad.returncode != 0


def test_signature_file_is_written_atomically(manifest_file: Path, tmp_path: Path) -> None:
    key = tmp_path / "k"
    generate_key(key)
    m = tmp_path / "m.json"
    shutil.copy(manifest_file, m)
    sigpath = tmp_path / "m.json.sig"
    sigpath.write_bytes(bytes(64))  # an earlier signature: replaced
    sign_file(m, key)
    assert len(sigpath.read_bytes()) == 64 and sigpath.read_bytes() != bytes(64)
    assert sorted(os.listdir(tmp_path)) == ["k", "k.pub", "m.json", "m.json.sig"]  # no temp files left


def test_sign_and_keygen_replace_only_their_own_kind_of_file(manifest_file: Path, tmp_path: Path) -> None:
    """A signature path or key path naming another file (the manifest itself, a document) is
    refused, --force included for keygen; a key pair keygen wrote is replaced with --force."""
    from k3ckpt.errors import OutputNotOwnedError

    key = tmp_path / "k"
    generate_key(key)
    generate_key(key, force=True)  # its own kind: replaced
    m = tmp_path / "m.json"
    shutil.copy(manifest_file, m)
    with pytest.raises(OutputNotOwnedError, match=f"{m}: exists and is not a signature k3ckpt wrote"):
        sign_file(m, key, m)
    assert m.read_bytes() == manifest_file.read_bytes()
    doc = tmp_path / "notes.txt"
    doc.write_text("mine")
    with pytest.raises(OutputNotOwnedError, match="is not a PEM private key k3ckpt wrote"):
        generate_key(doc, tmp_path / "fresh.pub", force=True)
    assert doc.read_text() == "mine" and not (tmp_path / "fresh.pub").exists()
