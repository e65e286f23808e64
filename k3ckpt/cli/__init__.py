"""The ``k3ckpt`` command line: a thin click layer over the library.

Conventions: quiet success, one-line precise failure on stderr, ``--json`` for machines.
Exit codes: 0 ok, 1 problems found, 2 could not run.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any, Callable

import click

from .. import __version__
from ..errors import EXIT_CANNOT_RUN, EXIT_PROBLEMS, K3ckptError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into one line on stderr and the right exit code; ``--debug`` re-raises."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = bool(click.get_current_context().find_root().params.get("debug"))
        try:
            return fn(*args, **kwargs)
        except K3ckptError as e:
            if debug:
                raise
            click.echo(f"k3ckpt: error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("k3ckpt: interrupted", err=True)
            sys.exit(130)
        except OSError as e:
            if debug:
                raise
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"k3ckpt: error: {where}{e.strerror or e}", err=True)
            sys.exit(EXIT_CANNOT_RUN)

    return wrapper


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="k3ckpt")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def main(debug: bool) -> None:
    """k3ckpt: fetch, verify, inspect, reshard and preflight Kimi K3-class MoE checkpoints.

    \b
    Examples:
      k3ckpt synth work/k3-small --preset k3-small
      k3ckpt inspect work/k3-small
      k3ckpt inspect work/k3-small --layers --json
    """


# -- inspect -----------------------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path(file_okay=False, path_type=str))
@click.option("--layers", "show_layers", is_flag=True, help="Add a per-layer table.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--jobs", type=click.IntRange(1), default=None, help="Processes reading headers [default: CPU count].")
@handle_errors
def inspect(path: str, show_layers: bool, as_json: bool, jobs: int | None) -> None:
    """Describe a checkpoint from its config and shard headers (no tensor data is read).

    PATH is a checkpoint directory (as `hf download --local-dir` leaves it), a Hugging Face
    cache snapshot, or a `models--org--name` cache folder. Exits 1 when the config, the index
    and the tensors disagree. A node's partial copy (with the k3ckpt-node.json or
    k3ckpt-partial.json that reshard --format hf-node and fetch --ranks write) must hold the
    experts its marker lists.

    \b
    Examples:
      k3ckpt inspect ./Kimi-K3
      k3ckpt inspect ~/.cache/huggingface/hub/models--moonshotai--Kimi-K3 --layers
      k3ckpt inspect ./Kimi-K3 --json | jq .params_active
    """
    from ..format.checkpoint import open_checkpoint
    from ..format.layout import read_node_marker
    from ..format.inspect import inspect_checkpoint, render_text

    t0 = time.perf_counter()
    ckpt = open_checkpoint(path, jobs=jobs)
    # a node's copy (reshard --format hf-node, fetch --ranks/--node) holds only the experts its
    # marker lists: those are the ones each MoE layer must have
    marker = read_node_marker(ckpt.root)
    rep = inspect_checkpoint(ckpt, experts=marker["experts"] if marker is not None else None)
    elapsed = time.perf_counter() - t0
    if as_json:
        d = rep.to_json(layers=show_layers)
        d["elapsed_seconds"] = round(elapsed, 3)
        _emit_json(d)
    else:
        click.echo(render_text(rep, show_layers=show_layers))
    if rep.errors:
        sys.exit(EXIT_PROBLEMS)


# -- synth -------------------------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@click.argument("dest", type=click.Path(path_type=str))
@click.option("--preset", default="k3-tiny", show_default=True,
              type=click.Choice(["k3-tiny", "k3-small", "k3-full", "gptoss-tiny", "k2-tiny"]),
              help="Starting shape; the options below override it.")
@click.option("--layers", "num_layers", type=click.IntRange(1), help="Number of layers.")
@click.option("--experts", "num_experts", type=click.IntRange(1), help="Routed experts per MoE layer.")
@click.option("--active", "experts_per_token", type=click.IntRange(1), help="Experts per token.")
@click.option("--hidden", "hidden_size", type=click.IntRange(32), help="Hidden size.")
@click.option("--moe-intermediate", "moe_intermediate_size", type=click.IntRange(32), help="Expert intermediate size (multiple of 32).")
@click.option("--expert-hidden", "routed_expert_hidden_size", type=click.IntRange(0), help="Latent expert width (0: hidden size).")
@click.option("--vocab", "vocab_size", type=click.IntRange(1), help="Vocabulary size.")
@click.option("--shards", "num_shards", type=click.IntRange(0), help="Shard count (0: one per layer, K3 style).")
@click.option("--seed", type=int, help="Seed; the same seed gives byte-identical output.")
@click.option("--headers-only", is_flag=True, default=None,
              help="Real headers, data as sparse holes (what k3-full does): full-size inventories at no disk cost.")
@click.option("--jobs", type=click.IntRange(1), default=None, help="Shards written in parallel [default: CPU count].")
@click.option("--force", is_flag=True, help="Write into a non-empty directory.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
@handle_errors
def synth(dest: str, preset: str, jobs: int | None, force: bool, as_json: bool, **overrides: Any) -> None:
    """Write a deterministic synthetic checkpoint shaped like Kimi K3 (or gpt-oss, Kimi-K2 FP8).

    Real config structure, tensor names, dtypes and shard naming; MXFP4 experts quantized from
    seeded random weights with the OCP MX rule; each expert's six tensors adjacent in one shard.

    \b
    Presets:
      k3-tiny      a few MB, for unit tests
      k3-small     about 1 GB, for benchmarks and the demo
      k3-full      the real K3 inventory (93 layers, 896 experts, 96 shards, ~497k tensors,
                   ~1.56 TB apparent) with --headers-only: sparse files, ~130 MB on disk
      gptoss-tiny  gpt-oss layout (stacked MXFP4 experts, zero-based shard names)
      k2-tiny      Kimi-K2 / DeepSeek-V3 layout (per-expert block FP8)

    \b
    Examples:
      k3ckpt synth work/k3-tiny
      k3ckpt synth work/k3-small --preset k3-small
      k3ckpt synth work/k3-full --preset k3-full --headers-only
      k3ckpt synth work/wide --preset k3-tiny --experts 64 --layers 8 --seed 7
    """
    from ..utils import human_bytes
    from ..testing.synth import spec_from_preset, synthesize

    spec = spec_from_preset(preset, **overrides)
    res = synthesize(spec, dest, jobs=jobs or os.cpu_count() or 1, force=force)
    if as_json:
        _emit_json(res.to_json())
    else:
        click.echo(f"wrote {res.path}: {res.shards} shards, {res.tensors:,} tensors, "
                   f"{human_bytes(res.total_bytes)}{' (sparse, headers only)' if spec.headers_only else ''}")


# -- progress ----------------------------------------------------------------------------------


class ByteProgress:
    """A tqdm bar for bytes (rate, ETA) on an interactive stderr; silent otherwise or with --json.

    Callable from several hashing threads at once."""

    def __init__(self, enabled: bool, desc: str) -> None:
        import threading

        self._bar = None
        self._lock = threading.Lock()
        self._enabled = enabled and sys.stderr.isatty()
        self._desc = desc

    def plan(self, total: int) -> None:
        if self._enabled and total:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000,
                             desc=self._desc, file=sys.stderr, leave=False, dynamic_ncols=True)

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- manifest ----------------------------------------------------------------------------------


@main.group(context_settings=CONTEXT)
def manifest() -> None:
    """Build, pull, diff and sign manifests: what a checkpoint is, file by file and tensor by tensor.

    \b
    Examples:
      k3ckpt manifest build ./Kimi-K3 -o manifests/kimi-k3.json --tensor-hashes
      k3ckpt manifest pull --source hf --repo moonshotai/Kimi-K3 -o kimi-k3.json
      k3ckpt manifest diff old.json new.json
      k3ckpt manifest keygen release.key && k3ckpt manifest sign kimi-k3.json --key release.key
    """


@manifest.command("build", context_settings=CONTEXT)
@click.argument("path", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="Where to write the manifest (JSON).")
@click.option("--tensor-hashes", is_flag=True,
              help="Also a sha256 per tensor, computed in the same read as the file hashes.")
@click.option("--jobs", type=click.IntRange(1), default=None, help="Files hashed in parallel [default: CPU count].")
@click.option("--sign", "sign_key", type=click.Path(dir_okay=False, path_type=str),
              help="Also sign the manifest with this ed25519 private key (writes OUTPUT.sig).")
@click.option("--json", "as_json", is_flag=True, help="Print a summary as JSON.")
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
        _emit_json({"output": output, "files": len(m.files), "tensors": len(m.tensors),
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
@click.option("--source", "hub", required=True, type=click.Choice(["hf", "modelscope"]), help="Which hub.")
@click.option("--repo", required=True, help="Repository id, e.g. moonshotai/Kimi-K3.")
@click.option("--revision", help="Branch, tag or commit [default: main]; the manifest records the resolved commit.")
@click.option("--endpoint", help="Hub endpoint [default: HF_ENDPOINT / MODELSCOPE_ENDPOINT, else the public hub].")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="Where to write the manifest (JSON).")
@click.option("--jobs", type=click.IntRange(1), default=8, show_default=True, help="Concurrent header requests.")
@click.option("--sign", "sign_key", type=click.Path(dir_okay=False, path_type=str),
              help="Also sign the manifest with this ed25519 private key (writes OUTPUT.sig).")
@click.option("--json", "as_json", is_flag=True, help="Print a summary as JSON.")
@handle_errors
def manifest_pull(hub: str, repo: str, revision: str | None, endpoint: str | None, output: str, jobs: int,
                  sign_key: str | None, as_json: bool) -> None:
    """Build a manifest from hub metadata alone, before downloading anything.

    Sizes and sha256 come from the hub API; each shard's safetensors header is fetched with
    HTTP Range requests (length first, then the header), so a 1.56 TB checkpoint costs about
    60 MB of traffic. Use it to plan, and to pin what a fleet verifies against.

    \b
    Examples:
      k3ckpt manifest pull --source hf --repo moonshotai/Kimi-K3 -o kimi-k3.json
      k3ckpt manifest pull --source modelscope --repo moonshotai/Kimi-K3 --revision master -o ms.json
    """
    from ..hub.pull import pull_manifest

    if sign_key:
        _check_signing_key(sign_key)
    m = pull_manifest(hub, repo, revision, endpoint=endpoint, jobs=jobs)
    m.save(output)
    signed = _sign_output(output, sign_key)
    if as_json:
        _emit_json({"output": output, "files": len(m.files), "tensors": len(m.tensors),
                    "bytes": m.total_bytes, "source": m.source, **signed})


@manifest.command("diff", context_settings=CONTEXT)
@click.argument("a", type=click.Path(dir_okay=False, path_type=str))
@click.argument("b", type=click.Path(dir_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
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
        _emit_json([c.__dict__ for c in changes])
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
@click.option("--json", "as_json", is_flag=True, help="Print the key id and paths as JSON.")
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
        _emit_json({"private_key": key, "public_key": pub, "key_id": kid})
    else:
        click.echo(f"{kid}: private key {key}, public key {pub}")


@manifest.command("sign", context_settings=CONTEXT)
@click.argument("file", type=click.Path(dir_okay=False, path_type=str))
@click.option("--key", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="ed25519 private key (PEM, OpenSSH or raw 32 bytes; passphrase in $K3CKPT_KEY_PASSPHRASE).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=str),
              help="Where to write the signature [default: FILE.sig].")
@click.option("--json", "as_json", is_flag=True, help="Print what was signed as JSON.")
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
        _emit_json(res.to_json())


# -- verify ------------------------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path(file_okay=False, path_type=str))
@click.option("--manifest", "manifest_path", type=click.Path(dir_okay=False, path_type=str),
              help="Verify against this manifest (sizes, sha256, tensor hashes when it has them).")
@click.option("--signature", "signature_path", type=click.Path(dir_okay=False, path_type=str),
              help="Require this ed25519 signature over the --manifest (needs --pubkey).")
@click.option("--pubkey", "pubkey_path", type=click.Path(dir_okay=False, path_type=str),
              help="The public key the --signature must verify with (PEM, OpenSSH or raw).")
@click.option("--against", type=click.Choice(["hf", "modelscope"]), help="Verify against a hub's listing.")
@click.option("--repo", help="Repository id for --against, e.g. moonshotai/Kimi-K3.")
@click.option("--revision", help="Revision for --against [default: the repo's main, resolved].")
@click.option("--endpoint", help="Hub endpoint for --against [default: HF_ENDPOINT / MODELSCOPE_ENDPOINT].")
@click.option("--quick", is_flag=True, help="Sizes and structure only, trusting digests from the stat cache.")
@click.option("--no-scan", is_flag=True, help="Skip the NaN scale-byte scan.")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the stat cache.")
@click.option("--jobs", type=click.IntRange(1), default=None, help="Files hashed in parallel [default: CPU count].")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def verify(path: str, manifest_path: str | None, signature_path: str | None, pubkey_path: str | None,
           against: str | None, repo: str | None, revision: str | None, endpoint: str | None, quick: bool,
           no_scan: bool, no_cache: bool, jobs: int | None, as_json: bool) -> None:
    """Prove a checkpoint intact, or say exactly what is wrong (exit 1).

    Always checks structure: every shard header, index vs headers, paths, config vs tensors,
    MXFP4 pairs, NaN scale bytes. With --manifest or --against it also checks the set of files,
    their sizes and sha256 (and with tensor hashes, which tensors differ). --quick re-verifies
    an unchanged directory in seconds from the stat cache a full run leaves behind. With
    --signature and --pubkey the manifest must carry that key's signature: a bad one exits 1
    before anything is hashed.

    \b
    Examples:
      k3ckpt verify ./Kimi-K3 --manifest manifests/kimi-k3.json
      k3ckpt verify ./Kimi-K3 --manifest kimi-k3.json --signature kimi-k3.json.sig --pubkey release.pub
      k3ckpt verify ./Kimi-K3 --against hf --repo moonshotai/Kimi-K3 --revision f831ab66
      k3ckpt verify ./Kimi-K3 --manifest kimi-k3.json --quick
      k3ckpt verify ./Kimi-K3 --json | jq .issues
    """
    from ..integrity.verify import Expected, verify_checkpoint

    if manifest_path and against:
        raise click.UsageError("use --manifest or --against, not both")
    if against and not repo:
        raise click.UsageError("--against needs --repo")
    if bool(signature_path) != bool(pubkey_path):
        raise click.UsageError("--signature and --pubkey go together")
    if signature_path and not manifest_path:
        raise click.UsageError("--signature checks a --manifest; give one")
    kwargs: dict[str, Any] = {}
    if manifest_path and signature_path:
        from ..integrity.signing import load_signed_manifest

        signed, kid = load_signed_manifest(manifest_path, signature_path, pubkey_path)  # type: ignore[arg-type]
        kwargs.update(manifest=signed, reference=f"manifest {manifest_path}, signed by {kid}")
    elif manifest_path:
        from ..integrity.manifest import Manifest

        kwargs.update(manifest=Manifest.load(manifest_path), manifest_label=manifest_path)
    elif against:
        from ..hub.client import list_repo

        listing = list_repo(against, repo, revision, endpoint=endpoint)  # type: ignore[arg-type]
        kwargs.update(
            expected_files={f.path: Expected(f.size, f.sha256, f.git_sha1) for f in listing.files.values()},
            reference=f"{against}:{listing.repo}@{listing.revision}",
        )
    with ByteProgress(not as_json, "verifying") as bar:
        rep = verify_checkpoint(path, quick=quick, scan=not no_scan, jobs=jobs, use_cache=not no_cache,
                                progress=bar, on_plan=bar.plan, **kwargs)
    if as_json:
        _emit_json(rep.to_json())
    else:
        click.echo(render_verify(rep))
    if not rep.ok:
        sys.exit(EXIT_PROBLEMS)


def render_verify(rep: Any) -> str:
    from ..utils import human_bytes

    rate = f" at {human_bytes(rep.bytes_hashed / rep.seconds)}/s" if rep.bytes_hashed and rep.seconds else ""
    head = (f"{'ok' if rep.ok else 'FAILED'}: {rep.root} ({rep.mode}; reference: {rep.reference}): "
            f"{rep.files} files, {rep.files_hashed} hashed ({human_bytes(rep.bytes_hashed)}{rate})")
    if rep.files_trusted:
        head += f", {len(rep.files_trusted)} trusted from the stat cache"
    if rep.files_size_only:
        head += f", {len(rep.files_size_only)} checked by size only (no cached digest)"
    if rep.structure_cached:
        head += ", structure unchanged since the last check"
    head += f", {rep.seconds:.1f} s"
    lines = [head]
    for kind, items in rep.grouped().items():
        label = "warning" if items[0].is_warning else "problem"
        lines.append(f"[{kind}] {len(items)} {label}{'s' if len(items) != 1 else ''}")
        lines += [f"  {i}" for i in items[:200]]
        if len(items) > 200:
            lines.append(f"  ... and {len(items) - 200} more (--json lists all)")
    return "\n".join(lines)


# -- fetch -------------------------------------------------------------------------------------


class ByteSize(click.ParamType):
    """Sizes like ``64MiB``, ``5GiB``, ``20GB`` or plain bytes."""

    name = "size"
    _UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
              "T": 1000**4, "TB": 1000**4, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        import re

        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = m.group(2).upper() if m else None
        if not m or unit not in self._UNITS:
            self.fail(f"{value!r} is not a size (examples: 64MiB, 5GiB, 20GB, 1048576)", param, ctx)
        n = int(float(m.group(1)) * self._UNITS[unit])
        if n <= 0:
            self.fail(f"{value!r} must be positive", param, ctx)
        return n


@main.command(context_settings=CONTEXT)
@click.option("--source", "hub", required=True, type=click.Choice(["hf", "modelscope"]), help="Which hub.")
@click.option("--repo", required=True, help="Repository id, e.g. moonshotai/Kimi-K3.")
@click.option("--revision", help="Branch, tag or commit [default: main]; the download is pinned to the resolved commit.")
@click.option("--dest", required=True, type=click.Path(file_okay=False, path_type=str), help="Local directory.")
@click.option("--include", multiple=True, help="Only files matching this glob (repeatable).")
@click.option("--exclude", multiple=True, help="Skip files matching this glob (repeatable).")
@click.option("--workers", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Concurrent requests (files and chunks of large files).")
@click.option("--chunk-size", type=ByteSize(), default="64MiB", show_default=True,
              help="Large files are fetched in chunks of this size, in parallel.")
@click.option("--endpoint", help="Hub endpoint [default: HF_ENDPOINT / MODELSCOPE_ENDPOINT, else the public hub].")
@click.option("--ep", type=click.IntRange(1), help="Rank-aware: expert-parallel degree.")
@click.option("--tp", type=click.IntRange(1), help="Rank-aware: tensor-parallel degree of dense weights.")
@click.option("--world-size", type=click.IntRange(1), help="Rank-aware: ranks in all [default: max(ep, tp)].")
@click.option("--placement", type=click.Choice(["linear", "round_robin"]),
              help="Rank-aware: expert placement [default: linear].")
@click.option("--ranks", "ranks_spec", help="Rank-aware: fetch only what these ranks need, e.g. 0-3,8.")
@click.option("--node", type=click.IntRange(0), help="Rank-aware: fetch only what this node's ranks need.")
@click.option("--gpus-per-node", type=click.IntRange(1), help="Rank-aware: ranks per node (for --node).")
@click.option("--manifest", "manifest_path", type=click.Path(dir_okay=False, path_type=str),
              help="Rank-aware: verify every fetched tensor against this tensor-hash manifest.")
@click.option("--dry-run", is_flag=True, help="List what would be downloaded and how many bytes; download nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary.")
@click.option("-v", "--verbose", is_flag=True, help="Name every file as it completes.")
@handle_errors
def fetch(hub: str, repo: str, revision: str | None, dest: str, include: tuple[str, ...], exclude: tuple[str, ...],
          workers: int, chunk_size: int, endpoint: str | None, ep: int | None, tp: int | None, world_size: int | None,
          placement: str | None, ranks_spec: str | None, node: int | None, gpus_per_node: int | None,
          manifest_path: str | None, dry_run: bool, as_json: bool, verbose: bool) -> None:
    """Download a checkpoint from Hugging Face or ModelScope: resumable, parallel, verified.

    Metadata comes through the real client (HF_ENDPOINT, HF_TOKEN or a saved login,
    MODELSCOPE_ENDPOINT / MODELSCOPE_DOMAIN and the ModelScope token are honoured); bytes come
    through k3ckpt's own ranged downloader: several files at once, large files in parallel
    chunks written in place, a journal of finished chunks so an interrupted run resumes where
    it stopped, every file's sha256 checked before it is renamed into place. Files already
    present and verified are skipped. Exits 1 and lists every file it could not fetch.

    Rank-aware (--ranks or --node with --ep/--tp): reads every shard's header, then downloads
    only the tensors those ranks need (whole tensors; the saving is the routed experts other
    ranks own), each shard rewritten with just those tensors under its own name, plus a
    matching index, the non-weight files and k3ckpt-partial.json (what was selected, written
    last). reshard and verify accept the result. The hub's sha256 covers whole files, so
    rewritten shards are verified tensor by tensor against --manifest (from `k3ckpt manifest
    build --tensor-hashes`); without it only structure and sizes are checked, and it says so.

    \b
    Examples:
      k3ckpt fetch --source hf --repo moonshotai/Kimi-K3 --dest /nvme/Kimi-K3
      k3ckpt fetch --source modelscope --repo moonshotai/Kimi-K3 --dest /nvme/Kimi-K3 --workers 16
      k3ckpt fetch --source hf --repo moonshotai/Kimi-K3 --dest ./k3 --include '*.json' --include 'tokenizer*'
      k3ckpt fetch --source hf --repo moonshotai/Kimi-K3 --dest ./k3 --dry-run
      k3ckpt fetch --source hf --repo moonshotai/Kimi-K3 --dest /nvme/k3-node0 --ep 8 --tp 2 --node 0 --gpus-per-node 4
      k3ckpt fetch --source hf --repo moonshotai/Kimi-K3 --dest ./k3-r0 --ep 8 --ranks 0 --manifest kimi-k3.json
    """
    from ..hub.fetch import plan_fetch, run_fetch
    from ..utils import human_bytes

    rank_opts = {"--ep": ep, "--tp": tp, "--world-size": world_size, "--ranks": ranks_spec, "--node": node}
    if any(v is not None for v in rank_opts.values()):
        if ranks_spec is None and node is None:
            raise click.UsageError("rank-aware fetch needs --ranks or --node (all ranks need the whole checkpoint: "
                                   "drop --ep/--tp/--world-size for a full fetch)")
        _fetch_ranks(hub, repo, revision, dest, include, exclude, workers, chunk_size, endpoint, ep or 1, tp or 1,
                     world_size, placement or "linear", ranks_spec, node, gpus_per_node, manifest_path, dry_run,
                     as_json, verbose)
        return
    for flag, given in (("--placement", placement), ("--gpus-per-node", gpus_per_node), ("--manifest", manifest_path)):
        if given is not None:
            raise click.UsageError(f"{flag} is for a rank-aware fetch: add --ranks or --node with --ep/--tp")

    plan = plan_fetch(hub, repo, dest, revision=revision, include=include, exclude=exclude, endpoint=endpoint)
    if dry_run:
        if as_json:
            _emit_json(plan.to_json())
            return
        present = set(plan.present())
        for p in plan.paths:
            note = "  (present, will be verified)" if p in present else ""
            click.echo(f"{human_bytes(plan.listing.files[p].size):>10}  {p}{note}")
        click.echo(f"would fetch {len(plan.paths)} files, {human_bytes(plan.bytes_total)} from "
                   f"{hub}:{plan.listing.repo}@{plan.listing.revision} into {plan.dest}")
        return
    with ByteProgress(not as_json, "fetching") as bar:
        res = run_fetch(plan, workers=workers, chunk_size=chunk_size, progress=bar, on_plan=bar.plan)
    if as_json:
        d = res.to_json()
        d.update(hub=hub, repo=plan.listing.repo, revision=plan.listing.revision)
        _emit_json(d)
    else:
        if verbose:
            for p in res.fetched:
                click.echo(f"fetched  {p}")
            for p in res.skipped:
                click.echo(f"verified {p} (already present)")
        rate = f" at {human_bytes(res.bytes_downloaded / res.seconds)}/s" if res.seconds and res.bytes_downloaded else ""
        click.echo(f"{'ok' if res.ok else 'FAILED'}: {hub}:{plan.listing.repo}@{plan.listing.revision} -> {plan.dest}: "
                   f"{len(res.fetched)} fetched ({human_bytes(res.bytes_downloaded)}{rate}), "
                   f"{len(res.skipped)} already present and verified, {len(res.failed)} failed")
        for p, why in sorted(res.failed.items()):
            click.echo(f"  could not fetch {p}: {why}")
        for note in res.notes:
            click.echo(f"  note: {note}", err=True)
    if not res.ok:
        sys.exit(EXIT_PROBLEMS)


def _fetch_ranks(hub: str, repo: str, revision: str | None, dest: str, include: tuple[str, ...],
                 exclude: tuple[str, ...], workers: int, chunk_size: int, endpoint: str | None, ep: int, tp: int,
                 world_size: int | None, placement: str, ranks_spec: str | None, node: int | None,
                 gpus_per_node: int | None, manifest_path: str | None, dry_run: bool, as_json: bool,
                 verbose: bool) -> None:
    """``k3ckpt fetch`` with a rank selection: see :mod:`k3ckpt.rankfetch`."""
    from ..hub.rankfetch import STRUCTURE_ONLY_NOTE, VERIFIED_STRUCTURE, plan_rank_fetch, run_rank_fetch
    from ..utils import format_ranges, human_bytes

    plan = plan_rank_fetch(hub, repo, dest, revision=revision, endpoint=endpoint, ep=ep, tp=tp, world_size=world_size,
                           placement=placement, ranks=ranks_spec, node=node, gpus_per_node=gpus_per_node,
                           manifest=manifest_path, include=include, exclude=exclude, chunk_size=chunk_size,
                           jobs=workers)
    t = plan.topology
    what = (f"rank{'s' if len(plan.ranks) > 1 else ''} {format_ranges(plan.ranks)} of ep {t.ep} x tp {t.tp} (world size {t.world_size}, "
            f"{t.placement} placement)")
    source = f"{hub}:{plan.listing.repo}@{plan.listing.revision}"
    if dry_run:
        if as_json:
            _emit_json(plan.to_json())
            return
        for sp in plan.shards:
            how = "whole" if sp.whole else f"{len(sp.names)} of {sp.source_tensors} tensors, {len(sp.pieces)} request{'s' if len(sp.pieces) != 1 else ''}"
            click.echo(f"{human_bytes(sp.download_bytes):>10} of {human_bytes(sp.source.size):>10}  {sp.path}  ({how})")
        for f in plan.files:
            click.echo(f"{human_bytes(plan.listing.files[f].size):>10}{'':14}  {f}")
        share = plan.bytes_total / plan.source_bytes if plan.source_bytes else 1.0
        click.echo(f"would fetch {human_bytes(plan.bytes_total)} of {human_bytes(plan.source_bytes)} ({share:.1%}) "
                   f"from {source} into {plan.dest} for {what}: {plan.tensors:,} tensors in {len(plan.shards)} "
                   f"shards ({sum(not s.whole for s in plan.shards)} rewritten) and {len(plan.files)} other files; "
                   f"headers read: {human_bytes(plan.header_bytes)}")
        if plan.verification == VERIFIED_STRUCTURE:
            click.echo(f"note: {STRUCTURE_ONLY_NOTE}")
        return
    with ByteProgress(not as_json, "fetching") as bar:
        res = run_rank_fetch(plan, workers=workers, progress=bar, on_plan=bar.plan)
    if as_json:
        d = res.to_json()
        d.update(hub=hub, repo=plan.listing.repo, revision=plan.listing.revision, ranks=plan.ranks,
                 topology=t.to_json(), source_bytes=plan.source_bytes)
        _emit_json(d)
    else:
        if verbose:
            for p in res.written:
                click.echo(f"wrote    {p} (selected tensors)")
            for p in res.fetched:
                click.echo(f"fetched  {p}")
            for p in res.skipped + res.files_skipped:
                click.echo(f"verified {p} (already present)")
        rate = f" at {human_bytes(res.bytes_downloaded / res.seconds)}/s" if res.seconds and res.bytes_downloaded else ""
        checked = f", {res.tensors_verified:,} tensors verified against the manifest" if plan.manifest is not None else ""
        click.echo(f"{'ok' if res.ok else 'FAILED'}: {source} -> {plan.dest}: {what}: "
                   f"{len(res.written)} shards rewritten, {len(res.fetched)} files fetched "
                   f"({human_bytes(res.bytes_downloaded)}{rate}; the selection is {human_bytes(plan.bytes_total)} of "
                   f"{human_bytes(plan.source_bytes)}), {len(res.skipped) + len(res.files_skipped)} already present"
                   f"{checked}, {len(res.failed)} failed")
        for p, why in sorted(res.failed.items()):
            click.echo(f"  could not fetch {p}: {why}")
        if res.verification == VERIFIED_STRUCTURE:
            click.echo(f"note: {STRUCTURE_ONLY_NOTE}")
    if not res.ok:
        sys.exit(EXIT_PROBLEMS)


# -- plan --------------------------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@click.argument("source", type=click.Path(exists=True, path_type=str))
@click.option("--ep", type=click.IntRange(1), default=1, show_default=True, help="Expert-parallel degree.")
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True, help="Tensor-parallel degree of dense weights.")
@click.option("--world-size", type=click.IntRange(1), help="Ranks in all [default: max(ep, tp)].")
@click.option("--placement", type=click.Choice(["linear", "round_robin"]), default="linear", show_default=True,
              help="Expert placement: vLLM's linear rule or round robin.")
@click.option("--gpus-per-node", type=click.IntRange(1), help="Group ranks into nodes of this many GPUs.")
@click.option("--kv-budget", type=ByteSize(), default="20GiB", show_default=True,
              help="KV cache (and other runtime) memory to reserve per GPU.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def plan(source: str, ep: int, tp: int, world_size: int | None, placement: str, gpus_per_node: int | None,
         kv_budget: int, as_json: bool) -> None:
    """What each rank of a TP/EP topology holds, and which accelerators fit it.

    SOURCE is a local checkpoint or a manifest (so a deployment can be planned before anything
    is downloaded: `k3ckpt manifest pull` makes one from hub metadata). Prints each rank's
    ep/tp/moe_tp rank and node, its experts, its bytes split into routed experts / TP-split
    dense / replicated, the largest rank, and the per-GPU need (weights x 1.15 + KV budget)
    against H100, H200, B200, GB300 and MI355X. Impossible topologies are refused with the
    precise reason (exit 2).

    \b
    Examples:
      k3ckpt plan ./Kimi-K3 --ep 8 --tp 2
      k3ckpt plan kimi-k3.manifest.json --ep 16 --tp 8 --world-size 16 --gpus-per-node 8
      k3ckpt plan ./Kimi-K3 --tp 8 --kv-budget 40GiB --json
    """
    from ..deploy.plan import plan_topology, render_plan

    rep = plan_topology(source, ep=ep, tp=tp, world_size=world_size, placement=placement,
                        gpus_per_node=gpus_per_node, kv_budget=kv_budget)
    if as_json:
        _emit_json(rep.to_json())
    else:
        click.echo(render_plan(rep))


# -- reshard -----------------------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@click.argument("source", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Output directory (the rank layout).")
@click.option("--ep", type=click.IntRange(1), default=1, show_default=True, help="Expert-parallel degree.")
@click.option("--tp", type=click.IntRange(1), default=1, show_default=True, help="Tensor-parallel degree of dense weights.")
@click.option("--world-size", type=click.IntRange(1), help="Ranks in all [default: max(ep, tp)].")
@click.option("--placement", type=click.Choice(["linear", "round_robin"]), default="linear", show_default=True,
              help="Expert placement: vLLM's linear rule or round robin.")
@click.option("--ranks", "ranks_spec", help="Only these ranks, e.g. 0-3,8.")
@click.option("--node", type=click.IntRange(0), help="Only the ranks of this node (needs --gpus-per-node).")
@click.option("--gpus-per-node", type=click.IntRange(1), help="Group ranks into nodes of this many GPUs.")
@click.option("--max-file-size", type=ByteSize(), default="5GiB", show_default=True,
              help="Split each rank's weights into parts of at most this size.")
@click.option("--jobs", type=click.IntRange(1), default=None, help="Output files written in parallel [default: 2 per CPU, at most 16].")
@click.option("--format", "layout", type=click.Choice(["rank", "hf-node"]), default="rank", show_default=True,
              help="rank: the per-rank layout; hf-node: per node a local-dir checkpoint with every dense "
                   "tensor whole and only the node's experts (needs --gpus-per-node).")
@click.option("--force", is_flag=True, help="Rewrite completed ranks too, and overwrite another topology in OUT.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary.")
@handle_errors
def reshard(source: str, out: str, ep: int, tp: int, world_size: int | None, placement: str, ranks_spec: str | None,
            node: int | None, gpus_per_node: int | None, max_file_size: int, jobs: int | None, layout: str,
            force: bool, as_json: bool) -> None:
    """Write a checkpoint as one directory of safetensors files per rank of a TP/EP topology.

    The layout is the rank-layout contract: OUT/topology.json, the source's non-weight files,
    and OUT/rank-NNNNN/ with model-rank-R-part-K.safetensors, rank-manifest.json (per-tensor and
    per-file sha256, computed while writing) and READY, written last. Tensors keep their source
    names and dtypes; split tensors are sliced by the TP rules. Streaming, bounded memory;
    contiguous byte runs are copied kernel-side. A rank whose READY exists and whose manifest
    matches is skipped on a re-run (--force redoes it); any other rank is rewritten from scratch.

    --format hf-node is for engines that read original checkpoints and filter experts
    themselves (vLLM --enable-ep-weight-filter, SGLang): OUT/node-NNNNN/ is a local-dir
    checkpoint (model-0000K-of-0000N.safetensors, model.safetensors.index.json, config and
    tokenizer) with every non-expert tensor whole plus the routed experts of the node's ranks,
    and k3ckpt-node.json naming them (k3ckpt verify checks exactly those), then READY.

    \b
    Examples:
      k3ckpt reshard ./Kimi-K3 -o /nvme/k3-ep8-tp2 --ep 8 --tp 2
      k3ckpt reshard ./Kimi-K3 -o /nvme/k3-ep16 --ep 16 --tp 8 --world-size 16 --node 1 --gpus-per-node 8
      k3ckpt reshard ./Kimi-K3 -o ./k3-tp8 --tp 8 --ranks 0-3 --max-file-size 2GiB --json
      k3ckpt reshard ./Kimi-K3 -o /nvme/k3-nodes --format hf-node --ep 16 --tp 8 --world-size 16 --gpus-per-node 8 --node 1
    """
    from ..deploy.reshard import plan_reshard, run_reshard
    from ..utils import human_bytes

    plan = plan_reshard(source, ep=ep, tp=tp, world_size=world_size, placement=placement, ranks=ranks_spec,
                        node=node, gpus_per_node=gpus_per_node, max_file_size=max_file_size, layout=layout)
    with ByteProgress(not as_json, "resharding") as bar:
        res = run_reshard(plan, out, jobs=jobs, force=force, progress=bar, on_plan=bar.plan)
    if as_json:
        _emit_json(res.to_json())
        return
    rate = f" at {human_bytes(res.bytes_written / res.seconds)}/s" if res.seconds and res.bytes_written else ""
    skipped = f", {len(res.skipped)} already complete (skipped)" if res.skipped else ""
    t = res.topology
    unit = "nodes" if layout == "hf-node" else "ranks"
    click.echo(f"ok: {res.out}: ep {t['ep']} x tp {t['tp']}, world size {t['world_size']}: "
               f"{len(res.written)} {unit} written ({human_bytes(res.bytes_written)}{rate}){skipped}")


# -- unshard -----------------------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@click.argument("layout", metavar="OUT", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("-o", "--output", "dest", required=True, type=click.Path(file_okay=False, path_type=str),
              help="Directory for the reassembled checkpoint.")
@click.option("--max-shard-size", type=ByteSize(), default="5GiB", show_default=True,
              help="Tensor bytes per output shard (a larger tensor gets a shard of its own).")
@click.option("--jobs", type=click.IntRange(1), default=None, help="Shards written in parallel [default: min(CPUs, 8)].")
@click.option("--force", is_flag=True, help="Replace a checkpoint already in the output directory.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary.")
@handle_errors
def unshard(layout: str, dest: str, max_shard_size: int, jobs: int | None, force: bool, as_json: bool) -> None:
    """Reassemble a standard checkpoint from a complete per-rank layout (the inverse of reshard).

    OUT is a directory written by `k3ckpt reshard`. Every rank must be complete (READY); the
    manifests must agree with topology.json and the file headers, and every tensor's parts must
    tile it - anything else is refused with a one-line error naming the rank, file or tensor.
    Split tensors are concatenated along their dim; each slice read is hashed while copied and
    must match its manifest sha256. The output is a local-dir checkpoint
    (model-0000K-of-0000N.safetensors, model.safetensors.index.json written last, and the
    layout's config, tokenizer and other non-weight files) whose tensors are byte-identical to
    the source's.

    \b
    Examples:
      k3ckpt unshard /nvme/k3-ep8-tp2 -o ./Kimi-K3-again
      k3ckpt unshard /nvme/k3-ep8-tp2 -o ./Kimi-K3-again --max-shard-size 2GiB --json
    """
    from ..utils import human_bytes
    from ..deploy.unshard import plan_unshard, run_unshard

    plan = plan_unshard(layout)
    with ByteProgress(not as_json, "unsharding") as bar:
        res = run_unshard(plan, dest, max_shard_size=max_shard_size, jobs=jobs, force=force,
                          progress=bar, on_plan=bar.plan)
    if as_json:
        _emit_json(res.to_json())
        return
    t = plan.topology
    click.echo(f"ok: {res.out}: {res.tensors} tensors ({human_bytes(res.total_size)}) in {len(res.shards)} shards, "
               f"from ep {t['ep']} x tp {t['tp']}, world size {t['world_size']}")


# -- preflight ---------------------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@click.argument("directory", type=click.Path(path_type=str))
@click.option("--rank", type=click.IntRange(0), help="Check this global rank only.")
@click.option("--node", type=click.IntRange(0), help="Check the ranks of this node (needs --gpus-per-node).")
@click.option("--gpus-per-node", type=click.IntRange(1), help="Ranks per node.")
@click.option("--ep", type=click.IntRange(1), help="Expert-parallel degree the launcher uses.")
@click.option("--tp", type=click.IntRange(1), help="Tensor-parallel degree the launcher uses.")
@click.option("--world-size", type=click.IntRange(1), help="World size the launcher uses [default: max(ep, tp)].")
@click.option("--full", is_flag=True, help="Compare every rank file's sha256 (in parallel), not just sizes.")
@click.option("--io-test", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Measure read speed (O_DIRECT where possible) for up to this long.")
@click.option("--kv-budget", type=ByteSize(), default="20GiB", show_default=True,
              help="KV cache (and other runtime) memory to reserve per GPU.")
@click.option("--min-free-disk", type=ByteSize(), default="1GiB", show_default=True,
              help="Free space the disk holding DIRECTORY must keep.")
@click.option("--no-env", is_flag=True, help="Ignore the launcher's variables (RANK, SLURM_*, ...).")
@click.option("--jobs", type=click.IntRange(1), default=None, help="Files hashed in parallel with --full [default: CPU count].")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@handle_errors
def preflight(directory: str, rank: int | None, node: int | None, gpus_per_node: int | None, ep: int | None,
              tp: int | None, world_size: int | None, full: bool, io_test: float | None, kv_budget: int,
              min_free_disk: int, no_env: bool, jobs: int | None, as_json: bool) -> None:
    """Check, in seconds, that this node can load DIRECTORY before the engine boots.

    DIRECTORY is a per-rank layout written by `k3ckpt reshard` or a plain checkpoint (a full
    download, or an hf-node copy holding only this node's experts). Checks, each PASS / WARN /
    FAIL with a reason and, for a FAIL, the command that fixes it:
    topology.json against --ep/--tp/--world-size and the launcher's variables (RANK,
    WORLD_SIZE, LOCAL_RANK, SLURM_*, torchrun's, JOB_COMPLETION_INDEX); each of this node's
    ranks READY with every file of its manifest at its size (--full: its sha256) - or, for a
    plain checkpoint, its structure and the experts this node's ranks need; free disk, host
    RAM and GPU memory (nvidia-smi / rocm-smi) against weights x 1.15 + --kv-budget; MXFP4
    support; LICENSE kind, quantization format and source revision; with --io-test, read
    speed and the predicted load time. This node's ranks: --rank, --node, else the launcher's
    variables, else all. Exits 0 when nothing FAILs, 1 when something does, 2 when it cannot
    run. Test hooks: K3CKPT_PREFLIGHT_FREE_BYTES and K3CKPT_PREFLIGHT_MEM_BYTES replace the
    measured free disk and available memory.

    \b
    Examples:
      k3ckpt preflight /nvme/k3-ep8-tp2 --node 0 --gpus-per-node 8
      k3ckpt preflight /nvme/k3-ep8-tp2 --rank 3 --ep 8 --tp 2 --full --json
      k3ckpt preflight /nvme/Kimi-K3 --ep 8 --tp 8 --node 1 --gpus-per-node 8 --io-test 10
    """
    from ..deploy.preflight import preflight as run_preflight, render_preflight

    rep = run_preflight(directory, rank=rank, node=node, gpus_per_node=gpus_per_node, ep=ep, tp=tp,
                        world_size=world_size, full=full, io_test=io_test, kv_budget=kv_budget,
                        min_free_disk=min_free_disk, use_env=not no_env, jobs=jobs)
    if as_json:
        _emit_json(rep.to_json())
    else:
        click.echo(render_preflight(rep))
    if not rep.ok:
        sys.exit(EXIT_PROBLEMS)


# -- mx ----------------------------------------------------------------------------------------


@main.group(context_settings=CONTEXT)
def mx() -> None:
    """Inspect, dequantize and quantize MXFP4 weights (E2M1 elements, one E8M0 scale per 32).

    Layouts are explicit, never guessed: compressed-tensors pairs (K3: `.weight_packed`
    [out, in/2] + `.weight_scale` [out, in/32]) and gpt-oss stacked experts (`_blocks`
    [E, out, G, 16] + `_scales` [E, out, G]). Everything works row-chunk by row-chunk.

    \b
    Examples:
      k3ckpt mx inspect ./Kimi-K3 --layer 1 --expert 0
      k3ckpt mx dequant ./Kimi-K3 --layer 1 --to bf16 -o layer1.safetensors
      k3ckpt mx quantize finetuned.safetensors -o packed.safetensors
      k3ckpt mx error finetuned.safetensors
    """


# -- mx inspect / mx error ---------------------------------------------------------------------


@mx.command("inspect", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=str))
@click.option("--tensor", help="One tensor: its dequantized name (...w1.weight), base or a stored name.")
@click.option("--layer", type=click.IntRange(0), help="Only this layer (compares its experts for outliers).")
@click.option("--expert", type=click.IntRange(0), help="Only this expert (gpt-oss: its slice of the stacked tensors).")
@click.option("--top", type=click.IntRange(0), default=3, show_default=True,
              help="Detailed charts for the K most severe flagged tensors.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=str),
              help="Also save the histograms as an image (needs the plot extra: matplotlib).")
@click.option("--jobs", type=click.IntRange(1), default=None, help="Tensors read in parallel [default: min(CPUs, 8)].")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (no charts).")
@handle_errors
def mx_inspect(path: str, tensor: str | None, layer: int | None, expert: int | None, top: int,
               plot_path: str | None, jobs: int | None, as_json: bool) -> None:
    """Statistics, code and scale-exponent histograms, and flags for MXFP4 tensors.

    PATH is a checkpoint directory or one .safetensors file. Reads row chunk by row chunk
    (bounded memory). Per tensor: stored and logical shapes; min, max, mean, std, absmax, zero
    fraction of the dequantized values (NaN/Inf counted apart); the 16 E2M1 codes; the E8M0 scale
    exponents. One tensor gets charts; several get a table, aggregate charts and charts for the
    --top most severe flagged ones. Exits 1 when anything is flagged:

    \b
      N  NaN scale byte (0xFF) - the whole block of 32 is NaN
      F  NaN/Inf dequantized values
      Z  all-zero blocks (32 codes all +-0: never made by quantizing real weights)
      E  scale-exponent outlier: mean or max exponent more than 5 robust deviations
         (1.4826 x MAD, at least 0.25 / 1.0) from the median of its layer and projection;
         needs >= 5 comparable tensors (or gpt-oss experts) in the selection

    \b
    Examples:
      k3ckpt mx inspect ./Kimi-K3 --layer 1
      k3ckpt mx inspect ./Kimi-K3 --layer 1 --expert 7
      k3ckpt mx inspect model-00002-of-000096.safetensors --top 10
      k3ckpt mx inspect ./Kimi-K3 --tensor language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight
      k3ckpt mx inspect ./gpt-oss-20b --layer 3 --plot layer3.png
      k3ckpt mx inspect ./Kimi-K3 --layer 1 --json | jq '.flags'
    """
    from ..mx.inspect import inspect_mx, plot_inspect, render_inspect, require_matplotlib

    if tensor is not None and (layer is not None or expert is not None):
        raise click.UsageError("use --tensor, or --layer/--expert, not both")
    if plot_path:
        require_matplotlib()  # fail before reading anything
    with ByteProgress(not as_json, "inspecting") as bar:
        rep = inspect_mx(path, tensor=tensor, layer=layer, expert=expert, jobs=jobs, progress=bar, on_plan=bar.plan)
    if plot_path:
        plot_inspect(rep, plot_path)
    if as_json:
        d = rep.to_json()
        if plot_path:
            d["plot"] = plot_path
        _emit_json(d)
    else:
        click.echo(render_inspect(rep, top=top))
        if plot_path:
            click.echo(f"histograms saved to {plot_path}")
    if rep.flags:
        sys.exit(EXIT_PROBLEMS)


@mx.command("error", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=str))
@click.option("--scale-mode", type=click.Choice(["floor", "ceil", "even"]), default="floor", show_default=True,
              help="Shared-exponent rule: floor is OCP MX (and K3); ceil never saturates; even rounds amax.")
@click.option("--tensor", help="Only this tensor (measured whatever its role).")
@click.option("--all", "include_all", is_flag=True,
              help="Also measure roles K3 keeps in high precision (attention, norms, router, embeddings, ...).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def mx_error(path: str, scale_mode: str, tensor: str | None, include_all: bool, as_json: bool) -> None:
    """What MXFP4 would do to float weights: round-trip quantization error per tensor.

    PATH is one .safetensors file with BF16/F16/F32 weights. Every 2-D float tensor whose last
    dimension is a multiple of 32 and whose role K3 quantizes (routed experts; also dense MLP,
    latent projections and unrecognized names) is quantized and dequantized back, row chunk by
    row chunk: relative RMS error, max abs error, fraction of saturated values (clipped to
    +-6 x scale). Exits 1 when a tensor holds NaN/Inf (MXFP4 cannot encode them).

    \b
    Examples:
      k3ckpt mx error finetuned.safetensors
      k3ckpt mx error finetuned.safetensors --scale-mode even
      k3ckpt mx error finetuned.safetensors --tensor model.layers.1.mlp.experts.0.gate_proj.weight
      k3ckpt mx error finetuned.safetensors --all --json | jq .totals
    """
    from ..mx.inspect import quantization_error, render_error

    rep = quantization_error(path, scale_mode=scale_mode, tensor=tensor, include_all=include_all)
    if as_json:
        _emit_json(rep.to_json())
    else:
        click.echo(render_error(rep))
    if rep.nonfinite:
        sys.exit(EXIT_PROBLEMS)


# -- mx dequant / mx quantize ------------------------------------------------------------------


@mx.command("dequant", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=str))
@click.option("--tensor", help="One quantized weight: its dequantized name, its base, or either stored name.")
@click.option("--layer", type=click.IntRange(0), help="Only this layer (0-based).")
@click.option("--expert", type=click.IntRange(0), help="Only this expert of --layer.")
@click.option("--to", "to", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Output dtype.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="The safetensors file to write (replaced atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
@handle_errors
def mx_dequant(path: str, tensor: str | None, layer: int | None, expert: int | None, to: str, output: str,
               as_json: bool) -> None:
    """Dequantize MXFP4 weights of a checkpoint (DIR) or one shard (FILE) into one safetensors file.

    Each quantized pair becomes one tensor: `<base>.weight` [out, in] for K3 / compressed-tensors,
    `<base>` [E, out, in] for gpt-oss stacked experts. Streams row chunk by row chunk (a whole
    MoE layer in a few hundred MB of RAM) into a temporary file that is renamed into place only
    when complete; free disk space is checked first.

    \b
    Examples:
      k3ckpt mx dequant ./Kimi-K3 --layer 1 --expert 0 --to fp32 -o l1e0.safetensors
      k3ckpt mx dequant ./Kimi-K3 --layer 1 --to bf16 -o layer1.safetensors
      k3ckpt mx dequant model-00002-of-000096.safetensors -o shard2-bf16.safetensors
      k3ckpt mx dequant ./gpt-oss --tensor model.layers.0.mlp.experts.down_proj -o down.safetensors --json
    """
    from ..mx.convert import dequantize_to_file
    from ..utils import human_bytes

    if tensor is not None and (layer is not None or expert is not None):
        raise click.UsageError("use --tensor or --layer/--expert, not both")
    if expert is not None and layer is None:
        raise click.UsageError("--expert needs --layer")
    with ByteProgress(not as_json, "dequantizing") as bar:
        res = dequantize_to_file(path, output, to=to, tensor=tensor, layer=layer, expert=expert,
                                 progress=bar, on_plan=bar.plan)
    if as_json:
        _emit_json(res.to_json())
    else:
        click.echo(f"wrote {res.output}: {len(res.tensors):,} tensors as {to}, {human_bytes(res.bytes_out)} "
                   f"from {human_bytes(res.bytes_in)} of MXFP4, {res.seconds:.1f} s")


@mx.command("quantize", context_settings=CONTEXT)
@click.argument("input_file", metavar="IN", type=click.Path(dir_okay=False, path_type=str))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="The safetensors file to write (replaced atomically).")
@click.option("--scale-mode", type=click.Choice(["floor", "ceil", "even"]), default="floor", show_default=True,
              help="Shared exponent rule: floor (OCP MX), ceil (never saturates), even (saturate only "
                   "where rounding would).")
@click.option("--all", "include_all", is_flag=True,
              help="Quantize every 2-D linear weight (in % 32 == 0), not only routed experts; "
                   "norms, embeddings and LM heads stay as they are.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
@handle_errors
def mx_quantize(input_file: str, output: str, scale_mode: str, include_all: bool, as_json: bool) -> None:
    """Quantize the BF16/F16/F32 weights of a safetensors file to MXFP4 in the K3 layout.

    Each eligible `<base>.weight` [out, in] becomes `<base>.weight_packed` [out, in/2] U8 (low
    nibble first) + `<base>.weight_scale` [out, in/32] U8 (E8M0), as compressed-tensors
    `mxfp4-pack-quantized` stores them. By default only routed-expert weights qualify (what K3
    quantizes); every other tensor is copied through unchanged. A weight with NaN/Inf is refused,
    naming it, and nothing is written.

    \b
    Examples:
      k3ckpt mx quantize finetuned.safetensors -o packed.safetensors
      k3ckpt mx quantize experts-bf16.safetensors -o packed.safetensors --scale-mode even --json
      k3ckpt mx quantize small-model.safetensors -o small-mxfp4.safetensors --all
    """
    from ..mx.convert import quantize_file
    from ..utils import human_bytes

    with ByteProgress(not as_json, "quantizing") as bar:
        res = quantize_file(input_file, output, scale_mode=scale_mode, include_all=include_all,  # type: ignore[arg-type]
                            progress=bar, on_plan=bar.plan)
    if as_json:
        _emit_json(res.to_json())
    else:
        click.echo(f"wrote {res.output}: {len(res.quantized):,} tensors quantized ({scale_mode}), "
                   f"{res.copied:,} copied; {human_bytes(res.bytes_in)} -> {human_bytes(res.bytes_out)}, "
                   f"{res.seconds:.1f} s")


if __name__ == "__main__":  # pragma: no cover
    main()
