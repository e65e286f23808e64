"""k3ckpt: checkpoint tooling and integrity pipeline for self-hosting Kimi K3 and models like it.

The operations a Python user calls are importable from here; the subpackages hold the rest
(:mod:`k3ckpt.format`, :mod:`k3ckpt.integrity`, :mod:`k3ckpt.hub`, :mod:`k3ckpt.mx`,
:mod:`k3ckpt.deploy`, :mod:`k3ckpt.testing`, :mod:`k3ckpt.utils`, :mod:`k3ckpt.errors`).
Names load on first use, so ``import k3ckpt`` stays cheap. Example, on a synthetic checkpoint::

    import k3ckpt

    k3ckpt.synthesize(k3ckpt.spec_from_preset("k3-tiny"), "k3-tiny")
    ckpt = k3ckpt.open_checkpoint("k3-tiny")
    print(ckpt.total_bytes, k3ckpt.inspect_checkpoint(ckpt).params_total)
    manifest = k3ckpt.build_manifest("k3-tiny", tensor_hashes=True)
    manifest.save("k3-tiny.manifest.json")
    assert k3ckpt.verify_checkpoint("k3-tiny", manifest=manifest).ok
    k3ckpt.reshard("k3-tiny", "nodes", k3ckpt.RankSelection(tp=2, dp=4, gpus_per_node=4))
    k3ckpt.reshard("k3-tiny", "ranks", k3ckpt.RankSelection(ep=8, tp=2), layout="rank")
    print(k3ckpt.preflight("ranks", k3ckpt.RankSelection(ranks=[0]), use_env=False).ok)

Every failure a user can act on is a :class:`K3ckptError` (see :mod:`k3ckpt.errors`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first attribute access, PEP 562)
_LAZY: dict[str, str] = {
    "K3ckptError": "k3ckpt.errors",
    # checkpoints
    "Checkpoint": "k3ckpt.format.checkpoint",
    "open_checkpoint": "k3ckpt.format.checkpoint",
    "inspect_checkpoint": "k3ckpt.format.inspect",
    "RankSelection": "k3ckpt.format.topology",
    # manifests and verification
    "Manifest": "k3ckpt.integrity.manifest",
    "build_manifest": "k3ckpt.integrity.manifest",
    "diff_manifests": "k3ckpt.integrity.manifest",
    "generate_key": "k3ckpt.integrity.signing",
    "load_signed_manifest": "k3ckpt.integrity.signing",
    "sign_file": "k3ckpt.integrity.signing",
    "verify_checkpoint": "k3ckpt.integrity.verify",
    # hubs
    "list_repo": "k3ckpt.hub.client",
    "plan_fetch": "k3ckpt.hub.fetch",
    "run_fetch": "k3ckpt.hub.fetch",
    "plan_rank_fetch": "k3ckpt.hub.rankfetch",
    "run_rank_fetch": "k3ckpt.hub.rankfetch",
    "pull_manifest": "k3ckpt.hub.pull",
    # deployment
    "plan_topology": "k3ckpt.deploy.plan",
    "plan_reshard": "k3ckpt.deploy.reshard",
    "run_reshard": "k3ckpt.deploy.reshard",
    "reshard": "k3ckpt.deploy.reshard",
    "plan_unshard": "k3ckpt.deploy.unshard",
    "run_unshard": "k3ckpt.deploy.unshard",
    "unshard": "k3ckpt.deploy.unshard",
    "preflight": "k3ckpt.deploy.preflight",
    "render_preflight": "k3ckpt.deploy.preflight",
    # MXFP4
    "quantize_mxfp4": "k3ckpt.mx.codec",
    "dequantize_mxfp4": "k3ckpt.mx.codec",
    "inspect_mx": "k3ckpt.mx.inspect",
    "quantization_error": "k3ckpt.mx.error",
    "quantize_file": "k3ckpt.mx.convert",
    "dequantize_to_file": "k3ckpt.mx.convert",
    # synthetic checkpoints
    "spec_from_preset": "k3ckpt.testing.synth",
    "synthesize": "k3ckpt.testing.synth",
}

__all__ = [
    "__version__",
    "Checkpoint",
    "K3ckptError",
    "Manifest",
    "RankSelection",
    "build_manifest",
    "dequantize_mxfp4",
    "dequantize_to_file",
    "diff_manifests",
    "generate_key",
    "inspect_checkpoint",
    "inspect_mx",
    "list_repo",
    "load_signed_manifest",
    "open_checkpoint",
    "plan_fetch",
    "plan_rank_fetch",
    "plan_reshard",
    "plan_topology",
    "plan_unshard",
    "preflight",
    "pull_manifest",
    "quantization_error",
    "quantize_file",
    "quantize_mxfp4",
    "render_preflight",
    "reshard",
    "run_fetch",
    "run_rank_fetch",
    "run_reshard",
    "run_unshard",
    "sign_file",
    "spec_from_preset",
    "synthesize",
    "unshard",
    "verify_checkpoint",
]

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from .deploy.plan import plan_topology
    from .deploy.preflight import preflight, render_preflight
    from .deploy.reshard import plan_reshard, reshard, run_reshard
    from .deploy.unshard import plan_unshard, run_unshard, unshard
    from .errors import K3ckptError
    from .format.checkpoint import Checkpoint, open_checkpoint
    from .format.inspect import inspect_checkpoint
    from .format.topology import RankSelection
    from .hub.client import list_repo
    from .hub.fetch import plan_fetch, run_fetch
    from .hub.pull import pull_manifest
    from .hub.rankfetch import plan_rank_fetch, run_rank_fetch
    from .integrity.manifest import Manifest, build_manifest, diff_manifests
    from .integrity.signing import generate_key, load_signed_manifest, sign_file
    from .integrity.verify import verify_checkpoint
    from .mx.codec import dequantize_mxfp4, quantize_mxfp4
    from .mx.convert import dequantize_to_file, quantize_file
    from .mx.error import quantization_error
    from .mx.inspect import inspect_mx
    from .testing.synth import spec_from_preset, synthesize


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
