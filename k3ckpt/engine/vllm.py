"""The ``k3ckpt`` load format for vLLM: a general plugin (entry point ``vllm.general_plugins``)
that registers a model loader through vLLM's public ``register_model_loader``.

The loader is vLLM's own ``DefaultModelLoader`` reading safetensors, with two checks around its
``load_weights``: once the model is built and before the first weight byte is read, the
topology guard (:func:`k3ckpt.engine.guard.check_topology`) with the parallel state of the
model's first fused-MoE layer; then every tensor the weights iterator yields is hashed as it
passes (no second read of the file) and compared with its digest before the load returns
(:class:`k3ckpt.engine.guard.TensorDigests`). With ``--enable-ep-weight-filter`` a rank reads
only its experts and the dense tensors, and verifies exactly those: the skipped ones are
excused by vLLM's own ``should_skip_weight``.

torch and vllm are imported inside functions: this module is importable (and :func:`register`
harmless) where vLLM is not installed.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Generator
from functools import cache
from pathlib import Path
from typing import Any

from ..deploy.serve import LOAD_FORMAT
from ..errors import K3ckptError
from ..format.layout import NODE_MARKER, PARTIAL_MARKER
from .guard import MANIFEST_KEY, TensorDigests, check_topology

#: The markers that make a directory k3ckpt's to check (a node directory's, a rank-aware fetch's).
MARKERS = (NODE_MARKER, PARTIAL_MARKER)


def register() -> None:
    """Register the ``k3ckpt`` load format (vLLM calls this in every process it starts)."""
    try:
        from vllm.model_executor.model_loader import register_model_loader
    except ImportError:  # installed beside another engine: nothing to register
        return
    register_model_loader(LOAD_FORMAT)(loader_class())


def tensor_bytes(tensor: Any) -> Any:
    """The bytes of a tensor as a buffer hashlib reads without a copy (a contiguous tensor's own)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


def parallel_state(model: Any) -> dict[str, Any]:
    """The engine's parallel state as the built model holds it: from its first fused-MoE layer's
    parallel config and expert map (``local_experts``: the global ids of this rank's experts;
    None for a model without one)."""
    from vllm.config import get_current_vllm_config

    pc = get_current_vllm_config().parallel_config
    state: dict[str, Any] = {"expert_parallel": bool(pc.enable_expert_parallel), "ep_size": 1, "ep_rank": 0,
                             "tp_size": pc.tensor_parallel_size, "dp_size": pc.data_parallel_size,
                             "local_experts": None}
    for module in model.modules():
        moe = getattr(module, "moe_config", None)
        if moe is None or not hasattr(module, "_expert_map"):
            continue
        mpc = moe.moe_parallel_config
        # the layer's canonical map (global id -> local slot, -1 elsewhere); None: every expert is here
        emap = module._expert_map
        local = range(moe.num_experts) if emap is None else [g for g, s in enumerate(emap.tolist()) if s >= 0]
        state.update(expert_parallel=bool(mpc.use_ep), ep_size=mpc.ep_size, ep_rank=mpc.ep_rank,
                     local_experts=list(local))
        break
    return state


def model_folder(model: str, revision: str | None) -> Path | None:
    """The directory the engine loads ``model`` from, when k3ckpt can check it: ``model`` itself
    when it is a directory; for a hub id, the Hugging Face cache snapshot of ``revision`` when it
    holds a k3ckpt marker (``fetch --ranks`` publishes a partial there under a k3ckpt revision) -
    the folder vLLM reads too, found with huggingface_hub's public cache lookup; else None (a
    plain hub checkpoint: nothing of k3ckpt's to check it against)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import try_to_load_from_cache

    for name in MARKERS:
        try:
            found = try_to_load_from_cache(model, name, revision=revision)
        except ValueError:  # not a repo id either (vLLM will say what it is)
            return None
        if isinstance(found, str):
            return Path(found).parent
    return None


def say(what: str, line: str, state: dict[str, Any]) -> None:
    """One line of the engine's log, ``k3ckpt: WHAT: LINE``; under expert parallelism it says
    which rank: ``k3ckpt: WHAT (ep rank R/N): LINE`` (the workers' stderr is not prefixed)."""
    who = f" (ep rank {state['ep_rank']}/{state['ep_size']})" if state.get("ep_size", 1) > 1 else ""
    print(f"k3ckpt: {what}{who}: {line}", file=sys.stderr, flush=True)


def refuse(error: K3ckptError, state: dict[str, Any]) -> None:
    """Say the refusal on one line of the engine's log (its traceback follows), then raise it."""
    say("refused", str(error), state)
    raise error


@cache
def loader_class() -> type:
    """The loader class, made on first use (it subclasses vLLM's ``DefaultModelLoader``)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

    class K3ckptModelLoader(DefaultModelLoader):
        """vLLM's safetensors loading, guarded: topology before the first byte, digests as read."""

        def __init__(self, load_config: Any) -> None:
            extra = dict(load_config.model_loader_extra_config or {})
            self.k3ckpt_extra = {"manifest": extra.pop("manifest", None)}
            inner = copy.copy(load_config)  # the default loader reads safetensors, its own way
            inner.load_format = "safetensors"
            inner.model_loader_extra_config = extra
            super().__init__(inner)
            self.k3ckpt_digests: TensorDigests | None = None

        def load_weights(self, model: Any, model_config: Any) -> None:
            root = model_folder(model_config.model, getattr(model_config, "revision", None))
            if root is None:  # a hub id without a k3ckpt marker in the cache: vLLM's own loading
                super().load_weights(model, model_config)
                return
            state = parallel_state(model)
            try:
                check_topology(root, **state)
                self.k3ckpt_digests = TensorDigests.for_directory(root, self.k3ckpt_extra)
            except K3ckptError as e:
                refuse(e, state)
            super().load_weights(model, model_config)
            if self.k3ckpt_digests is not None:
                ids = self.local_expert_ids  # set by the default loader's EP weight filter, None without
                try:
                    self.k3ckpt_digests.finish(skipped=lambda name: should_skip_weight(name, ids))
                except K3ckptError as e:
                    refuse(e, state)
                say("checked", f"{root}: {len(self.k3ckpt_digests.seen)} tensors read, each matches its sha256 in "
                               f"{self.k3ckpt_digests.source}", state)
            else:
                say("checked", f"{root}: the launch fits; no tensor digests to check the bytes against (give "
                               f"--model-loader-extra-config '{{\"{MANIFEST_KEY}\": \"PATH\"}}', a tensor-hash "
                               "manifest)", state)

        def get_all_weights(self, model_config: Any, model: Any) -> Generator[tuple[str, Any], None, None]:
            digests = self.k3ckpt_digests
            for name, tensor in super().get_all_weights(model_config, model):
                if digests is not None:
                    digests.update(name, tensor_bytes(tensor))
                yield name, tensor

    return K3ckptModelLoader
