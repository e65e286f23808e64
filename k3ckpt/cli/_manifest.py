"""``k3ckpt manifest ...`` (build, pull, diff, keygen, sign) and ``k3ckpt verify``: what a checkpoint
is, and proof that a copy is it."""

from __future__ import annotations

import sys
from typing import Any

import click

from ..errors import EXIT_PROBLEMS, K3ckptError
from ._options import CONTEXT, handle_errors, jobs_option, json_option, repo_id_of, revision_option, token_option
from ._output import ByteProgress, emit_json


@click.group(context_settings=CONTEXT)
def manifest() -> None:
    """Build, pull, diff and sign manifests: what a checkpoint is, file by file and tensor by tensor.

    \b
    Examples:
      k3ckpt manifest build ./Kimi-K3 -o manifests/kimi-k3.json --tensor-hashes
      k3ckpt manifest pull moonshotai/Kimi-K3 -o kimi-k3.json
      k3ckpt manifest diff old.json new.json
      k3ckpt manifest keygen release.key && k3ckpt manifest sign kimi-k3.json --key release.key
    """


@manifest.command("build", context_settings=CONTEXT)
@click.argument("path", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="Where to write the manifest (JSON).")
@click.option("--tensor-hashes", is_flag=True,
              help="Also a sha256 per tensor, computed in the same read as the file hashes.")
@jobs_option("Files hashed in parallel [default: CPU count].")
@click.option("--sign", "sign_key", type=click.Path(dir_okay=False, path_type=str),
              help="Also sign the manifest with this ed25519 private key (writes OUTPUT.sig).")
@json_option("Print a summary as JSON.")
@handle_errors
def manifest_build(path: str, output: str, tensor_hashes: bool, jobs: int | None, sign_key: str | None,
                   as_json: bool) -> None:
    """Hash every file of a local checkpoint and write its manifest.

    Deterministic JSON (sorted keys, one file or tensor per line), so manifests can be
    committed and diffed. The source (repo, revision) is recorded when the layout tells it.

    \b
    Examples:
      k3ckpt manifest build work/k3-small -o k3-small.json
      k3ckpt manifest build ./Kimi-K3 -o kimi-k3.json --tensor-hashes --jobs 8
      k3ckpt manifest build ./Kimi-K3 -o kimi-k3.json --sign release.key
    """
    from ..format.checkpoint import open_checkpoint
    from ..integrity.manifest import build_manifest

    if sign_key:
        _check_signing_key(sign_key)  # before hours of hashing, not after
    ckpt = open_checkpoint(path, jobs=jobs)
    with ByteProgress(not as_json, "hashing") as bar:
        bar.plan(sum((ckpt.root / f).stat().st_size for f in ckpt.iter_files()))
        m = build_manifest(ckpt, tensor_hashes=tensor_hashes, jobs=jobs, progress=bar)
    m.save(output)
    signed = _sign_output(output, sign_key)
    if as_json:
        emit_json({"output": output, "files": len(m.files), "tensors": len(m.tensors),
                    "bytes": m.total_bytes, "tensor_hashes": m.tensor_hashes, "source": m.source, **signed})


def _check_signing_key(key: str) -> None:
    from ..integrity.signing import load_private_key

    load_private_key(key)


def _sign_output(output: str, key: str | None) -> dict[str, str]:
    """Sign a just-written manifest with ``--sign KEY``; the JSON fields to report."""
    if not key:
        return {}
    from ..integrity.signing import sign_file

    res = sign_file(output, key)
    return {"signature": res.signature, "key_id": res.key_id}


@manifest.command("pull", context_settings=CONTEXT)
@click.argument("repo_id", required=False, metavar="REPO_ID")
@click.option("--source", "hub", type=click.Choice(["hf", "modelscope"]), default="hf", show_default=True,
              help="Which hub.")
@click.option("--repo", "repo_option", hidden=True, help="REPO_ID (the name in 0.1, kept for a release).")
@revision_option("the manifest records the resolved commit")
@click.option("--endpoint", help="Hub endpoint [default: HF_ENDPOINT / MODELSCOPE_ENDPOINT, else the public hub].")
@token_option()
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="Where to write the manifest (JSON).")
@click.option("--tensor-hashes", is_flag=True,
              help="Also a sha256 per tensor: streams every weight file once (nothing stored), each checked "
                   "against the hub's published sha256.")
@jobs_option("Concurrent header requests (and files streamed with --tensor-hashes).", default=8)
@click.option("--sign", "sign_key", type=click.Path(dir_okay=False, path_type=str),
              help="Also sign the manifest with this ed25519 private key (writes OUTPUT.sig).")
@json_option("Print a summary as JSON.")
@handle_errors
def manifest_pull(repo_id: str | None, hub: str, repo_option: str | None, revision: str | None, endpoint: str | None,
                  token: str | None, output: str, tensor_hashes: bool, jobs: int, sign_key: str | None,
                  as_json: bool) -> None:
    """Build a manifest of the hub repository REPO_ID (e.g. moonshotai/Kimi-K3) from hub metadata
    alone, before downloading anything.

    Sizes and sha256 come from the hub API; each shard's safetensors header is fetched with
    HTTP Range requests (length first, then the header), so a 1.56 TB checkpoint costs about
    60 MB of traffic. Use it to plan, and to pin what a fleet verifies against.

    With --tensor-hashes it also hashes every tensor: each weight file is streamed once (the
    whole checkpoint's bytes cross the network, nothing is written) and must hash to the hub's
    published sha256, so the tensor hashes are those of what the hub publishes. That manifest
    verifies a node's share (k3ckpt verify NODE_DIR --manifest M), equal to `manifest build
    --tensor-hashes` of the same checkpoint but for its source.

    \b
    Examples:
      k3ckpt manifest pull moonshotai/Kimi-K3 -o kimi-k3.json
      k3ckpt manifest pull moonshotai/Kimi-K3 --source modelscope --revision master -o ms.json
      k3ckpt manifest pull moonshotai/Kimi-K3 -o kimi-k3.tensors.json --tensor-hashes
    """
    from ..hub.pull import pull_manifest

    repo = repo_id_of(repo_id, repo_option)
    if sign_key:
        _check_signing_key(sign_key)
    with ByteProgress(not as_json and tensor_hashes, "hashing") as bar:
        m = pull_manifest(hub, repo, revision, endpoint=endpoint, token=token, jobs=jobs, tensor_hashes=tensor_hashes,
                          progress=bar, on_plan=bar.plan)
    m.save(output)
    signed = _sign_output(output, sign_key)
    if as_json:
        emit_json({"output": output, "files": len(m.files), "tensors": len(m.tensors),
                    "bytes": m.total_bytes, "tensor_hashes": m.tensor_hashes, "source": m.source, **signed})


@manifest.command("diff", context_settings=CONTEXT)
@click.argument("a", type=click.Path(dir_okay=False, path_type=str))
@click.argument("b", type=click.Path(dir_okay=False, path_type=str))
@json_option()
@handle_errors
def manifest_diff(a: str, b: str, as_json: bool) -> None:
    """List what changed from manifest A to manifest B (exit 1 when anything did).

    Lines start with + (added), - (removed) or ~ (changed, with the old and new values).

    \b
    Examples:
      k3ckpt manifest diff manifests/k3-tiny.json new.json
      k3ckpt manifest diff a.json b.json --json | jq '.[] | select(.what == "tensor")'
    """
    from ..integrity.manifest import Manifest, diff_manifests

    changes = diff_manifests(Manifest.load(a), Manifest.load(b))
    if as_json:
        emit_json([c.__dict__ for c in changes])
    else:
        for c in changes:
            click.echo(str(c))
    if changes:
        sys.exit(EXIT_PROBLEMS)


@manifest.command("keygen", context_settings=CONTEXT)
@click.argument("key", type=click.Path(dir_okay=False, path_type=str))
@click.option("--public", "public_path", type=click.Path(dir_okay=False, path_type=str),
              help="Where the public key goes [default: KEY.pub].")
@click.option("--force", is_flag=True, help="Overwrite existing key files.")
@json_option("Print the key id and paths as JSON.")
@handle_errors
def manifest_keygen(key: str, public_path: str | None, force: bool, as_json: bool) -> None:
    """Make an ed25519 signing key pair: KEY (PKCS#8 PEM, mode 0600) and KEY.pub (PEM).

    Both are ordinary OpenSSL formats: `openssl pkeyutl` can sign and verify with them, and a
    key made by `openssl genpkey -algorithm ed25519` (or `ssh-keygen -t ed25519`) works here too.
    Keep KEY offline with whoever releases manifests; hand KEY.pub to the fleet.

    \b
    Examples:
      k3ckpt manifest keygen release.key
      k3ckpt manifest keygen /secure/release.key --public deploy/release.pub
    """
    from ..integrity.signing import generate_key

    pub = public_path or f"{key}.pub"
    kid = generate_key(key, pub, force=force)
    if as_json:
        emit_json({"private_key": key, "public_key": pub, "key_id": kid})
    else:
        click.echo(f"{kid}: private key {key}, public key {pub}")


@manifest.command("sign", context_settings=CONTEXT)
@click.argument("file", type=click.Path(dir_okay=False, path_type=str))
@click.option("--key", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="ed25519 private key (PEM, OpenSSH or raw 32 bytes; passphrase in $K3CKPT_KEY_PASSPHRASE).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=str),
              help="Where to write the signature [default: FILE.sig].")
@json_option("Print what was signed as JSON.")
@handle_errors
def manifest_sign(file: str, key: str, output: str | None, as_json: bool) -> None:
    """Sign a manifest: a detached ed25519 signature over its exact bytes (FILE.sig).

    The signature is the raw 64 bytes `openssl pkeyutl -sign -rawin` writes, so either tool
    can check the other's. A fleet then runs `k3ckpt verify --manifest FILE --signature
    FILE.sig --pubkey KEY.pub`, which refuses a manifest changed after signing before it hashes
    anything. Re-sign after editing the manifest.

    \b
    Examples:
      k3ckpt manifest sign kimi-k3.json --key release.key
      k3ckpt manifest sign kimi-k3.json --key ~/.ssh/id_ed25519 -o kimi-k3.json.sig --json
    """
    from ..integrity.signing import sign_file

    res = sign_file(file, key, output)
    if as_json:
        emit_json(res.to_json())


# -- verify ------------------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path(file_okay=False, path_type=str))
@click.option("--manifest", "manifest_path", type=click.Path(dir_okay=False, path_type=str),
              help="Verify against this manifest (sizes, sha256, tensor hashes when it has them).")
@click.option("--signature", "signature_path", type=click.Path(dir_okay=False, path_type=str),
              help="Require this ed25519 signature over the --manifest (needs --pubkey).")
@click.option("--pubkey", "pubkey_path", type=click.Path(dir_okay=False, path_type=str),
              help="The public key the --signature must verify with (PEM, OpenSSH or raw).")
@click.option("--against", type=click.Choice(["hf", "modelscope"]), help="Verify against a hub's listing.")
@click.option("--repo", help="Repository id for --against, e.g. moonshotai/Kimi-K3.")
@revision_option("with --against: verified against the files of the commit it resolves to")
@click.option("--endpoint", help="Hub endpoint for --against [default: HF_ENDPOINT / MODELSCOPE_ENDPOINT].")
@token_option()
@click.option("--quick", is_flag=True, help="Sizes and structure only, trusting digests from the stat cache.")
@click.option("--no-scan", is_flag=True, help="Skip the NaN scale-byte scan.")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the stat cache.")
@click.option("--require-proof", is_flag=True,
              help="Exit 1 unless every file is proven: checked against a digest of named origin (docs/trust.md).")
@jobs_option("Files hashed in parallel [default: CPU count].")
@json_option()
@handle_errors
def verify(path: str, manifest_path: str | None, signature_path: str | None, pubkey_path: str | None,
           against: str | None, repo: str | None, revision: str | None, endpoint: str | None, token: str | None,
           quick: bool,
           no_scan: bool, no_cache: bool, require_proof: bool, jobs: int | None, as_json: bool) -> None:
    """Prove a checkpoint intact, or say exactly what is wrong (exit 1).

    Always checks structure: every shard header, index vs headers, paths, config vs tensors,
    MXFP4 pairs, NaN scale bytes. With --manifest or --against it also checks the set of files,
    their sizes and sha256 (and with tensor hashes, which tensors differ). --quick re-verifies
    an unchanged directory in seconds from the stat cache a full run leaves behind. With
    --signature and --pubkey the manifest must carry that key's signature: a bad one exits 1
    before anything is hashed.

    A node directory or rank-aware copy (a share, by its k3ckpt-node.json / k3ckpt-partial.json)
    is checked by what it holds: each tensor by the manifest's tensor sha256 at the share's own
    offsets, the tensors its ranks need must be present, other nodes' experts are only counted.
    That needs a tensor-hash manifest (manifest build|pull --tensor-hashes): with one that has no
    tensor hashes it exits 2 saying so. --against on a share reads just its tensors from the hub.

    \b
    Examples:
      k3ckpt verify ./Kimi-K3 --manifest manifests/kimi-k3.json
      k3ckpt verify ./Kimi-K3 --manifest kimi-k3.json --signature kimi-k3.json.sig --pubkey release.pub
      k3ckpt verify ./Kimi-K3 --against hf --repo moonshotai/Kimi-K3 --revision f831ab66
      k3ckpt verify ./Kimi-K3 --manifest kimi-k3.json --quick
      k3ckpt verify ./Kimi-K3 --json | jq .issues
      k3ckpt verify ./node-00001 --manifest kimi-k3.tensors.json
    """
    from ..integrity.verify import Expected, render_verify, verify_checkpoint

    if manifest_path and against:
        raise click.UsageError("use --manifest or --against, not both")
    if against and not repo:
        raise click.UsageError("--against needs --repo")
    if token is not None and not against:
        raise click.UsageError("--token is for --against (the hub's listing)")
    if bool(signature_path) != bool(pubkey_path):
        raise click.UsageError("--signature and --pubkey go together")
    if signature_path and not manifest_path:
        raise click.UsageError("--signature checks a --manifest; give one")
    kwargs: dict[str, Any] = {}
    if manifest_path and signature_path and pubkey_path:  # (--signature without --pubkey was refused above)
        from ..integrity.signing import load_signed_manifest

        signed, kid = load_signed_manifest(manifest_path, signature_path, pubkey_path)
        kwargs.update(manifest=signed, reference=f"manifest {manifest_path}, signed by {kid}")
    elif manifest_path:  # loaded by verify itself, while it already hashes
        kwargs.update(manifest_path=manifest_path)
    elif against and repo and _is_share(path):  # (--against without --repo was refused above)
        from ..hub.pull import pull_share_manifest

        # rewritten shards: the present tensors' bytes, read from the hub with ranged requests
        with ByteProgress(not as_json, "reading tensors from the hub") as bar:
            pulled = pull_share_manifest(path, against, repo, revision, endpoint=endpoint, token=token, progress=bar,
                                         on_plan=bar.plan)
        kwargs.update(manifest=pulled, reference=f"{against}:{pulled.source['repo']}@{pulled.source['revision']}, "
                                                 "tensors as the hub serves them now (ranged reads)")
    elif against and repo:
        from ..hub.client import list_repo

        listing = list_repo(against, repo, revision, endpoint=endpoint, token=token)
        kwargs.update(
            expected_files={f.path: Expected(f.size, f.sha256, f.git_sha1) for f in listing.files.values()},
            reference=f"{against}:{listing.repo}@{listing.revision}",
        )
    with ByteProgress(not as_json, "verifying") as bar:
        rep = verify_checkpoint(path, quick=quick, scan=not no_scan, jobs=jobs, use_cache=not no_cache,
                                progress=bar, on_plan=bar.plan, **kwargs)
    if as_json:
        emit_json(rep.to_json())
    else:
        click.echo(render_verify(rep))
    if not rep.ok or (require_proof and not rep.proven):
        sys.exit(EXIT_PROBLEMS)


def _is_share(path: str) -> bool:
    """A node directory or a rank-aware copy (by its marker)."""
    from ..format.checkpoint import resolve_root
    from ..integrity.share import share_marker

    try:
        root, _ = resolve_root(path)
    except K3ckptError:
        return False  # verify itself says what is wrong with the path
    return share_marker(root) is not None


COMMANDS = [manifest, verify]
